"""The KVStore contract: what every store type does, run against one store and reported as plain
data, so the same checks run in this process (local, device, a plug-in) and inside a worker of
a real parameter-server job (the dist_* types, `python kvstore_contract.py OUT`).

One worker, so every expected number is the same for every type: a push of several device
values stores their sum; with an optimizer the store (or its servers) applies it on push.
`expected(capabilities)` is what a type with those capabilities must report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Callable

import numpy as np


def _arr(x: Any) -> list:
    return np.asarray(x).tolist()


def _raises(call: Callable[[], Any]) -> str | None:
    """'Type: first line' of what `call` raises, None if it returns."""
    try:
        call()
    except Exception as e:  # the contract names the type and message each store must raise
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def run(kv: Any, devices: int, state_dir: str) -> dict[str, Any]:
    """Every check of the contract against `kv` (fresh, int keys, `devices` device values per
    push); what it saw."""
    from tfkv import optim

    f32 = np.float32
    seen: dict[str, Any] = {"type": kv.type, "rank": kv.rank, "num_workers": kv.num_workers}
    seen["optimizer_capable"] = kv.is_capable(kv.OPTIMIZER)
    seen["unknown_capability"] = _raises(lambda: kv.is_capable("teleport"))

    # init, then pull what was stored; a list of keys in one call
    kv.init(0, np.arange(4, dtype=f32))
    kv.init([1, 2], [np.zeros(3, f32), np.full((2, 2), 7.0, f32)])
    seen["init_pull"] = _arr(kv.pull(0))
    seen["init_pull_list"] = [_arr(v) for v in kv.pull([1, 2])]

    # keys: initialised once, known before use, one kind per store, ints or strs only
    seen["init_twice"] = _raises(lambda: kv.init(0, np.zeros(4, f32)))
    seen["mixed_key"] = _raises(lambda: kv.init("w", np.zeros(4, f32)))
    seen["float_key"] = _raises(lambda: kv.init(1.5, np.zeros(4, f32)))
    seen["save_without_optimizer"] = _raises(lambda: kv.save_optimizer_states(os.path.join(state_dir, "none.npz")))

    # no optimizer: a push stores the sum of its device values (a sync store), which a pull
    # copies out; pushpull without `out` writes the result into the values it was given
    def no_optimizer() -> None:
        kv.push(1, [np.full(3, d + 1.0, f32) for d in range(devices)])
        seen["push_sum"] = _arr(kv.pull(1))
        values = [np.full((2, 2), 2.0, f32) for _ in range(devices)]
        kv.pushpull(2, values)
        seen["pushpull_in_place"] = [_arr(v) for v in values]
        out = np.zeros(3, f32)
        kv.pull(1, out=out)
        seen["pull_into_out"] = _arr(out)

    seen["without_optimizer"] = _raises(no_optimizer)

    # the optimizer on the store (or its servers): SGD with momentum, applied on every push
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.5))
    kv.init(3, np.ones(2, f32))
    seen["unknown_key"] = _raises(lambda: kv.push(99, np.zeros(4, f32)))  # after set_optimizer: dist_async needs one
    for _ in range(2):
        kv.push(3, [np.full(2, 1.0 / devices, f32) for _ in range(devices)])  # sums to 1 per step
    seen["sgd_two_steps"] = _arr(kv.pull(3))  # 1 - 0.5 = 0.5; momentum 0.5*-0.5 - 0.5 = -0.75 -> -0.25

    # optimizer state saved and loaded again is the same state (npz, no pickle)
    first, second = os.path.join(state_dir, "a.npz"), os.path.join(state_dir, "b.npz")
    kv.save_optimizer_states(first)
    kv.load_optimizer_states(first)
    kv.save_optimizer_states(second)
    with np.load(first, allow_pickle=False) as a, np.load(second, allow_pickle=False) as b:
        seen["state_keys"] = sorted(a.files)
        seen["state_round_trip"] = sorted(a.files) == sorted(b.files) and all(
            np.array_equal(a[k], b[k]) for k in a.files)
    seen["load_missing"] = _raises(lambda: kv.load_optimizer_states(os.path.join(state_dir, "missing.npz")))
    return seen


def expected(sync: bool, devices: int) -> dict[str, Any]:
    """What a store with these capabilities reports from `run` (the type's own fields aside)."""
    want: dict[str, Any] = {
        "rank": 0, "num_workers": 1, "optimizer_capable": True,
        "init_pull": [0.0, 1.0, 2.0, 3.0], "init_pull_list": [[0.0] * 3, [[7.0, 7.0], [7.0, 7.0]]],
        "sgd_two_steps": [-0.25, -0.25], "state_round_trip": True,
    }
    if sync:
        total = float(sum(range(1, devices + 1)))
        want.update({"without_optimizer": None, "push_sum": [total] * 3,
                     "pushpull_in_place": [[[2.0 * devices] * 2] * 2] * devices, "pull_into_out": [total] * 3})
    return want


if __name__ == "__main__":  # a worker of a dist_* job: python kvstore_contract.py OUT
    import tfkv.store

    kv = tfkv.store.create(os.environ["TEST_KVSTORE"])
    with tempfile.TemporaryDirectory() as d:
        result = run(kv, int(os.environ.get("TEST_DEVICES", "2")), d)
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
    kv.close()
