"""A row-sparse key's shard on a server: its rows as one dense (local rows, width) array of the
table's dtype (float32, or float16: drawn in float32, then rounded).

A server makes its shard from the table's description an INIT carries (tfkv.ps.schema's
"table": rows, width, which shard of how many, the sharding, and how to fill it) and never from
values a worker ships, unless an INIT names rows with their values. A `uniform` or `normal`
table is drawn in blocks of BLOCK global rows, each block from (seed, key id, block), so a row's
initial value does not depend on how many servers there are nor on the sharding: a job of one
server and one of four, by range or by hash, start from the same table.

Requests name global row ids (the protocol's rows frame); `local` maps them to this shard's rows
and refuses any that is not one of them. `merge` sums the rows of a round (or of one push) per
unique id. No TensorFlow here.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from tfkv.ps.parts import RowPlacement

BLOCK = 1 << 16  # global rows drawn from one seed (a uniform/normal table)


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):  # not every platform says
        return 1 << 62


class Shard:
    """The rows of one row-sparse key that this server holds."""

    def __init__(self, key: int, table: Mapping[str, Any]):
        self.key = key
        self.width = int(table["width"])
        self.server = int(table["shard"])
        self.placement = RowPlacement(int(table["rows"]), int(table["shards"]), table["sharding"])
        if self.server >= self.placement.servers:
            raise ValueError(f"shard {self.server} of a table of {self.placement.servers} shards")
        self.rows = self.placement.shard_rows(self.server)
        self.dtype = np.dtype(table.get("dtype", "float32"))
        nbytes = self.rows * self.width * self.dtype.itemsize
        if nbytes > _memory_bytes():
            raise ValueError(f"a shard of {self.rows} rows of {self.width} values ({nbytes} bytes) is more than "
                             "this server's memory: use more servers")
        made = self._made(table["init"], float(table["scale"]), int(table["seed"]))
        self.value = made if self.dtype == made.dtype else made.astype(self.dtype)

    def describes(self, table: Mapping[str, Any]) -> bool:
        """Whether `table` is this shard's description (as far as its shape and place go)."""
        return (self.width, self.server, self.placement, self.dtype) == (
            table["width"], table["shard"], RowPlacement(table["rows"], table["shards"], table["sharding"]),
            np.dtype(table.get("dtype", "float32")))

    def _made(self, init: str, scale: float, seed: int) -> np.ndarray:
        if init == "zeros" or not self.rows:
            return np.zeros((self.rows, self.width), np.float32)
        out = np.empty((self.rows, self.width), np.float32)
        p, s = self.placement, self.server
        if p.sharding == "range":
            first, last = p.start(s), p.start(s) + self.rows  # global rows [first, last)
        else:
            first, last = s, p.rows
        for block in range(first // BLOCK, (last - 1) // BLOCK + 1):
            lo, hi = block * BLOCK, min(p.rows, (block + 1) * BLOCK)
            rng = np.random.default_rng([seed, self.key, block])
            if init == "uniform":
                drawn = rng.random((hi - lo, self.width), dtype=np.float32)
                drawn *= np.float32(2 * scale)
                drawn -= np.float32(scale)
            else:
                drawn = rng.standard_normal((hi - lo, self.width), dtype=np.float32)
                drawn *= np.float32(scale)
            if p.sharding == "range":
                a, b = max(lo, first), min(hi, last)
                out[a - first:b - first] = drawn[a - lo:b - lo]
            else:
                start = (s - lo) % p.servers  # the block's first row on this server
                mine = np.arange(lo + start, hi, p.servers)
                out[mine // p.servers] = drawn[start::p.servers]
        return out

    def local(self, ids: np.ndarray) -> np.ndarray:
        """This shard's rows of global `ids`; ValueError naming the first that is not one."""
        return self.placement.local(self.server, ids)

    def rows_of(self, ids: np.ndarray, data: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(local rows, values as (n, width)) of a request naming `ids` with `data`; ValueError
        when they do not fit this key."""
        if data is None:
            raise ValueError("row ids without their values")
        if data.dtype != self.dtype:
            raise ValueError(f"a {data.dtype.name} payload; this row-sparse key is {self.dtype.name}")
        if data.size != len(ids) * self.width:
            raise ValueError(f"{data.size} values for {len(ids)} rows of {self.width}")
        return self.local(ids), data.reshape(len(ids), self.width)

    def gather(self, local: np.ndarray) -> np.ndarray:
        """The values of `local` rows, flat: a fresh array (the shard is updated in place)."""
        return self.value[local].reshape(-1)


def merge(local: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique rows ascending, the sum of `rows` per unique row): duplicates summed."""
    if len(local) == 0:
        return local.astype(np.int64), rows.reshape(0, rows.shape[1] if rows.ndim == 2 else 0)
    order = np.argsort(local, kind="stable")
    ids = local[order]
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    if len(starts) == len(ids):  # no duplicates: the rows in order, as they are
        return ids, rows[order]
    return ids[starts], np.add.reduceat(rows[order], starts, axis=0)
