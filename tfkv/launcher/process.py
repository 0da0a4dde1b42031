"""The process groups of a job's roles, as every launcher backend handles them: a child that dies
with the process that started it, a signal to a whole group, and how a role's end is told
(`worker 1 exited with status 5`). Which failure is the job's cause, and when to tear the job
down, is tfkv.launcher.supervisor's.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import re
import signal

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


# The exit statuses of a role that ended by itself on an error which the same role, started again,
# meets again: 1, Python's for an uncaught exception (a bug, a model factory that raises), 2,
# tfkv's for a mistake the user fixes (tfkv.errors.TfkvError: the config, the data, the output),
# and 0 when it is the cause: a worker whose script ended while the others still needed it
# (tfkv.launcher.supervisor.LEFT_EARLY), as it will again after a restart.
REPEATS = (0, 1, 2)
EXITED = "exited with status"
_EXITED = re.compile(rf"\b{EXITED} (\d+)\b")


def status_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"{EXITED} {code}"


def repeats(failure: str) -> bool:
    """Whether a job's failure line (its cause first, as tfkv.launcher.supervisor names it) is a
    role's own error that a restart would meet again (REPEATS), rather than something a restart
    can cure: a role killed by a signal, lost (no heartbeat, stopped answering) or preempted, a
    host down (ssh's 255, no answer)."""
    m = _EXITED.search(failure)
    return m is not None and int(m.group(1)) in REPEATS
