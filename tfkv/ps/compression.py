"""2-bit gradient compression with error feedback, MXNet's scheme, on numpy arrays.

With threshold t, each element of (gradient + residual) becomes +t, -t or 0; what was not sent
stays in the residual for the next push. Codes take 2 bits each (0: 0, 1: +t, 2: -t; 3 is
invalid), 16 per little-endian uint32 word, element i in bits 2*(i % 16). No TensorFlow here.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

TYPES = ("none", "2bit")


def words(count: int) -> int:
    """uint32 words that hold `count` 2-bit codes."""
    return (count + 15) // 16


def parse(params: Mapping[str, Any] | None, where: str = "compression") -> float | None:
    """MXNet's compression params ({"type": "2bit", "threshold": 0.5}) -> threshold, or None for
    no compression. Raises ValueError on anything else, naming the setting as `where`.type etc."""
    if not params:
        return None
    kind = str(params.get("type", "none")).lower()
    if kind not in TYPES:
        raise ValueError(f"{where}.type={kind!r} is not known; choose one of {', '.join(TYPES)}")
    unknown = set(params) - {"type", "threshold"}
    if unknown:
        raise ValueError(f"{where}: unknown parameter(s) {', '.join(sorted(unknown))}")
    if kind == "none":
        return None
    threshold = float(params.get("threshold", 0.5))
    if not np.isfinite(threshold) or threshold <= 0:
        raise ValueError(f"{where}.threshold={threshold} must be positive")
    return threshold


def pack(grad: np.ndarray, residual: np.ndarray, threshold: float) -> np.ndarray:
    """Add `grad` into `residual` (in place), quantise it, take the sent part out of the residual;
    return the codes as uint32 words."""
    t = np.float32(threshold)
    residual += grad
    pos = residual >= t
    neg = residual <= -t
    # sent = (pos - neg) * t, one float temporary; masked ufuncs (where=) are 10x slower here.
    sent = np.subtract(pos, neg, dtype=np.float32)
    sent *= t
    residual -= sent
    n = residual.size
    codes = np.zeros(words(n) * 16, np.uint8)
    codes[:n] = pos.view(np.uint8)
    codes[:n] |= neg.view(np.uint8) << np.uint8(1)
    # Four codes per byte, lowest first; four bytes per little-endian word: element i lands in
    # bits 2*(i % 16) of word i // 16.
    c = codes.reshape(-1, 4)
    packed = c[:, 0] | (c[:, 1] << np.uint8(2)) | (c[:, 2] << np.uint8(4)) | (c[:, 3] << np.uint8(6))
    return packed.view("<u4").astype(np.uint32, copy=False)


def unpack(packed: np.ndarray, count: int, threshold: float) -> np.ndarray:
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
