"""The sum a barrier can carry: every worker's float64 vector, added up by the scheduler.

For small control values (an evaluation's metric state: totals, counts, confusion counts), not
for gradients, which go to the servers. A worker's vector travels in its BARRIER's metadata as
base64 text of little-endian float64 (exact, NaN and infinities included, nothing evaluated on
receipt), at most `CHUNK` values per barrier; the scheduler adds the workers' vectors in rank
order, so every worker gets the same bits back in its BARRIER_DONE. Counts stay exact up to 2**53.
No TensorFlow here.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Mapping, Sequence

import numpy as np

#: values per barrier: 512 KiB of float64, ~700 KB of base64, within protocol.MAX_META (1 MiB)
CHUNK = 1 << 16
_WIRE = np.dtype("<f8")
#: the longest `sum` text a barrier may carry
MAX_TEXT = 4 * -(-CHUNK * _WIRE.itemsize // 3)


def encode(values: Any) -> str:
    """A 1-D float64 vector as the text a BARRIER carries."""
    flat = np.ascontiguousarray(values, dtype=_WIRE).reshape(-1)
    if flat.size > CHUNK:
        raise ValueError(f"{flat.size} values in one barrier; at most {CHUNK} (chunks: tfkv.ps.sums.chunks)")
    return base64.b64encode(flat.tobytes()).decode("ascii")


def decode(text: Any) -> np.ndarray:
    """The vector `encode` wrote; ValueError for anything else."""
    if not isinstance(text, str) or len(text) > MAX_TEXT:
        raise ValueError(f"must be base64 text of at most {MAX_TEXT} characters")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError("is not base64 text") from None
    if len(raw) % _WIRE.itemsize:
        raise ValueError(f"holds {len(raw)} bytes, not a whole number of float64 values")
    return np.frombuffer(raw, dtype=_WIRE).astype(np.float64)


def chunks(values: Any) -> list[np.ndarray]:
    """`values` flattened to float64 and cut into pieces of at most CHUNK (one barrier each)."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    return [flat[i:i + CHUNK] for i in range(0, flat.size, CHUNK)] or [flat]


def total(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The elementwise sum of `vectors` (the workers' in rank order), added in that order."""
    out = np.array(vectors[0], dtype=np.float64)
    for v in vectors[1:]:
        out += v
    return out


def release(metas: Sequence[Mapping[str, Any] | None], names: Sequence[str]) -> dict[str, Any] | None:
    """What the scheduler's BARRIER_DONE carries, from the workers' BARRIER metadata in rank order
    (`names`: theirs): None for a plain barrier, else the sum of their chunks. ValueError when
    they disagree (a plain barrier beside a sum, or chunks of other sizes)."""
    if all(m is None for m in metas):
        return None
    vectors = [decode(m["sum"]) if m is not None else None for m in metas]
    shapes = [(m["of"], v.size) if m is not None and v is not None else None for m, v in zip(metas, vectors)]
    if len(set(shapes)) > 1:
        raise ValueError("the workers met at a barrier with different sums (values in all, in this chunk): "
                         + ", ".join(f"{n} {s or 'none'}" for n, s in zip(names, shapes)))
    return {"sum": encode(total([v for v in vectors if v is not None])), "of": shapes[0][0]}
