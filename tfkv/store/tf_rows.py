"""Row-sparse values as TensorFlow ops, for the single-machine stores (tfkv.store.local).

Eagerly a pushed value or a pull's row ids are checked in numpy (tfkv.store.sparse: one line
naming the key); inside a tf.function, where the trainer traces the store into its step, what
is known when tracing (dtype, row shape) is checked then and the ids' range by an assertion in
the graph. Rows are summed without densifying (concatenated, then a segment sum over the
unique ids), and a `Table`'s rows are drawn with TensorFlow's stateless random ops from its
seed and the key. A key holds float32 or float16 (the dtype it was initialised with); a push
of another dtype is refused naming the key.
"""

from __future__ import annotations

import zlib
from typing import Any, Hashable, Sequence

import numpy as np
import tensorflow as tf

from tfkv.store import sparse
from tfkv.store.sparse import RowSparse, Table


def table_values(key: Hashable, table: Table) -> tf.Tensor:
    """The whole table as its `init` draws it: the same rows for the same seed and key."""
    if table.init == "zeros":
        return tf.zeros(table.shape, table.dtype)
    # The key in the seed: two tables of one seed differ. crc32, not hash(): stable across runs.
    seed = tf.constant([int(table.seed) % 2**63, zlib.crc32(repr(key).encode())], tf.int64)
    if table.init == "normal":
        drawn = tf.random.stateless_normal(table.shape, seed, stddev=table.scale, dtype=tf.float32)
    else:
        drawn = tf.random.stateless_uniform(table.shape, seed, minval=-table.scale, maxval=table.scale,
                                            dtype=tf.float32)
    return tf.cast(drawn, table.dtype)  # a float16 table: the float32 draw rounded, as the servers make it


def initial(key: Hashable, value: Any) -> Any:
    """A row-sparse key's initial value, the whole table: a Table's draw, or the rows of a
    RowSparse or tf.IndexedSlices (duplicates summed, zero elsewhere), checked."""
    if isinstance(value, Table):
        return table_values(key, value)
    rows = RowSparse.of(value)
    if not rows.shape:
        raise ValueError(f"init of key {key!r}: rows without a dense shape; give RowSparse(data, indices, shape)")
    dtype = sparse.check_table_dtype(key, np.asarray(rows.data).dtype)
    return sparse.check_rows(key, rows, rows.shape, dtype, what="init").dense()


def rows_of(key: Hashable, value: Any, shape: Sequence[int], dtype: Any = tf.float32) -> tuple[tf.Tensor, tf.Tensor]:
    """(data, int64 ids) of a pushed RowSparse or tf.IndexedSlices for a key of dense `shape`
    holding `dtype`, checked: eagerly in numpy, in a graph what tracing knows and the ids' range
    by assertion."""
    if not sparse.is_rows(value):
        raise sparse.refused("dense_push", key)
    held = tf.as_dtype(dtype)
    if tf.executing_eagerly():
        rows = sparse.check_rows(key, RowSparse.of(value, shape), shape, held.as_numpy_dtype)
        return tf.constant(rows.data), tf.constant(rows.indices)
    data, ids = (value.data, value.indices) if isinstance(value, RowSparse) else (value.values, value.indices)
    data = tf.convert_to_tensor(data)
    if sparse.check_table_dtype(key, data.dtype, "push") != held.as_numpy_dtype:
        raise ValueError(f"push of key {key!r}: {data.dtype.name} rows for a {held.name} row-sparse key; cast them "
                         f"first (tf.cast(rows, {held.name!r}))")
    if data.shape.rank is not None and tuple(data.shape[1:]) != tuple(shape[1:]):
        raise ValueError(f"push of key {key!r}: rows of shape {tuple(data.shape[1:])} for a table whose rows have "
                         f"shape {tuple(shape[1:])}")
    dense = value.shape if isinstance(value, RowSparse) else tf.get_static_value(value.dense_shape)
    if dense is not None and len(dense) and tuple(int(s) for s in dense) != tuple(shape):
        raise ValueError(f"push of key {key!r}: a value of dense shape {tuple(int(s) for s in dense)} for a table of "
                         f"shape {tuple(shape)}")
    ids = checked_ids(key, ids, shape[0], "push")
    with tf.control_dependencies([tf.debugging.assert_equal(
            tf.shape(data, out_type=tf.int64)[0], tf.size(ids, out_type=tf.int64),
            message=f"push of key {key!r}: data and indices disagree (one row of data per id)")]):
        return tf.identity(data), ids


def densified(key: Hashable, value: RowSparse, shape: Sequence[int]) -> Any:
    """A RowSparse pushed to a dense key of `shape` as the dense value it stands for (rows summed,
    zeros elsewhere): checked in numpy eagerly (sparse.densify), in a graph a scatter of the
    rows whose ids are checked by assertion."""
    if tf.executing_eagerly():
        return tf.constant(sparse.densify(key, value, shape))
    ids = checked_ids(key, value.indices, shape[0], "push")
    return tf.scatter_nd(tf.reshape(ids, [-1, 1]), tf.convert_to_tensor(value.data), tf.constant(list(shape), tf.int64))


def checked_ids(key: Hashable, row_ids: Any, num_rows: int, what: str = "row_sparse_pull") -> tf.Tensor:
    """`row_ids` as a flat int64 tensor, in range: eagerly checked in numpy (one line naming
    the key), in a graph by an assertion carrying the same words."""
    if tf.executing_eagerly():
        return tf.constant(sparse.check_ids(key, np.asarray(row_ids), num_rows, what))
    ids = tf.reshape(tf.convert_to_tensor(row_ids), [-1])
    checks = []
    if ids.dtype.is_floating:  # MXNet's float32 ids: whole numbers only (float64 holds any of them exactly)
        ids = tf.cast(ids, tf.float64)
        checks.append(tf.debugging.assert_equal(ids, tf.round(ids), message=f"{what} of key {key!r}: a row id is not "
                                                "a whole number"))
    elif not ids.dtype.is_integer:
        raise ValueError(f"{what} of key {key!r}: row ids of dtype {ids.dtype.name}; give whole numbers")
    else:
        ids = tf.cast(ids, tf.int64)
    message = f"{what} of key {key!r}: a row id is out of range; the table has {num_rows} rows"
    checks += [tf.debugging.assert_non_negative(ids, message=message),
               tf.debugging.assert_less(ids, tf.constant(num_rows, ids.dtype), message=message)]
    with tf.control_dependencies(checks):
        return tf.identity(tf.cast(ids, tf.int64))


def summed(parts: list[tuple[tf.Tensor, tf.Tensor]]) -> tuple[tf.Tensor, tf.Tensor]:
    """(unique ids, their rows summed) of every part's (data, ids), never densified."""
    data = parts[0][0] if len(parts) == 1 else tf.concat([d for d, _ in parts], 0)
    ids = parts[0][1] if len(parts) == 1 else tf.concat([i for _, i in parts], 0)
    unique, where = tf.unique(ids)
    return unique, tf.math.unsorted_segment_sum(data, where, tf.size(unique))


def unique_sorted(ids: tf.Tensor) -> tf.Tensor:
    """The distinct ids in increasing order (row_sparse_pull's result ids, MXNet's)."""
    return tf.sort(tf.unique(ids).y)
