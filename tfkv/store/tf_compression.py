"""2-bit gradient compression as TensorFlow ops: the `device` store's in-graph reduction, and a
dist store's pushes packed inside the compiled step (tfkv.parallel.packing).

The schemes and the word layout are `tfkv.ps.compression`'s (MXNet's, and 2bit_momentum's
momentum correction in front of it): each element of
(gradient + residual) becomes +t, -t or 0, what was not sent stays in the residual, codes 1 (+t)
and 2 (-t) take 2 bits, 16 per uint32 word, element i in bits 2*(i % 16) of word i // 16. `pack`
runs on the device that computed the gradient (its residual lives there); only the words travel
to the device that sums, where `unpack` turns them back into floats.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf


def _sum(g: tf.Tensor, residual: tf.Variable, velocity: tf.Variable | None, momentum: float,
         opaque: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(what is added into the residual, residual + it): `g`, or with a velocity (2bit_momentum)
    momentum * velocity + g, rounded as numpy rounds it."""
    if velocity is not None:
        # momentum * velocity rounded on its own, as numpy does: or-ed with `opaque` (a zero the
        # compiler cannot see) it is no longer fused into one multiply-add that rounds once.
        scaled = tf.bitcast(tf.bitwise.bitwise_or(tf.bitcast(tf.constant(momentum, tf.float32) * velocity, tf.int32),
                                                  opaque), tf.float32)
        g = scaled + g
    return g, residual + g


def _flat(g: Any) -> tf.Tensor:
    return tf.reshape(tf.cast(g, tf.float32), [-1])


# XLA computations per key, each one pass over memory: the words (reading the residual and the
# gradient), then the residual's update in place (reading them again), then, with a velocity, its
# update (`_mask`). One computation with several outputs is about twice as slow: XLA's CPU backend
# does not fuse the words' reduction with the updates and writes them to fresh buffers.
@tf.function(jit_compile=True)
def _words_of(g: tf.Tensor, residual: tf.Variable, threshold: float, bounds: tuple[tuple[int, int], ...],
              velocity: tf.Variable | None, momentum: float, opaque: tf.Tensor) -> list[tf.Tensor]:
    _, r = _sum(_flat(g), residual, velocity, momentum, opaque)
    return [words_over(r[start:end], threshold) for start, end in bounds]


@tf.function(jit_compile=True)
def _keep(g: tf.Tensor, residual: tf.Variable, threshold: float, velocity: tf.Variable | None, momentum: float,
          opaque: tf.Tensor) -> None:
    """Take the sent part out of residual + g (with a velocity: + momentum * velocity + g)."""
    t = tf.constant(threshold, tf.float32)
    _, r = _sum(_flat(g), residual, velocity, momentum, opaque)
    residual.assign(r - t * (tf.cast(r >= t, tf.float32) - tf.cast(r <= -t, tf.float32)))  # t * (+-1 or 0): exact


@tf.function(jit_compile=True)
def _mask(g: tf.Tensor, left: tf.Variable, threshold: float, velocity: tf.Variable, momentum: float,
          opaque: tf.Tensor) -> None:
    """velocity = momentum * velocity + g, zeroed where the residual (`left`, after sending) still
    holds a whole threshold. Its own pass: with the residual's update in one computation, XLA
    writes both to fresh buffers (three times the time)."""
    added, _ = _sum(_flat(g), left, velocity, momentum, opaque)
    velocity.assign(tf.where(tf.abs(left) >= threshold, tf.zeros_like(added), added))


# A word's 16 codes, code j shifted to bits 2j: their sum is the word (the bits do not overlap).
_SHIFTS = [1 << (2 * j) for j in range(16)]


def words_over(values: tf.Tensor, threshold: float) -> tf.Tensor:
    """The uint32 words of the codes of `values` (float32, flat) against `threshold` (1: >= t,
    2: <= -t, else 0), the last word padded with code 0."""
    t = tf.constant(threshold, tf.float32)
    codes = tf.cast(values >= t, tf.uint32) + 2 * tf.cast(values <= -t, tf.uint32)
    n = int(values.shape[0])
    codes = tf.reshape(tf.pad(codes, [[0, -n % 16]]), [-1, 16])
    return tf.reduce_sum(codes * tf.constant(_SHIFTS, tf.uint32), axis=1)


def pack(grad: Any, residual: tf.Variable, threshold: float, velocity: tf.Variable | None = None,
         momentum: float = 0.0) -> tf.Tensor:
    """Add `grad` into `residual` (a flat float32 variable), quantise, keep what was not sent in
    the residual; return the codes as uint32 words. With a `velocity` (2bit_momentum), what is
    added is velocity = momentum * velocity + grad, and the velocity is zeroed where the residual
    still holds a whole threshold after sending, as `tfkv.ps.compression.pack_corrected`; float32
    throughout, rounded as there."""
    return pack_parts(grad, residual, threshold, ((0, int(residual.shape[0])),), velocity, momentum)[0]


def pack_parts(grad: Any, residual: tf.Variable, threshold: float, bounds: Sequence[tuple[int, int]],
               velocity: tf.Variable | None = None, momentum: float = 0.0) -> list[tf.Tensor]:
    """`pack`, as the words of each part [start, end) of `bounds` (a key's parts on the
    servers, each its own payload, its last word padded)."""
    opaque = tf.zeros([], tf.int32)
    threshold, momentum = float(threshold), float(momentum)
    words = _words_of(grad, residual, threshold, tuple((int(s), int(e)) for s, e in bounds), velocity, momentum,
                      opaque)
    # In this order, each reading the variables the one before wrote (TensorFlow orders them so).
    _keep(grad, residual, threshold, velocity, momentum, opaque)
    if velocity is not None:
        _mask(grad, residual, threshold, velocity, momentum, opaque)
    return words


def unpack(words: Any, count: int, threshold: float) -> tf.Tensor:
    """The `count` float32 values the words stand for (+t, -t or 0 each)."""
    return _values_of(words, int(count), float(threshold))


# One XLA computation: each word's 16 codes shifted out and turned into values, one pass.
@tf.function(jit_compile=True)
def _values_of(words: tf.Tensor, count: int, threshold: float) -> tf.Tensor:
    codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(tf.reshape(tf.cast(words, tf.uint32), [-1, 1]),
                                                          tf.constant([2 * j for j in range(16)], tf.uint32)), 3)
    t = tf.constant(threshold, tf.float32)
    values = tf.where(codes == 1, t, tf.where(codes == 2, -t, tf.zeros([], tf.float32)))
    return tf.reshape(values, [-1])[:count]
