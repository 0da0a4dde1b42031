"""A server's transport: its one ROUTER socket, every worker's connection to it, and what travels
on them. It receives a request message as protocol frames and sends the replies queued for each
connection as one ZeroMQ message at `flush`. A request that changes the server and was seen
before (the same sender and sequence number: a worker's transport resends under PS_RESEND) is
told apart here (`repeated`), so that the server acknowledges it again but never applies it twice.

Secure or plain is chosen once, by `bind`: a plain job's frames go as they are; a secure job's
(`SecureServerTransport`) are sealed with the keys of the connection they travel on
(tfkv.ps.channel), opened by the handshake's sessions (tfkv.ps.handshake.Acceptor), which also
answers each worker's HELLO. ZeroMQ's own CURVE is not used on the data plane: its cipher is
far slower than the channel's (benchmarks/results/design_figures.md). What fails the channel's
checks is dropped unanswered (who fails them cannot read an answer) and counted by reason, logged once at the end.

The socket is ROUTER_MANDATORY: a reply to a connection that closed after its request (a worker
that died, a peer that sent a HELLO and left) raises, and is logged, never lost unseen, and never
ends the server's loop.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict, defaultdict
from typing import Any, Sequence

import numpy as np
import zmq

from tfkv.ps import channel, handshake, memory
from tfkv.ps import protocol as P
from tfkv.ps import security, strangers, wire
from tfkv.ps.cluster_env import ClusterEnv

log = logging.getLogger("tfkv.ps")

# Reply frames from this size up are sent without a copy (pyzmq's zero-copy send, released by its
# helper thread); smaller ones are copied, cheaper than that release. It must stay below 1 MiB
# (a 512 x 512 weight): at 2 MiB every reply of 1 MiB frames was copied, and slower
# (benchmarks/results/design_figures.md). 64 KiB is pyzmq's own default.
COPY_THRESHOLD = 64 << 10
RECEIVE_WAIT_MS = 100  # how long a receive waits before the loop looks for a shutdown
DEDUP_WINDOW = 4096  # requests remembered per sender, to apply none of them twice
# Requests that change the server: one seen before is acknowledged again, never applied twice.
CHANGES = frozenset((P.Type.PUSH, P.Type.PUSHPULL, P.Type.INIT, P.Type.SET_STATE, P.Type.SET_OPTIMIZER,
                     P.Type.CONFIGURE, P.Type.SET_COMPRESSION))


class ServerTransport:
    """A plain job's: frames go as they are."""

    def __init__(self, sock: zmq.Socket, fusion_bytes: int):
        self.sock = sock
        self.fusion_bytes = fusion_bytes  # a reply payload from this size up goes at once
        self.name = "server"  # the node's name in the log, once it registered (`named`)
        self.sender = 0  # the node's id, the sender of its replies
        self._outbox: dict[bytes, list[Any]] = {}  # replies queued per connection until `flush`
        self.host, self.port = "", 0  # where it listens (`bind`)
        self._seen: defaultdict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)  # sender -> seqs

    def repeated(self, msg: P.Message) -> bool:
        """Whether request `msg` changes the server and came before (its sender resent it)."""
        if msg.type not in CHANGES:
            return False
        seen = self._seen[msg.sender]
        if msg.seq in seen:
            return True
        seen[msg.seq] = None
        if len(seen) > DEDUP_WINDOW:
            seen.popitem(last=False)
        return False

    def named(self, node_id: int, name: str) -> None:
        """The node's id and name, once the scheduler gave them."""
        self.sender, self.name = node_id, name

    def receive(self) -> tuple[bytes, list[Any]] | None:
        """A message's sender (its connection's ROUTER identity) and its protocol frames, or None:
        nothing within the receive wait, or nothing to serve (a handshake, answered here; a piece
        of a sealed message still arriving; a message refused)."""
        try:
            frames = wire.recv(self.sock)
        except zmq.Again:
            return None
        identity = frames[0].bytes
        frames = self._open(identity, frames[1:])
        return None if frames is None else (identity, frames)

    def _open(self, identity: bytes, frames: list[Any]) -> list[Any] | None:
        return frames

    def reply(self, identity: bytes, msg: P.Message) -> None:
        """Queue a reply: the replies to one received message (one batch) go back as one ZeroMQ
        message per peer, at `flush`; a payload of fusion_bytes or more sends them at once."""
        msg.sender = self.sender
        box = self._outbox.setdefault(identity, [])
        box.extend(P.encode(msg))
        if msg.data is not None and msg.data.nbytes >= self.fusion_bytes:
            self._send(identity, self._outbox.pop(identity))

    def flush(self) -> None:
        """Send every queued reply, one ZeroMQ message per peer."""
        while self._outbox:
            identity, frames = self._outbox.popitem()
            self._send(identity, frames)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        if not self._to(identity, frames):
            self._not_sent(frames)

    def _not_sent(self, frames: list[Any]) -> None:
        head = P.HEADER.unpack(bytes(frames[0]))
        log.warning("%s: %s reply (request %d) not sent: its sender is no longer connected", self.name,
                    P.Type(head[2]).name, head[6])

    def _to(self, identity: bytes, frames: Sequence[Any]) -> bool:
        """Send one ZeroMQ message to a connection; False if its peer is gone (EHOSTUNREACH, as
        the socket is ROUTER_MANDATORY)."""
        try:
            wire.send(self.sock, [identity, *frames])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def forget(self, identity: bytes) -> None:
        """Keep nothing for a connection its worker no longer uses (made again in its place)."""

    def report(self) -> None:
        """The closing lines of the server's log about its connections."""


class SecureServerTransport(ServerTransport):
    """A secure job's: every message sealed with its connection's keys, after a handshake."""

    def __init__(self, sock: zmq.Socket, fusion_bytes: int, acceptor: handshake.Acceptor):
        super().__init__(sock, fusion_bytes)
        self.acceptor = acceptor  # the handshakes and the sessions they open, per connection
        self.refused: Counter[str] = Counter()  # messages refused by the channel, by reason
        self._refused_by: Counter[bytes] = Counter()
        self._buffers = memory.Buffers()

    def _into(self, head: Any, frame: int, size: int) -> np.ndarray | None:
        """Where a payload arriving in pieces is opened: a kept buffer (whole frames open in place)."""
        return self._buffers.take(size) if size > channel.PIECE else None

    def _open(self, identity: bytes, frames: list[Any]) -> list[Any] | None:
        """The message as protocol frames, or None: a handshake (answered here), a piece of a
        message still arriving, or a message refused (dropped unanswered)."""
        try:
            if channel.envelope(frames)[0] == channel.HELLO:
                if not self._to(identity, self.acceptor.hello(identity, frames)):
                    log.warning("%s: a WELCOME not sent: its peer disconnected after its HELLO", self.name)
                    self.acceptor.forget(identity)
                return None
            return self.acceptor.open(identity, frames, self._into)
        except channel.Refused as e:
            self._refusal(identity, frames, e)
            return None

    def forget(self, identity: bytes) -> None:
        self.acceptor.forget(identity)

    def _refusal(self, identity: bytes, frames: list[Any], e: channel.Refused) -> None:
        """Count a refused message; one line per refusal, naming the peer, for the first few of
        each of the first connections: a stranger's connections cannot grow the log or this count
        without bound."""
        self.refused[e.reason] += 1
        seen = self._refused_by.get(identity)
        if seen is None and len(self._refused_by) >= strangers.MAX_PEERS:
            return
        self._refused_by[identity] = (seen or 0) + 1
        if self._refused_by[identity] <= strangers.PER_PEER:
            peer = frames[0].get("Peer-Address") if frames and hasattr(frames[0], "get") else "?"
            log.warning("%s: refused a message from %s: %s", self.name, peer, e)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        session = self.acceptor.sessions.get(identity)
        if session is None:
            return  # no connection of this job: nothing it could read
        # Each piece sent as soon as sealed (the worker opens it meanwhile); none sealed once one
        # finds its peer gone.
        if not all(self._to(identity, piece) for piece in session.seal(frames)):
            self._not_sent(frames)

    def report(self) -> None:
        if self.refused:
            log.warning("%s: refused %d messages that failed the channel's checks (%s)", self.name,
                        sum(self.refused.values()), ", ".join(f"{k}: {v}" for k, v in sorted(self.refused.items())))
        ciphers = Counter(s.cipher.NAME for s in self.acceptor.sessions.values())
        log.info("%s: data plane connections by cipher: %s", self.name,
                 ", ".join(f"{k}: {v}" for k, v in sorted(ciphers.items())) or "none")


def bind(env: ClusterEnv) -> ServerTransport:
    """The server's transport, its socket bound to a free port of env's bind address; secure when
    the job has keys."""
    secure = env.keys is not None
    sock = security.router_socket(None, P.max_frame(secure, env.max_message_bytes))
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.copy_threshold = COPY_THRESHOLD
    # A receive that waits, not a poll and then a receive: one call into libzmq less per message.
    sock.rcvtimeo = RECEIVE_WAIT_MS
    if secure:
        transport = SecureServerTransport(sock, env.fusion_bytes, handshake.Acceptor(handshake.psk(env.keys.secret)))
    else:
        transport = ServerTransport(sock, env.fusion_bytes)
    transport.host = env.bind_address()
    transport.port = sock.bind_to_random_port(f"tcp://{transport.host}")
    return transport
