"""A worker's link to the servers: one socket per server, requests tracked until answered.

`ServerLink.send` numbers and sends a request (and remembers it, to resend it under PS_RESEND
and to name it if it gets no answer); `receive` takes what the servers sent, keeping data
replies in `replies` for the caller; `wait` blocks until given requests are answered. Waiting has
no deadline of its own (a dist_sync pull waits for the slowest worker), but a silent server is
asked what it holds, so a lost reply fails the job naming it (see `_check_held`). The sockets are
not thread-safe: every use holds `lock` (the `dist_*` store's pushpull_async may run on a
TensorFlow op's thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any, Callable, Hashable, Iterator, Sequence

import numpy as np
import zmq

from tfkv.errors import TfkvError, reacting
from tfkv.ps import aead, channel, handshake
from tfkv.ps import protocol as P
from tfkv.ps import security, wire
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.parts import CHUNK_SHIFT
from tfkv.ps.scheduler_link import SchedulerLink

log = logging.getLogger("tfkv.ps")

MAX_BATCH_FRAMES = 1024  # a batch of small requests is sent once it holds this many frames
FUSED_KEY_BYTES = 64 << 10  # a key part up to this size may be pushed and pulled in a PUSHPULL
MAX_FUSED = 1024  # keys in one PUSHPULL (protocol.schema admits MAX_FUSED_KEYS)
TICK = 0.05  # seconds between two looks for silent servers and overdue resends (`tick`)


class DistError(TfkvError, RuntimeError):
    """A server refused a request; the message is the server's."""


def _seqs(start: int = 1) -> Iterator[int]:
    """Request numbers as a header carries them: `start`, ... 2**32 - 1, then 1 again (never 0)."""
    while True:
        yield from range(start, P.SEQ_MASK + 1)
        start = 1


def _before(seq: int, probe: int) -> bool:
    """Whether request `seq` was sent before request `probe`, across the wrap of 32 bits."""
    return 0 < (probe - seq) & P.SEQ_MASK < 1 << 31


def _log_ciphers(sessions: list[channel.Session]) -> None:
    """Say which cipher seals the data plane, and why not AEGIS-128X4 where it is not."""
    names = Counter(s.cipher.NAME for s in sessions)
    line = "; ".join(f"{name} with {n} of {len(sessions)} server(s)" for name, n in names.items())
    if aead.Aegis128X4 not in aead.available():
        line += " (AEGIS-128X4 needs the `aeg` package, not installed here: pip install 'tfkv[aegis]')"
    elif aead.AesGcm256.NAME in names:
        line += " (AEGIS-128X4 where both ends have the `aeg` package: a server lacks it)"
    log.info("data plane sealed with %s", line)


class Member:
    """A fused member's value, as `replies` holds it (a PULL reply's `data`, without a Message per key)."""

    __slots__ = ("data",)

    def __init__(self, data: np.ndarray):
        self.data = data


class ServerLink:
    """The sockets to every server of the job (in the scheduler's order) and the requests in flight."""

    def __init__(self, env: ClusterEnv, link: SchedulerLink, key_name: Callable[[int], Hashable] = lambda kid: kid):
        self.env, self.link = env, link
        self.key_name = key_name  # a key id's name as the caller gave it (for messages)
        ctx = zmq.Context.instance()
        self.socks = []
        self._poller = zmq.Poller()
        for server in self.link.servers:
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
        # Requests queued per server and sent together (`flush`): one ZeroMQ message for a batch of
        # small ones. Each ZeroMQ message costs a wakeup of the app's, libzmq's I/O and pyzmq's
        # garbage-collector threads on both ends (~65 us of CPU per process here, ~200 KB of wire time).
        self._outbox: list[list[Any]] = [[] for _ in self.socks]
        self._outbytes = [0] * len(self.socks)
        # Small keys' push+pull pairs staged per server, sent as one PUSHPULL (`pushpull`): one
        # request and one reply for many keys, so neither end pays a message's decoding, dispatch
        # and encoding per key. The members' own pull seqs are what callers wait for.
        # (key, data, the member PULL's seq)
        self._staged: list[list[tuple[int, Any, int]]] = [[] for _ in self.socks]
        self._staged_bytes = [0] * len(self.socks)
        self._groups: dict[int, list[tuple[int, int]]] = {}  # PUSHPULL seq -> (member pull seq, values)
        self.refused = 0  # replies (and handshake answers) that failed authentication (dropped)
        self.sessions: list[channel.Session] | None = self._handshake() if env.keys is not None else None
        # Sequence numbers as the header carries them (32 bits, protocol.HEADER): wrapping here
        # too, a job past 2**32 requests (430,000 steps of a 10,000-key model) still matches
        # every reply to its request. Requests in flight are never 2**31 apart.
        self.seq = _seqs()
        self.pending: dict[int, list[Any]] = {}  # seq -> [server, frames, sent_at]
        self._awaited = [0] * len(self.socks)  # per server: its requests in `pending`
        self._heard = [0.0] * len(self.socks)  # per server: when it last answered (or we began to wait)
        self._probes: dict[int, tuple[int, float]] = {}  # server -> (seq, sent_at) of a PING in flight
        self.replies: dict[int, P.Message] = {}  # data replies not yet taken by the caller
        # Secure job: where a PULL reply's payload is opened (its pull's destination, `land`).
        self._landing: dict[int, tuple[np.ndarray, int, int]] = {}  # seq -> (bytes, dtype code, itemsize)
        self.unsynced: set[int] = set()  # servers with pushes not yet known to be applied
        self._next_tick = 0.0  # when `tick` next looks
        # Sockets are not thread-safe: pushpull_async may run on a TensorFlow op's thread.
        self.lock = threading.RLock()

    @property
    def count(self) -> int:
        return len(self.socks)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()

    def _handshake(self) -> list[channel.Session]:
        """Open a session with every server (HELLO, resent until WELCOME: a lossy network may drop
        either); a server that does not answer in time is not of this job, or not there."""
        psk = handshake.psk(self.env.keys.secret)
        hellos = [handshake.Hello(psk) for _ in self.socks]
        sessions: list[channel.Session | None] = [None] * len(self.socks)
        wait = max(30.0, 5 * self.env.heartbeat_timeout)
        deadline, resend = time.monotonic() + wait, 0.0
        while None in sessions:
            now = time.monotonic()
            if now > deadline:
                server = sessions.index(None)
                raise DistError(f"{self._server_name(server)} did not complete the data plane's handshake in "
                                f"{wait:.0f} s: it is not of this job (other keys), not reachable, or its clock "
                                f"is more than {handshake.FRESH:.0f} s from this host's (its log says which)")
            if now >= resend:
                for i, sock in enumerate(self.socks):
                    if sessions[i] is None:
                        if hellos[i].stale():
                            hellos[i] = handshake.Hello(psk)
                        sock.send_multipart(hellos[i].message)
                resend = now + 1.0
            for sock, _ in self._poller.poll(100):
                i = self._index[sock]
                frames = sock.recv_multipart()
                if sessions[i] is None:
                    try:
                        sessions[i] = hellos[i].welcome(frames)
                    except channel.Refused as e:
                        self.refused += 1
                        log.warning("refused a handshake answer from %s: %s", self._server_name(i), e)
        _log_ciphers(sessions)  # type: ignore[arg-type]
        return sessions  # type: ignore[return-value]

    def _put(self, server: int, frames: list[Any]) -> None:
        """Send a request's frames, sealed for its server in a secure job (piece by piece)."""
        if self.sessions is None:
            wire.send(self.socks[server], frames)
            return
        for piece in self.sessions[server].seal(frames):
            wire.send(self.socks[server], piece)

    def fusable(self, nbytes: int) -> bool:
        """Whether a key part of `nbytes` may go in a PUSHPULL (`pushpull`)."""
        return 0 < nbytes <= FUSED_KEY_BYTES and self.env.fusion_bytes > 0 and not self.env.resend

    def pushpull(self, server: int, key: int, data: Any) -> int:
        """Push `data` (float32) to server-side `key` and request its value back, staged with the
        server's other small keys into one PUSHPULL; returns the sequence number whose reply (a
        PULL of this key's value) `replies` gets. Not acknowledged, not resent (`fusable`)."""
        with self.lock:
            seq = next(self.seq)
            # Awaited as the member's own PULL of `key`, which a lost reply's message names
            # (_describe); never resent (`fusable`), so no frames are made for it.
            self._track(server, seq, key)
            staged = self._staged[server]
            staged.append((key, data, seq))
            self._staged_bytes[server] += data.nbytes
            if self._staged_bytes[server] >= self.env.fusion_bytes or len(staged) >= MAX_FUSED:
                self._send_staged(server)
        return seq

    def _send_staged(self, server: int) -> None:
        staged, self._staged[server], self._staged_bytes[server] = self._staged[server], [], 0
        if len(staged) == 1:  # one key: a PUSHPULL of the header's key, answered as its PULL (no key list)
            key, data, seq = staged[0]
            one = P.Message(P.Type.PUSHPULL, sender=self.link.id, seq=seq, key=key, data=data)
            self._queue(server, P.encode(one), data.nbytes)
            return
        msg = P.Message(P.Type.PUSHPULL, sender=self.link.id, seq=next(self.seq), meta={"keys": [s[0] for s in staged]},
                        data=np.concatenate([s[1] for s in staged]))
        self._groups[msg.seq] = [(seq, data.size) for _, data, seq in staged]
        self._queue(server, P.encode(msg), msg.data.nbytes)

    def _queue(self, server: int, frames: list[Any], nbytes: int) -> None:
        box = self._outbox[server]
        box.extend(frames)
        self._outbytes[server] += nbytes
        if self._outbytes[server] >= self.env.fusion_bytes or len(box) >= MAX_BATCH_FRAMES:
            self._flush_server(server)

    def _flush_server(self, server: int) -> None:
        frames, self._outbox[server], self._outbytes[server] = self._outbox[server], [], 0
        self._put(server, frames)

    def flush(self) -> None:
        """Send the requests queued for every server (each server's as one ZeroMQ message)."""
        with self.lock:
            for server, staged in enumerate(self._staged):
                if staged:
                    self._send_staged(server)
            for server, box in enumerate(self._outbox):
                if box:
                    self._flush_server(server)

    def _take(self, server: int) -> list[Any] | None:
        """The protocol frames of the next message from `server` (zmq.Again if there is none),
        opened in a secure job; None if it failed the channel's checks (dropped, counted) or is a
        piece of a message still arriving."""
        frames = wire.recv(self.socks[server], zmq.NOBLOCK)
        if self.sessions is None:
            return frames
        try:
            return self.sessions[server].open(frames, self._into if self._landing else None)
        except channel.Refused as e:  # a duplicate WELCOME too: dropped, as anything refused
            self.refused += 1
            log.warning("refused a message from %s: %s", self._server_name(server), e)
            return None

    def land(self, seq: int, dest: np.ndarray | None) -> bool:
        """In a secure job, open the PULL reply to request `seq` straight into `dest` (a
        contiguous array of the key's dtype and the part's size), not into its received buffer
        for the caller to copy: one pass less over every pulled byte. A reply that fails
        authentication leaves it zeroed; the pull is then not complete (a lost reply). True if
        it will be (the request is awaited and the job secure); `unland` ends it."""
        if self.sessions is None or dest is None or seq not in self.pending:
            return False
        self._landing[seq] = (dest.reshape(-1).view(np.uint8), P.DTYPE_CODES[dest.dtype], dest.itemsize)
        return True

    def unland(self, seq: int) -> None:
        self._landing.pop(seq, None)

    def _into(self, head: memoryview, frame: int, size: int) -> np.ndarray | None:
        """channel.Session.open's `into`: the payload of a PULL reply to a request `land`ed."""
        if len(head) != P.HEADER.size:
            return None
        magic, version, kind, flags, dtype, _, seq, _, count = P.HEADER.unpack(head)
        landing = self._landing.get(seq)
        if (landing is None or magic != P.MAGIC or kind != P.Type.PULL or dtype != landing[1]
                or flags & (P.FLAG_META | P.FLAG_DATA | P.FLAG_REPLY) != P.FLAG_DATA | P.FLAG_REPLY
                or not landing[0].nbytes == size == count * landing[2]):
            return None
        return landing[0]

    def send(self, server: int, msg: P.Message, track: bool = True) -> int:
        """Queue a request for `server` (sent at `flush`, at the next wait, or once FUSION_BYTES
        are queued); `track`: wait for (and, under PS_RESEND, retransmit until) its answer."""
        with self.lock:
            msg.sender, msg.seq = self.link.id, next(self.seq)
            frames = P.encode(msg)
            size = sum(memoryview(f).nbytes for f in frames)
            if size > self.env.max_message_bytes:
                # A server drops an oversized message unread (and the connection with it): say so
                # here instead of waiting for an answer that cannot come.
                raise ValueError(f"{msg.type.name} of key {msg.key} is {size} bytes, over TFKV_MAX_MESSAGE_BYTES="
                                 f"{self.env.max_message_bytes}; raise it or lower MXNET_KVSTORE_BIGARRAY_BOUND "
                                 "so big arrays are split across more servers")
            if self._staged[server]:  # requests to a server go in the order they were made
                self._send_staged(server)
            self._queue(server, frames, size)
            if track:
                self._track(server, msg.seq, frames)
        return msg.seq

    def _track(self, server: int, seq: int, frames: list[Any] | int) -> None:
        """Await the answer to request `seq` (its `frames` kept to resend and to name it; a fused
        member's server-side key instead, which is never resent)."""
        now = time.monotonic()
        self.pending[seq] = [server, frames, now]
        if not self._awaited[server]:
            self._heard[server] = now  # silence counts from when we begin to wait
        self._awaited[server] += 1

    def _answered(self, seq: int) -> list[Any] | None:
        """Retire a request: its `pending` entry, None if it was not (or no longer) awaited."""
        entry = self.pending.pop(seq, None)
        if entry is not None:
            self._awaited[entry[0]] -= 1
        return entry

    def receive(self, timeout_ms: float) -> list[int]:
        """Take what the servers sent (waiting up to `timeout_ms` for the first of it, after
        sending what is queued); return the sequence numbers of the data replies now in `replies`."""
        with self.lock:
            if timeout_ms:
                self.flush()
            return self._receive_locked(timeout_ms)

    def _receive_locked(self, timeout_ms: float) -> list[int]:
        arrived: list[int] = []
        error: DistError | None = None  # raised once the batch it came in is taken whole
        ready = self._poller.poll(timeout_ms)
        while ready:
            for sock, _ in ready:
                server = self._index[sock]
                try:
                    frames = self._take(server)
                except zmq.Again:
                    continue
                if frames is None:
                    continue
                self._heard[server] = time.monotonic()
                for message in P.split(frames):
                    error = self._arrived(server, message, arrived) or error
            if error is not None:
                raise error
            # Whatever came meanwhile: a poll, where a receive that finds nothing raises (3x the cost);
            # none once nothing is awaited (a late answer waits for the next receive).
            ready = self._poller.poll(0) if self.pending else []
        return arrived

    def _arrived(self, server: int, frames: Sequence[Any], arrived: list[int]) -> DistError | None:
        """Take one reply: a data reply into `replies` (its seq appended to `arrived`); an ERROR
        comes back as the DistError to raise, after the rest of its batch."""
        try:
            msg = P.decode(frames, self.env.max_message_bytes // 4)
        except P.ProtocolError as e:
            log.warning("dropped a malformed reply from server %d: %s", server, e)
            return None
        members = self._groups.pop(msg.seq, None) if msg.type in (P.Type.PUSHPULL, P.Type.ERROR) else None
        if msg.type == P.Type.ERROR:  # also for untracked pushes
            self._answered(msg.seq)
            for seq, _ in members or ():
                self._answered(seq)
            meta = msg.meta or {}
            error = DistError(f"server {server}: {meta.get('message')}")
            return reacting(error) if "left" in meta else error
        if msg.type == P.Type.PUSHPULL:  # each member's value, as the PULL reply it awaits
            if members is None or msg.data.size != sum(n for _, n in members):
                log.warning("dropped a PUSHPULL reply from server %d that answers no request of this worker", server)
                return None
            offset, data = 0, msg.data
            for seq, n in members:
                if self._answered(seq) is not None:
                    self.replies[seq] = Member(data[offset:offset + n])
                    arrived.append(seq)
                offset += n
            return None
        if self._answered(msg.seq) is None:
            return None  # a late answer to a request already answered (resend)
        if msg.type == P.Type.PING:
            if self._probes.get(server, (None,))[0] == msg.seq:
                del self._probes[server]
                self._check_held(server, msg.seq, msg.meta["held"])
        elif msg.type != P.Type.ACK:
            self.replies[msg.seq] = msg
            arrived.append(msg.seq)
        return None

    # -- a request that gets no answer -----------------------------------------------------------
    #
    # A dist_sync pull may wait as long as the slowest worker takes to push, so waiting has no
    # deadline of its own. Instead, a server this worker has awaited in silence for a heartbeat
    # timeout is asked (PING) how many of this worker's requests it holds: one connection is
    # served in order, so every request sent before the PING has by its answer been either
    # answered or held (a pull parked until its round closes). More awaited than held: a reply
    # was lost, fail now naming it. No answer to the PING, nor any other reply, within
    # TFKV_REQUEST_TIMEOUT: the server is alive (it heartbeats) but does not serve, fail naming
    # it too.

    def _describe(self, seq: int) -> str:
        server, frames, sent_at = self.pending[seq]
        if isinstance(frames, int):  # a fused member: its PULL
            kind, skey = P.Type.PULL, frames
        else:
            head = P.HEADER.unpack(bytes(memoryview(frames[0])))
            kind, skey = P.Type(head[2]), head[7]
        kid, chunk = skey % (1 << CHUNK_SHIFT), skey >> CHUNK_SHIFT
        key = self.key_name(kid)  # the caller's name for it
        part = f" (part {chunk})" if chunk else ""
        return (f"{kind.name} of key {key!r}{part} (request {seq}, sent "
                f"{time.monotonic() - sent_at:.1f} s ago)")

    def _server_name(self, server: int) -> str:
        where = self.link.servers[server]
        return f"server {server} at {where['host']}:{where['port']}"

    def _check_held(self, server: int, probe: int, held: int) -> None:
        if self.env.resend:
            return  # under PS_RESEND a lost request or reply is sent again instead
        before = sorted((seq for seq, e in self.pending.items() if e[0] == server and _before(seq, probe)),
                        key=lambda seq: self.pending[seq][2])  # oldest first
        if len(before) > held:
            raise DistError(f"{self._server_name(server)} did not answer {self._describe(before[0])} and "
                            f"holds {held} of the {len(before)} requests this worker awaits from it: the reply "
                            "was lost")

    def _watch_servers(self) -> None:
        now = time.monotonic()
        for server, awaited in enumerate(self._awaited):
            probe = self._probes.get(server)
            if probe is not None:
                # From the last reply heard, not from the PING: a busy server still answering
                # the requests queued ahead of the PING is serving.
                if now - max(probe[1], self._heard[server]) > self.env.request_timeout:
                    oldest = min((seq for seq, e in self.pending.items() if e[0] == server),
                                 key=lambda seq: self.pending[seq][2])
                    raise DistError(f"{self._server_name(server)} has answered nothing for "
                                    f"{now - self._heard[server]:.0f} s, not even a PING sent "
                                    f"{now - probe[1]:.0f} s ago, while this worker awaits "
                                    f"{self._describe(oldest)}; it is alive but not serving (raise "
                                    "TFKV_REQUEST_TIMEOUT if it is only slow)")
            elif awaited and now - self._heard[server] > self.env.heartbeat_timeout:
                self._probes[server] = (self.send(server, P.Message(P.Type.PING)), now)

    def tick(self) -> None:
        """What a wait does between polls: resend (PS_RESEND), ask silent servers. At most every
        TICK seconds: both look for silence of a second or more, and a wait of many quick replies
        calls this after each."""
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + min(TICK, self.env.resend_timeout / 2)
        with self.lock:
            if self.env.resend:
                self._resend_overdue_locked()
            self._watch_servers()

    def _resend_overdue_locked(self) -> None:
        now = time.monotonic()
        for seq, entry in self.pending.items():
            if now - entry[2] > self.env.resend_timeout:
                if self.env.verbose >= 1:
                    log.info("resending request %d to server %d", seq, entry[0])
                self._put(entry[0], entry[1])
                entry[2] = now

    def wait(self, seqs: Sequence[int] | None = None) -> None:
        """Wait for the answers to `seqs` (default: everything outstanding); data replies stay
        in `replies` for the caller to take."""
        if seqs is None and self.unsynced:
            # Pushes are not acknowledged: a PING answered after them proves they were applied
            # (one connection, one serving thread), before a barrier lets another worker pull.
            for server in sorted(self.unsynced):
                self.send(server, P.Message(P.Type.PING))
            self.unsynced.clear()
        self.flush()
        wanted = list(self.pending) if seqs is None else list(seqs)
        tick = min(100.0, self.env.resend_timeout * 1000)
        i = 0
        while i < len(wanted):  # each answered one is passed once (any() rescanned them: 100,000 keys)
            if wanted[i] in self.pending:
                self.receive(tick)
                self.tick()
            else:
                i += 1
