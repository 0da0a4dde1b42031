"""A registered member of a job that also sends malformed messages: `python fuzz_peer.py worker OUT
STEPS NKEYS SIZE` or `python fuzz_peer.py server OUT`.

As a worker it does dist_worker.py's int_sgd work (rank 1 of 2) and, between its steps, sends
every malformed request of `server_cases` to the server under its own registered id, waiting for
each answer; what was not refused with an ERROR is written to OUT. As a worker and as a server it
also sends `scheduler_cases` to the scheduler on its registered connection (the scheduler answers
nothing a test could wait for, so the test reads the scheduler's log). Every case is invalid by
construction (a wrong type, a value out of range, a broken frame), never a valid request with
other values: the job must end with exactly the values of a clean run.
"""

import json
import os
import sys
import threading
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfkv import optim  # noqa: E402
from tfkv.ps import protocol as P  # noqa: E402
from dist_worker import answer  # noqa: E402  (tests/workers is this script's directory)

T = P.Type


def frames(type_, sender, seq, meta=None, data=None, key=0, reply=False, raw_meta=None, rows=None):
    out = [bytes(f) for f in P.encode(P.Message(type_, sender=sender, seq=seq, key=key, data=data, reply=reply,
                                                meta={} if raw_meta is not None else meta,
                                                rows=None if rows is None else np.asarray(rows, np.int64)))]
    if raw_meta is not None:
        out[1] = raw_meta
    return out


def wrong_types(value, nullable=False):
    """JSON values of another type than `value`'s (so invalid wherever `value` is valid)."""
    pool = {"null": None, "bool": True, "int": 7, "float": 1.5, "str": "x", "list": [1], "dict": {"a": 1}}
    kind = ("bool" if isinstance(value, bool) else "int" if isinstance(value, int) else
            "float" if isinstance(value, float) else "str" if isinstance(value, str) else
            "list" if isinstance(value, list) else "dict")
    same = {kind} | ({"int"} if kind == "float" else set()) | ({"null"} if nullable else set())
    bad = [v for k, v in pool.items() if k not in same]
    if kind == "list" and value == []:
        bad.append(["x"])  # a list of the wrong items
    return bad


def mutations(base):
    """(path, meta) for base with one field given each value of the wrong type, one field
    missing, one unknown field added; nested objects field by field."""
    for name, value in base.items():
        nullable = value is None
        if isinstance(value, dict):
            for path, inner in mutations(value):
                yield f"{name}.{path}", {**base, name: inner}
        for bad in wrong_types(value if not nullable else 0.5, nullable):
            yield f"{name}={bad!r}", {**base, name: bad}
    yield "unknown field", {**base, "zz_unknown": 1}


def meta_cases(sender, next_seq):
    """Control requests with metadata that does not fit their schema."""
    bases = {
        T.CONFIGURE: {"sync": True},
        T.SET_COMPRESSION: {"type": "2bit", "threshold": 0.5},
        T.SET_STATE: {"names": [], "count": 0},
        T.FEEDBACK: {"rank": 0, "what": "residual"},
        T.REGISTER: {"role": "worker", "host": "127.0.0.1", "port": 1, "rank_hint": None, "pid": 1, "hostname": "h"},
        T.FAILED: {"node": "worker 9", "reason": "fuzz"},
    }
    # Fields a message may leave out (left out, the message would be valid: a FAILED without
    # `node` would end the job).
    optional = {(T.REGISTER, "rank_hint"), (T.FAILED, "node"), (T.SET_COMPRESSION, "threshold")}
    for type_, base in bases.items():
        for path, meta in mutations(base):
            yield f"{type_.name} {path}", frames(type_, sender, next_seq(), meta)
        for name in base:
            if (type_, name) not in optional:
                yield f"{type_.name} without {name}", frames(type_, sender, next_seq(),
                                                             {k: v for k, v in base.items() if k != name})
    o = optim.to_dict(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    for path, meta in mutations(o):  # the optimizer's fields, whatever tfkv.optim declares
        yield f"SET_OPTIMIZER {path}", frames(T.SET_OPTIMIZER, sender, next_seq(), {"optimizer": meta})
    for label, bad in [("lr null", {"schedule": {**o["schedule"], "lr": None}}),
                       ("cosine total 0", {"schedule": {**o["schedule"], "name": "cosine", "total": 0}}),
                       ("milestones 5", {"schedule": {**o["schedule"], "name": "step", "milestones": 5}}),
                       ("schedule warp", {"schedule": {**o["schedule"], "name": "warp"}}),
                       ("momentum x", {"momentum": "x"}), ("name lbfgs", {"name": "lbfgs"}),
                       # integers beyond float64: OverflowError, not ValueError, once killed a server
                       ("momentum 10**400", {"momentum": 10**400}),
                       ("lr 10**400", {"schedule": {**o["schedule"], "lr": 10**400}}),
                       ("milestones [10**400]", {"schedule": {**o["schedule"], "name": "step", "milestones": [10**400]}}),
                       ("cosine total 10**400", {"schedule": {**o["schedule"], "name": "cosine", "total": 10**400}}),
                       ("warmup 2**53", {"schedule": {**o["schedule"], "warmup": 2**53}})]:
        yield f"SET_OPTIMIZER {label}", frames(T.SET_OPTIMIZER, sender, next_seq(), {"optimizer": {**o, **bad}})
    adam = optim.to_dict(optim.Adam())
    for label, bad in [("beta1 x", {"beta1": "x"}), ("beta1 1", {"beta1": 1.0}), ("epsilon 0", {"epsilon": 0.0}),
                       ("beta2 -10**400", {"beta2": -10**400})]:
        yield f"SET_OPTIMIZER adam {label}", frames(T.SET_OPTIMIZER, sender, next_seq(), {"optimizer": {**adam, **bad}})
    yield "SET_COMPRESSION threshold 10**400", frames(T.SET_COMPRESSION, sender, next_seq(),
                                                      {"type": "2bit", "threshold": 10**400})
    # An error text longer than the ERROR schema admits (every unknown field named): the ERROR
    # must still reach the sender, cut, or the worker reports a lost reply instead of the cause.
    yield "SET_OPTIMIZER 2000 unknown fields", frames(T.SET_OPTIMIZER, sender, next_seq(),
                                                      {"optimizer": {**o, **{f"zz_{i:05d}_{'x' * 20}": 1
                                                                              for i in range(2000)}}})
    yield "SET_STATE count 2**53", frames(T.SET_STATE, sender, next_seq(), {"names": [], "count": 2**53})
    for label, raw in [("5000-digit int", b'{"sync":' + b"1" * 5000 + b"}"), ("NaN", b'{"sync":NaN}'),
                       ("deep nesting", b"[" * 50_000 + b"]" * 50_000), ("not an object", b"[true]"),
                       ("not UTF-8", b'{"sync":"\xff"}'), ("not JSON", b"{sync}")]:
        yield f"CONFIGURE meta {label}", frames(T.CONFIGURE, sender, next_seq(), raw_meta=raw)


def frame_cases(sender, next_seq, key, size):
    """Broken frames, headers that lie, metadata or payloads where none belongs."""
    good = frames(T.PULL, sender, next_seq(), key=key)
    head = bytearray(good[0])
    yield "garbage", [b"garbage"]
    yield "empty frame", [b""]
    for label, offset, value in [("bad magic", 0, b"\0\0"), ("version 9", 2, b"\x09"), ("type 200", 3, b"\xc8"),
                                 ("flags 0x40", 4, b"\x40"), ("dtype 7", 5, b"\x07")]:
        h = bytearray(head)
        h[offset:offset + len(value)] = value
        yield label, [bytes(h)]
    yield "an extra frame", [bytes(head), b"extra"]
    push = frames(T.PUSH, sender, next_seq(), data=np.ones(size, np.float32), key=key)
    yield "payload shorter than the header says", [push[0], push[1][:-4]]
    h = bytearray(push[0])
    h[20:28] = (2**40).to_bytes(8, "little")
    yield "count of 2**40", [bytes(h), push[1]]
    yield "2-bit INIT", [P.HEADER.pack(P.MAGIC, P.VERSION, int(T.INIT), P.FLAG_DATA, int(P.DType.TWOBIT), sender,
                                       next_seq(), key, 16), b"\0" * 4]
    for type_ in (T.PULL, T.PING, T.GET_STATE, T.INIT, T.PUSH):
        yield f"{type_.name} with metadata", frames(type_, sender, next_seq(), {"x": 1}, key=key,
                                                    data=np.ones(size, np.float32) if type_ in (T.INIT, T.PUSH) else None)
    for type_ in (T.CONFIGURE, T.PULL, T.PING):
        yield f"{type_.name} with a payload", frames(type_, sender, next_seq(), {"sync": True} if type_ == T.CONFIGURE
                                                     else None, data=np.ones(size, np.float32), key=key)
    yield "PUSH without a payload", frames(T.PUSH, sender, next_seq(), key=key)
    yield "a reply sent as a request", frames(T.PULL, sender, next_seq(), key=key, reply=True,
                                             data=np.ones(size, np.float32))
    yield "ERROR sent to a server", frames(T.ERROR, sender, next_seq(), {"message": "x"}, reply=True)
    yield "ADDRESS_BOOK sent to a server", frames(T.ADDRESS_BOOK, sender, next_seq(), {"x": 1})


def server_cases(sender, next_seq, key, size):
    """Everything a server must refuse from a registered worker, each answered with an ERROR."""
    yield from meta_cases(sender, next_seq)
    yield from frame_cases(sender, next_seq, key, size)
    # Every type a server does not serve, bare, as a request and as a reply.
    served = {T.CONFIGURE, T.SET_OPTIMIZER, T.SET_COMPRESSION, T.INIT, T.PUSH, T.PULL, T.GET_STATE, T.SET_STATE,
              T.PING}
    for type_ in T:
        for reply in (False, True):
            if type_ not in served or reply:
                yield f"bare {type_.name}{' reply' if reply else ''}", frames(type_, sender, next_seq(), reply=reply)
    # Well-formed, but not servable: the handlers refuse them.
    yield "PUSH of the wrong size", frames(T.PUSH, sender, next_seq(), data=np.ones(size + 1, np.float32), key=key)
    yield "PULL of an unknown key", frames(T.PULL, sender, next_seq(), key=987_654)
    yield "SET_STATE with other names", frames(T.SET_STATE, sender, next_seq(), {"names": ["mean"], "count": 1},
                                               data=np.ones(size, np.float32), key=key)
    yield "FEEDBACK of the wrong size", frames(T.FEEDBACK, sender, next_seq(), {"rank": 1, "what": "residual"},
                                               data=np.ones(size + 1, np.float32), key=key)
    yield "FEEDBACK never kept", frames(T.FEEDBACK, sender, next_seq(), {"rank": 0, "what": "velocity"}, key=key)
    yield "2-bit PUSH without compression", [P.HEADER.pack(P.MAGIC, P.VERSION, int(T.PUSH), P.FLAG_DATA,
                                                           int(P.DType.TWOBIT), sender, next_seq(), key, size),
                                             b"\0" * 4 * ((size + 15) // 16)]
    # Half precision (the job's keys are float32): another dtype than the key's, half payloads
    # one byte short, and half codes on messages that carry float32 only.
    for code, name in ((P.DType.FLOAT16, "float16"), (P.DType.BFLOAT16, "bfloat16")):
        half = np.ones(size, P.dtypes.BFLOAT16 if name == "bfloat16" else np.float16)
        yield f"{name} PUSH to a float32 key", frames(T.PUSH, sender, next_seq(), data=half, key=key)
        for type_, meta in ((T.PUSH, None), (T.INIT, None), (T.SET_STATE, {"names": [], "count": 0}),
                            (T.PUSHPULL, {"keys": [key]})):
            header = P.HEADER.pack(P.MAGIC, P.VERSION, int(type_), P.FLAG_DATA | (P.FLAG_META if meta else 0),
                                   int(code), sender, next_seq(), key, size)
            body = [json.dumps(meta).encode()] if meta else []
            yield f"{name} {type_.name} one byte short", [header, *body, b"\0" * (2 * size - 1)]
            if type_ in (T.SET_STATE, T.PUSHPULL):
                yield f"{name} {type_.name}", [header, *body, b"\0" * (2 * size)]
    yield from rows_cases(sender, next_seq, key, size)


TABLE_KEY = 1 << 39  # a row-sparse key the fuzzing worker makes on the server; no worker pushes it
TABLE_ROWS = 8


def table(size):
    return {"rows": TABLE_ROWS, "width": size, "shard": 0, "shards": 1, "sharding": "range", "init": "zeros",
            "scale": 0.0, "seed": 0}


def table_init(sender, seq, size):
    """The INIT that makes TABLE_KEY (valid: the server acknowledges it)."""
    return frames(T.INIT, sender, seq, {"table": table(size)}, key=TABLE_KEY)


def rows_cases(sender, next_seq, key, size):
    """Row-sparse requests (the rows frame) that no server may serve: to the dense `key`, to
    TABLE_KEY with ids, values or descriptions that do not fit it, and rows frames that lie."""
    ones = np.ones(size, np.float32)
    t = table(size)

    def rows(type_, ids, data=None, meta=None, k=TABLE_KEY):
        return frames(type_, sender, next_seq(), meta, data, key=k, rows=ids)

    yield "rows PUSH to a dense key", rows(T.PUSH, [0], ones, k=key)
    yield "rows PULL of a dense key", rows(T.PULL, [0], k=key)
    yield "rows PUSH, row id out of range", rows(T.PUSH, [TABLE_ROWS], ones)
    yield "rows PUSH, negative row id", rows(T.PUSH, [1, -1], np.ones(2 * size, np.float32))
    yield "rows PULL, row id 2**62", rows(T.PULL, [0, 1 << 62])
    yield "rows PUSH, two rows of values for one id", rows(T.PUSH, [0], np.ones(2 * size, np.float32))
    yield "rows PUSH, rows too narrow", rows(T.PUSH, [0, 1], np.ones(2 * size - 2, np.float32))
    yield "rows PUSH without values", rows(T.PUSH, [0])
    yield "rows PULL of an unknown key", rows(T.PULL, [0], k=TABLE_KEY + 7)
    yield "dense PULL of a table", frames(T.PULL, sender, next_seq(), key=TABLE_KEY)
    yield "dense PUSH to a table", frames(T.PUSH, sender, next_seq(), data=np.ones(TABLE_ROWS * size, np.float32),
                                          key=TABLE_KEY)
    yield "one-key PUSHPULL of a table", frames(T.PUSHPULL, sender, next_seq(), key=TABLE_KEY,
                                                data=np.ones(TABLE_ROWS * size, np.float32))
    yield "GET_STATE of a table without rows", frames(T.GET_STATE, sender, next_seq(), key=TABLE_KEY)
    yield "GET_STATE of rows out of range", rows(T.GET_STATE, [TABLE_ROWS])
    yield "SET_STATE of rows with other names", rows(T.SET_STATE, [0], ones, {"names": ["mean"], "count": 1})
    yield "INIT of rows out of range", rows(T.INIT, [TABLE_ROWS], ones)
    yield "INIT of rows to a dense key", rows(T.INIT, [0], ones, k=key)
    yield "INIT of a table with values but no rows", frames(T.INIT, sender, next_seq(), {"table": t}, ones,
                                                            key=TABLE_KEY)
    yield "INIT of a table of another shape", frames(T.INIT, sender, next_seq(), {"table": {**t, "rows": 9}},
                                                     key=TABLE_KEY)
    yield "INIT of a table over a dense key", frames(T.INIT, sender, next_seq(), {"table": t}, key=key)
    yield "INIT of a table larger than memory", frames(T.INIT, sender, next_seq(), {"table": {
        **t, "rows": 1 << 40, "width": 1 << 20}}, key=TABLE_KEY + 1)
    yield "INIT of a table's shard 1 of 1", frames(T.INIT, sender, next_seq(), {"table": {**t, "shard": 1}},
                                                   key=TABLE_KEY + 1)
    yield "INIT of nothing", frames(T.INIT, sender, next_seq(), key=TABLE_KEY + 1)
    for path, meta in mutations(t):
        yield f"INIT table {path}", frames(T.INIT, sender, next_seq(), {"table": meta}, key=TABLE_KEY + 1)
    for name in t:
        yield f"INIT table without {name}", frames(T.INIT, sender, next_seq(),
                                                   {"table": {k: v for k, v in t.items() if k != name}},
                                                   key=TABLE_KEY + 1)

    def head(type_, flags, count=0, dtype=P.DType.NONE):
        return P.HEADER.pack(P.MAGIC, P.VERSION, int(type_), flags, int(dtype), sender, next_seq(), TABLE_KEY, count)

    rd = P.FLAG_ROWS | P.FLAG_DATA
    yield "rows frame of 12 bytes", [head(T.PULL, P.FLAG_ROWS), b"\0" * 12]
    yield "rows frame missing", [head(T.PULL, P.FLAG_ROWS)]
    yield "values not a whole number of rows", [head(T.PUSH, rd, 3, P.DType.FLOAT32), b"\0" * 16, b"\0" * 12]
    yield "values for no rows", [head(T.PUSH, rd, 1, P.DType.FLOAT32), b"", b"\0" * 4]
    yield "half-precision rows", [head(T.PUSH, rd, size, P.DType.FLOAT16), b"\0" * 8, b"\0" * 2 * size]
    yield "2-bit rows", [head(T.PUSH, rd, 16, P.DType.TWOBIT), b"\0" * 8, b"\0" * 4]
    yield "rows on a PING", [head(T.PING, P.FLAG_ROWS), b"\0" * 8]
    yield "rows on a PUSHPULL", [head(T.PUSHPULL, rd, size, P.DType.FLOAT32), b"\0" * 8, b"\0" * 4 * size]
    yield "rows on a reply", [head(T.PULL, P.FLAG_ROWS | P.FLAG_REPLY), b"\0" * 8]


def scheduler_cases(sender):
    """Everything the scheduler must refuse from a registered node (it ignores REGISTER once the
    cluster formed, so those test the schema, not the scheduler's state)."""
    seq = iter(range(10**6, 2 * 10**6))
    yield from meta_cases(sender, lambda: next(seq))
    yield from frame_cases(sender, lambda: next(seq), 0, 4)
    for type_ in (T.HEARTBEAT, T.BARRIER, T.DONE):
        yield f"{type_.name} with metadata", frames(type_, sender, next(seq), {"x": 1})
    yield "FAILED without a reason", frames(T.FAILED, sender, next(seq), {"node": "worker 0"})


def fuzz_scheduler(link):
    """Send scheduler_cases on this node's own, registered connection to the scheduler (through
    the link's thread, which owns the socket). Returns how many were queued."""
    real_send = link._send
    link._send = lambda m: link._sock.send_multipart(m) if isinstance(m, list) else real_send(m)
    cases = list(scheduler_cases(link.id))
    for _, f in cases:
        link._outbox.put(f)
    return len(cases)


def worker(out_path, steps, nkeys, size):
    import tfkv.store

    kv = tfkv.store.create("dist_sync")
    kv.set_optimizer(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    keys = list(range(nkeys))
    kv.init(keys, [np.full(size, 1000.0, np.float32) for _ in keys])
    kv.barrier()
    sent_to_scheduler = fuzz_scheduler(kv.link)
    kid = kv.keys.layout(0)[0]
    server = kv.keys.layout(0)[1].parts[0][0]
    with kv.servers.lock:  # a table no worker pushes, for rows_cases to aim at (a valid request, acknowledged)
        kv.servers.transport.put(server, table_init(kv.link.id, next(kv.servers.seq), size))
        made = answer(kv, server, 10_000)
        assert made is not None and P.decode(made).type == T.ACK, made
    cases = list(server_cases(kv.link.id, lambda: next(kv.servers.seq), kid, size))
    per_step = -(-len(cases) // steps)
    not_refused, answered = [], 0
    for step in range(steps):
        kv.push(keys, [np.full(size, float((kv.rank + 1) * (step % 5 + 1) + k % 3), np.float32) for k in keys])
        kv.pull(keys)
        with kv.servers.lock:  # nothing is outstanding after a pull: each answer is the case's own
            for label, f in cases[step * per_step:(step + 1) * per_step]:
                kv.servers.transport.put(server, f)  # sealed in a secure job: the server's decoder is the target
                frames = answer(kv, server, 10_000)
                if frames is None:
                    not_refused.append(f"{label}: no answer")
                    continue
                # The replies to one message come back together: frames after a whole message are
                # the next message of a batch ("an extra frame": a PULL, answered, then junk, refused).
                replies = [P.decode(m) for m in P.split(frames)]
                answered += 1
                if replies[-1].type != T.ERROR:
                    not_refused.append(f"{label}: answered {', '.join(r.type.name for r in replies)}")
    kv.barrier()
    finals = kv.pull(keys)
    with open(out_path, "w") as f:
        json.dump({"final": [[float(v.min()), float(v.max())] for v in finals], "cases": len(cases),
                   "answered": answered, "not_refused": not_refused, "to_scheduler": sent_to_scheduler}, f)
    kv.close()


def server(out_path):
    from tfkv.ps.cluster_env import ClusterEnv
    from tfkv.ps.server import Server

    srv = Server(ClusterEnv.from_env())
    sent = fuzz_scheduler(srv.link)
    with open(out_path, "w") as f:
        json.dump({"to_scheduler": sent}, f)
    sys.exit(srv.run())


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2], *map(int, sys.argv[3:6]))
    else:
        server(sys.argv[2])
