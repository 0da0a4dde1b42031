"""How a key's value is laid out on the servers, and how a pulled key is put back together.

A key lives on one server, picked as MXNet does (`key * 9973 % num_servers`), unless it holds
more than the big-array bound, in which case it is cut into one contiguous part per server; a
part over the chunk size is cut into chunks, each its own key on its server (`plan`). A `Pull`
collects a key's parts as their replies arrive and writes the value where the caller asked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, NamedTuple

import numpy as np

from tfkv.ps import dtypes

NAMED_KEY_BASE = 1 << 40  # keys that are not ints in [0, 2**40) get ids from here, in init order
CHUNK_SHIFT = 48  # chunk j > 0 of key id k is key k + (j << 48) on its server (ids stay < 2**48)


class Part(NamedTuple):
    """One part of a key: `[start, end)` of its flat value, held by `server` under `skey`."""

    server: int
    start: int
    end: int
    skey: int  # the server-side key: the key id, plus the chunk's index << CHUNK_SHIFT


@dataclass
class Layout:
    shape: tuple[int, ...]
    size: int
    parts: list[Part]  # over the flat value, in order
    dtype: np.dtype = dtypes.FLOAT32  # the key's (tfkv.ps.dtypes): float32, float16 or bfloat16
    fusable: bool = False  # may travel in a fused PUSHPULL (the worker's store decides, at init)


@dataclass
class Pull:
    """A key's pull requests in flight: `seqs` holds the sequence number of each of the layout's parts.

    `outs` are where the value goes: TensorFlow variables (assigned) or numpy arrays (writable,
    of the key's shape, a dtype the key's casts to: cast as MXNet's CopyFromTo does). The first
    C-contiguous one of the key's dtype receives
    the parts directly as they arrive (MXNet's `pull(key, out=array)`: no allocation per pull);
    without one, a key of one part is the reply's own read-only buffer (no copy) and a key of
    several parts is assembled in a fresh array."""

    key: Hashable
    layout: Layout
    outs: list[Any] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    value: np.ndarray | None = None  # once every part has arrived
    landed: bool = False  # a part's reply may be opened in its place (the worker transport's landing)

    def __post_init__(self) -> None:
        # Checked here, before anything is sent, so that a refused out leaves no request (nor a
        # sync round) half done. Arrays of another dtype or layout are copied into on delivery
        # (np.copyto, as LocalStore does), so every store type takes the same outs.
        self._dest = None
        for o in self.outs:
            if isinstance(o, np.ndarray):
                flags = o.flags
                if o.shape != self.layout.shape or not flags.writeable or not _castable(self.layout.dtype, o.dtype):
                    raise ValueError(f"pull of key {self.key!r}: out array is {o.dtype}{list(o.shape)}, expected "
                                     f"a writable float{list(self.layout.shape)}")
                if self._dest is None and o.dtype == self.layout.dtype and flags.c_contiguous:
                    self._dest = o

    def expect(self, seqs: list[int]) -> None:
        """The requests sent for this pull's parts, one per part of the layout, in its order."""
        self.seqs, self._left = seqs, len(seqs)
        self._spans = dict(zip(seqs, self.layout.parts))
        if self._dest is None and self._left > 1:
            self._dest = np.empty(self.layout.shape, self.layout.dtype)

    def destinations(self) -> Iterator[tuple[int, np.ndarray]]:
        """(seq, where its part of the value goes) for each part that has a place to go: its
        reply may be opened there."""
        if self._dest is not None:
            flat = self._dest.reshape(-1)
            for seq, part in zip(self.seqs, self.layout.parts):
                yield seq, flat[part.start:part.end]

    def arrive(self, seq: int, data: np.ndarray) -> bool:
        """Take one part's reply; True once the value is complete."""
        self._left -= 1
        if self._dest is None:  # one part, nowhere given: the reply's own buffer
            self.value = data.reshape(self.layout.shape)
            return True
        part = self._spans[seq]
        dest = self._dest.reshape(-1)[part.start:part.end]
        if not (self.landed and data.__array_interface__["data"][0] == dest.__array_interface__["data"][0]):
            dest[...] = data  # each part copied in as it comes, unless it was opened there
        if self._left:
            return False
        self.value = self._dest
        return True

    def deliver(self) -> None:
        """Copy the complete value into every other out."""
        for o in self.outs:
            if o is self._dest:
                continue
            if isinstance(o, np.ndarray):
                np.copyto(o, self.value)
            elif o.dtype == self.value.dtype:
                o.assign(self.value)
            else:  # a variable of another dtype: cast, as MXNet's CopyFromTo
                o.assign(self.value.astype(o.dtype.as_numpy_dtype))


@functools.lru_cache(maxsize=None)
def _castable(src: np.dtype, dst: np.dtype) -> bool:
    # A pull of a model's keys asks this per key and step, for a few dtypes: np.can_cast is slow for that.
    return bool(np.can_cast(src, dst, "same_kind"))


def plan(kid: int, shape: tuple[int, ...], servers: int, bigarray_bound: int, chunk_bytes: int,
         dtype: np.dtype = dtypes.FLOAT32) -> Layout:
    """Where each part of key id `kid` (of `dtype`) goes, as `Part`s in order."""
    size = int(np.prod(shape))
    n = servers
    if size < bigarray_bound or n == 1:
        spans = [((kid * 9973) % n, 0, size)]
    else:
        spans = [(i, i * size // n, (i + 1) * size // n) for i in range(n)]
    per_chunk = max(1, chunk_bytes // dtype.itemsize)
    parts = []
    for server, a, b in spans:
        pieces = max(1, -(-(b - a) // per_chunk))
        for j in range(pieces):
            lo, hi = a + j * (b - a) // pieces, a + (j + 1) * (b - a) // pieces
            parts.append(Part(server, lo, hi, kid + (len(parts) << CHUNK_SHIFT)))
    return Layout(shape, size, parts, dtype)
