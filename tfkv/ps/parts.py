"""How a key's value is laid out on the servers, and how a pulled key is put back together.

A key lives on one server, picked as MXNet does (`key * 9973 % num_servers`), unless it holds
more than the big-array bound, in which case it is cut into one contiguous part per server; a
part over the chunk size is cut into chunks, each its own key on its server (`plan`). A `Pull`
collects a key's parts as their replies arrive and writes the value where the caller asked.

A row-sparse key (a table) is placed by rows instead (`RowPlacement`): every server holds a
shard of its rows, by `range` (server s the rows [s*N//S, (s+1)*N//S)) or by `hash` (row r on
server r % S, its local row r // S); the knob kvstore.row_sharding (TFKV_ROW_SHARDING) picks.
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
    fusable: bool = False  # may travel in a fused PUSHPULL (KVWorker.plan decides, once)


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


SHARDINGS = ("range", "hash")


@dataclass(frozen=True)
class RowPlacement:
    """Where each row of a row-sparse key of `rows` rows lives over `servers` servers, and its
    row on that server (its local row): the worker cuts requests by it, a server maps the
    global ids it is sent to its shard's rows by it."""

    rows: int
    servers: int
    sharding: str = "range"

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"kvstore.row_sharding (TFKV_ROW_SHARDING) is {self.sharding!r}: use range or hash")
        if self.rows < 1 or self.servers < 1:
            raise ValueError(f"a row-sparse key of {self.rows} rows over {self.servers} servers")

    def start(self, server: int) -> int:
        """range: the first global row of `server`'s shard."""
        return server * self.rows // self.servers

    def shard_rows(self, server: int) -> int:
        """How many rows `server` holds."""
        if self.sharding == "hash":
            return max(0, (self.rows - server + self.servers - 1) // self.servers)
        return self.start(server + 1) - self.start(server)

    def server_of(self, ids: np.ndarray) -> np.ndarray:
        """The server of each of `ids` (valid global rows)."""
        if self.sharding == "hash":
            return ids % self.servers
        # the last server whose range starts at or before each id (empty ranges share a start)
        starts = np.array([self.start(s) for s in range(self.servers)], np.int64)
        return np.searchsorted(starts, ids, side="right") - 1

    def local(self, server: int, ids: np.ndarray) -> np.ndarray:
        """The local rows of `ids` on `server`; ValueError unless every one is a row of its shard."""
        ids = np.asarray(ids, np.int64)
        if self.sharding == "hash":
            local, wrong = ids // self.servers, (ids < 0) | (ids >= self.rows) | (ids % self.servers != server)
        else:
            local = ids - self.start(server)
            wrong = (local < 0) | (local >= self.shard_rows(server))
        if wrong.any():
            bad = int(ids[np.argmax(wrong)])
            raise ValueError(f"row id {bad} is not a row of shard {server} of a table of {self.rows} rows")
        return local

    def global_ids(self, server: int, local: np.ndarray) -> np.ndarray:
        """The global rows of `server`'s local rows."""
        local = np.asarray(local, np.int64)
        return local * self.servers + server if self.sharding == "hash" else local + self.start(server)

    def split(self, ids: np.ndarray) -> list[np.ndarray]:
        """For each server, the positions in `ids` of the rows it holds (in the order of `ids`)."""
        servers = self.server_of(np.asarray(ids, np.int64))
        if self.servers == 1:
            return [np.arange(len(servers))]
        order = np.argsort(servers, kind="stable")
        bounds = np.searchsorted(servers[order], np.arange(self.servers + 1))
        return [order[bounds[s]:bounds[s + 1]] for s in range(self.servers)]


def row_chunks(n: int, width: int, chunk_bytes: int, per_row: int = 1) -> list[slice]:
    """Slices of n rows of `width` float32 values (times `per_row` arrays, an optimizer's states)
    that each fit in chunk_bytes (at least one row each)."""
    step = max(1, chunk_bytes // max(1, width * 4 * per_row))
    return [slice(a, min(n, a + step)) for a in range(0, n, step)]


class TableLayout(NamedTuple):
    """A row-sparse key as a worker knows it: its dense shape and where its rows are."""

    shape: tuple[int, ...]
    width: int  # values per row
    placement: RowPlacement
    dtype: np.dtype  # float32 or float16


class RowPull:
    """One key's row pull in flight, completed as a `Pull` is (ServerLink.gather): its unique
    `ids`, and each request with the positions (in those ids) of the rows it asked for. Each
    reply goes into `data` at its positions as it arrives (or is opened there: a contiguous
    run of positions, the `range` sharding's, is a place a secure reply lands in); `value` is
    then the RowSparse-like (data, ids) the store hands on."""

    landed = False  # a part's reply may be opened in its place (the worker transport's landing)

    def __init__(self, key: Hashable, table: TableLayout, ids: np.ndarray):
        self.key, self.table, self.ids = key, table, ids
        self.requests: list[tuple[int, np.ndarray]] = []
        self.data = np.empty((len(ids), table.width), table.dtype)
        self.value: np.ndarray | None = None

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.requests]

    def expect(self, requests: list[tuple[int, np.ndarray]]) -> None:
        """The requests sent: (seq, positions of the rows it asked for)."""
        self.requests, self._left = requests, len(requests)
        self._at = dict(requests)
        if not requests:
            self.value = self.data

    def destinations(self) -> Iterator[tuple[int, np.ndarray]]:
        """(seq, where its rows go) for each request whose rows are one contiguous run of `data`."""
        for seq, at in self.requests:
            if len(at) and at[-1] - at[0] == len(at) - 1:  # positions only ever rise: a run
                yield seq, self.data[at[0]:at[-1] + 1].reshape(-1)

    def arrive(self, seq: int, data: np.ndarray | None) -> bool:
        """Take one request's rows; True once every row has arrived."""
        at = self._at[seq]
        if data is None or data.size != at.size * self.table.width:
            raise RuntimeError(f"row_sparse_pull of key {self.key!r}: a server answered "
                               f"{0 if data is None else data.size} values for {at.size} rows")
        if not (self.landed and len(at) and data.__array_interface__["data"][0]
                == self.data[at[0]:].__array_interface__["data"][0]):
            self.data[at] = data.reshape(at.size, self.table.width)  # unless it was opened there
        self._left -= 1
        if self._left:
            return False
        self.value = self.data
        return True

    def deliver(self) -> None:
        """Nothing to copy: the rows are in `data`, the one place they land."""
