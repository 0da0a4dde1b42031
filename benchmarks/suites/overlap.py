"""Push+pull of a model-shaped set of keys (ResNet18's parameters): blocking per key, overlapped,
overlapped with chunking, and with 2-bit compression, against raw pyzmq moving the same bytes.

One scheduler and one server (`python -m tfkv.ps.node`) run as processes; the worker is this
process (a `DistStore` built from an explicit ClusterEnv). One iteration pushes every key and
pulls every key back, as a training step does (dist_sync, no optimizer: the server sums):

    blocking          for each key: push(k); pull(k)   one round trip at a time
    push; pull        push(all keys); pull(all keys)   every request in flight, but the replies
                                                       only start once every push has gone out
    pushpull          pushpull(all keys)               each key's pull right behind its push, so
                                                       replies stream back while pushes go out
                                                       (what DataParallel does)
    pushpull, secure  the same against a second scheduler and server run with the job's keys
                      (AEGIS-128X4 data plane), as a launched job is by default; every other
                      tfkv row is plain (TFKV_SECURE=0), as raw is
    pushpull+chunks   the same with keys cut into TFKV_CHUNK_BYTES messages (--chunk); each
                      pull assembles its chunks in a fresh array
    +chunks, out=     pushpull+chunks into the caller's arrays (MXNet's `out=`): the chunks are
                      copied straight into them, nothing is allocated per pull
    +2bit             pushpull with 2-bit compressed pushes (pulls stay float32)
    raw pyzmq         a DEALER sends the messages all at once to a ROUTER echo in another process
                      and receives them back (zero-copy), once with one message per key and once
                      with the chunked messages; the faster is the transport's limit ("vs raw")

GB/s counts float32 bytes out and back (2 x model bytes per iteration), also for +2bit (its
"effective" rate: what it would take float32 pushes to deliver). Trials alternate contenders;
medians are reported. The machine is shared, so expect noise.

    python -m benchmarks overlap [--seconds 1.5] [--trials 3] [--chunk 4M]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import statistics

import numpy as np
import zmq
from benchmarks import harness
from benchmarks.jobs import start_ps


# This benchmark's section of the performance page (benchmarks/report.py).
REPORT = harness.Report(
    "Overlapping a model's pushes and pulls",
    "GB/s of a push and pull of every ResNet18 parameter (62 keys, 44.7 MB) per iteration, blocking, "
    "split, fused (`pushpull`), chunked and 2-bit, against raw pyzmq sending the same messages to an "
    "echo process (`vs raw`: the faster raw run).",
    ["contender"], ["GB/s"], "GB/s")


# ResNet18 (CIFAR variant, tfkv.models "resnet18", 32x32x3 -> 10) trainable variable shapes, in
# model order: tfkv.models.resnet.build_resnet18((32, 32, 3), 10).trainable_variables
RESNET18 = [(3, 3, 3, 64), (64,), (64,)]
for _cin, _cout, _first in ((64, 64, False), (64, 128, True), (128, 256, True), (256, 512, True)):
    for _block in range(2):
        c_in = _cin if _block == 0 else _cout
        RESNET18 += [(3, 3, c_in, _cout), (_cout,), (_cout,), (3, 3, _cout, _cout), (_cout,), (_cout,)]
        if _block == 0 and _first:
            RESNET18 += [(1, 1, c_in, _cout), (_cout,), (_cout,)]
RESNET18 += [(512, 10), (10,)]


def parse_size(text: str) -> int:
    text = text.strip().upper().rstrip("B").rstrip("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def echo(port_queue: mp.Queue) -> None:
    sock = zmq.Context().socket(zmq.ROUTER)
    port_queue.put(sock.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--chunk", default="4M", help="TFKV_CHUNK_BYTES for the chunked contenders (the default is 16M)")
    ap.add_argument("--threshold", type=float, default=0.5)
    harness.add_argument(ap, "overlap")
    args = ap.parse_args()
    chunk = parse_size(args.chunk)

    from tfkv.ps.cluster_env import ClusterEnv
    from tfkv.store.dist import DistStore

    shapes = RESNET18
    sizes = [int(np.prod(s)) for s in shapes]
    model_bytes = 4 * sum(sizes)
    print(f"ResNet18: {len(shapes)} keys, {sum(sizes):,} float32 ({model_bytes / 1e6:.1f} MB), "
          f"chunks of {chunk:,} bytes, 1 server / 1 worker on 127.0.0.1")
    procs, env = start_ps(secure=False)
    secure_procs, secure_env = start_ps(secure=True)
    procs += secure_procs
    try:
        store = DistStore(env=ClusterEnv.from_env({**env, "DMLC_ROLE": "worker"}))
        # The same job with the job's keys (what a launched job runs by default), for the pushpull row.
        secure = DistStore(env=ClusterEnv.from_env({**secure_env, "DMLC_ROLE": "worker"}))
        grads = [np.full(n, 0.25, np.float32) for n in sizes]
        # Keys 0..K-1 unchunked, 1000.. chunked: the layout is fixed when a key is initialised.
        unchunked = list(range(len(shapes)))
        chunked = [1000 + k for k in unchunked]
        compressed = [2000 + k for k in unchunked]
        chunk_env = store.env
        store.env = dataclasses.replace(chunk_env, chunk_bytes=1 << 40)
        store.init(unchunked, [np.zeros(s, np.float32) for s in shapes])
        store.env = dataclasses.replace(chunk_env, chunk_bytes=chunk)
        store.init(chunked, [np.zeros(s, np.float32) for s in shapes])
        store.init(compressed, [np.zeros(s, np.float32) for s in shapes])
        secure.env = dataclasses.replace(secure.env, chunk_bytes=1 << 40)
        secure.init(unchunked, [np.zeros(s, np.float32) for s in shapes])
        priority = list(unchunked)  # backprop's order: the last layer's gradient is ready first
        pieces = [b - a for k in chunked for _, a, b, _ in store.keys.layout(k)[1].parts]

        def blocking() -> None:
            for k, g in zip(unchunked, grads):
                store.push(k, g)
                store.pull(k)

        def push_then_pull(keys: list[int]) -> None:
            store.push(keys, grads, priority=priority)
            store.pull(keys, priority=priority)

        def pushpull(keys: list[int], out: list[np.ndarray] | None = None) -> None:
            store.pushpull(keys, grads, out=out, priority=priority)

        outs = [np.empty(s, np.float32) for s in shapes]

        # raw pyzmq: the same messages as overlap+chunks, all in flight, echoed back
        q: mp.Queue = mp.get_context("spawn").Queue()
        echo_proc = mp.get_context("spawn").Process(target=echo, args=(q,), daemon=True)
        echo_proc.start()
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(f"tcp://127.0.0.1:{q.get(timeout=30)}")
        def raw_round(payloads: list[np.ndarray]) -> None:
            for p in payloads:
                raw.send(memoryview(p).cast("B"), copy=False)
            for _ in payloads:
                raw.recv(copy=False)

        whole = [np.full(n, 0.25, np.float32) for n in sizes]
        cut = [np.full(n, 0.25, np.float32) for n in pieces]
        contenders = {"blocking": blocking, "push; pull": lambda: push_then_pull(unchunked),
                      "pushpull": lambda: pushpull(unchunked),
                      "pushpull, secure": lambda: secure.pushpull(unchunked, grads, priority=priority),
                      "pushpull+chunks": lambda: pushpull(chunked),
                      "+chunks, out=": lambda: pushpull(chunked, outs),
                      "+2bit": lambda: pushpull(compressed), "raw per key": lambda: raw_round(whole),
                      "raw chunked": lambda: raw_round(cut)}
        store.set_gradient_compression({"type": "2bit", "threshold": args.threshold})
        # Compression is a store-wide setting: its Sender is handed to the worker for the +2bit contender only.
        sender, compressing = store.worker.sender, {"+2bit"}
        results: dict[str, list[float]] = {name: [] for name in contenders}
        for trial in range(args.trials):
            order = harness.alternating(list(contenders), trial)
            for name in order:
                fn = contenders[name]
                store.worker.sender = sender if name in compressing else None
                harness.warm_up(fn, 1)
                n, elapsed = harness.timed(fn, args.seconds)
                results[name].append(2 * model_bytes * n / elapsed / 1e9)
        raw_gbs = max(statistics.median(results["raw per key"]), statistics.median(results["raw chunked"]))
        print(f"\n{'contender':<18}{'GB/s':>8}{'vs raw':>9}   (median of {args.trials} trials of {args.seconds} s)")
        rows = []
        for name, values in results.items():
            gbs = statistics.median(values)
            print(f"{name:<18}{gbs:8.3f}{gbs / raw_gbs:9.2f}")
            rows.append({"contender": name, "GB/s": gbs, "vs raw": gbs / raw_gbs})
        store.push_bytes = 0
        store.worker.sender = None
        pushpull(chunked)
        plain = store.push_bytes
        store.push_bytes = 0
        store.worker.sender = sender
        pushpull(compressed)
        if store.push_bytes * 8 > plain:  # 2-bit is 16x fewer bytes: a +2bit row that did not compress is no figure
            raise SystemExit(f"overlap: the +2bit contender pushed {store.push_bytes:,} bytes against float32's {plain:,}: "
                             "its pushes were not compressed, so its row is not recorded")
        print(f"\nbytes pushed per step: float32 {plain:,}, 2-bit {store.push_bytes:,} "
              f"({plain / store.push_bytes:.1f}x less)")
        print(f"pushpull secure/plain: {statistics.median(results['pushpull, secure']) / statistics.median(results['pushpull']):.2f} "
              "(secure: the job's keys, AEGIS-128X4 data plane, as launched jobs run by default; the other tfkv rows are "
              "plain, TFKV_SECURE=0, as raw is)")
        store.close()
        secure.close()
        harness.write(args.result, "overlap", harness.settings_of(args), rows,
                     pushed_bytes_per_step={"float32": plain, "2bit": store.push_bytes})
    finally:
        from tfkv.launcher.supervisor import stop_groups

        stop_groups(procs, grace=10)  # after store.close() the scheduler shuts the server down


if __name__ == "__main__":
    main()
