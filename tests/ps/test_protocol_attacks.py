"""Attacks on the data plane of a running secure job (tfkv.ps.channel), each refused and counted
by the server while the job's workers go on and end with exact values.

The attacker is this test process on 127.0.0.1: strangers without the job's key, and a peer
that holds it (an authenticated peer, or an on-path attacker replaying what it saw) sending
tampered, replayed and spliced messages."""

import json
import re
import time

import numpy as np
import pytest
import zmq

from conftest import expected
from tfkv import keys as job_keys
from tfkv.ps import channel
from tfkv.ps import protocol as P


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _session(address: str, keys) -> tuple[zmq.Socket, channel.Session]:
    """A connection that completed the handshake with the job's key."""
    sock = _dealer(address)
    hello = channel.Hello(channel.psk(keys.secret))
    sock.send_multipart(hello.message)
    assert sock.poll(10_000), "the server never welcomed a HELLO made with the job's key"
    return sock, hello.welcome(sock.recv_multipart())


def _answered(sock: zmq.Socket, session: channel.Session | None = None, wait_ms: int = 1000) -> bool:
    if not sock.poll(wait_ms):
        return False
    frames = sock.recv_multipart()
    if session is not None:
        got = session.open(frames)
        while got is None:  # the answer's further pieces (one ZeroMQ message each)
            assert sock.poll(wait_ms), "an answer stopped half-way"
            got = session.open(sock.recv_multipart())
        P.decode(got)  # a real answer, sealed for this connection
    return True


@pytest.mark.slow
def test_every_attack_on_the_data_plane_is_refused_counted_and_the_job_goes_on(cluster):
    steps = 200  # 0.05 s apart: the job outlasts the attacks
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = c.start_workers("int_sgd", str(steps), "1", "64", "0.05")
    host, port = c.listening("server 0")
    address = f"tcp://{host}:{port}"
    time.sleep(1.5)  # the job is under way

    # Strangers: an older tfkv or plain ZeroMQ speaking the bare protocol, garbage, and a HELLO
    # made with another job's key. Nobody answers them.
    stranger = _dealer(address)
    stranger.send_multipart(P.encode(P.Message(P.Type.PUSH, sender=1, seq=1, key=0, data=np.ones(64, np.float32))))
    stranger.send_multipart([b"garbage"])
    stranger.send_multipart(channel.Hello(channel.psk(job_keys.new_keys().secret)).message)
    assert not _answered(stranger)

    # A peer with the job's key: its own well-formed message is answered...
    a, a_session = _session(address, c.keys)
    (ping,) = a_session.seal(P.encode(P.Message(P.Type.PING, sender=0, seq=1)))  # one piece
    a.send_multipart(ping)
    assert _answered(a, a_session), "a well-formed sealed message got no answer"
    # ...the same frames again (a replay) are not.
    a.send_multipart(ping)
    # A flipped bit in the envelope (its frame count), in the protocol header, in the payload.
    push = P.encode(P.Message(P.Type.PUSH, sender=0, seq=2, key=0, data=np.full(64, 1e6, np.float32)))
    for frame, at in ((0, 4), (1, 5), (2, 40)):
        (sealed,) = [[bytearray(f) for f in p] for p in a_session.seal(push)]  # small: one message
        sealed[frame][at] ^= 0x10
        a.send_multipart(sealed)
    # A message of connection A spliced into connection B (same job, its own session), and into
    # a connection that never made a handshake.
    b, b_session = _session(address, c.keys)
    b.send_multipart(*a_session.seal(P.encode(P.Message(P.Type.PING, sender=0, seq=3))))
    fresh = _dealer(address)
    fresh.send_multipart(*a_session.seal(P.encode(P.Message(P.Type.PING, sender=0, seq=4))))
    assert not any(_answered(s, wait_ms=500) for s in (a, b, fresh)), "a refused message was answered"
    for s in (stranger, a, b, fresh):
        s.close()

    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(steps, 1, 2)  # every push counted once
    log = c.output("server 0")
    m = re.search(r"refused (\d+) messages that failed the channel's checks \(([^)]*)\)", log)
    assert m, log[-3000:]
    counts = dict((k, int(v)) for k, v in (item.split(": ") for item in m.group(2).split(", ")))
    assert counts == {"not tfkv": 2, "bad handshake": 1, "replay": 1, "bad tag": 4, "no session": 1}, counts
    # Each refusal is one line naming the peer's address; the old protocol's says what it is.
    assert re.search(r"refused a message from 127\.0\.0\.1\S*: not tfkv: a tfkv message without the channel's "
                     r"envelope: a peer of an older tfkv or one started with TFKV_SECURE=0", log), log[-3000:]
    assert re.search(r"refused a message from 127\.0\.0\.1\S*: not tfkv: not a message of tfkv's data plane", log)
    assert "Traceback" not in log
