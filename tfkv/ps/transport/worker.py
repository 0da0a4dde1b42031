"""A worker's transport: one DEALER socket per server, and what travels through them.

`connect` makes a `WorkerTransport` (plain) or a `SecureWorkerTransport` (a job with keys: each
server's session opened by the HELLO handshake, made again when ZeroMQ makes a lost connection
again, every message sealed and opened, a PULL reply's payload opened straight into where its pull
puts it: `land`), chosen once. Either batches the
requests queued for a server into one ZeroMQ message (`send`, `flush`), and under PS_RESEND
keeps each awaited request until `answered`, sending it again while it is overdue
(`resend_overdue`), as ps-lite's Van does with its Resender. Request numbers, tracking and
replies are the link's (tfkv.ps.worker); the transport sees frames only.

The sockets are not thread-safe: every use holds `lock` (the `dist_*` store's pushpull_async
may run on a TensorFlow op's thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import zmq

from tfkv.errors import TfkvError
from tfkv.ps import aead, channel, handshake
from tfkv.ps import protocol as P
from tfkv.ps import security, wire
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.parts import Pull

log = logging.getLogger("tfkv.ps")

MAX_BATCH_FRAMES = 1024  # a batch of small requests is sent once it holds this many frames


class DistError(TfkvError, RuntimeError):
    """A server refused a request, or did not answer it or the handshake; the message says which."""


def server_name(servers: list[dict], server: int) -> str:
    """How messages name server `server` of the scheduler's list."""
    where = servers[server]
    return f"server {server} at {where['host']}:{where['port']}"


class Outgoing:
    """A request kept to be sent again under PS_RESEND until it is answered."""

    __slots__ = ("server", "frames", "sent_at")

    def __init__(self, server: int, frames: list[Any], sent_at: float):
        self.server, self.frames, self.sent_at = server, frames, sent_at


class Landing(NamedTuple):
    """Where a secure PULL reply's payload is opened: its pull's destination, as bytes."""

    buffer: np.ndarray  # uint8 view of the destination
    dtype: int  # the key's protocol dtype code
    itemsize: int


def connect(env: ClusterEnv, servers: list[dict], sender: int) -> WorkerTransport:
    """The transport of worker `sender` to `servers` (the scheduler's list): sealed in a job with
    keys, plain otherwise."""
    return (WorkerTransport if env.keys is None else SecureWorkerTransport)(env, servers, sender)


class WorkerTransport:
    """Plain sockets to every server of the job, in the scheduler's order."""

    sessions: list[channel.Session] | None = None  # a secure job's, one per server

    def __init__(self, env: ClusterEnv, servers: list[dict], sender: int):
        self.env, self.servers, self.sender = env, servers, sender
        ctx = zmq.Context.instance()
        self.socks = []
        self._poller = zmq.Poller()
        for server in servers:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            # Every message a server sends here answers a request this worker made, so its queue
            # is bounded by this worker's own requests: no high-water mark, at which ZeroMQ would
            # stop reading and leave the server's queue to fill (a pull of 10,000 keys).
            sock.setsockopt(zmq.RCVHWM, 0)
            # The data plane is a plain socket: a secure job seals every message (tfkv.ps.channel).
            security.client_socket(sock, None, P.max_frame(env.keys is not None, env.max_message_bytes))
            sock.connect(f"tcp://{server['host']}:{server['port']}")
            self._poller.register(sock, zmq.POLLIN)
            self.socks.append(sock)
        self._index = {sock: i for i, sock in enumerate(self.socks)}
        # Requests queued per server and sent together (`flush`): one ZeroMQ message for a batch
        # of small ones, as each ZeroMQ message costs a wakeup of the application's, libzmq's I/O
        # and pyzmq's garbage-collector threads on both ends.
        self._outbox: list[list[Any]] = [[] for _ in self.socks]
        self._outbytes = [0] * len(self.socks)
        self._resent: dict[int, Outgoing] | None = {} if env.resend else None  # PS_RESEND: seq -> request
        self.refused = 0  # replies (and handshake answers) that failed authentication (dropped)
        self.lock = threading.RLock()

    @property
    def count(self) -> int:
        return len(self.socks)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    def put(self, server: int, frames: list[Any]) -> None:
        """Send frames to `server` now."""
        wire.send(self.socks[server], frames)

    def send(self, server: int, frames: list[Any], nbytes: int, seq: int = 0) -> None:
        """Queue frames for `server`, sent with the rest of its batch (at `flush`, or once it is
        full). `seq`: of a request awaited, which under PS_RESEND is sent again while overdue,
        until `answered`."""
        if seq and self._resent is not None:
            self._resent[seq] = Outgoing(server, frames, time.monotonic())
        box = self._outbox[server]
        box.extend(frames)
        self._outbytes[server] += nbytes
        if self._outbytes[server] >= self.env.fusion_bytes or len(box) >= MAX_BATCH_FRAMES:
            self.flush_server(server)

    @property
    def resends(self) -> bool:
        """Whether requests are sent again until answered (PS_RESEND)."""
        return self._resent is not None

    def answered(self, seq: int) -> None:
        """Request `seq` needs sending no more."""
        if self._resent is not None:
            self._resent.pop(seq, None)

    def watch(self) -> None:
        """Look after the connections (a secure transport's: each made again gets a new handshake)."""

    def resend_overdue(self) -> None:
        """Under PS_RESEND, send again each request unanswered for PS_RESEND_TIMEOUT."""
        if self._resent is None:
            return
        now = time.monotonic()
        for seq, out in self._resent.items():
            if now - out.sent_at > self.env.resend_timeout:
                if self.env.verbose >= 1:
                    log.info("resending request %d to server %d", seq, out.server)
                self.put(out.server, out.frames)
                out.sent_at = now

    def flush_server(self, server: int) -> None:
        frames, self._outbox[server], self._outbytes[server] = self._outbox[server], [], 0
        self.put(server, frames)

    def flush(self) -> None:
        """Send the requests queued for every server (each server's as one ZeroMQ message)."""
        for server, box in enumerate(self._outbox):
            if box:
                self.flush_server(server)

    def ready(self, timeout_ms: float) -> list[int]:
        """The servers with something to take, waiting up to `timeout_ms` for the first."""
        return [self._index[sock] for sock, _ in self._poller.poll(timeout_ms)]

    def take(self, server: int) -> list[Any] | None:
        """The protocol frames of the next message from `server` (zmq.Again if there is none);
        None if there is none to use yet (a secure transport's: refused, or a piece)."""
        return wire.recv(self.socks[server], zmq.NOBLOCK)

    def land(self, pulls: Iterable[Pull], awaited: Callable[[int], bool]) -> list[int]:
        """Have the replies to `pulls`' parts opened where each pull puts them: a secure
        transport's (the seqs landed, for `unland`); a plain one receives into its own buffers."""
        return []

    def unland(self, seqs: list[int]) -> None:
        """End the landings `land` made."""


class SecureWorkerTransport(WorkerTransport):
    """Every message sealed for its server's session (tfkv.ps.channel), opened by the HELLO handshake."""

    def __init__(self, env: ClusterEnv, servers: list[dict], sender: int):
        super().__init__(env, servers, sender)
        # Secure job: where a PULL reply's payload is opened (its pull's destination, `land`).
        self._landing: dict[int, Landing] = {}  # seq -> where
        self.sessions = self._handshake(list(range(self.count)))
        # A connection that drops mid-job is made again by ZeroMQ, a new one to its server, which
        # holds this worker's session for the old one only: each socket is watched for a new
        # connection, which gets a new handshake (`watch`). The monitors have a poller of their
        # own: in the receive's, they doubled the cost of each poll (4 servers: 29 -> 57 us).
        self._monitors: dict[zmq.Socket, int] = {}
        self._watching = zmq.Poller()
        self._reconnected: set[int] = set()  # servers whose connection is new, not yet handshaken
        for server, sock in enumerate(self.socks):
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._monitors[monitor] = server
            self._watching.register(monitor, zmq.POLLIN)

    def close(self) -> None:
        for sock, monitor in zip(self.socks, self._monitors):
            sock.disable_monitor()
            monitor.close()
        super().close()

    def _handshake(self, servers: list[int]) -> list[channel.Session]:
        """Open a session with each of `servers` (tfkv.ps.handshake.Initiator: a fresh HELLO while
        unanswered, the session the server answers a PING on); a server that does not answer in
        time is not of this job, or not there."""
        psk = handshake.psk(self.env.keys.secret)
        sides = {server: handshake.Initiator(psk, self.sender) for server in servers}
        poller = zmq.Poller()
        for server in servers:
            poller.register(self.socks[server], zmq.POLLIN)
        wait = max(30.0, 5 * self.env.heartbeat_timeout)
        deadline = time.monotonic() + wait
        while (server := next((i for i, side in sides.items() if side.session is None), None)) is not None:
            now = time.monotonic()
            if now > deadline:
                raise DistError(f"{server_name(self.servers, server)} did not complete the data plane's handshake "
                                f"in {wait:.0f} s: it is not of this job (other keys), not reachable, or its clock "
                                f"is more than {handshake.FRESH:.0f} s from this host's (its log says which)")
            for i, side in sides.items():
                for message in side.due(now):
                    self.socks[i].send_multipart(message)
            for sock, _ in poller.poll(100):
                i = self._index[sock]
                frames = sock.recv_multipart()
                if sides[i].session is not None:
                    continue  # the WELCOME to a HELLO sent before, or its PING's answer: done without it
                try:
                    for piece in sides[i].answer(frames):
                        sock.send_multipart(piece)
                except channel.Refused as e:
                    self.refused += 1
                    log.warning("refused a handshake answer from %s: %s", server_name(self.servers, i), e)
        sessions = [side.session for side in sides.values()]
        _log_ciphers(sessions)  # type: ignore[arg-type]
        return sessions  # type: ignore[return-value]

    def watch(self) -> None:
        """A server whose connection ZeroMQ made again gets a new handshake, once what came on the
        old connection has been taken."""
        for monitor, _ in self._watching.poll(0):
            while monitor.poll(0):  # its events: one reconnect, or several
                monitor.recv_multipart()
            self._reconnected.add(self._monitors[monitor])
        for server in [s for s in self._reconnected if not self.socks[s].poll(0)]:
            self._reconnected.discard(server)
            log.warning("the connection to %s was lost and made again: a new handshake (what was in flight on the "
                        "old one is sent again under PS_RESEND, else named if awaited)",
                        server_name(self.servers, server))
            (self.sessions[server],) = self._handshake([server])

    def put(self, server: int, frames: list[Any]) -> None:
        """Send a request's frames sealed for its server (piece by piece)."""
        for piece in self.sessions[server].seal(frames):
            wire.send(self.socks[server], piece)

    def take(self, server: int) -> list[Any] | None:
        frames = wire.recv(self.socks[server], zmq.NOBLOCK)
        try:
            return self.sessions[server].open(frames, self._into if self._landing else None)
        except channel.Refused as e:  # a duplicate WELCOME too: dropped, as anything refused
            self.refused += 1
            log.warning("refused a message from %s: %s", server_name(self.servers, server), e)
            return None

    def land(self, pulls: Iterable[Pull], awaited: Callable[[int], bool]) -> list[int]:
        """Open each awaited part's PULL reply straight into its pull's destination (a contiguous
        array of the key's dtype and the part's size), not into its received buffer for the
        caller to copy: one pass less over every pulled byte. A reply that fails authentication
        leaves it zeroed; the pull is then not complete (a lost reply)."""
        landed: list[int] = []
        with self.lock:  # no receive on another thread between a look at what is awaited and a landing
            for p in pulls:
                for seq, dest in p.destinations():
                    if awaited(seq):
                        self._landing[seq] = Landing(dest.view(np.uint8), P.DTYPE_CODES[dest.dtype], dest.itemsize)
                        p.landed = True
                        landed.append(seq)
        return landed

    def unland(self, seqs: list[int]) -> None:
        for seq in seqs:
            self._landing.pop(seq, None)

    def _into(self, head: memoryview, frame: int, size: int) -> np.ndarray | None:
        """channel.Session.open's `into`: the payload of a PULL reply to a request `land`ed."""
        if len(head) != P.HEADER.size:
            return None
        magic, version, kind, flags, dtype, _, seq, _, count = P.HEADER.unpack(head)
        landing = self._landing.get(seq)
        if (landing is None or magic != P.MAGIC or kind != P.Type.PULL or dtype != landing.dtype
                or flags & (P.FLAG_META | P.FLAG_ROWS | P.FLAG_DATA | P.FLAG_REPLY) != P.FLAG_DATA | P.FLAG_REPLY
                or not landing.buffer.nbytes == size == count * landing.itemsize):
            return None
        return landing.buffer


def _log_ciphers(sessions: list[channel.Session]) -> None:
    """Say which cipher seals the data plane, and why not AEGIS-128X4 where it is not."""
    names = Counter(s.cipher.NAME for s in sessions)
    line = "; ".join(f"{name} with {n} of {len(sessions)} server(s)" for name, n in names.items())
    if aead.Aegis128X4 not in aead.available():
        line += " (AEGIS-128X4 needs the `aeg` package, not installed here: pip install 'tfkv[aegis]')"
    elif aead.AesGcm256.NAME in names:
        line += " (AEGIS-128X4 where both ends have the `aeg` package: a server lacks it)"
    log.info("data plane sealed with %s", line)
