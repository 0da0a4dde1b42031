"""The row-sparse contract (tests/store/sparse_contract.py) on the single-machine stores, local
and device, with device values from several logical CPU devices; and what only they do: push
and pull of row-sparse keys traced into a tf.function, as the trainer traces them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

import sparse_contract as contract
from tfkv import optim, store
from tfkv.store import RowSparse, Table


@pytest.mark.parametrize("kind", ["local", "device"])
@pytest.mark.parametrize("devices", [1, 3])
def test_single_machine_stores_keep_the_row_sparse_contract(kind, devices, tf_devices, tmp_path):
    kv = store.create(kind, devices=tf_devices[:devices])
    seen = contract.run(kv, devices, str(tmp_path))
    assert seen["type"] == kind
    assert not contract.mismatches(seen, contract.expected(True, devices)), json.dumps(seen, indent=1)


def test_the_oracle_can_fail():
    """The lazy references change only pushed rows, and weight decay moves a row pushed with
    zero data (it is named in the push): a dense update, or one of nonzero rows only, differs."""
    sgd, momentum = contract.lazy_sgd(2, [0])
    initial = contract.initial(contract.SGD_KEY)
    pushed = {1, 4, 6, contract.own_row(0)}
    for i in range(contract.ROWS):
        assert (not np.allclose(sgd[i], initial[i])) == (i in pushed), i
    assert np.any(momentum[6] != 0) and not np.allclose(sgd[6], initial[6])
    assert contract.mismatches({"sgd": sgd.tolist()}, {"sgd": initial.tolist()})
    two = contract.expected(True, 2, num_workers=2, rank=1)
    assert two["sgd"] != contract.expected(True, 2)["sgd"]  # every worker's rows are summed


@pytest.mark.parametrize("kind", ["local", "device"])
def test_row_sparse_push_and_pull_trace_into_a_tf_function(kind, tf_devices):
    kv = store.create(kind, devices=tf_devices[:2])
    kv.init("emb", Table((8, 2), init="zeros"))
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))

    @tf.function
    def step(ids):  # one device's gradient per device: rows of ones at the batch's ids
        grads = [tf.IndexedSlices(tf.ones([tf.size(ids), 2]), ids, tf.constant([8, 2], tf.int64)) for _ in range(2)]
        kv.push("emb", grads)
        pulled = kv.row_sparse_pull("emb", row_ids=ids)
        return pulled.indices, pulled.data, kv.pull_rows("emb", ids)

    indices, data, in_order = step(tf.constant([5, 1, 5], tf.int64))
    np.testing.assert_array_equal(indices.numpy(), [1, 5])  # unique and sorted, as eagerly
    np.testing.assert_array_equal(data.numpy(), [[-2, -2], [-4, -4]])  # row 5 twice on each of 2 devices
    np.testing.assert_array_equal(in_order.numpy(), [[-4, -4], [-2, -2], [-4, -4]])
    step(tf.constant([0], tf.int64))  # the same graph (shapes vary): only row 0 moves
    got = kv.row_sparse_pull("emb", row_ids=np.arange(8))
    assert isinstance(got, RowSparse) and isinstance(got.data, np.ndarray)
    np.testing.assert_array_equal(got.data[:, 0], [-2, -2, 0, 0, 0, -4, 0, 0])
    with pytest.raises(tf.errors.InvalidArgumentError, match="emb.*: a row id is out of range; the table has 8 rows"):
        step(tf.constant([8], tf.int64))
    np.testing.assert_array_equal(kv.row_sparse_pull("emb", row_ids=np.arange(8)).data[:, 0],
                                  [-2, -2, 0, 0, 0, -4, 0, 0])  # a refused push changed nothing


def test_an_indexed_slices_push_to_a_dense_key_is_densified(tf_devices):
    """As before row-sparse keys: a Keras Embedding's gradient for a dense key is summed dense."""
    kv = store.create("local")
    kv.init(0, np.zeros((3, 2), np.float32))
    kv.push(0, [tf.IndexedSlices(tf.ones([2, 2]), tf.constant([2, 2]), tf.constant([3, 2]))])
    np.testing.assert_array_equal(kv.pull(0).numpy(), [[0, 0], [0, 0], [2, 2]])


def test_tables_draw_the_same_rows_for_the_same_seed_and_key():
    a, b = store.create("local"), store.create("local")
    for kv in (a, b):
        kv.init([1, 2], [Table((50, 4), seed=7), Table((50, 4), seed=7)])
    rows = [kv.row_sparse_pull(k, row_ids=np.arange(50)).data for kv in (a, b) for k in (1, 2)]
    np.testing.assert_array_equal(rows[0], rows[2])
    assert not np.array_equal(rows[0], rows[1])  # another key, other rows


def test_table_and_row_sparse_refuse_bad_descriptions():
    for bad, words in [(dict(shape=(0, 2)), "at least 1"), (dict(shape=(4, 2), dtype="float64"), "float32 or float16"),
                       (dict(shape=(4, 2), init="ones"), "unknown"), (dict(shape=(4, 2), scale=float("nan")), "scale")]:
        with pytest.raises(ValueError, match=words):
            Table(**bad)
    rows = RowSparse(np.array([[1.0], [2.0], [3.0]], np.float32), np.array([4, 0, 4]), (5, 1))
    merged = rows.merged()
    np.testing.assert_array_equal(merged.indices, [0, 4])
    np.testing.assert_array_equal(merged.data, [[2.0], [4.0]])
    np.testing.assert_array_equal(rows.dense()[:, 0], [2, 0, 0, 0, 4])
    np.testing.assert_array_equal(merged.gather([4, 4, 0])[:, 0], [4, 4, 2])


def test_traced_pushes_are_checked_when_traced_and_compression_refused(tf_devices):
    kv = store.create("device", devices=tf_devices[:2])
    kv.init("emb", Table((8, 2), init="zeros"))

    def push(values, shape=(8, 2)):
        tf.function(lambda: kv.push("emb", tf.IndexedSlices(values, tf.constant([1]), tf.constant(shape))))()

    with pytest.raises(ValueError, match="push of key 'emb': a value of dense shape \\(9, 2\\) for a table of shape"):
        push(tf.ones([1, 2]), (9, 2))
    with pytest.raises(ValueError, match="push of key 'emb': rows of shape \\(3,\\)"):
        push(tf.ones([1, 3]), (8, 3))
    with pytest.raises(ValueError, match="push of key 'emb': float16 rows for a float32 row-sparse key; cast them"):
        push(tf.ones([1, 2], tf.float16))
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    with pytest.raises(ValueError, match="push of key 'emb': gradient compression does not apply to row-sparse keys"):
        kv.push("emb", RowSparse(np.ones((1, 2), np.float32), [0], (8, 2)))


def test_row_sparse_pull_argument_forms():
    """MXNet's forms: one array of ids for every key of a list; row_ids required; out a RowSparse."""
    kv = store.create("local")
    kv.init([1, 2], [RowSparse(np.array([[1.0]], np.float32), [3], (4, 1)), Table((4, 1), init="zeros")])
    one, two = kv.row_sparse_pull([1, 2], row_ids=np.array([3, 0, 3]))
    assert (one.indices.tolist(), one.data.tolist(), two.indices.tolist()) == ([0, 3], [[0.0], [1.0]], [0, 3])
    with pytest.raises(ValueError, match="row_sparse_pull of key 1: give row_ids="):
        kv.row_sparse_pull(1)
    with pytest.raises(ValueError, match=r"row_sparse_pull of keys \[1, 2\]: 1 row_ids for 2 keys"):
        kv.row_sparse_pull([1, 2], row_ids=[np.array([0])])
    with pytest.raises(TypeError, match="row_sparse_pull of key 1: out must be a tfkv.store.RowSparse"):
        kv.row_sparse_pull(1, out=np.zeros((4, 1), np.float32), row_ids=[0])


@pytest.mark.parametrize("kind", ["local", "device"])
def test_a_table_larger_than_the_memory_available_is_refused_before_it_is_drawn(kind, tf_devices):
    """Issue 40, point 16: TensorFlow's out-of-memory error after seconds of drawing was what a
    Table too large for this process met; now one line naming the key, its size and what fits,
    before anything is allocated (the store keeps working, the key stays free)."""
    from tfkv.errors import ConfigError
    from tfkv.ps import memory

    kv = store.create(kind, devices=tf_devices[:2])
    huge = Table((10**11, 64))  # 25.6 TB: more than any machine's memory
    with pytest.raises(store.sparse.TableTooLarge) as e:
        kv.init("emb", huge)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, MemoryError)
    line = str(e.value)
    assert line.startswith("key 'emb': a table of 100000000000 rows of 64 values (23841.9 GiB)") and \
        "\n" not in line, line
    assert "more than the" in line and "kvstore=dist_sync" in line and "1099511627776" not in line
    fits = memory.available() // (4 * 8 * 3)  # rows of 8 values, 3 copies' room
    kv.init("emb", Table((min(fits, 1000), 8)))  # the key was left free, and a table that fits is made
    assert kv.row_sparse_pull("emb", row_ids=np.array([0])).data.shape == (1, 8)


def test_a_key_named_by_its_caller_is_refused_by_that_name():
    """Issue 40, point 16: a trainer keys its tables by number and gives the store each one's
    layer (tfkv.parallel.sparse); the store's refusal names the layer, and the key is still 10."""
    kv = store.create("local")
    kv.name_keys({10: "layer embedding0 (tfkv.layers.ShardedEmbedding)"})
    with pytest.raises(store.sparse.TableTooLarge) as e:
        kv.init(10, Table((10**11, 64)))
    assert str(e.value).startswith("layer embedding0 (tfkv.layers.ShardedEmbedding): a table of 100000000000 rows"), e.value
    assert kv.key_phrase(11) == "key 11"  # a key not named is named as before
    kv.init(10, Table((4, 2)))
    assert kv.row_sparse_pull(10, row_ids=np.array([3])).indices.tolist() == [3]


def test_the_room_a_table_needs_is_its_copies_while_it_is_drawn():
    from tfkv.store import sparse

    table = Table((1000, 16))  # 64000 bytes
    sparse.check_room("key 't'", table, copies=2, available=128000)
    with pytest.raises(sparse.TableTooLarge, match="^key 't': a table of 1000 rows of 16 values"):
        sparse.check_room("key 't'", table, copies=2, available=127999)
