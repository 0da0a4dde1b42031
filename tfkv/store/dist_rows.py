"""Row-sparse keys of the dist stores: the `RowSparseKeys` part of `tfkv.store.dist.DistStore`.

A row-sparse key (initialised with a `tfkv.store.RowSparse` or a `Table`, tfkv.store.sparse) is
a table sharded by rows over every server (`parts.RowPlacement`, kvstore.row_sharding: range or
hash): a Table is made by the servers themselves, each its shard, from the seed (never on a
worker), a RowSparse is sent as rows in chunks of at most kvstore.chunk_bytes. A push of rows (a
RowSparse or tf.IndexedSlices, one per device) is summed here sparsely (duplicates merged) and
goes only to the servers that own rows of it, as one PUSH each (rows frame and values), except
that in a synchronous job every server gets one, with no rows if it owns none, so that each
server's round closes. `row_sparse_pull` asks each owning server for its unique rows in chunks
of at most kvstore.chunk_bytes; `row_sparse_pull_async` sends those requests without waiting
(safe from a TensorFlow op's thread, under the link's lock) and `rows` takes them. In a
synchronous job a row pull sent after this worker's push of a round is answered once that round
closed, as a dense pull is. A key holds float32 or float16 (its init's dtype, or a Table's
`dtype`): its rows travel, and the servers keep them, in that dtype. `push_bytes` and
`pull_bytes` count the payload bytes sent and asked for (row ids included).
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np

from tfkv.ps import protocol as P
from tfkv.ps.parts import RowPlacement, row_chunks
from tfkv.store import sparse
from tfkv.store.base import Key
from tfkv.store.sparse import RowSparse, Table


class TableKey(NamedTuple):
    """A row-sparse key as a worker knows it: its dense shape and where its rows are."""

    shape: tuple[int, ...]
    width: int  # values per row
    placement: RowPlacement
    dtype: np.dtype  # float32 or float16


class RowPull(NamedTuple):
    """One key's row pull in flight: its unique ids, and each request with the positions (in
    those ids) of the rows it asked for."""

    key: Hashable
    table: TableKey
    ids: np.ndarray
    requests: list[tuple[int, np.ndarray]]


class RowPulls(NamedTuple):
    """What row_sparse_pull_async returns and `rows` takes: the caller's key argument, what was
    asked for each key (sparse.Asked) and its pulls (one per array of ids, in that order)."""

    key: Any
    asked: list[sparse.Asked]
    pulls: list[RowPull]


class RowSparseKeys:
    """DistStore's row-sparse calls. It keeps its tables in `_tables` (id -> TableKey) and uses
    the store's `servers`, `env`, `sync`, `rank`, `_ids`, `_id`, `_layouts`, `_sender`,
    `_ordered`, `_check_key`, `push_bytes` and `pull_bytes`."""

    _tables: dict[int, TableKey]

    def is_row_sparse(self, key: Key) -> bool:
        kid = self._ids.get(key) if isinstance(key, (int, str, np.integer)) else None
        return kid is not None and kid in self._tables

    def _table(self, key: Key, what: str = "sparse_pull") -> tuple[int, TableKey]:
        kid = self._ids.get(key) if isinstance(key, (int, str, np.integer)) else None
        table = self._tables.get(kid)  # type: ignore[arg-type]
        if table is None:
            if kid is not None and kid in self._layouts:
                raise sparse.refused(what, key)
            self._check_key(key)
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first")
        return kid, table  # type: ignore[return-value]

    def _init_table(self, k: Key, value: Any) -> None:
        """Make `k` a table on every server: each server makes its shard from the description
        (a Table's init, or zeros), then a RowSparse's rows are sent in chunks to their owners."""
        self._check_key(k)
        if k in self._ids:
            raise ValueError(f"key {k!r} is already initialised")
        if isinstance(value, Table):
            dtype = np.dtype(value.dtype)
            shape, rows, spec = value.shape, None, {"init": value.init, "scale": float(value.scale),
                                                    "seed": int(value.seed) % (1 << 63)}
        else:
            given = RowSparse.of(value)
            dtype = sparse.check_table_dtype(k, np.asarray(given.data).dtype)
            rows = sparse.check_rows(k, given, given.shape, dtype, what="init")  # on every worker: the same refusals
            shape, spec = given.shape, {"init": "zeros", "scale": 0.0, "seed": 0}
        if len(shape) < 1 or shape[0] < 1:
            raise ValueError(f"init of key {k!r}: a table of shape {shape}; give (rows, *row_shape)")
        width = int(np.prod(shape[1:], dtype=np.int64))
        placement = RowPlacement(shape[0], self.servers.count, self.env.row_sharding)
        kid = self._id(k)  # once the value was found good: a refused init leaves no key behind
        self._tables[kid] = TableKey(tuple(shape), width, placement, dtype)
        if self.rank == 0:  # worker 0's value wins; the others wait at the barrier
            for s in range(self.servers.count):
                meta = {"table": {"rows": shape[0], "width": width, "shard": s, "shards": self.servers.count,
                                  "sharding": placement.sharding, "dtype": dtype.name, **spec}}
                self.servers.request(s, P.Message(P.Type.INIT, key=kid, meta=meta))
            if rows is not None:
                self._send_rows(kid, rows.merged())

    def set_rows(self, key: Key, rows: Any) -> None:
        kid, table = self._table(key, "sparse_pull")
        given = sparse.check_rows(key, RowSparse.of(rows, table.shape), table.shape, table.dtype, what="set_rows")
        if self.rank == 0:  # worker 0's rows win, as with init; the caller's barrier waits for them
            self._send_rows(kid, given)
            self.servers.settle()

    def _send_rows(self, kid: int, rows: RowSparse) -> None:
        """Rows (ids unique) of table `kid` to their owners, in chunks of at most chunk_bytes."""
        table = self._tables[kid]
        data = np.ascontiguousarray(rows.data, table.dtype).reshape(len(rows.indices), table.width)
        for s, positions in enumerate(table.placement.split(rows.indices)):
            for chunk in row_chunks(len(positions), table.width, self.env.chunk_bytes):
                at = positions[chunk]
                self.servers.request(s, P.Message(P.Type.INIT, key=kid, rows=rows.indices[at],
                                                  data=data[at].reshape(-1)))

    def _push_rows(self, k: Key, values: list[Any]) -> None:
        """This machine's rows of `k` (one value per device) summed sparsely, then one PUSH to
        each server owning some (every server, in a synchronous job)."""
        kid, table = self._table(k)
        if self._sender is not None:
            raise sparse.refused("compression", k)
        if not values or not all(sparse.is_rows(v) for v in values):
            raise sparse.refused("dense_push", k)
        given = [sparse.check_rows(k, RowSparse.of(v, table.shape), table.shape, table.dtype) for v in values]
        if len(given) == 1:
            rows = given[0].merged()
        else:
            rows = RowSparse(np.concatenate([np.asarray(g.data) for g in given]),
                             np.concatenate([g.indices for g in given]), table.shape).merged()
        data = np.ascontiguousarray(rows.data, table.dtype).reshape(len(rows.indices), table.width)
        with self.servers.lock:  # one push's messages together, whichever thread pushes (a TensorFlow op's)
            for s, positions in enumerate(table.placement.split(rows.indices)):
                if not len(positions) and not self.sync:
                    continue  # travels only to the servers that own rows of it
                ids, part = rows.indices[positions], data[positions].reshape(-1)
                self.push_bytes += ids.nbytes + part.nbytes
                self.servers.push(s, P.Message(P.Type.PUSH, key=kid, rows=ids, data=part))

    def row_sparse_pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0,
                        row_ids: Any = None) -> Any:
        """MXNet's: every key's rows requested (from the servers that own them) before any is awaited."""
        pending = self._request_rows(key, sparse.requests(key, row_ids, out), priority)
        return sparse.deliver(key, pending.asked, self._arrived_rows(pending), out)

    def _pull_rows(self, key: Key, row_ids: Any) -> RowSparse:
        return self._arrived_rows(self.row_sparse_pull_async(key, row_ids))[0]

    def row_sparse_pull_async(self, key: Key | Sequence[Key], row_ids: Any, priority: int | Sequence[int] = 0) -> Any:
        """Send each key's row requests now, without waiting (safe from a TensorFlow op's thread);
        `rows` takes the answer. In a synchronous job, asked after this worker's push of a round,
        the rows include that round's update."""
        return self._request_rows(key, sparse.requests(key, row_ids), priority)

    def _request_rows(self, key: Any, asked: list[sparse.Asked], priority: int | Sequence[int]) -> RowPulls:
        """Every array of ids of `asked` requested from the servers owning its rows, keys in
        priority order; the pulls come back in `asked`'s order."""
        pulls: dict[int, list[RowPull]] = {}
        with self.servers.lock:
            self.servers.fence()
            for i, _ in self._ordered([(i, []) for i in range(len(asked))], priority):
                k = asked[i].key
                kid, table = self._table(k, "sparse_pull")
                pulls[i] = [self._request_table_rows(k, kid, table, ids) for ids in asked[i].row_ids]
            self.servers.flush()
        return RowPulls(key, asked, [p for i in range(len(asked)) for p in pulls[i]])

    def _request_table_rows(self, k: Key, kid: int, table: TableKey, row_ids: Any) -> RowPull:
        unique = np.unique(sparse.check_ids(k, row_ids, table.shape[0]))
        requests = []
        for s, positions in enumerate(table.placement.split(unique)):
            for chunk in row_chunks(len(positions), table.width, self.env.chunk_bytes):
                at = positions[chunk]
                self.pull_bytes += at.size * (8 + table.dtype.itemsize * table.width)
                requests.append((self.servers.request(s, P.Message(P.Type.PULL, key=kid, rows=unique[at])), at))
        return RowPull(k, table, unique, requests)

    def rows(self, pending: Any) -> Any:
        """What row_sparse_pull would have returned for the request `pending` stands for."""
        return sparse.deliver(pending.key, pending.asked, self._arrived_rows(pending), None)

    def _arrived_rows(self, pending: RowPulls) -> list[RowSparse]:
        self.servers.wait([seq for pull in pending.pulls for seq, _ in pull.requests])
        results = []
        for pull in pending.pulls:
            data = np.empty((len(pull.ids), pull.table.width), pull.table.dtype)
            for seq, at in pull.requests:
                reply = self.servers.take(seq)
                if reply.data is None or reply.data.size != at.size * pull.table.width:
                    raise RuntimeError(f"row_sparse_pull of key {pull.key!r}: a server answered "
                                       f"{0 if reply.data is None else reply.data.size} values for {at.size} rows")
                data[at] = reply.data.reshape(at.size, pull.table.width)
            results.append(RowSparse(data.reshape((len(pull.ids), *pull.table.shape[1:])), pull.ids, pull.table.shape))
        return results

