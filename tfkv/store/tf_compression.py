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


# Per byte value, the codes of its 4 values, lowest bits first.
_BYTE_CODES = [[(b >> (2 * j)) & 3 for j in range(4)] for b in range(256)]


def _codes(g: tf.Tensor, residual: tf.Variable, threshold: float, velocity: tf.Variable | None, momentum: float,
           opaque: tf.Tensor) -> tf.Tensor:
    """Add `g` (with a velocity, 2bit_momentum: velocity = momentum * velocity + g, in place)
    into `residual`, quantise, keep what was not sent; each value's code (uint8)."""
    t = tf.constant(threshold, tf.float32)
    if velocity is not None:
        # momentum * velocity rounded on its own, as numpy does: or-ed with `opaque` (a zero the
        # compiler cannot see) it is no longer fused into one multiply-add that rounds once.
        scaled = tf.bitcast(tf.bitwise.bitwise_or(tf.bitcast(tf.constant(momentum, tf.float32) * velocity, tf.int32),
                                                  opaque), tf.float32)
        g = scaled + g
    r = residual + g
    pos, neg = r >= t, r <= -t
    left = r - t * (tf.cast(pos, tf.float32) - tf.cast(neg, tf.float32))  # t * (+-1 or 0): exact
    residual.assign(left)
    if velocity is not None:
        velocity.assign(tf.where(tf.abs(left) >= t, tf.zeros_like(g), g))
    return tf.cast(pos, tf.uint8) + 2 * tf.cast(neg, tf.uint8)


# One XLA computation per key: TensorFlow's own kernels take a pass over memory (and a fresh
# buffer) per op, a dozen for a push; fused, the quantisation is about one.
@tf.function(jit_compile=True)
def _packed(g: tf.Tensor, residual: tf.Variable, threshold: float, bounds: tuple[tuple[int, int], ...],
            velocity: tf.Variable | None, momentum: float, opaque: tf.Tensor) -> list[tf.Tensor]:
    c = _codes(tf.reshape(tf.cast(g, tf.float32), [-1]), residual, threshold, velocity, momentum, opaque)
    return [words(c[start:end]) for start, end in bounds]


def words(values: tf.Tensor) -> tf.Tensor:
    """The uint32 words of `values`' codes (uint8, flat), the last word padded with code 0."""
    n = int(values.shape[0])
    quads = tf.reshape(tf.pad(values, [[0, -n % 16]]), [-1, 4])
    gathered = tf.bitwise.right_shift(tf.bitcast(quads, tf.uint32) * tf.constant(_GATHER, tf.uint32), 24)
    return tf.bitcast(tf.reshape(tf.cast(gathered, tf.uint8), [-1, 4]), tf.uint32)


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
    return _packed(grad, residual, float(threshold), tuple((int(s), int(e)) for s, e in bounds), velocity,
                   float(momentum), tf.zeros([], tf.int32))


def unpack(words: Any, count: int, threshold: float) -> tf.Tensor:
    """The `count` float32 values the words stand for (+t, -t or 0 each): 4 values per byte,
    gathered from a table of the 256 bytes' values."""
    t = tf.constant(threshold, tf.float32)
    table = tf.gather(tf.stack([tf.zeros([]), t, -t, tf.zeros([])]), _BYTE_CODES)  # [256, 4]
    values = tf.gather(table, tf.cast(tf.reshape(tf.bitcast(words, tf.uint8), [-1]), tf.int32))
    return tf.reshape(values, [-1])[:count]
