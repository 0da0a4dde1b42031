"""A worker of a dist_* job for tests/store/test_sparse_dist.py: `python sparse_dist_worker.py
SCENARIO OUT_JSON [args]` (TEST_KVSTORE names the type). Each scenario uses a real store against
real scheduler and server processes and writes what it saw to OUT_JSON."""

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402
from tfkv.store import RowSparse, Table  # noqa: E402


def _raises(call):
    try:
        call()
    except Exception as e:  # noqa: BLE001 - what was raised is the result
        return f"{type(e).__name__}: {e}"
    return None


def sgd(kv, out):
    """Every worker pushes rows 2*step+rank and row 7 for 3 rounds into a zeros table (lazy SGD,
    lr 1, wd 0.5); every step's pull of every row right after the push; then state saved, changed
    and loaded back; a RowSparse init read back; the pull of a uniform Table."""
    r = kv.rank
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0), wd=0.5, momentum=0.5))
    kv.init("t", Table((12, 2, 2), init="zeros"))
    kv.init("given", RowSparse(np.arange(12, dtype=np.float32).reshape(3, 2, 2), np.array([11, 0, 5]), (12, 2, 2)))
    kv.init("u", Table((100_000, 4), init="uniform", scale=0.25, seed=5))
    seen = []
    for step in range(3):
        ids = np.array([2 * step + r, 7, 7])
        kv.push("t", RowSparse(np.ones((3, 2, 2), np.float32) * (r + 1), ids, (12, 2, 2)))
        pulled = kv.row_sparse_pull("t", row_ids=np.arange(12))
        seen.append(pulled.data[:, 0, 0].tolist())
    pending = kv.row_sparse_pull_async(["t", "given"], [np.array([7, 7, 0]), np.array([5, 11, 1])])
    t_rows, given_rows = kv.rows(pending)
    u = kv.row_sparse_pull("u", row_ids=np.array([99_999, 0, 50_000]))
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "states.npz")
        kv.save_optimizer_states(path)
        with np.load(path) as f:
            saved = {n: f[n].tolist() for n in f.files if n.startswith("t/")}
        kv.load_optimizer_states(path)
    json.dump({"rank": r, "seen": seen, "t_rows": [t_rows.indices.tolist(), t_rows.data[:, 0, 0].tolist()],
               "given": [given_rows.indices.tolist(), given_rows.data.reshape(3, 4).tolist()],
               "u": [u.indices.tolist(), u.data.tolist()], "saved": saved,
               "push_bytes": kv.push_bytes, "pull_bytes": kv.pull_bytes}, out)


def refusals(kv, out):
    """Bad calls, each refused on the worker in one line naming the key; the store serves on."""
    kv.set_optimizer(optim.SGD())
    kv.init("emb", Table((10, 3)))
    kv.init("dense", np.zeros(3, np.float32))
    ok = RowSparse(np.ones((1, 3), np.float32), np.array([1]), (10, 3))
    seen = {
        "dense_pull": _raises(lambda: kv.pull("emb")),
        "pushpull": _raises(lambda: kv.pushpull("emb", ok)),
        "rows_to_dense": _raises(lambda: kv.push("dense", RowSparse(np.ones(1, np.float32), np.array([3]), (3,)))),
        "ignore_sparse": _raises(lambda: kv.pull("dense", out=RowSparse.zeros((3,)), ignore_sparse=False)),
        "dense_to_rows": _raises(lambda: kv.push("emb", np.ones((10, 3), np.float32))),
        "out_of_range": _raises(lambda: kv.push("emb", RowSparse(np.ones((1, 3), np.float32), np.array([10]), (10, 3)))),
        "pull_out_of_range": _raises(lambda: kv.row_sparse_pull("emb", row_ids=np.array([-1]))),
        "disagree": _raises(lambda: kv.push("emb", RowSparse(np.ones((2, 3), np.float32), np.array([1]), (10, 3)))),
        "dtype": _raises(lambda: kv.push("emb", RowSparse(np.ones((1, 3), np.float64), np.array([1]), (10, 3)))),
        "half_table": _raises(lambda: kv.init("h", RowSparse(np.ones((1, 3), np.float64), np.array([1]), (10, 3)))),
        "sparse_pull_dense": _raises(lambda: kv.row_sparse_pull("dense", row_ids=np.array([0]))),
    }
    kv.push("emb", ok)
    seen["after"] = kv.row_sparse_pull("emb", row_ids=np.array([1])).data.shape[0]
    skipped = RowSparse.from_dense(np.full(3, 2, np.float32))
    kv.pull("dense", out=skipped)  # MXNet's ignore_sparse=True: left as it is
    seen["skipped"] = skipped.dense().tolist()
    json.dump(seen, out)


def too_big(kv, out):
    """A table larger than the server's memory: the server refuses its shard naming the key's
    id; the worker's error names the key as its caller did."""
    kv.init("small", Table((10, 3)))
    seen = {"too_big": _raises(lambda: (kv.init("big", Table((10**11, 64))), kv.servers.settle()))}  # its answer
    seen["after"] = kv.row_sparse_pull("small", row_ids=np.array([1])).data.shape[0]
    json.dump(seen, out)


def wire(kv, out):
    """Bytes counted per push and per pull of the same batch (500 unique rows of 16, repeats in the
    batch) into a table of N rows (argv[3])."""
    rows, width = int(sys.argv[3]), 16
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=0.1)))
    kv.init("emb", Table((rows, width), init="normal", seed=1))
    rng = np.random.default_rng(kv.rank)
    batch = rng.choice(10_000, 500, replace=False)
    ids = np.concatenate([batch, batch[:100]])  # a batch names some rows twice
    grads = np.ones((len(ids), width), np.float32)
    steps = []
    for _ in range(3):
        push0, pull0 = kv.push_bytes, kv.pull_bytes
        kv.push("emb", RowSparse(grads, ids, (rows, width)))
        got = kv.row_sparse_pull("emb", row_ids=ids)
        steps.append([kv.push_bytes - push0, kv.pull_bytes - pull0, len(got.indices)])
    json.dump({"steps": steps}, out)


def contract(kv, out):
    """H1's row-sparse contract (tests/store/sparse_contract.py) as this worker of the job."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "store"))
    import sparse_contract  # tests/store/sparse_contract.py

    with tempfile.TemporaryDirectory() as d:
        json.dump(sparse_contract.run(kv, int(os.environ.get("TEST_DEVICES", "2")), d), out)


SCENARIOS = {f.__name__: f for f in (sgd, refusals, too_big, wire, contract)}

if __name__ == "__main__":
    scenario, path = sys.argv[1], sys.argv[2]
    if scenario == "contract":
        # TensorFlow's import holds the GIL for seconds: done after joining the job it can starve the
        # heartbeat thread past the tests' heartbeat timeout (tests/workers/dist_worker.py does the same)
        import tensorflow  # noqa: F401
    store = tfkv.store.create(os.environ.get("TEST_KVSTORE", "dist_sync"))
    with open(path, "w") as f:
        SCENARIOS[scenario](store, f)
    store.close()
