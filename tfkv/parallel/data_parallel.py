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

import functools
import time
from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfkv import optim
from tfkv.errors import ConfigError
from tfkv.layers import serving_rows
from tfkv.parallel import sparse
from tfkv.parallel.base import Parallel
from tfkv.parallel.criterion import Criterion, regularization
from tfkv.parallel.portable import PortableWeights
from tfkv.parallel.precision import LossScale, all_finite
from tfkv.parallel.xla import xla_refusal
from tfkv.store.base import KVStore
from tfkv.store.tf_updater import TFUpdater


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
        self.devices = list(devices)
        self.store = store
        self.batch_sizes = [int(n) for n in batch_sizes]
        optimizer = self._rescaled(optimizer, sum(self.batch_sizes))
        self.replicas = []
        with serving_rows():  # a ShardedEmbedding holds the batch's rows, the store its table
            for d in self.devices:
                with tf.device(d):
                    self.replicas.append(build_model())
        found = sparse.find(self.replicas, row_sparse, first_key=0)
        self.uses_store = len(self.devices) > 1 or store.distributed or bool(found)
        self.update_on_kvstore = update_on_kvstore and self.uses_store
        if found and not self.update_on_kvstore:
            raise ConfigError(f"the embedding tables {', '.join(t.name for t in found)} are row-sparse keys of the "
                              "store, which updates their rows: set kvstore.update_on_kvstore=true")
        tables = {j: None for j in range(len(found))}
        table_vars = {id(t.variable(r)) for t in found for r in range(len(self.replicas))}
        self.params = [[v for v in r.trainable_variables if id(v) not in table_vars] for r in self.replicas]
        self.keys = list(range(len(self.params[0])))
        for j, t in enumerate(found):
            t.key = len(self.keys) + j
        self.sparse = (sparse.Tables(found, self.replicas, store) if found else None)
        if initial_weights is not None:
            tables = self._set_portable_weights(list(initial_weights))
        self._start_keys(optimizer, tables, evaluate_only)
        self._compile(loss_scale, clipnorm, jit_compile)

    def _start_keys(self, optimizer: optim.Optimizer, tables: dict[int, Any], evaluate_only: bool) -> None:
        """The optimizer where updates happen, every copy from the first one's weights, the
        tables put in the store (their initial weights where given)."""
        store = self.store
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
        if self.sparse is not None:
            self.sparse.init({j: v for j, v in tables.items() if v is not None}, read_only=evaluate_only)
        self._sync_non_trainable(source=0)

    def _compile(self, loss_scale: LossScale | None, clipnorm: float | None, jit_compile: bool) -> None:
        """The step's compiled functions, chosen once: one fused step where the store traces
        into it, else gradients (pushing as backprop makes them) then assign and apply."""
        store = self.store
        self.loss_scale = loss_scale
        self.clipnorm = clipnorm
        self.jit_compile = jit_compile
        self._compiled = False
        self._device_grads = [
            tf.function(functools.partial(self._device_gradients, r, n), jit_compile=True) if jit_compile
            else functools.partial(self._device_gradients, r, n)
            for r, n in enumerate(self.batch_sizes)]
        # Loss scaling decides after the whole backprop whether anything is pushed, so the
        # pushes cannot start from inside it.
        self._streams = self.uses_store and store.async_pushpull and loss_scale is None
        self._inflight: list[Any] = []  # pulls requested from inside the compiled step
        self._hook_error: BaseException | None = None
        if store.traceable or not self.uses_store:
            self._step = tf.function(self._fused_step)
        else:
            self._grads = tf.function(self._forward_backward_pushing if self._streams else self._checked_gradients)
            self._set_weights = tf.function(self._assign_all)
            self._apply = tf.function(self._apply_aggregated)
        self._eval_compiled = tf.function(self._eval_step)
        self._eval = self._eval_batch
        # Seconds per phase of the non-traceable step, summed over steps (see reset_timings).
        self.timings = {"compute": 0.0, "push": 0.0, "pull": 0.0, "assign": 0.0, "steps": 0}

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
            if self.jit_compile and not self._compiled:
                with xla_refusal():  # the first step is where XLA compiles
                    self._step_once(x, y, upcoming)
                self._compiled = True
                return
            self._step_once(x, y, upcoming)

    def _step_once(self, x: Any, y: Any, upcoming: Any) -> None:
        self.metrics.prepare(y)
        tables = self.sparse
        if tables is not None:
            tables.before(x, upcoming)  # this batch's rows into the copies
        if self.store.traceable or not self.uses_store:
            rows, finite = self._step(x, y)
            if tables is not None:
                tables.after(rows if bool(finite) else None, upcoming)
            return
        clock = time.perf_counter
        tm = self.timings
        t0 = clock()
        if self._streams:
            rows = self._grads(x, y)  # pushes every dense key from inside, as its gradients are ready
            if self._hook_error is not None:
                error, self._hook_error, self._inflight = self._hook_error, None, []
                raise error
            t1 = clock()
            if tables is not None:
                tables.after(rows, upcoming)  # before the dense replies are waited for
            t2 = clock()
            tm["push"] += t2 - t1
        else:
            grads, rows, finite = self._grads(x, y)
            t1 = clock()
            if self.loss_scale is not None:
                # dist_sync: every worker skips the same steps, so the weights stay alike
                finite = self.store.all_workers(bool(finite))
                self.loss_scale.update(finite)
                if not finite:
                    if tables is not None:
                        tables.after(None, upcoming)
                    tm["compute"] += t1 - t0
                    tm["steps"] += 1
                    return
            # Priority k: backprop's order, the last layer first (the order the gradients came).
            self._inflight = self.store.pushpull_async(self.keys, [[g[k] for g in grads] for k in self.keys],
                                                       priority=list(self.keys))
            if tables is not None:
                tables.after(rows, upcoming)
            t2 = clock()
            tm["push"] += t2 - t1
        pending, self._inflight = self._inflight, []
        waited = self._finish_step(pending)
        t3 = clock()
        tm["compute"] += t1 - t0
        tm["pull"] += waited
        tm["assign"] += t3 - t2 - waited
        tm["steps"] += 1

    def _forward_backward_pushing(self, x: Any, y: Any) -> list[list[tuple[Any, Any]]]:
        grads, rows = self._forward_backward(x, y)
        # Stateful ops run in program order, so the hooks fire in backprop's order: the last
        # layer's first, each as soon as its gradients exist.
        for k in reversed(self.keys):
            values = [g[k] for g in grads]
            if len(values) > 1 and self.store.sum_on_device:
                with tf.device(self.devices[0]):
                    values = [tf.add_n(values)]
            tf.numpy_function(functools.partial(self._push_hook, k), values, Tout=tf.int32, stateful=True,
                              name=f"push_{k}")
        return rows

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

    def _forward_backward(self, x: Any, y: Any) -> tuple[list[list[Any]], list[list[tuple[Any, Any]]]]:
        """Every device's gradients of its slice's summed loss (unscaled), clipped (clipnorm):
        per device, the dense keys' and each row-sparse table's as (rows, table ids)."""
        grads, rows, offset = [], [], 0
        tables = self.sparse.tables if self.sparse is not None else []
        scale = self.loss_scale.scale.read_value() if self.loss_scale is not None else tf.constant(1.0)
        for d, n, device_grads in zip(self.devices, self.batch_sizes, self._device_grads):
            with tf.device(d):
                xs, ys = (tf.nest.map_structure(lambda t: t[offset:offset + n], v) for v in (x, y))
                g, pred, losses, reg = device_grads(xs, ys, scale)
                grads.append(g[:len(self.keys)])
                rows.append([t.global_rows(len(rows), gt) for t, gt in zip(tables, g[len(self.keys):])])
                self.metrics.add(ys, pred, losses, n, reg)
            offset += n
        return self._clipped(grads, rows) if self.clipnorm else (grads, rows)

    def _device_gradients(self, r: int, n: int, xs: Any, ys: Any, scale: Any) -> tuple[Any, ...]:
        """One copy's forward and backward pass (what jit_compile compiles): the gradients of
        its examples' summed loss; with loss scaling, backprop runs from the mean loss times
        `scale` (Keras's meaning of the scale) and the gradients are brought back after.
        The gradients are the dense keys', then the row-sparse tables' (tf.IndexedSlices)."""
        model = self.replicas[r]
        variables = self.params[r] + (self.sparse.variables(r) if self.sparse is not None else [])
        with tf.GradientTape() as tape:
            pred = model(xs, training=True)
            losses = self.criterion.losses(ys, pred)
            reg = regularization(model)
            loss = tf.add_n([tf.reduce_sum(v) for v in losses.values()]) + n * reg
            if self.loss_scale is not None:  # the scale is of the mean loss, as in Keras
                loss = loss * (scale / n)
        grads = tape.gradient(loss, variables)
        # A dense key's gradient is pushed and updated whole (an Embedding's IndexedSlices too)
        dense = len(self.params[r])
        grads = [tf.convert_to_tensor(g) if i < dense and isinstance(g, tf.IndexedSlices) else g
                 for i, g in enumerate(grads)]
        if self.loss_scale is not None:
            grads = [_times(g, n / scale) for g in grads]
        return grads, pred, losses, reg

    def _clipped(self, grads: list[list[Any]], rows: list[list[tuple[Any, Any]]]) -> tuple[list[list[Any]], Any]:
        """Every device's gradients times clipnorm / max(norm, clipnorm), norm the global norm of
        this worker's gradient of its mean loss: tf.clip_by_global_norm of the summed gradient
        over the worker's examples (linear, so each device's share scales alike); a table's
        rows summed per id over the devices count as its gradient."""
        with tf.device(self.devices[0]):
            summed = [tf.add_n([g[k] for g in grads]) for k in self.keys]
            for j in range(len(rows[0])):
                unique, where = tf.unique(tf.concat([r[j][1] for r in rows], 0))
                summed.append(tf.math.unsorted_segment_sum(tf.concat([r[j][0] for r in rows], 0), where,
                                                           tf.shape(unique)[0]))
            norm = tf.linalg.global_norm(summed) / float(sum(self.batch_sizes))
            factor = self.clipnorm / tf.maximum(norm, self.clipnorm)
        return ([[v * tf.cast(factor, v.dtype) for v in g] for g in grads],
                [[(v * tf.cast(factor, v.dtype), i) for v, i in r] for r in rows])

    def _checked_gradients(self, x: Any, y: Any) -> tuple[list[list[Any]], list[list[tuple[Any, Any]]], Any]:
        grads, rows = self._forward_backward(x, y)
        finite = all_finite(grads + _row_values(rows)) if self.loss_scale is not None else tf.constant(True)
        return grads, rows, finite

    def _fused_step(self, x: Any, y: Any) -> tuple[list[list[tuple[Any, Any]]], Any]:
        """The step of a traceable store; returns the tables' rows to push and whether the
        gradients were finite (false: a skipped step, nothing pushed)."""
        grads, rows = self._forward_backward(x, y)
        if self.loss_scale is None:
            self._exchange(grads, rows)
            return rows, tf.constant(True)
        finite = all_finite(grads + _row_values(rows))  # this machine's devices: one graph, nothing to agree on
        tf.cond(finite, lambda: self._exchange(grads, rows), lambda: None)
        self.loss_scale.update(finite)
        return rows, finite

    def _exchange(self, grads: list[list[Any]], rows: list[list[tuple[Any, Any]]]) -> None:
        """The update of one step: through the store (the tables' rows too), or the one device's own."""
        if not self.uses_store:
            self._apply_aggregated(grads[0])
            return
        if self.sparse is not None:
            self.sparse.push_traced(rows)
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
        self._sync_non_trainable(source=None)

    def _copies_of_keys(self) -> list[list[Any]]:
        return [[p[k] for p in self.params] for k in self.keys]

    def _copies_of_state(self) -> list[list[Any]]:
        """Per non-trainable variable, its copies; a ShardedEmbedding's row ids are the rows'
        (loaded with them), not state."""
        own = self.sparse.is_table_variable if self.sparse is not None else (lambda v: False)
        return [list(vs) for vs in zip(*(r.non_trainable_variables for r in self.replicas)) if not own(vs[0])]

    def _sync_non_trainable(self, source: int | None) -> None:
        if len(self.replicas) == 1:
            return
        for vs in self._copies_of_state():
            value = vs[source].numpy() if source is not None else np.mean([v.numpy() for v in vs], axis=0)
            for v in vs:
                v.assign(value)


def _times(g: Any, factor: Any) -> Any:
    """A gradient times `factor` (a tf.IndexedSlices: its rows)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return g * factor


def _row_values(rows: list[list[tuple[Any, Any]]]) -> list[Any]:
    """The row values of every device's tables' (rows, ids) (what a finiteness check reads)."""
    return [v for r in rows for v, _ in r]
