"""How a launcher takes Ctrl-C and SIGTERM: the first one stops the job, none cuts its teardown short.

While a backend runs a job, the first SIGINT or SIGTERM (Ctrl-C, `kill`, scancel or qdel of the
launcher's own job, `timeout`) raises `Interrupted`, which the backend turns into its failure line
before tearing the job down. Every later SIGINT or SIGTERM is ignored until the launch returns: a
second Ctrl-C, or `timeout` (which signals the launcher and then its whole process group), must
not interrupt the teardown and leave roles running. `shielded()` covers a teardown that starts for
another reason (a role failed) the same way.

A preemptible job (`stop_once(preempt=...)`: tfkv-run's jobs, not a trial of a sweep, and
tfkv-launch's) takes its first SIGTERM as a preemption instead, as a batch system means it: the
job is asked to checkpoint at its next step and end by itself (tfkv.preempt), and the wait goes
on. A second SIGTERM, a Ctrl-C, or GRACE seconds without the job's end stop it now.

A job stopped this way ends with the status a shell gives a process killed by that signal,
128 + N: 130 after Ctrl-C, 143 after SIGTERM (`Stop.status`), as a single tfkv-run does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from tfkv.preempt import GRACE

SIGNALS = (signal.SIGINT, signal.SIGTERM)
WHAT = {signal.SIGINT: "interrupted (Ctrl-C)", signal.SIGTERM: "stopped by SIGTERM"}


class Interrupted(KeyboardInterrupt):
    """The launcher was asked to stop; str() says by what."""


def failure(e: KeyboardInterrupt) -> str:
    """The job's failure line for an interrupt (a bare KeyboardInterrupt is a Ctrl-C)."""
    return str(e) if isinstance(e, Interrupted) else WHAT[signal.SIGINT]


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # only it may set handlers


@dataclass
class Stop:
    """Which signal stopped the job, if one did."""

    signum: int | None = None
    preempting: bool = False  # a SIGTERM asked the job to checkpoint and end

    @property
    def status(self) -> int | None:
        """The exit status for it: 128 + N, as a shell reports a process ended by signal N."""
        return None if self.signum is None else 128 + self.signum


@contextlib.contextmanager
def stop_once(preempt: Callable[[], None] | None = None, grace: float = GRACE) -> Iterator[Stop]:
    """Around a backend's launch: the first SIGINT/SIGTERM raises Interrupted (and is noted in
    the Stop it yields), later ones are ignored until the block is left. With `preempt`, the
    first SIGTERM calls it instead and the job goes on; a second SIGTERM or a SIGINT, or `grace`
    seconds (SIGALRM), raise Interrupted as above."""
    stop = Stop()
    if not _main_thread():
        yield stop
        return

    def now(sig: int, why: str) -> None:
        for s in (*SIGNALS, signal.SIGALRM):
            signal.signal(s, signal.SIG_IGN)
        stop.signum = sig
        raise Interrupted(why)

    def first(sig: int, _frame: Any) -> None:
        if preempt is not None and sig == signal.SIGTERM and not stop.preempting:
            stop.preempting = True
            preempt()
            signal.setitimer(signal.ITIMER_REAL, grace)
            return
        now(sig, WHAT[signal.Signals(sig)])

    def late(_sig: int, _frame: Any) -> None:
        now(signal.SIGTERM, f"stopped by SIGTERM: the job did not checkpoint and end within {grace:.0f} s")

    old = {s: signal.signal(s, first) for s in SIGNALS}
    old[signal.SIGALRM] = signal.signal(signal.SIGALRM, late)
    try:
        yield stop
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """While a Ctrl-C'd job's workers finish (tfkv.launcher.supervisor.finish_workers): the next
    SIGINT or SIGTERM raises Interrupted, to tear the job down at once (stop_once ignores them
    after its first)."""
    if not _main_thread():
        yield
        return

    def again(sig: int, _frame: Any) -> None:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(WHAT[signal.Signals(sig)])

    old = {s: signal.signal(s, again) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Around a teardown: SIGINT and SIGTERM are ignored. Every step of a teardown is bounded by
    its own timeout, so nothing is lost but the user's impatience."""
    if not _main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
