"""What security costs: push+pull GB/s of one worker against one server, secure (the default:
the job's keys, AEGIS-128X4 data plane), secure on AES-256-GCM (the data plane where `aeg` is
missing: the job's processes run with it hidden) and plain (TFKV_SECURE=0), in the same run.

    python -m benchmarks security [--sizes 4K,1M,16M,64M] [--seconds 1] [--rounds 3]
                                         [--op push+pull|pushpull] [--gcm]

Each round starts a scheduler and a server (python -m tfkv.ps.node) on loopback for each mode, and
a child process per mode is the worker; rounds alternate the modes (in reversed order every other
round) and the medians are reported, because this machine is shared and noisy. GB/s counts the
bytes pushed plus the bytes pulled; the ratio is secure over plain. Target: >= 0.7 from 1 MiB up.
With --gcm a third mode, gcm, runs secure with `aeg` hidden from the worker and the servers
(a directory first on PYTHONPATH whose `aeg` raises ImportError, as tests/handshakes.py does).
"""

import argparse
import json
import statistics
import os
import subprocess
import tempfile
import time

import numpy as np

from benchmarks import harness


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "What security costs",
    "GB/s of one worker and one server on loopback, secure (the default: AEGIS data plane, CURVE control "
    "plane) against plain (`TFKV_SECURE=0`), rounds alternating in fresh processes.",
    ["size"], ["plain", "secure"], "GB/s")


def run(secure: bool, sizes_mib: list[float], seconds: float, op: str = "push+pull") -> dict:
    from benchmarks.jobs import start_ps

    procs, env = start_ps(secure, quiet=True)
    os.environ.clear()
    os.environ.update({**env, "DMLC_ROLE": "worker"})
    from tfkv.ps.cluster_env import ClusterEnv
    from tfkv.store.dist import DistStore

    kv = DistStore(env=ClusterEnv.from_env())
    sessions = kv.servers.sessions
    out = {"cipher": sessions[0].cipher.NAME if sessions else "none"}
    for i, mib in enumerate(sizes_mib):
        n = int(mib * (1 << 20) // 4)
        kv.init(i, np.zeros(n, np.float32))
        g, back = np.ones(n, np.float32), np.empty(n, np.float32)

        def once() -> None:
            if op == "pushpull":  # MXNet's fused push and pull: one request message, what training sends
                kv.pushpull(i, g, out=back)
            else:
                kv.push(i, g)
                kv.pull(i, out=back)

        once()  # warm up
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            once()
            count += 1
        out[mib] = 2 * count * n * 4 / (time.perf_counter() - start) / 1e9
    kv.close()  # the scheduler then shuts the server down; what is left is stopped as a launcher would
    from tfkv.launcher.supervisor import stop_groups

    stop_groups(procs, grace=30)
    return out


def _size(text: str) -> float:
    """'4K', '1M', '64M' -> MiB."""
    units = {"K": 1 / 1024, "M": 1.0}
    return float(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else float(text)


def _label(mib: float) -> str:
    return f"{mib * 1024:g} KiB" if mib < 1 else f"{mib:g} MiB"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4K,1M,16M,64M", help="comma-separated sizes, K or M suffix")
    ap.add_argument("--seconds", type=float, default=1.0, help="per size, mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=["both", "plain", "secure"], default="both")
    ap.add_argument("--gcm", action="store_true", help="also measure secure with aeg hidden (AES-256-GCM)")
    ap.add_argument("--op", choices=["push+pull", "pushpull"], default="push+pull",
                    help="an iteration: push then pull (two requests), or one pushpull (training's)")
    harness.add_argument(ap, "security")
    a = ap.parse_args()
    sizes = [_size(s) for s in a.sizes.split(",")]
    if a.mode == "both":  # each mode in a fresh process: one ZeroMQ context, one environment
        modes = ["plain", "secure", "gcm"] if a.gcm else ["plain", "secure"]
        got: dict[str, list[dict]] = {m: [] for m in modes}
        hidden = tempfile.mkdtemp(prefix="no-aeg-")
        os.mkdir(os.path.join(hidden, "aeg"))
        with open(os.path.join(hidden, "aeg", "__init__.py"), "w") as f:
            f.write("raise ImportError('aeg hidden by bench_security.py --gcm')\n")
        for r in range(a.rounds):
            for mode in harness.alternating(modes, r):
                env = dict(os.environ)
                if mode == "gcm":
                    env["PYTHONPATH"] = os.pathsep.join([hidden, env.get("PYTHONPATH", "")])
                lines = subprocess.run([*harness.suite_argv("security"), "--mode", "plain" if mode == "plain" else "secure",
                                        "--seconds", str(a.seconds), "--sizes", a.sizes, "--op", a.op], check=True,
                                       capture_output=True, text=True, env=env).stdout
                got[mode].append(json.loads(lines.strip().splitlines()[-1]))
                assert got[mode][-1]["cipher"] == {"plain": "none", "secure": "AEGIS-128X4", "gcm": "AES-256-GCM"}[mode], (
                    f"the {mode} run's data plane was sealed with {got[mode][-1]['cipher']}")
            print(f"  round {r + 1}/{a.rounds} done", flush=True)
        print(f"{a.op} GB/s, 1 worker x 1 server, loopback, median of {a.rounds} alternating rounds")
        extra = f" {'gcm':>8} {'gcm/plain':>10} {'gcm/secure':>11}" if a.gcm else ""
        print(f"{'size':>8} {'plain':>8} {'secure':>8} {'secure/plain':>13}{extra}")
        rows = []
        for mib in sizes:
            gbs = {m: statistics.median(g[f"{mib:g}"] for g in got[m]) for m in modes}
            line = f"{_label(mib):>8} {gbs['plain']:8.3f} {gbs['secure']:8.3f} {gbs['secure'] / gbs['plain']:13.2f}"
            if a.gcm:
                line += f" {gbs['gcm']:8.3f} {gbs['gcm'] / gbs['plain']:10.2f} {gbs['gcm'] / gbs['secure']:11.2f}"
            print(line, flush=True)
            rows.append({"size": _label(mib), **gbs, "secure/plain": gbs["secure"] / gbs["plain"],
                         **({"gcm/plain": gbs["gcm"] / gbs["plain"]} if a.gcm else {})})
        print("secure = the default (job keys: AEGIS-128X4 data plane, CURVE control plane); plain = TFKV_SECURE=0; "
              "gcm = secure where aeg is missing (AES-256-GCM). Target: secure/plain >= 0.7 from 1 MiB up.")
        harness.write(a.result, "security", harness.settings_of(a), rows, unit="GB/s")
    else:  # the child: its figures as one JSON line
        print(json.dumps({k if isinstance(k, str) else f"{k:g}": v
                          for k, v in run(a.mode == "secure", sizes, a.seconds, a.op).items()}))


if __name__ == "__main__":
    main()
