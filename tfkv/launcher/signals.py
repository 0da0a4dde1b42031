"""How a launcher takes Ctrl-C and SIGTERM: the first one stops the job, none cuts its teardown short.

While a backend runs a job, the first SIGINT or SIGTERM (Ctrl-C, `kill`, scancel or qdel of the
launcher's own job, `timeout`) raises `Interrupted`, which the backend turns into its failure line
before tearing the job down. Every later SIGINT or SIGTERM is ignored until the launch returns: a
second Ctrl-C, or `timeout` (which signals the launcher and then its whole process group), must
not interrupt the teardown and leave roles running. `shielded()` covers a teardown that starts for
another reason (a role failed) the same way.

A job stopped this way ends with the status a shell gives a process killed by that signal,
128 + N: 130 after Ctrl-C, 143 after SIGTERM (`Stop.status`), as a single tfkv-run does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from typing import Any, Iterator

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

    @property
    def status(self) -> int | None:
        """The exit status for it: 128 + N, as a shell reports a process ended by signal N."""
        return None if self.signum is None else 128 + self.signum


@contextlib.contextmanager
def stop_once() -> Iterator[Stop]:
    """Around a backend's launch: the first SIGINT/SIGTERM raises Interrupted (and is noted in
    the Stop it yields), later ones are ignored until the block is left."""
    stop = Stop()
    if not _main_thread():
        yield stop
        return

    def first(sig: int, _frame: Any) -> None:
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        stop.signum = sig
        raise Interrupted(WHAT[signal.Signals(sig)])

    old = {s: signal.signal(s, first) for s in SIGNALS}
    try:
        yield stop
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
