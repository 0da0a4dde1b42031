"""A worker process for the parameter-server tests: `python dist_worker.py SCENARIO OUT_JSON [args]`.

Each scenario uses a real `tfkv.store.create(...)` store against real scheduler and server
processes, and writes what it observed to OUT_JSON for the test to check.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfkv.store  # noqa: E402
from tfkv import optim  # noqa: E402
from tfkv.ps import protocol as P  # noqa: E402


def semantics(kv, out):
    """Sync sums, update on the store, a big array split over servers, string keys."""
    r, n = kv.rank, kv.num_workers
    kv.init(["a", "b", "big"], [np.zeros((2, 3), np.float32), np.ones(5, np.float32), np.zeros(1000, np.float32)])
    results = {}
    for step in range(3):
        kv.push(["a", "big"], [np.full((2, 3), r + 1.0, np.float32), np.full(1000, step + r, np.float32)])
        a, big = kv.pull(["a", "big"])
        results[f"step{step}"] = [a.tolist(), float(big[0]), float(big[-1])]
    # Two device values from this machine are summed before the push.
    kv.push("b", [np.full(5, 1.0, np.float32), np.full(5, 2.0, np.float32)])
    results["device_sum"] = kv.pull("b").tolist()
    results["rank"], results["num_workers"] = r, n
    json.dump(results, out)


def updates(kv, out):
    """Update on the servers with SGD lr=1: every worker's push counted exactly once."""
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    kv.init("w", np.full(4, 100.0, np.float32))
    steps = int(sys.argv[3])
    for _ in range(steps):
        kv.push("w", np.full(4, kv.rank + 1.0, np.float32))
        value = kv.pull("w")
    kv.barrier()
    json.dump({"final": kv.pull("w").tolist(), "last_seen": value.tolist(), "steps": steps}, out)


def train(kv, out):
    """Data-parallel training; worker r takes slice r of each global batch (see test)."""
    import keras
    import tensorflow as tf

    from tfkv.models import build
    from tfkv.parallel import devices
    from tfkv.parallel.data_parallel import DataParallel

    ndev, update_on_kvstore, batch = int(sys.argv[3]), sys.argv[4] == "1", int(sys.argv[5])
    devs = devices.setup([f"cpu:{i}" for i in range(ndev)])
    keras.utils.set_random_seed(7)
    opt = optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9, wd=1e-3)
    mlp = {"_target_": "tfkv.models.mlp.build", "hidden": [32, 16]}
    dp = DataParallel(lambda: build(mlp, input_shape=(8, 8, 1), num_classes=10), devs, kv, opt,
                      [batch // ndev] * ndev, update_on_kvstore=update_on_kvstore)
    rng = np.random.default_rng(42)
    for _ in range(6):
        x = rng.normal(size=(batch * kv.num_workers, 8, 8, 1)).astype(np.float32)
        y = rng.integers(0, 10, batch * kv.num_workers).astype(np.int32)
        sl = slice(kv.rank * batch, (kv.rank + 1) * batch)
        dp.step(tf.constant(x[sl]), tf.constant(y[sl]))
    np.savez(out.name + ".npz", *dp.get_weights())
    json.dump({"rank": kv.rank}, out)


def hang(kv, out):
    """Stay in the job (heartbeating, in barriers) until killed or told a peer failed."""
    kv.init(0, np.zeros(3, np.float32))
    json.dump({"pid": os.getpid()}, out)
    out.flush()
    deadline = time.time() + float(sys.argv[3])
    while time.time() < deadline:
        kv.push(0, np.ones(3, np.float32))
        kv.pull(0)
        time.sleep(0.05)


def answer(kv, server: int, timeout_ms: int):
    """The next whole message from `server` (its pieces opened in a secure job), None if none
    came within `timeout_ms` of the last piece: what the link's own receive loop does."""
    frames = None
    while frames is None:
        if not kv.servers.transport.socks[server].poll(timeout_ms):
            return None
        frames = kv.servers.transport.take(server)
    return frames


def bad_requests(kv, out):
    """Malformed and wrong requests get ERROR replies; the server keeps serving."""
    kv.init("w", np.zeros(8, np.float32))
    kid, layout = kv.keys.layout("w")
    server = layout.parts[0][0]
    errors = []

    def ask(frames):  # sealed for the server in a secure job, as the transport does (put, take)
        kv.servers.transport.put(server, frames)
        frames = answer(kv, server, 5000)
        if frames is None:
            errors.append("no reply")
            return
        reply = P.decode(frames)
        errors.append((reply.meta or {}).get("message") if reply.type == P.Type.ERROR else reply.type.name)

    good = P.encode(P.Message(P.Type.PUSH, sender=kv.link.id, seq=10**6, key=kid, data=np.ones(8, np.float32)))
    ask([b"garbage"])
    ask([bytes(good[0])[:-1] + b"\xff", bytes(good[1])])  # count does not match the payload
    ask(P.encode(P.Message(P.Type.PUSH, sender=kv.link.id, seq=10**6 + 1, key=kid, data=np.ones(3, np.float32))))
    ask(P.encode(P.Message(P.Type.PULL, sender=kv.link.id, seq=10**6 + 2, key=987654)))
    ask(P.encode(P.Message(P.Type.PUSH, sender=999, seq=10**6 + 3, key=kid, data=np.ones(8, np.float32))))
    ask(P.encode(P.Message(P.Type.SET_OPTIMIZER, sender=kv.link.id, seq=10**6 + 4, meta={"optimizer": {"name": "x"}})))
    raw = bytearray(bytes(good[0]))
    raw[0] = 0  # bad magic
    ask([bytes(raw), bytes(good[1])])
    # PUSHPULL (small keys together): every key checked before any is pushed.
    kv.init("v", np.zeros(4, np.float32))
    vid = kv.keys.layout("v")[0]
    for seq, keys, n in [(10**6 + 5, [kid, 987654], 8), (10**6 + 6, [kid, kid], 16), (10**6 + 7, [kid], 9)]:
        ask(P.encode(P.Message(P.Type.PUSHPULL, sender=kv.link.id, seq=seq, meta={"keys": keys},
                               data=np.ones(n, np.float32))))
    if kv.keys.layout("v")[1].parts[0][0] == server:  # both keys on this server: a good one, answered with both values
        ask(P.encode(P.Message(P.Type.PUSHPULL, sender=kv.link.id, seq=10**6 + 8, meta={"keys": [vid, kid]},
                               data=np.zeros(12, np.float32))))
    else:
        errors.append("PUSHPULL")
    # Still serving: a proper push and pull.
    kv.push("w", np.full(8, 2.0, np.float32))
    json.dump({"errors": errors, "after": kv.pull("w").tolist()}, out)


def lossy(kv, out):
    """Drop the first PUSH on the wire, and deliver the second one twice (SGD lr=1: w -= g)."""
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    kv.init("w", np.zeros(4, np.float32))
    real_send = kv.servers.transport.put  # where the transport sends a request's frames (sealed there if secure)
    pushes = {"n": 0}

    def flaky(server, frames):
        header = P.HEADER.unpack(bytes(frames[0]))
        if header[2] == P.Type.PUSH:
            pushes["n"] += 1
            if pushes["n"] == 1:
                return None  # lost
            if pushes["n"] == 3:
                real_send(server, frames)  # duplicated
        return real_send(server, frames)

    kv.servers.transport.put = flaky
    t0 = time.time()
    kv.push("w", np.ones(4, np.float32))
    first = kv.pull("w").tolist()
    kv.push("w", np.ones(4, np.float32))
    second = kv.pull("w").tolist()
    json.dump({"first": first, "second": second, "seconds": time.time() - t0, "sends": pushes["n"]}, out)


SCENARIOS = {f.__name__: f for f in (semantics, updates, train, hang, bad_requests, lossy)}

def push_then_barrier(kv, out):
    """A push followed at once by a barrier is applied before any worker passes the barrier."""
    kv.init("w", np.zeros(1000, np.float32))
    kv.push("w", np.full(1000, kv.rank + 1.0, np.float32))
    kv.barrier()
    json.dump({"after": float(kv.pull("w")[0])}, out)


SCENARIOS["push_then_barrier"] = push_then_barrier


def seq_wrap(kv, out):
    """Requests numbered across the header's 32-bit wrap (a fused small key, a large one, a
    barrier's PINGs): every reply still finds its request."""
    from tfkv.ps.tracker import seqs

    kv.init(["a", "b", "t"], [np.zeros(3, np.float32), np.zeros(300_000, np.float32), np.zeros(1, np.float32)])
    # As after 2**32 requests: the numbers from the job's start have long left the servers'
    # duplicate window (4,096 requests per worker), which a jump of the counter must do by hand.
    for _ in range(4200):
        kv.push("t", np.ones(1, np.float32))
    kv.barrier()
    # Numbers only ever grow (mod 2**32), so a PING asking a silent server what it holds (sent
    # while the barrier waited, on a loaded machine) must be answered before the jump.
    while kv.servers.tracker.pending:
        kv.servers.settle()
    kv.servers.seq = seqs((1 << 32) - 4)
    got = []
    for _ in range(4):
        small, big = kv.pushpull(["a", "b"], [np.full(3, 1.0, np.float32), np.full(300_000, 1.0, np.float32)])
        got.append([float(small.min()), float(big.max())])
        kv.barrier()
    json.dump({"got": got, "next": next(kv.servers.seq)}, out)


SCENARIOS["seq_wrap"] = seq_wrap


def compressed(kv, out):
    """2-bit pushes across the wire: quantised sums, error feedback, chunked parts, bytes sent."""
    r = kv.rank
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.init(["a", "big"], [np.zeros(100, np.float32), np.zeros(3000, np.float32)])
    res = {"parts": len(kv.keys.layout("big")[1].parts)}
    pulls = []
    for _ in range(2):  # 0.3 per step: nothing is sent, then 0.5 once 0.6 has built up
        kv.push("a", np.full(100, 0.3, np.float32))
        pulls.append(float(kv.pull("a")[0]))
    res["a"] = pulls
    before = kv.push_bytes
    kv.push("big", np.full(3000, 0.5 * (r + 1), np.float32))  # worker 1 sends 0.5, keeps 0.5
    big = kv.pull("big")
    res["big"] = [float(big.min()), float(big.max())]
    res["compressed_bytes"] = kv.push_bytes - before
    kv.push("big", np.zeros(3000, np.float32))  # only the residual goes out
    big = kv.pull("big")
    res["big_residual"] = [float(big.min()), float(big.max())]
    kv.set_gradient_compression({"type": "none"})
    before = kv.push_bytes
    kv.push("big", np.full(3000, 0.25, np.float32))
    res["plain_bytes"] = kv.push_bytes - before
    res["plain"] = float(kv.pull("big")[0])
    json.dump(res, out)


def lossy_compressed(kv, out):
    """`lossy` with 2-bit pushes: a resend repeats the compressed frames, applied once."""
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    lossy(kv, out)


# 2bit_momentum's pushes: per worker and step, dyadic values (exact in float32 and in the test's
# oracle), summed by a machine's devices when pushed as two device values
MOMENTUM_GRADS = [[0.125, -0.375, 0.25, 0.625], [0.5, 0.25, -0.125, -0.75], [0.25, -0.5, 0.375, 0.125]]


def momentum_compressed(kv, out):
    """2bit_momentum across the wire (SGD lr=1, momentum 0.5 on the workers, threshold 0.5): a
    push before set_optimizer is refused; then 6 steps of MOMENTUM_GRADS, scaled by rank + 1,
    pushed as two device values; the weights pulled after each step and after a final barrier,
    and the optimizer state the servers hold; then each worker's residuals and velocities, and
    those worker 0 saves after share_feedback."""
    kv.set_gradient_compression({"type": "2bit_momentum", "threshold": 0.5})
    kv.init("w", np.zeros(4, np.float32))
    try:
        kv.push("w", np.zeros(4, np.float32))
        refused = None
    except RuntimeError as e:
        refused = str(e)
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0), momentum=0.5))
    seen = []
    for step in range(6):
        g = np.array(MOMENTUM_GRADS[step % 3], np.float32) * (kv.rank + 1)
        kv.push("w", [g * 0.5, g * 0.5])
        seen.append(kv.pull("w").tolist())
    kv.barrier()
    final = kv.pull("w").tolist()
    path = f"{out.name}.state.npz"
    kv.save_optimizer_states(path)
    with np.load(path) as f:
        state = sorted(f.files)
    own = {k: v.tolist() for k, v in kv.feedback_state().items()}
    kv.share_feedback()
    shared = None
    if kv.rank == 0:
        kv.save_optimizer_states(path)
        with np.load(path) as f:
            shared = {k: f[k].tolist() for k in f.files if k.startswith("worker_feedback/")}
    kv.barrier()
    json.dump({"refused": refused, "seen": seen, "final": final, "state": state, "rank": kv.rank, "own": own,
               "shared": shared}, out)


SCENARIOS["compressed"] = compressed
SCENARIOS["momentum_compressed"] = momentum_compressed
SCENARIOS["lossy_compressed"] = lossy_compressed


def int_sgd(kv, out):
    """Integer-valued pushes with SGD lr=1 on the servers, `steps` rounds over `nkeys` keys of
    `size` floats, `pause` seconds between steps: exact sums, so every update counted once shows."""
    steps, nkeys, size = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    pause = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    keys = list(range(nkeys))
    kv.init(keys, [np.full(size, 1000.0, np.float32) for _ in keys])
    kv.barrier()
    start = time.perf_counter()
    for step in range(steps):
        kv.push(keys, [np.full(size, float((kv.rank + 1) * (step % 5 + 1) + k % 3), np.float32) for k in keys])
        kv.pull(keys)
        if pause:
            time.sleep(pause)
    elapsed = time.perf_counter() - start
    kv.barrier()
    finals = kv.pull(keys)
    json.dump({"final": [[float(v.min()), float(v.max())] for v in finals], "steps": steps,
               "steps_per_s": steps / elapsed}, out)


SCENARIOS["int_sgd"] = int_sgd


def threaded_sgd(kv, out):
    """SGD with momentum and weight decay on the servers, over keys large enough for their threads
    (one split over the servers, one whole) and a small one: every worker's pulls, for the test's
    numpy oracle (worker r's pushes at step s are normal floats seeded 100 * s + r)."""
    sizes = {"big": 1_000_003, "mid": 300_001, "small": 100}
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=0.05), momentum=0.9, wd=1e-3))
    kv.init(list(sizes), [np.linspace(-1, 1, n, dtype=np.float32) for n in sizes.values()])
    for step in range(4):
        rng = np.random.default_rng(100 * step + kv.rank)
        got = kv.pushpull(list(sizes), [rng.normal(size=n).astype(np.float32) for n in sizes.values()])
    np.savez(out.name + ".npz", **dict(zip(sizes, got)))
    json.dump({"rank": kv.rank}, out)


SCENARIOS["threaded_sgd"] = threaded_sgd


def fusion(kv, out):
    """pushpull_async of many small keys and one large one, as a training step pushes them: the
    ZeroMQ messages each server gets (the transport's put: the requests in each) and the values
    (exact: SGD lr=1 on integers)."""
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    small = [f"s{i}" for i in range(200)]
    kv.init(small + ["big"], [np.full(100, 50.0, np.float32) for _ in small] + [np.zeros(300_000, np.float32)])
    kv.barrier()
    real_put, puts = kv.servers.transport.put, []

    def counting(server, frames):  # per ZeroMQ message: (type, keys) of each request in it
        requests = [P.decode(m, max_count=10**7) for m in P.split(frames)]
        # A PUSHPULL without a key list is one key's, named in its header.
        puts.append([[r.type.name + (" one" if r.type == P.Type.PUSHPULL and r.meta is None else ""),
                      len(r.meta["keys"]) if r.type == P.Type.PUSHPULL and r.meta else 1] for r in requests])
        return real_put(server, frames)

    kv.servers.transport.put = counting
    values = [np.full(100, kv.rank + 1.0, np.float32) for _ in small] + [np.ones(300_000, np.float32)]
    pending = []
    for k, v in zip(small + ["big"], values):  # one call per key, as DataParallel's hooks make them
        pending += kv.pushpull_async(k, [v])
    sent_before_wait = list(puts)
    got = kv.wait(pending)
    kv.servers.transport.put = real_put
    json.dump({"puts": puts, "before_wait": sent_before_wait, "servers": kv.servers.count,
               "small": sorted({float(got[k][0]) for k in small} | {float(got[k][-1]) for k in small}),
               "big": [float(got["big"].min()), float(got["big"].max())]}, out)


SCENARIOS["fusion"] = fusion


def pushpull(kv, out):
    """pushpull and pushpull_async + arrivals over small, server-split and chunked keys (lists
    of device values too), with and without 2-bit compression: sums, once per key."""
    r = kv.rank
    keys = ["small", "split", "chunked"]
    kv.init(keys, [np.zeros(3, np.float32), np.zeros(1000, np.float32), np.zeros((50, 40), np.float32)])
    res = {"parts": {k: len(kv.keys.layout(k)[1].parts) for k in keys}}
    small, split, chunked = kv.pushpull(keys, [np.full(3, r + 1.0, np.float32),
                                              [np.full(1000, 1.0, np.float32), np.full(1000, r, np.float32)],
                                              np.full((50, 40), 2.0 * r, np.float32)], priority=[0, 1, 2])
    res["pushpull"] = [small.tolist(), [float(split.min()), float(split.max())], list(chunked.shape),
                       [float(chunked.min()), float(chunked.max())]]
    pending = kv.pushpull_async(keys, [np.ones(3, np.float32), np.ones(1000, np.float32),
                                       np.ones((50, 40), np.float32)])
    got = list(kv.arrivals(pending))
    res["arrived"] = sorted(k for k, _ in got)
    res["async"] = {k: [float(v.min()), float(v.max())] for k, v in got}
    # Into the caller's arrays (MXNet's out=): the parts land in place, the others get a copy.
    # In a secure job each part's reply is opened straight into dest (the transport's land): counted.
    dest, copy = np.zeros((50, 40), np.float32), np.zeros((50, 40), np.float32)
    transport = kv.servers.transport
    landed, into = [], getattr(transport, "_into", None)
    transport._into = lambda *a: landed.append(into(*a)) or landed[-1]
    kv.pushpull("chunked", np.full((50, 40), r + 1.0, np.float32), out=[dest, copy])
    transport._into = into
    res["into_out"] = [float(dest.min()), float(dest.max()), bool(np.array_equal(dest, copy))]
    res["landed"] = sum(x is not None and np.shares_memory(x, dest) for x in landed)
    try:
        kv.pull("chunked", out=np.zeros((40, 50), np.float32))
    except ValueError as e:
        res["bad_out"] = str(e)
    res["after_bad_out"] = float(kv.pull("small")[0])  # nothing was sent for the refused pull
    # In place into values Pull cannot fill directly (float64, as np.ones makes; not contiguous):
    # cast into them on delivery, as LocalStore does.
    f64, strided = np.full(3, r + 1.0), np.zeros((50, 80), np.float32)[:, ::2]
    kv.pushpull(["small", "chunked"], [f64, strided])
    res["cast_in_place"] = [str(f64.dtype), f64.tolist(), float(strided.min()), float(strided.max())]
    res["after_cast"] = float(kv.pull("small")[0])  # the sync round was whole
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    res["compressed"] = float(kv.pushpull("chunked", np.full((50, 40), 0.5, np.float32)).max())
    res["landing_left"] = len(getattr(kv.servers.transport, "_landing", {}))  # every landed reply taken
    json.dump(res, out)


SCENARIOS["pushpull"] = pushpull


def half(kv, out):
    """float16 and bfloat16 keys over dist_sync (2 workers): exact sums in the key's dtype, kept
    on pull; a big half key split over both servers; pushpull of half keys among float32 ones
    (fused); bytes pushed; a float32 push refused; 2-bit compression of half gradients; SGD on
    the servers without and with multi_precision (the test computes the expected values)."""
    import ml_dtypes

    r, res = kv.rank, {}
    dts = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
    for name, dt in dts.items():
        kv.init([f"{name}", f"{name}_big"], [np.zeros(3, dt), np.zeros(1000, dt)])
    kv.init([f"f{i}" for i in range(4)], [np.zeros(5, np.float32) for _ in range(4)])
    res["parts"] = len(kv.keys.layout("float16_big")[1].parts)
    for name, dt in dts.items():
        before = kv.push_bytes
        # 0.25 + 0.5 per element from workers 0 and 1: exact in half
        kv.push([name, f"{name}_big"], [np.full(3, 0.25 * (r + 1), dt), np.full(1000, 0.25 * (r + 1), dt)])
        res[f"{name}_bytes"] = kv.push_bytes - before
        small, big = kv.pull([name, f"{name}_big"])
        res[name] = [str(small.dtype), small.astype(np.float32).tolist(), str(big.dtype),
                     float(big.astype(np.float32).min()), float(big.astype(np.float32).max())]
        try:
            kv.push(name, np.ones(3, np.float32))
        except ValueError as e:
            res[f"{name}_f32_push"] = str(e)
    # pushpull_async of half keys between float32 ones: the float32 keys fuse into a PUSHPULL
    keys = ["f0", "float16", "f1", "bfloat16", "f2", "f3"]
    values = [np.full(3, 1.0 + r, dts[k]) if k in dts else np.full(5, 1.0 + r, np.float32) for k in keys]
    got = kv.wait([p for k, v in zip(keys, values) for p in kv.pushpull_async(k, [v])])
    res["mixed"] = {k: [str(got[k].dtype), float(got[k].astype(np.float32)[0])] for k in keys}
    # 2-bit compression of half gradients: 0.3 then 0.3 (0.6 in the float32 residual: 0.5 sent)
    kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    for name, dt in dts.items():
        seen = []
        for _ in range(2):
            kv.push(name, np.full(3, 0.3, dt))
            got = kv.pull(name)
            seen.append([str(got.dtype), float(got.astype(np.float32)[0])])
        res[f"{name}_2bit"] = seen
    kv.set_gradient_compression({"type": "none"})
    g = {"float16": 2.0 ** -13, "bfloat16": 2.0 ** -10}  # a quarter of each dtype's resolution below 1
    for mp in (False, True):
        kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0), momentum=0.5, multi_precision=mp))
        for name, dt in dts.items():
            key = f"{name}_w{int(mp)}"
            kv.init(key, np.ones(2, dt))
            for _ in range(8):  # a step: push (the two workers' sum: g), pull
                kv.push(key, np.full(2, g[name] / 2, dt))
                got = kv.pull(key)
            res[key] = [str(got.dtype), got.astype(np.float32).tolist()]
    json.dump(res, out)


SCENARIOS["half"] = half


def ends_without_close(kv, out):
    """An MXNet-style script: it works, then ends without close() (MXNet's store leaves in its
    destructor); main() below skips the close for it."""
    kv.init("w", np.zeros(4, np.float32))
    kv.push("w", np.full(4, kv.rank + 1.0, np.float32))
    json.dump({"value": kv.pull("w").tolist()}, out)


def crash(kv, out):
    """Worker 1 raises (uncaught) a second after the job is up; worker 0 goes on pushing."""
    kv.init("w", np.zeros(4, np.float32))
    json.dump({"pid": os.getpid()}, out)
    out.flush()
    deadline = time.time() + 1.0
    while True:
        if kv.rank == 1 and time.time() > deadline:
            raise RuntimeError("boom in worker 1")
        kv.push("w", np.ones(4, np.float32))
        kv.pull("w")
        time.sleep(0.01)


def lost_reply(kv, out):
    """The first PULL reply is lost on the way in (as if a queue had dropped it), or with "all"
    every message from the server from then on (a server that heartbeats but never answers): the
    pull must raise, naming the server and the request, instead of waiting forever."""
    every = sys.argv[3:] == ["all"]
    kv.init("w", np.zeros(4, np.float32))
    real_recv = kv.servers.transport.take  # where the transport takes a server's message (opened there if secure)
    lost = {"n": 0}

    def lossy_recv(server):
        while True:
            frames = real_recv(server)  # zmq.Again when nothing (more) is there
            if frames is not None and (every or (P.HEADER.unpack(bytes(frames[0]))[2] == P.Type.PULL
                                                 and not lost["n"])):
                lost["n"] += 1
                continue  # never arrived
            return frames

    kv.servers.transport.take = lossy_recv
    json.dump({"pulling_at": time.time()}, out)
    out.flush()
    kv.pull("w")  # raises: the test reads the cause in this worker's output


SCENARIOS.update(ends_without_close=ends_without_close, crash=crash, lost_reply=lost_reply)

KEYS = {"int": [0, 5, -1, -2, -(1 << 40), (1 << 40) - 1, 1 << 40, (1 << 40) + 1, 1 << 48, (1 << 63) + 7],
        "str": ["w", "", "0", "00", "Aa", "BB", "w ", "W", "\u043a\u043b\u044e\u0447", "a" * 300]}


def keys(kv, out):
    """Keys of one kind (sys.argv[3]): negative and large ints, or strs that collide under
    common hashes ("Aa"/"BB"): key i holds i + 1 after init, and a push of rank + 10 * (i + 1)
    from each worker; a key of the other kind and a Python updater are refused."""
    kind = sys.argv[3]
    names = KEYS[kind]
    kv.init(names, [np.full(3, i + 1.0, np.float32) for i in range(len(names))])
    res = {"init": [float(v[0]) for v in kv.pull(names)]}
    kv.push(names, [np.full(3, kv.rank + 10.0 * (i + 1), np.float32) for i in range(len(names))])
    res["pushed"] = [float(v[0]) for v in kv.pull(names)]
    res["ids"] = len({kv.keys.id(k) for k in names})
    a, b = np.ones(3, np.float32), [np.ones(3, np.float32), np.full(3, 2.0, np.float32)]
    kv.pushpull(names[:2], [a, b])  # no out: MXNet writes the result into the values
    res["in_place"] = [a.tolist(), b[0].tolist(), b[1].tolist()]
    shaped = 1 << 50 if kind == "int" else "shaped"
    kv.init(shaped, np.zeros((2, 3), np.float32))
    flat = np.ones(6, np.float32)  # the key's size, flat: written through a view in its shape
    kv.pushpull(shaped, flat)
    res["flat"] = flat.tolist()
    try:
        kv.init("w" if kind == "int" else 7, np.zeros(3, np.float32))
    except ValueError as e:
        res["mixed"] = str(e)
    try:
        kv.set_updater(lambda key, received, stored: None)
    except ValueError as e:
        res["updater"] = str(e)
    res["capable"], res["dead"] = kv.is_capable("optimizer"), kv.num_dead_node(6)
    json.dump(res, out)


SCENARIOS["keys"] = keys


def busy_server(kv, out):
    """A server that goes silent (SIGSTOP, pid in argv[3]) for longer than the worker's heartbeat
    timeout with a long queue of this worker's pulls, then answers them one by one for longer
    than TFKV_REQUEST_TIMEOUT before it reaches the PING sent while it was silent."""
    import signal
    import threading

    kv.init("w", np.arange(200_000, dtype=np.float32))
    server = int(sys.argv[3])
    os.kill(server, signal.SIGSTOP)
    threading.Timer(float(sys.argv[4]), os.kill, (server, signal.SIGCONT)).start()
    dest = np.empty(200_000, np.float32)
    pulls = [kv.worker.pull("w", kv.keys.layout("w")[1], [dest]) for _ in range(int(sys.argv[5]))]
    t0 = time.monotonic()
    kv.wait(pulls)
    json.dump({"seconds": time.monotonic() - t0, "exact": bool(np.array_equal(dest, np.arange(200_000)))}, out)


SCENARIOS["busy_server"] = busy_server


def criterion_kinds(kv, out):
    """The dict-input, two-output model with BatchNorm and L2 (test_criterion.two_headed) on 2
    devices, 12 steps on this worker's own batch, in this job's store (TEST_KVSTORE) and then
    in one more job per entry of TFKV_TEST_MORE ("kind=port,..."), each a store of its own: one
    process (one TensorFlow start) for every dist_* type. Per type: the loss on the batch before
    and after, both copies' weights after the epoch-end BatchNorm averaging."""
    import keras

    sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))  # test_criterion's model, in tests/parallel
    from test_criterion import TWO_HEADED_LOSS, TWO_HEADED_METRICS, two_headed, two_headed_data
    from tfkv.parallel import devices
    from tfkv.parallel.criterion import Criterion
    from tfkv.parallel.data_parallel import DataParallel
    from tfkv.ps.cluster_env import ClusterEnv

    devs = devices.setup(["cpu:0", "cpu:1"])
    jobs = [(os.environ.get("TEST_KVSTORE", "dist_sync"), lambda: kv)]
    for entry in filter(None, os.environ.get("TFKV_TEST_MORE", "").split(",")):
        kind, port = entry.split("=")
        env = ClusterEnv.from_env({**os.environ, "DMLC_PS_ROOT_PORT": port})
        jobs.append((kind, lambda kind=kind, env=env: tfkv.store.create(kind, env=env)))
    results = {}
    for kind, make in jobs:
        store = make()
        keras.utils.set_random_seed(7)
        # Asynchronous servers apply each worker's push on its own, to weights the other worker's
        # pushes moved: momentum 0.9 on such stale, alternating gradients can make one worker's
        # batch loss rise for a dozen steps; plain SGD falls on both batches.
        momentum = 0.0 if "async" in kind else 0.9
        dp = DataParallel(two_headed, devs, store, optim.SGD(schedule=optim.Schedule(lr=0.05), momentum=momentum),
                          [16, 16], criterion=Criterion(TWO_HEADED_LOSS, TWO_HEADED_METRICS))
        x, y = two_headed_data(store.rank)
        before = dp.evaluate([(x, y)])
        for _ in range(12):
            dp.step(x, y)
        dp.sync_non_trainable()
        results[kind] = {"rank": store.rank, "before": before, "after": dp.evaluate([(x, y)]),
                         "train": dp.take_metrics()[0]}
        for i, replica in enumerate(dp.replicas):
            np.savez(f"{out.name}.{kind}.{i}.npz", *[v.numpy() for v in replica.trainable_variables])
            np.savez(f"{out.name}.{kind}.{i}.state.npz", *[v.numpy() for v in replica.non_trainable_variables])
        store.close()
    json.dump(results, out)


SCENARIOS["criterion_kinds"] = criterion_kinds


def overflow(kv, out):
    """mixed_float16 on 2 workers, 4 steps; at step 2 worker 1's batch overflows float16 (worker
    0's does not). Per step: the loss scale and the weights (the test compares the workers)."""
    import keras
    import tensorflow as tf

    from tfkv.models import mlp
    from tfkv.parallel import devices
    from tfkv.parallel.data_parallel import DataParallel
    from tfkv.parallel.precision import LossScale, set_policy

    devs = devices.setup(["cpu:0"])
    set_policy("mixed_float16")
    keras.utils.set_random_seed(7)
    scale = LossScale(initial=2.0**10)
    dp = DataParallel(lambda: mlp.build((8, 8, 1), 10, hidden=[16]), devs, kv,
                      optim.SGD(schedule=optim.Schedule(lr=0.1), momentum=0.9), [16],
                      update_on_kvstore=sys.argv[3] == "1", loss_scale=scale)
    rng = np.random.default_rng(kv.rank)
    res: dict = {"scale": []}
    for step in range(4):
        x = rng.normal(size=(16, 8, 8, 1)).astype(np.float32)
        if step == 1 and kv.rank == 1:
            x[0] = 1e5  # above float16's 65504
        dp.step(tf.constant(x), tf.constant(rng.integers(0, 10, 16).astype(np.int32)))
        res["scale"].append(float(scale.scale.numpy()))
        np.savez(f"{out.name}.{step}.npz", *dp.get_weights())
    json.dump(res, out)


SCENARIOS["overflow"] = overflow


def worker_left(kv, out):
    """Worker 0 pushes and pulls key 0 three times and closes; worker 1 then pushes and pulls a
    fourth time (argv[3] "push"; "pushpull": keys 0 and 1 fused into one request each time; or
    "barrier": a barrier instead of the fourth), either once worker 0 has left (argv[4] "after")
    or while worker 0 waits a while before closing ("before"). What worker 1's fourth raised (and
    when) goes to OUT, then it is raised again: a round or barrier that can never close."""
    what, when = sys.argv[3], sys.argv[4]
    kv.init([0, 1], [np.zeros(3, np.float32), np.zeros(3, np.float32)])

    def step():
        if what == "pushpull":
            kv.pushpull([0, 1], [np.ones(3, np.float32), np.ones(3, np.float32)])
        else:
            kv.push(0, np.ones(3, np.float32))
            kv.pull(0)

    for _ in range(3):
        step()
    if kv.rank == 0:
        if when == "before":
            time.sleep(2.0)
        json.dump({"closing_at": time.time()}, out)
        return  # main() closes the store
    if when == "after":
        time.sleep(2.0)
    acting_at = time.time()
    try:
        kv.barrier() if what == "barrier" else step()
    except Exception as e:
        json.dump({"error": f"{type(e).__name__}: {e}", "acting_at": acting_at, "at": time.time()}, out)
        raise
    json.dump({"error": None}, out)


SCENARIOS["worker_left"] = worker_left


def packed_compressed(kv, out):
    """Pushes packed in a compiled step (tfkv.parallel.packing) for 5 steps of SGD lr=1 (the
    momentum 0.5, on this worker, for 2bit_momentum), key "w" split over both servers; after 3
    steps the optimizer state saved, this worker's residuals zeroed, the state loaded again: the
    weights after each step, the residuals saved, restored and at the end, and a numpy push of
    the KVStore API afterwards."""
    import tensorflow as tf

    from tfkv.parallel.packing import Packing

    kind = os.environ["TEST_COMPRESSION"]
    kv.set_gradient_compression({"type": kind, "threshold": 0.25})
    kv.init(["w", "b"], [np.zeros(1003, np.float32), np.zeros(37, np.float32)])
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0), momentum=0.5 if kind == "2bit_momentum" else 0.0))
    packing = Packing.for_store(kv, ["w", "b"], "/device:CPU:0")
    step = tf.function(lambda gw, gb: [packing.pack("w", [gw]), packing.pack("b", [gb])])
    res = {"parts": len(kv.keys.layout("w")[1].parts), "seen": [], "packs_in_graph": packing is not None}
    rng = np.random.default_rng(7)
    for i in range(5):
        grads = [rng.normal(scale=0.3, size=n).astype(np.float32) for n in (1003, 37)]
        words = step(*grads)
        pulls = [p for k, w in zip(["w", "b"], words) for p in kv.pushpull_packed_async(k, [x.numpy() for x in w])]
        got = kv.wait(pulls)
        res["seen"].append([got["w"].tolist(), got["b"].tolist()])
        if i == 2:
            path = str(Path(out.name).with_suffix(".npz"))
            kv.save_optimizer_states(path)
            res["saved"] = {k: v.tolist() for k, v in np.load(path).items() if k.startswith("worker_feedback/")}
            packing.restore_feedback({})  # as a fresh job's: zero
            res["zeroed"] = float(np.abs(packing.residuals["w"].numpy()).sum())
            kv.load_optimizer_states(path)
            res["restored"] = packing.residuals["w"].numpy().tolist()
    res["final_residual"] = packing.residuals["w"].numpy().tolist()
    kv.push("b", np.full(37, 0.25, np.float32))  # the API's push: the numpy Sender, its own residual
    res["api_push"] = kv.pull("b").tolist()
    json.dump(res, out)


SCENARIOS["packed_compressed"] = packed_compressed


if __name__ == "__main__":
    scenario, path = sys.argv[1], sys.argv[2]
    kind = os.environ.get("TEST_KVSTORE", "dist_sync")
    devices = None
    if os.environ.get("TEST_SHOWN_EXCEPTION"):
        # What IPython/Jupyter leave after displaying an earlier cell's traceback: not this exit's.
        sys.last_value = RuntimeError("shown in an earlier cell")
    if scenario in ("train", "criterion_kinds", "overflow"):
        # TensorFlow's import holds the GIL for seconds while it loads its libraries; done after
        # the store joins the job, it starves the heartbeat thread past the tests' heartbeat timeout on
        # a loaded machine (CI saw this). tfkv-run imports TensorFlow before it creates a store.
        import tensorflow  # noqa: F401
    store = tfkv.store.create(kind)
    with open(path, "w") as f:
        SCENARIOS[scenario](store, f)
    if scenario != "ends_without_close":
        store.close()

