"""The 2-bit scheme as tfkv first wrote it, value by value in plain numpy passes: the oracle the
vectorised `tfkv.ps.compression` and the TensorFlow ops (`tfkv.store.tf_compression`) are
checked against, bit for bit (words, residuals, velocities)."""

import numpy as np


def words(count):
    return (count + 15) // 16


def _encode(pos, neg):
    """The codes of (pos, neg) boolean arrays as uint32 words."""
    n = pos.size
    codes = np.zeros(words(n) * 16, np.uint8)
    codes[:n] = pos.view(np.uint8)
    codes[:n] |= neg.view(np.uint8) << np.uint8(1)
    # Four codes per byte, lowest first; four bytes per little-endian word: element i lands in
    # bits 2*(i % 16) of word i // 16.
    c = codes.reshape(-1, 4)
    packed = c[:, 0] | (c[:, 1] << np.uint8(2)) | (c[:, 2] << np.uint8(4)) | (c[:, 3] << np.uint8(6))
    return packed.view("<u4").astype(np.uint32, copy=False)


def _quantise(residual, threshold):
    """Where `residual` sends +t and -t; the sent part is taken out of it (in place)."""
    t = np.float32(threshold)
    pos = residual >= t
    neg = residual <= -t
    # sent = (pos - neg) * t, one float temporary; masked ufuncs (where=) are much slower.
    sent = np.subtract(pos, neg, dtype=np.float32)
    sent *= t
    residual -= sent
    return pos, neg


def pack(grad, residual, threshold):
    """Add `grad` into `residual` (in place), quantise it, take the sent part out of the residual;
    return the codes as uint32 words."""
    residual += grad
    return _encode(*_quantise(residual, threshold))


def pack_corrected(grad, velocity, residual, threshold, momentum):
    """velocity = momentum * velocity + grad into the residual, quantised as `pack`; the velocity
    zeroed where the residual still holds a whole threshold."""
    velocity *= np.float32(momentum)
    velocity += grad
    residual += velocity
    pos, neg = _quantise(residual, threshold)
    np.putmask(velocity, np.abs(residual) >= np.float32(threshold), np.float32(0))
    return _encode(pos, neg)


def unpack(packed, count, threshold):
    """The float32 values (length `count`) that `packed` represents; ValueError if malformed."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint32 or packed.ndim != 1 or packed.size != words(count):
        raise ValueError(f"2-bit payload of {packed.size} words cannot hold exactly {count} values")
    raw = packed.astype("<u4", copy=False).view(np.uint8)
    codes = np.empty((raw.size, 4), np.uint8)
    for j in range(4):
        np.bitwise_and(raw >> np.uint8(2 * j), np.uint8(3), out=codes[:, j])
    codes = codes.reshape(-1)
    if (codes == 3).any():
        raise ValueError("2-bit payload holds the invalid code 3")
    if codes[count:].any():
        raise ValueError("2-bit payload has non-zero padding after its last value")
    t = np.float32(threshold)
    return np.array([0, t, -t], np.float32)[codes[:count]]
