"""2-bit gradient compression as TensorFlow ops, for the `device` store's in-graph reduction.

The schemes and the word layout are `tfkv.ps.compression`'s (MXNet's, and 2bit_momentum's
momentum correction in front of it): each element of
(gradient + residual) becomes +t, -t or 0, what was not sent stays in the residual, codes 1 (+t)
and 2 (-t) take 2 bits, 16 per uint32 word, element i in bits 2*(i % 16) of word i // 16. `pack`
runs on the device that computed the gradient (its residual lives there); only the words travel
to the device that sums, where `unpack` turns them back into floats.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


def _shifts() -> tf.Tensor:
    """The bit offset of each of a word's 16 codes."""
    return tf.constant([2 * i for i in range(16)], tf.uint32)


def pack(grad: Any, residual: tf.Variable, threshold: float, velocity: tf.Variable | None = None,
         momentum: float = 0.0) -> tf.Tensor:
    """Add `grad` into `residual` (a flat float32 variable), quantise, keep what was not sent in
    the residual; return the codes as uint32 words. With a `velocity` (2bit_momentum), what is
    added is velocity = momentum * velocity + grad, and the velocity is zeroed where the residual
    still holds a whole threshold after sending, as `tfkv.ps.compression.pack_corrected`."""
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
    codes = tf.bitwise.bitwise_or(tf.cast(pos, tf.uint32), tf.bitwise.left_shift(tf.cast(neg, tf.uint32), 1))
    n = int(residual.shape[0])
    codes = tf.reshape(tf.pad(codes, [[0, -n % 16]]), [-1, 16])
    # The 16 codes of a word occupy disjoint bits, so their sum is their bitwise or.
    return tf.reduce_sum(tf.bitwise.left_shift(codes, _shifts()), axis=1)


def unpack(words: Any, count: int, threshold: float) -> tf.Tensor:
    """The `count` float32 values the words stand for (+t, -t or 0 each)."""
    codes = tf.reshape(tf.bitwise.bitwise_and(tf.bitwise.right_shift(words[:, None], _shifts()), 3), [-1])[:count]
    t = tf.constant(threshold, tf.float32)
    return t * (tf.cast(codes == 1, tf.float32) - tf.cast(codes == 2, tf.float32))
