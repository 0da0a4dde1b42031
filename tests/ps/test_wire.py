"""The data plane's multipart send and receive (tfkv.ps.wire) over real ZeroMQ sockets: what
goes out comes back frame for frame (small frames copied, large ones and received zmq.Frames by
pyzmq's zero-copy send), and an empty socket raises zmq.Again as pyzmq's own calls do."""

import numpy as np
import pytest
import zmq

from tfkv.ps import wire


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


def test_frames_arrive_as_sent_and_go_back_by_identity(pair):
    router, dealer = pair
    big = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: over pyzmq's copy threshold, sent without a copy
    frames = [b"head", memoryview(np.arange(7, dtype=np.float32)).cast("B"), memoryview(big).cast("B")]
    wire.send(dealer, frames)
    router.rcvtimeo = 5000
    got = wire.recv(router)
    assert all(isinstance(f, zmq.Frame) for f in got)
    identity, *rest = got
    assert [bytes(f.buffer) for f in rest] == [bytes(f) for f in frames]
    wire.send(router, [identity, *rest])  # received frames go back as they are, as a server's reply does
    dealer.rcvtimeo = 5000
    back = wire.recv(dealer)
    np.testing.assert_array_equal(np.frombuffer(back[2].buffer, np.float32), big)
    assert len(back) == 3 and bytes(back[0].buffer) == b"head"


def test_a_single_frame(pair):
    router, dealer = pair
    wire.send(dealer, [b"only"])
    router.rcvtimeo = 5000
    assert [bytes(f.buffer) for f in wire.recv(router)][1:] == [b"only"]


def test_nothing_to_take_raises_again(pair):
    router, dealer = pair
    with pytest.raises(zmq.Again):
        wire.recv(dealer, zmq.NOBLOCK)
    router.rcvtimeo = 50  # the server's receive: a timeout, to look for a shutdown
    with pytest.raises(zmq.Again):
        wire.recv(router)


def test_an_unreachable_peer_raises_on_a_mandatory_router(pair):
    router, _ = pair
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    with pytest.raises(zmq.ZMQError) as e:
        wire.send(router, [b"no such peer", b"x"])
    assert e.value.errno == zmq.EHOSTUNREACH  # what ServerTransport logs as a gone sender
