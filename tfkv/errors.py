"""The one error family: every exception tfkv defines derives from TfkvError.

Each is a mistake or a state the user can act on: its message is one line saying what is wrong
and how to fix it, and its class says the exit status (`exit_code`). The entry points (`tfkv-run`,
`python -m tfkv.worker`, the parameter-server roles, `tfkv-launch`) turn one into `prog: line` and
that status through `report`, in one place; anything else is a bug and keeps its traceback.
Classes that callers also catch by a standard base (a ValueError for a malformed message) keep
it as a second base. This module imports only the standard library: every layer may use it.
"""

from __future__ import annotations

import errno
import os
import sys

# Exit status of a process that stopped because another node of its job failed: launchers
# blame the first process that did not exit with it (in dist_sync, a worker that exited 0 while
# the others still needed it, when nothing else failed).
EXIT_PEER_FAILED = 3
# Exit status of a process that stopped because a node of its job went silent (no heartbeat, or
# the scheduler's answers stopped): the silent one is still running, hung, and launchers blame
# it without waiting for it to exit (a role only slow to exit reports its failure first).
EXIT_PEER_SILENT = 4
# Exit status after Ctrl-C, as a shell reports a process that SIGINT ended (128 + 2).
EXIT_INTERRUPTED = 130
# Exit status of a run that a preemption signal stopped after it checkpointed: the same command
# with resume=auto continues it (sysexits' EX_TEMPFAIL, "try again later").
EXIT_PREEMPTED = 75

# A full or read-only disk is the machine's state, not a bug: one line, like a config mistake.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class TfkvError(Exception):
    """Base of every user-facing error; exit status 2 unless a subclass says otherwise."""

    exit_code = 2


class ConfigError(TfkvError):
    """The configuration is wrong (unknown name, bad device, impossible split...)."""


class DataError(TfkvError):
    """A data set is missing or malformed on disk."""


class OutputError(TfkvError):
    """The run directory cannot be written (a full disk, a read-only file system); the message
    names the file and the system's reason."""


class ClusterFailed(TfkvError):
    """A role of a distributed job failed; the message names it. `tfkv-run` exits 2 for it, as
    for any job that fails for a reason the user fixes."""


class Preempted(TfkvError):
    """Asked to stop (SIGUSR1), the run checkpointed at the end of a step and stopped: resumable."""

    exit_code = EXIT_PREEMPTED


class Diverged(TfkvError):
    """The training loss became NaN or infinite: the run stopped, its last finite checkpoint kept."""


class TrialPruned(TfkvError):
    """A sweep's pruner stopped this trial early (worse than its peers at the same epoch): a
    result of the sweep, not a failure."""


def with_article(word: str) -> str:
    """`word` with its indefinite article, as a message names a type: "an int", "a float"."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def reacting(e: TfkvError) -> TfkvError:
    """`e`, raised because a peer left the job (a round or barrier it never joins), exits as a
    peer's reaction (EXIT_PEER_FAILED): launchers then blame that peer's own failure, if it had
    one (a worker that exits 5 after its store left), not this process."""
    e.exit_code = EXIT_PEER_FAILED
    return e


def message(e: BaseException) -> str | None:
    """The one line for an error the user fixes outside tfkv's code, or None for a bug."""
    if isinstance(e, TfkvError):
        text = str(e)
        if text.startswith("in user code:"):
            # raised while TensorFlow traced a step (a loss that does not fit the model's output):
            # TensorFlow prefixes the trace, the message is its last line, after the type's name
            last = [line.strip() for line in text.splitlines() if line.strip()][-1]
            text = last.split(": ", 1)[1] if last.startswith(f"{type(e).__name__}: ") else last
        return text
    if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
        where = f" writing {e.filename}" if e.filename else ""
        return f"{e.strerror}{where}; {unwritable(e.errno)}"
    return None


def unwritable(reason: int | str | None) -> str:
    """What to do about a write into the run directory that failed for `reason`: the errno, or
    the system's text of it as TensorFlow's errors carry it ("...; Read-only file system")."""
    def why(code: int) -> bool:
        return reason == code or (isinstance(reason, str) and os.strerror(code) in reason)

    if why(errno.ENOSPC) or why(errno.EDQUOT):
        return "free space there or choose another hydra.run.dir"
    if why(errno.EROFS) or why(errno.EACCES) or why(errno.EPERM):
        return "make it writable or choose another hydra.run.dir"
    return "check that the run directory is there and writable, or choose another hydra.run.dir"


def exit_code(e: BaseException) -> int:
    """The exit status for an error `message` gives a line for."""
    return e.exit_code if isinstance(e, TfkvError) else 2


def report(prog: str, e: BaseException) -> None:
    """An entry point's handler: a user's error is `prog: <its line>` on stderr and its exit
    status; a bug returns, for the caller to re-raise with its traceback."""
    text = message(e)
    if text is not None:
        print(f"{prog}: {text}", file=sys.stderr)
        sys.exit(exit_code(e))
