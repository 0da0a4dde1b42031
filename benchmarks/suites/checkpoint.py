"""The two figures of issue 18: what step checkpoints cost, and how long a restart takes.

`overhead`: the default job (digits MLP) trained with `checkpoint.every_steps=50` and without step
checkpoints (epoch checkpoints in both), the two alternating over `--trials` runs; each run's
rate is its samples over its training seconds, every epoch but the first (tracing), from
metrics.json; the medians and their ratio are printed. A save is written and fsynced while
training waits, so the ratio is what a save costs against the steps between two.

`restart`: a dist_sync job on this machine (scheduler, a server, two workers) with
`cluster.max_restarts=1`; once it has written a step checkpoint, worker 1 is killed with
SIGKILL; printed: the seconds from the kill to the restart line (the teardown), and to the
restarted job's resume line (training again).

    python -m benchmarks checkpoint [--what overhead,restart] [--trials 3] [--epochs 10]

On a shared machine both move with the load: run it on a quiet one for figures to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Checkpoint cost and restart time",
    "Samples/s of the default job with step checkpoints (`checkpoint.every_steps=50`) against none, "
    "runs alternating; and the seconds from `kill -9` of a worker to the restarted job training again.",
    ["what"], ["samples/s"], "samples/s")


OVERHEAD_JOB = ["progress=false", "batch_size=16", "resume=false"]  # 88 steps per epoch
RESTART_JOB = ["kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1",
               "batch_size=16", "progress=false", "checkpoint.every_steps=4", "cluster.max_restarts=1",
               "resume=auto", "epochs=3"]


def rate(args: list[str], where: Path) -> float:
    """Samples per second of one run, its first epoch aside."""
    proc = subprocess.run(["tfkv-run", *OVERHEAD_JOB, *args, f"hydra.run.dir={where}"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"tfkv-run {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    history = json.loads((where / "metrics.json").read_text())["history"][1:]
    return sum(h["samples"] for h in history) / sum(h["train_seconds"] for h in history)


def overhead(trials: int, epochs: int, root: Path) -> list[dict]:
    runs: dict[str, list[float]] = {"none": [], "every_steps=50": []}
    for t in range(trials):
        for name in runs:
            extra = [f"checkpoint.every_steps={name.split('=')[1]}"] if "=" in name else []
            runs[name].append(rate([f"epochs={epochs}", *extra], root / f"{name.replace('=', '')}-{t}"))
    for name, rates in runs.items():
        print(f"step checkpoints {name:15s} {statistics.median(rates):9.0f} samples/s  "
              f"({', '.join(f'{r:.0f}' for r in rates)})")
    ratio = statistics.median(runs["every_steps=50"]) / statistics.median(runs["none"])
    print(f"ratio every_steps=50 / none: {ratio:.3f}")
    return [{"what": f"step checkpoints {name}", "samples/s": statistics.median(rates),
             "vs none": statistics.median(rates) / statistics.median(runs["none"])} for name, rates in runs.items()]


def _worker(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of worker `rank` among the local launcher's children, if it runs."""
    for task in Path(f"/proc/{launcher.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"DMLC_ROLE=worker" in environ and f"TFKV_RANK_HINT={rank}".encode() in environ:
                return int(child)
    return None


def restart(root: Path) -> list[dict]:
    run = root / "restart"
    job = subprocess.Popen(["tfkv-run", *RESTART_JOB, f"hydra.run.dir={run}"], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    seen: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: seen.extend((time.monotonic(), ln) for ln in job.stdout), daemon=True)
    reader.start()
    try:
        while not (run / "checkpoints").is_dir() or not any((run / "checkpoints").glob("*-step-*")):
            if job.poll() is not None:
                raise SystemExit("the job ended before a step checkpoint")
            time.sleep(0.01)
        pid = _worker(job, 1)
        if pid is None:
            raise SystemExit("worker 1 is not running")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        code = job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    reader.join(timeout=10)
    when = {what: next((t for t, ln in seen if t > killed and what in ln), None)
            for what in ("tfkv: restart 1 of 1", "resumed from")}
    if code != 0 or None in when.values():
        raise SystemExit(f"the restarted job did not resume (status {code}):\n" + "".join(ln for _, ln in seen)[-3000:])
    print(f"kill -9 of worker 1 -> restart line {when['tfkv: restart 1 of 1'] - killed:.1f} s, "
          f"-> training again (resume line) {when['resumed from'] - killed:.1f} s")
    return [{"what": "kill -9 of worker 1 -> restart line", "seconds": when["tfkv: restart 1 of 1"] - killed},
            {"what": "kill -9 of worker 1 -> training again", "seconds": when["resumed from"] - killed}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", default="overhead,restart", help="overhead, restart or both (comma-separated)")
    p.add_argument("--trials", type=int, default=3, help="runs of each contender (overhead)")
    p.add_argument("--epochs", type=int, default=10, help="epochs of each run (overhead)")
    harness.add_argument(p, "checkpoint")
    a = p.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-checkpoint-") as d:
        if "overhead" in a.what:
            rows += overhead(a.trials, a.epochs, Path(d))
        if "restart" in a.what:
            rows += restart(Path(d))
    harness.write(a.result, "checkpoint", harness.settings_of(a), rows)


if __name__ == "__main__":
    main()
