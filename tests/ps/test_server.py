"""The server's handling of a synchronous round in-process (no sockets, no scheduler): where the sum
goes, and that it stays exact."""

from collections import Counter, defaultdict

import numpy as np
import pytest

from tfkv.ps import protocol as P
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.server import Round, Server


def _server(workers: int) -> Server:
    srv = object.__new__(Server)  # only the round's bookkeeping: no sockets, no scheduler
    srv.env = ClusterEnv("server", "127.0.0.1", 1, 1, workers)
    srv._pool, srv.sync, srv.updater, srv.threshold = None, True, None, None
    srv.values, srv.rounds, srv._held = {}, defaultdict(Round), Counter()
    srv.workers = set(range(9, 9 + workers))
    return srv


def _push(sender: int, buffer) -> P.Message:
    return P.Message(P.Type.PUSH, sender=sender, key=3, data=np.frombuffer(buffer, np.float32), want_ack=False)


@pytest.mark.parametrize("workers", [2, 3])
def test_a_round_sums_into_the_first_received_buffer(workers):
    """The pushes of a round add into the first one's received buffer (it is the round's own until
    the round closes): no fresh array per round, which for a 16 MiB key was an allocation and its
    page faults on every round. The value is exact, and no other push's buffer is touched."""
    srv = _server(workers)
    srv.values[3] = np.zeros(5, np.float32)
    pushed = [bytearray(np.full(5, w + 1, np.float32).tobytes()) for w in range(workers)]
    for w, buffer in enumerate(pushed):
        srv.on_push(b"id", _push(9 + w, buffer))
    assert np.array_equal(srv.values[3], np.full(5, workers * (workers + 1) / 2, np.float32))
    assert np.shares_memory(srv.values[3], np.frombuffer(pushed[0], np.float32))
    assert all(bytes(b) == np.full(5, w + 1, np.float32).tobytes() for w, b in enumerate(pushed) if w)


def test_a_read_only_first_push_is_summed_into_a_fresh_array():
    srv = _server(2)
    srv.values[3] = np.zeros(5, np.float32)
    first = np.ones(5, np.float32).tobytes()  # bytes: read-only
    srv.on_push(b"id", _push(9, first))
    srv.on_push(b"id", _push(10, bytearray(np.full(5, 2, np.float32).tobytes())))
    assert np.array_equal(srv.values[3], np.full(5, 3, np.float32))
    assert first == np.ones(5, np.float32).tobytes()


def test_a_one_key_pushpull_is_its_push_then_its_pull():
    """A PUSHPULL without a key list (the header's key, its payload the last frame): served as a
    PUSH then a PULL, so a dist_sync round still waits for every worker, the answer is a PULL reply
    of the new value under the request's seq, and a second PUSHPULL before the round closes is held
    whole for the next round (its pull answered with that round's value, not this one's)."""
    srv = _server(2)
    srv.values[3] = np.zeros(5, np.float32)
    sent = []
    srv.reply = lambda identity, msg: sent.append((identity, msg))

    def pushpull(sender, value, seq):
        srv.on_pushpull(b"w%d" % sender, P.Message(P.Type.PUSHPULL, sender=sender, seq=seq, key=3,
                                                   data=np.full(5, value, np.float32)))

    pushpull(9, 1.0, 1)
    pushpull(9, 10.0, 2)  # worker 9 again before worker 10 pushed: held for the next round
    assert sent == [] and srv._held[9] == 2
    pushpull(10, 2.0, 1)
    replies = [(identity, msg.type, msg.seq, msg.data.tolist()) for identity, msg in sent]
    assert replies == [(b"w9", P.Type.PULL, 1, [3.0] * 5), (b"w10", P.Type.PULL, 1, [3.0] * 5)]
    assert srv.rounds[3].pushed == {9} and srv._held[9] == 1  # the held push opened the next round
    pushpull(10, 20.0, 2)
    assert [(msg.seq, msg.data.tolist()) for identity, msg in sent[2:]] == [(2, [30.0] * 5), (2, [30.0] * 5)]  # no optimizer: the sum
    assert srv._held[9] == 0 and srv._held[10] == 0
