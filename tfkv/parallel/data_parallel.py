"""Data parallelism: one model copy per device, the batch split across them, gradients summed
through a KVStore, as MXNet's Module does.

Each step, device i runs forward and backward on its slice (b/k examples, or its share of
`work_load_list`); every parameter is pushed as a list of per-device gradients (the store sums
them), then pulled back into every copy. With `update_on_kvstore` the store runs the optimizer;
otherwise it only sums, and each device applies the update to its own copy.

The copies, their keys and their weights are `tfkv.parallel.replicas.Replicas`; every device's
forward and backward pass is `tfkv.parallel.backprop.Backprop`; how the gradients reach the
store and the replies the copies is an exchange (`tfkv.parallel.exchange`), chosen once here
from the store's capabilities and the config: stores whose push/pull are TensorFlow ops
(`traceable`) are traced into the step's tf.function; the parameter-server client
(`async_pushpull`) is handed each key's gradients from inside the compiled step as soon as
backprop has produced them (last layer first), and asked for them back at once; other stores,
and any store under a loss scale, get the same calls after backprop. `timings` accumulates the
seconds of each phase (compute, push, pull, assign) for benchmarks.
With one device on one machine there is nothing to sum, and, as MXNet does, the store is left
out: the device updates its weights itself, with the same rule and the same numbers.

Inputs and labels may be dicts (a model with several inputs or outputs): every tensor of x and
y is cut along its first axis, the same rows for each device. The loss and metrics are the
criterion's (`tfkv.parallel.criterion`), the model's regularisation losses included.

State that gradients do not move (BatchNorm's moving statistics) is not pushed. The copies
inside one worker each update their own on their slice, and `sync_non_trainable` (the trainer
calls it at each epoch's end, before evaluating) sets them all to their average. Across the
workers of a `dist_*` job nothing is exchanged while training: each worker keeps its own
statistics; before a split evaluation every worker takes worker 0's (`Parallel.evaluate_split`),
the ones its checkpoint and export hold.

Row-sparse tables (tfkv.parallel.sparse): every `tfkv.layers.ShardedEmbedding`, and with
`row_sparse` every `keras.layers.Embedding`, is a row-sparse key of the store (keys after the
dense ones). Its gradient leaves the compiled step as rows with their table ids and is pushed as
rows after it; the rows each batch reads are loaded into the copies before it computes, those
of the next batch (`step`'s `upcoming`) requested while this one computes. Such a model always
goes through the store (its tables live there) and needs `update_on_kvstore`. `get_weights`
gives the tables whole, gathered from the store: the weights of the model built without one;
`streamed_weights` gives each table as row pieces pulled as they are written (checkpoints).
With `evaluate_only` (eval_only) the tables of `initial_weights` (a checkpoint's, memory-mapped)
stay where they are: each batch's rows are read from them, the store never holds them.

Precision, clipping, XLA (docs/guides/precision-and-devices.md): with a `loss_scale`
(mixed_float16) the loss is scaled before backprop and the gradients unscaled after; a step
whose gradients are not all finite on any device, or, with a synchronous `dist_*` store, on any
worker (a vote through the store before anything is pushed: `KVStore.all_workers`), is skipped
everywhere and the scale halved. `clipnorm` scales this worker's gradients down so that the
global norm of their sum over its devices, divided by its examples (the gradient of its mean
loss, what Keras's global_clipnorm bounds), is at most `clipnorm`, before they are pushed.
`jit_compile` compiles each device's forward and backward pass with XLA.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfkv import optim
from tfkv.parallel import sparse
from tfkv.parallel.backprop import Backprop
from tfkv.parallel.base import Parallel
from tfkv.parallel.criterion import Criterion, regularization
from tfkv.parallel.exchange import choose
from tfkv.parallel.portable import PortableWeights
from tfkv.parallel.precision import LossScale
from tfkv.parallel.replicas import Replicas
from tfkv.parallel.xla import xla_refusal
from tfkv.store.base import KVStore


class DataParallel(PortableWeights, Parallel):
    def __init__(
        self,
        build_model: Callable[[], Any],
        devices: Sequence[str],
        store: KVStore,
        optimizer: optim.Optimizer,
        batch_sizes: Sequence[int],
        update_on_kvstore: bool = True,
        initial_weights: Sequence[np.ndarray] | None = None,
        criterion: Criterion | None = None,
        loss_scale: LossScale | None = None,
        clipnorm: float | None = None,
        jit_compile: bool = False,
        row_sparse: bool = False,
        evaluate_only: bool = False,
    ):
        """`devices` are TensorFlow device names; `batch_sizes[i]` examples go to device i;
        `criterion`: the loss and metrics (default: sparse categorical crossentropy on logits,
        accuracy); `loss_scale`, `clipnorm`, `jit_compile`, `row_sparse`, `evaluate_only`: see the module docstring.

        As in MXNet, what is pushed is the gradient of the loss summed over the examples (an
        example's loss is the mean over its positions, e.g. tokens), plus the examples' count
        times the regularisation, and the optimizer's `rescale_grad` turns the sum into a mean:
        unset, it becomes 1 / the examples of one update (every worker's for `dist_sync`), as
        MXNet's Module sets it. So k devices compute what one does, whatever the split, and
        2-bit thresholds apply to MXNet's scale.
        """
        if len(batch_sizes) != len(devices):
            raise ValueError(f"{len(batch_sizes)} batch sizes for {len(devices)} devices")
        super().__init__(criterion)
        self.store = store
        self.batch_sizes = [int(n) for n in batch_sizes]
        optimizer = self._rescaled(optimizer, sum(self.batch_sizes))
        copies = Replicas(build_model, devices, store, update_on_kvstore, row_sparse)
        self._copies = copies
        self.devices, self.replicas, self.params, self.keys = copies.devices, copies.models, copies.params, copies.keys
        self.uses_store, self.update_on_kvstore, self.sparse = copies.uses_store, copies.update_on_kvstore, copies.sparse
        self._updaters = copies.updaters
        tables = self._set_portable_weights(list(initial_weights)) if initial_weights is not None else {}
        copies.start(optimizer, tables, evaluate_only)
        self.loss_scale = loss_scale
        self.clipnorm = clipnorm
        self.jit_compile = jit_compile
        self._compiled = False
        backprop = Backprop(copies, self.batch_sizes, self.criterion, self.metrics, loss_scale, clipnorm, jit_compile)
        self._exchange = choose(copies, loss_scale)(copies, backprop, loss_scale)  # chosen once, as Keras's step
        # Seconds per phase of the non-traceable step, summed over steps (see reset_timings).
        self.timings = self._exchange.timings
        self._eval_compiled = tf.function(self._eval_step)
        self._eval = self._eval_batch

    def reset_timings(self) -> None:
        for k in self.timings:
            self.timings[k] = 0 if k == "steps" else 0.0

    # -- one training step ---------------------------------------------------------------------

    #: step() takes the next batch's x (`upcoming`): the trainer peeks it for the row prefetch
    prefetches = True

    def step(self, x: Any, y: Any, upcoming: Any = None) -> None:
        """Train on one batch (x, y) of sum(batch_sizes) examples; `upcoming`: the x of the next
        call, if known, whose table rows are requested while this batch computes."""
        with sparse.ids_refusal(self.replicas):  # an id past its table: one line, not TF's traceback
            self.metrics.prepare(y)
            if self.jit_compile and not self._compiled:
                with xla_refusal():  # the first step is where XLA compiles
                    self._exchange.step(x, y, upcoming)
                self._compiled = True
                return
            self._exchange.step(x, y, upcoming)

    # -- metrics, evaluation, state ------------------------------------------------------------

    def _eval_batch(self, x: Any, y: Any) -> None:
        with sparse.ids_refusal(self.replicas):
            (self._eval_compiled if self.sparse is None else self._eval_with_rows)(x, y)

    def _eval_with_rows(self, x: Any, y: Any) -> None:
        """Evaluate a batch whose table rows are loaded first; with a ShardedEmbedding, in pieces
        of a training batch (what its cache holds)."""
        n = int(tf.shape(tf.nest.flatten(x)[0])[0])
        size = sum(self.batch_sizes) if self.sparse.sharded else max(n, 1)
        for start in range(0, max(n, 1), size):
            xs, ys = (tf.nest.map_structure(lambda t: t[start:start + size], v) for v in (x, y))
            self.sparse.load_for(xs)
            self._eval_compiled(xs, ys)

    def _eval_step(self, x: Any, y: Any) -> None:
        model = self.replicas[0]
        with tf.device(self.devices[0]):
            pred = model(x, training=False)
            self.test_metrics.add(y, pred, self.criterion.losses(y, pred), tf.shape(tf.nest.flatten(y)[0])[0],
                                  regularization(model))

    def step_state(self) -> list[tf.Variable]:
        """Variables of the training run beyond weights and optimizer (the loss scale), which a
        checkpoint keeps so that a resumed run continues exactly."""
        return self.loss_scale.variables if self.loss_scale is not None else []

    def sync_non_trainable(self) -> None:
        """Average state that gradients do not move (BatchNorm statistics) across this worker's
        copies (not across workers: see the module docstring)."""
        self._copies.sync_state(source=None)

    def _copies_of_keys(self) -> list[list[Any]]:
        return [[p[k] for p in self.params] for k in self.keys]

    def _copies_of_state(self) -> list[list[Any]]:
        return self._copies.copies_of_state()

