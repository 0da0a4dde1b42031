"""MXNet v1.9.1's own KVStore tests, the row-sparse parts, ported to tfkv's API: MXNet's checks as
they are (names, values, assertions), only the spelling adapted (mx.nd -> numpy and
tfkv.store.RowSparse, `mx.kv.create` -> tfkv.store.create, MXNetError -> the ValueError or
TypeError tfkv raises). From tests/python/unittest/test_kvstore.py (local; also run on `device`),
tests/python/gpu/test_kvstore_gpu.py (local and device, on the GPUs where there are any, else on
CPU devices) and tests/nightly/dist_sync_kvstore.py (the row-sparse checks, run by
tests/workers/mxnet_dist_sync.py inside each worker of a real dist_sync job: slow). The float16
variants of MXNet's dist checks are tests of their own, named with float16.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tfkv import optim
from tfkv import store as kvstore
from tfkv.store import RowSparse

# MXNet raises MXNetError for a bad call; tfkv the ValueError or TypeError of Python's conventions.
MXNetError = (ValueError, TypeError)

shape = (4, 4)
keys = [5, 7, 11]
str_keys = ['b', 'c', 'd']
STORES = ["local", "device"]  # MXNet's test_kvstore.py creates `local` (its default); `device` too here


# -- mx.nd, spelled with numpy and RowSparse ----------------------------------------------------------

def nd_zeros(shape, stype='default', dtype='float32'):
    """mx.nd.zeros(shape, stype=...)."""
    return RowSparse.zeros(shape, dtype) if stype == 'row_sparse' else np.zeros(shape, dtype)


def tostype(value, stype):
    """value.tostype(stype)."""
    return RowSparse.from_dense(value) if stype == 'row_sparse' else value


def ones(shape, dtype='float32'):
    return np.ones(shape, dtype)


def empty(shape):
    return np.empty(shape, np.float32)


def asnumpy(value):
    return value.asnumpy() if isinstance(value, RowSparse) else np.asarray(value)


def rand_ndarray(shape, stype, rng):
    """mxnet.test_utils.rand_ndarray(shape, 'row_sparse'): rows kept with a random density."""
    density = rng.uniform()
    keep = rng.uniform(size=(shape[0], 1)) < density
    return tostype((rng.uniform(size=shape) * keep).astype(np.float32), stype)


def assert_almost_equal(a, b):
    np.testing.assert_allclose(asnumpy(a), asnumpy(b), rtol=1e-5, atol=1e-20)


def assertRaises(exc, call, *args, **kwargs):
    with pytest.raises(exc):
        call(*args, **kwargs)


def check_diff_to_scalar(A, x):
    """ assert A == x"""
    assert(np.sum(np.abs((asnumpy(A) - x))) == 0)


@pytest.fixture
def rng():
    return np.random.default_rng(1829754103)  # MXNet's @with_seed(), fixed


@pytest.fixture
def create(tf_devices):
    """mx.kv.create(kind): the store on this machine's devices (MXNet's contexts)."""
    return lambda kind='local': kvstore.create(kind)


def init_kv(create, stype='default', kv_type='local'):
    """init kv """
    kv = create(kv_type)
    # single
    kv.init(3, nd_zeros(shape=shape, stype=stype))
    # list
    kv.init(keys, [nd_zeros(shape=shape, stype=stype)] * len(keys))
    return kv


def init_kv_with_str(create, stype='default', kv_type='local'):
    """init kv """
    kv = create(kv_type)
    # single
    kv.init('a', nd_zeros(shape, stype=stype))
    # list
    kv.init(str_keys, [nd_zeros(shape=shape, stype=stype)] * len(keys))
    return kv


# -- tests/python/unittest/test_kvstore.py ------------------------------------------------------------

@pytest.mark.parametrize("kv_type", STORES)
def test_single_kv_pair(create, kv_type):
    """single key-value pair push & pull"""
    def check_single_kv_pair(kv, key, stype):
        kv.push(key, tostype(ones(shape), stype))
        val = empty(shape)
        kv.pull(key, out=val)
        check_diff_to_scalar(val, 1)

    stypes = ['default', 'row_sparse']
    for stype in stypes:
        check_single_kv_pair(init_kv(create, kv_type=kv_type), 3, stype)
        check_single_kv_pair(init_kv_with_str(create, kv_type=kv_type), 'a', stype)


@pytest.mark.parametrize("kv_type", STORES)
def test_row_sparse_pull(create, rng, kv_type):
    kv = init_kv_with_str(create, 'row_sparse', kv_type)
    kv.init('e', tostype(ones(shape), 'row_sparse'))

    def check_row_sparse_pull(kv, count):
        num_rows = shape[0]
        vals = []
        row_ids = []
        all_row_ids = np.arange(num_rows)
        for i in range(count):
            vals.append(tostype(nd_zeros(shape), 'row_sparse'))
            row_id = rng.integers(num_rows, size=num_rows)
            row_ids.append(np.array(row_id, np.float32).reshape((2, num_rows//2)))  # mx.nd.array: float32
        row_ids_to_pull = row_ids[0] if len(row_ids) == 1 else row_ids
        vals_to_pull = vals[0] if len(vals) == 1 else vals

        kv.row_sparse_pull('e', out=vals_to_pull, row_ids=row_ids_to_pull)
        for val, row_id in zip(vals, row_ids):
            retained = asnumpy(val)
            excluded_row_ids = np.setdiff1d(all_row_ids, row_id)
            for row in range(num_rows):
                expected_val = np.zeros_like(retained[row])
                expected_val += 0 if row in excluded_row_ids else 1
                assert_almost_equal(retained[row], expected_val)

    check_row_sparse_pull(kv, 1)
    check_row_sparse_pull(kv, 4)


@pytest.mark.parametrize("kv_type", STORES)
def test_list_kv_pair(create, kv_type):
    """list key-value pair push & pull"""
    def check_list_kv_pair(kv, key, stype):
        kv.push(key, [tostype(ones(shape)*4, stype)] * len(key))
        val = [empty(shape)] * len(key)
        kv.pull(key, out=val)
        for v in val:
            check_diff_to_scalar(v, 4)

    stypes = ['default', 'row_sparse']
    for stype in stypes:
        check_list_kv_pair(init_kv(create, kv_type=kv_type), keys, stype)
        check_list_kv_pair(init_kv_with_str(create, kv_type=kv_type), str_keys, stype)


@pytest.mark.parametrize("kv_type", STORES)
def test_aggregator(create, kv_type):
    """aggregate value on muliple devices"""

    def check_aggregator(kv, key, key_list, stype):
        # devices
        num_devs = 4
        devs = range(num_devs)

        # single
        vals = [tostype(ones(shape), stype) for d in devs]
        outs = [empty(shape) for d in devs]

        kv.push(key, vals)
        kv.pull(key, out=outs)

        for out in outs:
            check_diff_to_scalar(out, num_devs)

        # list
        vals = [[tostype(ones(shape) * 2.0, stype) for d in devs]] * len(key_list)
        outs = [[empty(shape) for d in devs]] * len(key_list)
        kv.push(key_list, vals)
        kv.pull(key_list, out=outs)

        for out in outs:
            for o in out:
                check_diff_to_scalar(o, num_devs * 2.0)

    stypes = ['default', 'row_sparse']
    for stype in stypes:
        check_aggregator(init_kv(create, kv_type=kv_type), 3, keys, stype)
        check_aggregator(init_kv_with_str(create, kv_type=kv_type), 'a', str_keys, stype)


@pytest.mark.parametrize("kv_type", STORES)
def test_sparse_aggregator(create, rng, kv_type):
    """aggregate sparse ndarray on muliple devices"""
    def check_sparse_aggregator(sparse_pull):
        stype = 'row_sparse'
        kv = init_kv_with_str(create, stype, kv_type)

        # devices
        num_devs = 4

        # single
        vals = [rand_ndarray(shape, stype, rng) for i in range(num_devs)]
        expected_sum = np.zeros(shape)
        for v in vals:
            expected_sum += asnumpy(v)

        # prepare row_ids
        kv.push('a', vals)
        if sparse_pull:
            all_rows = np.array(np.arange(shape[0]), np.float32)
            kv.row_sparse_pull('a', out=vals, row_ids=[all_rows] * len(vals))
        else:
            kv.pull('a', out=vals, ignore_sparse=False)
        result_sum = np.zeros(shape)
        for v in vals:
            result_sum += asnumpy(v)
        assert_almost_equal(result_sum, expected_sum * num_devs)

        # list
        vals = [[rand_ndarray(shape, stype, rng) for i in range(num_devs)]] * len(keys)
        expected_sum = np.zeros(shape)
        for v in vals[0]:
            expected_sum += asnumpy(v)

        kv.push(str_keys, vals)
        if sparse_pull:
            kv.row_sparse_pull(str_keys, out=vals, row_ids=[[all_rows] * num_devs] * len(vals))
        else:
            kv.pull(str_keys, out=vals, ignore_sparse=False)
        for vv in vals:
            result_sum = np.zeros(shape)
            for v in vv:
                result_sum += asnumpy(v)
            assert_almost_equal(result_sum, expected_sum * num_devs)

    check_sparse_aggregator(False)
    check_sparse_aggregator(True)


def updater(key, recv, local):
    """use updater: += with int keys"""
    assert(isinstance(key, int))
    local += recv


def str_updater(key, recv, local):
    """use updater: += with str keys"""
    if isinstance(key, bytes):
        key = key.decode()
    assert(isinstance(key, str))
    local += recv


@pytest.mark.parametrize("kv_type", STORES)
def test_updater(create, kv_type):
    """updater"""

    def check_updater(kv, key, key_list, stype):
        # devices
        num_devs = 4
        devs = range(num_devs)

        # single
        vals = [tostype(ones(shape), stype) for d in devs]
        outs = [empty(shape) for d in devs]

        kv.push(key, vals)
        kv.pull(key, out=outs)

        for out in outs:
            check_diff_to_scalar(out, num_devs)

        # list
        vals = [[tostype(ones(shape), stype) for d in devs]] * len(key_list)
        outs = [[empty(shape) for d in devs]] * len(key_list)

        num_push = 4
        for i in range(num_push):
            kv.push(key_list, vals)

        kv.pull(key_list, out=outs)

        for out in outs:
            for o in out:
                check_diff_to_scalar(o, num_devs * num_push)

    stypes = ['default', 'row_sparse']
    for stype in stypes:
        kv = init_kv(create, kv_type=kv_type)
        kv._set_updater(updater)
        check_updater(kv, 3, keys, stype)

        str_kv = init_kv_with_str(create, kv_type=kv_type)
        str_kv._set_updater(str_updater)
        check_updater(str_kv, 'a', str_keys, stype)


@pytest.mark.parametrize("kv_type", STORES)
def test_invalid_pull(create, kv_type):
    def check_ignored_pull_single(kv, key):
        dns_val = (ones(shape) * 2)
        rsp_val = tostype(dns_val, 'row_sparse')
        kv.pull(key, out=rsp_val)
        check_diff_to_scalar(rsp_val, 2)

    def check_ignored_pull_list(kv, key):
        dns_val = [ones(shape) * 2] * len(key)
        rsp_val = [tostype(val, 'row_sparse') for val in dns_val]
        kv.pull(key, out=rsp_val)
        for v in rsp_val:
            check_diff_to_scalar(v, 2)

    def check_invalid_rsp_pull_single(kv, key):
        dns_val = ones(shape) * 2
        assertRaises(MXNetError, kv.row_sparse_pull,
                     key, out=dns_val, row_ids=np.array([1], np.float32))

    def check_invalid_rsp_pull_list(kv, key):
        dns_val = [ones(shape) * 2] * len(key)
        assertRaises(MXNetError, kv.row_sparse_pull, key, out=dns_val,
                     row_ids=[np.array([1], np.float32)] * len(key))

    def check_invalid_key_types_single(kv, key):
        dns_val = ones(shape) * 2
        rsp_val = tostype(dns_val, 'row_sparse')
        assertRaises(MXNetError, kv.init, key, dns_val)
        assertRaises(MXNetError, kv.push, key, dns_val)
        assertRaises(MXNetError, kv.pull, key, dns_val)
        assertRaises(MXNetError, kv.row_sparse_pull, key, rsp_val,
                     row_ids=np.array([1], np.float32))

    def check_invalid_key_types_list(kv, key):
        dns_val = [ones(shape) * 2] * len(key)
        rsp_val = [tostype(val, 'row_sparse') for val in dns_val]
        assertRaises(MXNetError, kv.init, key, dns_val)
        assertRaises(MXNetError, kv.push, key, dns_val)
        assertRaises(MXNetError, kv.pull, key, dns_val)
        assertRaises(MXNetError, kv.row_sparse_pull, key, rsp_val,
                     row_ids=[np.array([1], np.float32)] * len(key))

    int_kv = init_kv(create, kv_type=kv_type)
    str_kv = init_kv_with_str(create, kv_type=kv_type)

    kvs = [int_kv, str_kv]
    single_keys = [3, 'a']
    list_keys = [keys, str_keys]
    for i in range(2):
        # pull with rsp outputs should be ignored with no values updated
        with pytest.warns(UserWarning, match="RowSparse out is left unchanged"):
            check_ignored_pull_single(kvs[i], single_keys[i])
            check_ignored_pull_list(kvs[i], list_keys[i])
        # row_sparse_pull should be aborted when vals.stype != row_sparse
        check_invalid_rsp_pull_single(kvs[i], single_keys[i])
        check_invalid_rsp_pull_list(kvs[i], list_keys[i])
        # kvstore should be restricted to only accept either int or str keys
        check_invalid_key_types_single(kvs[i], single_keys[1 - i])
        check_invalid_key_types_list(kvs[i], list_keys[1 - i])


# -- tests/python/gpu/test_kvstore_gpu.py (MXNet's contexts: this machine's devices) -------------------

@pytest.fixture
def contexts(tf_devices):
    """mx.gpu(i) and mx.cpu(i) for a store's `devices=`: the GPUs where there are any (two
    contexts on one GPU where there is one), else logical CPU devices."""
    import tensorflow as tf

    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    return lambda i: gpus[i % len(gpus)] if gpus else tf_devices[i]


def test_rsp_push_pull(rng, contexts):
    def check_rsp_push_pull(kv_type, sparse_pull, is_push_cpu=True):
        kv = init_kv_with_str(lambda t: kvstore.create(t, devices=[contexts(i) for i in range(2)]), 'row_sparse',
                              kv_type)
        kv.init('e', tostype(ones(shape), 'row_sparse'))
        push_ctxs = range(2)  # MXNet's cpu(i) or gpu(i): where each pushed value is
        kv.push('e', [tostype(ones(shape), 'row_sparse') for context in push_ctxs])

        def check_rsp_pull(kv, ctxs, sparse_pull, is_same_rowid=False, use_slice=False):
            count = len(ctxs)
            num_rows = shape[0]
            row_ids = []
            all_row_ids = np.arange(num_rows)
            vals = [nd_zeros(shape=shape, stype='row_sparse') for i in range(count)]
            if is_same_rowid:
                row_id = rng.integers(num_rows, size=num_rows)
                row_ids = [np.array(row_id, np.float32)] * count
            elif use_slice:
                total_row_ids = np.array(rng.integers(num_rows, size=count*num_rows), np.float32)
                row_ids = [total_row_ids[i*num_rows : (i+1)*num_rows] for i in range(count)]
            else:
                for i in range(count):
                    row_id = rng.integers(num_rows, size=num_rows)
                    row_ids.append(np.array(row_id, np.float32))
            row_ids_to_pull = row_ids[0] if (len(row_ids) == 1 or is_same_rowid) else row_ids
            vals_to_pull = vals[0] if len(vals) == 1 else vals

            kv.row_sparse_pull('e', out=vals_to_pull, row_ids=row_ids_to_pull)
            for val, row_id in zip(vals, row_ids):
                retained = asnumpy(val)
                excluded_row_ids = np.setdiff1d(all_row_ids, row_id)
                for row in range(num_rows):
                    expected_val = np.zeros_like(retained[row])
                    expected_val += 0 if row in excluded_row_ids else 2
                    assert_almost_equal(retained[row], expected_val)

            if sparse_pull is True:
                kv.pull('e', out=vals_to_pull, ignore_sparse=False)
                for val in vals:
                    retained = asnumpy(val)
                    expected_val = np.zeros_like(retained)
                    expected_val[:] = 2
                    assert_almost_equal(retained, expected_val)

        check_rsp_pull(kv, [0], sparse_pull)
        check_rsp_pull(kv, [0], sparse_pull)
        check_rsp_pull(kv, [i//2 for i in range(4)], sparse_pull)
        check_rsp_pull(kv, [i//2 for i in range(4)], sparse_pull, is_same_rowid=True)
        check_rsp_pull(kv, [i for i in range(4)], sparse_pull)
        check_rsp_pull(kv, [i for i in range(4)], sparse_pull, is_same_rowid=True)
        check_rsp_pull(kv, [i//2 for i in range(4)], sparse_pull, use_slice=True)
        check_rsp_pull(kv, [i for i in range(4)], sparse_pull, use_slice=True)

    # MXNet runs it with MXNET_KVSTORE_USETREE unset (sparse_pull True) and set (False); tfkv has
    # no tree reduction, so only what the flag changes in the checks varies
    for sparse_pull in (True, False):
        check_rsp_push_pull('local', sparse_pull)
        check_rsp_push_pull('device', sparse_pull)
        check_rsp_push_pull('device', sparse_pull, is_push_cpu=False)


def test_row_sparse_pull_single_device(contexts, rng):
    kv = kvstore.create('device', devices=[contexts(0)])
    copy = rng.normal(size=(4, 4)).astype(np.float32)
    grad = tostype(copy, "row_sparse")

    key = 0
    kv.init(key, grad)
    idx = grad.indices
    kv.push(key, grad)
    kv.row_sparse_pull(key, out=grad, row_ids=idx)

    assert_almost_equal(asnumpy(grad), copy)


def test_rsp_push_pull_large_rowid(contexts):
    num_rows = 793470
    val = tostype(ones((num_rows, 1)), 'row_sparse')
    kv = kvstore.create('device', devices=[contexts(0)])
    kv.init('a', val)
    out = nd_zeros((num_rows, 1), stype='row_sparse')
    kv.push('a', val)
    kv.row_sparse_pull('a', out=out, row_ids=np.arange(0, num_rows, dtype='int64'))
    assert(out.indices.shape[0] == num_rows)


# -- tests/nightly/dist_sync_kvstore.py: its row-sparse checks in each worker of a real job -----------

def _dist(cluster, kind, store="dist_sync"):
    """Every worker's outcome of MXNet's `--type kind` checks (tests/workers/mxnet_dist_sync.py) in a
    job of 2 servers and 2 workers: {check name: "ok" or the error's line}."""
    from test_sparse_dist import _job

    return _job(cluster, kind, kind=store, worker=str(Path(__file__).parents[1] / "workers" / "mxnet_dist_sync.py"))


def _all_ok(outcomes):
    for rank, outcome in enumerate(outcomes):
        assert outcome and all(v == "ok" for v in outcome.values()), (rank, outcome)


@pytest.mark.slow
def test_dist_sync_row_sparse_keys(cluster):
    """check_row_sparse_keys, check_row_sparse_keys_with_zeros, check_big_row_sparse_keys
    (float32), 7 rounds each, under MXNet's test optimizer (w += 2 * g)."""
    outcomes = _dist(cluster, "default_cpu")
    assert set(outcomes[0]) == {"check_row_sparse_keys", "check_row_sparse_keys_with_zeros",
                                "check_big_row_sparse_keys"}
    _all_ok(outcomes)


@pytest.mark.slow
def test_dist_sync_row_sparse_keys_float16(cluster):
    """The same checks of float16 row-sparse keys (issue 40, point 9: refused by tfkv so far)."""
    _all_ok(_dist(cluster, "default_cpu_float16"))


@pytest.mark.slow
def test_dist_sync_invalid_pull_and_sparse_trainer_step(cluster):
    _all_ok(_dist(cluster, "invalid_cpu"))
    _all_ok(_dist(cluster, "gluon_sparse_step_cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("store", ["dist_sync", "dist_async"])
def test_dist_stores_pair_outs_with_row_ids_and_add_rows_into_dense_keys(cluster, store):
    _all_ok(_dist(cluster, "paired_cpu", store))


# -- what the port needs of tfkv, beyond MXNet's checks -----------------------------------------------

@pytest.mark.parametrize("kv_type", STORES)
def test_a_row_sparse_push_to_a_dense_key_goes_through_the_optimizer(create, kv_type):
    """MXNet's dense weight with a row_sparse gradient: the standard update, as for the dense
    gradient the rows stand for (weight decay on every row). numpy closed form."""
    kv = create(kv_type)
    w = np.arange(8, dtype=np.float32).reshape(4, 2)
    kv.init(3, w)
    kv.set_optimizer(optim.create("sgd", learning_rate=0.5, wd=0.1, lazy_update=True))
    rows = RowSparse(np.array([[1, 2], [3, 4], [1, 1]], np.float32), np.array([2, 0, 2]), (4, 2))
    kv.push(3, [rows, rows])
    g = np.zeros((4, 2), np.float32)
    g[2], g[0] = 2 * np.array([2, 3]), 2 * np.array([3, 4])
    np.testing.assert_allclose(kv.pull(3).numpy(), w - 0.5 * (g + 0.1 * w), rtol=1e-6)
    with pytest.raises(ValueError, match="push of key 3: row id 4 is out of range; the table has 4 rows"):
        kv.push(3, RowSparse(np.ones((1, 2), np.float32), np.array([4]), (4, 2)))


@pytest.mark.parametrize("kv_type", STORES)
def test_row_sparse_pull_pairs_each_out_with_its_row_ids(create, kv_type):
    """Issue 40's case (int ids): out i gets rows r_i only, not the union; one array for every out."""
    kv = create(kv_type)
    kv.init('e', RowSparse(np.arange(8, dtype=np.float32).reshape(4, 2), np.arange(4), (4, 2)))
    o1, o2 = RowSparse.zeros((4, 2)), RowSparse.zeros((4, 2))
    kv.row_sparse_pull('e', out=[o1, o2], row_ids=[np.array([2, 0]), np.array([3, 3])])
    assert (o1.indices.tolist(), o1.data.tolist()) == ([0, 2], [[0, 1], [4, 5]])
    assert (o2.indices.tolist(), o2.data.tolist()) == ([3], [[6, 7]])
    kv.row_sparse_pull('e', out=[o1, o2], row_ids=np.array([1]))
    assert o1.indices.tolist() == o2.indices.tolist() == [1] and o1.data.tolist() == o2.data.tolist() == [[2, 3]]
    one, two = kv.row_sparse_pull('e', row_ids=[[1], [2, 1]])  # without out: one RowSparse per array
    assert (one.indices.tolist(), two.indices.tolist()) == ([1], [1, 2])
    with pytest.raises(ValueError, match=r"^row_sparse_pull of key 'e': 2 arrays of row_ids for 3 outs"):
        kv.row_sparse_pull('e', out=[o1, o2, RowSparse.zeros((4, 2))], row_ids=[[0], [1]])


def test_lazy_update_is_taken_where_it_means_what_tfkv_does():
    assert optim.create("adam", learning_rate=0.1, lazy_update=True) == optim.create("adam", learning_rate=0.1)
    with pytest.raises(ValueError, match="optimizer sgd: lazy_update=False is not supported by tfkv; it always updates"):
        optim.create("sgd", lazy_update=False)


@pytest.mark.parametrize("kv_type", STORES)
def test_row_ids_as_floats_must_be_whole_numbers(create, kv_type):
    kv = create(kv_type)
    kv.init('e', RowSparse.from_dense(np.eye(3, dtype=np.float32)))
    got = kv.row_sparse_pull('e', row_ids=np.array([2.0, 0.0, 2.0], np.float16))
    assert got.indices.tolist() == [0, 2] and got.dense().tolist() == [[1, 0, 0], [0, 0, 0], [0, 0, 1]]
    with pytest.raises(ValueError, match=r"^row_sparse_pull of key 'e': row id 1.5 is not a whole number; give whole "
                                         r"numbers from 0 to 2$"):
        kv.row_sparse_pull('e', row_ids=np.array([0, 1.5], np.float32))
    with pytest.raises(ValueError, match="row_sparse_pull of key 'e': row id nan is not a whole number"):
        kv.row_sparse_pull('e', row_ids=[np.nan])


@pytest.mark.parametrize("kv_type", STORES)
def test_a_dense_pull_of_a_row_sparse_key_gives_its_whole_value_here(create, kv_type):
    """The single-machine stores hold a row-sparse key whole, as MXNet's local store: its dense
    pull (MXNet's, into a dense out) is the whole table; the dist_* stores refuse it, as MXNet's
    dist kvstore does (tests/store/test_sparse_dist.py)."""
    kv = create(kv_type)
    kv.init('e', RowSparse(np.array([[1, 2]], np.float32), np.array([1]), (3, 2)))
    out = np.full((3, 2), 7, np.float32)
    kv.pull('e', out=out)
    assert out.tolist() == [[0, 0], [1, 2], [0, 0]]
    assert kv.pull('e').numpy().tolist() == [[0, 0], [1, 2], [0, 0]]


def test_row_sparse_conveniences_of_mxnet():
    dense = np.array([[0, 0], [1, 0], [0, 0], [0, -2]], np.float16)
    rows = RowSparse.from_dense(dense)
    assert rows.indices.tolist() == [1, 3] and rows.data.dtype == np.float16 and rows.shape == (4, 2)
    assert np.array_equal(rows.todense(), dense) and np.array_equal(rows.asnumpy(), dense)
    zeros = RowSparse.zeros((5, 2, 3))
    assert zeros.data.shape == (0, 2, 3) and zeros.data.dtype == np.float32 and zeros.indices.dtype == np.int64
    assert np.array_equal(zeros.todense(), np.zeros((5, 2, 3), np.float32))


@pytest.mark.parametrize("kv_type", STORES)
def test_rows_into_a_dense_key_and_float_ids_trace_into_a_tf_function(create, kv_type):
    """As the trainer traces the single-machine stores: a RowSparse pushed to a dense key is
    scattered (repeats summed), whole float ids pull their rows, a fraction fails the step."""
    import tensorflow as tf

    kv = create(kv_type)
    kv.init(1, np.zeros((4, 2), np.float32))
    kv.init(2, RowSparse.from_dense(np.eye(4, dtype=np.float32)))

    @tf.function
    def step(ids, row_ids):
        kv.push(1, RowSparse(tf.ones([tf.size(ids), 2]), ids, (4, 2)))
        got = kv.row_sparse_pull(2, row_ids=row_ids)
        return kv.pull(1), got.indices, got.data

    dense, ids, rows = step(tf.constant([1, 3, 1], tf.int64), tf.constant([3.0, 1.0, 3.0]))
    assert dense.numpy().tolist() == [[0, 0], [2, 2], [0, 0], [1, 1]]
    assert ids.numpy().tolist() == [1, 3] and rows.numpy().tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    with pytest.raises(tf.errors.InvalidArgumentError, match="row_sparse_pull of key 2: a row id is not a whole number"):
        step(tf.constant([0], tf.int64), tf.constant([1.5]))
