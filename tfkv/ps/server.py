"""A parameter server: holds its share of the keys and applies what workers push.

Synchronous mode (`dist_sync*`): pushes of a key are summed until every worker has pushed once;
then the optimizer runs (or the sum becomes the value, when workers update themselves), and
pulls that arrived meanwhile from workers who pushed are answered with the new value. A worker
that pushes the same key twice before the round closes has the second push held for the next
round. Asynchronous mode (`dist_async*`): every push is applied on arrival; requests are handled
one at a time, so each update of a key is atomic.

A worker that finished (the scheduler's LEFT) pushes no more: an open round it has not pushed
into can never close, so every request waiting on it is answered at once with an ERROR naming
the key, the round and that worker, and so is any later push into such a round.

Pushes may arrive 2-bit compressed (protocol dtype TWOBIT); they are decoded to float32 with the
threshold a worker announced (SET_COMPRESSION) before they are summed. Summing arrays of at
least the big-array bound uses MXNET_KVSTORE_REDUCTION_NTHREADS threads, one slice each (numpy
releases the GIL in np.add), smaller ones stay on the serving thread.

A key holds the dtype its INIT carried (float32, float16 or bfloat16; tfkv.ps.dtypes) and takes
pushes of that dtype only. A half key's pushes are summed in float32 (as MXNet's servers may: the
sum of the workers' half values is then rounded once, at the end, not after every addition),
then stored, sent and updated in its dtype: without `multi_precision` the update
reads and writes half weights and state (MXNet's float16 update); with it the updater keeps a
float32 master copy (tfkv.ps.updater).

Requests are handled by one thread, in the order each connection delivers them. A malformed or
wrong-size request gets an ERROR reply and the server carries on; a connection no worker of the
job spoke on gets a few such replies, then none (tfkv.ps.strangers). A request seen before (same sender and sequence number, as resent
under PS_RESEND) is acknowledged again but never applied twice. No TensorFlow here.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import zmq

from tfkv import optim
from tfkv.errors import TfkvError
from tfkv.ps import channel, compression, dtypes, handshake, memory
from tfkv.ps import protocol as P
from tfkv.ps import security
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.updater import NumpyUpdater
from tfkv.ps.scheduler_link import SchedulerLink
from tfkv.ps import strangers, wire
from tfkv.ps.strangers import Strangers

log = logging.getLogger("tfkv.ps")

_DEDUP_WINDOW = 4096
_F32 = dtypes.FLOAT32
COPY_THRESHOLD = 64 << 10  # bytes: pyzmq's own default; frames from here up are sent zero-copy


class RequestError(TfkvError, ValueError):
    """The request cannot be served; its text goes back to the sender."""


@dataclass
class Fused:
    """A PUSHPULL's pulls: answered in one reply, the keys' values end to end, once every key's
    round has closed. Counted as len(keys) held requests meanwhile (the worker awaits one pull
    per key)."""

    identity: bytes
    request: P.Message
    keys: list[int]
    values: dict[int, np.ndarray] = field(default_factory=dict)


@dataclass
class GroupRound:
    """One synchronous round of a fused key set that the workers push as the same PUSHPULL (the
    same keys in the same order, as every worker of a data-parallel job stages them): summed as
    one buffer, closed at once, each worker answered with one buffer. It stands for the keys' own
    rounds opened and closed together, so any request that would see them apart first turns it
    into them (`Server._dissolve`), and those rounds (`Round`) remain the one definition of what a
    round does. A transformer-shaped key set's 192 small keys cost 6.7 us a key as rounds of their
    own: a message, a round, a slice and an add each."""

    keys: tuple[int, ...]
    sizes: list[int]
    merged: np.ndarray | None = None
    pushed: set[int] = field(default_factory=set)
    pulls: list[tuple[bytes, P.Message]] = field(default_factory=list)  # the PUSHPULLs to answer
    held: list[tuple[bytes, P.Message]] = field(default_factory=list)  # a sender's next one, for the next round


@dataclass
class Round:
    """One synchronous round of a key: who has pushed and what is waiting."""

    merged: np.ndarray | None = None
    pushed: set[int] = field(default_factory=set)
    pulls: list[tuple[bytes, P.Message | Fused]] = field(default_factory=list)
    # A PUSH or one-key PUSHPULL for the next round; a fused key's PUSH with the pull (Fused) that
    # waits for the round it goes into.
    held: list[tuple[bytes, P.Message, Fused | None]] = field(default_factory=list)


class Server:
    def __init__(self, env: ClusterEnv):
        self.env = env
        memory.keep_freed_buffers()  # the same large buffers every step (tfkv.ps.memory)
        # Workers' requests come on a plain socket and, in a secure job, every message is sealed
        # with this connection's keys (tfkv.ps.channel): CURVE's cipher ran at a 28th of AEGIS-128X4.
        self.sock = security.router_socket(None, P.max_frame(env.keys is not None, env.max_message_bytes))
        # A secure job's handshakes and the sessions they open, per connection (ROUTER identity).
        self.acceptor = handshake.Acceptor(handshake.psk(env.keys.secret)) if env.keys is not None else None
        self._outbox: dict[bytes, list[Any]] = {}  # replies queued per connection until `flush`
        self.refused: Counter[str] = Counter()  # messages refused by the channel, by reason
        self._refused_by: Counter[bytes] = Counter()
        # A reply to a peer that is gone raises (ROUTER_MANDATORY) and is logged, not lost unseen.
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Reply frames from 64 KiB up are sent without a copy (pyzmq's zero-copy send, released
        # by its helper thread); smaller ones are copied, cheaper than that release. The cap must
        # be below 1 MiB (a 512 x 512 weight): at 2 MiB with 1 MiB frames every reply was copied
        # (bench_security --mode plain, push+pull of 4 and 16 MiB: 0.9-1.1 GB/s copied, 1.2-1.5 zero-copy).
        self.sock.copy_threshold = COPY_THRESHOLD
        self.host = env.bind_address()
        self.port = self.sock.bind_to_random_port(f"tcp://{self.host}")
        # Behind NAT (or a test proxy) workers must connect elsewhere than where this binds.
        host, port = env.advertise or (self.host, self.port)
        self.link = SchedulerLink(env, "server", host, port)
        self.id = self.link.id
        self.workers = set(self.link.workers)
        self.sync = True
        self.updater: NumpyUpdater | None = None
        self.values: dict[int, np.ndarray] = {}
        self.rounds: dict[int, Round] = defaultdict(Round)
        self._grouped: dict[int, GroupRound] = {}  # key -> the open GroupRound it is in
        self._seen: dict[int, OrderedDict[int, None]] = defaultdict(OrderedDict)
        # Per sender: its requests held unanswered (pulls parked until their round closes,
        # acknowledged pushes held for the next round), what a PING answers with.
        self._held: Counter[int] = Counter()
        self._left: dict[int, str] = {}  # workers that finished (LEFT), by id: their names
        self._rounds_closed: Counter[int] = Counter()  # per key: the round numbers in errors
        self.max_count = env.max_message_bytes // 4
        self.threshold: float | None = None  # of 2-bit pushes, once a worker set compression
        self._pool: ThreadPoolExecutor | None = None
        # Connections a worker of the job sent a well-formed request on: answered whatever they
        # send. Any other gets a few errors, then nothing (its replies would queue unread).
        self._members: set[bytes] = set()
        self._strangers = Strangers(self.link.name)
        log.info("%s listening on %s:%d", self.link.name, self.host, self.port)

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        # A receive that waits (up to 100 ms, to see a shutdown), not a poll and then a receive:
        # one call into libzmq less per message (~5 us of a 4 KiB round trip).
        self.sock.rcvtimeo = 100
        while not self.link.shutdown.is_set():
            if self.link.left:
                self._workers_left()
            try:
                frames = wire.recv(self.sock)
            except zmq.Again:
                continue
            identity, frames = frames[0].bytes, frames[1:]
            if self.acceptor is not None:
                frames = self._open(identity, frames)
                if frames is None:
                    continue
            for message in P.split(frames):
                if not self.handle(identity, message):
                    break  # a malformed message: what follows it in the batch cannot be trusted to line up
            self.flush()
        if self.refused:
            log.warning("%s: refused %d messages that failed the channel's checks (%s)", self.link.name,
                        sum(self.refused.values()), ", ".join(f"{k}: {v}" for k, v in sorted(self.refused.items())))
        if self.acceptor is not None:
            ciphers = Counter(s.cipher.NAME for s in self.acceptor.sessions.values())
            log.info("%s: data plane connections by cipher: %s", self.link.name,
                     ", ".join(f"{k}: {v}" for k, v in sorted(ciphers.items())) or "none")
        log.info("%s: shut down by the scheduler", self.link.name)
        return 0

    def _open(self, identity: bytes, frames: list[Any]) -> list[Any] | None:
        """A secure job's message as protocol frames, or None: a handshake (answered here), a piece
        of a message still arriving, or a message refused (dropped unanswered: who fails the
        checks cannot read an answer)."""
        try:
            if channel.envelope(frames)[0] == channel.HELLO:
                if not self._welcome(identity, self.acceptor.hello(identity, frames)):
                    self.acceptor.forget(identity)
                return None
            return self.acceptor.open(identity, frames)
        except channel.Refused as e:
            self.refused[e.reason] += 1
            # One line per refusal, naming the peer, for the first few of each of the first
            # connections: a stranger's connections cannot grow the log or this count without bound.
            seen = self._refused_by.get(identity)
            if seen is None and len(self._refused_by) >= strangers.MAX_PEERS:
                return None
            self._refused_by[identity] = (seen or 0) + 1
            if self._refused_by[identity] <= strangers.PER_PEER:
                peer = frames[0].get("Peer-Address") if frames and hasattr(frames[0], "get") else "?"
                log.warning("%s: refused a message from %s: %s", self.link.name, peer, e)
            return None

    def reply(self, identity: bytes, msg: P.Message) -> None:
        """Queue a reply: the replies to one received message (one batch) go back as one ZeroMQ
        message per peer, at `flush`; a payload of FUSION_BYTES or more sends them at once."""
        msg.sender = self.id
        frames = P.encode(msg)
        box = self._outbox.setdefault(identity, [])
        box.extend(frames)
        if msg.data is not None and msg.data.nbytes >= self.env.fusion_bytes:
            self._send(identity, self._outbox.pop(identity))

    def flush(self) -> None:
        """Send every queued reply, one ZeroMQ message per peer."""
        while self._outbox:
            identity, frames = self._outbox.popitem()
            self._send(identity, frames)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        if self.acceptor is None:
            sent = self._to(identity, frames)
        else:
            session = self.acceptor.sessions.get(identity)
            if session is None:
                return  # no connection of this job: nothing it could read
            # Each piece sent as soon as sealed (the worker opens it meanwhile); none sealed once
            # one finds its peer gone.
            sent = all(self._to(identity, piece) for piece in session.seal(frames))
        if not sent:
            head = P.HEADER.unpack(bytes(frames[0]))
            log.warning("%s: %s reply (request %d) not sent: its sender is no longer connected", self.link.name,
                        P.Type(head[2]).name, head[6])

    def _welcome(self, identity: bytes, answer: list[bytes]) -> bool:
        """Answer a HELLO; False if its peer left before the answer went."""
        if self._to(identity, answer):
            return True
        log.warning("%s: a WELCOME not sent: its peer disconnected after its HELLO", self.link.name)
        return False

    def _to(self, identity: bytes, frames: list[Any]) -> bool:
        """Send one ZeroMQ message to a connection; False if its peer is gone: the socket is
        ROUTER_MANDATORY, so a send to a connection that closed after its request raises
        EHOSTUNREACH, which must not end the loop (a worker that died, or a peer that sent a
        HELLO and left)."""
        try:
            wire.send(self.sock, [identity, *frames])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            return False
        return True

    def handle(self, identity: bytes, frames: Sequence[Any]) -> bool:
        """Serve one request; False if it was malformed (refused)."""
        try:
            msg = P.decode(frames, self.max_count)
        except P.ProtocolError as e:
            self._refuse(identity, P.refusal(frames, str(e)), f"a malformed request: {e}")
            return False
        if self.env.verbose >= 2:
            log.info("%s: %s key=%d from %d seq=%d (%s floats)", self.link.name, msg.type.name, msg.key,
                     msg.sender, msg.seq, 0 if msg.data is None else msg.data.size)
        if msg.sender not in self.workers:
            self._refuse(identity, P.error(msg, f"sender {msg.sender} is not a worker of this job"), "a stranger")
            return False
        self._members.add(identity)
        if msg.reply:
            self.reply(identity, P.error(msg, f"a {msg.type.name} reply sent to a server, which serves requests"))
            return True
        mutating = msg.type in (P.Type.PUSH, P.Type.PUSHPULL, P.Type.INIT, P.Type.SET_STATE, P.Type.SET_OPTIMIZER,
                                P.Type.CONFIGURE, P.Type.SET_COMPRESSION)
        if mutating and self._duplicate(msg):
            if msg.want_ack:
                self.reply(identity, P.ack(msg))
            return True
        try:
            handler = self._handlers.get(msg.type)
            if handler is None:
                raise RequestError(f"{msg.type.name} is not a request a server serves")
            handler(self, identity, msg)
        except RequestError as e:
            self.reply(identity, P.error(msg, str(e)))
        return True

    def _refuse(self, identity: bytes, error: P.Message, what: str) -> None:
        """Answer with `error`: always a member (a connection a worker of the job spoke on);
        anyone else only while its few answers last (tfkv.ps.strangers), then silently."""
        if identity in self._members or self._strangers.may_answer(identity):
            log.warning("%s: refused %s", self.link.name, what)
            self.reply(identity, error)

    def _duplicate(self, msg: P.Message) -> bool:
        seen = self._seen[msg.sender]
        if msg.seq in seen:
            return True
        seen[msg.seq] = None
        if len(seen) > _DEDUP_WINDOW:
            seen.popitem(last=False)
        return False

    # -- requests ------------------------------------------------------------------------------

    def _value(self, key: int) -> np.ndarray:
        value = self.values.get(key)
        if value is None:
            raise RequestError(f"key {key} is not initialised on this server")
        return value

    def _payload(self, msg: P.Message, size: int | None = None) -> np.ndarray:
        if msg.data is None:
            raise RequestError(f"{msg.type.name} carries no data")
        count = msg.count if msg.dtype == P.DType.TWOBIT else msg.data.size
        if size is not None and count != size:
            raise RequestError(f"key {msg.key}: {count} values pushed, the key holds {size}")
        if msg.dtype == P.DType.TWOBIT:  # decoded to float32, whatever the key's dtype
            if self.threshold is None:
                raise RequestError("a 2-bit compressed push, but no worker set gradient compression")
            try:
                return compression.unpack(msg.data, msg.count, self.threshold)
            except ValueError as e:
                raise RequestError(f"key {msg.key}: {e}") from None
        return msg.data

    def add(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """a + b into `out` (default: a fresh array); large arrays in slices over the reduction
        threads."""
        n = self.env.reduction_nthreads
        if n <= 1 or a.size < max(self.env.bigarray_bound, n):
            return np.add(a, b, out=out)
        if out is None:
            out = np.empty_like(a)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="tfkv-reduce")
        bounds = [i * a.size // n for i in range(n + 1)]
        slices = [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        list(self._pool.map(lambda s: np.add(a[s], b[s], out=out[s]), slices))
        return out

    # The control handlers read their metadata as protocol.decode left it: checked against the
    # message's schema (tfkv.ps.schema), so every field is there with its type and range.

    def on_configure(self, identity: bytes, msg: P.Message) -> None:
        self.sync = msg.meta["sync"]
        self.reply(identity, P.ack(msg))

    def on_set_compression(self, identity: bytes, msg: P.Message) -> None:
        setting = compression.parse(msg.meta)  # every kind sends the same words: only t decodes them
        self.threshold = None if setting is None else setting.threshold
        self.reply(identity, P.ack(msg))

    def on_set_optimizer(self, identity: bytes, msg: P.Message) -> None:
        opt = optim.from_dict(msg.meta["optimizer"])
        if self.updater is None or self.updater.optimizer != opt:
            self.updater = NumpyUpdater(opt)
        self.reply(identity, P.ack(msg))

    def on_init(self, identity: bytes, msg: P.Message) -> None:
        data = self._payload(msg)
        if msg.key not in self.values:  # the first init wins, as in MXNet
            self.values[msg.key] = data
        self.reply(identity, P.ack(msg))

    def on_push(self, identity: bytes, msg: P.Message) -> None:
        self._apart(msg.key)
        value = self._value(msg.key)
        data = self._payload(msg, value.size)
        if data.dtype != value.dtype and msg.dtype != P.DType.TWOBIT:
            raise RequestError(f"key {msg.key}: a {data.dtype.name} push to a {value.dtype.name} key (a key's dtype "
                               "is fixed at init)")
        if not self.sync:
            if self.updater is None:
                raise RequestError("dist_async needs an optimizer on the servers: without one each "
                                   "push would overwrite the weights; set update_on_kvstore=true")
            self.values[msg.key] = self.updater.update(msg.key, self.values[msg.key], data)
            self._ack_push(identity, msg)
            return
        r = self.rounds[msg.key]
        if msg.sender in r.pushed:
            self._hold(r, identity, msg)
            return  # acknowledged when its round opens
        if self._left and self._refuse_owed(identity, msg, (msg.key,)):
            return
        # The later pushes add into the first one's buffer: received (a zmq frame, or the channel's
        # opened frame) or decoded from 2 bits, it belongs to this round alone until the round
        # closes, and no stored value is ever written into (a reply may still be sending one).
        # A fresh array per round cost a 16 MiB key an allocation and its page faults per step.
        if r.merged is None:
            # A half key's sum is taken in float32 (a fresh array, writable): see the docstring.
            r.merged = data if data.dtype == _F32 else data.astype(_F32)
        elif r.merged.flags.writeable:
            self.add(r.merged, data, out=r.merged)
        else:  # a read-only buffer (bytes): the sum goes into a fresh array, later pushes into it
            r.merged = self.add(r.merged, data)
        r.pushed.add(msg.sender)
        self._ack_push(identity, msg)
        if len(r.pushed) == len(self.workers):
            self._close_round(msg.key, r)

    def _ack_push(self, identity: bytes, msg: P.Message) -> None:
        # Without PS_RESEND a push is not acknowledged: one connection delivers in order and one
        # thread serves it, so the answer to a later pull proves the push was applied.
        if msg.want_ack:
            self.reply(identity, P.ack(msg))

    def _close_round(self, key: int, r: Round) -> None:
        assert r.merged is not None
        value = self.values[key]
        if self.updater is not None:
            self.values[key] = self.updater.update(key, value, r.merged)
        else:
            self.values[key] = r.merged if value.dtype == _F32 else r.merged.astype(value.dtype)
        pulls, held = r.pulls, r.held
        self.rounds[key] = Round()
        self._rounds_closed[key] += 1
        for identity, pull in pulls:
            if isinstance(pull, Fused):
                self._fill(pull, key)
                continue
            self._held[pull.sender] -= 1
            self._answer_pull(identity, pull)
        for identity, push, pull in held:  # a PUSH, or a one-key PUSHPULL (held whole, answered when served)
            self._held[push.sender] -= _awaits_answer(push)
            if pull is not None:  # a fused key's push: its pull waits for the round it goes into
                self._push_member(identity, push, pull)
            else:
                self._handlers[push.type](self, identity, push)

    def _hold(self, r: Round, identity: bytes, msg: P.Message, pull: Fused | None = None) -> None:
        """Keep a sender's second push of a key (a PUSH or a one-key PUSHPULL) for the key's next
        round, with the fused pull that waits for it if any; counted as held while its sender
        awaits an answer to it."""
        r.held.append((identity, msg, pull))
        self._held[msg.sender] += _awaits_answer(msg)

    def _push_member(self, identity: bytes, push: P.Message, group: Fused) -> None:
        """A fused PUSHPULL's push of one key, then its pull, filled now or when the round the
        push went into closes. Pushed again before the key's round closed, the push waits for the
        next round and its pull with it (a pull answers after its own push, as a one-key
        PUSHPULL's does)."""
        self._apart(push.key)
        r = self._open_round(push.key, push.sender)
        if r is not None:
            self._hold(r, identity, push, group)
            return
        self.on_push(identity, push)
        r = self._open_round(push.key, push.sender)
        if r is not None:
            r.pulls.append((group.identity, group))
        else:
            self._fill(group, push.key)

    def _open_round(self, key: int, sender: int) -> Round | None:
        """The round a pull of `key` by `sender` waits for: one this sender has pushed into (sync)."""
        r = self.rounds.get(key)
        return r if self.sync and r is not None and sender in r.pushed else None

    def on_pull(self, identity: bytes, msg: P.Message) -> None:
        self._apart(msg.key)
        self._value(msg.key)
        r = self._open_round(msg.key, msg.sender)
        if r is not None:
            r.pulls.append((identity, msg))  # answered when the round closes
            self._held[msg.sender] += 1
            return
        self._answer_pull(identity, msg)

    def _answer_pull(self, identity: bytes, msg: P.Message) -> None:
        self.reply(identity, P.Message(P.Type.PULL, seq=msg.seq, key=msg.key, data=self.values[msg.key], reply=True))

    def on_pushpull(self, identity: bytes, msg: P.Message) -> None:
        """Keys pushed and pulled in one request. Without metadata, the header's key: served as
        its PUSH, then its PULL. Small keys fused: each key's push is served as a PUSH of its slice
        (the same rounds, held pushes and updates), its pull as a PULL whose value goes into one
        reply; checked whole before anything is applied."""
        if msg.meta is None:
            self._apart(msg.key)
            r = self._open_round(msg.key, msg.sender)
            if r is not None:  # its push waits for the next round (as a second PUSH would): its pull too
                self._hold(r, identity, msg)
                return
            if self._left and self.sync and self._refuse_owed(identity, msg, (msg.key,)):
                return
            self.on_push(identity, P.Message(P.Type.PUSH, msg.sender, msg.seq, msg.key, data=msg.data, dtype=msg.dtype,
                                             count=msg.count, want_ack=False))
            self.on_pull(identity, P.Message(P.Type.PULL, msg.sender, msg.seq, msg.key))
            return
        keys = msg.meta["keys"]
        if not self.sync and self.updater is None:
            raise RequestError("dist_async needs an optimizer on the servers: without one each push would "
                               "overwrite the weights; set update_on_kvstore=true")
        if msg.dtype != P.DType.FLOAT32:
            raise RequestError("PUSHPULL carries float32 values")
        if len(set(keys)) != len(keys):
            raise RequestError("PUSHPULL names a key twice")
        held = [self._value(k) for k in keys]
        if any(v.dtype != _F32 for v in held):
            raise RequestError("PUSHPULL names a half-precision key; those go as PUSH and PULL")
        sizes = [v.size for v in held]
        if sum(sizes) != msg.data.size:
            raise RequestError(f"PUSHPULL of {len(keys)} keys holding {sum(sizes)} values carries {msg.data.size}")
        if self._left and self.sync and self._refuse_owed(identity, msg, keys):
            return
        if self.sync and self._as_group(identity, msg, keys, sizes):
            return
        group, offset = Fused(identity, msg, keys), 0
        self._held[msg.sender] += len(keys)
        for k, n in zip(keys, sizes):
            push = P.Message(P.Type.PUSH, msg.sender, msg.seq, k, data=msg.data[offset:offset + n], want_ack=False)
            offset += n
            self._push_member(identity, push, group)

    def _as_group(self, identity: bytes, msg: P.Message, keys: list[int], sizes: list[int]) -> bool:
        """Serve a fused PUSHPULL of a synchronous job as a GroupRound when its keys are in no
        other round (or all in this set's own); False: served key by key (other rounds taken apart)."""
        group = self._grouped.get(keys[0])
        if group is None or group.keys != tuple(keys):
            for k in keys:
                other = self._grouped.get(k)
                if other is not None:
                    self._dissolve(other)
            if any(self.rounds[k].pushed for k in keys):
                return False  # a key of it is in a round of its own: the keys' rounds serve it
            group = GroupRound(tuple(keys), sizes)
            for k in keys:
                self._grouped[k] = group
        self._held[msg.sender] += len(keys)  # as a Fused: the worker awaits a pull per key
        if msg.sender in group.pushed:  # pushed again before the round closed: held whole for the next
            group.held.append((identity, msg))
            return True
        data = msg.data
        if group.merged is None:
            group.merged = data  # the received buffer, this round's own (as Round.merged)
        elif group.merged.flags.writeable:
            self.add(group.merged, data, out=group.merged)
        else:
            group.merged = self.add(group.merged, data)
        group.pushed.add(msg.sender)
        group.pulls.append((identity, msg))
        if len(group.pushed) == len(self.workers):
            self._close_group(group)
        return True

    def _release(self, group: GroupRound) -> None:
        for k in group.keys:
            del self._grouped[k]

    def _close_group(self, group: GroupRound) -> None:
        """Each key's value from the round's sum, as its own round's close would; every pull
        answered with the keys' values end to end (without an optimizer, the sum's own buffer)."""
        self._release(group)
        merged, offset, values = group.merged, 0, []
        assert merged is not None
        for k, n in zip(group.keys, group.sizes):
            part = merged[offset:offset + n]
            offset += n
            self._rounds_closed[k] += 1
            self.values[k] = part if self.updater is None else self.updater.update(k, self.values[k], part)
            values.append(self.values[k])
        data = merged if self.updater is None else np.concatenate(values)
        for identity, request in group.pulls:
            self._held[request.sender] -= len(group.keys)
            self.reply(identity, P.Message(P.Type.PUSHPULL, seq=request.seq, data=data, reply=True))
        for identity, request in group.held:  # each opens the next round
            self._held[request.sender] -= len(group.keys)
            self.on_pushpull(identity, request)

    # -- a worker that left ---------------------------------------------------------------------

    def _never_closes(self, keys: Sequence[int], worker: str) -> str:
        """The one line a request waiting on a round of `keys` (pushed together) gets."""
        also = f" (and the {len(keys) - 1} keys pushed with it)" if len(keys) > 1 else ""
        return (f"key {keys[0]}{also}: round {self._rounds_closed[keys[0]] + 1} can never close: {worker} left "
                "the job (it finished and closed its store) before pushing to it")

    def _refuse_owed(self, identity: bytes, msg: P.Message, keys: Sequence[int]) -> bool:
        """Answer `msg` (a push into the rounds of `keys`) with an ERROR if one of those rounds
        can never close, because a worker that left has not pushed into it; True if it did. A push
        its sender already made in a round waits for the next one and is asked when it opens. An
        answer, not a RequestError: a held request is served again from inside a round's close."""
        for key in keys:
            group = self._grouped.get(key)
            r = group if group is not None else self.rounds.get(key)
            pushed = r.pushed if r is not None else set()
            if msg.sender in pushed:
                continue
            gone = next((name for wid, name in self._left.items() if wid not in pushed), None)
            if gone is not None:
                self.reply(identity, P.error(msg, self._never_closes((key,), gone), left=gone))
                return True
        return False

    def _workers_left(self) -> None:
        """Take the workers the scheduler reported gone; fail every open synchronous round one of
        them has not pushed into (it never will): its waiting pulls and held pushes get an ERROR."""
        while self.link.left:
            meta = self.link.left.popleft()
            wid, name = meta["id"], meta["node"]
            if wid not in self.workers:
                continue
            self._left[wid] = name
            if not self.sync:
                continue  # no rounds: every push was applied on arrival
            failed: list[str] = []
            answered: set[int] = set()  # a fused request waits in several rounds: answered once
            for group in {id(g): g for g in self._grouped.values()}.values():
                if wid not in group.pushed:
                    failed.append(self._fail_group(group, name))
            for key, r in list(self.rounds.items()):
                if r.pushed and wid not in r.pushed:
                    failed.append(self._fail_round(key, r, name, answered))
            if failed:
                log.error("%s: %s left; %d round(s) can never close, their requests refused: %s", self.link.name,
                          name, len(failed), "; ".join(failed[:3]) + (" ..." if len(failed) > 3 else ""))
        self.flush()

    def _fail_round(self, key: int, r: Round, worker: str, answered: set[int]) -> str:
        reason = self._never_closes((key,), worker)
        del self.rounds[key]
        waiting = [*r.pulls, *((i, push if pull is None else pull) for i, push, pull in r.held)]
        for identity, request in waiting:
            if id(request) in answered:
                continue
            answered.add(id(request))
            if isinstance(request, Fused):
                self._held[request.request.sender] -= len(request.keys)
                self.reply(request.identity, P.error(request.request, reason, left=worker))
            else:
                self._held[request.sender] -= 1 if request.type == P.Type.PULL else _awaits_answer(request)
                self.reply(identity, P.error(request, reason, left=worker))
        return reason

    def _fail_group(self, group: GroupRound, worker: str) -> str:
        reason = self._never_closes(group.keys, worker)
        self._release(group)
        for identity, request in [*group.pulls, *group.held]:
            self._held[request.sender] -= len(group.keys)
            self.reply(identity, P.error(request, reason, left=worker))
        return reason

    def _apart(self, key: int) -> None:
        group = self._grouped.get(key)
        if group is not None:
            self._dissolve(group)

    def _dissolve(self, group: GroupRound) -> None:
        """Turn an open GroupRound into its keys' own rounds (what they would be had each key been
        served on its own: the same pushes summed, the same pulls waiting), then serve its held
        requests key by key."""
        self._release(group)
        pulls = [(identity, Fused(identity, request, list(group.keys))) for identity, request in group.pulls]
        offset = 0
        for k, n in zip(group.keys, group.sizes):
            r = self.rounds[k]  # empty: a grouped key is in no round of its own
            r.merged = None if group.merged is None else group.merged[offset:offset + n]
            r.pushed, r.pulls = set(group.pushed), list(pulls)
            offset += n
        for identity, request in group.held:
            self._held[request.sender] -= len(group.keys)
            self.on_pushpull(identity, request)

    def _fill(self, group: Fused, key: int) -> None:
        group.values[key] = self.values[key]  # never written into: replaced by each update
        if len(group.values) == len(group.keys):
            self._held[group.request.sender] -= len(group.keys)
            data = np.concatenate([group.values[k] for k in group.keys])
            self.reply(group.identity, P.Message(P.Type.PUSHPULL, seq=group.request.seq, data=data, reply=True))

    def on_get_state(self, identity: bytes, msg: P.Message) -> None:
        value = self._value(msg.key)
        if self.updater is None:
            raise RequestError("this server has no optimizer, so no optimizer state")
        states, count = self.updater.get(msg.key, value.size)
        data = np.concatenate(states) if states else np.zeros(0, np.float32)
        self.reply(identity, P.Message(P.Type.GET_STATE, seq=msg.seq, key=msg.key, reply=True, data=data,
                                       meta={"names": list(self.updater.optimizer.state_names), "count": count}))

    def on_set_state(self, identity: bytes, msg: P.Message) -> None:
        value = self._value(msg.key)
        if self.updater is None:
            raise RequestError("set the optimizer before its state")
        names = list(self.updater.optimizer.state_names)
        if msg.meta["names"] != names:
            raise RequestError(f"state names {msg.meta['names']} do not match this optimizer's {names}")
        data = self._payload(msg, value.size * len(names)) if names else np.zeros(0, np.float32)
        self.updater.set(msg.key, list(np.split(data, len(names))) if names else [], msg.meta["count"])
        self.reply(identity, P.ack(msg))

    def on_ping(self, identity: bytes, msg: P.Message) -> None:
        # Answered once every earlier request on the connection was handled; says how many of
        # them are held, so a worker can tell a reply that was lost from one not yet due.
        self.reply(identity, P.Message(P.Type.PING, seq=msg.seq, reply=True, meta={"held": self._held[msg.sender]}))

    _handlers = {
        P.Type.PING: on_ping,
        P.Type.CONFIGURE: on_configure,
        P.Type.SET_OPTIMIZER: on_set_optimizer,
        P.Type.SET_COMPRESSION: on_set_compression,
        P.Type.INIT: on_init,
        P.Type.PUSH: on_push,
        P.Type.PULL: on_pull,
        P.Type.PUSHPULL: on_pushpull,
        P.Type.GET_STATE: on_get_state,
        P.Type.SET_STATE: on_set_state,
    }


def _awaits_answer(msg: P.Message) -> int:
    """1 if the sender of a held request awaits an answer to it (a PUSHPULL always, a PUSH only
    when acknowledged under PS_RESEND), for the count a PING answers with."""
    return 1 if msg.type == P.Type.PUSHPULL else int(msg.want_ack)
