"""A server's threads for large keys (tfkv.ps.reduction, tfkv.ps.updater) and how many it starts
(tfkv.ps.cpus): sums and updates bit-identical to a numpy oracle computed value by value in one
thread, whatever the threads and ranges; the CPU count from the affinity and the cgroup quota."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tfkv import optim
from tfkv.ps import cpus
from tfkv.ps.reduction import Reducer
from tfkv.ps.updater import BLOCK, NumpyUpdater

# A size that leaves ranges and blocks of uneven ends, in ranges of at least 1,000 values.
SIZE = 2 * BLOCK + 4_321
RNG = np.random.default_rng(7)


def _pushes(workers: int, size: int = SIZE) -> list[np.ndarray]:
    return [(RNG.normal(size=size) * 10.0 ** RNG.integers(-3, 3)).astype(np.float32) for _ in range(workers)]


def _sgd_oracle(opt: optim.SGD, w: np.ndarray, grads: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """MXNet's SGD as a server applied it before threads, one whole-array float32 pass per
    operation: g*lr*rescale (or the clip / wd forms), v = m*v - step, w + v."""
    v = np.zeros_like(w)
    for t, g in enumerate(grads):
        lr = np.float32(opt.schedule(np.float32(t), optim.NumpyOps))
        rescale = 1.0 if opt.rescale_grad is None else float(opt.rescale_grad)
        if opt.clip_gradient:
            step = np.clip(g * np.float32(rescale), -opt.clip_gradient, opt.clip_gradient)
            if opt.wd:
                step = step + np.float32(opt.wd) * w
            step = step * lr
        elif opt.wd:
            step = (w * np.float32(opt.wd / rescale) + g) * np.float32(lr * rescale)
        else:
            step = g * np.float32(lr * rescale)
        if opt.momentum:
            v = v * np.float32(opt.momentum) - step
            w = w + v
        else:
            w = w - step
    return w, v


@pytest.mark.parametrize("nthreads", [1, 2, 3, 8])
def test_a_threaded_sum_is_the_oracle_bit_for_bit(nthreads):
    pushes = _pushes(5)
    oracle = pushes[0].copy()
    for p in pushes[1:]:  # the workers' pushes added in arrival order, float32
        oracle = oracle + p
    reducer = Reducer(nthreads, min_span=1_000)
    merged = None
    for p in pushes:
        merged = reducer.accumulate(merged, p.copy())
    assert merged.dtype == np.float32 and np.array_equal(merged, oracle)
    assert len(reducer.spans(SIZE)) == nthreads


@pytest.mark.parametrize("opt", [
    optim.SGD(schedule=optim.Schedule(lr=0.05), momentum=0.9),
    optim.SGD(schedule=optim.Schedule(lr=0.05, name="step", milestones=[2], factor=0.5), momentum=0.9, wd=1e-3, rescale_grad=0.25),
    optim.SGD(schedule=optim.Schedule(lr=0.1), clip_gradient=0.5, wd=1e-2),
    optim.SGD(schedule=optim.Schedule(lr=0.1)),
], ids=["momentum", "momentum-wd-rescale", "clip-wd", "plain"])
@pytest.mark.parametrize("nthreads", [1, 3])
def test_a_threaded_sgd_update_is_the_oracle_bit_for_bit(opt, nthreads):
    w0, grads = _pushes(1)[0], _pushes(4)
    updater, w = NumpyUpdater(opt, Reducer(nthreads, min_span=1_000)), w0
    for g in grads:
        w = updater.update(3, w, g)
    w_oracle, v_oracle = _sgd_oracle(opt, w0, grads)
    assert np.array_equal(w, w_oracle)
    states, count = updater.get(3, SIZE)
    assert count == 4
    if opt.momentum:  # the velocity kept is the oracle's too (GET_STATE, checkpoints)
        assert np.array_equal(states[0], v_oracle)


def test_a_threaded_adam_update_is_its_own_rule_bit_for_bit():
    opt = optim.Adam(schedule=optim.Schedule(lr=0.01), wd=1e-3)
    w0, grads = _pushes(1)[0], _pushes(3)
    threaded = NumpyUpdater(opt, Reducer(4, min_span=1_000))
    w, ref, state = w0, w0, (np.zeros_like(w0), np.zeros_like(w0))
    for t, g in enumerate(grads):
        w = threaded.update(0, w, g)
        ref, state = opt.step(optim.NumpyOps, np.float32(t), ref, g, state)  # the rule, whole arrays, one thread
    assert np.array_equal(w, ref)
    assert all(np.array_equal(a, b) for a, b in zip(threaded.get(0, SIZE)[0], state))


def test_ranges_run_on_the_pool_threads_and_small_keys_stay_on_the_serving_thread():
    reducer, seen = Reducer(3, min_span=1_000), []
    reducer.run(lambda s: seen.append((s, threading.current_thread().name)), 10_000)
    assert sorted(s.start for s, _ in seen) == [0, 3_333, 6_666]
    names = {s.start: name for s, name in seen}
    assert names[0] == threading.current_thread().name and names[3_333].startswith("tfkv-reduce")
    assert reducer.spans(1_999) == [slice(0, 1_999)]  # below twice a range: one range, no hop
    with pytest.raises(ZeroDivisionError):  # a range's failure reaches the serving thread
        reducer.run(lambda s: 1 / 0 if s.start else None, 10_000)
    reducer.close()


@pytest.mark.slow
def test_a_dist_sync_job_on_threaded_servers_gives_the_numpy_oracles_weights(cluster):
    """2 workers x 2 servers of 3 threads each, SGD with momentum on the servers: every worker
    pulls the oracle's weights bit for bit (two pushes per round: their float32 sum is exact in
    either arrival order)."""
    c = cluster(num_servers=2, num_workers=2, TFKV_REDUCTION_NTHREADS="3")
    c.start_servers()
    outs = c.start_workers("threaded_sgd")
    codes = c.wait(300)
    assert all(code == 0 for code in codes.values()), f"{codes}\n{c.outputs()}"
    opt = optim.SGD(schedule=optim.Schedule(lr=0.05), momentum=0.9, wd=1e-3)
    sizes = {"big": 1_000_003, "mid": 300_001, "small": 100}
    grads: dict[str, list[np.ndarray]] = {key: [] for key in sizes}
    for step in range(4):  # each worker's pushes of a step drawn key after key from one generator
        rngs = [np.random.default_rng(100 * step + r) for r in (0, 1)]
        for key, n in sizes.items():
            g0, g1 = (rng.normal(size=n).astype(np.float32) for rng in rngs)
            grads[key].append(g0 + g1)
    for key, n in sizes.items():
        expected, _ = _sgd_oracle(opt, np.linspace(-1, 1, n, dtype=np.float32), grads[key])
        for out in outs:
            assert np.array_equal(np.load(str(out) + ".npz")[key], expected), (out, key)


def _cgroup(tmp_path: Path, proc_line: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_line)
    return proc, root


def test_the_cpus_follow_the_tightest_cgroup_quota_on_the_path(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    # cgroup v1, as the emulated cluster's hosts: the host's group under the cpu controller
    proc, root = _cgroup(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/tfkv-emu-h1\n", {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000",
        "cpu,cpuacct/tfkv-emu-h1/cpu.cfs_quota_us": "40000", "cpu,cpuacct/tfkv-emu-h1/cpu.cfs_period_us": "100000"})
    assert cpus.quota_cpus(proc, root) == 0.4 and cpus.usable(proc, root) == 1
    proc, root = _cgroup(tmp_path / "b", "2:cpu:/a/b\n", {
        "cpu/a/cpu.cfs_quota_us": "150000", "cpu/a/cpu.cfs_period_us": "100000",
        "cpu/a/b/cpu.cfs_quota_us": "-1", "cpu/a/b/cpu.cfs_period_us": "100000"})
    assert cpus.quota_cpus(proc, root) == 1.5 and cpus.usable(proc, root) == min(2, affinity)  # rounded up
    # cgroup v2 (unified), and a path this namespace does not show: the mount's own group counts
    proc, root = _cgroup(tmp_path / "c", "0::/not/here\n", {"cpu.max": "max 100000"})
    assert cpus.quota_cpus(proc, root) is None and cpus.usable(proc, root) == affinity
    proc, root = _cgroup(tmp_path / "d", "0::/job\n", {"job/cpu.max": "300000 100000"})
    assert cpus.usable(proc, root) == min(3, affinity)
    assert cpus.usable(tmp_path / "none", tmp_path) == affinity  # no cgroup file: the affinity alone
