"""Push+pull throughput (GB/s) of the `dist_sync` parameter server against raw pyzmq, same run.

Throughput counts the bytes moved in both directions: one iteration of tfkv is `pushpull(key, a,
out=b)` (MXNet's fused push and pull, what a training step does; `--op push+pull`: `push(key, a)`
then `b = pull(key)`) of a float32 array of N bytes (N out, N back), one iteration of the raw
baseline is a DEALER client sending N bytes to a ROUTER echo server in another process that
sends them back (N out, N back), zero-copy (`copy=False`, the socket types tfkv uses). GB = 1e9
bytes. The workers use numpy arrays directly and run `dist_sync` without an optimizer, so the
servers only sum (with one worker the pulled value is the pushed array; every result is checked).

Contenders, each in its own processes, for every size (4 KiB, 1 MiB, 16 MiB, 64 MiB):

    raw 1x1     one client, one echo server, zero-copy
    raw copy    the same with plain copying send/recv (copy=True), measured in the same processes
    tfkv 1x1    1 worker, 1 server, launched by tfkv.launcher (make_plan + local.run)
    raw 2x2     2 clients, 2 echo servers, with tfkv's traffic pattern (below)
    tfkv 2x2    2 workers, 2 servers; throughput is the sum over both workers
    secure 1x1  tfkv 1x1 with the job's keys, as a launched job runs by default (the tfkv
                contenders above are plain, TFKV_SECURE=0, to compare the transport with raw)

In dist_sync a server closes a key's round only when *every* worker has pushed it, so the two
workers of the 2x2 job push and pull the same key (as data-parallel training does); a worker
pushing a key of its own would wait forever. Keys below the big-array bound (1,000,000 elements,
so 4 KiB and 1 MiB) live on one server, larger ones are split in halves over both servers. The
raw 2x2 clients send to the echo servers with exactly that layout.

Each point runs a fixed count of iterations chosen from a calibration so that it lasts about
`--seconds` (the workers of a job agree on the count through the store, as they must in a
synchronous job). Trials alternate between the contenders (in reversed order every other trial)
and the median is reported, because this machine is shared and noisy.

    python -m benchmarks pushpull [--seconds 1] [--trials 5] [--sizes 4K,1M,16M,64M,keyset]
                                        [--op pushpull|push+pull]

Exits non-zero if a job fails, hangs (--job-timeout), or a pulled value is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np
import zmq
from benchmarks import harness
from benchmarks.jobs import run_plan, security_env


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Push and pull throughput",
    "GB/s (both directions) of tfkv's `pushpull` of one array, or of a transformer-shaped key set, "
    "against a raw pyzmq round trip of the same bytes between the same processes, in the same run. "
    "The tfkv and raw columns are plain; `secure_1x1` is what a launched job runs by default.",
    ["size"], ["raw_1x1", "tfkv_1x1", "secure_1x1"], "GB/s")


BIGARRAY_BOUND = 1_000_000  # elements; tfkv's (and MXNet's) default MXNET_KVSTORE_BIGARRAY_BOUND
CONTROL_KEY = 1 << 20
# MXNet 1.9.1 ps-lite, 1 server / 1 worker, push+pull over raw ZeroMQ at the same size.
MXNET_RATIO = {1 << 20: 0.78, 16 << 20: 0.69, 64 << 20: 0.54}
TARGET = 0.8
KEYSET_TARGET = 0.7


# A transformer-shaped key set (`--sizes keyset`): 24 blocks of small keys (two LayerNorms' scale
# and bias, the attention's qkv and output biases, the MLP's two biases: 8 keys, 11,904 floats) and
# 4 large weights of 768 x 1024: 196 keys, 13.1 MiB, as one iteration's pushpull of every key.
# Raw moves the same bytes as one message per server (its keys' bytes end to end): the best a
# transport can do with them, which tfkv must approach with a message per key (target >= 0.7).
KEYSET = -1
_BLOCK = [768, 768, 768, 768, 2304, 768, 3072, 768]
KEYSET_COUNTS = _BLOCK * 24 + [768 * 1024] * 4


def counts(n: int) -> list[int]:
    """Element counts of the keys of one point: one key of n bytes, or the key set's."""
    return KEYSET_COUNTS if n == KEYSET else [n // 4]


def point_bytes(n: int) -> int:
    return 4 * sum(counts(n))


def parse_size(text: str) -> int:
    if text.strip().lower() == "keyset":
        return KEYSET
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def human(nbytes: int) -> str:
    if nbytes == KEYSET:
        return "keyset"
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= m and nbytes % m == 0:
            return f"{nbytes // m} {unit}"
    return f"{nbytes} B"


def server_bytes(key0: int, n: int, num_servers: int) -> list[int]:
    """Float32 elements each server holds of point n's keys (numbered from key0), as tfkv places them."""
    held = [0] * num_servers
    for i, c in enumerate(counts(n)):
        for s, lo, hi in layout(key0 + i, c, num_servers):
            held[s] += hi - lo
    return held


def layout(key: int, size: int, num_servers: int) -> list[tuple[int, int, int]]:
    """(server, start, end) parts of a key, as tfkv.ps.parts.plan cuts them (chunks aside)."""
    if size < BIGARRAY_BOUND or num_servers == 1:
        return [((key * 9973) % num_servers, 0, size)]
    return [(i, i * size // num_servers, (i + 1) * size // num_servers) for i in range(num_servers)]


def calibration_count(nbytes: int) -> int:
    """Iterations timed to estimate one iteration: about 32 MiB each way, 2 to 500."""
    return max(2, min(500, (32 << 20) // nbytes))


def timed_count(seconds: float, per_iter: float) -> int:
    return max(3, math.ceil(seconds / max(per_iter, 1e-7)))


# -- tfkv worker (a separate process started by tfkv.launcher.backends.local) ------------------------------

def tfkv_worker(args: argparse.Namespace) -> None:
    import tfkv.store

    store = tfkv.store.create("dist_sync", devices=["cpu:0"])
    with harness.closing(store, "bench_pushpull"):
        rank, workers = store.rank, store.num_workers
        expected = workers * (workers + 1) / 2  # worker r pushes r + 1 everywhere; the servers sum
        store.init(CONTROL_KEY, np.zeros(1, np.float32))
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        for i, nbytes in enumerate(sizes):
            keys = [i * 1000 + j for j in range(len(counts(nbytes)))]
            store.init(keys, [np.zeros(c, np.float32) for c in counts(nbytes)])
        points = {}
        for i, nbytes in enumerate(sizes):
            keys = [i * 1000 + j for j in range(len(counts(nbytes)))]
            arrays = [np.full(c, rank + 1, np.float32) for c in counts(nbytes)]
            outs = [np.empty_like(a) for a in arrays]
            a = np.concatenate(arrays)

            def once() -> list[np.ndarray]:
                if args.op == "pushpull":  # MXNet's fused pushpull: what a training step does
                    store.pushpull(keys, arrays, out=outs)
                    return outs
                store.push(keys, arrays)
                return store.pull(keys)

            for _ in range(2):  # warm-up
                once()
            c = calibration_count(point_bytes(nbytes))
            t0 = time.perf_counter()
            for _ in range(c):
                once()
            per_iter = (time.perf_counter() - t0) / c
            # Every worker must run the same count, or the last round of the others never closes:
            # the mean of the estimates, summed by the servers, is the same float everywhere.
            store.push(CONTROL_KEY, np.array([per_iter], np.float32))
            n = timed_count(args.seconds, float(store.pull(CONTROL_KEY)[0]) / workers)
            store.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                got = once()
            elapsed = time.perf_counter() - t0
            out = np.concatenate(got) if len(got) > 1 else got[0]  # checked outside the timed loop, as raw's echo is
            if out.shape != a.shape or not np.all(out == expected):
                raise AssertionError(f"{human(nbytes)}: pulled {out[:4]}..., expected {expected} everywhere")
            points[str(nbytes)] = {"n": n, "seconds": elapsed}
        with open(args.out, "w") as f:
            json.dump({"rank": rank, "points": points}, f)


def run_tfkv(num_servers: int, num_workers: int, sizes: list[int], seconds: float,
             timeout: float, secure: bool = False, op: str = "pushpull") -> dict[int, float]:
    """GB/s per size of one tfkv job (summed over the workers): plain (TFKV_SECURE=0), as the raw
    baseline is, or secure as a launched job is by default (a fresh key for the job)."""
    from tfkv.launcher.plan import make_plan
    from tfkv.launcher.ports import free_port

    with tempfile.TemporaryDirectory(prefix="bench_pushpull_") as tmp:
        outs = [os.path.join(tmp, f"worker{i}.json") for i in range(num_workers)]
        worker = [*harness.suite_argv("pushpull"), "--worker", "--seconds", str(seconds), "--op", op,
                  "--sizes", ",".join(str(s) for s in sizes), "--out"]
        plan = make_plan(num_workers, num_servers, worker, [sys.executable, "-m", "tfkv.ps.node"],
                         ["127.0.0.1"], "127.0.0.1", free_port(), extra_env=security_env(secure))
        for p in plan:
            if p.role == "worker":
                p.argv.append(outs[p.rank])
        run_plan(plan, timeout, f"tfkv {num_servers} server(s) x {num_workers} worker(s)")
        reports = []
        for path in outs:
            with open(path) as f:
                reports.append(json.load(f)["points"])
    return {n: sum(2 * point_bytes(n) * r[str(n)]["n"] for r in reports) / max(r[str(n)]["seconds"] for r in reports)
            / 1e9 for n in sizes}


# -- raw pyzmq baseline (multiprocessing, spawn) --------------------------------------------------

def echo_server(port_queue: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port_queue.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        frames = sock.recv_multipart(copy=False)  # [identity, payload]
        sock.send_multipart(frames, copy=False)  # the same zmq messages back: no copy


def raw_client(rank: int, ports: list[int], sizes: list[int], seconds: float, modes: list[str],
               barrier, shared, results: mp.Queue) -> None:
    try:
        ctx = zmq.Context()
        socks = []
        for port in ports:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
        workers = len(shared)
        points: dict[str, dict[str, float]] = {}
        for i, nbytes in enumerate(sizes):
            if nbytes == KEYSET:  # each server's keys' bytes as one message
                parts = [(socks[s], memoryview(np.full(held, rank + 1, np.float32)).cast("B"))
                         for s, held in enumerate(server_bytes(i * 1000, nbytes, len(socks))) if held]
            else:
                a = np.full(nbytes // 4, rank + 1, np.float32)
                parts = [(socks[s], memoryview(a[lo:hi]).cast("B")) for s, lo, hi in layout(i * 1000, a.size, len(socks))]
            for mode in modes:
                copy = mode == "copy"

                def once():
                    for sock, view in parts:  # every part out before waiting, as tfkv does
                        sock.send(view, copy=copy)
                    return [sock.recv(copy=copy) for sock, _ in parts]

                for _ in range(2):
                    once()
                c = calibration_count(point_bytes(nbytes))
                t0 = time.perf_counter()
                for _ in range(c):
                    once()
                shared[rank] = (time.perf_counter() - t0) / c
                barrier.wait()
                n = timed_count(seconds, sum(shared[:]) / workers)
                barrier.wait()  # everyone has read `shared`; start together
                t0 = time.perf_counter()
                for _ in range(n):
                    got = once()
                elapsed = time.perf_counter() - t0
                for (sock, view), frame in zip(parts, got):
                    if bytes(memoryview(frame.buffer if hasattr(frame, "buffer") else frame)) != view.tobytes():
                        raise AssertionError(f"raw {mode} {human(nbytes)}: the echo differs from what was sent")
                points.setdefault(mode, {})[str(nbytes)] = (n, elapsed)
        results.put((rank, points))
    except BaseException as e:  # noqa: BLE001 - report anything to the parent
        results.put((rank, f"{type(e).__name__}: {e}"))
        raise


def run_raw(num_servers: int, num_clients: int, sizes: list[int], seconds: float, modes: list[str],
            timeout: float) -> dict[str, dict[int, float]]:
    """GB/s per mode and size, summed over the clients."""
    ctx = mp.get_context("spawn")
    port_queue = ctx.Queue()
    servers = [ctx.Process(target=echo_server, args=(port_queue,), daemon=True) for _ in range(num_servers)]
    clients = []
    try:
        for s in servers:
            s.start()
        ports = [port_queue.get(timeout=60) for _ in servers]
        barrier = ctx.Barrier(num_clients)
        shared = ctx.Array("d", num_clients)
        results = ctx.Queue()
        clients = [ctx.Process(target=raw_client, args=(r, ports, sizes, seconds, modes, barrier, shared, results),
                               daemon=True) for r in range(num_clients)]
        for c in clients:
            c.start()
        reports = {}
        deadline = time.monotonic() + timeout
        while len(reports) < num_clients:
            try:
                rank, got = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # queue.Empty
                raise RuntimeError(f"raw {num_servers}x{num_clients}: no result within {timeout:.0f} s") from None
            if isinstance(got, str):
                raise RuntimeError(f"raw {num_servers}x{num_clients} client {rank}: {got}")
            reports[rank] = got
            if time.monotonic() > deadline:
                raise RuntimeError(f"raw {num_servers}x{num_clients}: ran past {timeout:.0f} s")
        for c in clients:
            c.join(timeout=10)
    finally:
        for p in clients + servers:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return {mode: {n: sum(2 * point_bytes(n) * r[mode][str(n)][0] for r in reports.values())
                   / max(r[mode][str(n)][1] for r in reports.values()) / 1e9 for n in sizes}
            for mode in modes}


# -- main -----------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="per point (size, contender, trial)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--sizes", default="4K,1M,16M,64M,keyset",
                    help="bytes per array, comma-separated (K/M suffixes), or keyset (a transformer's 196 keys)")
    ap.add_argument("--op", choices=["pushpull", "push+pull"], default="pushpull",
                    help="tfkv's iteration: one pushpull (the fused op training uses) or push then pull")
    ap.add_argument("--no-copy-baseline", action="store_true", help="skip the copying raw baseline")
    ap.add_argument("--job-timeout", type=float, default=180.0, help="seconds before a job counts as hung")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    harness.add_argument(ap, "pushpull")
    args = ap.parse_args()
    if args.worker:
        tfkv_worker(args)
        return

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    for n in sizes:
        if n != KEYSET and (n % 4 or n <= 0):
            ap.error(f"size {n} is not a positive multiple of 4 bytes (float32)")
    modes = ["zc"] if args.no_copy_baseline else ["zc", "copy"]
    contenders = {
        "raw1": lambda: run_raw(1, 1, sizes, args.seconds, modes, args.job_timeout),
        "tfkv1": lambda: {"tfkv1": run_tfkv(1, 1, sizes, args.seconds, args.job_timeout, op=args.op)},
        "secure1": lambda: {"secure1": run_tfkv(1, 1, sizes, args.seconds, args.job_timeout, secure=True, op=args.op)},
        "raw2": lambda: {"raw2": run_raw(2, 2, sizes, args.seconds, ["zc"], args.job_timeout)["zc"]},
        "tfkv2": lambda: {"tfkv2": run_tfkv(2, 2, sizes, args.seconds, args.job_timeout, op=args.op)},
    }
    series: dict[str, dict[int, list[float]]] = {}
    print(f"{args.op} throughput, GB/s (1e9 bytes/s, both directions), median of {args.trials} trials "
          f"of ~{args.seconds:g} s per point", flush=True)
    t_start = time.monotonic()
    try:
        for trial in range(args.trials):
            order = harness.alternating(list(contenders), trial)
            for name in order:
                got = contenders[name]()
                if name == "raw1":
                    got = {"raw1": got["zc"], **({"rawcopy": got["copy"]} if "copy" in got else {})}
                for series_name, by_size in got.items():
                    for n, v in by_size.items():
                        series.setdefault(series_name, {}).setdefault(n, []).append(v)
            print(f"  trial {trial + 1}/{args.trials} done ({time.monotonic() - t_start:.0f} s)", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"bench_pushpull: FAILED: {e}", file=sys.stderr)
        sys.exit(1)

    med = {s: harness.medians(by) for s, by in series.items()}
    has_copy = "rawcopy" in med
    head = (f"{'size':>8} {'raw 1x1':>8} " + (f"{'raw copy':>8} " if has_copy else "")
            + f"{'tfkv 1x1':>8} {'ratio':>6}   {'raw 2x2':>8} {'tfkv 2x2':>8} {'ratio':>6}   "
            f"{'MXNet 1.9.1 ratio 1x1':>21}   {'secure 1x1':>10} {'secure/plain':>12}")
    print(head)
    below, rows = [], []
    for n in sizes:
        r1, t1, r2, t2 = med["raw1"][n], med["tfkv1"][n], med["raw2"][n], med["tfkv2"][n]
        s1 = med["secure1"][n]
        mx = f"{MXNET_RATIO[n]:.2f}" if n in MXNET_RATIO else "-"
        print(f"{human(n):>8} {r1:>8.3f} " + (f"{med['rawcopy'][n]:>8.3f} " if has_copy else "")
              + f"{t1:>8.3f} {t1 / r1:>6.3f}   {r2:>8.3f} {t2:>8.3f} {t2 / r2:>6.3f}   {mx:>21}   "
              f"{s1:>10.3f} {s1 / t1:>12.3f}")
        rows.append({"size": human(n), "raw_1x1": r1, **({"raw_copy_1x1": med["rawcopy"][n]} if has_copy else {}),
                     "tfkv_1x1": t1, "ratio_1x1": t1 / r1, "raw_2x2": r2, "tfkv_2x2": t2, "ratio_2x2": t2 / r2,
                     "mxnet_ratio_1x1": MXNET_RATIO.get(n), "secure_1x1": s1, "secure/plain": s1 / t1})
        if (n == KEYSET and t1 / r1 < KEYSET_TARGET) or (n >= 1 << 20 and t1 / r1 < TARGET):
            below.append(human(n))
    print(f"ratio = tfkv / raw with the same processes and traffic pattern. Target: tfkv 1x1 >= {TARGET} "
          f"of raw from 1 MiB up, >= {KEYSET_TARGET} for the key set (raw: one message per server) "
          f"({'met' if not below else 'NOT met at ' + ', '.join(below)}). "
          f"MXNet 1.9.1 ps-lite reached ~0.78 (1 MiB), 0.69 (16 MiB), 0.54 (64 MiB) of raw. The tfkv columns "
          f"are plain (TFKV_SECURE=0), as raw is; secure 1x1 is the default (the job's keys), secure/plain "
          f"its cost (target >= 0.7).")
    print("per-trial spread (min-max GB/s): " + "; ".join(
        f"{s} {human(n)} {min(series[s][n]):.2f}-{max(series[s][n]):.2f}"
        for s in ("raw1", "tfkv1") for n in sizes if n >= 1 << 20 or n == KEYSET))
    harness.write(args.result, "pushpull", harness.settings_of(args), rows, unit="GB/s, both directions")


if __name__ == "__main__":
    main()
