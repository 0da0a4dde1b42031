"""Row-sparse keys on the parameter server, in-process (no sockets): the protocol's rows frame,
where rows are placed (tfkv.ps.parts.RowPlacement), a server's shard made from a table's
description, its synchronous and asynchronous rounds checked against numpy closed forms, and
the refusals of requests that do not fit (each an ERROR naming the key; the server serves on)."""

import json

import numpy as np
import pytest

from tfkv import optim
from tfkv.ps import channel
from tfkv.ps import protocol as P
from tfkv.ps.parts import RowPlacement, row_chunks
from tfkv.ps.rows import BLOCK, Shard, merge
from tfkv.ps.updater import NumpyUpdater

from test_channel import _pair
from test_server import _held, _server

W = 3


def _table(rows, shard=0, shards=1, sharding="range", init="zeros", scale=0.05, seed=0, width=W):
    return {"rows": rows, "width": width, "shard": shard, "shards": shards, "sharding": sharding, "init": init,
            "scale": scale, "seed": seed}


def _rows_msg(type_, sender, seq, key, ids, data=None, meta=None):
    return P.Message(type_, sender=sender, seq=seq, key=key, rows=np.asarray(ids, np.int64), meta=meta,
                     data=None if data is None else np.asarray(data, np.float32).reshape(-1), want_ack=False)


def _replies(srv):
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append((identity, msg))
    return sent


# -- the rows frame ----------------------------------------------------------------------------

def test_a_rows_frame_travels_before_the_payload_and_round_trips():
    msg = _rows_msg(P.Type.PUSH, 3, 7, 11, [5, 1, 5], np.arange(9))
    frames = P.encode(msg)
    assert len(frames) == 3 == P.frames_of(P.FLAG_ROWS | P.FLAG_DATA)
    got = P.decode([bytes(f) for f in frames], max_count=100)
    assert got.rows.dtype == np.int64 and got.rows.tolist() == [5, 1, 5]
    assert got.data.tolist() == list(range(9)) and got.key == 11
    empty = P.decode([bytes(f) for f in P.encode(_rows_msg(P.Type.PUSH, 3, 8, 11, [], np.zeros(0)))])
    assert empty.rows.size == 0 and empty.data.size == 0  # a synchronous job's empty push
    pull = P.decode([bytes(f) for f in P.encode(_rows_msg(P.Type.PULL, 3, 9, 11, [2, 0]))])
    assert pull.rows.tolist() == [2, 0] and pull.data is None
    # several messages in one ZeroMQ message split at the right frames
    batch = [bytes(f) for m in (msg, _rows_msg(P.Type.PULL, 3, 9, 11, [2])) for f in P.encode(m)]
    assert [len(m) for m in P.split(batch)] == [3, 2]


def _raw(type_, flags, rows_bytes, data_bytes=None, count=0, dtype=P.DType.FLOAT32, meta=None):
    head = P.HEADER.pack(P.MAGIC, P.VERSION, int(type_), flags, int(dtype) if data_bytes is not None else 0, 1, 1,
                         4, count)
    return [head, *([meta] if meta else []), rows_bytes, *([data_bytes] if data_bytes is not None else [])]


@pytest.mark.parametrize("frames,message", [
    (_raw(P.Type.PULL, P.FLAG_ROWS, b"\0" * 12), "not a whole number of int64 ids"),
    (_raw(P.Type.PUSH, P.FLAG_ROWS | P.FLAG_DATA, b"\0" * 16, b"\0" * 12, 3), "3 values cannot be 2 rows"),
    (_raw(P.Type.PUSH, P.FLAG_ROWS | P.FLAG_DATA, b"", b"\0" * 4, 1), "1 values cannot be 0 rows"),
    (_raw(P.Type.PUSH, P.FLAG_ROWS | P.FLAG_DATA, b"\0" * 8, b"\0" * 4, 2, P.DType.BFLOAT16), "are float32 or float16"),
    (_raw(P.Type.PING, P.FLAG_ROWS, b"\0" * 8), "row ids are only for"),
    (_raw(P.Type.PUSHPULL, P.FLAG_ROWS | P.FLAG_DATA, b"\0" * 8, b"\0" * 4, 1), "row ids are only for"),
    (_raw(P.Type.PULL, P.FLAG_ROWS | P.FLAG_REPLY, b"\0" * 8), "row ids are only for"),
    (_raw(P.Type.PULL, P.FLAG_ROWS, b"\0" * 8 * 101), "101 row ids exceed the limit of 100"),
    (_raw(P.Type.PULL, P.FLAG_ROWS, b"\0" * 8)[:1], "1 frames, flags and count say 2"),
    (_raw(P.Type.PUSH, P.FLAG_ROWS | P.FLAG_DATA, b"\0" * 8, b"\0" * 4, 1)[:2], "2 frames, flags and count say 3"),
    (_raw(P.Type.PUSH, P.FLAG_ROWS | P.FLAG_DATA, b"\0" * 8, b"\0" * 8, 1), "payload is 8 bytes"),
])
def test_malformed_rows_frames_are_refused(frames, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.decode(frames, max_count=100)


def test_init_of_a_table_is_checked_against_its_schema():
    ok = P.Message(P.Type.INIT, sender=1, key=4, meta={"table": _table(10, init="uniform")})
    assert P.decode([bytes(f) for f in P.encode(ok)]).meta["table"]["rows"] == 10
    for bad in ({"rows": 0}, {"sharding": "modulo"}, {"init": "ones"}, {"rows": 1 << 41}, {"seed": -1},
                {"scale": float("nan")}, {"width": "3"}):
        frames = [bytes(f) for f in P.encode(P.Message(P.Type.INIT, sender=1, key=4, meta={"table": _table(10)}))]
        frames[1] = json.dumps({"table": {**_table(10), **bad}}).encode()
        with pytest.raises(P.ProtocolError):
            P.decode(frames)


@pytest.mark.parametrize("size", [0, 40, 3 << 20])
def test_rows_frames_are_sealed_and_opened_by_the_secure_channel(size):
    """The channel counts a message's frames from its flags (the payload is the last one, where
    a pull may land): a rows frame of any size, before a payload of any size, arrives whole."""
    a, b = _pair()  # a worker's session and the server's, after the real handshake
    ids = np.arange(size // 4, dtype=np.int64)
    frames = [f for m in (_rows_msg(P.Type.PUSH, 1, 1, 4, ids, np.ones(size // 4)),
                          P.Message(P.Type.PULL, sender=1, seq=2, key=5)) for f in P.encode(m)]
    landed = []
    got = None
    for sealed in a.seal(frames):
        got = b.open(sealed, into=lambda head, frame, n: landed.append(frame))
    push, pull = [P.decode(m) for m in P.split(got)]
    assert push.rows.tolist() == ids.tolist() and push.data.size == size // 4 and pull.key == 5
    assert landed == [2]  # asked where the payload (frame 2, after the rows) goes; not the rows


# -- placement ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sharding", ["range", "hash"])
@pytest.mark.parametrize("rows,servers", [(10, 3), (2, 3), (7, 1), (1000, 4)])
def test_every_row_has_exactly_one_place(sharding, rows, servers):
    p = RowPlacement(rows, servers, sharding)
    ids = np.arange(rows)
    seen = np.zeros(rows, int)
    for s, positions in enumerate(p.split(ids)):
        local = p.local(s, ids[positions])
        assert len(local) == p.shard_rows(s) and sorted(local.tolist()) == list(range(p.shard_rows(s)))
        assert p.global_ids(s, local).tolist() == ids[positions].tolist()
        seen[positions] += 1
    assert (seen == 1).all()
    if sharding == "range":  # contiguous ranges, as documented
        assert p.server_of(ids).tolist() == sorted(p.server_of(ids).tolist())
    else:
        assert p.server_of(ids).tolist() == (ids % servers).tolist()


def test_a_row_not_on_a_shard_is_named():
    p = RowPlacement(10, 2, "hash")
    with pytest.raises(ValueError, match="row id 3 is not a row of shard 0 of a table of 10 rows"):
        p.local(0, np.array([2, 3]))
    with pytest.raises(ValueError, match="row id 10 is not"):
        RowPlacement(10, 2).local(1, np.array([10]))
    with pytest.raises(ValueError, match="TFKV_ROW_SHARDING.*'modulo'"):
        RowPlacement(10, 2, "modulo")


def test_row_chunks_fit_the_chunk_size():
    assert row_chunks(10, 4, 48) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert row_chunks(3, 100, 8) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # at least a row each
    assert row_chunks(10, 4, 48, per_row=2) == [slice(a, min(10, a + 1)) for a in range(10)]


def test_a_drawn_table_is_the_same_however_it_is_sharded():
    rows = BLOCK + 1000  # more than one block
    whole = Shard(7, _table(rows, init="uniform", scale=0.5, seed=3)).value
    assert whole.shape == (rows, W) and np.abs(whole).max() <= 0.5 and whole.std() > 0.2
    for sharding in ("range", "hash"):
        p = RowPlacement(rows, 3, sharding)
        for s in range(3):
            shard = Shard(7, _table(rows, s, 3, sharding, "uniform", 0.5, 3))
            np.testing.assert_array_equal(shard.value, whole[p.global_ids(s, np.arange(shard.rows))])
    other = Shard(8, _table(rows, init="uniform", scale=0.5, seed=3)).value  # another key, another table
    assert not np.allclose(other, whole)
    normal = Shard(7, _table(rows, init="normal", scale=2.0)).value
    assert abs(normal.std() - 2.0) < 0.05


def test_merge_sums_duplicates_per_row():
    ids, rows = merge(np.array([4, 1, 4, 0]), np.arange(8, dtype=np.float32).reshape(4, 2))
    assert ids.tolist() == [0, 1, 4] and rows.tolist() == [[6, 7], [2, 3], [4 + 0, 5 + 1]]


# -- the server --------------------------------------------------------------------------------

def _init(srv, key, table, sender=9, seq=1):
    sent = _replies(srv)
    srv.serve(b"w", P.Message(P.Type.INIT, sender=sender, seq=seq, key=key, meta={"table": table}))
    assert [m.type for _, m in sent] == [P.Type.ACK], [m.meta for _, m in sent]


def test_a_sync_round_sums_rows_and_sgd_updates_only_those_rows_lazily():
    srv = _server(2)
    opt = optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.9, wd=0.1)
    srv.rounds.updater = NumpyUpdater(opt)
    _init(srv, 4, _table(6, init="normal", scale=1.0))
    w0 = srv.rounds.shards[4].value.copy()
    sent = _replies(srv)
    g9 = np.ones((2, W), np.float32)
    srv.serve(b"w9", _rows_msg(P.Type.PUSH, 9, 2, 4, [1, 3], g9))
    srv.serve(b"w9", _rows_msg(P.Type.PULL, 9, 3, 4, [3, 1, 5]))  # waits for the round
    assert sent == [] and _held(srv, 9) == 1
    srv.serve(b"w10", _rows_msg(P.Type.PUSH, 10, 2, 4, [3, 3], np.full((2, W), 2.0)))
    # numpy closed form: only rows 1 and 3 move; v = -lr*(g + wd*w); w += v
    want = w0.copy()
    g = np.zeros_like(w0)
    g[1], g[3] = 1.0, 1.0 + 4.0
    v = -0.5 * (g + 0.1 * w0)
    want[[1, 3]] += v[[1, 3]]
    np.testing.assert_allclose(srv.rounds.shards[4].value, want, rtol=1e-6)
    ((identity, reply),) = sent
    assert identity == b"w9" and reply.type == P.Type.PULL and reply.seq == 3
    np.testing.assert_allclose(reply.data.reshape(3, W), want[[3, 1, 5]], rtol=1e-6)
    (mom,) = srv.rounds.updater.state[4]
    assert np.count_nonzero(mom.any(axis=1)) == 2  # state only for the rows pushed
    # a second round: momentum carried per row, row 5 (never pushed) still untouched
    for sender in (9, 10):
        srv.serve(b"w", _rows_msg(P.Type.PUSH, sender, 4, 4, [1], np.ones((1, W))))
    v1 = 0.9 * v[1] - 0.5 * (2.0 + 0.1 * want[1])
    np.testing.assert_allclose(srv.rounds.shards[4].value[1], want[1] + v1, rtol=1e-5)
    np.testing.assert_array_equal(srv.rounds.shards[4].value[5], w0[5])
    assert srv.rounds.updater.count[4] == 2


def test_adam_updates_rows_lazily_with_a_count_per_key():
    opt = optim.Adam(schedule=optim.Schedule(lr=0.01))
    up = NumpyUpdater(opt)
    table = np.ones((4, W), np.float32)
    up.update_rows(4, table, np.array([0, 2]), np.full((2, W), 0.5, np.float32))
    up.update_rows(4, table, np.array([2]), np.full((1, W), -1.0, np.float32))
    # closed form per row, t = the key's count
    def adam(w, grads):
        m = v = 0.0
        for t, (g, counted) in enumerate(grads):
            if not counted:
                continue
            m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
            lr = 0.01 * np.sqrt(1 - 0.999 ** (t + 1)) / (1 - 0.9 ** (t + 1))
            w = w - lr * m / (np.sqrt(v) + 1e-8)
        return w
    np.testing.assert_allclose(table[0], adam(1.0, [(0.5, True), (0, False)]), rtol=1e-6)
    np.testing.assert_allclose(table[2], adam(1.0, [(0.5, True), (-1.0, True)]), rtol=1e-6)
    np.testing.assert_array_equal(table[[1, 3]], 1.0)
    assert up.count[4] == 2


def test_without_an_optimizer_the_shard_becomes_the_summed_rows_and_empty_pushes_close_the_round():
    srv = _server(2)
    _init(srv, 4, _table(6, shard=1, shards=2, sharding="hash", init="uniform"))  # global rows 1, 3, 5
    sent = _replies(srv)
    srv.serve(b"w9", _rows_msg(P.Type.PUSH, 9, 2, 4, [5, 1], [[1, 1, 1], [2, 2, 2]]))
    srv.serve(b"w10", _rows_msg(P.Type.PUSH, 10, 2, 4, [], np.zeros(0)))  # none of its rows here
    assert srv.rounds.shards[4].value.tolist() == [[2] * 3, [0] * 3, [1] * 3]
    assert sent == [] and not srv.rounds.open[4].pushed


def test_async_applies_each_push_with_duplicates_summed():
    srv = _server(2)
    srv.rounds.sync = False
    srv.rounds.updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    _init(srv, 4, _table(5))
    srv.serve(b"w9", _rows_msg(P.Type.PUSH, 9, 2, 4, [2, 2, 0], np.ones((3, W))))
    assert srv.rounds.shards[4].value[:, 0].tolist() == [-1, 0, -2, 0, 0]
    sent = _replies(srv)
    srv.serve(b"w10", _rows_msg(P.Type.PULL, 10, 3, 4, [2]))
    assert sent[0][1].data.tolist() == [-2.0] * W


def test_init_rows_state_by_rows_and_a_second_table_init():
    srv = _server(1)
    srv.rounds.updater = NumpyUpdater(optim.SGD(momentum=0.5))
    table = _table(8, shard=1, shards=2)  # range: rows 4..7
    _init(srv, 4, table)
    _init(srv, 4, table, seq=5)  # the first init wins, the same description is acknowledged
    sent = _replies(srv)
    srv.serve(b"w", _rows_msg(P.Type.INIT, 9, 6, 4, [7, 4], [[7] * W, [4] * W]))
    assert srv.rounds.shards[4].value[:, 0].tolist() == [4, 0, 0, 7]
    srv.serve(b"w", _rows_msg(P.Type.SET_STATE, 9, 7, 4, [5, 6], np.arange(6), meta={"names": ["momentum"],
                                                                                      "count": 9}))
    srv.serve(b"w", _rows_msg(P.Type.GET_STATE, 9, 8, 4, [6, 4]))
    *acks, state = [m for _, m in sent]
    assert [a.type for a in acks] == [P.Type.ACK] * 2 and state.meta == {"names": ["momentum"], "count": 9}
    assert state.data.tolist() == [3, 4, 5, 0, 0, 0]


def _refused(srv, msg, *texts):
    sent = _replies(srv)
    srv.serve(b"w", msg)
    (_, reply), = sent
    assert reply.type == P.Type.ERROR, reply
    for text in texts:
        assert text in reply.meta["message"], reply.meta["message"]


def test_requests_that_do_not_fit_a_table_are_refused_naming_the_key_and_the_server_serves_on():
    srv = _server(1)
    srv.rounds.updater = NumpyUpdater(optim.SGD())
    _init(srv, 4, _table(6, shard=0, shards=2))  # rows 0..2
    srv.rounds.values[5] = np.zeros(3, np.float32)
    push = lambda ids, data: _rows_msg(P.Type.PUSH, 9, 2, 4, ids, data)  # noqa: E731
    _refused(srv, push([3], np.ones(W)), "key 4: row id 3 is not a row of shard 0")
    _refused(srv, push([-1], np.ones(W)), "key 4: row id -1")
    _refused(srv, push([0, 1], np.ones(W)), "key 4: 3 values for 2 rows of 3")
    _refused(srv, _rows_msg(P.Type.PULL, 9, 2, 4, [1 << 50]), "key 4: row id 1125899906842624")
    _refused(srv, P.Message(P.Type.PULL, sender=9, seq=3, key=4), "key 4 is row-sparse")
    _refused(srv, P.Message(P.Type.PUSH, sender=9, seq=3, key=4, data=np.ones(18, np.float32)), "key 4 is row-sparse")
    _refused(srv, P.Message(P.Type.PUSHPULL, sender=9, seq=3, key=4, data=np.ones(18, np.float32)),
             "key 4 is row-sparse")
    _refused(srv, P.Message(P.Type.PUSHPULL, sender=9, seq=3, meta={"keys": [5, 4]}, data=np.ones(21, np.float32)),
             "key 4 is row-sparse")
    _refused(srv, P.Message(P.Type.GET_STATE, sender=9, seq=3, key=4), "key 4 is row-sparse")
    _refused(srv, _rows_msg(P.Type.PUSH, 9, 3, 5, [0], np.ones(W)), "key 5 is dense")
    _refused(srv, _rows_msg(P.Type.PULL, 9, 3, 77, [0]), "key 77 is not initialised")
    _refused(srv, P.Message(P.Type.INIT, sender=9, seq=3, key=4, meta={"table": _table(7)}), "key 4 is already a table")
    _refused(srv, P.Message(P.Type.INIT, sender=9, seq=3, key=5, meta={"table": _table(7)}), "key 5 is a dense key")
    _refused(srv, P.Message(P.Type.INIT, sender=9, seq=3, key=4, data=np.ones(3, np.float32)), "key 4 is row-sparse")
    _refused(srv, P.Message(P.Type.INIT, sender=9, seq=3, key=8, meta={"table": _table(1 << 40, width=1 << 20)}),
             "key 8: a shard of", "more than this server's memory")
    _refused(srv, P.Message(P.Type.INIT, sender=9, seq=3, key=8, meta={"table": _table(4, shard=3, shards=2)}),
             "key 8: shard 3")
    # served on: a good push and pull of the same key
    sent = _replies(srv)
    srv.serve(b"w", push([2], np.ones(W)))
    srv.serve(b"w", _rows_msg(P.Type.PULL, 9, 5, 4, [2]))
    assert sent[-1][1].data.tolist() == [np.float32(-0.1)] * W  # SGD's default lr 0.1


def test_every_row_sparse_fuzz_case_is_refused_with_an_error_and_the_server_serves_on():
    """tests/workers/fuzz_peer.py's rows_cases (which a registered worker of a real job sends in
    tests/ps/test_fuzz_registered.py), each through the server's own decoding and dispatch."""
    import fuzz_peer  # tests/workers, on pytest's pythonpath

    srv = _server(2)
    srv.rounds.updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    size, sender = 4, 9
    srv.rounds.values[0] = np.zeros(size, np.float32)
    _init(srv, fuzz_peer.TABLE_KEY, fuzz_peer.table(size))
    seqs = iter(range(100, 10_000))
    cases = list(fuzz_peer.rows_cases(sender, lambda: next(seqs), 0, size))
    assert len(cases) > 60
    for label, frames in cases:
        sent = _replies(srv)
        srv.handle(b"w", frames)
        assert [m.type for _, m in sent] == [P.Type.ERROR], (label, [m.meta for _, m in sent])
    assert set(srv.rounds.shards) == {fuzz_peer.TABLE_KEY} and not srv.rounds.open[fuzz_peer.TABLE_KEY].pushed
    assert not srv.rounds.shards[fuzz_peer.TABLE_KEY].value.any()


def test_a_tampered_rows_frame_fails_authentication_and_nothing_is_parsed():
    """An on-path change to a sealed row id (say, to aim a push at another row) is caught by the
    tag before the protocol reads any frame."""
    a, b = _pair()
    frames = P.encode(_rows_msg(P.Type.PUSH, 1, 1, 4, [3, 5], np.ones(2 * W)))
    (sealed,) = list(a.seal(frames))
    forged = [bytes(f) for f in sealed]
    rows_part = len(forged) - 2  # the envelope, then header, rows and payload each sealed
    changed = bytearray(forged[rows_part])
    changed[0] ^= 1
    forged[rows_part] = bytes(changed)
    with pytest.raises(channel.Refused, match="fails authentication"):
        b.open(forged)
