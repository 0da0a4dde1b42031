"""What data and model parallelism share: the interface the trainer drives, and the end of a step
that goes through a KVStore.

A subclass builds its copies of the model and its updaters (when the workers update their own
weights). ModelParallel also builds two compiled calls, `_set_weights(values)` and
`_apply(grads)`; `_finish_step` takes the store's replies as they arrive (`arrived`) and hands
them, in key order, to the one that applies. DataParallel's exchange (tfkv.parallel.exchange)
takes them through `arrived` too.
The loss and metrics are the criterion's (`tfkv.parallel.criterion`); their running values are
kept inside the compiled step, one `tfkv.parallel.metrics.Tally` per phase, read back on request.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tfkv import optim
from tfkv.parallel.criterion import Criterion
from tfkv.parallel.metrics import Tally, assign_flat, evaluate, flat, numpy_dtype
from tfkv.store.base import KVStore
from tfkv.store.tf_updater import TFUpdater

log = logging.getLogger("tfkv")


def arrived(store: KVStore, keys: list[int], pending: list[Any]) -> tuple[list[Any], float]:
    """The replies to `pending` (pushpull_async's requests), taken as they arrive, in `keys`'
    order, and the seconds spent waiting for them."""
    t = time.perf_counter()
    values = dict(store.arrivals(pending))
    return [values[k] for k in keys], time.perf_counter() - t


class Parallel:
    store: KVStore
    keys: list[int]
    update_on_kvstore: bool
    _eval: Callable[[Any, Any], None]  # compiled: add one batch to the test tally
    _set_weights: Callable[[list[Any]], None]  # compiled: write pulled weights into every copy
    _apply: Callable[[list[Any]], None]  # compiled: update every copy with pulled summed gradients

    def __init__(self, criterion: Criterion | None) -> None:
        self.criterion = criterion or Criterion()
        self.metrics = Tally(self.criterion, forgiven=self._overflow_forgiven)  # training
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
        pulled, waited = arrived(self.store, self.keys, pending)
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

    loss_scale: Any = None  # mixed_float16's dynamic loss scale (DataParallel)

    def _overflow_forgiven(self) -> Any:
        """Traceable: whether a non-finite training loss is the loss scale's to handle (it skips
        the step and halves the scale) rather than a divergence that fails the step: while the
        scale is above 1, with something left to rescale."""
        return False if self.loss_scale is None else self.loss_scale.scale > 1.0

    def peek_metrics(self) -> dict[str, float]:
        """What `take_metrics` would give now, without resetting (for a progress line)."""
        return self.metrics.peek()[0]

    def evaluate(self, batches: Any) -> dict[str, float]:
        """{name: value} (the names `take_metrics` gives) over an iterable of (x, y) batches."""
        return evaluate(self.test_metrics, self._eval, batches)[0]

    def evaluate_split(self, share: Callable[[int, int], Any]) -> dict[str, float]:
        """`evaluate` of a whole split, `share(parts, index)` giving part `index` of `parts`
        disjoint parts of it. Each worker of a job evaluates its own part with worker 0's weights
        and the tallies are summed over the workers (store.sum_over_workers): every worker gets
        the values one process would get from `share(1, 0)`. Alone, or when a metric's state is
        not a sum (Tally.unsummable), this worker evaluates `share(1, 0)` with its own weights.
        Sets `evaluated`: (examples this worker evaluated, examples of the split)."""
        if self.store.num_workers == 1 or self._unsummable():
            values, own, total = evaluate(self.test_metrics, self._eval, share(1, 0))
        else:
            self._same_weights_everywhere()
            values, own, total = evaluate(self.test_metrics, self._eval,
                                          share(self.store.num_workers, self.store.rank), self.store.sum_over_workers)
        self.evaluated = (own, total)
        return values

    evaluated: tuple[int, int] = (0, 0)

    def _unsummable(self) -> list[str]:
        """The metrics that keep the evaluation whole on every worker (logged once); all of them
        while none exists yet (no step has run: nothing says which classes they are)."""
        tally = next((t for t in (self.metrics, self.test_metrics) if t.prepared), None)
        if tally is None:
            return ["(not built yet)"]
        names = tally.unsummable()
        if names and not self._warned_unsummable:
            self._warned_unsummable = True
            log.warning("metrics %s: not of Keras's own classes, so their state may not be a sum over examples; "
                        "every worker evaluates the whole test split and worker 0's values are reported",
                        ", ".join(names))
        return names

    _warned_unsummable = False

    def _same_weights_everywhere(self) -> None:
        """Worker 0's weights in every worker, for a split evaluation. A synchronous job's
        trainable weights are alike already; dist_async's are each worker's last pull, so every
        worker, worker 0 too, takes the servers' (once every worker's last push is applied: the
        barrier). State that gradients do not move (BatchNorm's statistics) is each worker's
        own: worker 0's goes to all, through the store's sum (the others add zeros)."""
        if not self.store.sync and self.update_on_kvstore:
            self.store.barrier()
            self.store.pull(self.keys, out=self._copies_of_keys())
        state = [copies for copies in self._copies_of_state() if np.issubdtype(numpy_dtype(copies[0]), np.floating)]
        if state:
            mine = flat([copies[0] for copies in state])
            assign_flat(state, self.store.sum_over_workers(mine if self.store.rank == 0 else np.zeros_like(mine)))

    def _copies_of_keys(self) -> list[list[Any]]:
        """Per key, its variable in every copy of the model (what a pull of every key fills)."""
        raise NotImplementedError

    def _copies_of_state(self) -> list[list[Any]]:
        """Per variable that gradients do not move, that variable in every copy of the model."""
        raise NotImplementedError

    def optimizer_states(self) -> dict[str, np.ndarray]:
        if self.update_on_kvstore:
            raise RuntimeError("the store holds the optimizer state; use store.save_optimizer_states")
        return self._updaters[0].get_states()  # every copy holds the same state

    def load_optimizer_states(self, states: dict[str, np.ndarray]) -> None:
        if self.update_on_kvstore:
            raise RuntimeError("the store holds the optimizer state; use store.load_optimizer_states")
        for u in self._updaters:
            u.set_states(states)

    def streamed_weights(self) -> list[Any]:
        """`get_weights` as a checkpoint writes them (data parallelism gives a row-sparse table
        as row pieces pulled from the store)."""
        return self.get_weights()

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
