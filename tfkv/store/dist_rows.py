"""Row-sparse keys of the dist stores: what `tfkv.store.dist.DistStore`'s row calls share.

A row-sparse key (initialised with a `tfkv.store.RowSparse` or a `Table`, tfkv.store.sparse) is
a table sharded by rows over every server (`parts.RowPlacement`, kvstore.row_sharding: range or
hash): a Table is made by the servers themselves, each its shard, from the seed (never on a
worker), a RowSparse is sent as rows in chunks of at most kvstore.chunk_bytes. A push of rows (a
RowSparse or tf.IndexedSlices, one per device) is summed here sparsely (duplicates merged) and
goes only to the servers that own rows of it, as one PUSH each (rows frame and values), except
that in a synchronous job every server gets one, with no rows if it owns none, so that each
server's round closes. `row_sparse_pull` asks each owning server for its unique rows in chunks
of at most kvstore.chunk_bytes; `row_sparse_pull_async` sends those requests without waiting
(safe from a TensorFlow op's thread, under the link's lock) and `rows` takes them, each
completed as a dense pull is (`KVWorker.gather`), into the one array its rows land in. In a
synchronous job a row pull sent after this worker's push of a round is answered once that round
closed, as a dense pull is. A key holds float32 or float16 (its init's dtype, or a Table's
`dtype`): its rows travel, and the servers keep them, in that dtype. `push_bytes` and
`pull_bytes` count the payload bytes sent and asked for (row ids included).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from tfkv.ps.kvworker import KVWorker
from tfkv.ps.parts import RowPull, TableLayout
from tfkv.store import sparse
from tfkv.store.base import Key
from tfkv.store.dist_keys import Keys
from tfkv.store.sparse import RowSparse


class RowPulls(NamedTuple):
    """What row_sparse_pull_async returns and `rows` takes: the caller's key argument, what was
    asked for each key (sparse.Asked) and its pulls (one per array of ids, in that order)."""

    key: Any
    asked: list[sparse.Asked]
    pulls: list[RowPull]


def pushed(k: Key, values: list[Any], table: TableLayout) -> RowSparse:
    """This machine's rows of `k` (one value per device) summed sparsely (duplicates merged)."""
    if not values or not all(sparse.is_rows(v) for v in values):
        raise sparse.refused("dense_push", k)
    given = [sparse.check_rows(k, RowSparse.of(v, table.shape), table.shape, table.dtype) for v in values]
    if len(given) == 1:
        return given[0].merged()
    return RowSparse(np.concatenate([np.asarray(g.data) for g in given]),
                     np.concatenate([g.indices for g in given]), table.shape).merged()


def request(keys: Keys, worker: KVWorker, key: Any, asked: list[sparse.Asked], order: Sequence[int],
            chunk_bytes: int) -> RowPulls:
    """Every array of ids of `asked` requested from the servers owning its rows, keys in
    `order` (positions in `asked`, by priority); the pulls come back in `asked`'s order."""
    pulls: dict[int, list[RowPull]] = {}
    with worker.link.lock:
        worker.link.fence()
        for i in order:
            k = asked[i].key
            kid, table = keys.table(k, "sparse_pull")
            pulls[i] = [worker.pull_rows(k, kid, table, np.unique(sparse.check_ids(k, ids, table.shape[0])),
                                         chunk_bytes) for ids in asked[i].row_ids]
        worker.link.flush()
    return RowPulls(key, asked, [p for i in range(len(asked)) for p in pulls[i]])


def arrived(worker: KVWorker, pending: RowPulls) -> list[RowSparse]:
    """Each pull's rows, once all have arrived."""
    for _ in worker.gather(pending.pulls):
        pass
    return [RowSparse(p.data.reshape((len(p.ids), *p.table.shape[1:])), p.ids, p.table.shape) for p in pending.pulls]
