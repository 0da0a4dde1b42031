"""The worker's request tracker apart from any socket: a lost reply named by a PING's answer, a
silent server asked, a server that answers nothing failing the job."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tfkv.ps import protocol as P
from tfkv.ps.parts import CHUNK_SHIFT
from tfkv.ps.tracker import Tracker, before, seqs
from tfkv.ps.worker import DistError

SERVERS = [{"host": "10.0.0.1", "port": 9000}, {"host": "10.0.0.2", "port": 9001}]


def _tracker(resend: bool = False, **env) -> Tracker:
    settings = {"heartbeat_timeout": 0.05, "request_timeout": 0.1, **env}
    names = {7: "key 'w'", 10: "layer embedding0 (tfkv.layers.ShardedEmbedding)"}  # as the store names them
    return Tracker(SimpleNamespace(**settings), SERVERS, lambda kid: names.get(kid, f"key {kid}"), lost_fails=not resend)


def test_a_ping_that_holds_fewer_than_are_awaited_names_the_oldest_lost_request():
    t = _tracker()
    t.track(0, 1, P.Type.PULL, 7 + (2 << CHUNK_SHIFT))
    t.track(0, 2, P.Type.PUSHPULL, 7)
    t.track(1, 3, P.Type.PULL, 7)  # another server's: not counted
    t.track(0, 4, P.Type.PING, 0)
    t.probe(0, 4, time.monotonic())
    t.answered(4)
    t.probed(0, 4, held=2)  # both held (parked in a round): nothing lost
    t.track(0, 5, P.Type.PING, 0)
    t.probe(0, 5, time.monotonic())
    t.answered(5)
    with pytest.raises(DistError, match=r"server 0 at 10\.0\.0\.1:9000 did not answer PULL of key 'w' \(part 2\) "
                                        r"\(request 1, .* holds 1 of the 2 requests .* the reply was lost"):
        t.probed(0, 5, held=1)


def test_under_resend_a_short_ping_is_no_failure():
    t = _tracker(resend=True)
    t.track(0, 1, P.Type.PULL, 7)
    t.check_held(0, 2, held=0)  # the request is sent again instead


def test_a_silent_server_is_asked_then_failed_after_the_request_timeout():
    t = _tracker()
    assert t.watch() == []  # nothing awaited: nobody to ask
    t.track(1, 1, P.Type.PULL, 7)
    assert t.watch() == []  # not silent long enough yet
    time.sleep(0.06)
    assert t.watch() == [1]
    t.probe(1, 2, time.monotonic())
    assert t.watch() == []  # asked: waiting for the answer
    time.sleep(0.12)
    with pytest.raises(DistError, match=r"server 1 at 10\.0\.0\.2:9001 has answered nothing .* awaits PULL of "
                                        r"key 'w' \(request 1"):
        t.watch()


def test_request_numbers_wrap_and_order_across_the_wrap():
    numbers = seqs(P.SEQ_MASK - 1)
    assert [next(numbers) for _ in range(3)] == [P.SEQ_MASK - 1, P.SEQ_MASK, 1]
    assert before(P.SEQ_MASK, 1) and not before(1, P.SEQ_MASK)


def test_a_server_s_text_names_keys_as_the_caller_did():
    """A server's error names key ids (a part's id is the key's + (j << 48)); the worker's line
    names the key as its caller did, and leaves other numbers and unknown ids alone."""
    from tfkv.ps.parts import CHUNK_SHIFT

    t = _tracker()
    assert t.named("key 7: row id 3 is not a row of shard 0") == "key 'w': row id 3 is not a row of shard 0"
    assert t.named(f"key {7 + (2 << CHUNK_SHIFT)}: 12 values pushed, the key holds 8") == \
        "key 'w': 12 values pushed, the key holds 8"
    assert t.named("key 9 is not initialised on this server; round 7") == "key 9 is not initialised on this server; round 7"
    # a trainer's table (tfkv.parallel.sparse names its keys by their layers): the layer, not `key 10`
    assert t.named("key 10: a shard of 10 rows of 4 values (160 bytes) is more than this server's memory") == \
        "layer embedding0 (tfkv.layers.ShardedEmbedding): a shard of 10 rows of 4 values (160 bytes) is more than " \
        "this server's memory"
