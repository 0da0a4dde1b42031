"""What data and model parallelism share: the interface the trainer drives, and the end of a step
that goes through a KVStore.

A subclass builds its copies of the model, its updaters (when the workers update their own
weights) and two compiled calls, `_set_weights(values)` and `_apply(grads)`; `_finish_step`
takes the store's replies as they arrive and hands them, in key order, to the one that applies.
The loss and metrics are the criterion's (`tfkv.parallel.criterion`); their running values are
kept inside the compiled step, one `tfkv.parallel.metrics.Tally` per phase, read back on request.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tfkv import optim
from tfkv.parallel.criterion import Criterion
from tfkv.parallel.metrics import Tally, evaluate
from tfkv.store.base import KVStore
from tfkv.store.tf_updater import TFUpdater


class Parallel:
    store: KVStore
    keys: list[int]
    update_on_kvstore: bool
    _eval: Callable[[Any, Any], None]  # compiled: add one batch to the test tally
    _set_weights: Callable[[list[Any]], None]  # compiled: write pulled weights into every copy
    _apply: Callable[[list[Any]], None]  # compiled: update every copy with pulled summed gradients

    def __init__(self, criterion: Criterion | None) -> None:
        self.criterion = criterion or Criterion()
        self.metrics = Tally(self.criterion)  # training
        self.test_metrics = Tally(self.criterion)  # evaluation
        self._updaters: list[TFUpdater] = []  # when the workers update: one per copy of the weights

    def _rescaled(self, optimizer: optim.Optimizer, batch: int) -> optim.Optimizer:
        """The optimizer with MXNet Module's rescale_grad unless one is set: 1 / the examples
        whose summed gradients one update applies (this worker's `batch`, times the workers when
        a synchronous store sums every worker's push before it updates)."""
        return optim.with_rescale(optimizer, batch * (self.store.num_workers if self.store.sync else 1))

    def _finish_step(self, pending: list[Any]) -> float:
        """Take the replies to `pending` (pushpull_async's requests) as they arrive, then write
        them: weights with update_on_kvstore, else summed gradients for the local updaters.
        Returns the seconds spent waiting for the replies."""
        t = time.perf_counter()
        values = dict(self.store.arrivals(pending))
        pulled = [values[k] for k in self.keys]
        waited = time.perf_counter() - t
        if self.update_on_kvstore:
            self._set_weights(pulled)
        else:
            self._apply(pulled)
        return waited

    # -- metrics, evaluation, optimizer state --------------------------------------------------

    def take_metrics(self) -> tuple[dict[str, float], int]:
        """({name: value} of the training batches since the last call, examples), and reset.
        Names: `loss` (per example: the mean over its positions, plus regularisation), each
        metric's, `<output>_loss` for dict outputs, `perplexity` for sequence labels."""
        return self.metrics.take()

    def peek_metrics(self) -> dict[str, float]:
        """What `take_metrics` would give now, without resetting (for a progress line)."""
        return self.metrics.peek()[0]

    def evaluate(self, batches: Any) -> dict[str, float]:
        """{name: value} (the names `take_metrics` gives) over an iterable of (x, y) batches."""
        return evaluate(self.test_metrics, self._eval, batches)

    def optimizer_states(self) -> dict[str, np.ndarray]:
        if self.update_on_kvstore:
            raise RuntimeError("the store holds the optimizer state; use store.save_optimizer_states")
        return self._updaters[0].get_states()  # every copy holds the same state

    def load_optimizer_states(self, states: dict[str, np.ndarray]) -> None:
        if self.update_on_kvstore:
            raise RuntimeError("the store holds the optimizer state; use store.load_optimizer_states")
        for u in self._updaters:
            u.set_states(states)

    def save_optimizer(self, path: str) -> None:
        """The optimizer state into an .npz at `path`, from wherever it lives (store or workers)."""
        if self.update_on_kvstore:
            self.store.save_optimizer_states(path)
        else:
            np.savez(path, **self.optimizer_states())

    def load_optimizer(self, states: dict[str, np.ndarray], scratch_dir: Path) -> None:
        """Put saved optimizer `states` back where this job keeps them."""
        if not self.update_on_kvstore:
            self.load_optimizer_states(states)
            return
        # The store reads a file; every worker of a job may share scratch_dir: a file of its own each.
        fd, tmp = tempfile.mkstemp(prefix=".resume-optimizer-", suffix=".npz", dir=scratch_dir)
        os.close(fd)
        try:
            np.savez(tmp, **states)
            self.store.load_optimizer_states(tmp)
        finally:
            os.unlink(tmp)
