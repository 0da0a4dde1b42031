"""A worker of a dist_sync job for tests/store/test_sparse_dist_sync.py: `python rows_sync_worker.py
SCENARIO OUT_JSON [args]`. Each scenario uses a real store against real scheduler and server
processes and writes what it pulled to OUT_JSON; the test checks it against numpy closed forms.

rounds N: issue 40's reproduction of a row pull one round old. One row-sparse key of shape (2, 3);
  each round this worker pushes row rank % 2 (value rank + 1), then pulls 2 random row ids (so
  some pulls skip the server of the other row); optimizer w += 2 * g. OUT: each round's pulled ids
  and rows.
mxnet DTYPE NREPEAT [MULTI_PRECISION]: MXNet v1.9.1's dist_sync check_row_sparse_keys,
  check_row_sparse_keys_with_zeros and check_big_row_sparse_keys (tests/nightly/dist_sync_kvstore.py)
  in DTYPE, with its `test` optimizer (w += rescale_grad * g, rescale_grad 2; multi_precision
  "1", MXNet's default there, or "0", its --no-multiprecision); each check's own assertion is made
  here, as MXNet's (exact equality, in DTYPE), and OUT says which checks ran.
"""

import json
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402
from tfkv.store import RowSparse, Table  # noqa: E402


def rounds(kv, out, n):
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=-2.0), rescale_grad=1.0))  # w += 2 * g
    kv.init("w", RowSparse(np.zeros((2, 3), np.float32), np.arange(2), (2, 3)))
    rng = np.random.default_rng(100 + kv.rank)
    pulled = []
    for _ in range(int(n)):
        kv.push("w", RowSparse(np.full((1, 3), kv.rank + 1, np.float32), np.array([kv.rank % 2]), (2, 3)))
        got = kv.row_sparse_pull("w", row_ids=rng.integers(0, 2, size=2))
        pulled.append([np.asarray(got.indices).tolist(), np.asarray(got.data).tolist()])
    json.dump({"rank": kv.rank, "pulled": pulled}, out)


# -- MXNet's checks, as tests/nightly/dist_sync_kvstore.py writes them (v1.9.1) ---------------------

SHAPE, BIG_SHAPE, RATE = (2, 3), (1200, 1200), 2


def check_diff(got, want, rank=None):
    """MXNet's check_diff: assert A == x exactly (`want` a scalar or an array), in got's dtype."""
    assert np.sum(np.abs(np.asarray(got) - want)) == 0, (rank, got, want)


def _dense(rows, shape, dtype):
    """A pulled RowSparse as MXNet's out: the rows it holds, zeros elsewhere."""
    out = np.zeros(shape, dtype)
    out[np.asarray(rows.indices)] = np.asarray(rows.data)
    return out


def _rsp(dense):
    """MXNet's tostype('row_sparse'): the rows that are not all zero."""
    ids = np.flatnonzero(np.any(dense.reshape(len(dense), -1) != 0, axis=1))
    return RowSparse(dense[ids], ids, dense.shape)


def mxnet(kv, out, dtype, nrepeat, multi_precision="1"):
    dtype, nrepeat = np.dtype(dtype), int(nrepeat)
    rank, nworker = kv.rank, kv.num_workers
    ones, big_ones = np.ones(SHAPE, dtype), np.ones(BIG_SHAPE, dtype)
    kv.init(["rsp", "rsp1", "rsp_big"], [_rsp(ones), _rsp(ones), _rsp(big_ones)])
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=-1.0), rescale_grad=RATE,  # MXNet's `test`: w += 2 * g
                               multi_precision=multi_precision == "1"))

    # check_row_sparse_keys
    v = np.zeros(SHAPE, dtype)
    v[rank % SHAPE[0]] = rank + 1
    for i in range(nrepeat):
        kv.push("rsp", _rsp(v))
        row_ids_np = np.random.randint(SHAPE[0], size=SHAPE[0])
        val = kv.row_sparse_pull("rsp", row_ids=row_ids_np.reshape(SHAPE[0] // 2, 2).reshape(-1))
        updated_val = np.ones(SHAPE, dtype)
        for r in range(nworker):
            updated_val[r % SHAPE[0]] += (r + 1) * RATE * (i + 1)
        expected = np.zeros(SHAPE, dtype)
        for row in row_ids_np:
            expected[row] = updated_val[row]
        assert np.asarray(val.data).dtype == dtype
        check_diff(_dense(val, SHAPE, dtype), expected, rank)

    # check_row_sparse_keys_with_zeros
    zeros = RowSparse(np.zeros((0, *SHAPE[1:]), dtype), np.zeros(0, np.int64), SHAPE)
    big_zeros = RowSparse(np.zeros((0, *BIG_SHAPE[1:]), dtype), np.zeros(0, np.int64), BIG_SHAPE)
    for i in range(nrepeat):
        kv.push("rsp1", zeros)
        kv.push("rsp_big", big_zeros)
        val = kv.row_sparse_pull("rsp1", row_ids=np.arange(SHAPE[0]))
        big_val = kv.row_sparse_pull("rsp_big", row_ids=np.arange(BIG_SHAPE[0]))
        check_diff(_dense(val, SHAPE, dtype), 1)
        check_diff(_dense(big_val, BIG_SHAPE, dtype), 1)
        val = kv.row_sparse_pull("rsp1", row_ids=np.zeros(0, np.int64))
        big_val = kv.row_sparse_pull("rsp_big", row_ids=np.zeros(0, np.int64))
        check_diff(_dense(val, SHAPE, dtype), 0)
        check_diff(_dense(big_val, BIG_SHAPE, dtype), 0)

    # check_big_row_sparse_keys
    rnd = np.random.RandomState(123)
    density = 0.3
    v = np.zeros(BIG_SHAPE, dtype)
    indices = np.argwhere(rnd.rand(BIG_SHAPE[0]) < density).flatten()
    update_rows = [indices[::(r + 1) * 2] for r in range(nworker)]  # each worker's subset
    v[update_rows[rank]] = rank + 1
    for i in range(nrepeat):
        kv.push("rsp_big", _rsp(v))
        np.random.seed(rank)
        row_ids_np = np.random.randint(BIG_SHAPE[0], size=BIG_SHAPE[0])
        val = kv.row_sparse_pull("rsp_big", row_ids=row_ids_np)
        updated_val = np.ones(BIG_SHAPE, dtype)
        for r in range(nworker):
            updated_val[update_rows[r]] += (r + 1) * RATE * (i + 1)
        expected = np.zeros(BIG_SHAPE, dtype)
        expected[row_ids_np] = updated_val[row_ids_np]
        assert np.asarray(val.data).dtype == dtype
        check_diff(_dense(val, BIG_SHAPE, dtype), expected, rank)
    # beyond MXNet: a Table of DTYPE, drawn by the servers, comes back in DTYPE within its scale
    kv.init("drawn", Table((50, 4), dtype=dtype.name, init="uniform", scale=0.5, seed=3))
    drawn = np.asarray(kv.row_sparse_pull("drawn", row_ids=np.arange(50)).data)
    assert drawn.dtype == dtype and np.abs(drawn).max() <= 0.5 and np.std(drawn) > 0.1, drawn
    json.dump({"rank": rank, "checked": ["check_row_sparse_keys", "check_row_sparse_keys_with_zeros",
                                         "check_big_row_sparse_keys"], "dtype": dtype.name,
               "multi_precision": multi_precision == "1"}, out)


if __name__ == "__main__":
    store = tfkv.store.create(os.environ.get("TEST_KVSTORE", "dist_sync"))
    with open(sys.argv[2], "w") as f:
        {"rounds": rounds, "mxnet": mxnet}[sys.argv[1]](store, f, *sys.argv[3:])
    store.close()
