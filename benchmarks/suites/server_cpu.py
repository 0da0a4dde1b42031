"""A server's CPU per MiB pushed, summing only or summing and updating, its threads and trees compared.

A `dist_sync` job of 2 workers and 1 server on 127.0.0.1 (secure unless `--plain`), each worker
pushing and pulling one float32 key of `--mib` MiB (`pushpull`, what a training step does) for
`--steps` steps. The server runs inside a small wrapper that samples its process's CPU time (every
thread: the serving loop, the summing threads, libzmq's I/O thread) every 5 ms; the figure is the
CPU it spent between the first and the last timed step of worker 0, over the MiB the workers
pushed in that time (2 x steps x MiB). Two modes, as a job runs them:

    sgd   update_on_kvstore=true: the servers sum and run SGD with momentum 0.9
    sum   update_on_kvstore=false: the servers only sum, the workers update (BytePS's summation
          service)

Contenders, each in its own job, trials alternating (reversed every other trial), medians:

    threads=1   this tree's server on one thread (kvstore.reduction_nthreads=1)
    threads=N   this tree's server with its default: one thread per CPU it may use
    base        with `--base TREE`: that checkout's server (its own tfkv first on its
                PYTHONPATH; the scheduler and workers are this tree's), e.g. the commit before

Every pulled value is checked against a numpy oracle (the sum; SGD's recurrence in float32).

    python -m benchmarks server_cpu [--mib 16] [--steps 30] [--trials 3] [--modes sgd,sum]
                                    [--base /path/to/old/checkout] [--plain]
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.jobs import Failed, run_plan, security_env

COLUMNS = ["mode", "contender", "ms_per_mib", "step_ms", "ratio"]
REPORT = harness.Report("Server CPU per MiB pushed", (
    "Milliseconds of a parameter server's CPU (all its threads) per MiB the workers pushed, 2 workers x 1 "
    "server pushing and pulling one key, summing only (`sum`) or summing and running SGD with momentum "
    "(`sgd`); `ratio` is the contender's over the baseline measured in the same run (base, else threads=1)."),
    COLUMNS[:2], COLUMNS[2:3], "ms CPU / MiB", columns=COLUMNS)

LR, MOMENTUM = 0.01, 0.9
WORKERS = 2
KEY = 7

# The server, run by `python -c`: its process's CPU time sampled until it exits, then written out.
# Code rather than a module of this package: a base tree's server runs with that tree first on its
# path, whose benchmarks package may not have it.
WRAPPER = """
import json, runpy, sys, threading, time
out, samples = sys.argv[1], []
def sample():
    while True:
        samples.append((time.time(), time.process_time()))
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
sys.argv = ["tfkv.ps.node"]
try:
    runpy.run_module("tfkv.ps.node", run_name="__main__", alter_sys=True)
finally:
    samples.append((time.time(), time.process_time()))
    with open(out, "w") as f:
        json.dump(samples, f)
"""


def pushes(rank: int, size: int) -> np.ndarray:
    return np.random.default_rng(rank).normal(0.0, 1.0, size).astype(np.float32)


def oracle(size: int, mode: str, steps: int) -> np.ndarray:
    """What a pull returns after `steps` steps: the sum of the workers' pushes (`sum`), or the
    weights after SGD with momentum on that sum, from zeros, in float32 (`sgd`)."""
    total = pushes(0, size) + pushes(1, size)
    if mode == "sum":
        return total
    w, v = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for _ in range(steps):
        v = v * np.float32(MOMENTUM) - total * np.float32(LR)
        w = w + v
    return w


def worker(args: argparse.Namespace) -> None:
    import tfkv.store
    from tfkv import optim

    store = tfkv.store.create("dist_sync", devices=["cpu:0"])
    with harness.closing(store, "bench_server_cpu"):
        size = args.mib * (1 << 20) // 4
        store.init(KEY, np.zeros(size, np.float32))
        if args.mode == "sgd":
            store.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=LR), momentum=MOMENTUM))
        grad, out = pushes(store.rank, size), np.empty(size, np.float32)
        for _ in range(2):  # warm-up: the first round allocates what the others reuse
            store.pushpull(KEY, grad, out=out)
        store.barrier()
        t0 = time.time()
        for _ in range(args.steps):
            store.pushpull(KEY, grad, out=out)
        t1 = time.time()
        expected = oracle(size, args.mode, args.steps + 2)
        if not np.array_equal(out, expected):
            raise AssertionError(f"{args.mode}: pulled {out[:3]}..., the oracle {expected[:3]}...")
        Path(args.out).write_text(json.dumps({"rank": store.rank, "t0": t0, "t1": t1}))


def cpu_at(samples: list[list[float]], when: float) -> float:
    """The process's CPU time at wall time `when`, interpolated between its samples."""
    times = [s[0] for s in samples]
    i = min(max(bisect.bisect_left(times, when), 1), len(samples) - 1)
    (ta, ca), (tb, cb) = samples[i - 1], samples[i]
    return ca + (cb - ca) * ((when - ta) / (tb - ta) if tb > ta else 1.0)


def run_job(args: argparse.Namespace, mode: str, tree: Path, nthreads: int | None) -> dict[str, float]:
    """One job: the server's ms of CPU per MiB pushed and the step's ms (`nthreads`: the server's
    kvstore.reduction_nthreads, 0 for its default; None: the tree's own default, unset)."""
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    with tempfile.TemporaryDirectory(prefix="bench_server_cpu_") as tmp:
        samples = os.path.join(tmp, "server.json")
        reports = [os.path.join(tmp, f"worker{i}.json") for i in range(WORKERS)]
        argv = [*harness.suite_argv("server_cpu"), "--worker", "--mode", mode, "--mib", str(args.mib),
                "--steps", str(args.steps), "--out"]
        plan = make_plan(WORKERS, 1, argv, [sys.executable, "-m", "tfkv.ps.node"], ["127.0.0.1"], "127.0.0.1",
                         free_port(), extra_env=security_env(not args.plain))
        for p in plan:
            if p.role == "worker":
                p.argv.append(reports[p.rank])
            elif p.role == "server":
                p.argv = [sys.executable, "-c", WRAPPER, samples]
                p.env["PYTHONPATH"] = str(tree)
                if nthreads is not None:
                    p.env["TFKV_REDUCTION_NTHREADS"] = str(nthreads)
        run_plan(plan, args.job_timeout, f"server_cpu {mode} ({tree}, threads {nthreads or 'auto'})")
        times = json.loads(Path(reports[0]).read_text())
        cpu = json.loads(Path(samples).read_text())
    spent = cpu_at(cpu, times["t1"]) - cpu_at(cpu, times["t0"])
    return {"ms_per_mib": 1e3 * spent / (WORKERS * args.steps * args.mib),
            "step_ms": 1e3 * (times["t1"] - times["t0"]) / args.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16, help="the key's size in MiB")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per job")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--modes", default="sgd,sum", help="comma-separated: sgd (update_on_kvstore=true), sum (false)")
    ap.add_argument("--base", type=Path, help="another checkout of tfkv whose server to measure too (the baseline)")
    ap.add_argument("--plain", action="store_true", help="TFKV_SECURE=0 (default: secure, as a launched job)")
    ap.add_argument("--job-timeout", type=float, default=300.0, help="seconds before a job counts as hung")
    harness.add_argument(ap, "server_cpu")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--mode", "--out"):  # a job's worker's own
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    modes = args.modes.split(",")
    if any(m not in ("sgd", "sum") for m in modes):
        ap.error(f"--modes {args.modes}: choose from sgd, sum")
    if args.base is not None and not (args.base / "tfkv" / "__init__.py").is_file():
        ap.error(f"--base {args.base} is not a checkout of tfkv (no tfkv/__init__.py)")
    from tfkv.ps import cpus

    auto = cpus.usable()
    contenders = {**({"base": (args.base.resolve(), None)} if args.base else {}),
                  "threads=1": (harness.REPO, 1), f"threads={auto}": (harness.REPO, 0)}
    got: dict[tuple[str, str], list[dict[str, float]]] = {(m, c): [] for m in modes for c in contenders}
    try:
        for trial in range(args.trials):
            for name in harness.alternating(list(contenders), trial):
                for mode in modes:
                    got[(mode, name)].append(run_job(args, mode, *contenders[name]))
            print(f"  trial {trial + 1}/{args.trials} done", flush=True)
    except Failed as e:
        print(f"bench_server_cpu: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
    rows, baseline = [], next(iter(contenders))
    for mode in modes:
        base = statistics.median(r["ms_per_mib"] for r in got[(mode, baseline)])
        for name in contenders:
            ms = statistics.median(r["ms_per_mib"] for r in got[(mode, name)])
            step = statistics.median(r["step_ms"] for r in got[(mode, name)])
            rows.append({"mode": mode, "contender": name, "ms_per_mib": round(ms, 4), "step_ms": round(step, 2),
                         "ratio": round(ms / base, 3), "spread": [round(r["ms_per_mib"], 4) for r in got[(mode, name)]]})
    print(f"server CPU per MiB pushed: {WORKERS} workers x 1 server, one {args.mib} MiB key, {args.steps} steps, "
          f"{'plain' if args.plain else 'secure'}, medians of {args.trials} trials; ratio = contender / {baseline}")
    print(f"{'mode':<6}{'contender':<12}{'ms CPU/MiB':>12}{'step ms':>10}{'ratio':>8}   trials (ms/MiB)")
    for r in rows:
        print(f"{r['mode']:<6}{r['contender']:<12}{r['ms_per_mib']:>12.3f}{r['step_ms']:>10.1f}{r['ratio']:>8.2f}   "
              + ", ".join(f"{x:.3f}" for x in r["spread"]))
    harness.write(args.result, "server_cpu", harness.settings_of(args), rows, unit="ms CPU / MiB",
                  base=str(args.base) if args.base else None)


if __name__ == "__main__":
    main()
