"""When a step ends on a checkpoint: `checkpoint.every_steps` and `checkpoint.every_minutes`
(mid-epoch), beside the one at every epoch's end that is always written."""

from __future__ import annotations

import time
from typing import Any, Callable


class Policy:
    """`due(global_step)` after each step of worker 0; `saved()` after each checkpoint."""

    def __init__(self, every_steps: int | None, every_minutes: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self.clock = clock
        self.last = clock()

    @classmethod
    def from_config(cls, node: Any) -> "Policy":
        return cls(node.every_steps, node.every_minutes)

    def due(self, global_step: int) -> bool:
        """A mid-epoch checkpoint after `global_step` (counted from 1 over the whole run)."""
        if self.every_steps and global_step % self.every_steps == 0:
            return True
        return self.every_seconds is not None and self.clock() - self.last >= self.every_seconds

    def saved(self) -> None:
        self.last = self.clock()
