"""Saving checkpoints while training goes on: the files are written on the trainer's thread, and
made durable and visible (checksums, fsync, rename: `files.publish`) on a thread of their own.

An fsync waits for the disk, which on a small model costs as much as several training steps
(and more when other jobs share the disk). Only what needs the model and the store (the
weights, the optimizer state, perhaps from the servers) is taken on the trainer's thread, so
the checkpoint is of exactly that step; one save at a time is in flight, so the next save
first waits for the previous one. A crash or `kill -9` before the rename leaves the previous
checkpoint the newest valid one, as with a save in one piece. A failure of the background
part (a full disk) is raised by the next `save` or by `wait`. Ctrl-C while a checkpoint's files
are written lets them finish and be published first (tfkv.checkpoint.interrupt), then stops.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from tfkv.checkpoint import files
from tfkv.checkpoint.interrupt import Finishing
from tfkv.preempt import GRACE

log = logging.getLogger("tfkv")


class Writer:
    """Checkpoints of one run, published in the background; `wait` before relying on the last one."""

    def __init__(self, grace: float = GRACE) -> None:
        self.grace = grace  # how long a Ctrl-C waits for the checkpoint being written
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: Path | None = None  # the newest published checkpoint

    def save(self, *args: Any, background: bool = True, **kwargs: Any) -> None:
        """`files.stage(*args, **kwargs)` now, then publish it (in the background, or before
        returning with `background=False`, or when Ctrl-C came meanwhile: then it raises
        KeyboardInterrupt once the checkpoint is in place)."""
        with Finishing(self.grace) as ctrl_c:
            self.wait()  # one in flight at a time: staging removes stale temporaries
            if ctrl_c.interrupted:  # while the previous one landed: stop there, no new one
                return
            staged = files.stage(*args, **kwargs)
            if not background or ctrl_c.interrupted:
                self.last = files.publish(staged)
                return
            self._thread = threading.Thread(target=self._publish, args=(staged,), name="tfkv-checkpoint",
                                            daemon=True)
            self._thread.start()

    def _publish(self, staged: files.Staged) -> None:
        try:
            self.last = files.publish(staged)
        except BaseException as e:  # noqa: BLE001 - raised on the trainer's thread by wait()
            self._error = e

    def wait(self) -> None:
        """Until the save in flight is published; raises its failure, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """`wait`, for a run that is ending anyway because of another error: a failure of the
        last save is logged, not raised over that error."""
        try:
            self.wait()
        except BaseException as e:  # noqa: BLE001
            log.error("the last checkpoint was not saved: %s", e)
