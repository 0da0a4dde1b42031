"""Row-sparse values of the KVStore API: the rows of a table that a push carries or a pull asks for.

`RowSparse(data, indices, shape)` is MXNet's row_sparse NDArray: `data` (n, *row_shape) holds the
rows whose ids are `indices` (n,), of a dense table of `shape` (rows, *row_shape); rows not named
are zero. A push may name a row twice and in any order (the rows are summed); a pull returns ids
unique and sorted, as MXNet's `row_sparse_pull`. `Table` describes a row-sparse key whose rows the
store creates itself (from a seed), so a table larger than a worker is never made on one.

The checks and argument handling every store type shares live here too, one line per refusal and
each naming the key. numpy only: TensorFlow values (tf.IndexedSlices, tensors) are read by duck
typing, so `tfkv.store` imports without TensorFlow.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Hashable, NamedTuple, Sequence

import numpy as np

from tfkv.errors import ConfigError

FLOAT32 = np.dtype(np.float32)
ROW_DTYPES = (FLOAT32, np.dtype(np.float16))  # what a row-sparse key may hold (MXNet's: float32, float16)
INITS = ("uniform", "normal", "zeros")


@dataclass(eq=False)
class RowSparse:
    """Rows `indices` of a table of dense `shape`, their values in `data` (numpy arrays, or
    TensorFlow tensors inside a tf.function). Mutable: a pull's `out=` has its three fields
    replaced in place."""

    data: Any
    indices: Any
    shape: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @classmethod
    def of(cls, value: Any, shape: Sequence[int] | None = None) -> "RowSparse":
        """A numpy RowSparse of a RowSparse or a tf.IndexedSlices (values, indices, dense_shape),
        eager tensors read as numpy. `shape` stands in for an IndexedSlices without dense_shape.
        Checks nothing (see check_rows)."""
        if isinstance(value, RowSparse):
            return cls(np.asarray(value.data), np.asarray(value.indices), value.shape or tuple(shape or ()))
        if not is_indexed_slices(value):
            raise TypeError(f"a {type(value).__name__} is not rows of a table: give a tfkv.store.RowSparse or a "
                            "tf.IndexedSlices")
        dense = value.dense_shape
        dense = tuple(np.asarray(dense).tolist()) if dense is not None else tuple(shape or ())
        return cls(np.asarray(value.values), np.asarray(value.indices), dense)

    def merged(self) -> "RowSparse":
        """The same rows with duplicates summed, ids unique and sorted (numpy)."""
        data, ids = np.asarray(self.data), np.asarray(self.indices).astype(np.int64).reshape(-1)
        if ids.size == 0:
            return RowSparse(data.reshape((0, *self.row_shape)), ids, self.shape)
        if np.all(ids[1:] > ids[:-1]):  # already merged (a whole table given row by row): no copy
            return RowSparse(data, ids, self.shape)
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
        return RowSparse(np.add.reduceat(data[order], starts, axis=0), ids[starts], self.shape)

    @classmethod
    def from_dense(cls, array: Any) -> "RowSparse":
        """The rows of a dense `array` (rows, *row_shape) that hold a non-zero value, ids sorted:
        MXNet's `array.tostype('row_sparse')`."""
        array = np.asarray(array)
        if array.ndim < 1:
            raise ValueError(f"a row-sparse value needs rows; a {array.ndim}-d array has none")
        ids = np.flatnonzero(np.any(array.reshape(len(array), -1) != 0, axis=1))
        return cls(array[ids], ids, array.shape)

    @classmethod
    def zeros(cls, shape: Sequence[int], dtype: Any = FLOAT32) -> "RowSparse":
        """No rows of a table of `shape`: MXNet's `mx.nd.sparse.zeros('row_sparse', shape)`."""
        shape = tuple(int(s) for s in shape)
        return cls(np.zeros((0, *shape[1:]), dtype), np.zeros(0, np.int64), shape)

    def dense(self) -> np.ndarray:
        """The whole table: the rows given (duplicates summed), zeros elsewhere."""
        rows = self.merged()
        out = np.zeros(self.shape, np.asarray(rows.data).dtype)
        out[rows.indices] = rows.data
        return out

    todense = dense  # MXNet's RowSparseNDArray.todense()
    asnumpy = dense  # MXNet's NDArray.asnumpy(), for code that reads any value as numpy

    def gather(self, row_ids: Any) -> np.ndarray:
        """The rows `row_ids` in their order (repeats repeated), shape row_ids.shape + row_shape,
        from a merged RowSparse (ids sorted) that holds every one of them."""
        ids = np.asarray(row_ids).astype(np.int64)
        return np.asarray(self.data)[np.searchsorted(np.asarray(self.indices), ids.reshape(-1))].reshape(
            (*ids.shape, *self.row_shape))

    def __repr__(self) -> str:
        return f"RowSparse({len(self.indices)} rows of a {self.shape} table)"


@dataclass(frozen=True)
class Table:
    """A row-sparse key whose rows the store makes: `init` "uniform" (in [-scale, scale]),
    "normal" (standard deviation `scale`) or "zeros", drawn from `seed` (and the key) where the
    rows live, never on a worker. `dtype` float32 or float16 (drawn in float32, then rounded).
    Plain data: it travels to the servers as JSON."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    init: str = "uniform"
    scale: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        try:
            shape = tuple(int(s) for s in self.shape)
        except (TypeError, ValueError):
            raise ValueError(f"Table shape {self.shape!r}: give (rows, *row_shape) as whole numbers") from None
        if len(shape) < 1 or any(s < 1 for s in shape):
            raise ValueError(f"Table shape {shape}: give (rows, *row_shape), every size at least 1")
        object.__setattr__(self, "shape", shape)
        if np.dtype(self.dtype) not in ROW_DTYPES:
            raise ValueError(f"Table dtype {self.dtype!r}: a row-sparse key holds float32 or float16")
        if self.init not in INITS:
            raise ValueError(f"Table init {self.init!r} is unknown; choose one of {', '.join(INITS)}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"Table scale {self.scale!r}: give a finite number of at least 0")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise ValueError(f"Table seed {self.seed!r}: give a whole number")

    @property
    def num_rows(self) -> int:
        return self.shape[0]


def is_indexed_slices(value: Any) -> bool:
    """A tf.IndexedSlices (or anything shaped like one), recognised without importing TensorFlow."""
    return all(hasattr(value, a) for a in ("values", "indices", "dense_shape"))


def is_rows(value: Any) -> bool:
    """A row-sparse value: a RowSparse or a tf.IndexedSlices."""
    return isinstance(value, RowSparse) or is_indexed_slices(value)


def is_sparse_init(value: Any) -> bool:
    """What makes a key row-sparse at init: a RowSparse, a Table or a tf.IndexedSlices."""
    return isinstance(value, Table) or is_rows(value)


# -- the checks: one line each, naming the key ----------------------------------------------------

def check_ids(key: Hashable, row_ids: Any, num_rows: int, what: str = "row_sparse_pull") -> np.ndarray:
    """`row_ids` as a flat int64 array; ValueError naming the key for ids that are not whole
    numbers or fall outside the table's rows."""
    ids = np.asarray(row_ids)
    if ids.size == 0:
        return np.zeros(0, np.int64)
    if ids.dtype.kind == "f":  # MXNet's mx.nd.array is float32: ids that are whole numbers are ids
        whole = np.isfinite(ids) & (ids == np.round(ids))
        if not whole.all():
            raise ValueError(f"{what} of key {key!r}: row id {float(ids.reshape(-1)[np.argmin(whole.reshape(-1))]):g} "
                             f"is not a whole number; give whole numbers from 0 to {num_rows - 1}")
    elif ids.dtype.kind not in "iu":
        raise ValueError(f"{what} of key {key!r}: row ids of dtype {ids.dtype.name}; give whole numbers "
                         f"(int32 or int64) from 0 to {num_rows - 1}")
    if ids.min() < 0 or ids.max() >= num_rows:  # before the cast: a float too large for int64 named as it is
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"{what} of key {key!r}: row id {bad} is out of range; the table has {num_rows} rows "
                         f"(ids 0 to {num_rows - 1})")
    return ids.astype(np.int64).reshape(-1)


def check_rows(key: Hashable, rows: RowSparse, shape: Sequence[int], dtype: Any = FLOAT32,
               what: str = "push") -> RowSparse:
    """`rows` (numpy, RowSparse.of) checked against the key's dense `shape` and `dtype`, its ids
    as a flat int64 array; ValueError naming the key where data and indices disagree, the row
    shape or dense shape is not the key's, the dtype is another, or an id is out of range."""
    shape = tuple(int(s) for s in shape)
    data, ids = np.asarray(rows.data), np.asarray(rows.indices)
    if ids.ndim != 1:
        raise ValueError(f"{what} of key {key!r}: indices of shape {ids.shape}; a RowSparse's indices are one id per "
                         "row of data (a vector)")
    if data.ndim < 1 or len(data) != len(ids):
        raise ValueError(f"{what} of key {key!r}: data and indices disagree: {len(data) if data.ndim else 0} rows of "
                         f"data for {len(ids)} row ids (one row per id)")
    if tuple(data.shape[1:]) != shape[1:]:
        raise ValueError(f"{what} of key {key!r}: rows of shape {tuple(data.shape[1:])} for a table whose rows have "
                         f"shape {shape[1:]}")
    if rows.shape and tuple(rows.shape) != shape:
        raise ValueError(f"{what} of key {key!r}: a value of dense shape {tuple(rows.shape)} for a table of shape "
                         f"{shape}")
    if data.dtype != np.dtype(dtype):
        raise ValueError(f"{what} of key {key!r}: {data.dtype.name} rows for a {np.dtype(dtype).name} row-sparse key; "
                         f"cast them first (data.astype({np.dtype(dtype).name!r}) or tf.cast)")
    return RowSparse(data, check_ids(key, ids, shape[0], what), shape)


def check_table_dtype(key: Hashable, dtype: Any, what: str = "init") -> np.dtype:
    """The row-sparse key's dtype (numpy): float32 or float16 (as MXNet's); any other refused,
    naming the key."""
    held = np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    if held not in ROW_DTYPES:
        raise ValueError(f"{what} of key {key!r}: a row-sparse key holds float32 or float16, not {held.name}; give "
                         "float32 or float16 rows")
    return held


# -- the refusals of dense operations on row-sparse keys and the reverse ---------------------------

# What each refusal says, by the operation refused; `refused(what, key)` makes the error.
REFUSALS = {
    "pull": "key {key!r} is row-sparse: a dist_* store pulls its rows with row_sparse_pull({key!r}, row_ids=...), "
            "never the whole table (as MXNet's dist kvstore)",
    "ignore_sparse": "pull of key {key!r}: ignore_sparse=False (the whole value into RowSparse outs) is not for "
                     "dist_* stores (as MXNet's dist kvstore); pull rows with row_sparse_pull({key!r}, row_ids=...)",
    "pushpull": "key {key!r} is row-sparse: pushpull takes dense keys; push its rows, then "
                "row_sparse_pull({key!r}, row_ids=...)",
    "dense_push": "push of key {key!r}: a dense value for a row-sparse key; push a tfkv.store.RowSparse or a "
                  "tf.IndexedSlices of its rows",
    "sparse_pull": "row_sparse_pull of key {key!r}: a dense key; pull it whole with pull({key!r})",
    "compression": "push of key {key!r}: gradient compression does not apply to row-sparse keys; push their rows "
                   "uncompressed (set_gradient_compression({{'type': 'none'}}))",
    "updater": "push of key {key!r}: a Python updater (set_updater) takes dense keys only; for a row-sparse key use "
               "set_optimizer (MXNet's lazy SGD or Adam update of the rows pushed)",
}


def dense_outs(key: Hashable, outs: list[Any], ignore_sparse: bool) -> tuple[list[Any], list[RowSparse]]:
    """A dense pull's outs of `key` as (dense outs, RowSparse outs that take the whole value).
    MXNet's pull skips a RowSparse out, leaving it unchanged, unless ignore_sparse=False: a
    warning says so (once per key), as MXNet's log does."""
    rows = [o for o in outs if isinstance(o, RowSparse)]
    if not rows:
        return outs, []
    if ignore_sparse:
        warnings.warn(f"pull of key {key!r}: a RowSparse out is left unchanged (ignore_sparse=True, MXNet's default); "
                      f"row_sparse_pull({key!r}, out=..., row_ids=...) fills it, or pull(..., ignore_sparse=False) "
                      "gives it the whole value", stacklevel=3)
        rows = []
    return [o for o in outs if not isinstance(o, RowSparse)], rows


def whole(out: RowSparse, value: Any) -> None:
    """`out` given every row of the dense `value` (numpy, or a tensor inside a tf.function)."""
    out.data, out.indices, out.shape = value, np.arange(value.shape[0], dtype=np.int64), tuple(value.shape)


def densify(key: Hashable, value: Any, shape: Sequence[int]) -> np.ndarray:
    """Rows pushed to a dense key (a RowSparse or tf.IndexedSlices) as the dense value they stand
    for: the rows summed, zeros elsewhere (MXNet adds them into the key, or with an optimizer
    updates the key as for that dense gradient), checked against the key's shape."""
    rows = RowSparse.of(value, shape)
    return check_rows(key, rows, shape, np.asarray(rows.data).dtype).dense()


class TableTooLarge(ConfigError, MemoryError):
    """A Table the store cannot hold in the memory it has: refused before any of it is made,
    naming it as the store's messages name its key (`key 'emb'`, or a trainer's layer)."""


def check_room(phrase: str, table: Table, copies: int, available: int) -> None:
    """TableTooLarge unless `copies` whole copies of `table` (a local store's draw and its
    variable) fit in `available` bytes; the dist_* stores' servers each hold a part of one."""
    nbytes = 4 * math.prod(table.shape)
    if copies * nbytes > available:
        raise TableTooLarge(f"{phrase}: a table of {table.shape[0]} rows of {math.prod(table.shape[1:])} values "
                            f"({_size(nbytes)}) is made whole in this process, {copies} copies while it is "
                            f"drawn ({_size(copies * nbytes)}), more than the {_size(available)} of memory "
                            "available: spread it over parameter servers (kvstore=dist_sync cluster=local "
                            "cluster.num_servers=N) or make it smaller")


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.1f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def refused(what: str, key: Hashable) -> ValueError:
    """The one-line ValueError refusing operation `what` (a REFUSALS name) on `key`."""
    return ValueError(REFUSALS[what].format(key=key))


# -- argument forms, shared by every store's row_sparse_pull ---------------------------------------

class Asked(NamedTuple):
    """One key of a row_sparse_pull and the row ids asked for it: one array for every out of the
    key, or one array per out (MXNet pairs them: out i gets rows row_ids[i] only)."""

    key: Hashable
    row_ids: list[Any]


def requests(key: Any, row_ids: Any, out: Any = None) -> list[Asked]:
    """MXNet's row_sparse_pull arguments, one Asked per key: one key with its ids, or a list of
    keys with a list of ids (one per key) or one array of ids for every key. A key's ids may be a
    list of arrays, one per out of the key (its outs a list as long); `out`, when given, is
    checked here (RowSparse outs, one per key), before anything is asked of a store."""
    if row_ids is None:
        raise ValueError(f"row_sparse_pull of key {key!r}: give row_ids=, the rows to pull")
    if not isinstance(key, (list, tuple)):
        return [_asked(key, row_ids, out)]
    if isinstance(row_ids, (list, tuple)):
        if len(row_ids) != len(key):
            raise ValueError(f"row_sparse_pull of keys {list(key)!r}: {len(row_ids)} row_ids for {len(key)} keys "
                             "(give one array of ids per key)")
        per_key = list(row_ids)
    else:
        per_key = [row_ids] * len(key)
    if out is None:
        return [_asked(k, r, None) for k, r in zip(key, per_key)]
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    if len(outs) != len(key):
        raise ValueError(f"row_sparse_pull of keys {list(key)!r}: {len(outs)} outs for {len(key)} keys")
    return [_asked(k, r, o) for k, r, o in zip(key, per_key, outs)]


def _asked(key: Hashable, row_ids: Any, out: Any) -> Asked:
    """One key's ids: a list of id arrays (not of ids) is one per out, else one for all."""
    each = list(row_ids) if isinstance(row_ids, (list, tuple)) and row_ids and all(
        np.ndim(r) >= 1 for r in row_ids) else [row_ids]
    outs = None if out is None else list(out) if isinstance(out, (list, tuple)) else [out]
    for o in outs or ():
        if not isinstance(o, RowSparse):
            raise TypeError(f"row_sparse_pull of key {key!r}: out must be a tfkv.store.RowSparse (or a list of "
                            f"them), not a {type(o).__name__}")
    if len(each) > 1 and outs is not None and len(outs) != len(each):
        raise ValueError(f"row_sparse_pull of key {key!r}: {len(each)} arrays of row_ids for {len(outs)} outs (give "
                         "one array of ids per out, or one array for every out)")
    return Asked(key, each)


def flat(asked: list[Asked]) -> list[tuple[Hashable, Any]]:
    """Every (key, row ids) pull that `asked` stands for, in order: what a store fetches."""
    return [(a.key, ids) for a in asked for ids in a.row_ids]


def deliver(key: Any, asked: list[Asked], results: list[RowSparse], out: Any) -> Any:
    """row_sparse_pull's result from `results` (one per pull of `flat(asked)`): the RowSparse (a
    list of them for a key asked with one array of ids per out; a list per key for a list of
    keys) when `out` is None; else each out gets its rows in place (its data, indices and shape
    replaced; numpy rows copied per out) and None is returned."""
    left = iter(results)
    per_key = [[next(left) for _ in a.row_ids] for a in asked]
    if out is None:
        got = [rows[0] if len(rows) == 1 else rows for rows in per_key]
        return got if isinstance(key, (list, tuple)) else got[0]
    outs = list(out) if isinstance(key, (list, tuple)) else [out]
    for o, rows in zip(outs, per_key):
        for i, each in enumerate(o if isinstance(o, (list, tuple)) else [o]):
            r = rows[i if len(rows) > 1 else 0]
            numpy = isinstance(r.data, np.ndarray)
            each.data = np.array(r.data) if numpy else r.data
            each.indices = np.array(r.indices) if numpy else r.indices
            each.shape = r.shape
    return None


__all__ = ["Asked", "RowSparse", "Table", "TableTooLarge", "check_ids", "check_room", "check_rows", "check_table_dtype", "deliver",
           "dense_outs", "densify", "flat", "is_rows", "is_sparse_init", "refused", "requests", "whole"]
