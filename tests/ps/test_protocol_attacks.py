"""Attacks on the data plane of a running secure job (tfkv.ps.channel), each refused and counted
by the server while the job's workers go on and end with exact values.

The attacker is this test process on 127.0.0.1: strangers without the job's key, and a peer
that holds it (an authenticated peer, or an on-path attacker replaying what it saw) sending
tampered, replayed and spliced messages."""

import json
import re
import sys
import time

import numpy as np
import pytest
import zmq

from conftest import expected
from proxy import Proxy
from tfkv import keys as job_keys
from tfkv.ps import aead, channel, handshake
from tfkv.ps import protocol as P


def _dealer(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _session(address: str, keys) -> tuple[zmq.Socket, channel.Session]:
    """A connection that completed the handshake with the job's key."""
    sock = _dealer(address)
    hello = handshake.Hello(handshake.psk(keys.secret))
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


def _ends_exact(c, outs, steps: int) -> str:
    """Wait for the job: every process ends well and every worker with int_sgd's exact values
    (every push counted once); the server's log."""
    codes = c.wait(120)
    assert all(v == 0 for v in codes.values()), c.outputs()
    for out in outs:
        assert json.loads(out.read_text())["final"] == expected(steps, 1, 2)
    return c.output("server 0")


def _refusals(log: str) -> dict[str, int]:
    """The server's closing count of what the channel refused, by reason."""
    m = re.search(r"refused (\d+) messages that failed the channel's checks \(([^)]*)\)", log)
    assert m, log[-3000:]
    return dict((k, int(v)) for k, v in (item.split(": ") for item in m.group(2).split(", ")))


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


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
    stranger.send_multipart(handshake.Hello(handshake.psk(job_keys.new_keys().secret)).message)
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

    log = _ends_exact(c, outs, steps)
    counts = _refusals(log)
    assert counts == {"not tfkv": 2, "bad handshake": 1, "replay": 1, "bad tag": 4, "no session": 1}, counts
    # Each refusal is one line naming the peer's address; the old protocol's says what it is.
    assert re.search(r"refused a message from 127\.0\.0\.1\S*: not tfkv: a tfkv message without the channel's "
                     r"envelope: a peer of an older tfkv or one started with TFKV_SECURE=0", log), log[-3000:]
    assert re.search(r"refused a message from 127\.0\.0\.1\S*: not tfkv: not a message of tfkv's data plane", log)
    assert "Traceback" not in log


@pytest.mark.slow
def test_a_replayed_hello_gets_nothing_and_costs_the_server_no_memory(cluster):
    """A HELLO seen once on the network (here made with the job's key and welcomed, as a worker's
    is) replayed without the key on 6,000 fresh connections: not one WELCOME comes back, the
    server keeps no session for any (it grew by 87 MiB per 22,000 before), and the job ends exact."""
    steps, replays, batch = 400, 6000, 300
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = c.start_workers("int_sgd", str(steps), "1", "64", "0.05")
    host, port = c.listening("server 0")
    address = f"tcp://{host}:{port}"
    pid = c.procs["server 0"].pid
    time.sleep(1.5)  # the job is under way
    seen = _dealer(address)  # the HELLO's first use: welcomed
    hello = handshake.Hello(handshake.psk(c.keys.secret))
    seen.send_multipart(hello.message)
    assert seen.poll(10_000), "the HELLO's own connection got no WELCOME"
    welcomed, rss = 0, []
    for start in range(0, replays, batch):
        socks = [_dealer(address) for _ in range(batch)]
        for s in socks:
            s.send_multipart(hello.message)
        time.sleep(0.5)  # any answer is back by now
        welcomed += sum(bool(s.poll(0)) for s in socks)
        for s in socks:
            s.close()
        assert c.procs["server 0"].poll() is None, c.outputs()
        rss.append(_rss_mib(pid))
    # What 300 connections at once take from libzmq the server's allocator keeps (tfkv.ps.memory)
    # after the first batches; from then on only what each replay leaves behind would add up.
    grown = rss[-1] - rss[len(rss) // 2]
    print(f"server RSS after each {batch} replayed HELLOs: {' '.join(f'{r:.0f}' for r in rss)} MiB; "
          f"{welcomed} welcomed")
    assert welcomed == 0, f"{welcomed} of {replays} replayed HELLOs got a WELCOME"
    assert grown < 4, f"the server grew by {grown:.1f} MiB under the last {replays // 2} replayed HELLOs"
    seen.close()
    log = _ends_exact(c, outs, steps)
    assert _refusals(log).get("replay", 0) >= replays * 0.8, _refusals(log)  # most arrived (linger 0), each counted
    assert "refused a message from 127.0.0.1" in log and "a HELLO welcomed before" in log


@pytest.mark.slow
def test_small_order_keys_in_hellos_are_bad_handshakes_and_the_server_serves_on(cluster):
    """A member (or anyone with the job's key) sends HELLOs around each of the 14 X25519 keys of
    small order, each on its own connection: each is refused, logged and counted as a bad
    handshake (cryptography's ValueError used to end the server), and the job ends exact."""
    import handshakes

    steps = 200
    c = cluster(num_servers=1, num_workers=2)
    c.start_servers()
    outs = c.start_workers("int_sgd", str(steps), "1", "64", "0.05")
    host, port = c.listening("server 0")
    time.sleep(1.5)  # the job is under way
    psk = handshake.psk(c.keys.secret)
    socks = []
    for key in handshakes.SMALL_ORDER:
        socks.append(_dealer(f"tcp://{host}:{port}"))
        socks[-1].send_multipart(handshakes.hello(psk, key))
    assert not any(_answered(s, wait_ms=300) for s in socks), "a small-order HELLO was answered"
    assert c.procs["server 0"].poll() is None, c.output("server 0")[-3000:]
    for s in socks:
        s.close()
    log = _ends_exact(c, outs, steps)
    assert _refusals(log) == {"bad handshake": 14}, _refusals(log)
    assert log.count("bad handshake: an X25519 key of small order") == 14 and "Traceback" not in log


class _ForgingProxy(Proxy):
    """Before each WELCOME it passes on to a worker, it sends that WELCOME with its cipher turned to
    AES-256-GCM (a downgrade on the path, without the key) and one WELCOME per small-order key
    (made with the job's key)."""

    def __init__(self, port: int, server, psk: bytes):
        self.psk, self.forged, self.hellos = psk, 0, {}
        super().__init__(port, server)

    def deliveries(self, to_server: bool, ident: bytes, frames: list[bytes]) -> list[tuple[float, list]]:
        import handshakes

        kind = channel.envelope(frames)[0]
        if to_server or kind != channel.WELCOME:
            if kind == channel.HELLO:
                self.hellos[ident] = frames
            return [(0.0, frames)]
        downgraded = [frames[0], bytearray(frames[1])]
        downgraded[1][handshake._PUBLIC] = aead.AesGcm256.ID
        forged = [handshakes.welcome(self.psk, self.hellos[ident], key, aead.AesGcm256.ID)
                  for key in handshakes.SMALL_ORDER]
        self.forged += 1 + len(forged)
        return [(0.0, m) for m in (downgraded, *forged, frames)]


@pytest.mark.slow
def test_a_worker_refuses_downgraded_and_small_order_welcomes_and_trains_on(cluster):
    """Every worker's first WELCOMEs are forged on the path: one with its cipher changed (no key:
    a downgrade), 14 around keys of small order (with the key). The worker refuses each as a bad
    handshake (the small-order ones used to end it with ValueError), takes the real WELCOME after
    them on AEGIS-128X4, and the job ends exact."""
    from tfkv.launcher.ports import free_port

    steps, proxy_port = 30, free_port()
    c = cluster(num_servers=1, num_workers=2)
    c.start("scheduler", "scheduler", [sys.executable, "-m", "tfkv.ps.node"])
    c.start("server 0", "server", [sys.executable, "-m", "tfkv.ps.node"], TFKV_RANK_HINT="0",
            TFKV_ADVERTISE_ADDRESS=f"127.0.0.1:{proxy_port}")
    proxy = _ForgingProxy(proxy_port, lambda: "tcp://%s:%d" % c.listening("server 0"), handshake.psk(c.keys.secret))
    try:
        outs = c.start_workers("int_sgd", str(steps), "1", "32")
        codes = c.wait(120)
    finally:
        proxy.stop.set()
        proxy.thread.join(10)
    assert all(v == 0 for v in codes.values()), c.outputs()
    assert proxy.forged == 2 * 15, proxy.forged
    for i, out in enumerate(outs):
        assert json.loads(out.read_text())["final"] == expected(steps, 1, 2)
        log = c.output(f"worker {i}")
        assert log.count("refused a handshake answer from server 0 at 127.0.0.1") == 15, log[-3000:]
        assert log.count("bad handshake: an X25519 key of small order") == 14
        assert "bad handshake: a WELCOME not made with the job's key for this HELLO" in log
        assert "Traceback" not in log
    assert "data plane connections by cipher: AEGIS-128X4: 2" in c.output("server 0")
