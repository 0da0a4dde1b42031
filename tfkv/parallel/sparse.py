"""Row-sparse training: embedding tables held by the KVStore as row-sparse keys, each batch's rows
loaded before it reads them, the rows it touched pushed as rows (MXNet's row_sparse weights).

Which layers: every `tfkv.layers.ShardedEmbedding` (its copies hold a cache of `rows_per_batch`
rows, the table is a `tfkv.store.Table` key the store makes), and with `kvstore.row_sparse` every
`keras.layers.Embedding` (its copies keep the whole table, initialised into the store from the
first copy's weights; only the rows a batch reads are refreshed from the store). A table's
gradient leaves the compiled step as (rows, their table ids), summed per id on each device, and
is pushed as one `RowSparse` per device; the store sums them and updates only those rows.

Which rows a batch reads: for a functional or Sequential model a probe
(`keras.Model(model.inputs, [layer.input, ...])`) computes each table's ids from the batch, so
the rows of batch n+1 are requested (`row_sparse_pull_async`) while batch n computes and taken
(`rows`) when n+1 starts. A synchronous store is asked after this worker's push of round n (its
servers answer once the round closes: the rows include round n's update); dist_async is asked
before batch n computes. Without a probe (a subclassed model, a layer shared between calls) a
ShardedEmbedding fetches its rows at lookup time, and a Keras Embedding's copies take back the
rows they pushed, which is exact for one worker only (more are refused).
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfkv.errors import ConfigError, DataError
from tfkv.layers import ShardedEmbedding
from tfkv.store import npz
from tfkv.store.base import KVStore
from tfkv.store.sparse import RowSparse, Table

log = logging.getLogger("tfkv")

@dataclass
class SparseTable:
    """One embedding table: its store key and the layer in every copy of the model."""

    key: int
    copies: list[Any]  # the layer in each replica
    sharded: bool  # a ShardedEmbedding's cache of rows (else the whole table on every copy)

    @property
    def shape(self) -> tuple[int, int]:
        layer = self.copies[0]
        return (int(layer.input_dim), int(layer.output_dim))

    @property
    def name(self) -> str:
        return self.copies[0].name

    @property
    def label(self) -> str:
        """What the store's messages call its key: the user's layer, not the key's number."""
        return f"layer {self.name} ({'tfkv.layers.ShardedEmbedding' if self.sharded else 'keras.layers.Embedding'})"

    def variable(self, r: int) -> Any:
        """The trainable variable of copy `r` (the cache, or the whole table)."""
        return self.copies[r].embeddings

    def global_rows(self, r: int, grad: Any) -> tuple[Any, Any]:
        """Traceable: copy `r`'s gradient as (rows, table ids), each id once (rows summed)."""
        if grad is None:  # the table did not take part in the loss
            return tf.zeros([0, self.shape[1]], tf.float32), tf.zeros([0], tf.int64)
        if isinstance(grad, tf.IndexedSlices):
            values, ids = grad.values, tf.cast(grad.indices, tf.int64)
        else:  # a layer whose gradient is dense (models.lstm_lm's): the rows it touched
            ids = tf.where(tf.reduce_any(tf.not_equal(grad, 0), axis=-1))[:, 0]
            values = tf.gather(grad, ids)
        if self.sharded:  # a slot of the cache -> the table row it holds
            ids = tf.gather(tf.convert_to_tensor(self.copies[r].row_ids.value), ids)
        unique, where = tf.unique(ids)
        return tf.math.unsorted_segment_sum(values, where, tf.shape(unique)[0]), unique


@dataclass
class Prefetch:
    """Rows requested for a batch not yet stepped: `x` is that batch (matched by identity)."""

    x: Any
    pending: list[Any] = field(default_factory=list)  # per table: what `store.rows` takes
    refused: DataError | None = None  # the batch's ids do not fit a table: raised when it is taken


def find(replicas: Sequence[Any], row_sparse: bool, first_key: int) -> list[SparseTable]:
    """The model's row-sparse tables, keys from `first_key` in layer order."""
    per_copy = [[layer for layer in m._flatten_layers(include_self=False)
                 if isinstance(layer, ShardedEmbedding) or (row_sparse and isinstance(layer, keras.layers.Embedding))]
                for m in replicas]
    return [SparseTable(first_key + j, list(copies), isinstance(copies[0], ShardedEmbedding))
            for j, copies in enumerate(zip(*per_copy))]


class Tables:
    """The row-sparse tables of a data-parallel model and what moves their rows."""

    def __init__(self, tables: list[SparseTable], replicas: Sequence[Any], store: KVStore) -> None:
        self.tables = tables
        self.store = store
        store.name_keys({t.key: t.label for t in tables})  # its errors about a table name the layer
        self._prefetch: Prefetch | None = None
        self.fixed: dict[int, Any] = {}  # read-only tables (eval_only): rows read from them, not the store
        # A traceable store (local, device) pushes inside the compiled step and its rows are
        # pulled and loaded by one compiled call; others move numpy rows, loaded by one too.
        self.traced = bool(store.traceable)
        self._pull_and_assign = tf.function(self._pull_and_assign_rows, reduce_retracing=True)
        self._assign = tf.function(self._assign_rows, reduce_retracing=True)
        self.probe = self._make_probe(replicas[0])
        if self.probe is None:
            self._fetch_at_lookup()
        log.info("row-sparse tables in kvstore=%s: %s; %s", store.type, ", ".join(map(_described, tables)),
                 "each batch's rows requested while the one before computes" if self.probe is not None
                 else "rows fetched at lookup time")

    # -- what the trainer and DataParallel ask ----------------------------------------------------

    @property
    def sharded(self) -> bool:
        return any(t.sharded for t in self.tables)

    def is_table_variable(self, v: Any) -> bool:
        return any(v is t.variable(r) or (t.sharded and v is t.copies[r].row_ids)
                   for t in self.tables for r in range(len(t.copies)))

    def init(self, tables: dict[int, Any], read_only: bool = False) -> None:
        """Each table's key in the store: from `tables` (a checkpoint's, by table index: put back
        by row pieces, a memory-mapped table never read whole), else a ShardedEmbedding's Table
        (made by the store) or a Keras Embedding's first copy's weights. `read_only` (eval_only):
        `tables`' rows are read from them per batch, and the store never holds them."""
        if read_only:
            self.fixed, self.traced = tables, False
        for j, t in enumerate(self.tables):
            layer = t.copies[0]
            if j in tables:
                value = tables[j]
                if tuple(value.shape) != t.shape:
                    raise ValueError(f"table {t.name}: the checkpoint holds shape {tuple(value.shape)}, the layer {t.shape}")
                if not read_only:
                    self.store.init(t.key, Table(t.shape, init="zeros"))
                start = 0
                for piece in npz.pieces(value):
                    ids = np.arange(start, start + len(piece), dtype=np.int64)
                    if not read_only:
                        self.store.set_rows(t.key, RowSparse(np.asarray(piece, np.float32), ids, t.shape))
                    if not t.sharded:
                        for c in t.copies:
                            c.embeddings.value.scatter_update(tf.IndexedSlices(tf.constant(piece, tf.float32), ids))
                    start += len(piece)
                self.store.barrier()  # worker 0's rows are in the store before any worker pulls
            elif t.sharded:
                self.store.init(t.key, Table(t.shape, init=layer.init, scale=layer.scale, seed=layer.seed))
            else:
                value = np.asarray(layer.embeddings.numpy(), np.float32)
                self.store.init(t.key, RowSparse(value, np.arange(t.shape[0], dtype=np.int64), t.shape))
                for c in t.copies[1:]:
                    c.embeddings.assign(value)

    def before(self, x: Any, upcoming: Any) -> None:
        """Before batch `x` computes: its rows in every copy (prefetched, or pulled now); an
        asynchronous store is asked for `upcoming`'s rows at once."""
        if self.probe is None:
            return
        if self.traced:  # in this process: nothing to wait for, the rows are current when pulled
            self.load_for(x)
            return
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is None or prefetch.x is not x:
            prefetch = self._request(x)
        self._load(self._taken(prefetch))
        if upcoming is not None and not self.store.sync:
            self._prefetch = self._request(upcoming)

    def push_traced(self, rows: list[list[tuple[Any, Any]]]) -> None:
        """Traceable: push every device's rows of each table (a traceable store, in the step)."""
        for j, t in enumerate(self.tables):
            shape = tf.constant(t.shape, tf.int64)
            self.store.push(t.key, [tf.IndexedSlices(r[j][0], r[j][1], shape) for r in rows])

    def after(self, rows: list[list[tuple[Any, Any]]] | None, upcoming: Any) -> None:
        """After batch n computed: push its rows (`rows[d][j]`: device d's (rows, ids) of table
        j; None for a skipped step; a traceable store's were pushed in the step), then, with a
        synchronous store, ask for `upcoming`'s."""
        if rows is not None:
            if not self.traced:
                for j, t in enumerate(self.tables):
                    self.store.push(t.key, [RowSparse(np.asarray(r[j][0]), np.asarray(r[j][1]), t.shape)
                                            for r in rows])
            if self.probe is None:
                self._take_back(rows)
        if upcoming is not None and self.store.sync and self.probe is not None and not self.traced:
            self._prefetch = self._request(upcoming)

    def load_for(self, x: Any) -> None:
        """The rows batch `x` reads, pulled now, in every copy (evaluation)."""
        if self.probe is None:
            return
        if self.traced:
            self._pull_and_assign(self._ids(x))
        else:
            self._load(self._taken(self._request(x)))

    def rows_of(self, t: SparseTable) -> npz.Chunked:
        """Table `t` from the store as row pieces of about npz.PIECE_BYTES, pulled as they are
        read (a checkpoint writes them; the table is never whole here)."""
        rows, dim = t.shape

        def pulled() -> Iterator[np.ndarray]:
            for start, end in npz.spans(rows, dim):
                got = self.store.row_sparse_pull(t.key, row_ids=np.arange(start, end, dtype=np.int64))
                yield np.asarray(got.data, np.float32).reshape(end - start, dim)

        return npz.Chunked(t.shape, pulled)

    # -- ids, requests, loading -----------------------------------------------------------------

    def _make_probe(self, model: Any) -> Any:
        try:
            inputs = [layer.input for layer in (t.copies[0] for t in self.tables)]
            probe = keras.Model(model.inputs, inputs)
        except Exception as e:  # noqa: BLE001 - Keras's many ways of saying "not a graph of layers"
            log.info("row-sparse tables: the ids a batch reads cannot be computed ahead for this model (%s); "
                     "the rows are fetched at lookup time instead of while the previous batch computes",
                     str(e).splitlines()[0][:160] if str(e) else type(e).__name__)
            return None

        @tf.function(reduce_retracing=True)
        def ids(x: Any) -> list[Any]:
            out = probe(x, training=False)
            out = out if isinstance(out, (list, tuple)) else [out]
            return [tf.sort(tf.unique(tf.reshape(tf.cast(o, tf.int64), [-1])).y) for o in out]

        return ids

    def _ids(self, x: Any) -> list[Any]:
        """Each table's distinct ids of batch `x` (tensors, sorted), checked against its table and
        its cache."""
        ids = list(self.probe(x))
        for t, wanted in zip(self.tables, ids):
            _check_in_table(t, wanted)
            if t.sharded and int(tf.shape(wanted)[0]) > t.copies[0].rows_per_batch:
                raise ConfigError(f"ShardedEmbedding {t.name!r}: a batch reads {int(tf.shape(wanted)[0])} distinct "
                                  f"rows, more than its rows_per_batch={t.copies[0].rows_per_batch}; raise "
                                  f"rows_per_batch to at least that or lower batch_size")
        return ids

    def _request(self, x: Any) -> Prefetch:
        """Batch `x`'s rows of each table asked of the store (or read, for a read-only table).
        Ids that do not fit a table are refused when the batch is taken, at the start of its
        step, not while this step's own requests are in flight (a job would wait on them)."""
        try:
            ids = self._ids(x)
        except DataError as e:
            return Prefetch(x, refused=e)
        return Prefetch(x, [RowSparse(np.asarray(self.fixed[j][wanted.numpy()]), wanted.numpy(), t.shape)
                            if j in self.fixed else self.store.row_sparse_pull_async(t.key, row_ids=wanted.numpy())
                            for j, (t, wanted) in enumerate(zip(self.tables, ids))])

    def _taken(self, prefetch: Prefetch) -> list[RowSparse]:
        if prefetch.refused is not None:
            raise prefetch.refused
        return [p if j in self.fixed else self.store.rows(p) for j, p in enumerate(prefetch.pending)]

    def _load(self, rows: list[RowSparse]) -> None:
        """Pulled rows (numpy) into every copy, in one compiled call."""
        self._assign([tf.constant(np.asarray(got.indices, np.int64)) for got in rows],
                     [tf.constant(np.asarray(got.data, np.float32).reshape(-1, t.shape[1]))
                      for t, got in zip(self.tables, rows)])

    def _pull_and_assign_rows(self, ids: list[Any]) -> None:
        """Traced: a traceable store's rows `ids` of each table into every copy."""
        got = [self.store.row_sparse_pull(t.key, row_ids=i) for t, i in zip(self.tables, ids)]
        self._assign_rows([g.indices for g in got], [g.data for g in got])

    def _assign_rows(self, ids: list[Any], data: list[Any]) -> None:
        """Traced: rows `data` of table ids `ids` (unique, sorted) into every copy: a cache's
        slots (the rest padded: ids past the table, zero rows), or a whole table's rows."""
        for t, i, d in zip(self.tables, ids, data):
            i, d = tf.cast(i, tf.int64), tf.reshape(d, [-1, t.shape[1]])
            if t.sharded:
                pad = t.copies[0].rows_per_batch - tf.shape(i)[0]
                padded_ids = tf.concat([i, tf.fill([pad], tf.constant(t.shape[0], tf.int64))], 0)
                padded = tf.concat([d, tf.zeros([pad, t.shape[1]], tf.float32)], 0)
                for c in t.copies:
                    c.row_ids.assign(padded_ids)
                    c.embeddings.assign(padded)
            else:
                for c in t.copies:
                    c.embeddings.value.scatter_update(tf.IndexedSlices(d, i))

    def _take_back(self, rows: list[list[tuple[Any, Any]]]) -> None:
        """Without a probe, a whole-table copy takes back the rows it pushed (the only rows a
        store of one worker changed)."""
        for j, t in enumerate(self.tables):
            if t.sharded:
                continue
            ids = np.unique(np.concatenate([np.asarray(r[j][1], np.int64) for r in rows]))
            if len(ids):
                self._load_one(t, self.store.row_sparse_pull(t.key, row_ids=ids))

    def _load_one(self, t: SparseTable, got: RowSparse) -> None:
        update = tf.IndexedSlices(tf.constant(np.asarray(got.data, np.float32)),
                                  tf.constant(np.asarray(got.indices, np.int64)))
        for c in t.copies:
            c.embeddings.value.scatter_update(update)

    def _fetch_at_lookup(self) -> None:
        whole = [t.name for t in self.tables if not t.sharded]
        if whole and self.store.num_workers > 1:
            raise ConfigError(f"kvstore.row_sparse: the Embedding layers {', '.join(whole)} of this model (subclassed, "
                              f"or a layer called more than once) cannot have their rows refreshed ahead in a job of "
                              f"{self.store.num_workers} workers; build the model functionally (keras.Model(inputs, "
                              "outputs) or Sequential) or use tfkv.layers.ShardedEmbedding")
        for t in self.tables:
            if t.sharded:
                for c in t.copies:
                    c.fetch = _Fetcher(self.store, t)


def compression_refused(tables: Sequence[SparseTable], kind: str) -> ConfigError:
    """The one line refusing kvstore.compression for a model with row-sparse tables (the store
    pushes a table's rows uncompressed), naming the layers: tfkv-run's before a dist_* job's
    launch (tfkv.check.tables), the trainer's before the first step of a run in this process."""
    names = ", ".join(t.name for t in tables)
    which = f"layer {names} is a row-sparse table" if len(tables) == 1 else f"layers {names} are row-sparse tables"
    return ConfigError(f"kvstore.compression.type={kind} compresses dense gradients, but this model's {which} "
                       "(tfkv.layers.ShardedEmbedding), whose rows are pushed uncompressed: set "
                       "kvstore.compression.type=none, or use keras.layers.Embedding with kvstore.row_sparse=false")


def _check_in_table(t: SparseTable, wanted: Any) -> None:
    """Refuse ids (sorted) past table `t`'s rows in one line naming the layer, before the store is
    asked for them (it would refuse them by key number, from inside TensorFlow)."""
    if not int(tf.size(wanted)):
        return
    rows = t.shape[0]
    bad = [int(i) for i in (wanted[0], wanted[-1]) if not 0 <= int(i) < rows]
    if bad:
        raise beyond_table(t.name, bad[-1], rows)


def beyond_table(layer: str, row_id: int, rows: int) -> DataError:
    """The one line for data whose row id `row_id` is past the `rows` of embedding layer `layer`."""
    return DataError(f"embedding layer {layer!r}: the data has row id {row_id}, but the layer's table has {rows} rows "
                     f"(ids 0 to {rows - 1}); give the layer an input_dim above the data's largest id (e.g. "
                     "model.vocab_sizes as dataset.vocab_sizes), or map the ids into its rows")


# TensorFlow's words for a gather past a table (on CPU; a GPU gives zeros), and the op's scope
_GATHER_PAST = re.compile(r"indices\[[\d,]*\] = (-?\d+) is not in \[0, (\d+)\)\s*\[\[\{\{node ([^}]+)\}\}\]\]")


@contextlib.contextmanager
def ids_refusal(models: Sequence[Any]) -> Iterator[None]:
    """An embedding lookup past its table inside a compiled step (a table the probe does not
    see) as the one line `beyond_table` says: a ShardedEmbedding's lookup-time fetch keeps its
    refusal (raised inside TensorFlow, it comes back wrapped); a dense table's gather (on CPU)
    is found by the layer's name in the op's scope (Keras may add `_1` to it)."""
    try:
        yield
    except tf.errors.OpError as e:
        layers = [layer for m in models for layer in m._flatten_layers(include_self=False)
                  if isinstance(layer, keras.layers.Embedding)]
        refused = next((f.refused for f in (getattr(layer, "fetch", None) for layer in layers)
                        if isinstance(f, _Fetcher) and f.refused is not None), None)
        if refused is not None:
            raise refused from None
        found = _GATHER_PAST.search(e.message) if isinstance(e, tf.errors.InvalidArgumentError) else None
        if found is None:
            raise
        row_id, rows, node = int(found[1]), int(found[2]), found[3]
        scopes = node.split("/")[:-1]
        layer = next((layer.name for layer in layers if int(layer.input_dim) == rows
                      and any(re.fullmatch(re.escape(layer.name) + r"(_\d+)?", s) for s in scopes)), None)
        if layer is None:
            raise
        raise beyond_table(layer, row_id, rows) from None


def _described(t: SparseTable) -> str:
    where = (f"a batch's rows on the worker, at most {t.copies[0].rows_per_batch}" if t.sharded
             else "whole on the worker")
    return f"{t.name} {t.shape[0]}x{t.shape[1]} ({where})"


class _Fetcher:
    """A ShardedEmbedding's lookup-time fetch: (sorted ids, rows) of the ids asked for."""

    refused: DataError | None = None  # ids past the table: what ids_refusal raises after the step

    def __init__(self, store: KVStore, table: SparseTable) -> None:
        self.store, self.table = store, table

    def __call__(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self.table.shape[0]
        past = ids[(ids < 0) | (ids >= rows)]
        if len(past):
            self.refused = beyond_table(self.table.name, int(past[0]), rows)
            raise self.refused
        limit = self.table.copies[0].rows_per_batch
        if len(ids) > limit:
            raise ValueError(f"ShardedEmbedding {self.table.name!r}: a batch reads {len(ids)} distinct rows, more than "
                             f"its rows_per_batch={limit}; raise rows_per_batch or lower batch_size")
        got = self.store.row_sparse_pull(self.table.key, row_ids=np.asarray(ids, np.int64))
        return np.asarray(got.indices, np.int64), np.asarray(got.data, np.float32)
