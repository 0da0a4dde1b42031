"""Wall time of a sweep run one trial after another against two trials at once, same run.

The sweep is `tfkv-run -m optimizer.lr=...` over N learning rates (4 by default) on the default
job (digits MLP), each trial a whole `tfkv-run` job with its own run directory. It runs with
Hydra's basic launcher (one trial at a time, in the tfkv-run process) and with the joblib
launcher (`hydra/launcher=joblib hydra.launcher.n_jobs=2`: two trial processes at once), the
two alternating over `--trials` repetitions; the medians and their ratio are printed.
`--dist` makes every trial a dist_sync job on this machine (`cluster=local`: scheduler, a
server and two workers per trial), the kind of trial whose ports must not collide.

    python -m benchmarks sweep [--lrs 0.2,0.1,0.05,0.02] [--epochs 3] [--trials 1] [--dist]

A ratio above 1 is the time two-at-once saves; on a machine with fewer cores than two trials
use, the trials share the cores and the gain is what overlapping start-up and I/O gives.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Sweeps: one by one or two at once",
    "Wall time of a 4-trial learning-rate sweep with Hydra's basic launcher (one by one) against joblib "
    "running two trials at once, same run.",
    ["launcher"], ["seconds"], "seconds", rerun="python -m benchmarks sweep")


LAUNCHERS = {
    "one by one (basic)": [],
    "two at once (joblib)": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
}


def sweep(launcher: list[str], lrs: str, epochs: int, dist: bool, where: Path) -> float:
    """Seconds for the whole sweep; fails loudly if a trial did not finish."""
    extra = ["kvstore=dist_sync", "cluster=local"] if dist else []
    argv = ["tfkv-run", "-m", f"optimizer.lr={lrs}", f"epochs={epochs}", "progress=false", *extra, *launcher,
            f"hydra.sweep.dir={where}"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench_sweep: {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    done = list(where.glob("*/metrics.json"))
    if len(done) != len(lrs.split(",")):
        sys.exit(f"bench_sweep: {len(done)} of {len(lrs.split(','))} trials left metrics.json in {where}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lrs", default="0.2,0.1,0.05,0.02", help="the swept learning rates (one trial each)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--trials", type=int, default=1, help="repetitions of each sweep (median reported)")
    ap.add_argument("--dist", action="store_true", help="every trial a dist_sync job with cluster=local")
    harness.add_argument(ap, "sweep")
    args = ap.parse_args()
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory(prefix="bench_sweep.") as tmp:
        for rep in range(args.trials):
            for i, (name, launcher) in enumerate(LAUNCHERS.items()):
                where = Path(tmp) / f"{rep}-{i}"
                times[name].append(sweep(launcher, args.lrs, args.epochs, args.dist, where))
                print(f"  {name}: {times[name][-1]:.1f} s", flush=True)
    n = len(args.lrs.split(","))
    kind = "dist_sync cluster=local" if args.dist else "kvstore=local"
    print(f"\n{n}-trial sweep, {kind}, epochs={args.epochs}, median of {args.trials}:")
    medians = harness.medians(times)
    for name, m in medians.items():
        print(f"  {name:22s} {m:7.1f} s")
    one, two = medians.values()
    print(f"  ratio one-by-one / two-at-once = {one / two:.2f}")
    print(json.dumps({"trials": n, "kind": kind, "seconds": medians, "ratio": one / two}))
    harness.write(args.result, "sweep", harness.settings_of(args),
                 [{"launcher": name, "seconds": m, "vs one-by-one": m / one} for name, m in medians.items()],
                 trials=n, kind=kind)


if __name__ == "__main__":
    main()
