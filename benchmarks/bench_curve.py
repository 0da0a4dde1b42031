"""What CURVE costs: push+pull GB/s of one worker against one server, with and without CURVE.

    python3 benchmarks/bench_curve.py [--sizes-mib 1 16] [--seconds 5]

Starts a scheduler and a server (python -m tfkv.ps.node) on loopback for each mode; a child
process per mode is the worker. GB/s counts the bytes pushed plus the bytes pulled; the ratio is
CURVE's against plain TCP in the same run.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def run(secure: bool, sizes_mib: list[float], seconds: float) -> dict[float, float]:
    from tfkv.launcher.ports import free_port
    from tfkv import keys as security

    env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(free_port()),
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.update(security.keys_env(security.new_keys()) if secure else {"TFKV_SECURE": "0"})
    procs = [subprocess.Popen([sys.executable, "-m", "tfkv.ps.node"], env={**env, "DMLC_ROLE": role},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for role in ("scheduler", "server")]
    os.environ.clear()
    os.environ.update({**env, "DMLC_ROLE": "worker"})
    from tfkv.ps.cluster_env import ClusterEnv
    from tfkv.store.dist import DistStore

    kv = DistStore(env=ClusterEnv.from_env())
    out = {}
    for i, mib in enumerate(sizes_mib):
        n = int(mib * (1 << 20) // 4)
        kv.init(i, np.zeros(n, np.float32))
        g = np.ones(n, np.float32)
        kv.push(i, g), kv.pull(i)  # warm up
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            kv.push(i, g)
            kv.pull(i)
            count += 1
        out[mib] = 2 * count * n * 4 / (time.perf_counter() - start) / 1e9
    kv.close()  # the scheduler then shuts the server down; what is left is stopped as a launcher would
    from tfkv.launcher.supervisor import stop_groups

    stop_groups(procs, grace=30)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 16])
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--mode", choices=["both", "plain", "curve"], default="both")
    a = ap.parse_args()
    if a.mode == "both":  # each mode in a fresh process: one ZeroMQ context, one environment
        got = {}
        for mode in ("plain", "curve"):
            lines = subprocess.run([sys.executable, __file__, "--mode", mode, "--seconds", str(a.seconds),
                                    "--sizes-mib", *map(str, a.sizes_mib)], check=True, capture_output=True,
                                   text=True).stdout
            got[mode] = json.loads(lines.strip().splitlines()[-1])
        for mib in a.sizes_mib:
            plain, curve = got["plain"][f"{mib:g}"], got["curve"][f"{mib:g}"]
            print(f"plain {mib:g} MiB push+pull: {plain:.3f} GB/s")
            print(f"curve {mib:g} MiB push+pull: {curve:.3f} GB/s  ({curve / plain:.2f}x plain)", flush=True)
    else:  # the child: its figures as one JSON line
        print(json.dumps({f"{mib:g}": gbs for mib, gbs in run(a.mode == "curve", a.sizes_mib, a.seconds).items()}))
