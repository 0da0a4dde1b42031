"""SIGUSR1, the signal a batch system sends ahead of a preemption or the end of a time limit
(Slurm's `--signal=USR1@<seconds>`): the run finishes its step, checkpoints and stops with
tfkv.errors.EXIT_PREEMPTED, and the same command with `resume=auto` continues it.

The handler only notes the signal: the trainer looks at the end of each step, where the weights,
optimizer state and data position agree and a checkpoint is exact.
"""

from __future__ import annotations

import signal
import threading

SIGNAL = signal.SIGUSR1


class Preemption:
    """While installed, SIGUSR1 is noted (`requested`) instead of ending the process; `restore()`
    puts the previous handler back. Only the main thread may set a handler: elsewhere, or not
    `enabled`, nothing changes."""

    def __init__(self, enabled: bool = True) -> None:
        self.signum: int | None = None
        self._old: object = None
        if enabled and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(SIGNAL, self._note)

    def _note(self, signum: int, _frame: object) -> None:
        self.signum = signum

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def restore(self) -> None:
        if self._old is not None:
            signal.signal(SIGNAL, self._old)
            self._old = None
