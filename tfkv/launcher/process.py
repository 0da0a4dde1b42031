"""The process groups of a job's roles, as every launcher backend handles them: a child that dies
with the process that started it, a signal to a whole group, and how a role's end is told
(`worker 1 exited with status 5`, the first failure that was not a peer's reaction to another,
or `worker 1 stopped answering` when that was a hang).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
from typing import Sequence

from tfkv.errors import EXIT_PEER_FAILED

GRACE = 2.0  # seconds the other roles get to notice a failure on their own before teardown
# When every failure so far is a peer's reaction (EXIT_PEER_FAILED), the cause is a role still
# running: hung, or only slow to exit after reporting its own failure (TensorFlow's teardown on a
# loaded machine takes seconds). It gets this long to end before it is blamed as hung.
HANG_GRACE = 6.0
PR_SET_PDEATHSIG, PR_GET_PDEATHSIG = 1, 2

log = logging.getLogger("tfkv")


def die_with_parent(sig: int) -> None:
    """In a child (preexec_fn): receive `sig` when the parent dies (PR_SET_PDEATHSIG). Where that
    cannot be done (prctl's -1, ignored: a preexec_fn has no one to tell) the child runs without
    it: warn_without_parent_death, which probes the same call, says so in the parent."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


@functools.lru_cache(maxsize=None)
def parent_death_problem() -> str | None:
    """Why the parent-death signal cannot be set in this process's children (no glibc, a kernel
    or sandbox that refuses prctl), or None. Asked by setting it here, to the value this process
    already has (read with PR_GET_PDEATHSIG; 0, none, where that is refused too): a sandbox may
    allow reading it and refuse setting it. Children inherit what refuses it (seccomp filters,
    the kernel)."""
    try:
        value = ctypes.c_int()
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.prctl(PR_GET_PDEATHSIG, ctypes.byref(value)) != 0:
            value.value = 0
        if libc.prctl(PR_SET_PDEATHSIG, value.value) != 0:
            return os.strerror(ctypes.get_errno())
    except (OSError, AttributeError) as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def warn_without_parent_death() -> None:
    """Once per process, before it starts children that should die with it: say when they cannot."""
    problem = parent_death_problem()
    if problem:
        log.warning("tfkv: the parent-death signal (PR_SET_PDEATHSIG) cannot be set here (%s): if this process "
                    "is killed with SIGKILL, the roles it started keep running; stop them by hand", problem)


def signal_group(pid: int, sig: int) -> None:
    """`sig` to the process group led by `pid`, if it still exists."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def status_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def done_waiting(failed: list[tuple[str, int]], since: float | None, now: float) -> bool:
    """Whether a launcher has waited long enough after the first failure (seen at `since`) to
    tear the job down: GRACE once a failure names its own cause, HANG_GRACE while every failure
    is a peer's reaction, so that a role still exiting is not blamed for a hang."""
    if since is None:
        return False
    own_cause = any(code != EXIT_PEER_FAILED for _, code in failed)
    return now - since > (GRACE if own_cause else HANG_GRACE)


def first_cause(failed: list[tuple[str, int]], running: Sequence[str] = ()) -> str | None:
    """Processes that stopped because a peer failed say so with EXIT_PEER_FAILED: the cause is
    the first failure that did not. When every failure did, the cause is whatever is still
    `running` (roles that had not ended when the launcher looked): a role that hangs (stopped,
    deadlocked) lives on while the others stop because it stopped answering."""
    causes = [f for f in failed if f[1] != EXIT_PEER_FAILED]
    if causes:
        return f"{causes[0][0]} {status_text(causes[0][1])}"
    if failed and running:
        return (f"{' and '.join(running)} stopped answering (still running when the others had stopped because "
                "a peer failed)")
    return f"{failed[0][0]} {status_text(failed[0][1])}" if failed else None
