"""A worker's link to the servers: requests numbered, sent through the transport and awaited.

Its user is `tfkv.ps.kvworker.KVWorker`, which turns a store's keys and arrays into requests:
`request` sends a request whose answer it awaits, `push` a key part's push (unacknowledged,
unless PS_RESEND asks every request to be acknowledged and resent until it is), `pushpull` a
small key's push and pull staged with its server's other small keys into one PUSHPULL,
`exchange` the order of several keys' pushes and pulls (PUSHPULLs, or under PS_RESEND pushes,
then pulls once the pushes are acknowledged); `wait`
blocks until given requests are answered and `take` hands over a reply; `settle` waits for
everything sent, pushes included; `gather` completes pulls as their last part arrives. Below it
are the transport (tfkv.ps.transport.worker: sockets, sealing, batching, resend) and the tracker
(tfkv.ps.tracker: what is awaited, and a lost reply or a silent server named). Whether requests
are resent is read once, here, from the transport (`transport.resends`), and decided on here only. Waiting has no deadline of its
own (a dist_sync pull waits for the slowest worker)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Hashable, Iterator, NamedTuple, Sequence, TypeVar

import numpy as np
import zmq

from tfkv.errors import reacting
from tfkv.ps import protocol as P
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.parts import Pull, RowPull
from tfkv.ps.scheduler_link import SchedulerLink
from tfkv.ps.tracker import Tracker, seqs
from tfkv.ps.transport import worker as transport
from tfkv.ps.transport.worker import DistError

__all__ = ["DistError", "ServerLink"]

log = logging.getLogger("tfkv.ps")

MAX_FUSED = 1024  # keys in one PUSHPULL (protocol.schema admits MAX_FUSED_KEYS)
T = TypeVar("T")  # what a caller of `exchange` sends a push and pull of
TICK = 0.05  # seconds between two looks for connections made again, silent servers and overdue resends (`_tick`)


class Member:
    """A fused member's value, as a reply is held (a PULL reply's `data`, without a Message per key)."""

    __slots__ = ("data",)

    def __init__(self, data: np.ndarray):
        self.data = data


class Staged(NamedTuple):
    """A small key's push+pull waiting to go in its server's next PUSHPULL."""

    skey: int
    data: np.ndarray  # float32
    seq: int  # the member's own PULL, which the caller awaits


_staged = tuple.__new__  # a NamedTuple made without its generated __new__: a key's cost stays a tuple's


class ServerLink:
    """The requests of this worker to every server of the job (in the scheduler's order)."""

    def __init__(self, env: ClusterEnv, link: SchedulerLink, key_name: Callable[[int], str] = lambda kid: f"key {kid}"):
        self.env, self.id = env, link.id
        self.transport = transport.connect(env, link.servers, link.id)
        self._acked = self.transport.resends  # PS_RESEND: pushes acknowledged (and resent until they are)
        # Under PS_RESEND a lost request or reply is sent again: a PING's count names none lost.
        self.tracker = Tracker(env, link.servers, key_name, lost_fails=not self._acked)
        self.lock = self.transport.lock  # hold it to make several calls one (the sockets are not thread-safe)
        # Small keys' push+pull pairs staged per server, sent as one PUSHPULL (`pushpull`): one
        # request and one reply for many keys, so neither end pays a message's decoding, dispatch
        # and encoding per key. The members' own pull seqs are what callers wait for.
        self._staged: list[list[Staged]] = [[] for _ in link.servers]
        self._staged_bytes = [0] * len(link.servers)
        self._groups: dict[int, list[Staged]] = {}  # PUSHPULL seq -> its members
        self.seq = seqs()  # the next request's number
        self._replies: dict[int, P.Message | Member] = {}  # data replies not yet taken
        # A pull reply's values as `gather` completes it (tfkv.ps.copies.Copies.decode, under both_ways)
        self.decoding: Callable[[int, Any], np.ndarray] | None = None
        self._unsynced: set[int] = set()  # servers with pushes not yet known to be applied
        # Retiring an answered request: under PS_RESEND the transport stops resending it too.
        self._answered = self._answered_resent if self._acked else self.tracker.answered
        self._next_tick = 0.0  # when `_tick` next looks

    @property
    def count(self) -> int:
        return self.transport.count

    @property
    def sessions(self) -> list | None:
        """The data plane's sessions, one per server (None in a plain job)."""
        return self.transport.sessions

    def close(self) -> None:
        self.transport.close()

    def exchange(self, items: list[T], together: Callable[[T], Any], push: Callable[[T], None],
                 pull: Callable[[T], Any]) -> list:
        """Each item's push and pull, in order, without waiting: as one request each
        (`together`, a PUSHPULL), or, when requests are acknowledged and resent (PS_RESEND), as
        two: every push, then, once each is acknowledged (`fence`), every pull, which must not
        overtake a push that was lost and is being resent. The pulls (what `together` or `pull`
        return)."""
        if not self._acked:
            return [together(item) for item in items]
        for item in items:
            push(item)
        self.fence()
        return [pull(item) for item in items]

    # -- sending -------------------------------------------------------------------------------

    def request(self, server: int, msg: P.Message, awaited: bool = True) -> int:
        """Send a request to `server` (at `flush`, at the next wait, or once FUSION_BYTES are
        queued) and await its answer (unless not `awaited`); its sequence number."""
        with self.lock:
            msg.sender, msg.seq = self.id, next(self.seq)
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
            if awaited:
                self.transport.send(server, frames, size, msg.seq)
                self.tracker.track(server, msg.seq, msg.type, msg.key)
            else:
                self.transport.send(server, frames, size)
        return msg.seq

    def push(self, server: int, msg: P.Message) -> None:
        """Send a key part's PUSH. Not acknowledged, so not awaited: a PING before the next
        barrier proves it applied (`settle`). Under PS_RESEND acknowledged, and resent until it is."""
        msg.want_ack = self._acked  # see Server._ack_push
        self.request(server, msg, self._acked)
        if not self._acked:
            self._unsynced.add(server)

    def pushpull(self, server: int, skey: int, data: np.ndarray) -> int:
        """Push `data` (float32) to server-side `skey` and request its value back, staged with
        the server's other small keys into one PUSHPULL; the sequence number whose reply (a PULL
        of this key's value) `gather` gets. Not acknowledged, not resent (never under PS_RESEND: `exchange`)."""
        with self.lock:
            seq = next(self.seq)
            # Awaited as the member's own PULL of `skey`, which a lost reply's message names.
            self.tracker.track(server, seq, P.Type.PULL, skey)
            staged = self._staged[server]
            staged.append(_staged(Staged, (skey, data, seq)))
            self._staged_bytes[server] += data.nbytes
            self._unsynced.add(server)
            if self._staged_bytes[server] >= self.env.fusion_bytes or len(staged) >= MAX_FUSED:
                self._send_staged(server)
        return seq

    def fence(self) -> None:
        """Before pulls of keys just pushed. One connection delivers in order, so a pull cannot
        overtake its key's push, unless that push was lost and is being resent (PS_RESEND):
        then wait until it is acknowledged."""
        if self._acked:
            self.settle()

    def flush(self) -> None:
        """Send what is staged and queued for every server (each server's as one ZeroMQ message)."""
        with self.lock:
            for server, staged in enumerate(self._staged):
                if staged:
                    self._send_staged(server)
            self.transport.flush()

    def _send_staged(self, server: int) -> None:
        staged, self._staged[server], self._staged_bytes[server] = self._staged[server], [], 0
        if len(staged) == 1:  # one key: a PUSHPULL of the header's key, answered as its PULL (no key list)
            one = staged[0]
            msg = P.Message(P.Type.PUSHPULL, sender=self.id, seq=one.seq, key=one.skey, data=one.data)
            self.transport.send(server, P.encode(msg), one.data.nbytes)
            return
        msg = P.Message(P.Type.PUSHPULL, sender=self.id, seq=next(self.seq), meta={"keys": [s.skey for s in staged]},
                        data=np.concatenate([s.data for s in staged]))
        self._groups[msg.seq] = staged
        self.transport.send(server, P.encode(msg), msg.data.nbytes)

    # -- waiting -------------------------------------------------------------------------------

    def poll(self) -> None:
        """Take the answers already here (so a server's error surfaces early), without waiting."""
        self._receive(0)

    def wait(self, seqs: Sequence[int]) -> None:
        """Wait for the answers to `seqs`; data replies are kept for `take`."""
        self.flush()
        wanted = list(seqs)
        tick = min(100.0, self.env.resend_timeout * 1000)
        i = 0
        pending = self.tracker.pending
        while i < len(wanted):  # each answered one is passed once (any() rescanned them: 100,000 keys)
            if wanted[i] in pending:
                self._receive(tick)
                self._tick()
            else:
                i += 1

    def settle(self) -> None:
        """Wait for everything sent: every request's answer, and every push applied (pushes
        are not acknowledged: a PING answered after them proves they were, as one connection
        is served in order, before a barrier lets another worker pull)."""
        for server in sorted(self._unsynced):
            self.request(server, P.Message(P.Type.PING))
        self._unsynced.clear()
        self.wait(list(self.tracker.pending))

    def take(self, seq: int) -> P.Message:
        """The reply to request `seq`, once `wait` has seen it answered."""
        return self._replies.pop(seq)

    def gather(self, pulls: Sequence[Pull | RowPull]) -> Iterator[tuple[Hashable, Any]]:
        """(key, value) of each of `pulls` (a key's parts, or a table's rows) as soon as all of
        its parts have arrived (in arrival order), the value delivered into the pull's outs: the
        one way every pull completes."""
        waiting = {seq: p for p in pulls for seq in p.seqs}
        landed = self.transport.land(pulls, self._landable)
        try:
            replies, decoding = self._replies, self.decoding
            arrived = [seq for seq in waiting if seq in replies]
            tick = min(100.0, self.env.resend_timeout * 1000)
            while True:
                for seq in arrived:
                    p = waiting.pop(seq, None)
                    if p is not None and p.arrive(seq, replies.pop(seq).data if decoding is None
                                                  else decoding(seq, replies.pop(seq))):
                        p.deliver()
                        yield p.key, p.value
                if not waiting:
                    return
                arrived = self._receive(tick)
                self._tick()
        finally:  # a wait given up (an error, a generator dropped) lands nothing later
            self.transport.unland(landed)

    def _landable(self, seq: int) -> bool:
        return seq not in self._replies and seq in self.tracker.pending

    # -- receiving -----------------------------------------------------------------------------

    def _receive(self, timeout_ms: float) -> list[int]:
        """Take what the servers sent (waiting up to `timeout_ms` for the first of it, after
        sending what is queued); the sequence numbers of the data replies now kept."""
        with self.lock:
            if timeout_ms:
                self.flush()
            arrived: list[int] = []
            error: DistError | None = None  # raised once the batch it came in is taken whole
            ready = self.transport.ready(timeout_ms)
            while ready:
                for server in ready:
                    try:
                        frames = self.transport.take(server)
                    except zmq.Again:
                        continue
                    if frames is None:
                        continue
                    self.tracker.heard(server)
                    for message in P.split(frames):
                        error = self._arrived(server, message, arrived) or error
                if error is not None:
                    raise error
                # Whatever came meanwhile: a poll, where a receive that finds nothing raises (which
                # costs more); none once nothing is awaited (a late answer waits for the next receive).
                ready = self.transport.ready(0) if self.tracker.pending else []
            return arrived

    def _answered_resent(self, seq: int) -> bool:
        """`_answered` under PS_RESEND: retire request `seq`; False if it was not (or no longer) awaited."""
        if self.tracker.answered(seq):
            self.transport.answered(seq)
            return True
        return False

    def _arrived(self, server: int, frames: Sequence[Any], arrived: list[int]) -> DistError | None:
        """Take one reply: a data reply kept (its seq appended to `arrived`); an ERROR comes back
        as the DistError to raise, after the rest of its batch."""
        try:
            msg = P.decode(frames, self.env.max_message_bytes // 4)
        except P.ProtocolError as e:
            log.warning("dropped a malformed reply from server %d: %s", server, e)
            return None
        members = self._groups.pop(msg.seq, None) if msg.type in (P.Type.PUSHPULL, P.Type.ERROR) else None
        if msg.type == P.Type.ERROR:  # also for untracked pushes
            self._answered(msg.seq)
            for member in members or ():
                self._answered(member.seq)
            meta = msg.meta or {}
            error = DistError(f"server {server}: {self.tracker.named(str(meta.get('message')))}")
            return reacting(error) if "left" in meta else error
        if msg.type == P.Type.PUSHPULL:  # each member's value, as the PULL reply it awaits
            if members is None or msg.data.size != sum(m.data.size for m in members):
                log.warning("dropped a PUSHPULL reply from server %d that answers no request of this worker", server)
                return None
            offset, data = 0, msg.data
            for member in members:
                n = member.data.size
                if self._answered(member.seq):
                    self._replies[member.seq] = Member(data[offset:offset + n])
                    arrived.append(member.seq)
                offset += n
            return None
        if not self._answered(msg.seq):
            return None  # a late answer to a request already answered (resend)
        if msg.type == P.Type.PING:
            self.tracker.probed(server, msg.seq, msg.meta["held"])
        elif msg.type != P.Type.ACK:
            self._replies[msg.seq] = msg
            arrived.append(msg.seq)
        return None

    def _tick(self) -> None:
        """What a wait does between polls: a new handshake on a connection made again, resend
        (PS_RESEND), ask silent servers. At most every TICK seconds: they look for events of a
        second or more, and a wait of many quick replies calls this after each."""
        now = time.monotonic()
        if now < self._next_tick:
            return
        self._next_tick = now + min(TICK, self.env.resend_timeout / 2)
        with self.lock:
            self.transport.watch()
            self.transport.resend_overdue()
            for server in self.tracker.watch():
                self.tracker.probe(server, self.request(server, P.Message(P.Type.PING)), now)
