"""Checkpoints: the files (`files`), when to write one (`policy`, `preemption`) and which one
a `resume` setting means (`resume`). See each module; what the trainer and the entry points use is here."""

from tfkv.checkpoint.files import (CHECKPOINTS, Checkpoint, Damaged, all_in, latest, load, name, position, prune,
                                   save)
from tfkv.checkpoint.policy import Policy
from tfkv.checkpoint.preemption import Preemption, takes_sigterm
from tfkv.checkpoint.resume import AUTO, NO, YES, check_fits, find_resume, newest_valid
from tfkv.checkpoint.writer import Writer

__all__ = ["AUTO", "CHECKPOINTS", "NO", "YES", "Checkpoint", "Damaged", "Policy", "Preemption", "all_in", "check_fits",
           "find_resume", "latest", "load", "name", "newest_valid", "position", "prune", "save", "takes_sigterm", "Writer"]
