"""Ctrl-C while a checkpoint is being written: the write finishes first, within the grace a
preemption has (tfkv.preempt.GRACE), and the run stops after it as Ctrl-C stops it (status 130).

Without this, the KeyboardInterrupt lands inside the write, which removes its temporary directory:
the checkpoint the user was waiting for is lost, and the previous one is the newest. While a
checkpoint is written, the first SIGINT is only noted (with one line saying so); a second one, or
the grace running out, stops at once, without that checkpoint (the previous one stays the newest
valid one, as after a kill -9). Only the main thread sets signal handlers, and only where SIGINT
has Python's own handler (a process that handles SIGINT itself keeps its handler).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from types import TracebackType
from typing import Any

from tfkv.preempt import GRACE

log = logging.getLogger("tfkv")


class Finishing:
    """`with Finishing():` around a checkpoint's write; `interrupted` once Ctrl-C came. Leaving the
    block after one raises KeyboardInterrupt."""

    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace
        self.interrupted = False
        self._late = False
        self._old: Any = None
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Finishing:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, _signum: int, _frame: object) -> None:
        if self._late:
            log.warning("the checkpoint was not written within %.0f s of Ctrl-C; stopping without it", self.grace)
            raise KeyboardInterrupt
        if self.interrupted:  # the second Ctrl-C
            raise KeyboardInterrupt
        self.interrupted = True
        log.warning("Ctrl-C: finishing the checkpoint being written first (at most %.0f s); "
                    "Ctrl-C again stops at once, without it", self.grace)
        self._timer = threading.Timer(self.grace, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        self._late = True
        _thread.interrupt_main(signal.SIGINT)  # to _note, on the main thread

    def __exit__(self, kind: type[BaseException] | None, _e: BaseException | None, _tb: TracebackType | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        if self.interrupted and kind is None:  # written: now the Ctrl-C it waited for
            raise KeyboardInterrupt
