"""A scaling table of `dist_sync` on loopback: 1, 2, 4, 8 local workers and 1 server, samples/s
of the whole job and where a worker's step time goes.

A small model, so that communication and Python matter: the MLP [256, 128] (tfkv `mlp`) on one
synthetic 8x8x1 batch, b=32 per worker, SGD (lr 0.01, momentum 0.9) on the server. Each job is
the one in benchmarks/jobs.py (time-based steps, workers' weights checked to agree). Inside
every worker DataParallel.timings splits the step, averaged over the workers:

    compute   the gradient tf.function (forward + backward), with the pushes made from inside it
    push      the part of compute spent pushing each key and requesting it back (merging,
              compressing if asked, sending without waiting)
    wait+pull waiting for the replies after the backward pass, which in dist_sync includes
              waiting for the slowest worker's pushes
    assign    writing the pulled weights into the variables (one compiled call)

Every worker count is a separate job, run secure (the job's keys, as a launched job is by
default: the table's figures) and plain (TFKV_SECURE=0, beside it); trials go through the counts
in alternating order and the median is reported. All processes share this machine's cores, so beyond the core count more
workers mean more waiting, not more throughput.

    python -m benchmarks scaling [--seconds 2] [--trials 2] [--workers 1,2,4,8]
                                       [--model mlp|lenet] [--batch 32]

Exits non-zero if any job failed or hung.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time


from benchmarks.jobs import MODELS, Failed, run_job  # noqa: E402
from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Workers on one machine",
    "Samples/s of a `dist_sync` job as workers are added on one machine, against one worker "
    "(`speed-up`), with the milliseconds of each phase of a step.",
    ["workers"], ["samples/s"], "samples/s")


PHASES = ["compute", "push", "pull", "assign"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--model", choices=list(MODELS), default="mlp")
    ap.add_argument("--batch", type=int, default=32, help="per worker")
    ap.add_argument("--job-timeout", type=float, default=300.0)
    harness.add_argument(ap, "scaling")
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    print(f"{args.model} {MODELS[args.model][0]} on {'x'.join(map(str, MODELS[args.model][1]))}, dist_sync, "
          f"1 server, b={args.batch} per worker; median of {args.trials} trials of ~{args.seconds:g} s; "
          f"cores: {os.cpu_count()}", flush=True)
    got: dict[int, list[dict]] = {}  # secure, the default: what users get
    plain: dict[int, list[dict]] = {}  # TFKV_SECURE=0, beside it
    t_start = time.monotonic()
    try:
        for trial in range(args.trials):
            for w in harness.alternating(counts, trial):
                for secure in harness.alternating((True, False), trial):
                    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
                        r = run_job(w, args.model, args.batch, args.seconds, tmp, "job", args.job_timeout, secure=secure)
                    (got if secure else plain).setdefault(w, []).append(r)
            print(f"  trial {trial + 1}/{args.trials} done ({time.monotonic() - t_start:.0f} s)", flush=True)
    except (Failed, OSError, ValueError, KeyError) as e:
        print(f"bench_scaling: FAILED: {e}", file=sys.stderr)
        sys.exit(1)

    base = statistics.median(r["samples_s"] for r in got[counts[0]]) / counts[0]
    print(f"{'workers':>7} {'samples/s':>10} {'plain':>8} {'secure/plain':>12} {'speed-up':>9} {'efficiency':>10} "
          f"{'step ms':>8}   "
          + " ".join(f"{p if p != 'pull' else 'wait+pull':>10}" for p in PHASES) + "   (ms per step, worker mean)")
    rows = []
    for w in counts:
        rs = got[w]
        s = statistics.median(r["samples_s"] for r in rs)
        step = statistics.median(r["step_s"] for r in rs) * 1e3
        ph = [statistics.median(r["timings"][p] for r in rs) * 1e3 for p in PHASES]
        pl = statistics.median(r["samples_s"] for r in plain[w])
        print(f"{w:>7} {s:>10.0f} {pl:>8.0f} {s / pl:>12.2f} {s / (base * counts[0]):>9.2f} {s / (base * w):>10.2f} "
              f"{step:>8.2f}   "
              + " ".join(f"{v:>10.2f}" for v in ph))
        rows.append({"workers": w, "samples/s": s, "plain": pl, "secure/plain": s / pl,
                     "speed-up": s / (base * counts[0]), "efficiency": s / (base * w), "step_ms": step,
                     **{f"{p if p != 'pull' else 'wait+pull'}_ms": v for p, v in zip(PHASES, ph)}})
    print("per-trial samples/s: " + "; ".join(f"{w}w " + "/".join(f"{r['samples_s']:.0f}" for r in got[w])
                                             for w in counts))
    harness.write(args.result, "scaling", harness.settings_of(args), rows)


if __name__ == "__main__":
    main()
