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

# (4 codes, one per byte of a uint32) * _GATHER holds the 4 codes side by side in its top byte
# (tfkv.ps.compression's trick): the products of the other bytes never reach it.
_GATHER = 0x01041040


def _shifts() -> tf.Tensor:
    """The bit offset of each of a word's 16 codes."""
    return tf.constant([2 * i for i in range(16)], tf.uint32)


def codes(grad: Any, residual: tf.Variable, threshold: float, velocity: tf.Variable | None = None,
          momentum: float = 0.0) -> tf.Tensor:
    """Add `grad` into `residual` (a flat float32 variable), quantise, keep what was not sent in
    the residual; return each value's code (uint8: 0, 1 for +t, 2 for -t). With a `velocity`
    (2bit_momentum), what is added is velocity = momentum * velocity + grad, and the velocity is
    zeroed where the residual still holds a whole threshold after sending, as
    `tfkv.ps.compression.pack_corrected`; float32 throughout, rounded as there."""
    t = tf.constant(threshold, tf.float32)
    g = tf.reshape(tf.cast(grad, tf.float32), [-1])
    if velocity is not None:
        g = tf.constant(momentum, tf.float32) * velocity + g
    r = residual + g
    pos, neg = r >= t, r <= -t
    left = r - t * (tf.cast(pos, tf.float32) - tf.cast(neg, tf.float32))
    residual.assign(left)
    if velocity is not None:
        velocity.assign(tf.where(tf.abs(left) >= t, tf.zeros_like(g), g))
    return tf.cast(pos, tf.uint8) + 2 * tf.cast(neg, tf.uint8)


def words(values: tf.Tensor) -> tf.Tensor:
    """The uint32 words of `values`' codes (uint8, flat), the last word padded with code 0."""
    n = int(values.shape[0])
    quads = tf.reshape(tf.pad(values, [[0, -n % 16]]), [-1, 4])
    gathered = tf.bitwise.right_shift(tf.bitcast(quads, tf.uint32) * tf.constant(_GATHER, tf.uint32), 24)
    return tf.bitcast(tf.reshape(tf.cast(gathered, tf.uint8), [-1, 4]), tf.uint32)


def pack(grad: Any, residual: tf.Variable, threshold: float, velocity: tf.Variable | None = None,
         momentum: float = 0.0) -> tf.Tensor:
    """`codes` of the whole residual as uint32 words (see `codes`)."""
    return words(codes(grad, residual, threshold, velocity, momentum))


def pack_parts(grad: Any, residual: tf.Variable, threshold: float, bounds: Sequence[tuple[int, int]],
               velocity: tf.Variable | None = None, momentum: float = 0.0) -> list[tf.Tensor]:
    """`codes` of the residual, as the words of each part [start, end) of `bounds` (a key's parts
    on the servers, each its own payload, its last word padded)."""
    c = codes(grad, residual, threshold, velocity, momentum)
    return [words(c[start:end]) for start, end in bounds]


def unpack(words: Any, count: int, threshold: float) -> tf.Tensor:
    """The `count` float32 values the words stand for (+t, -t or 0 each)."""
    codes = tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, None], _shifts()), 3), [-1])[:count]
    t = tf.constant(threshold, tf.float32)
    return t * (tf.cast(codes == 1, tf.float32) - tf.cast(codes == 2, tf.float32))
