"""A parameter server: holds its share of the keys and applies what workers push.

Its transport (tfkv.ps.transport.server) receives the workers' messages and sends the replies;
its keys and their rounds (tfkv.ps.rounds) say what each push or pull gives back. Here is the one
loop between them: each request is checked, served, and what it releases served in turn.

Requests are handled by one thread, in the order each connection delivers them, so each update of
a key is atomic. A malformed or wrong-size request gets an ERROR reply and the server carries on;
a connection no worker of the job spoke on gets a few such replies, then none (tfkv.ps.strangers).
A request seen before (same sender and sequence number, as resent under PS_RESEND: the transport
tells, `repeated`) is acknowledged again but never applied twice. No TensorFlow here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np

from tfkv import optim, timeline
from tfkv.ps import compression, departures, memory
from tfkv.ps import protocol as P
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.reduction import Reducer
from tfkv.ps.round_types import Fused, Held, Outcome, RequestError
from tfkv.ps.rounds import Rounds
from tfkv.ps.rows import Shard
from tfkv.ps.scheduler_link import SchedulerLink
from tfkv.ps.strangers import Strangers
from tfkv.ps.transport import server as transport
from tfkv.ps.updater import NumpyUpdater

log = logging.getLogger("tfkv.ps")


class Server:
    """One server of a job: registered with the scheduler, serving until it says the job ended."""

    timeline: timeline.Timeline | None = None  # kvstore.timeline's recorder of this server (None: off)

    def __init__(self, env: ClusterEnv):
        self.env = env
        memory.keep_freed_buffers(one_arena=True)  # the same large buffers every step (tfkv.ps.memory)
        self.transport = transport.bind(env)
        # Behind NAT (or a test proxy) workers must connect elsewhere than where this binds.
        host, port = env.advertise or (self.transport.host, self.transport.port)
        self.link = SchedulerLink(env, "server", host, port)
        self.transport.named(self.link.id, self.link.name)
        self.timeline = timeline.of(env.timeline, "server", self.link.rank)  # None: off
        self._serving(set(self.link.workers))
        log.info("%s listening on %s:%d", self.link.name, self.transport.host, self.transport.port)

    def _serving(self, workers: set[int]) -> None:
        """What serving needs beside the sockets: the keys' rounds, who spoke."""
        self.workers = workers
        self.rounds = Rounds(workers, Reducer(self.env.reduction_nthreads))
        self.max_count = self.env.max_message_bytes // 4
        # Connections a worker of the job sent a well-formed request on: answered whatever they
        # send. Any other gets a few errors, then nothing (its replies would queue unread).
        self._members: set[bytes] = set()
        self._connection: dict[int, bytes] = {}  # worker id -> its connection (one socket per server)
        self._strangers = Strangers(self.link.name)
        if self.timeline is not None:  # its spans: each request served, the sums and replies (updates: on_set_optimizer)
            self.timeline.wrap(self.rounds.reducer, "accumulate", "sum")
            self.timeline.wrap(self.transport, "_send", "reply")
        rounds = self.rounds
        self._handlers: dict[P.Type, Callable[[bytes, P.Message], Outcome]] = {
            P.Type.PING: self.on_ping, P.Type.CONFIGURE: self.on_configure,
            P.Type.SET_OPTIMIZER: self.on_set_optimizer, P.Type.SET_COMPRESSION: self.on_set_compression,
            P.Type.INIT: self.on_init, P.Type.PUSH: rounds.push, P.Type.PULL: rounds.pull,
            P.Type.PUSHPULL: rounds.pushpull, P.Type.GET_STATE: self.on_get_state, P.Type.SET_STATE: self.on_set_state,
            P.Type.FEEDBACK: self.on_feedback,
        }
        # (key, worker rank, "residual"/"velocity") -> that worker's error feedback of the key part, as
        # it sent it at the last checkpoint for worker 0 to save (tfkv.store.dist_feedback)
        self.feedback: dict[tuple[int, int, str], np.ndarray] = {}

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> int:
        receive, flush = self.transport.receive, self.transport.flush
        while not self.link.shutdown.is_set():
            if self.link.left:
                self._workers_left()
            received = receive()
            if received is None:
                continue
            identity, frames = received
            for message in P.split(frames):
                if not self.handle(identity, message):
                    break  # a malformed message: what follows it in the batch cannot be trusted to line up
            flush()
        self.transport.report()
        if self.timeline is not None:
            self.timeline.close()
        log.info("%s: shut down by the scheduler", self.link.name)
        return 0

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
        if identity not in self._members:
            self._joined(msg.sender, identity)
        if msg.reply:
            self.transport.reply(identity, P.error(msg, f"a {msg.type.name} reply sent to a server, which serves requests"))
        elif self.transport.repeated(msg):
            if msg.want_ack:
                self.transport.reply(identity, P.ack(msg))
        elif self.timeline is None:
            self.serve(identity, msg)
        else:
            self.timeline.served(self.serve, identity, msg)
        return True

    def serve(self, identity: bytes, msg: P.Message) -> None:
        """Serve a request, then each request it releases, before what follows it (depth first:
        the order in which a round's close serves its held requests is the order of its sums)."""
        outcome = self._outcome(identity, msg, None)
        if not outcome:
            return
        reply = self.transport.reply
        stack = [iter(outcome)]
        while stack:
            for item in stack[-1]:
                if type(item) is Held:
                    stack.append(iter(self._outcome(*item)))
                    break
                reply(*item)
            else:
                stack.pop()

    def _outcome(self, identity: bytes, msg: P.Message, pull: Fused | None) -> Outcome:
        try:
            if pull is not None:  # a fused PUSHPULL's push of one key, released
                return self.rounds.member(identity, msg, pull)
            handler = self._handlers.get(msg.type)
            if handler is None:
                raise RequestError(f"{msg.type.name} is not a request a server serves")
            return handler(identity, msg)
        except RequestError as e:
            return [(identity, P.error(msg, str(e)))]

    def _refuse(self, identity: bytes, error: P.Message, what: str) -> None:
        """Answer with `error`: always a member (a connection a worker of the job spoke on);
        anyone else only while its few answers last (tfkv.ps.strangers), then silently."""
        if identity in self._members or self._strangers.may_answer(identity):
            log.warning("%s: refused %s", self.link.name, what)
            self.transport.reply(identity, error)

    def _joined(self, worker: int, identity: bytes) -> None:
        """A worker's first request on a connection. A worker has one connection to a server:
        one it had before was lost, and ZeroMQ made this one in its place; what the transport
        keeps for the old one (a secure job's session) goes, so lost connections add nothing up."""
        self._members.add(identity)
        old = self._connection.get(worker)
        self._connection[worker] = identity
        if old is not None:
            self._members.discard(old)
            self.transport.forget(old)

    def _workers_left(self) -> None:
        """Take the workers the scheduler reported gone; fail every open synchronous round one of
        them has not pushed into (it never will): its waiting pulls and held pushes get an ERROR."""
        while self.link.left:
            meta = self.link.left.popleft()
            failed, replies = departures.leave(self.rounds, meta["id"], meta["node"])
            if failed:
                log.error("%s: %s left; %d round(s) can never close, their requests refused: %s", self.link.name,
                          meta["node"], len(failed), "; ".join(failed[:3]) + (" ..." if len(failed) > 3 else ""))
            for identity, error in replies:
                self.transport.reply(identity, error)
        self.transport.flush()

    # -- control requests ----------------------------------------------------------------------
    #
    # They read their metadata as protocol.decode left it: checked against the message's schema
    # (tfkv.ps.schema), so every field is there with its type and range.

    def on_configure(self, identity: bytes, msg: P.Message) -> Outcome:
        self.rounds.sync = msg.meta["sync"]
        return [(identity, P.ack(msg))]

    def on_set_compression(self, identity: bytes, msg: P.Message) -> Outcome:
        setting = compression.parse(msg.meta)  # every kind sends the same words: only t decodes them
        self.rounds.threshold = None if setting is None else setting.threshold
        # both_ways: replies 2-bit too, with the threshold the worker resolved (compression.pull_threshold_for)
        self.rounds.replies.threshold = setting.pull_threshold if setting is not None and setting.both_ways else None
        return [(identity, P.ack(msg))]

    def on_set_optimizer(self, identity: bytes, msg: P.Message) -> Outcome:
        opt = optim.from_dict(msg.meta["optimizer"])
        if self.rounds.updater is None or self.rounds.updater.optimizer != opt:
            self.rounds.updater = NumpyUpdater(opt, self.rounds.reducer)
            if self.timeline is not None:
                for method in ("update", "update_rows"):
                    self.timeline.wrap(self.rounds.updater, method, "update", key_arg=0)
        return [(identity, P.ack(msg))]

    def on_init(self, identity: bytes, msg: P.Message) -> Outcome:
        if msg.meta is not None or msg.rows is not None:
            return self._init_rows(identity, msg)
        if msg.key in self.rounds.shards:
            raise RequestError(f"key {msg.key} is row-sparse: an INIT of it names its rows or its table")
        data = self.rounds.payload(msg)
        if msg.key not in self.rounds.values:  # the first init wins, as in MXNet
            self.rounds.values[msg.key] = data
        return [(identity, P.ack(msg))]

    def _init_rows(self, identity: bytes, msg: P.Message) -> Outcome:
        """A row-sparse key's shard made from its table's description (the first init wins, as for
        a dense key; a different description is refused), and/or rows of it given their values."""
        rounds, key = self.rounds, msg.key
        if msg.meta is not None:
            table = msg.meta["table"]
            if key in rounds.values:
                raise RequestError(f"key {key} is a dense key on this server, not a table")
            shard = rounds.shards.get(key)
            if shard is None:
                try:
                    rounds.shards[key] = Shard(key, table)
                except ValueError as e:
                    raise RequestError(f"key {key}: {e}") from None
            elif not shard.describes(table):
                raise RequestError(f"key {key} is already a table of another shape or placement on this server")
        if msg.rows is not None:
            shard = rounds.shard(msg)
            local, values = rounds.rows(shard, msg)
            shard.value[local] = values
        elif msg.data is not None:
            raise RequestError(f"key {key}: an INIT of a table carries its values with their rows")
        return [(identity, P.ack(msg))]

    def on_get_state(self, identity: bytes, msg: P.Message) -> Outcome:
        updater = self.rounds.updater
        if msg.rows is not None:
            shard = self.rounds.shard(msg)
            local = self.rounds.local(shard, msg)
            if updater is None:
                raise RequestError("this server has no optimizer, so no optimizer state")
            states, count = updater.get_rows(msg.key, local, shard.width)
            data = np.concatenate([s.reshape(-1) for s in states]) if states else np.zeros(0, np.float32)
            return [(identity, P.Message(P.Type.GET_STATE, seq=msg.seq, key=msg.key, reply=True, data=data,
                                         meta={"names": list(updater.optimizer.state_names), "count": count}))]
        value = self.rounds.value(msg.key)
        if updater is None:
            raise RequestError("this server has no optimizer, so no optimizer state")
        states, count = updater.get(msg.key, value.size)
        kept = self.rounds.replies.state_names()  # both_ways: the weights beside the copies
        states = [*states, *(np.asarray(value, np.float32).reshape(-1) for _ in kept)]
        data = np.concatenate(states) if states else np.zeros(0, np.float32)
        return [(identity, P.Message(P.Type.GET_STATE, seq=msg.seq, key=msg.key, reply=True, data=data,
                                     meta={"names": [*updater.optimizer.state_names, *kept], "count": count}))]

    def on_set_state(self, identity: bytes, msg: P.Message) -> Outcome:
        updater = self.rounds.updater
        shard = self.rounds.shard(msg) if msg.rows is not None else None
        value = self.rounds.value(msg.key) if shard is None else shard.value
        if updater is None:
            raise RequestError("set the optimizer before its state")
        names = list(updater.optimizer.state_names)
        if shard is None and msg.meta["names"] == [*names, *self.rounds.replies.state_names()] != names:
            return self._set_state_kept(identity, msg, value, len(names))
        if msg.meta["names"] != names:
            raise RequestError(f"state names {msg.meta['names']} do not match this optimizer's {names}")
        if shard is not None:  # rows of a row-sparse key: each state's rows, one state after another
            local = self.rounds.local(shard, msg)
            n = len(local) * shard.width
            data = self.rounds.payload(msg, n * len(names)) if names else np.zeros(0, np.float32)
            updater.set_rows(msg.key, shard.value, local,
                             [data[i * n:(i + 1) * n].reshape(len(local), shard.width) for i in range(len(names))],
                             msg.meta["count"])
            return [(identity, P.ack(msg))]
        data = self.rounds.payload(msg, value.size * len(names)) if names else np.zeros(0, np.float32)
        updater.set(msg.key, list(np.split(data, len(names))) if names else [], msg.meta["count"])
        return [(identity, P.ack(msg))]

    def _set_state_kept(self, identity: bytes, msg: P.Message, value: np.ndarray, optimizer_states: int) -> Outcome:
        """A dense key's optimizer state and, last, the servers' weights under both_ways compression
        (tfkv.ps.replies.STATE): the key's value now is the workers' copy."""
        rounds = self.rounds
        data = np.split(rounds.payload(msg, value.size * (optimizer_states + 1)), optimizer_states + 1)
        rounds.updater.set(msg.key, data[:optimizer_states], msg.meta["count"])
        rounds.values[msg.key] = rounds.replies.restore(msg.key, value, data[-1], rounds.closed[msg.key], rounds.sync)
        return [(identity, P.ack(msg))]

    def on_feedback(self, identity: bytes, msg: P.Message) -> Outcome:
        """Keep a worker's error feedback of a key part (with data), or give it back (without)."""
        size = self.rounds.value(msg.key).size
        held = (msg.key, msg.meta["rank"], msg.meta["what"])
        if msg.data is not None:
            if msg.dtype != P.DType.FLOAT32 or msg.data.dtype != np.float32 or msg.data.size != size:
                raise RequestError(f"key {msg.key}: error feedback must be {size} float32 values")
            self.feedback[held] = np.array(msg.data, np.float32)
            return [(identity, P.ack(msg))]
        value = self.feedback.get(held)
        if value is None:
            raise RequestError(f"key {msg.key}: no {held[2]} of worker {held[1]} kept on this server")
        return [(identity, P.Message(P.Type.FEEDBACK, seq=msg.seq, key=msg.key, reply=True, data=value,
                                     meta=msg.meta))]

    def on_ping(self, identity: bytes, msg: P.Message) -> Outcome:
        # Answered once every earlier request on the connection was handled; says how many of
        # them are held, so a worker can tell a reply that was lost from one not yet due.
        held = self.rounds.held(msg.sender)
        return [(identity, P.Message(P.Type.PING, seq=msg.seq, reply=True, meta={"held": held}))]
