"""Test accuracy of the default experiment (digits MLP, SGD lr 0.1 momentum 0.9, 10 epochs) as a
`dist_sync` job of local workers, uncompressed against MXNet's exact 2-bit, the accurate 2-bit
(momentum on the workers) and the accurate 2-bit both ways (the servers' replies 2-bit too, with
error feedback on the servers), same seeds, same run.

Each job is `tfkv-run kvstore=dist_sync cluster=local kvstore.compression.type=<none | 2bit_mxnet
| 2bit> [kvstore.compression.both_ways=true]`; its exported model.keras is evaluated with plain
Keras on the digits test split (the job's own metrics.json must agree). Prints one row per seed,
contender and epoch count, and the mean difference from uncompressed in points; `--json OUT`
also writes the rows and the settings (benchmarks/results/compression_accuracy.json holds the
committed figures). `--also-epochs 3` runs every job again at 3 epochs (the gap early on);
`--contenders` picks some (by their compression label); `--pull-thresholds 0.0002,0.006` adds a
both-ways contender per replies' threshold (kvstore.compression.pull_threshold; the default
derives it from the optimizer), the sweep that chose that default.

    python -m benchmarks compression_accuracy [--seeds 0,1,2] [--workers 2] [--threshold 0.5]
        [--epochs 10] [--also-epochs 3] [--contenders none,2bit,2bit_both_ways] [--pull-thresholds Q,...]
        [--json OUT]

Exits non-zero if a job fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "2-bit compression: accuracy",
    "Test accuracy of the default experiment as a 2-worker `dist_sync` job, uncompressed against MXNet's "
    "2-bit and the accurate 2-bit (momentum on the workers), same seeds, same run.",
    ["contender", "seed"], ["test_accuracy"], "test accuracy",
    columns=["contender", "seed", "epochs", "compression", "test_accuracy", "seconds"])


os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# name -> (its compression label in the rows, the job's overrides)
CONTENDERS = {"uncompressed": ("none", ["kvstore.compression.type=none"]),
              "2bit_mxnet (MXNet's exact)": ("2bit_mxnet", ["kvstore.compression.type=2bit_mxnet"]),
              "2bit (accurate: momentum on the workers)": ("2bit", ["kvstore.compression.type=2bit"]),
              "2bit both ways (replies 2-bit too)": ("2bit_both_ways", ["kvstore.compression.type=2bit",
                                                                         "kvstore.compression.both_ways=true"])}


def keras_accuracy(model_file: Path) -> float:
    """The exported model's accuracy on the digits test split, by plain Keras."""
    import keras
    import numpy as np

    from tfkv.data import digits

    data = digits.load()
    model = keras.saving.load_model(model_file, compile=False)
    # the exported model takes the data set's own inputs, raw pixels: its first layer normalises them
    # as tfkv's input pipeline did (tfkv/models/input_scaling.py)
    predicted = np.argmax(model.predict(data.x_test, verbose=0), axis=-1)
    return float(np.mean(predicted == data.y_test))


def run(kind: str, overrides: list[str], seed: int, epochs: int, args: argparse.Namespace, tmp: Path) -> dict:
    run_dir = tmp / f"{kind}-{seed}-{epochs}"
    cmd = [shutil.which("tfkv-run") or "tfkv-run", "kvstore=dist_sync", "cluster=local",
           f"cluster.num_workers={args.workers}", "progress=false", f"seed={seed}", f"epochs={epochs}",
           *overrides, f"kvstore.compression.threshold={args.threshold}", f"hydra.run.dir={run_dir}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.job_timeout, cwd=tmp)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    reported = json.loads((run_dir / "metrics.json").read_text())["test_accuracy"]
    accuracy = keras_accuracy(run_dir / "model.keras")
    if abs(accuracy - reported) > 1e-6:
        raise RuntimeError(f"{kind} seed {seed}: Keras evaluates the exported model at {accuracy:.4f}, "
                           f"the job reported {reported:.4f}")
    return {"seed": seed, "compression": kind, "epochs": epochs, "test_accuracy": accuracy,
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--also-epochs", type=int, default=None, help="run every job again at this many epochs")
    ap.add_argument("--contenders", default=",".join(label for label, _ in CONTENDERS.values()),
                    help="compression labels, comma-separated (none is always run: the baseline)")
    ap.add_argument("--pull-thresholds", default="", help="a both-ways contender per replies' threshold, comma-separated")
    ap.add_argument("--job-timeout", type=float, default=600.0)
    harness.add_argument(ap, "compression_accuracy", "--json", "--result")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    wanted = {"none", *args.contenders.split(",")}
    contenders = {name: c for name, c in CONTENDERS.items() if c[0] in wanted}
    for q in filter(None, args.pull_thresholds.split(",")):
        both = CONTENDERS["2bit both ways (replies 2-bit too)"][1]
        contenders[f"2bit both ways, pull_threshold {q}"] = (f"2bit_both_ways_q{q}",
                                                             [*both, f"kvstore.compression.pull_threshold={q}"])
    epochs = [args.epochs] + ([args.also_epochs] if args.also_epochs else [])
    print(f"default experiment (digits MLP, SGD lr 0.1 momentum 0.9), dist_sync, {args.workers} workers, 1 server, "
          f"{args.epochs} epochs, threshold {args.threshold}, seeds {args.seeds}; accuracy of model.keras by "
          "plain Keras", flush=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_compression_accuracy_") as tmp:
            for n in epochs:
                for seed in seeds:
                    for name, (kind, overrides) in contenders.items():
                        rows.append({"contender": name, **run(kind, overrides, seed, n, args, Path(tmp))})
                        print(f"  {n:>2} epochs  seed {seed}  {name:<42} {rows[-1]['test_accuracy']:.4f}", flush=True)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"bench_compression_accuracy: FAILED: {e}", file=sys.stderr)
        sys.exit(1)

    summary = {}
    for n in epochs:
        summary.update(_summary(rows, contenders, n, n == args.epochs))
    harness.write(args.result, "compression_accuracy",
                 {"experiment": "tfkv-run default (digits, mlp, sgd lr 0.1 momentum 0.9 wd 1e-4, batch 64 per worker)",
                  "kvstore": "dist_sync", "workers": args.workers, "servers": 1, "epochs": args.epochs,
                  "also_epochs": args.also_epochs, "threshold": args.threshold, "seeds": seeds}, rows, summary=summary)


def _summary(rows: list[dict], contenders: dict, epochs: int, default: bool) -> dict:
    """Each contender's mean accuracy after `epochs` and its difference from uncompressed, printed;
    keyed by its label (and the epochs, unless they are the default's)."""
    rows = [r for r in rows if r["epochs"] == epochs]
    base = {r["seed"]: r["test_accuracy"] for r in rows if r["compression"] == "none"}
    print(f"after {epochs} epochs:")
    print(f"{'contender':<42} {'mean accuracy':>13} {'vs uncompressed (points)':>25} {'worst seed (points)':>20}")
    summary = {}
    for name, (kind, _) in contenders.items():
        mine = [r for r in rows if r["compression"] == kind]
        diffs = [100 * (r["test_accuracy"] - base[r["seed"]]) for r in mine]
        summary[kind if default else f"{kind}@{epochs}"] = entry = {
            "mean_accuracy": statistics.mean(r["test_accuracy"] for r in mine),
            "mean_points_vs_uncompressed": statistics.mean(diffs), "worst_points": min(diffs)}
        print(f"{name:<42} {entry['mean_accuracy']:>13.4f} {entry['mean_points_vs_uncompressed']:>+25.2f} "
              f"{entry['worst_points']:>+20.2f}")
    return summary


if __name__ == "__main__":
    main()
