"""`dist_sync` training samples/s with and without 2-bit gradient compression, and the bytes a
worker pushes per step, with 2 and 4 local workers and 1 server, same run.

LeNet (tfkv `lenet`) on one synthetic 28x28x1 batch, b=32 per worker, SGD (lr 0.01, momentum
0.9). Contenders: float32 pushes; MXNet's 2-bit pushes (a config's
`kvstore.compression.type=2bit_mxnet`, set right after the store is created, before any key
exists, as the trainer does; pulls stay float32); and the accurate 2-bit
(`kvstore.compression.type=2bit`: the momentum
applied on the workers before quantising, the servers' SGD without it), the one speed targets
are measured with. Their accuracy: the compression_accuracy benchmark. Each job is the one in
benchmarks/jobs.py (time-based steps, workers' weights checked to agree). Trials alternate
the contenders (order reversed every other trial); medians are reported. `--overlap-ab` adds a
float32 contender that pushes every key after the whole backward pass instead of from inside it
as each gradient is ready (the A/B for DataParallel's overlap). `--vote-ab` adds the accurate
2-bit with the vote on worker 0's checkpoint decision after every step, which tfkv-run's
workers make when they compress (tfkv.trainer.hooks.FeedbackAtCheckpoints): its cost per step.

    python -m benchmarks compression_training [--seconds 3] [--trials 2] [--workers 2,4]
                                                    [--threshold 0.5] [--overlap-ab] [--vote-ab]

Exits non-zero if any job failed or hung.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time


from benchmarks.jobs import Failed, run_job  # noqa: E402
from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "2-bit compression: throughput",
    "Samples/s of a LeNet `dist_sync` job with 2-bit compressed pushes against the same job in float32 "
    "(`vs float32`), and the bytes each pushes per step.",
    ["workers", "contender"], ["samples/s"], "samples/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--batch", type=int, default=32, help="per worker")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--overlap-ab", action="store_true",
                    help="also run float32 pushing every key after the whole backward pass")
    ap.add_argument("--vote-ab", action="store_true",
                    help="also run the accurate 2-bit with tfkv-run's checkpoint vote after every step")
    ap.add_argument("--job-timeout", type=float, default=240.0)
    harness.add_argument(ap, "compression_training")
    args = ap.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    # Every job is secure (the job's keys), as launched jobs are by default; "plain" is the float32
    # job with TFKV_SECURE=0, what security costs beside what compression saves.
    # config names (jobs.config_compression): 2bit is the accurate one, 2bit_mxnet MXNet's exact one
    compressions = {"2bit (accurate)": "2bit", "2bit (MXNet's)": "2bit_mxnet"}
    contenders = ["float32", *compressions, "float32, plain (secure=false)"] + (
        ["float32, pushed after backward"] if args.overlap_ab else []) + (
        ["2bit (accurate), checkpoint vote"] if args.vote_ab else [])
    print(f"LeNet, dist_sync, 1 server, b={args.batch} per worker; samples/s of the whole job, median of "
          f"{args.trials} trials of ~{args.seconds:g} s; 2-bit threshold {args.threshold}", flush=True)
    got: dict[tuple[int, str], list[dict]] = {}
    t_start = time.monotonic()
    try:
        for trial in range(args.trials):
            for w in counts:
                for c in harness.alternating(contenders, trial):
                    with tempfile.TemporaryDirectory(prefix="bench_compression_") as tmp:
                        r = run_job(w, "lenet", args.batch, args.seconds, tmp, "job", args.job_timeout,
                                    compression=compressions.get(c.split(",")[0], "none"), threshold=args.threshold,
                                    overlap="after" if "after" in c else "graph", secure="plain" not in c,
                                    vote="vote" in c)
                    got.setdefault((w, c), []).append(r)
            print(f"  trial {trial + 1}/{args.trials} done ({time.monotonic() - t_start:.0f} s)", flush=True)
    except (Failed, OSError, ValueError, KeyError) as e:
        print(f"bench_compression_training: FAILED: {e}", file=sys.stderr)
        sys.exit(1)

    def med(w, c, f):
        return statistics.median(f(r) for r in got[(w, c)])

    print(f"{'workers':>7}  {'contender':<34} {'samples/s':>10} {'vs float32':>10} {'pushed B/step':>14} "
          f"{'bytes ratio':>11}")
    rows = []
    for w in counts:
        base_s = med(w, "float32", lambda r: r["samples_s"])
        base_b = med(w, "float32", lambda r: r["push_bytes"])
        for c in contenders:
            s, b = med(w, c, lambda r: r["samples_s"]), med(w, c, lambda r: r["push_bytes"])
            print(f"{w:>7}  {c:<34} {s:>10.0f} {s / base_s:>10.3f} {b:>14,.0f} {base_b / b:>10.1f}x")
            rows.append({"workers": w, "contender": c, "samples/s": s, "vs float32": s / base_s,
                         "pushed B/step": b, "bytes ratio": base_b / b})
    if args.vote_ab:
        for w in counts:
            plain, voted = (med(w, c, lambda r: r["step_s"]) for c in ("2bit (accurate)", "2bit (accurate), checkpoint vote"))
            print(f"checkpoint vote, {w} workers: {1e3 * (voted - plain):+.2f} ms a step "
                  f"({voted / plain:.3f}x the accurate 2-bit's step time)")
    print("per-trial samples/s: " + "; ".join(
        f"{w}w {c} " + "/".join(f"{r['samples_s']:.0f}" for r in got[(w, c)]) for w in counts for c in contenders))
    harness.write(args.result, "compression_training", harness.settings_of(args), rows)


if __name__ == "__main__":
    main()
