"""The worker side of the parameter server: the `dist_sync`, `dist_async`, `dist_sync_device`
and `dist_async_device` KVStore types.

A key lives on one server, picked as MXNet does (`key * 9973 % num_servers`), unless it holds
more than the big-array bound (MXNET_KVSTORE_BIGARRAY_BOUND, 1,000,000 elements), in which case
it is cut into one contiguous part per server. A push first sums this machine's device values
(in host memory, or on the first device for the `*_device` types), then sends one message per
part without waiting; a pull sends every part's request before it waits for any answer.
Requests go out in priority order (higher first). `pushpull` and `pushpull_async` send each
key's pull right behind its push, so the servers answer early keys while later pushes are still
on the wire (both directions of the link busy at once: 2x the throughput of pushing everything
before pulling); `arrivals` hands out each key as its last part arrives. DataParallel calls
`pushpull_async` from inside its compiled step, per key, as backprop produces the gradients
(hence the lock: the sockets are used from a TensorFlow thread). A part of more than
TFKV_CHUNK_BYTES is cut into chunks, each its own key on its server, so one big tensor does not
hold up the others; the chunks of a pulled key are copied into one array as they arrive. With
`set_gradient_compression` pushes are 2-bit compressed (`tfkv.ps.compression`) with one
residual per key chunk kept on the worker.

Creating a store in a process whose role is `server` or `scheduler` runs that role and exits,
as MXNet does, so one command can be started for every role of a job. A worker's store leaves
when the interpreter exits, as MXNet's does in its destructor (see `_at_exit`). Waiting has no
deadline of its own (a dist_sync pull waits for the slowest worker), but a silent server is
asked what it holds, so a lost reply fails the job naming it (see `_check_held`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator, Sequence

import numpy as np
import zmq

from tfkv import optim
from tfkv.errors import TfkvError
from tfkv.ps import compression
from tfkv.ps import protocol as P
from tfkv.ps import security
from tfkv.store.base import Key, KVStore, gpu_p2p, in_place, pairs
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.scheduler_link import SchedulerLink

log = logging.getLogger("tfkv.ps")

_NAMED_KEY_BASE = 1 << 40  # keys that are not ints in [0, 2**40) get ids from here, in init order
_CHUNK_SHIFT = 48  # chunk j > 0 of key id k is key k + (j << 48) on its server (ids stay < 2**48)


class DistError(TfkvError, RuntimeError):
    """A server refused a request; the message is the server's."""


@dataclass
class Layout:
    shape: tuple[int, ...]
    size: int
    parts: list[tuple[int, int, int, int]]  # (server, start, end, server-side key) over the flat value


@dataclass
class Pull:
    """A key's pull requests in flight: `seqs` holds (sequence number, start, end) per part.

    `outs` are where the value goes: TensorFlow variables (assigned) or numpy arrays (writable,
    of the key's shape, a dtype float32 casts to). The first C-contiguous float32 one receives
    the parts directly as they arrive (MXNet's `pull(key, out=array)`: no allocation per pull);
    without one, a key of one part is the reply's own read-only buffer (no copy) and a key of
    several parts is assembled in a fresh array."""

    key: Key
    layout: Layout
    outs: list[Any] = field(default_factory=list)
    seqs: list[tuple[int, int, int]] = field(default_factory=list)
    value: np.ndarray | None = None  # once every part has arrived

    def __post_init__(self) -> None:
        # Checked here, before anything is sent, so that a refused out leaves no request (nor a
        # sync round) half done. Arrays of another dtype or layout are copied into on delivery
        # (np.copyto, as LocalStore does), so every store type takes the same outs.
        self._dest = None
        for o in self.outs:
            if isinstance(o, np.ndarray):
                if (o.shape != self.layout.shape or not o.flags.writeable
                        or not np.can_cast(np.float32, o.dtype, "same_kind")):
                    raise ValueError(f"pull of key {self.key!r}: out array is {o.dtype}{list(o.shape)}, expected "
                                     f"a writable float{list(self.layout.shape)}")
                if self._dest is None and o.dtype == np.float32 and o.flags.c_contiguous:
                    self._dest = o

    def expect(self, seqs: list[tuple[int, int, int]]) -> None:
        """The requests sent for this pull's parts."""
        self.seqs, self._left = seqs, len(seqs)
        self._spans = {seq: (a, b) for seq, a, b in seqs}
        if self._dest is None and self._left > 1:
            self._dest = np.empty(self.layout.shape, np.float32)

    def arrive(self, seq: int, data: np.ndarray) -> bool:
        """Take one part's reply; True once the value is complete."""
        self._left -= 1
        if self._dest is None:  # one part, nowhere given: the reply's own buffer
            self.value = data.reshape(self.layout.shape)
            return True
        a, b = self._spans[seq]
        self._dest.reshape(-1)[a:b] = data  # each part copied in as it comes
        if self._left:
            return False
        self.value = self._dest
        return True

    def deliver(self) -> None:
        """Copy the complete value into every other out."""
        for o in self.outs:
            if o is self._dest:
                continue
            if isinstance(o, np.ndarray):
                np.copyto(o, self.value)
            else:
                o.assign(self.value)


class DistStore(KVStore):
    type = "dist_sync"
    distributed = True
    async_pushpull = True
    sync = True
    on_device = False

    def __init__(self, devices: Sequence[str] | None = None, env: ClusterEnv | None = None):
        env = env or ClusterEnv.from_env()
        if env.role != "worker":
            from tfkv.ps.node import run_role

            sys.exit(run_role(env))
        self.env = env
        self._devices = list(devices or [])
        self.link = SchedulerLink(env, "worker")
        ctx = zmq.Context.instance()
        self._socks = []
        self._poller = zmq.Poller()
        for server in self.link.servers:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            # Every message a server sends here answers a request this worker made, so its queue
            # is bounded by this worker's own requests: no high-water mark, at which ZeroMQ would
            # stop reading and leave the server's queue to fill (a pull of 10,000 keys).
            sock.setsockopt(zmq.RCVHWM, 0)
            security.client_socket(sock, env.keys)
            sock.connect(f"tcp://{server['host']}:{server['port']}")
            self._poller.register(sock, zmq.POLLIN)
            self._socks.append(sock)
        self._index = {sock: i for i, sock in enumerate(self._socks)}
        self._seq = itertools.count(1)
        self._pending: dict[int, list[Any]] = {}  # seq -> [server, frames, sent_at]
        self._awaited = [0] * len(self._socks)  # per server: its requests in _pending
        self._heard = [0.0] * len(self._socks)  # per server: when it last answered (or we began to wait)
        self._probes: dict[int, tuple[int, float]] = {}  # server -> (seq, sent_at) of a PING in flight
        self._replies: dict[int, P.Message] = {}
        self._ids: dict[Hashable, int] = {}
        self._layouts: dict[int, Layout] = {}
        self._has_optimizer = False
        self._unsynced: set[int] = set()  # servers with pushes not yet known to be applied
        self._threshold: float | None = None  # 2-bit compression of pushes, when set
        self._residuals: dict[int, np.ndarray] = {}  # server-side key -> what compression held back
        self.push_bytes = 0  # payload bytes of every PUSH sent (measures compression)
        self.sum_on_device = self.on_device and gpu_p2p()
        # Sockets are not thread-safe: pushpull_async may run on a TensorFlow op's thread.
        self._lock = threading.RLock()
        # MXNet's store leaves in its destructor, and its scripts end without a teardown call:
        # this one leaves when the interpreter exits (close() unregisters it). An exception left in
        # sys.last_value already (IPython sets it for every traceback it displays) is not the one
        # that ends this interpreter: _at_exit only heeds a newer one.
        self._shown_before = getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        if self.rank == 0:
            self._wait([self._send(s, P.Message(P.Type.CONFIGURE, meta={"sync": self.sync}))
                        for s in range(len(self._socks))])
        self.barrier()

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def num_workers(self) -> int:
        return self.link.num_workers

    # -- transport -----------------------------------------------------------------------------

    def _send(self, server: int, msg: P.Message, track: bool = True) -> int:
        """Send a request; `track`: wait for (and, under PS_RESEND, retransmit until) its answer."""
        with self._lock:
            msg.sender, msg.seq = self.link.id, next(self._seq)
            frames = P.encode(msg)
            size = sum(memoryview(f).nbytes for f in frames)
            if size > self.env.max_message_bytes:
                # A server drops an oversized message unread (and the connection with it): say so
                # here instead of waiting for an answer that cannot come.
                raise ValueError(f"{msg.type.name} of key {msg.key} is {size} bytes, over TFKV_MAX_MESSAGE_BYTES="
                                 f"{self.env.max_message_bytes}; raise it or lower MXNET_KVSTORE_BIGARRAY_BOUND "
                                 "so big arrays are split across more servers")
            self._socks[server].send_multipart(frames, copy=False)
            if track:
                now = time.monotonic()
                self._pending[msg.seq] = [server, frames, now]
                if not self._awaited[server]:
                    self._heard[server] = now  # silence counts from when we begin to wait
                self._awaited[server] += 1
        return msg.seq

    def _answered(self, seq: int) -> list[Any] | None:
        """Retire a request: its _pending entry, None if it was not (or no longer) awaited."""
        entry = self._pending.pop(seq, None)
        if entry is not None:
            self._awaited[entry[0]] -= 1
        return entry

    def _receive(self, timeout_ms: float) -> list[int]:
        """Take what the servers sent (waiting up to `timeout_ms` for the first of it); return
        the sequence numbers of the data replies now in `_replies`."""
        with self._lock:
            return self._receive_locked(timeout_ms)

    def _receive_locked(self, timeout_ms: float) -> list[int]:
        arrived = []
        for sock, _ in self._poller.poll(timeout_ms):
            server = self._index[sock]
            while True:
                try:
                    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._heard[server] = time.monotonic()
                try:
                    msg = P.decode(frames, self.env.max_message_bytes // 4)
                except P.ProtocolError as e:
                    log.warning("dropped a malformed reply from server %d: %s", server, e)
                    continue
                if msg.type == P.Type.ERROR:  # also for untracked pushes
                    self._answered(msg.seq)
                    raise DistError(f"server {server}: {(msg.meta or {}).get('message')}")
                if self._answered(msg.seq) is None:
                    continue  # a late answer to a request already answered (resend)
                if msg.type == P.Type.PING:
                    if self._probes.get(server, (None,))[0] == msg.seq:
                        del self._probes[server]
                        self._check_held(server, msg.seq, msg.meta["held"])
                elif msg.type != P.Type.ACK:
                    self._replies[msg.seq] = msg
                    arrived.append(msg.seq)
        return arrived

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
        server, frames, sent_at = self._pending[seq]
        head = P.HEADER.unpack(bytes(memoryview(frames[0])))
        kid, chunk = head[7] % (1 << _CHUNK_SHIFT), head[7] >> _CHUNK_SHIFT
        key = next((k for k, i in self._ids.items() if i == kid), kid)  # the caller's name for it
        part = f" (part {chunk})" if chunk else ""
        return (f"{P.Type(head[2]).name} of key {key!r}{part} (request {seq}, sent "
                f"{time.monotonic() - sent_at:.1f} s ago)")

    def _server_name(self, server: int) -> str:
        where = self.link.servers[server]
        return f"server {server} at {where['host']}:{where['port']}"

    def _check_held(self, server: int, probe: int, held: int) -> None:
        if self.env.resend:
            return  # under PS_RESEND a lost request or reply is sent again instead
        before = sorted(seq for seq, e in self._pending.items() if e[0] == server and seq < probe)
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
                    oldest = min(seq for seq, e in self._pending.items() if e[0] == server)
                    raise DistError(f"{self._server_name(server)} has answered nothing for "
                                    f"{now - self._heard[server]:.0f} s, not even a PING sent "
                                    f"{now - probe[1]:.0f} s ago, while this worker awaits "
                                    f"{self._describe(oldest)}; it is alive but not serving (raise "
                                    "TFKV_REQUEST_TIMEOUT if it is only slow)")
            elif awaited and now - self._heard[server] > self.env.heartbeat_timeout:
                self._probes[server] = (self._send(server, P.Message(P.Type.PING)), now)

    def _tick(self) -> None:
        """What a wait does between polls: resend (PS_RESEND), ask silent servers."""
        with self._lock:
            if self.env.resend:
                self._resend_overdue_locked()
            self._watch_servers()

    def _resend_overdue_locked(self) -> None:
        now = time.monotonic()
        for seq, entry in self._pending.items():
            if now - entry[2] > self.env.resend_timeout:
                if self.env.verbose >= 1:
                    log.info("resending request %d to server %d", seq, entry[0])
                self._socks[entry[0]].send_multipart(entry[1], copy=False)
                entry[2] = now

    def _wait(self, seqs: Sequence[int] | None = None) -> None:
        """Wait for the answers to `seqs` (default: everything outstanding); data replies stay
        in `_replies` for the caller to take."""
        if seqs is None and self._unsynced:
            # Pushes are not acknowledged: a PING answered after them proves they were applied
            # (one connection, one serving thread), before a barrier lets another worker pull.
            for server in sorted(self._unsynced):
                self._send(server, P.Message(P.Type.PING))
            self._unsynced.clear()
        wanted = list(self._pending) if seqs is None else list(seqs)
        tick = min(100.0, self.env.resend_timeout * 1000)
        i = 0
        while i < len(wanted):  # each answered one is passed once (any() rescanned them: 100,000 keys)
            if wanted[i] in self._pending:
                self._receive(tick)
                self._tick()
            else:
                i += 1

    # -- keys ----------------------------------------------------------------------------------

    def _id(self, key: Hashable) -> int:
        """The key's id on the servers, the same on every worker. An int key in [0, 2**40) is its
        own id (so `key * 9973 % servers` places it as in MXNet); any other key (a str, a negative
        or a larger int) takes the next id from 2**40 in init order, which every worker shares,
        as MXNet numbers its str keys. So two distinct keys never share an id."""
        self._check_key(key)
        kid = self._ids.get(key)
        if kid is None:
            if isinstance(key, (int, np.integer)) and 0 <= int(key) < _NAMED_KEY_BASE:
                kid = int(key)
            else:
                kid = _NAMED_KEY_BASE + self._named
                if kid >> _CHUNK_SHIFT:
                    raise ValueError(f"key {key!r}: more than {(1 << _CHUNK_SHIFT) - _NAMED_KEY_BASE} keys")
                self._named += 1
            self._ids[key] = kid
        return kid

    _named = 0  # keys numbered from _NAMED_KEY_BASE so far

    def _layout(self, key: Hashable) -> tuple[int, Layout]:
        self._check_key(key)
        kid = self._ids.get(key)
        if kid is None or kid not in self._layouts:
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first")
        return kid, self._layouts[kid]

    def _plan(self, kid: int, shape: tuple[int, ...]) -> Layout:
        size = int(np.prod(shape))
        n = len(self._socks)
        if size < self.env.bigarray_bound or n == 1:
            spans = [((kid * 9973) % n, 0, size)]
        else:
            spans = [(i, i * size // n, (i + 1) * size // n) for i in range(n)]
        per_chunk = max(1, self.env.chunk_bytes // 4)
        parts = []
        for server, a, b in spans:
            pieces = max(1, -(-(b - a) // per_chunk))
            for j in range(pieces):
                lo, hi = a + j * (b - a) // pieces, a + (j + 1) * (b - a) // pieces
                parts.append((server, lo, hi, kid + (len(parts) << _CHUNK_SHIFT)))
        return Layout(shape, size, parts)

    def _merge(self, values: list[Any]) -> np.ndarray:
        """One flat float32 array: the sum of this machine's device values."""
        if len(values) > 1 and self.sum_on_device:
            # GPU P2P: sum on the first device; without it the values are summed below, in host memory.
            import tensorflow as tf

            with tf.device(self._devices[0] if self._devices else "/device:CPU:0"):
                values = [tf.add_n([tf.identity(v) for v in values])]
        arrays = [np.asarray(v, dtype=np.float32) for v in values]
        total = arrays[0] if len(arrays) == 1 else np.add(arrays[0], arrays[1])
        for a in arrays[2:]:
            np.add(total, a, out=total)
        return np.ascontiguousarray(total).reshape(-1)

    @staticmethod
    def _ordered(items: list[tuple[Key, list[Any]]], priority: int | Sequence[int]) -> list[tuple[Key, list[Any]]]:
        if isinstance(priority, (list, tuple)):
            return [it for _, it in sorted(zip(priority, items), key=lambda t: -t[0])]
        return items

    # -- the KVStore API -----------------------------------------------------------------------

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        for k, values in pairs(key, value):
            kid = self._id(k)
            if kid in self._layouts:
                raise ValueError(f"key {k!r} is already initialised")
            flat = self._merge(values[:1])
            self._layouts[kid] = layout = self._plan(kid, tuple(np.shape(values[0])))
            if self.rank == 0:  # worker 0's value wins; the others wait at the barrier
                for server, a, b, skey in layout.parts:
                    self._send(server, P.Message(P.Type.INIT, key=skey, data=flat[a:b]))
        self._wait()
        self.barrier()

    def push(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> None:
        self._check_can_push()
        for k, values in self._ordered(list(pairs(key, value)), priority):
            self._push_key(k, values)
        self._receive(0)  # collect answers that are already here (errors surface early)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0) -> Any:
        if self.env.resend:
            self._settle_pushes()
        pulls = [self._request_pull(k, outs) for k, outs in self._ordered(list(pairs(key, out)), priority)]
        return self._finish(key, out, pulls)

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None,
                 priority: int | Sequence[int] = 0) -> Any:
        """Push each key and request it back at once, so that replies stream back while later
        keys are still going out (both directions of the link busy, not one after the other).
        Without `out` the result goes into `value`, as MXNet's (see base.in_place), and is returned."""
        into = out if out is not None else self._in_place(key, value)
        return self._finish(key, out, self.pushpull_async(key, value, priority, out=into))

    def _in_place(self, key: Key | Sequence[Key], value: Any) -> Any:
        """base.in_place, with a numpy value of a key's size but another shape (a flat gradient)
        viewed in the key's shape, so the result still lands in it."""
        if isinstance(key, (list, tuple)):
            return [self._in_place(k, v) for k, v in zip(key, value)]
        shape = self._layout(key)[1].shape
        return [o.reshape(shape) if isinstance(o, np.ndarray) and o.shape != shape and o.flags.c_contiguous
                and o.size == int(np.prod(shape)) else o for o in in_place(key, value)]

    def pushpull_async(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0,
                       out: Any = None) -> list[Pull]:
        """Push each key and send its pull request without waiting for anything; `arrivals` (or
        `wait`) takes the replies and writes them into `out` if given. Safe to call from a
        TensorFlow op's thread (DataParallel pushes each gradient as backprop produces it)."""
        self._check_can_push()
        outs = dict(pairs(key, out))
        with self._lock:
            items = self._ordered(list(pairs(key, value)), priority)
            if self.env.resend:
                # A pull must not overtake a push that was lost and is being resent: under
                # PS_RESEND the pushes are acknowledged first.
                for k, values in items:
                    self._push_key(k, values)
                self._settle_pushes()
                return [self._request_pull(k, outs[k]) for k, _ in items]
            pulls = []
            for k, values in items:  # each pull right behind its push: replies flow while pushes do
                self._push_key(k, values)
                pulls.append(self._request_pull(k, outs[k]))
            return pulls

    def arrivals(self, pulls: Sequence[Pull]) -> Iterator[tuple[Key, np.ndarray]]:
        """(key, value) for each of `pulls` as soon as all of its parts have arrived, in arrival
        order; the value is also written into the pull's `outs`."""
        waiting = {seq: p for p in pulls for seq, _, _ in p.seqs}
        arrived = [seq for seq in waiting if seq in self._replies]
        tick = min(100.0, self.env.resend_timeout * 1000)
        while True:
            for seq in arrived:
                p = waiting.pop(seq, None)
                if p is not None and p.arrive(seq, self._replies.pop(seq).data):
                    p.deliver()
                    yield p.key, p.value
            if not waiting:
                return
            arrived = self._receive(tick)
            self._tick()

    def wait(self, pulls: Sequence[Pull]) -> dict[Key, np.ndarray]:
        """Every pull's value, by key, once all have arrived."""
        return dict(self.arrivals(pulls))

    def _finish(self, key: Key | Sequence[Key], out: Any, pulls: list[Pull]) -> Any:
        results = self.wait(pulls)
        if out is not None:
            return None
        if isinstance(key, (list, tuple)):
            return [results[k] for k in key]
        return results[key]

    def _check_can_push(self) -> None:
        if not self.sync and not self._has_optimizer:
            raise RuntimeError(f"{self.type} needs an optimizer on the servers (set_optimizer, "
                               "update_on_kvstore=true): without one each push would replace the weights")

    def _push_key(self, k: Key, values: list[Any]) -> None:
        kid, layout = self._layout(k)
        flat = self._merge(values)
        if flat.size != layout.size:
            raise ValueError(f"key {k!r}: pushed {flat.size} values, it holds {layout.size}")
        for server, a, b, skey in layout.parts:
            msg = P.Message(P.Type.PUSH, key=skey, data=flat[a:b], want_ack=self.env.resend)
            if self._threshold is not None:
                residual = self._residuals.get(skey)
                if residual is None:
                    residual = self._residuals[skey] = np.zeros(b - a, np.float32)
                # The residual changes once here; a resend (PS_RESEND) repeats these frames.
                msg.data = compression.pack(flat[a:b], residual, self._threshold)
                msg.dtype, msg.count = P.DType.TWOBIT, b - a
            self.push_bytes += msg.data.nbytes
            # Acknowledged (and tracked) only under PS_RESEND; see Server._ack_push.
            self._send(server, msg, track=self.env.resend)
            if not self.env.resend:
                self._unsynced.add(server)

    def _settle_pushes(self) -> None:
        # One connection delivers in order, so a pull cannot overtake its key's push, unless
        # that push was lost and is being resent: then wait until it is acknowledged.
        self._wait()

    def _request_pull(self, k: Key, outs: list[Any]) -> Pull:
        _, layout = self._layout(k)
        pull = Pull(k, layout, outs)  # checks the outs before anything is sent
        pull.expect([(self._send(server, P.Message(P.Type.PULL, key=skey)), a, b)
                     for server, a, b, skey in layout.parts])
        return pull

    def set_gradient_compression(self, compression_params: Any) -> None:
        """MXNet's API, e.g. {"type": "2bit", "threshold": 0.5}; every worker calls it (each keeps
        its residuals), worker 0 tells the servers how to decode."""
        threshold = compression.parse(compression_params)
        if threshold != self._threshold:
            self._residuals.clear()
        self._threshold = threshold
        if self.rank == 0 and threshold is not None:
            for s in range(len(self._socks)):
                self._send(s, P.Message(P.Type.SET_COMPRESSION, meta={"type": "2bit", "threshold": threshold}))
        self._wait()
        self.barrier()

    def set_optimizer(self, optimizer: Any) -> None:
        self._has_optimizer = True
        self._optimizer = optimizer
        if self.rank == 0:
            spec = {"optimizer": optim.to_dict(optimizer)}
            for s in range(len(self._socks)):
                self._send(s, P.Message(P.Type.SET_OPTIMIZER, meta=spec))
        self._wait()
        self.barrier()

    def barrier(self) -> None:
        self._wait()
        self.link.barrier()

    def save_optimizer_states(self, fname: str) -> None:
        """Gather the optimizer state of every key from the servers into one npz file."""
        requests = []
        for k, kid in self._ids.items():
            layout = self._layouts[kid]
            requests.append((k, layout, [(self._send(s, P.Message(P.Type.GET_STATE, key=skey)), a, b)
                                         for s, a, b, skey in layout.parts]))
        self._wait()
        out: dict[str, np.ndarray] = {}
        for k, layout, seqs in requests:
            replies = [(self._replies.pop(seq), a, b) for seq, a, b in seqs]
            names = replies[0][0].meta["names"]
            for j, name in enumerate(names):
                full = np.empty(layout.size, np.float32)
                for reply, a, b in replies:
                    full[a:b] = np.split(reply.data, len(names))[j]
                out[f"{k}/{name}"] = full.reshape(layout.shape)
            out[f"{k}/count"] = np.asarray(replies[0][0].meta["count"])
        np.savez(fname, **out)

    def load_optimizer_states(self, fname: str) -> None:
        if self.rank == 0:
            with np.load(fname, allow_pickle=False) as f:
                states = {n: f[n] for n in f.files}
            for k, kid in self._ids.items():
                layout = self._layouts[kid]
                names = list(self._optimizer.state_names) if self._optimizer else []
                count = int(states.get(f"{k}/count", 0))
                for s, a, b, skey in layout.parts:
                    data = np.concatenate([states[f"{k}/{n}"].reshape(-1)[a:b] for n in names]) if names else None
                    self._send(s, P.Message(P.Type.SET_STATE, key=skey, data=data,
                                            meta={"count": count, "names": names}))
        self._wait()
        self.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self._wait()
        self.link.done()
        for sock in self._socks:
            sock.close()

    def abort(self, reason: str) -> None:
        if not self._closed:
            self._closed = True
            atexit.unregister(self._at_exit)
            self.link.abort(reason)

    def _at_exit(self) -> None:
        """The interpreter is exiting without close(): after an uncaught exception (which the
        interpreter has just printed, and left in sys.last_value) leave as failed, so the job
        stops now naming it; after a normal end leave as close() does, so the job can end 0."""
        exc = getattr(sys, "last_value", None)
        if exc is not None and exc is not self._shown_before:
            self.abort(f"{type(exc).__name__}: {exc}")
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - an atexit hook cannot raise: fail the job instead
            print(f"tfkv: {self.link.name}: leaving at exit failed ({type(e).__name__}: {e})", file=sys.stderr,
                  flush=True)
            self._closed = False
            self.abort(f"leaving at exit failed: {type(e).__name__}: {e}")
            sys.stdout.flush()
            logging.shutdown()  # os._exit skips the atexit hook that would flush the log handlers
            os._exit(1)  # an exception in an atexit hook would not change the exit status

    _closed = False
    _optimizer: Any = None
    _shown_before: BaseException | None = None


class DistAsync(DistStore):
    type = "dist_async"
    sync = False


class DistSyncDevice(DistStore):
    type = "dist_sync_device"
    on_device = True


class DistAsyncDevice(DistStore):
    type = "dist_async_device"
    sync = False
    on_device = True
