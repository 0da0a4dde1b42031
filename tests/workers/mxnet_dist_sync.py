"""MXNet v1.9.1's tests/nightly/dist_sync_kvstore.py, its row-sparse checks, ported to tfkv's API
(mx.nd -> numpy and tfkv.store.RowSparse; MXNet's checks, names and values as they are), run as
one worker of a real dist_* job by tests/store/test_mxnet_rowsparse.py:
`python mxnet_dist_sync.py TYPE OUT_JSON` (TEST_KVSTORE names the store type). TYPE is MXNet's
--type: `default_cpu` (the row-sparse keys of test_sync_push_pull, float32), `default_cpu_float16`
(the same checks in float16), `invalid_cpu` (check_invalid_pull), `gluon_sparse_step_cpu` (the
KVStore calls of gluon's sparse Trainer step); `paired_cpu` adds what the port needs of a dist
store beyond MXNet's file (row_sparse_pull's outs paired with their row ids, rows pushed to a dense
key). Each check's outcome ("ok" or its error's last line) goes to OUT_JSON, by name.
"""

import json
import os
import sys
import traceback

import numpy as np
import numpy.random as rnd

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402
from tfkv.store import RowSparse  # noqa: E402

MXNetError = (ValueError, TypeError)


def asnumpy(value):
    return value.asnumpy() if isinstance(value, RowSparse) else np.asarray(value)


def tostype(value, stype):
    return RowSparse.from_dense(value) if stype == 'row_sparse' else value


def nd_zeros(shape, stype='default', dtype='float32'):
    return RowSparse.zeros(shape, dtype) if stype == 'row_sparse' else np.zeros(shape, dtype)


def check_diff(A, x, rank=None):
    """ assert A == x
        x can be scalar as well as numpy array
    """
    assert (np.sum(np.abs(asnumpy(A) - asnumpy(x))) == 0), (rank, asnumpy(A), asnumpy(x))


def assert_almost_equal(a, b):
    np.testing.assert_allclose(asnumpy(a), asnumpy(b), rtol=1e-5, atol=1e-20)


def assert_exception(f, exception_type, *args, **kwargs):
    try:
        f(*args, **kwargs)
    except exception_type:
        return
    raise AssertionError(f"{f.__name__} raised no {exception_type}")


def test_optimizer(rescale_grad, multi_precision):
    """MXNet's mx.optimizer.create('test', rescale_grad=...): weight += rescale_grad * grad, which
    is SGD at the rate -1 (a row-sparse key's update touches the rows pushed only, as MXNet's)."""
    return optim.SGD(schedule=optim.Schedule(lr=-1.0), rescale_grad=rescale_grad, multi_precision=multi_precision)


# setup
shape = (2, 3)
irregular_shape = (1211, 1211)
big_shape = (1200, 1200)        # bigger than MXNET_KVSTORE_BIGARRAY_BOUND

keys_invalid = [999]
rsp_keys_shape = ['9', '11', '13']
rsp_keys_big_shape = ['97']
fp16_rsp_keys_shape = ['10', '12', '14']
fp16_rsp_keys_big_shape = ['98']

rate = 2

kv = tfkv.store.create(os.environ.get("TEST_KVSTORE", "dist_sync"))

my_rank = kv.rank
nworker = kv.num_workers


def init_kv(dtype):
    """MXNet's init_kv, the row-sparse keys of `dtype` (its dense keys are not these checks')."""
    if dtype == 'float32':
        # # init kv row_sparse keys
        kv.init(rsp_keys_shape, [tostype(np.ones(shape, np.float32), 'row_sparse')] * len(rsp_keys_shape))
        kv.init(rsp_keys_big_shape, [tostype(np.ones(big_shape, np.float32), 'row_sparse')] * len(rsp_keys_big_shape))
    else:
        # init fp16 row_sparse keys
        kv.init(fp16_rsp_keys_shape, [tostype(np.ones(shape, dtype='float16'), 'row_sparse')] * len(fp16_rsp_keys_shape))
        kv.init(fp16_rsp_keys_big_shape, [tostype(np.ones(big_shape, dtype='float16'), 'row_sparse')]
                * len(fp16_rsp_keys_big_shape))
    return kv


def set_optimizer(use_multiprecision):
    # init updater on servers
    kv.set_optimizer(test_optimizer(rescale_grad=rate, multi_precision=use_multiprecision))
    return kv


def check_row_sparse_keys(dtype, nrepeat):
    # prepare gradient
    v = np.zeros(shape, dtype=dtype)
    my_row = my_rank % shape[0]
    v[my_row] = my_rank + 1
    # push
    if dtype == 'float32':
        k = rsp_keys_shape[0]
    else:
        k = fp16_rsp_keys_shape[0]
    s = shape
    for i in range(nrepeat):
        kv.push(k, tostype(v, 'row_sparse'))
        # select a random subset of rows this worker is interested in
        num_rows = s[0]
        row_ids_np = np.random.randint(num_rows, size=num_rows)
        row_ids = np.array(row_ids_np, np.float32).reshape((num_rows//2, 2)).astype(dtype)  # mx.nd.array
        # perform pull
        val = nd_zeros(s, stype='row_sparse', dtype=dtype)
        kv.row_sparse_pull(k, out=val, row_ids=row_ids)
        # prepare updated values
        updated_val = np.ones(s, dtype=dtype)
        for rank in range(nworker):
            row = rank % s[0]
            updated_val[row] += (rank + 1) * rate * (i+1)
        # verify subset of updated values
        expected = np.zeros(s, dtype=dtype)
        for row in row_ids_np:
            expected[row] = updated_val[row]
        check_diff(val, expected, kv.rank)


def check_row_sparse_keys_with_zeros(dtype, nrepeat):
    if dtype == 'float32':
        k1 = rsp_keys_shape[1]
        k2 = rsp_keys_big_shape[0]
    else:
        k1 = fp16_rsp_keys_shape[1]
        k2 = fp16_rsp_keys_big_shape[0]
    # prepare gradient
    v = nd_zeros(shape, 'row_sparse', dtype=dtype)
    big_v = nd_zeros(big_shape, 'row_sparse', dtype=dtype)
    # push
    for i in range(nrepeat):
        kv.push(k1, v)
        kv.push(k2, big_v)
        # pull a subset of rows this worker is interested in
        all_row_ids = np.arange(shape[0])
        val = nd_zeros(shape, 'row_sparse')
        big_val = nd_zeros(big_shape, 'row_sparse')
        kv.row_sparse_pull(k1, out=val, row_ids=np.array(all_row_ids, np.float32))
        big_all_row_ids = np.arange(big_shape[0])
        kv.row_sparse_pull(k2, out=big_val, row_ids=np.array(big_all_row_ids, np.float32))
        # verify results
        check_diff(val, 1)
        check_diff(big_val, 1)
        # pull empty weights
        kv.row_sparse_pull(k1, out=val, row_ids=np.array([], np.float32))
        kv.row_sparse_pull(k2, out=big_val, row_ids=np.array([], np.float32))
        check_diff(val, 0)
        check_diff(big_val, 0)


def check_big_row_sparse_keys(dtype, nrepeat):
    if dtype == 'float32':
        k = rsp_keys_big_shape[0]
    else:
        k = fp16_rsp_keys_big_shape[0]

    rnd.seed(123)
    density = 0.3
    # prepare gradient
    v = np.zeros(big_shape, dtype=dtype)
    idx_sample = rnd.rand(big_shape[0])
    indices = np.argwhere(idx_sample < density).flatten()
    # each worker chooses a subset of the indices to update
    update_rows = []
    for rank in range(nworker):
        rows = []
        i = 0
        step = (rank + 1) * 2
        while i < len(indices):
            rows.append(indices[i])
            i += step
        update_rows.append(np.array(rows))
    # rows to update for this worker
    for row in update_rows[my_rank]:
        v[row] = my_rank + 1
    # push
    for i in range(nrepeat):
        kv.push(k, tostype(v, 'row_sparse'))
        # select a random subset of rows this worker is interested in
        rnd.seed(my_rank)
        num_rows = big_shape[0]
        row_ids_np = np.random.randint(num_rows, size=num_rows)
        row_ids = np.array(row_ids_np, np.float32).reshape((num_rows//2, 2)).astype(dtype)
        # perform pull
        val = nd_zeros(big_shape, stype='row_sparse', dtype=dtype)
        kv.row_sparse_pull(k, out=val, row_ids=row_ids)
        # prepare expected result
        updated_val = np.ones(big_shape, dtype=dtype)
        # apply updates from each worker
        for rank in range(nworker):
            for row in update_rows[rank]:
                updated_val[row] += (rank + 1) * rate * (i+1)

        expected = np.zeros(big_shape, dtype=dtype)
        for row in row_ids_np:
            expected[row] = updated_val[row]
        check_diff(val, expected.astype(dtype), rank=my_rank)


def check_invalid_pull():
    kv.init(keys_invalid[0], tostype(np.ones((2, 2), np.float32), 'row_sparse'))
    out = tostype(np.ones((2, 2), np.float32), 'row_sparse')
    assert_exception(kv.pull, MXNetError, 'invalid_key', out=out, ignore_sparse=False)


def check_trainer_sparse_step():
    """gluon's Trainer over a row_sparse Parameter, as the KVStore calls it makes: the key made
    from the Parameter (init 'ones'), the optimizer set on the store (update_on_kvstore), the
    row_sparse gradient of y = (rank+1) * w pushed by step(1) and the rows read back by
    x.row_sparse_data(all_rows)."""
    shape = (2, 10)
    all_rows = np.arange(0, shape[0], dtype=np.float32)  # mx.nd.arange
    kv.init('x', tostype(np.ones(shape, np.float32), 'row_sparse'))
    kv.set_optimizer(optim.create('sgd', learning_rate=1.0))
    grad = tostype(np.full(shape, my_rank + 1, np.float32), 'row_sparse')  # y.backward()
    kv.push('x', grad)  # trainer.step(1)
    expected = 1 - (1 + nworker) * nworker / 2
    assert_almost_equal(asnumpy(kv.row_sparse_pull('x', row_ids=all_rows)), np.full(shape, expected))


def check_paired_row_sparse_pull():
    """test_kvstore.py's test_row_sparse_pull on a dist store: out i gets rows row_ids[i] only."""
    shape = (4, 4)
    kv.init('e', tostype(np.ones(shape, np.float32), 'row_sparse'))
    kv.barrier()
    rng = np.random.default_rng(my_rank)
    row_ids = [rng.integers(shape[0], size=shape[0]) for _ in range(4)]  # int64: float ids are another check's
    vals = [nd_zeros(shape, 'row_sparse') for _ in row_ids]
    kv.row_sparse_pull('e', out=vals, row_ids=row_ids)
    for val, row_id in zip(vals, row_ids):
        expected = np.zeros(shape, np.float32)
        expected[row_id] = 1
        check_diff(val, expected, my_rank)


def check_rows_into_dense_key(nrepeat):
    """test_kvstore.py's row_sparse pushes to dense keys on a dist store, through the servers'
    optimizer (MXNet's test optimizer: w += rate * g): every worker's rows summed in."""
    kv.init('dense', np.ones(shape, np.float32))
    for i in range(nrepeat):
        v = np.zeros(shape, np.float32)
        v[my_rank % shape[0]] = my_rank + 1
        kv.push('dense', tostype(v, 'row_sparse'))
        kv.barrier()  # dist_async applies each push as it comes: all of them, then read
        val = np.zeros(shape, np.float32)
        kv.pull('dense', out=val)
        expected = np.ones(shape, np.float32)
        for rank in range(nworker):
            expected[rank % shape[0]] += (rank + 1) * rate * (i + 1)
        check_diff(val, expected, my_rank)
        kv.barrier()


def _checks(kind, nrepeat):
    if kind in ('default_cpu', 'default_cpu_float16'):
        dtype = 'float16' if kind.endswith('float16') else 'float32'
        init_kv(dtype)
        set_optimizer(use_multiprecision=True)
        return [(f.__name__, lambda f=f: f(dtype, nrepeat))
                for f in (check_row_sparse_keys, check_row_sparse_keys_with_zeros, check_big_row_sparse_keys)]
    if kind == 'invalid_cpu':
        return [('check_invalid_pull', check_invalid_pull)]
    if kind == 'gluon_sparse_step_cpu':
        return [('check_trainer_sparse_step', check_trainer_sparse_step)]
    if kind == 'paired_cpu':
        set_optimizer(use_multiprecision=False)
        return [('check_paired_row_sparse_pull', check_paired_row_sparse_pull),
                ('check_rows_into_dense_key', lambda: check_rows_into_dense_key(nrepeat))]
    raise RuntimeError("Unknown test type")


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    nrepeat = int(os.environ.get("TEST_NREPEAT", "7"))
    outcome = {}
    try:
        checks = _checks(kind, nrepeat)
    except Exception as e:  # noqa: BLE001 - the setup's failure is every check's
        checks = [("setup", lambda e=e: (_ for _ in ()).throw(e))]
    for name, check in checks:
        try:
            check()
            outcome[name] = "ok"
        except Exception as e:  # noqa: BLE001 - what a check raised is its outcome
            outcome[name] = (traceback.format_exception_only(type(e), e)[-1].strip())[:2000]
    with open(path, "w") as f:
        json.dump(outcome, f)
    kv.close()
