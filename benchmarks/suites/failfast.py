"""How long a job takes to go down when one of its roles hangs (SIGSTOP: alive, answering
nothing), against the baseline of the same role dying (SIGKILL), measured in the same run.

Each try starts `tfkv-launch --launcher local -n 2 -s 2` running a dist_sync worker that pushes
and pulls in a loop, signals one role once every worker is working, and times the signal to the
launcher's exit; it also checks that the launcher's failure line names that role. `--load N`
keeps N busy processes running meanwhile (a loaded machine). The target (issue 28): a hang is
down within 10 s, the right role named. Prints one line per try, then per role the median
seconds for each signal and the ratio hang / death.

    python -m benchmarks failfast --repeat 2 --load 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Failing fast",
    "Seconds from `kill -9` (SIGKILL) or SIGSTOP of a worker, a server or the scheduler to the whole job "
    "down with the role named; a hang against a death (`hang/death`).",
    ["victim"], ["SIGKILL_s", "SIGSTOP_s"], "seconds", rerun="python -m benchmarks failfast --load 2")


TAG = "TFKV_BENCH_FAILFAST"
WORKER = """\
import os, sys, time
import numpy as np
import tfkv.store
kv = tfkv.store.create("dist_sync")
kv.init(0, np.zeros(1000, np.float32))
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    kv.push(0, np.ones(1000, np.float32)); kv.pull(0); time.sleep(0.01)
"""


def _role_pid(tag: str, role: str, rank: str) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if (env.get(TAG.encode()) == tag.encode() and env.get(b"DMLC_ROLE") == role.encode()
                and env.get(b"TFKV_RANK_HINT", b"0") == rank.encode()):
            return int(entry)
    return None


def one_try(victim: str, sig: int, workdir: Path, tag: str) -> tuple[float, bool, str]:
    """(seconds from the signal to the launcher's exit, whether its failure line names the
    victim, that line)."""
    script = workdir / "worker.py"
    script.write_text(WORKER)
    ready = [workdir / f"ready{i}" for i in range(2)]
    for r in ready:
        r.unlink(missing_ok=True)
    env = {**os.environ, TAG: tag, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(["tfkv-launch", "-n", "2", "-s", "2", "--launcher", "local", "--", sys.executable,
                             str(script), str(workdir / "ready{rank}")], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not all(r.exists() for r in ready):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the job never started:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.1)
    time.sleep(0.5)
    role, _, rank = victim.partition(" ")
    pid = _role_pid(tag, role, rank or "0")
    if pid is None:
        proc.kill()
        raise RuntimeError(f"no {victim} found")
    os.kill(pid, sig)
    signalled = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - signalled
    line = next((ln for ln in out.splitlines() if "the job failed:" in ln), "(no failure line)")
    named = f"the job failed: {victim}" in line
    if not named:
        print(out[-4000:], file=sys.stderr)
    return took, named, line.strip()


def _busy() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--load", type=int, default=0, help="busy processes kept running meanwhile")
    ap.add_argument("--roles", default="worker 1,server 0,scheduler")
    harness.add_argument(ap, "failfast")
    args = ap.parse_args()
    load = [multiprocessing.Process(target=_busy, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    times: dict[tuple[str, str], list[float]] = {}
    named_all = True
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(args.repeat):
                for victim in args.roles.split(","):
                    for sig in (signal.SIGKILL, signal.SIGSTOP):
                        took, named, line = one_try(victim, sig, Path(d), f"{os.getpid()}-{i}-{victim}-{sig}")
                        named_all &= named
                        times.setdefault((victim, sig.name), []).append(took)
                        print(f"{victim:10s} {sig.name:8s} {took:5.1f} s  named={named}  {line[-110:]}", flush=True)
    finally:
        for p in load:
            p.terminate()
    print(f"\nmedian seconds from the signal to the job down (load {args.load}, {args.repeat} tries each)")
    rows = []
    for victim in args.roles.split(","):
        kill = statistics.median(times[(victim, "SIGKILL")])
        stop = statistics.median(times[(victim, "SIGSTOP")])
        print(f"{victim:10s} SIGKILL {kill:5.1f}  SIGSTOP {stop:5.1f}  ratio hang/death {stop / kill:.2f}  "
              f"target SIGSTOP <= 10 s: {'met' if max(times[(victim, 'SIGSTOP')]) <= 10 else 'MISSED'}")
        rows.append({"victim": victim, "SIGKILL_s": kill, "SIGSTOP_s": stop, "hang/death": stop / kill})
    print(f"every failure line named the role: {named_all}")
    harness.write(args.result, "failfast", harness.settings_of(args), rows, every_line_named_the_role=named_all)


if __name__ == "__main__":
    main()
