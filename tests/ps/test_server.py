"""The server's handling of a synchronous round in-process (no sockets, no scheduler): where the sum
goes, and that it stays exact; and, on a real ROUTER socket, that a peer gone before its answer
leaves the server serving."""

import collections
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import zmq

from tfkv import keys as job_keys
from tfkv import optim
from tfkv.ps import handshake
from tfkv.ps import protocol as P
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.round_types import Round
from tfkv.ps.server import Server
from tfkv.ps.transport.server import SecureServerTransport, ServerTransport
from tfkv.ps.updater import NumpyUpdater


def _server(workers: int) -> Server:
    """A server's dispatch and rounds without sockets or a scheduler: its replies go to
    `srv.transport.reply` (a test sets it to record them)."""
    srv = object.__new__(Server)
    srv.env = ClusterEnv("server", "127.0.0.1", 1, 1, workers)
    srv.link = SimpleNamespace(name="server 0", left=collections.deque())
    srv.transport = SimpleNamespace(reply=lambda identity, msg: None, flush=lambda: None,
                                    repeated=ServerTransport(None, 1 << 20).repeated)  # the dedup is the transport's
    srv._serving(set(range(9, 9 + workers)))
    return srv


def _held(srv, sender):
    """What a PING from `sender` answers: how many of its requests the server holds."""
    reply, got = srv.transport.reply, []
    srv.transport.reply = lambda identity, msg: got.append(msg.meta["held"])
    srv.serve(b"ping", P.Message(P.Type.PING, sender=sender, seq=99))
    srv.transport.reply = reply
    return got[0]


def _push(sender: int, buffer) -> P.Message:
    return P.Message(P.Type.PUSH, sender=sender, key=3, data=np.frombuffer(buffer, np.float32), want_ack=False)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_round_sums_into_the_first_received_buffer(workers):
    """The pushes of a round add into the first one's received buffer (it is the round's own until
    the round closes): no fresh array per round, which for a 16 MiB key was an allocation and its
    page faults on every round. The value is exact, and no other push's buffer is touched."""
    srv = _server(workers)
    srv.rounds.values[3] = np.zeros(5, np.float32)
    pushed = [bytearray(np.full(5, w + 1, np.float32).tobytes()) for w in range(workers)]
    for w, buffer in enumerate(pushed):
        srv.serve(b"id", _push(9 + w, buffer))
    assert np.array_equal(srv.rounds.values[3], np.full(5, workers * (workers + 1) / 2, np.float32))
    assert np.shares_memory(srv.rounds.values[3], np.frombuffer(pushed[0], np.float32))
    assert all(bytes(b) == np.full(5, w + 1, np.float32).tobytes() for w, b in enumerate(pushed) if w)


def test_a_read_only_first_push_is_summed_into_a_fresh_array():
    srv = _server(2)
    srv.rounds.values[3] = np.zeros(5, np.float32)
    first = np.ones(5, np.float32).tobytes()  # bytes: read-only
    srv.serve(b"id", _push(9, first))
    srv.serve(b"id", _push(10, bytearray(np.full(5, 2, np.float32).tobytes())))
    assert np.array_equal(srv.rounds.values[3], np.full(5, 3, np.float32))
    assert first == np.ones(5, np.float32).tobytes()


def test_a_one_key_pushpull_is_its_push_then_its_pull():
    """A PUSHPULL without a key list (the header's key, its payload the last frame): served as a
    PUSH then a PULL, so a dist_sync round still waits for every worker, the answer is a PULL reply
    of the new value under the request's seq, and a second PUSHPULL before the round closes is held
    whole for the next round (its pull answered with that round's value, not this one's)."""
    srv = _server(2)
    srv.rounds.values[3] = np.zeros(5, np.float32)
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append((identity, msg))

    def pushpull(sender, value, seq):
        srv.serve(b"w%d" % sender, P.Message(P.Type.PUSHPULL, sender=sender, seq=seq, key=3,
                                                   data=np.full(5, value, np.float32)))

    pushpull(9, 1.0, 1)
    pushpull(9, 10.0, 2)  # worker 9 again before worker 10 pushed: held for the next round
    assert sent == [] and _held(srv, 9) == 2
    pushpull(10, 2.0, 1)
    replies = [(identity, msg.type, msg.seq, msg.data.tolist()) for identity, msg in sent]
    assert replies == [(b"w9", P.Type.PULL, 1, [3.0] * 5), (b"w10", P.Type.PULL, 1, [3.0] * 5)]
    assert srv.rounds.open[3].pushed == {9} and _held(srv, 9) == 1  # the held push opened the next round
    pushpull(10, 20.0, 2)
    assert [(msg.seq, msg.data.tolist()) for identity, msg in sent[2:]] == [(2, [30.0] * 5), (2, [30.0] * 5)]  # no optimizer: the sum
    assert _held(srv, 9) == 0 and _held(srv, 10) == 0


@pytest.mark.parametrize("kind", ["rows", "dense"])
def test_a_pull_behind_its_senders_held_push_answers_with_the_round_that_push_went_into(kind):
    """Issue 40, point 1. Worker 9 pushes round 1, then (its last row pull skipped this server, so
    it never waited for round 1 here) pushes round 2 while round 1 is open, and pulls: the push is
    held for round 2, and the pull with it. It is answered once round 2 closed, with round 2's
    value (it was answered with round 1's: one round old); `w += 2 * g` in numpy is the oracle."""
    from tfkv.ps.rows import Shard
    from tfkv.ps.updater import NumpyUpdater
    from tfkv import optim

    srv = _server(2)
    srv.rounds.updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=-2.0)))  # w += 2 * g
    if kind == "rows":
        srv.rounds.shards[3] = Shard(3, {"rows": 2, "width": 3, "shard": 0, "shards": 1, "sharding": "range",
                                         "init": "zeros", "scale": 0.0, "seed": 0})
        rows = {"rows": np.array([0, 1], np.int64)}
    else:
        srv.rounds.values[3] = np.zeros(6, np.float32)
        rows = {}
    sent = _replying(srv)

    def push(sender, seq, value):
        srv.serve(b"w%d" % sender, P.Message(P.Type.PUSH, sender=sender, seq=seq, key=3, want_ack=False,
                                             data=np.full(6, value, np.float32), **rows))

    push(9, 1, 1.0)
    push(9, 2, 10.0)  # round 1 still open here: held for round 2
    srv.serve(b"w9", P.Message(P.Type.PULL, sender=9, seq=3, key=3, **rows))
    assert sent == [] and _held(srv, 9) == 1  # the pull, held behind the push
    push(10, 1, 2.0)  # round 1 closes: w = 2 * 3; worker 9's push opens round 2, its pull waits for it
    assert sent == [] and _held(srv, 9) == 1
    push(10, 2, 20.0)  # round 2 closes: w = 6 + 2 * 30
    w = 2 * (1.0 + 2.0) + 2 * (10.0 + 20.0)
    assert sent == [(b"w9", P.Type.PULL, 3, [w] * 6)] and _held(srv, 9) == 0


def test_a_held_request_that_is_malformed_gets_its_own_error_and_the_rest_is_served():
    """A one-key PUSHPULL held for the next round is checked when its round opens: a wrong size
    is answered with an ERROR to its own sender, under its own seq, and the requests released
    with it, and the pull of the push that closed the round, are served as ever."""
    srv = _server(2)
    srv.rounds.values[3] = np.zeros(5, np.float32)
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append((identity, msg.type, msg.seq))

    def pushpull(sender, seq, size):
        srv.serve(b"w%d" % sender, P.Message(P.Type.PUSHPULL, sender=sender, seq=seq, key=3,
                                             data=np.ones(size, np.float32)))

    pushpull(9, 1, 5)
    pushpull(9, 2, 4)  # held, then found malformed
    pushpull(9, 3, 5)  # held behind it
    assert sent == [] and _held(srv, 9) == 3
    pushpull(10, 1, 5)
    assert sent == [(b"w9", P.Type.PULL, 1), (b"w9", P.Type.ERROR, 2), (b"w10", P.Type.PULL, 1)]
    assert srv.rounds.open[3].pushed == {9} and _held(srv, 9) == 1 and _held(srv, 10) == 0


def _fused(srv, sender, seq, keys, values, sent):
    data = np.concatenate([np.full(3, v, np.float32) for v in values])
    srv.serve(b"w%d" % sender, P.Message(P.Type.PUSHPULL, sender=sender, seq=seq, meta={"keys": list(keys)},
                                               data=data))
    return data


def _replying(srv):
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append((identity, msg.type, msg.seq,
                                                   None if msg.data is None else msg.data.tolist()))
    return sent


def test_a_fused_key_set_pushed_alike_by_every_worker_is_one_round_answered_from_one_buffer():
    """Every worker stages the same small keys into the same PUSHPULL: the server sums the
    payloads as one buffer (no per-key round), answers each worker with that buffer (no
    concatenation), and each key's value is its slice of it, exactly the sum."""
    srv = _server(2)
    for k in (3, 4, 5):
        srv.rounds.values[k] = np.zeros(3, np.float32)
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append((identity, msg))
    first = _fused(srv, 9, 1, (3, 4, 5), (1, 2, 3), sent)
    assert sent == [] and _held(srv, 9) == 3 and not any(srv.rounds.open[k].pushed for k in (3, 4, 5))
    _fused(srv, 10, 1, (3, 4, 5), (10, 20, 30), sent)
    assert [(i, m.type, m.seq) for i, m in sent] == [(b"w9", P.Type.PUSHPULL, 1), (b"w10", P.Type.PUSHPULL, 1)]
    assert sent[0][1].data.tolist() == [11] * 3 + [22] * 3 + [33] * 3
    assert all(np.shares_memory(m.data, first) for _, m in sent)  # the first push's buffer, summed into
    assert [srv.rounds.values[k].tolist() for k in (3, 4, 5)] == [[11] * 3, [22] * 3, [33] * 3]
    assert _held(srv, 9) == _held(srv, 10) == 0 and not srv.rounds.grouped


def test_a_fused_key_set_with_an_optimizer_updates_each_key_as_its_own_round_would():
    from tfkv import optim
    from tfkv.ps.updater import NumpyUpdater

    results = []
    for fused in (True, False):
        srv = _server(2)
        srv.rounds.updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=0.5), momentum=0.9))
        for k in (3, 4):
            srv.rounds.values[k] = np.ones(3, np.float32)
        sent = _replying(srv)
        for step in range(3):
            for w in (9, 10):
                if fused:
                    _fused(srv, w, step + 1, (3, 4), (w + step, 2 * w), sent)
                else:
                    for k, v in ((3, w + step), (4, 2 * w)):
                        srv.serve(b"w%d" % w, P.Message(P.Type.PUSHPULL, sender=w, seq=10 * step + k, key=k,
                                                              data=np.full(3, v, np.float32)))
        results.append(([srv.rounds.values[k].tolist() for k in (3, 4)], sent[-1][3]))
    (fused_values, fused_reply), (own_values, _) = results
    assert fused_values == own_values
    assert fused_reply == own_values[0] + own_values[1]


def test_a_fused_key_set_pushed_twice_before_its_round_closes_is_held_whole_for_the_next_round():
    srv = _server(2)
    for k in (3, 4):
        srv.rounds.values[k] = np.zeros(3, np.float32)
    sent = _replying(srv)
    _fused(srv, 9, 1, (3, 4), (1, 2), sent)
    _fused(srv, 9, 2, (3, 4), (100, 200), sent)  # again before worker 10 pushed: the next round's
    assert sent == [] and _held(srv, 9) == 4
    _fused(srv, 10, 1, (3, 4), (10, 20), sent)
    assert [(i, seq, data) for i, _, seq, data in sent] == [(b"w9", 1, [11] * 3 + [22] * 3),
                                                            (b"w10", 1, [11] * 3 + [22] * 3)]
    assert _held(srv, 9) == 2  # the held one opened the next round
    _fused(srv, 10, 2, (3, 4), (1000, 2000), sent)
    assert [(seq, data) for _, _, seq, data in sent[2:]] == [(2, [1100] * 3 + [2200] * 3)] * 2
    assert _held(srv, 9) == _held(srv, 10) == 0


def _left(srv, wid):
    """What the server's loop does when the scheduler reports worker `wid` finished (LEFT)."""
    srv.link.left.append({"id": wid, "node": f"worker {wid - 9}"})
    srv._workers_left()


@pytest.mark.parametrize("request_kind", ["push+pull", "one-key pushpull", "fused", "held"])
def test_a_round_a_finished_worker_never_pushed_into_fails_every_request_waiting_on_it(request_kind):
    """Three rounds of key 3 by both workers, then worker 9 pushes a fourth (as a PUSH and a
    parked PULL, a one-key PUSHPULL, or a fused PUSHPULL of keys 3 and 4; "held": a fifth push
    held behind it too) and worker 10 leaves: every request waiting on that round is answered at
    once with one ERROR naming the key, the round and worker 10, none is left held, and a later
    push into a round it can never join is refused the same way."""
    srv = _server(2)
    for k in (3, 4):
        srv.rounds.values[k] = np.zeros(3, np.float32)
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append((identity, msg))
    fused = request_kind == "fused"

    def pushpull(w, seq):
        if fused:
            _fused(srv, w, seq, (3, 4), (1, 1), sent)
        else:
            srv.serve(b"w%d" % w, P.Message(P.Type.PUSHPULL, sender=w, seq=seq, key=3,
                                                  data=np.ones(3, np.float32)))

    for step in range(3):
        for w in (9, 10):
            pushpull(w, step + 1)
    sent.clear()
    if request_kind in ("fused", "one-key pushpull"):
        pushpull(9, 4)
    else:
        srv.serve(b"w9", P.Message(P.Type.PUSH, sender=9, seq=4, key=3, data=np.ones(3, np.float32),
                                           want_ack=False))
        srv.serve(b"w9", P.Message(P.Type.PULL, sender=9, seq=5, key=3))
        if request_kind == "held":
            pushpull(9, 6)
    assert sent == []  # waiting for worker 10
    _left(srv, 10)
    why = ("round 4 can never close: worker 1 left the job (it finished and closed its store) before "
           "pushing to it")
    key = "key 3 (and the 1 keys pushed with it)" if fused else "key 3"
    seqs = {"push+pull": [5], "one-key pushpull": [4], "fused": [4], "held": [5, 6]}[request_kind]
    assert [(i, m.type, m.seq, m.meta["message"]) for i, m in sent] == [
        (b"w9", P.Type.ERROR, seq, f"{key}: {why}") for seq in seqs]
    assert _held(srv, 9) == 0 and not srv.rounds.grouped and not srv.rounds.open.get(3, Round()).pushed
    sent.clear()
    srv.serve(b"w9", P.Message(P.Type.PUSH, sender=9, seq=7, key=3, data=np.ones(3, np.float32),
                                           want_ack=False))
    assert [(m.type, m.seq, m.meta["message"]) for _, m in sent] == [(P.Type.ERROR, 7, f"key 3: {why}")]


def test_a_round_the_finished_worker_pushed_into_still_closes():
    srv = _server(2)
    srv.rounds.values[3] = np.zeros(3, np.float32)
    sent = _replying(srv)
    srv.serve(b"w10", _push(10, np.ones(3, np.float32).tobytes()))  # worker 10's last push, then it leaves
    _left(srv, 10)
    srv.serve(b"w9", _push(9, np.ones(3, np.float32).tobytes()))
    assert sent == [] and srv.rounds.values[3].tolist() == [2.0] * 3 and not srv.rounds.open[3].pushed


def test_the_pushes_a_finished_worker_left_held_still_open_and_close_their_rounds():
    """Issue 40, point 1: worker 9 pushed rounds 1 to 3 here without waiting for round 1 (its pulls
    went to other servers), then finished: its held pushes are its last rounds, not rounds it owes.
    Each joins its round when it opens, and worker 10's pushes close rounds 1 to 3 (they were
    refused: "round 2 can never close: worker 0 left", and the job failed)."""
    srv = _server(2)
    srv.rounds.values[3] = np.zeros(3, np.float32)
    sent = _replying(srv)
    for w, steps in ((9, (1, 2, 3)), (10, (1,))):
        for v in steps:
            srv.serve(b"w%d" % w, _push(w, np.full(3, v, np.float32).tobytes()))
        if w == 9:
            _left(srv, 9)
    assert sent == [] and srv.rounds.open[3].pushed == {9}  # worker 9's round-2 push opened round 2
    for v in (2, 3):
        srv.serve(b"w10", _push(10, np.full(3, v, np.float32).tobytes()))
    assert sent == [] and srv.rounds.values[3].tolist() == [6.0] * 3 and not srv.rounds.open[3].pushed
    assert srv.rounds.closed[3] == 3


@pytest.mark.parametrize("other", ["push", "pull", "one-key pushpull", "another key set"])
def test_a_request_that_sees_a_fused_key_set_apart_gets_what_the_keys_own_rounds_give(other):
    """Worker 9 pushed keys 3 and 4 fused; worker 10 then reaches key 3 on its own (a PUSH, a PULL,
    a one-key PUSHPULL) or in another key set: the open group round becomes the keys' own rounds,
    and every answer is what the key-by-key server gives (tested against it)."""
    answers = []
    for grouped in (True, False):
        srv = _server(2)
        for k in (3, 4, 5):
            srv.rounds.values[k] = np.full(3, 7, np.float32)
        if not grouped:
            srv.rounds._as_group = lambda *a: None  # the key-by-key server: the reference
        sent = _replying(srv)
        _fused(srv, 9, 1, (3, 4), (1, 2), sent)
        if other == "push":
            srv.serve(b"w10", P.Message(P.Type.PUSH, sender=10, seq=1, key=3, data=np.full(3, 10, np.float32)))
            srv.serve(b"w9", P.Message(P.Type.PULL, sender=9, seq=2, key=3))
            srv.serve(b"w10", P.Message(P.Type.PUSHPULL, sender=10, seq=2, key=4, data=np.full(3, 20, np.float32)))
        elif other == "pull":
            srv.serve(b"w10", P.Message(P.Type.PULL, sender=10, seq=1, key=3))  # not pushed: today's value
            srv.serve(b"w9", P.Message(P.Type.PULL, sender=9, seq=2, key=4))  # pushed: waits for the round
            _fused(srv, 10, 2, (3, 4), (10, 20), sent)
        elif other == "one-key pushpull":
            for k, v in ((3, 10), (4, 20)):
                srv.serve(b"w10", P.Message(P.Type.PUSHPULL, sender=10, seq=k, key=k, data=np.full(3, v, np.float32)))
        else:
            _fused(srv, 10, 1, (3, 4, 5), (10, 20, 30), sent)
            srv.serve(b"w9", P.Message(P.Type.PUSH, sender=9, seq=2, key=5, data=np.full(3, 3, np.float32)))
        answers.append((sent, [srv.rounds.values[k].tolist() for k in (3, 4, 5)], {w: _held(srv, w) for w in sorted(srv.workers)}))
    assert answers[0] == answers[1]
    assert answers[0][0] and all(v == 0 for v in answers[0][2].values())


def _serve_steps(grouped, workers, order, optimizer):
    """Every worker pushes and pulls keys 3..6 each step, in its own requests (fused sets, one-key
    PUSHPULLs, a PUSH then a PULL), the server taking the workers' requests in the interleaving
    `order` (worker indices; what is left after it, round robin): a worker may run steps ahead of
    the others, so pushes arrive again before their round closed. The replies each (worker, seq)
    got, the values at the end, and what is left held."""
    from tfkv import optim
    from tfkv.ps.updater import NumpyUpdater

    count = len(workers[0])
    srv = _server(count)
    if optimizer:
        srv.rounds.updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=0.25), momentum=0.5))
    if not grouped:
        srv.rounds._as_group = lambda *a: None  # the key-by-key server: the reference
    for k in range(3, 7):
        srv.rounds.values[k] = np.zeros(2, np.float32)
    got = {}
    srv.transport.reply = lambda identity, msg: got.setdefault((identity, msg.seq), []).append(
        None if msg.data is None else msg.data.tolist())
    queues = {w: [(step, req) for step in range(len(workers)) for req in workers[step][w]] for w in range(count)}
    rest = [w for _ in range(4 * len(workers)) for w in range(count)]
    for n, w in enumerate(list(order) + rest):
        if not queues[w]:
            continue
        step, (kind, keys) = queues[w].pop(0)
        sender, seq, ident = 9 + w, 2 * n + 1, b"w%d" % w
        value = lambda k: np.full(2, (w + 1) * 10 + k + step, np.float32)  # noqa: E731
        if kind == "fused":
            srv.serve(ident, P.Message(P.Type.PUSHPULL, sender=sender, seq=seq, meta={"keys": list(keys)},
                                             data=np.concatenate([value(k) for k in keys])))
        elif kind == "one":
            srv.serve(ident, P.Message(P.Type.PUSHPULL, sender=sender, seq=seq, key=keys[0], data=value(keys[0])))
        else:
            srv.serve(ident, P.Message(P.Type.PUSH, sender=sender, seq=seq, key=keys[0], data=value(keys[0]),
                                         want_ack=False))
            srv.serve(ident, P.Message(P.Type.PULL, sender=sender, seq=seq + 1, key=keys[0]))
    assert not any(queues.values())
    return got, [srv.rounds.values[k].tolist() for k in range(3, 7)], {w: _held(srv, w) for w in sorted(srv.workers)}


from hypothesis import given, settings, strategies as st  # noqa: E402

_KEYS = (3, 4, 5, 6)


@st.composite
def _requests(draw):
    """One worker's requests of one step: every key once, in fused sets or alone."""
    keys = draw(st.permutations(_KEYS))
    reqs, i = [], 0
    while i < len(keys):
        n = draw(st.integers(1, len(keys) - i))
        kind = "fused" if n > 1 else draw(st.sampled_from(["one", "push+pull"]))
        reqs.append((kind, tuple(keys[i:i + n])))
        i += n
    return reqs


@st.composite
def _plans(draw):
    """Each worker's requests per step (a worker often keeps its way of fusing from one step to
    the next, as a training loop does), and an interleaving of the workers."""
    count, steps = draw(st.integers(2, 3)), draw(st.integers(1, 3))
    workers = [[draw(_requests()) for _ in range(count)]]
    for _ in range(steps - 1):
        workers.append([reqs if draw(st.booleans()) else draw(_requests()) for reqs in workers[-1]])
    return workers, draw(st.lists(st.integers(0, count - 1), max_size=40))


@settings(max_examples=300, deadline=None)
@given(_plans(), st.booleans())
def test_group_rounds_answer_every_interleaving_as_the_key_by_key_server(plan, optimizer):
    """Workers that fuse the same keys alike, differently or not at all, in any interleaving
    (also a worker steps ahead, pushing keys again before their round closed): the server with
    group rounds sends every reply and ends with every value as serving each key on its own does,
    with nothing left held. Every pull answers after its own push: a pushpull pushed again early
    gets the next round's value, whether its keys went as a group or one by one."""
    workers, order = plan
    grouped = _serve_steps(True, workers, order, optimizer)
    assert grouped == _serve_steps(False, workers, order, optimizer)
    assert all(v == 0 for v in grouped[2].values())
    replies = grouped[0]  # one answer for each request (a PUSH goes unanswered, its PULL answered)
    assert len(replies) == sum(len(reqs) for step in workers for reqs in step)
    assert all(len(r) == 1 for r in replies.values())


def test_a_peer_gone_before_its_answer_leaves_the_server_serving(caplog):
    """The server's socket is ROUTER_MANDATORY, so a send to a connection that closed raises
    EHOSTUNREACH: a peer holding the job's key that sends a HELLO and disconnects before the
    WELCOME goes out, or a worker gone before its reply, must cost a log line, not the server's
    loop (the HELLO's WELCOME used to go out unguarded). An identity the socket never had is
    what ROUTER sees for such a connection."""
    psk = handshake.psk(job_keys.new_keys().secret)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.linger = 0
    secure = SecureServerTransport(sock, 1 << 20, handshake.Acceptor(psk))
    plain = ServerTransport(sock, 1 << 20)
    gone = b"\x00gone"
    try:
        hello = [zmq.Frame(f) for f in handshake.Hello(psk).message]  # as received
        with caplog.at_level(logging.WARNING, logger="tfkv"):
            assert secure._open(gone, hello) is None
            assert gone not in secure.acceptor.sessions and not secure.refused  # nothing kept for a peer that left
            secure.acceptor.hello(gone, handshake.Hello(psk).message)  # a session, then its peer gone
            secure.reply(gone, P.Message(P.Type.ACK, seq=5, reply=True))
            secure.flush()
            plain.reply(gone, P.Message(P.Type.ACK, seq=6, reply=True))  # a plain job's reply
            plain.flush()
    finally:
        sock.close()
    assert "a WELCOME not sent" in caplog.text
    assert "ACK reply (request 5) not sent" in caplog.text and "ACK reply (request 6) not sent" in caplog.text


def test_a_worker_on_a_new_connection_leaves_nothing_kept_for_its_old_one():
    """ZeroMQ made a worker's lost connection again (a new identity) and the worker made a new
    handshake on it: its first request there makes the server forget the old connection's session
    (each lost connection used to keep one, with its replay window, for the rest of the job). Another
    worker's connection is kept."""
    psk = handshake.psk(job_keys.new_keys().secret)
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.linger = 0
    srv = _server(2)
    srv.transport = secure = SecureServerTransport(sock, 1 << 20, handshake.Acceptor(psk))
    try:
        for sender, identity in ((9, b"old"), (10, b"other"), (9, b"new")):
            hello = handshake.Hello(psk)
            session = hello.welcome(secure.acceptor.hello(identity, hello.message))
            ping = next(session.seal(P.encode(P.Message(P.Type.PING, sender=sender, seq=1))))
            assert srv.handle(identity, secure.acceptor.open(identity, ping))
    finally:
        sock.close()
    assert sorted(secure.acceptor.sessions) == [b"new", b"other"]


def test_the_transport_tells_a_resent_change_from_a_new_one_and_the_server_applies_it_once():
    """A worker's transport resends a request under PS_RESEND with its sequence number: the
    server's transport tells it apart (per sender, changes only), and the server acknowledges it
    again without applying it twice."""
    seen = ServerTransport(None, 1 << 20)
    push = P.Message(P.Type.PUSH, sender=9, seq=5, key=3, data=np.ones(2, np.float32), want_ack=True)
    assert not seen.repeated(push) and seen.repeated(push)
    assert not seen.repeated(P.Message(P.Type.PUSH, sender=10, seq=5, key=3))  # another worker's request 5
    pull = P.Message(P.Type.PULL, sender=9, seq=6, key=3)
    assert not seen.repeated(pull) and not seen.repeated(pull)  # a pull changes nothing: answered again
    srv = _server(1)
    srv.rounds.sync = False
    srv.rounds.updater = NumpyUpdater(optim.SGD(schedule=optim.Schedule(lr=1.0)))
    srv.rounds.values[3] = np.zeros(2, np.float32)
    sent = []
    srv.transport.reply = lambda identity, msg: sent.append(msg.type)
    frames = [bytes(f) for f in P.encode(push)]
    assert srv.handle(b"w", frames) and srv.handle(b"w", frames)
    assert sent == [P.Type.ACK, P.Type.ACK]
    np.testing.assert_array_equal(srv.rounds.values[3], [-1.0, -1.0])  # applied once: lr 1, gradient 1


def test_a_workers_error_feedback_is_kept_per_worker_and_given_back_and_a_bad_one_refused():
    """FEEDBACK with data keeps a worker's residual of a key part (the last one sent), FEEDBACK
    without data gives it back to whoever asks (worker 0 for its checkpoint); one of the wrong size
    or dtype, of a key the server lacks, or asked before any was kept, is refused in one line, and
    the server serves on."""
    srv = _server(2)
    srv.rounds.values[3] = np.zeros(4, np.float32)
    got = []
    srv.transport.reply = lambda identity, msg: got.append(msg)

    def feedback(sender, rank, data=None, key=3, what="residual", **kw):
        srv.serve(b"id", P.Message(P.Type.FEEDBACK, sender=sender, seq=len(got) + 1, key=key,
                                   meta={"rank": rank, "what": what}, data=data, **kw))
        return got[-1]

    assert feedback(10, 1, np.arange(4, dtype=np.float32)).type == P.Type.ACK
    assert feedback(10, 1, np.full(4, 7, np.float32)).type == P.Type.ACK  # the last one counts
    assert feedback(9, 0, np.ones(4, np.float32), what="velocity").type == P.Type.ACK
    back = feedback(9, 1)
    assert back.type == P.Type.FEEDBACK and back.reply and back.data.tolist() == [7.0] * 4
    assert feedback(9, 0, what="velocity").data.tolist() == [1.0] * 4
    for bad, says in [(dict(rank=1, data=np.ones(3, np.float32)), "must be 4 float32 values"),
                      (dict(rank=1, data=np.ones(4, np.float16)), "must be 4 float32 values"),
                      (dict(rank=1, data=np.ones(4, np.float32), key=8), "not initialised"),
                      (dict(rank=0), "no residual of worker 0 kept")]:
        reply = feedback(10, **bad)
        assert reply.type == P.Type.ERROR and says in reply.meta["message"], (bad, reply.meta)
    with pytest.raises(P.ProtocolError, match="what"):  # the schema: only residual or velocity
        P.decode(P.encode(P.Message(P.Type.FEEDBACK, key=3, meta={"rank": 1, "what": "weights"})))
    assert feedback(9, 1).data.tolist() == [7.0] * 4
