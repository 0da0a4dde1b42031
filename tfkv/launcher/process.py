"""The process groups of a job's roles, as every launcher backend handles them: a child that dies
with the process that started it, a signal to a whole group, and how a role's end is told
(`worker 1 exited with status 5`, the first failure that was not a peer's reaction to another,
or `worker 1 stopped answering` when that was a hang).
"""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Sequence

from tfkv.errors import EXIT_PEER_FAILED

GRACE = 2.0  # seconds the other roles get to notice a failure on their own before teardown


def die_with_parent(sig: int) -> None:
    """In a child (preexec_fn): receive `sig` when the parent dies (PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)
    except OSError:
        pass


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
