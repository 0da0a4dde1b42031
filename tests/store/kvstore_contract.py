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
    seen.update(half_sums(kv, devices))

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
    seen.update(half_updates(kv, devices, state_dir))
    seen.update(add_what_you_receive(kv, devices))
    return seen


def add_what_you_receive(kv: Any, devices: int) -> dict[str, Any]:
    """MXNet's KVStore tests' updater: SGD with learning_rate=-1 (w -= -1 * g) adds every push to
    the stored value, set through set_optimizer as MXNet's `create` builds it."""
    from tfkv import optim

    seen: dict[str, Any] = {"add_what_you_receive": None}

    def three_pushes() -> None:
        kv.set_optimizer(optim.create("sgd", learning_rate=-1))
        kv.init(70, np.ones(3, np.float32))
        for _ in range(3):  # each push sums to 0.5 * (1 + 2 + ... + devices)
            kv.push(70, [np.full(3, 0.5 * (d + 1), np.float32) for d in range(devices)])
        seen["add_what_you_receive"] = _arr(kv.pull(70))

    seen["add_what_you_receive_set"] = _raises(three_pushes)
    return seen


HALF = ("float16", "bfloat16")


def _half(name: str) -> Any:
    """The numpy dtype: bfloat16 is ml_dtypes' (numpy has none; TensorFlow uses it)."""
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.float16


def _resolution(name: str) -> float:
    """The spacing of the dtype's values just below 1.0."""
    return 2.0 ** -11 if name == "float16" else 2.0 ** -8


HALF_STEPS = 8


def sgd_reference(name: str, multi_precision: bool) -> list[float]:
    """SGD lr=1, momentum 0.5 on a half weight of 1.0, HALF_STEPS updates by a gradient of a
    quarter of the dtype's resolution: in numpy float32 on a float32 master cast to half at the
    end (multi_precision), or with weight and momentum rounded to half every update (MXNet's half
    update, where each step is below half's resolution of the weight and is lost)."""
    dt, g = _half(name), np.float32(_resolution(name) / 4)
    w, v = np.ones(2, np.float32), np.zeros(2, np.float32)
    for _ in range(HALF_STEPS):
        v = np.float32(0.5) * v - np.float32(1.0) * g
        w = w + v
        if not multi_precision:
            w, v = w.astype(dt).astype(np.float32), v.astype(dt).astype(np.float32)
    return _arr(w.astype(dt).astype(np.float32))


def half_sums(kv: Any, devices: int) -> dict[str, Any]:
    """float16 and bfloat16 keys without an optimizer: the dtype kept on pull, device values
    summed exactly where half holds the sum, a pull into a float32 out cast."""
    seen: dict[str, Any] = {}
    for i, name in enumerate(HALF):
        dt = _half(name)
        kv.init(40 + i, np.arange(4).astype(dt))
        got = kv.pull(40 + i)
        seen[f"{name}_init"] = [str(np.asarray(got).dtype), _arr(np.asarray(got).astype(np.float32))]

        def sums() -> None:
            # 0.25, 0.5, ... per device: every partial sum is exact in half
            kv.push(40 + i, [np.full(4, 0.25 * (d + 1), dt) for d in range(devices)])
            got = np.asarray(kv.pull(40 + i))
            seen[f"{name}_sum"] = [str(got.dtype), _arr(got.astype(np.float32))]
            out = np.zeros(4, np.float32)
            kv.pull(40 + i, out=out)  # cast into an out of another dtype, as MXNet's CopyFromTo
            seen[f"{name}_into_f32"] = _arr(out)

        seen[f"{name}_sums"] = _raises(sums)
    return seen


def half_updates(kv: Any, devices: int, state_dir: str) -> dict[str, Any]:
    """SGD on the store (or its servers) on half keys, without and with multi_precision
    (sgd_reference); a float32 push to a half key refused in one line; the state saved and
    loaded (float32)."""
    from tfkv import optim

    seen: dict[str, Any] = {}
    for mp in (False, True):
        kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0), momentum=0.5, multi_precision=mp))
        for i, name in enumerate(HALF):
            key, dt = 50 + 2 * i + mp, _half(name)
            kv.init(key, np.ones(2, dt))
            g = _resolution(name) / 4
            for _ in range(HALF_STEPS):
                kv.push(key, [np.full(2, g / devices, dt) for _ in range(devices)])
            got = np.asarray(kv.pull(key))
            seen[f"{name}_sgd_mp{int(mp)}"] = [str(got.dtype), _arr(got.astype(np.float32))]
            seen[f"{name}_f32_push"] = _raises(lambda: kv.push(key, np.ones(2, np.float32)))
    path = os.path.join(state_dir, "half.npz")
    kv.save_optimizer_states(path)
    kv.load_optimizer_states(path)
    with np.load(path, allow_pickle=False) as f:
        seen["half_state"] = [str(f["51/momentum"].dtype), bool(np.all(f["51/momentum"] < 0))]
    return seen


def expected(sync: bool, devices: int) -> dict[str, Any]:
    """What a store with these capabilities reports from `run` (the type's own fields aside)."""
    want: dict[str, Any] = {
        "rank": 0, "num_workers": 1, "optimizer_capable": True,
        "init_pull": [0.0, 1.0, 2.0, 3.0], "init_pull_list": [[0.0] * 3, [[7.0, 7.0], [7.0, 7.0]]],
        "sgd_two_steps": [-0.25, -0.25], "state_round_trip": True,
    }
    for name in HALF:
        want[f"{name}_init"] = [name, [0.0, 1.0, 2.0, 3.0]]
        for mp in (0, 1):
            want[f"{name}_sgd_mp{mp}"] = [name, sgd_reference(name, bool(mp))]
    want["half_state"] = ["float32", True]
    want.update(add_what_you_receive_set=None,
                add_what_you_receive=[1.0 + 3 * 0.5 * sum(range(1, devices + 1))] * 3)
    if sync:
        half_sum = [0.25 * sum(range(1, devices + 1))] * 4
        for name in HALF:
            want.update({f"{name}_sums": None, f"{name}_sum": [name, half_sum], f"{name}_into_f32": half_sum})
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
