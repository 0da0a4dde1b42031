"""Every device's forward and backward pass on its slice of a batch, as a data-parallel step
computes it before any exchange: the gradients of each slice's summed loss (the dense keys', and
each row-sparse table's as (rows, table ids)), the loss scaled before backprop and the
gradients unscaled after (mixed_float16), clipped to `clipnorm`, each device's pass compiled
with XLA under `jit_compile`. Traceable: an exchange calls it inside its compiled step."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import tensorflow as tf

from tfkv.parallel.criterion import Criterion, regularization
from tfkv.parallel.metrics import Tally
from tfkv.parallel.precision import LossScale
from tfkv.parallel.replicas import Replicas

Rows = list[list[tuple[Any, Any]]]  # per device, per table: (rows, table ids)


class Backprop:
    def __init__(self, replicas: Replicas, batch_sizes: Sequence[int], criterion: Criterion, metrics: Tally,
                 loss_scale: LossScale | None, clipnorm: float | None, jit_compile: bool) -> None:
        self.replicas = replicas
        self.batch_sizes = list(batch_sizes)
        self.criterion = criterion
        self.metrics = metrics
        self.loss_scale = loss_scale
        self.clipnorm = clipnorm
        self._device_grads = [
            tf.function(functools.partial(self._device_gradients, r, n), jit_compile=True) if jit_compile
            else functools.partial(self._device_gradients, r, n)
            for r, n in enumerate(self.batch_sizes)]

    def __call__(self, x: Any, y: Any) -> tuple[list[list[Any]], Rows]:
        """Every device's gradients of its slice's summed loss (unscaled), clipped (clipnorm):
        per device, the dense keys' and each row-sparse table's as (rows, table ids)."""
        replicas = self.replicas
        keys = len(replicas.keys)
        grads: list[list[Any]] = []
        rows: Rows = []
        offset = 0
        scale = self.loss_scale.scale.read_value() if self.loss_scale is not None else tf.constant(1.0)
        for d, n, device_grads in zip(replicas.devices, self.batch_sizes, self._device_grads):
            with tf.device(d):
                xs, ys = (tf.nest.map_structure(lambda t: t[offset:offset + n], v) for v in (x, y))
                g, pred, losses, reg = device_grads(xs, ys, scale)
                grads.append(g[:keys])
                rows.append([t.global_rows(len(rows), gt) for t, gt in zip(replicas.tables, g[keys:])])
                self.metrics.add(ys, pred, losses, n, reg)
            offset += n
        return self._clipped(grads, rows) if self.clipnorm else (grads, rows)

    def _device_gradients(self, r: int, n: int, xs: Any, ys: Any, scale: Any) -> tuple[Any, ...]:
        """One copy's forward and backward pass (what jit_compile compiles): the gradients of
        its examples' summed loss; with loss scaling, backprop runs from the mean loss times
        `scale` (Keras's meaning of the scale) and the gradients are brought back after.
        The gradients are the dense keys', then the row-sparse tables' (tf.IndexedSlices)."""
        replicas = self.replicas
        model = replicas.models[r]
        variables = replicas.params[r] + replicas.table_variables(r)
        with tf.GradientTape() as tape:
            pred = model(xs, training=True)
            losses = self.criterion.losses(ys, pred)
            reg = regularization(model)
            loss = tf.add_n([tf.reduce_sum(v) for v in losses.values()]) + n * reg
            if self.loss_scale is not None:  # the scale is of the mean loss, as in Keras
                loss = loss * (scale / n)
        grads = tape.gradient(loss, variables)
        # A dense key's gradient is pushed and updated whole (an Embedding's IndexedSlices too)
        dense = len(replicas.params[r])
        grads = [tf.convert_to_tensor(g) if i < dense and isinstance(g, tf.IndexedSlices) else g
                 for i, g in enumerate(grads)]
        if self.loss_scale is not None:
            grads = [_times(g, n / scale) for g in grads]
        return grads, pred, losses, reg

    def _clipped(self, grads: list[list[Any]], rows: Rows) -> tuple[list[list[Any]], Rows]:
        """Every device's gradients times clipnorm / max(norm, clipnorm), norm the global norm of
        this worker's gradient of its mean loss: tf.clip_by_global_norm of the summed gradient
        over the worker's examples (linear, so each device's share scales alike); a table's
        rows summed per id over the devices count as its gradient."""
        with tf.device(self.replicas.devices[0]):
            summed = [tf.add_n([g[k] for g in grads]) for k in self.replicas.keys]
            for j in range(len(rows[0])):
                unique, where = tf.unique(tf.concat([r[j][1] for r in rows], 0))
                summed.append(tf.math.unsorted_segment_sum(tf.concat([r[j][0] for r in rows], 0), where,
                                                           tf.shape(unique)[0]))
            norm = tf.linalg.global_norm(summed) / float(sum(self.batch_sizes))
            factor = self.clipnorm / tf.maximum(norm, self.clipnorm)
        return ([[v * tf.cast(factor, v.dtype) for v in g] for g in grads],
                [[(v * tf.cast(factor, v.dtype), i) for v, i in r] for r in rows])


def _times(g: Any, factor: Any) -> Any:
    """A gradient times `factor` (a tf.IndexedSlices: its rows)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * factor, g.indices, g.dense_shape)
    return g * factor


def row_values(rows: Rows) -> list[Any]:
    """The row values of every device's tables' (rows, ids) (what a finiteness check reads)."""
    return [v for r in rows for v, _ in r]
