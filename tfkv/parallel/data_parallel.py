"""Data parallelism: one model copy per device, the batch split across them, gradients summed
through a KVStore, as MXNet's Module does.

Each step, device i runs forward and backward on its slice (b/k examples, or its share of
`work_load_list`); every parameter is pushed as a list of per-device gradients (the store sums
them), then pulled back into every copy. With `update_on_kvstore` the store runs the optimizer;
otherwise it only sums, and each device applies the update to its own copy.

Stores whose push/pull are TensorFlow ops (`traceable`) are traced into the step's tf.function.
The parameter-server client (`async_pushpull`) is handed each key's gradients from inside the
compiled step, by a `tf.numpy_function` per key that runs as soon as backprop has produced that
key's gradients (last layer first) while the rest of backprop goes on: it pushes the key and
requests it back at once, so the servers sum and answer early keys while later ones are still
being computed. After the step, the replies are taken as they arrive and written into the
variables in one compiled call. Other stores get the same calls between the two compiled
halves of the step.
`timings` accumulates the seconds of each phase (compute, including the pushes made from inside
it; push, the part of compute spent pushing; pull, waiting for replies; assign) for benchmarks.
With one device on one machine there is nothing to sum, and, as MXNet does, the store is left
out: the device updates its weights itself, with the same rule and the same numbers.

Inputs and labels may be dicts (a model with several inputs or outputs): every tensor of x and
y is cut along its first axis, the same rows for each device. The loss and metrics are the
criterion's (`tfkv.parallel.criterion`), the model's regularisation losses included.

State that gradients do not move (BatchNorm's moving statistics) is not pushed. The copies
inside one worker each update their own on their slice, and `sync_non_trainable` (the trainer
calls it at each epoch's end, before evaluating) sets them all to their average. Across the
workers of a `dist_*` job nothing is exchanged: each worker keeps its own statistics, and
worker 0's are the ones its evaluation reports and its checkpoint and export hold.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfkv import optim
from tfkv.parallel.base import Parallel
from tfkv.parallel.criterion import Criterion, regularization
from tfkv.store.base import KVStore
from tfkv.store.tf_updater import TFUpdater


class DataParallel(Parallel):
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
    ):
        """`devices` are TensorFlow device names; `batch_sizes[i]` examples go to device i;
        `criterion`: the loss and metrics (default: sparse categorical crossentropy on logits,
        accuracy).

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
        self.devices = list(devices)
        self.store = store
        self.batch_sizes = [int(n) for n in batch_sizes]
        self.uses_store = len(self.devices) > 1 or store.distributed
        self.update_on_kvstore = update_on_kvstore and self.uses_store
        optimizer = self._rescaled(optimizer, sum(self.batch_sizes))
        self.replicas = []
        for d in self.devices:
            with tf.device(d):
                self.replicas.append(build_model())
        if initial_weights is not None:
            self.replicas[0].set_weights(list(initial_weights))
        self.params = [r.trainable_variables for r in self.replicas]
        self.keys = list(range(len(self.params[0])))

        if self.update_on_kvstore:
            store.set_optimizer(optimizer)
        else:
            for d, params in zip(self.devices, self.params):
                updater = TFUpdater(optimizer)
                for k in self.keys:
                    updater.create_state(k, params[k], d)
                self._updaters.append(updater)
        if self.uses_store:
            # Every copy starts from the first one's weights (MXNet: init, then pull everywhere).
            for k in self.keys:
                store.broadcast(k, self.params[0][k], out=[p[k] for p in self.params], priority=-k)
        self._sync_non_trainable(source=0)

        self._streams = self.uses_store and store.async_pushpull
        self._inflight: list[Any] = []  # pulls requested from inside the compiled step
        self._hook_error: BaseException | None = None
        if store.traceable or not self.uses_store:
            self._step = tf.function(self._fused_step)
        else:
            self._grads = tf.function(self._forward_backward_pushing if self._streams else self._forward_backward)
            self._set_weights = tf.function(self._assign_all)
            self._apply = tf.function(self._apply_aggregated)
        self._eval = tf.function(self._eval_step)
        # Seconds per phase of the non-traceable step, summed over steps (see reset_timings).
        self.timings = {"compute": 0.0, "push": 0.0, "pull": 0.0, "assign": 0.0, "steps": 0}

    def reset_timings(self) -> None:
        for k in self.timings:
            self.timings[k] = 0 if k == "steps" else 0.0

    # -- one training step ---------------------------------------------------------------------

    def step(self, x: Any, y: Any) -> None:
        """Train on one batch (x, y) of sum(batch_sizes) examples."""
        self.metrics.prepare(y)
        if self.store.traceable or not self.uses_store:
            self._step(x, y)
            return
        clock = time.perf_counter
        tm = self.timings
        t0 = clock()
        if self._streams:
            self._grads(x, y)  # pushes every key from inside, as its gradients are ready
            if self._hook_error is not None:
                error, self._hook_error, self._inflight = self._hook_error, None, []
                raise error
            t1 = t2 = clock()
        else:
            grads = self._grads(x, y)
            t1 = clock()
            # Priority k: backprop's order, the last layer first (the order the gradients came).
            self._inflight = self.store.pushpull_async(self.keys, [[g[k] for g in grads] for k in self.keys],
                                                       priority=list(self.keys))
            t2 = clock()
            tm["push"] += t2 - t1
        pending, self._inflight = self._inflight, []
        waited = self._finish_step(pending)
        t3 = clock()
        tm["compute"] += t1 - t0
        tm["pull"] += waited
        tm["assign"] += t3 - t2 - waited
        tm["steps"] += 1

    def _forward_backward_pushing(self, x: Any, y: Any) -> None:
        grads = self._forward_backward(x, y)
        # Stateful ops run in program order, so the hooks fire in backprop's order: the last
        # layer's first, each as soon as its gradients exist.
        for k in reversed(self.keys):
            values = [g[k] for g in grads]
            if len(values) > 1 and self.store.sum_on_device:
                with tf.device(self.devices[0]):
                    values = [tf.add_n(values)]
            tf.numpy_function(functools.partial(self._push_hook, k), values, Tout=tf.int32, stateful=True,
                              name=f"push_{k}")

    def _push_hook(self, key: int, *values: np.ndarray) -> np.int32:
        # Runs on a TensorFlow thread: an exception here would come back wrapped in a TF error,
        # so it is kept and raised as itself once the step returns.
        if self._hook_error is None:
            t = time.perf_counter()
            try:
                self._inflight.extend(self.store.pushpull_async(key, list(values)))
            except BaseException as e:  # noqa: BLE001 - re-raised by step()
                self._hook_error = e
            self.timings["push"] += time.perf_counter() - t
        return np.int32(0)

    def _forward_backward(self, x: Any, y: Any) -> list[list[Any]]:
        grads, offset = [], 0
        for d, model, n in zip(self.devices, self.replicas, self.batch_sizes):
            with tf.device(d):
                xs, ys = (tf.nest.map_structure(lambda t: t[offset:offset + n], v) for v in (x, y))
                with tf.GradientTape() as tape:
                    pred = model(xs, training=True)
                    losses = self.criterion.losses(ys, pred)
                    reg = regularization(model)
                    loss = tf.add_n([tf.reduce_sum(v) for v in losses.values()]) + n * reg
                grads.append(tape.gradient(loss, model.trainable_variables))
                self.metrics.add(ys, pred, losses, n, reg)
            offset += n
        return grads

    def _fused_step(self, x: Any, y: Any) -> None:
        grads = self._forward_backward(x, y)
        if not self.uses_store:
            self._apply_aggregated(grads[0])
            return
        for k in self.keys:
            self.store.push(k, [g[k] for g in grads], priority=-k)
            if self.update_on_kvstore:
                self.store.pull(k, out=[p[k] for p in self.params], priority=-k)
            else:
                self._update_copies(k, self.store.pull(k, priority=-k))

    def _update_copies(self, k: int, aggregated: Any) -> None:
        for d, params, updater in zip(self.devices, self.params, self._updaters):
            with tf.device(d):
                updater.update(k, params[k], tf.identity(aggregated))

    def _assign_all(self, weights: list[Any]) -> None:
        for k, w in zip(self.keys, weights):
            for d, params in zip(self.devices, self.params):
                with tf.device(d):
                    params[k].assign(w)

    def _apply_aggregated(self, grads: list[Any]) -> None:
        for k, g in zip(self.keys, grads):
            self._update_copies(k, g)

    # -- metrics, evaluation, state ------------------------------------------------------------

    def _eval_step(self, x: Any, y: Any) -> None:
        model = self.replicas[0]
        with tf.device(self.devices[0]):
            pred = model(x, training=False)
            self.test_metrics.add(y, pred, self.criterion.losses(y, pred), tf.shape(tf.nest.flatten(y)[0])[0],
                                  regularization(model))

    def sync_non_trainable(self) -> None:
        """Average state that gradients do not move (BatchNorm statistics) across this worker's
        copies (not across workers: see the module docstring)."""
        self._sync_non_trainable(source=None)

    def _sync_non_trainable(self, source: int | None) -> None:
        if len(self.replicas) == 1:
            return
        for vs in zip(*(r.non_trainable_variables for r in self.replicas)):
            value = vs[source].numpy() if source is not None else np.mean([v.numpy() for v in vs], axis=0)
            for v in vs:
                v.assign(value)

    def get_weights(self) -> list[np.ndarray]:
        """All variables of the first copy, in `model.weights` order."""
        return [np.asarray(w) for w in self.replicas[0].get_weights()]

    def weight_names(self) -> list[str]:
        return [f"{i:04d}/{v.path}" for i, v in enumerate(self.replicas[0].weights)]
