"""Load: 8 workers and 2 servers on loopback, dist_sync, many steps of integer-valued pushes;
every update is counted exactly once (exact sums). Prints steps/s and each server's peak memory."""

import json
import time
from pathlib import Path

import pytest

from conftest import expected


def _vmhwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return -1


@pytest.mark.slow
def test_soak_8_workers_2_servers_every_update_counted_once(cluster, capsys):
    steps, nkeys, size, workers = 1000, 4, 20_000, 8
    # bigarray bound below the key size: every key is split over both servers
    c = cluster(num_servers=2, num_workers=workers, MXNET_KVSTORE_BIGARRAY_BOUND="10000",
                TFKV_HEARTBEAT_TIMEOUT="10")
    c.start_servers()
    start = time.time()
    outs = c.start_workers("int_sgd", str(steps), str(nkeys), str(size))
    peaks: dict[str, int] = {}
    while any(c.procs[f"worker {i}"].poll() is None for i in range(workers)):
        assert time.time() - start < 90, c.outputs()
        for name in ("server 0", "server 1"):
            try:
                peaks[name] = max(peaks.get(name, 0), _vmhwm_kib(c.procs[name].pid))
            except OSError:
                pass
        time.sleep(0.2)
    codes = c.wait(30)
    assert all(v == 0 for v in codes.values()), c.outputs()
    results = [json.loads(o.read_text()) for o in outs]
    for r in results:
        assert r["final"] == expected(steps, nkeys, workers)
    rate = min(r["steps_per_s"] for r in results)
    with capsys.disabled():
        print(f"\nsoak: {workers} workers, 2 servers, {nkeys} keys x {size} floats, {steps} steps: "
              f"{rate:.1f} steps/s (slowest worker), wall {time.time() - start:.1f} s; peak RSS (VmHWM) "
              + ", ".join(f"{n} {kib / 1024:.1f} MiB" for n, kib in sorted(peaks.items())))
