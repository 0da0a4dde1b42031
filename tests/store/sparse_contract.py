"""The row-sparse contract: what every store type does with row-sparse keys (MXNet's row_sparse
weights), run against one store and reported as plain data, so the same checks run in this
process (local, device) and inside each worker of a real parameter-server job with several
workers (`python sparse_contract.py OUT`, TEST_KVSTORE naming the type).

Every worker makes the same calls in the same order (a synchronous job's rounds close); what a
worker pushes is described once (`pushes`): rows every worker pushes, and a row of its own
(9 - rank). `expected(sync, devices, num_workers, rank)` is what a worker must see: the lazy
optimizer updates come from a numpy closed form written here from MXNet's formulas, not from
tfkv. Where servers apply each push as it comes (dist_async) and several workers push the same
rows, only a worker's own rows have a value that does not depend on timing, and that is all
that is expected of them; no-optimizer pushes are refused there.
`mismatches(seen, want)` compares (floats to a relative 1e-4).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable

import numpy as np

f32 = np.float32
ROWS, WIDTH = 10, 3
SHAPE = (ROWS, WIDTH)
U = np.array([1.0, 2.0, -1.0])  # the direction of every pushed row
MAX_WORKERS = 3  # own rows 9, 8, 7 stay clear of the rows every worker pushes (0..6)

# Keys (ints: every store type takes them). 0 is dense, the rest row-sparse.
DENSE, GIVEN, ZEROS, UNIFORM, NORMAL, REPLACED, SGD_KEY, ADAM_KEY = 0, 100, 101, 102, 103, 104, 110, 120

# The rows every worker pushes in each round, per optimizer; ZERO_ROWS are pushed with zero data
# (a lazy update still applies momentum and weight decay to them: they are named in the push).
ROUNDS = {"sgd": [[1, 4, 1], [4, 6], [1, 6]], "adam": [[2, 5], [5, 0], [2]], "none": [[5, 3, 5]]}
ZERO_ROWS = {("sgd", 2, 6)}
SGD = {"lr": 0.1, "momentum": 0.9, "wd": 0.01}
ADAM = {"lr": 0.05, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-8, "wd": 0.01}
TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


def own_row(rank: int) -> int:
    return ROWS - 1 - rank


def pushes(kind: str, rnd: int, rank: int, device: int) -> tuple[list[int], np.ndarray]:
    """(ids, rows) one device of one worker pushes in a round: the shared ids in that order
    (repeats and all), row k of them (k+1) * 0.1 * (device+1) * (round+1) * U; device 0 also
    pushes the worker's own row, 0.5 * (round+1) * U."""
    ids = list(ROUNDS[kind][rnd])
    scale = 0.1 * (device + 1) * (rnd + 1)
    rows = [np.zeros(WIDTH) if (kind, rnd, i) in ZERO_ROWS else (k + 1) * scale * U for k, i in enumerate(ids)]
    if device == 0:
        ids.append(own_row(rank))
        rows.append(0.5 * (rnd + 1) * U)
    return ids, np.array(rows, f32)


def merged_round(kind: str, rnd: int, devices: int, workers: list[int]) -> dict[int, np.ndarray]:
    """Row id -> the sum of every listed worker's and device's rows for it in that round."""
    total: dict[int, np.ndarray] = {}
    for rank in workers:
        for d in range(devices):
            ids, rows = pushes(kind, rnd, rank, d)
            for i, row in zip(ids, rows.astype(np.float64)):
                total[i] = total.get(i, 0.0) + row
    return total


def initial(key: int) -> np.ndarray:
    """The dense initial table of the optimizer keys: every row nonzero."""
    i = np.arange(ROWS, dtype=np.float64)[:, None]
    if key == SGD_KEY:
        return (i + 1) * 0.1 * np.array([1.0, -1.0, 0.5])
    return (i - 4.5) * 0.2 * np.array([0.5, 1.0, -2.0])


# -- the oracle: MXNet's lazy updates (only the rows named in a push change), in numpy ----------------

def lazy_sgd(devices: int, workers: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(weights, momentum) after the sgd rounds: per pushed row g += wd * w; v = m * v - lr * g;
    w += v (MXNet's sgd_mom_update, lazy_update=True)."""
    w, v = initial(SGD_KEY), np.zeros(SHAPE)
    for rnd in range(len(ROUNDS["sgd"])):
        for i, g in merged_round("sgd", rnd, devices, workers).items():
            g = g + SGD["wd"] * w[i]
            v[i] = SGD["momentum"] * v[i] - SGD["lr"] * g
            w[i] = w[i] + v[i]
    return w, v


def lazy_adam(devices: int, workers: list[int]) -> np.ndarray:
    """Weights after the adam rounds: per pushed row g += wd * w; m, v moving averages; the
    rate corrected with the key's update count t (one per round, every row alike: MXNet's)."""
    w, m, v = initial(ADAM_KEY), np.zeros(SHAPE), np.zeros(SHAPE)
    b1, b2 = ADAM["beta1"], ADAM["beta2"]
    for rnd in range(len(ROUNDS["adam"])):
        t = rnd + 1
        lr = ADAM["lr"] * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        for i, g in merged_round("adam", rnd, devices, workers).items():
            g = g + ADAM["wd"] * w[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            w[i] = w[i] - lr * m[i] / (np.sqrt(v[i]) + ADAM["epsilon"])
    return w


# -- the run ----------------------------------------------------------------------------------------

def _arr(x: Any) -> list:
    return np.asarray(x).tolist()


def _raises(call: Callable[[], Any]) -> str | None:
    """'Type: message' of what `call` raises (the whole message: a refusal is one line), None if
    it returns."""
    try:
        call()
    except Exception as e:  # the contract names the type and message each store must raise
        return f"{type(e).__name__}: {e}"
    return None


def _rs(rows: Any) -> list:
    """A pulled RowSparse as [ids, rows, shape]."""
    return [_arr(rows.indices), _arr(rows.data), list(rows.shape)]


def _push_round(kv: Any, key: int, kind: str, rnd: int, devices: int) -> None:
    """Every device's rows for the round: a RowSparse or a tf.IndexedSlices (int32 ids) by turns."""
    import tensorflow as tf
    from tfkv.store import RowSparse

    values = []
    for d in range(devices):
        ids, rows = pushes(kind, rnd, kv.rank, d)
        if (d + rnd) % 2:
            values.append(tf.IndexedSlices(tf.constant(rows), tf.constant(ids, tf.int32), tf.constant(SHAPE)))
        else:
            values.append(RowSparse(rows, np.array(ids, np.int64), SHAPE))
    kv.push(key, values)


def _all_rows(kv: Any, key: int) -> list:
    return _arr(kv.row_sparse_pull(key, row_ids=np.arange(ROWS)).data)


def _train(kv: Any, key: int, kind: str, devices: int) -> tuple[list, list]:
    """Init `key` with its initial table, push every round of `kind`; (all rows, own row)."""
    from tfkv.store import RowSparse

    kv.init(key, RowSparse(initial(key).astype(f32), np.arange(ROWS), SHAPE))
    for rnd in range(len(ROUNDS[kind])):
        _push_round(kv, key, kind, rnd, devices)
    kv.barrier()
    return _all_rows(kv, key), _arr(kv.row_sparse_pull(key, row_ids=[own_row(kv.rank)]).data)


def run(kv: Any, devices: int, state_dir: str) -> dict[str, Any]:
    """Every check against `kv` (fresh; `devices` values per push); what it saw."""
    from tfkv import optim
    from tfkv.store import RowSparse, Table

    assert kv.num_workers <= MAX_WORKERS, "the contract's own rows need at most 3 workers"
    seen: dict[str, Any] = {"type": kv.type, "rank": kv.rank, "num_workers": kv.num_workers}

    # init: rows given (a repeat summed), a Table's rows made by the store; lists of keys
    kv.init(DENSE, np.zeros(4, f32))
    kv.init(GIVEN, RowSparse(np.array([[1, 2, 3], [4, 5, 6], [1, 1, 1]], f32), np.array([7, 2, 7]), SHAPE))
    kv.init([ZEROS, UNIFORM, NORMAL], [Table(SHAPE, init="zeros"), Table((1000, 4), init="uniform", scale=0.05, seed=3),
                                       Table((1000, 4), init="normal", scale=0.1, seed=3)])
    seen["is_row_sparse"] = [kv.is_row_sparse(k) for k in (DENSE, GIVEN, ZEROS)]
    seen["given"] = _rs(kv.row_sparse_pull(GIVEN, row_ids=np.array([7, 0, 2, 7])))  # repeats, unsorted
    seen["zeros"] = _rs(kv.row_sparse_pull(ZEROS, row_ids=[9, 0]))
    seen["list_of_keys"] = [_rs(r) for r in kv.row_sparse_pull([GIVEN, ZEROS], row_ids=[np.array([2]), np.array([3])])]
    seen["pull_rows_in_order"] = _arr(kv.pull_rows(GIVEN, np.array([7, 2, 7])))
    seen["async_then_rows"] = _rs(kv.rows(kv.row_sparse_pull_async(GIVEN, row_ids=np.array([2, 7, 2]))))
    uniform = np.asarray(kv.row_sparse_pull(UNIFORM, row_ids=np.arange(1000)).data, np.float64)
    normal = np.asarray(kv.row_sparse_pull(NORMAL, row_ids=np.arange(1000)).data, np.float64)
    seen["uniform_in_range"] = bool(np.all(np.abs(uniform) <= 0.05) and np.unique(uniform).size > 3900)
    seen["uniform_std"] = bool(abs(uniform.std() / (0.05 / np.sqrt(3)) - 1) < 0.05 and abs(uniform.mean()) < 0.003)
    seen["normal_std"] = bool(abs(normal.std() / 0.1 - 1) < 0.05 and abs(normal.mean()) < 0.007)

    # out= filled in place (one RowSparse, or one per device), None returned
    out = RowSparse(np.zeros((1, WIDTH), f32), np.zeros(1, np.int64), SHAPE)
    outs = [RowSparse(None, None) for _ in range(devices)]
    seen["out_returns"] = kv.row_sparse_pull(GIVEN, out=out, row_ids=np.array([7, 2]))
    kv.row_sparse_pull([ZEROS], out=[outs], row_ids=[np.array([1, 1])])
    seen["out"] = _rs(out)
    seen["outs"] = [_rs(o) for o in outs]

    # without an optimizer the key becomes the merged push: rows not pushed are zero (MXNet's); rows
    # pushed to a dense key too, as the dense value they stand for
    kv.init(REPLACED, RowSparse(np.ones(SHAPE, f32), np.arange(ROWS), SHAPE))

    def replace() -> None:
        _push_round(kv, REPLACED, "none", 0, devices)
        seen["replaced"] = _all_rows(kv, REPLACED)
        kv.push(DENSE, [RowSparse(np.array([1, 2, 3], f32) * (d + 1), np.array([1, 3, 1]), (4,))
                        for d in range(devices)])
        seen["rows_into_dense"] = _arr(kv.pull(DENSE))

    seen["without_optimizer"] = _raises(replace)

    # lazy SGD with momentum and weight decay: only the rows pushed, and their momentum, change
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=SGD["lr"]), momentum=SGD["momentum"], wd=SGD["wd"]))
    seen["sgd"], seen["sgd_own"] = _train(kv, SGD_KEY, "sgd", devices)

    # the state saved (per row, "<key>/momentum") and loaded back
    # one file pair per worker: workers of a dist job may share state_dir
    first, again = (os.path.join(state_dir, f"sparse_{name}_{kv.rank}.npz") for name in ("a", "b"))
    kv.save_optimizer_states(first)
    with np.load(first, allow_pickle=False) as f:
        momentum = f[f"{SGD_KEY}/momentum"]
        seen["sgd_momentum"] = _arr(momentum)
        seen["sgd_own_momentum"] = _arr(momentum[own_row(kv.rank)])
        seen["sgd_count"] = int(f[f"{SGD_KEY}/count"])
    _push_round(kv, SGD_KEY, "sgd", 0, devices)  # the state moves on, then is put back
    kv.load_optimizer_states(first)
    kv.save_optimizer_states(again)
    with np.load(first, allow_pickle=False) as a, np.load(again, allow_pickle=False) as b:
        seen["state_restored"] = sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)

    # lazy Adam: the rate's bias correction counts the key's updates, not the row's
    kv.set_optimizer(optim.Adam(schedule=optim.Schedule(lr=ADAM["lr"]), beta1=ADAM["beta1"], beta2=ADAM["beta2"],
                                epsilon=ADAM["epsilon"], wd=ADAM["wd"]))
    seen["adam"], seen["adam_own"] = _train(kv, ADAM_KEY, "adam", devices)

    seen["refusals"] = refusals(kv)
    # last: a Python updater replaces the optimizer (or is refused by a store whose servers update)
    seen["python_updater"] = _raises(lambda: (kv.set_updater(lambda key, got, stored: None),
                                              kv.push(GIVEN, RowSparse(np.ones((1, WIDTH), f32), [0], SHAPE))))
    return seen


def refusals(kv: Any) -> dict[str, str | None]:
    """Each bad call's error: one line naming the key (REFUSED says which words)."""
    from tfkv.store import RowSparse, Table

    def rows(data: Any, ids: Any, shape: tuple = SHAPE) -> Any:
        return RowSparse(np.asarray(data), np.asarray(ids), shape)

    one = np.ones((1, WIDTH), f32)
    calls = {
        "pushpull": lambda: kv.pushpull(GIVEN, rows(one, [0])),
        "sparse_pull_of_dense": lambda: kv.row_sparse_pull(DENSE, row_ids=[0]),
        "rows_to_dense": lambda: kv.push(DENSE, rows(np.ones(1, f32), [4], (4,))),
        "dense_to_rows": lambda: kv.push(GIVEN, np.ones(SHAPE, f32)),
        "pull_id_too_big": lambda: kv.row_sparse_pull(GIVEN, row_ids=np.array([3, ROWS])),
        "pull_id_negative": lambda: kv.row_sparse_pull(GIVEN, row_ids=np.array([-1])),
        "pull_rows_id_too_big": lambda: kv.pull_rows(GIVEN, np.array([ROWS + 5])),
        "push_id_too_big": lambda: kv.push(GIVEN, rows(one, [ROWS])),
        "data_indices_disagree": lambda: kv.push(GIVEN, rows(np.ones((2, WIDTH), f32), [0])),
        "row_shape": lambda: kv.push(GIVEN, rows(np.ones((1, WIDTH + 1), f32), [0])),
        "dense_shape": lambda: kv.push(GIVEN, rows(one, [0], (ROWS + 1, WIDTH))),
        "float64_push": lambda: kv.push(GIVEN, rows(np.ones((1, WIDTH)), [0])),
        "float16_push": lambda: kv.push(GIVEN, rows(np.ones((1, WIDTH), np.float16), [0])),
        "float64_init": lambda: kv.init(130, rows(np.ones((1, WIDTH)), [0])),
        "init_id_too_big": lambda: kv.init(131, rows(one, [ROWS])),
        "init_twice": lambda: kv.init(GIVEN, Table(SHAPE)),
    }
    return {name: _raises(call) for name, call in calls.items()}


# name -> (the key the line names, words it holds)
REFUSED = {
    "pushpull": (GIVEN, "pushpull"),
    "sparse_pull_of_dense": (DENSE, "dense key"), "rows_to_dense": (DENSE, "out of range"),
    "dense_to_rows": (GIVEN, "row-sparse"), "pull_id_too_big": (GIVEN, "out of range"),
    "pull_id_negative": (GIVEN, "out of range"), "pull_rows_id_too_big": (GIVEN, "out of range"),
    "push_id_too_big": (GIVEN, "out of range"), "data_indices_disagree": (GIVEN, "disagree"),
    "row_shape": (GIVEN, "shape"), "dense_shape": (GIVEN, "shape"), "float64_push": (GIVEN, "float64"),
    "float16_push": (GIVEN, "float16"), "float64_init": (130, "float64"), "init_id_too_big": (131, "out of range"),
    "init_twice": (GIVEN, "already initialised"),
}


def expected(sync: bool, devices: int, num_workers: int = 1, rank: int = 0) -> dict[str, Any]:
    """What worker `rank` of a store with these capabilities reports from `run`."""
    workers = list(range(num_workers))
    given = [[0, 2, 7], [[0.0] * 3, [4.0, 5.0, 6.0], [2.0, 3.0, 4.0]], list(SHAPE)]
    sgd, momentum = lazy_sgd(devices, workers)
    adam = lazy_adam(devices, workers)
    own = own_row(rank)
    want: dict[str, Any] = {
        "rank": rank, "num_workers": num_workers, "is_row_sparse": [False, True, True], "given": given,
        "zeros": [[0, 9], [[0.0] * 3] * 2, list(SHAPE)],
        "list_of_keys": [[[2], [[4.0, 5.0, 6.0]], list(SHAPE)], [[3], [[0.0] * 3], list(SHAPE)]],
        "pull_rows_in_order": [[2.0, 3.0, 4.0], [4.0, 5.0, 6.0], [2.0, 3.0, 4.0]],
        "async_then_rows": [[2, 7], [[4.0, 5.0, 6.0], [2.0, 3.0, 4.0]], list(SHAPE)],
        "uniform_in_range": True, "uniform_std": True, "normal_std": True,
        "out_returns": None, "out": [[2, 7], [[4.0, 5.0, 6.0], [2.0, 3.0, 4.0]], list(SHAPE)],
        "outs": [[[1], [[0.0] * 3], list(SHAPE)]] * devices,
        "sgd_own": [_arr(sgd[own])], "sgd_own_momentum": _arr(momentum[own]),
    }
    if sync:
        replaced = np.zeros(SHAPE)
        for i, row in merged_round("none", 0, devices, workers).items():
            replaced[i] = row
        rows_into_dense = np.array([0.0, 4.0, 0.0, 2.0]) * devices * (devices + 1) / 2 * num_workers
        want.update(without_optimizer=None, replaced=_arr(replaced), rows_into_dense=_arr(rows_into_dense),
                    sgd=_arr(sgd), sgd_momentum=_arr(momentum),
                    sgd_count=len(ROUNDS["sgd"]), state_restored=True)
    if sync or num_workers == 1:  # Adam's count is the key's: with several async workers, timing's
        want.update(adam=_arr(adam), adam_own=[_arr(adam[own])])
    return want


def mismatches(seen: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """What `seen` gets wrong of `want` (numbers to TOLERANCE), and every refusal that is not
    one line naming its key: empty when the store keeps the contract."""
    wrong = [f"{name}: got {seen.get(name)!r}, want {value!r}" for name, value in want.items()
             if not _close(seen.get(name), value)]
    lines = {**seen.get("refusals", {}), "python_updater": seen.get("python_updater")}
    for name, (key, words) in {**REFUSED, "python_updater": (None, "updater")}.items():
        line = lines.get(name)
        named = key is None or f"key {key!r}" in line if line else False
        if not (line and line.startswith("ValueError: ") and "\n" not in line and named and words in line):
            wrong.append(f"refusal {name}: {line!r} (want one ValueError line naming key {key!r} and {words!r})")
    return wrong


def _close(got: Any, want: Any) -> bool:
    """Equal, numbers (not bools) to TOLERANCE, lists item by item."""
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return bool(np.isclose(got, want, **TOLERANCE))
    return type(got) is type(want) and got == want or (isinstance(want, int) and isinstance(got, float) and got == want)


if __name__ == "__main__":  # a worker of a dist_* job: python sparse_contract.py OUT
    import tfkv.store

    kv = tfkv.store.create(os.environ["TEST_KVSTORE"])
    with tempfile.TemporaryDirectory() as d:
        result = run(kv, int(os.environ.get("TEST_DEVICES", "2")), d)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
    kv.close()
