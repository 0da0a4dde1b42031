"""The data plane's AEAD channel, in one process: handshake, sealing, and every refusal."""

import numpy as np
import pytest

from tfkv import keys as job_keys
from tfkv.ps import channel
from tfkv.ps import protocol as P


def _pair(keys=None):
    keys = keys or job_keys.new_keys()
    hello = channel.Hello(channel.psk(keys.secret))
    server, answer = channel.welcome(channel.psk(keys.secret), hello.message)
    return hello.welcome(answer), server


def _msg(n=1000, seq=1):
    return P.encode(P.Message(P.Type.PUSH, sender=9, seq=seq, key=3, data=np.arange(n, dtype=np.float32)))


def test_a_sealed_message_opens_to_the_same_frames_and_hides_them():
    worker, server = _pair()
    frames = _msg()
    sealed = worker.seal(frames)
    assert np.arange(1000, dtype=np.float32).tobytes() not in b"".join(bytes(f) for f in sealed)
    got = P.decode(server.open(sealed))
    assert got.seq == 1 and np.array_equal(got.data, np.arange(1000, dtype=np.float32))
    reply = P.decode(worker.open(server.seal(P.encode(P.ack(got)))))  # and back
    assert reply.type == P.Type.ACK and reply.seq == 1


def test_nonces_never_repeat_across_frames_and_messages():
    worker, _ = _pair()
    counters = []
    for seq in range(5):
        kind, n, counter = channel.envelope(worker.seal(_msg(300_000, seq)))  # two payload frames
        counters.append((counter, n))
    spans = [range(c, c + n) for c, n in counters]
    used = [i for s in spans for i in s]
    assert len(used) == len(set(used))


@pytest.mark.parametrize("where", ["envelope", "header", "payload", "tag"])
def test_a_flipped_bit_anywhere_is_refused(where):
    worker, server = _pair()
    sealed = [bytearray(f) for f in worker.seal(_msg())]
    frame, at = {"envelope": (0, 12), "header": (1, 3), "payload": (2, 100), "tag": (2, -1)}[where]
    sealed[frame][at] ^= 1
    with pytest.raises(channel.Refused) as e:
        server.open(sealed)
    assert e.value.reason in ("bad tag", "malformed", "replay")
    assert P.decode(server.open(worker.seal(_msg(seq=2)))).seq == 2  # the connection goes on


def test_a_replayed_message_is_refused_and_a_late_one_within_the_window_is_not():
    worker, server = _pair()
    first, second = worker.seal(_msg(seq=1)), worker.seal(_msg(seq=2))
    server.open(second)
    assert P.decode(server.open(first)).seq == 1  # reordered, within the window
    for again in (first, second):
        with pytest.raises(channel.Refused, match="replay"):
            server.open(again)
    for _ in range(channel.WINDOW):  # push `first`'s counter out of the window
        server.open(worker.seal([b"x"]))
    stale = worker.seal(_msg(seq=3))
    for _ in range(channel.WINDOW + 1):
        server.open(worker.seal([b"x"]))
    with pytest.raises(channel.Refused, match="replay"):
        server.open(stale)


def test_frames_from_another_connection_or_message_are_refused():
    keys = job_keys.new_keys()
    a_worker, a_server = _pair(keys)
    b_worker, b_server = _pair(keys)  # same job, another connection
    with pytest.raises(channel.Refused, match="bad tag"):
        b_server.open(a_worker.seal(_msg()))
    one, two = a_worker.seal(_msg(seq=1)), a_worker.seal(_msg(seq=2))
    with pytest.raises(channel.Refused, match="bad tag"):
        a_server.open([one[0], one[1], two[2]])  # a payload frame moved between messages
    with pytest.raises(channel.Refused, match="malformed"):
        a_server.open(one[:2])  # a frame dropped


def test_a_stranger_cannot_handshake_nor_pass_for_the_server():
    keys, other = job_keys.new_keys(), job_keys.new_keys()
    with pytest.raises(channel.Refused, match="bad handshake"):
        channel.welcome(channel.psk(keys.secret), channel.Hello(channel.psk(other.secret)).message)
    hello = channel.Hello(channel.psk(keys.secret))
    _, forged = channel.welcome(channel.psk(other.secret), channel.Hello(channel.psk(other.secret)).message)
    with pytest.raises(channel.Refused, match="bad handshake"):
        hello.welcome(forged)
    for junk in ([b"garbage"], P.encode(P.Message(P.Type.PULL, sender=1, seq=1, key=0)), []):
        with pytest.raises(channel.Refused, match="not tfkv"):
            channel.envelope(junk)
