"""Model parallelism: a model's layer groups on different devices, run as a pipeline.

Each layer group (`tfkv.parallel.placement.LayerGroup`) is built inside `tf.device(d)` of its
device, so its variables live there, and every op of its forward and backward pass is placed
there too; only activations (forward) and their gradients (backward) cross between devices.
There is one copy of each weight, so on one machine nothing needs summing and the update runs
on each weight's own device (as data parallelism leaves the store out with one device).

Pipelining, GPipe-style, in one tf.function: a batch is cut into `micro_batches` pieces; each
goes forward through the groups and then backward, and each group's gradients are summed over
the pieces before one update. Group s's work on piece i depends only on group s-1's work on
piece i, so TensorFlow's dataflow executor runs group s on piece i-1 while group s-1 already
works on piece i; nothing orders ops that need not be ordered. The loss is the criterion's
(`tfkv.parallel.criterion`), summed over examples (the optimizer's rescale_grad makes it a
mean, as in data parallelism), so the summed micro-batch gradients are the gradient of the
unsplit batch. Each group's regularisation losses (`model.losses`) are added once per batch,
times its examples, on the group's own device.

In a `dist_*` job each worker is model-parallel: after the compiled step every weight's gradient
is pushed and asked back at once (`pushpull_async`, as DataParallel does for stores it cannot
push to from inside the graph; here a weight's gradient is complete only once every micro-batch
is through), so the servers see a worker with one "device" per weight.

The interface is `tfkv.parallel.base.Parallel`'s, as DataParallel's is, so the trainer drives either.
"""

from __future__ import annotations

from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfkv import optim
from tfkv.config import split_batch
from tfkv.parallel.base import Parallel
from tfkv.parallel.criterion import Criterion, regularization
from tfkv.parallel.placement import LayerGroup
from tfkv.store.base import KVStore
from tfkv.store.tf_updater import TFUpdater


class ModelParallel(Parallel):
    def __init__(
        self,
        groups: Sequence[LayerGroup],
        devices: Sequence[str],
        store: KVStore,
        optimizer: optim.Optimizer,
        batch_size: int,
        micro_batches: int = 1,
        update_on_kvstore: bool = True,
        initial_weights: Sequence[np.ndarray] | None = None,
        criterion: Criterion | None = None,
    ):
        """`devices[i]` is the TensorFlow device of `groups[i]`; batches hold `batch_size` examples,
        cut into `micro_batches` pieces (sizes as `split_batch`: the remainder to the last);
        `criterion`: the loss and metrics, as DataParallel's."""
        if len(devices) != len(groups):
            raise ValueError(f"{len(devices)} devices for {len(groups)} layer groups")
        if not 1 <= micro_batches <= batch_size:
            raise ValueError(f"micro_batches={micro_batches} must be in [1, batch_size={batch_size}]")
        super().__init__(criterion)
        self.devices = list(devices)
        self.group_names = [g.name for g in groups]
        self.store = store
        self.batch_size = int(batch_size)
        self.micro_sizes = split_batch(self.batch_size, None, int(micro_batches))
        self.uses_store = store.distributed
        self.update_on_kvstore = update_on_kvstore and self.uses_store
        optimizer = self._rescaled(optimizer, self.batch_size)

        self.models = []
        for g, d in zip(groups, self.devices):
            with tf.device(d):  # variables (weights, dropout seeds) are created where they will live
                model = keras.Sequential(g.make(), name=g.name)
                model.build((None, *g.input_shape))
            self.models.append(model)
        if initial_weights is not None:
            self.set_weights(initial_weights)
        self.params = [v for m in self.models for v in m.trainable_variables]
        self.param_devices = [d for m, d in zip(self.models, self.devices) for _ in m.trainable_variables]
        self.keys = list(range(len(self.params)))

        if self.update_on_kvstore:
            store.set_optimizer(optimizer)
        else:
            self._updaters = [TFUpdater(optimizer)]  # one copy of the weights
            for k, (v, d) in enumerate(zip(self.params, self.param_devices)):
                self._updaters[0].create_state(k, v, d)  # optimizer state beside its weight
        if self.uses_store:
            # Worker 0's initial weights win everywhere (MXNet: init, then pull).
            self.store.broadcast(self.keys, list(self.params), out=[[v] for v in self.params],
                                 priority=[-k for k in self.keys])

        if self.uses_store:
            self._grads = tf.function(self._forward_backward)
            self._set_weights = tf.function(self._assign_all)
            self._apply = tf.function(self._apply_grads)
        else:
            self._step = tf.function(self._fused_step)
        self._grads_only = tf.function(lambda x, y: self._forward_backward(x, y, record=False))
        self._eval = tf.function(self._eval_step)

    # -- one training step ---------------------------------------------------------------------

    def step(self, x: Any, y: Any) -> None:
        """Train on one batch (x, y) of `batch_size` examples."""
        self.metrics.prepare(y)
        if not self.uses_store:
            self._step(x, y)
            return
        grads = self._grads(x, y)
        # Each key pushed and asked back at once, the last layer's first (backprop's order), so
        # replies stream back while later keys still go out; taken as they arrive.
        self._finish_step(self.store.pushpull_async(self.keys, [[g] for g in grads], priority=list(self.keys)))

    def gradients(self, x: Any, y: Any) -> list[np.ndarray]:
        """The summed micro-batch gradients of one batch, one per trainable variable; no update,
        no metrics (what `step` would apply)."""
        self.metrics.prepare(y)
        return [np.asarray(g) for g in self._grads_only(x, y)]

    def _forward_backward(self, x: Any, y: Any, record: bool = True) -> list[Any]:
        last = len(self.models) - 1
        pieces = len(self.micro_sizes)
        with tf.device(self.devices[0]):
            xs = _split(x, self.micro_sizes)
        with tf.device(self.devices[last]):
            ys = _split(y, self.micro_sizes)

        # Forward: one tape per (piece, group), recorded on the group's device. Piece i at group s
        # waits only for piece i at group s-1, so consecutive pieces overlap across devices.
        tapes: list[list[tuple[Any, Any, Any]]] = []
        for i in range(pieces):
            h, row = xs[i], []
            for s, (model, d) in enumerate(zip(self.models, self.devices)):
                with tf.device(d):
                    with tf.GradientTape() as tape:
                        if s > 0:
                            tape.watch(h)
                        out = model(h, training=True)
                        if s == last:
                            pred = out
                            losses = self.criterion.losses(ys[i], pred)
                            out = tf.add_n([tf.reduce_sum(v) for v in losses.values()])
                    row.append((tape, h, out))
                    if s == last and record:
                        self.metrics.add(ys[i], pred, losses, self.micro_sizes[i])
                h = out
            tapes.append(row)

        # Backward, each group on its device: the gradient of its output flows in from the next
        # group, the gradient of its input flows out to the previous one.
        per_group: list[list[list[Any]]] = [[] for _ in self.models]
        for i in reversed(range(pieces)):
            upstream = None
            for s in reversed(range(last + 1)):
                tape, inp, out = tapes[i][s]
                variables = self.models[s].trainable_variables
                with tf.device(self.devices[s]):
                    grads = tape.gradient(out, [*variables, inp] if s > 0 else list(variables),
                                          output_gradients=upstream)
                per_group[s].append(grads[:len(variables)])  # dense: see models.lstm_lm's Embedding
                upstream = grads[-1] if s > 0 else None

        summed, reg_total = [], []
        for s, (model, d) in enumerate(zip(self.models, self.devices)):
            with tf.device(d):
                if model.losses:  # regularisation: once per batch, times its examples
                    with tf.GradientTape() as tape:
                        reg = regularization(model)
                        weighted = self.batch_size * reg
                    grads = tape.gradient(weighted, model.trainable_variables)
                    # a weight without a regulariser (a bias) has no gradient here
                    per_group[s].append([tf.zeros_like(v) if g is None else g
                                         for v, g in zip(model.trainable_variables, grads)])
                    reg_total.append(reg)
                for per_var in zip(*reversed(per_group[s])):  # pieces in order 0..m-1
                    summed.append(per_var[0] if len(per_var) == 1 else tf.add_n(list(per_var)))
        if record and reg_total:
            self.metrics.add_regularization(tf.add_n(reg_total), self.batch_size)
        return summed

    def _fused_step(self, x: Any, y: Any) -> None:
        self._apply_grads(self._forward_backward(x, y))

    def _apply_grads(self, grads: Sequence[Any]) -> None:
        for k, (v, d, g) in enumerate(zip(self.params, self.param_devices, grads)):
            with tf.device(d):  # the update of a weight runs where the weight lives
                self._updaters[0].update(k, v, tf.identity(g))

    def _assign_all(self, weights: Sequence[Any]) -> None:
        for v, d, w in zip(self.params, self.param_devices, weights):
            with tf.device(d):
                v.assign(w)

    # -- metrics, evaluation, state ------------------------------------------------------------

    def _eval_step(self, x: Any, y: Any) -> None:
        h = x
        for model, d in zip(self.models, self.devices):
            with tf.device(d):
                h = model(h, training=False)
        reg = tf.add_n([regularization(m) for m in self.models])
        with tf.device(self.devices[-1]):
            self.test_metrics.add(y, h, self.criterion.losses(y, h), tf.shape(tf.nest.flatten(y)[0])[0], reg)

    def sync_non_trainable(self) -> None:
        """Nothing to do: there is one copy of every variable."""

    def _copies_of_keys(self) -> list[list[Any]]:
        return [[v] for v in self.params]

    def _copies_of_state(self) -> list[list[Any]]:
        return [[v] for m in self.models for v in m.non_trainable_variables]

    def get_weights(self) -> list[np.ndarray]:
        """Every group's variables, groups in order (the order of the chained model's weights)."""
        return [np.asarray(w) for m in self.models for w in m.get_weights()]

    def set_weights(self, weights: Sequence[np.ndarray]) -> None:
        weights = list(weights)
        sizes = [len(m.weights) for m in self.models]
        if len(weights) != sum(sizes):
            raise ValueError(f"{len(weights)} arrays for {sum(sizes)} variables of groups {self.group_names}")
        offset = 0
        for m, n in zip(self.models, sizes):
            m.set_weights(weights[offset:offset + n])
            offset += n

    def weight_names(self) -> list[str]:
        return [f"{i:04d}/{v.path}" for i, v in enumerate(v for m in self.models for v in m.weights)]


def _split(t: Any, sizes: list[int]) -> list[Any]:
    """`t` (a tensor or a dict of them) cut along its first axis into pieces of `sizes`."""
    if len(sizes) == 1:
        return [t]
    parts = [tf.split(v, sizes) for v in tf.nest.flatten(t)]
    return [tf.nest.pack_sequence_as(t, [p[i] for p in parts]) for i in range(len(sizes))]
