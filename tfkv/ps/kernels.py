"""The 2-bit scheme's loops, compiled by Numba: one pass over memory each, with no Python per value
and without the GIL (a server's threads pack and unpack key parts side by side).

The scheme, its word layout and its rounding are `tfkv.ps.compression`'s (which calls these):
float32 throughout, each product rounded on its own (no fused multiply-add: Numba compiles
without fast-math), so the words, residuals and velocities equal numpy's, bit for bit. A dozen
numpy passes, even in cache-sized blocks, cost 4-9 times a copy of the values; one compiled loop
costs 1-2 (python -m benchmarks compression_speed). Compiled once per machine: the cache lives
beside this file (else in the user's cache directory), so a later process loads it in a blink.
"""

from __future__ import annotations

import numba
import numpy as np

_ONE, _TWO = np.uint32(1), np.uint32(2)


@numba.njit(cache=True, nogil=True, inline="always")
def _send(x: np.float32, t: np.float32, j: int) -> tuple[np.float32, np.uint32]:
    """(what is held back of `x`, its code shifted into place j of a word)."""
    p, q = np.uint32(x >= t), np.uint32(x <= -t)
    return x - t * (np.float32(p) - np.float32(q)), (p | (q << _ONE)) << np.uint32(2 * j)


@numba.njit(cache=True, nogil=True)
def pack(grad: np.ndarray, residual: np.ndarray, t: np.float32, out: np.ndarray) -> None:
    """residual += grad; its codes into `out` (uint32 words); the sent part taken out of it."""
    n = residual.size
    for w in range(out.size):
        word, base = np.uint32(0), w * 16
        for j in range(min(16, n - base)):
            i = base + j
            residual[i], code = _send(residual[i] + grad[i], t, j)
            word |= code
        out[w] = word


@numba.njit(cache=True, nogil=True)
def pack_corrected(grad: np.ndarray, velocity: np.ndarray, residual: np.ndarray, t: np.float32, m: np.float32,
                   out: np.ndarray) -> None:
    """velocity = m * velocity + grad, added into the residual, quantised as `pack`; then the
    velocity zeroed where the residual still holds a whole threshold (+0: as numpy's v * keep + 0,
    which also makes a kept -0 into +0)."""
    n, zero = residual.size, np.float32(0)
    for w in range(out.size):
        word, base = np.uint32(0), w * 16
        for j in range(min(16, n - base)):
            i = base + j
            v = m * velocity[i]
            v = v + grad[i]
            left, code = _send(residual[i] + v, t, j)
            residual[i] = left
            velocity[i] = v + zero if abs(left) < t else zero
            word |= code
        out[w] = word


@numba.njit(cache=True, nogil=True)
def unpack(words: np.ndarray, t: np.float32, out: np.ndarray) -> None:
    """The values (+t, -t or 0) of `words`' codes into `out` (its size: how many)."""
    n, zero = out.size, np.float32(0)
    for w in range(words.size):
        word, base = words[w], w * 16
        for j in range(min(16, n - base)):
            code = (word >> np.uint32(2 * j)) & np.uint32(3)
            out[base + j] = t if code == _ONE else (-t if code == _TWO else zero)


@numba.njit(cache=True, nogil=True)
def unpack_onto(words: np.ndarray, t: np.float32, base: np.ndarray, out: np.ndarray) -> None:
    """out = base + the values of `words`' codes, in one pass (a copy moved by a 2-bit reply)."""
    n, zero = out.size, np.float32(0)
    for w in range(words.size):
        word, start = words[w], w * 16
        for j in range(min(16, n - start)):
            code = (word >> np.uint32(2 * j)) & np.uint32(3)
            out[start + j] = base[start + j] + (t if code == _ONE else (-t if code == _TWO else zero))
