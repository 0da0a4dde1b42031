"""A server's or worker's line to the scheduler: registration, the address book, heartbeats,
barriers (which may also sum a small vector over the workers: tfkv.ps.sums), and leaving at
once when the scheduler reports that a node failed. A barrier the scheduler refuses (a worker
left the job, so it can never be released) raises ClusterError in the caller; a server is
handed the workers that left (`left`).

After registering, a background thread owns the socket: it heartbeats, answers the
scheduler's heartbeats, releases barriers, and when a node fails it prints which one and ends
this process with EXIT_PEER_FAILED (EXIT_PEER_SILENT when the scheduler goes silent), so that
nothing waits forever on a peer that is gone. No TensorFlow here.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import socket
import sys
import threading
import time
from typing import Any

import numpy as np
import zmq

from tfkv.errors import EXIT_PEER_FAILED, EXIT_PEER_SILENT, TfkvError, reacting
from tfkv.ps import protocol as P
from tfkv.ps import security, sums
from tfkv.ps.cluster_env import ClusterEnv

log = logging.getLogger("tfkv.ps")


class ClusterError(TfkvError, RuntimeError):
    """The cluster could not be formed or broke; the message says which node and why."""


def node_name(role: str, rank: int) -> str:
    return f"{role} {rank}"


class SchedulerLink:
    def __init__(self, env: ClusterEnv, role: str, host: str = "", port: int = 0):
        self.env = env
        env.enable_logging()
        self.role = role
        self.ctx = zmq.Context.instance()
        self._sock = self.ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 2000)
        security.client_socket(self._sock, env.keys)
        self._sock.connect(f"tcp://{env.scheduler_host}:{env.scheduler_port}")
        self._send(P.Message(P.Type.REGISTER, meta={
            "role": role, "host": host, "port": port, "rank_hint": env.rank_hint,
            "pid": os.getpid(), "hostname": socket.gethostname()}))
        book = self._await_address_book()
        self.id: int = book["id"]
        self.rank: int = book["rank"]
        self.name = node_name(role, self.rank)
        self.num_workers: int = book["num_workers"]
        self.num_servers: int = book["num_servers"]
        self.servers: list[dict[str, Any]] = book["servers"]
        self.workers: dict[int, str] = {n["id"]: node_name(n["role"], n["rank"]) for n in book["nodes"]
                                        if n["role"] == "worker"}
        if env.verbose >= 1:
            log.info("%s (id %d): cluster of %d servers, %d workers; servers at %s", self.name, self.id,
                     self.num_servers, self.num_workers,
                     ", ".join(f"{s['host']}:{s['port']}" for s in self.servers))
        self.shutdown = threading.Event()
        self._barrier = threading.Event()
        self._released: dict[str, Any] | None = None  # the last BARRIER_DONE's metadata (its sum)
        self._barriers = 0  # BARRIERs sent: each carries its number as seq, which a refusal answers
        self._refusal: dict[str, str] | None = None  # the scheduler's ERROR refusing the barrier waited on
        # Workers that left the job before the others, as the scheduler reported them (LEFT:
        # id, node), for the server's serving thread to take.
        self.left: collections.deque[dict[str, Any]] = collections.deque()
        self._outbox: queue.Queue[P.Message] = queue.Queue()
        # A byte down this pipe wakes the link's thread as soon as a message is posted, instead of
        # at its next 50 ms poll: a barrier (an epoch's end, a split evaluation's sum) waits for it.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        self._aborting = False
        self._thread = threading.Thread(target=self._loop, name="tfkv-scheduler-link", daemon=True)
        self._thread.start()

    # -- main-thread API -----------------------------------------------------------------------

    def barrier(self, values: Any = None) -> np.ndarray | None:
        """Block until every worker has called barrier(). With `values` (every worker gives a
        vector of the same length) return their elementwise sum, the same on every worker, one
        barrier per tfkv.ps.sums.CHUNK values."""
        if values is None:
            self._meet(None)
            return None
        pieces = sums.chunks(values)
        of = sum(p.size for p in pieces)
        return np.concatenate([self._meet({"sum": sums.encode(p), "of": of}) for p in pieces])

    def _meet(self, meta: dict[str, Any] | None) -> Any:
        self._barrier.clear()
        self._released = self._refusal = None
        self._barriers += 1
        self._post(P.Message(P.Type.BARRIER, sender=self.id, seq=self._barriers, meta=meta))
        while not self._barrier.wait(0.2):
            pass
        if self._refusal is not None:
            error = ClusterError(f"{self.name}: {self._refusal['message']}")
            raise reacting(error) if "left" in self._refusal else error
        return sums.decode(self._released["sum"]) if meta is not None and self._released else None

    def done(self) -> None:
        """Tell the scheduler this worker finished cleanly, then stop heartbeating."""
        self._post(P.Message(P.Type.DONE, sender=self.id))
        self._outbox.join()
        self._closed = True
        self._thread.join(timeout=5)

    def abort(self, reason: str) -> None:
        """Report that this node is failing, so the scheduler stops the job now, not after a
        heartbeat timeout."""
        self._aborting = True
        self._post(P.Message(P.Type.FAILED, sender=self.id, meta={"reason": reason[:500]}))
        self._outbox.join()
        self._closed = True
        self._thread.join(timeout=5)

    # -- internals -----------------------------------------------------------------------------

    def _post(self, msg: P.Message) -> None:
        """Hand `msg` to the link's thread (which owns the socket) and wake it."""
        self._outbox.put(msg)
        if not self._closed:  # the thread closes the pipe when it ends
            os.write(self._wake_w, b"\0")

    def _send(self, msg: P.Message) -> None:
        self._sock.send_multipart(P.encode(msg), copy=False)

    def _await_address_book(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.env.start_timeout
        while time.monotonic() < deadline:
            if self._sock.poll(200):
                try:
                    msg = P.decode(self._sock.recv_multipart(copy=False))
                except P.ProtocolError as e:
                    log.warning("ignored a malformed message from the scheduler: %s", e)
                    continue
                if msg.type == P.Type.ADDRESS_BOOK and msg.meta:
                    return msg.meta
                if msg.type in (P.Type.FAILED, P.Type.ERROR) and msg.meta:
                    raise ClusterError(f"scheduler refused {self.role}: "
                                       f"{msg.meta.get('reason') or msg.meta.get('message')}")
        raise ClusterError(
            f"{self.role}: no answer from the scheduler at {self.env.scheduler_host}:"
            f"{self.env.scheduler_port} within {self.env.start_timeout:.0f} s; is it running, and are "
            "DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT right?")

    def _die(self, reason: str, status: int = EXIT_PEER_FAILED) -> None:
        sys.stdout.flush()
        print(f"tfkv: {self.name}: {reason}; exiting", file=sys.stderr, flush=True)
        os._exit(status)

    def _loop(self) -> None:
        interval, timeout = self.env.heartbeat_interval, self.env.heartbeat_timeout
        last_sent = 0.0
        last_heard = time.monotonic()
        judge = _Judge(interval, timeout)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._closed:
            now = judge.tick()
            if now - last_sent >= interval:
                self._send(P.Message(P.Type.HEARTBEAT, sender=self.id))
                last_sent = now
            while not self._outbox.empty():
                self._send(self._outbox.get())
                self._outbox.task_done()
            ready = dict(poller.poll(min(interval, 0.05) * 1000))
            judge.tick()
            if self._wake_r in ready:
                try:
                    os.read(self._wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._sock in ready:
                try:
                    msg = P.decode(self._sock.recv_multipart(copy=False))
                except P.ProtocolError as e:
                    log.warning("ignored a malformed message from the scheduler: %s", e)
                    continue
                last_heard = time.monotonic()
                if msg.type == P.Type.BARRIER_DONE:
                    self._released = msg.meta
                    self._barrier.set()
                elif msg.type == P.Type.ERROR and msg.seq == self._barriers and not self._barrier.is_set():
                    self._refusal = msg.meta
                    self._barrier.set()
                elif msg.type == P.Type.LEFT:
                    self.left.append(msg.meta)
                elif msg.type == P.Type.SHUTDOWN:
                    self.shutdown.set()
                elif msg.type == P.Type.FAILED and not self._aborting:
                    meta = msg.meta or {}
                    self._die(f"{meta.get('node', 'a node')} failed ({meta.get('reason', 'no reason given')})")
            elif self._sock not in ready and not self.shutdown.is_set() and judge.silent(last_heard):
                self._die(f"the scheduler at {self.env.scheduler_host}:{self.env.scheduler_port} "
                          f"has been silent for {timeout:.1f} s", EXIT_PEER_SILENT)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class _Judge:
    """When a node may judge the scheduler silent: not while its own loop is held up.

    A loop that got no CPU (or no GIL: a sibling thread in a long C call) for a while sent no
    heartbeat to be answered, so no answer waits for it when it wakes: the scheduler's silence is
    judged once a heartbeat sent after waking had an interval to be answered (as the scheduler
    judges its nodes, tfkv.ps.scheduler), unless hold-ups have kept it from judging for two
    timeouts (a machine that never lets it catch up)."""

    def __init__(self, interval: float, timeout: float):
        self.interval, self.timeout = interval, timeout
        self.last = self.judge_from = time.monotonic()
        self.held_since: float | None = None

    def tick(self) -> float:
        """Note that the loop runs now; the time."""
        now = time.monotonic()
        if now - self.last > self.interval:
            self.held_since = self.held_since or now
            if now - self.held_since < 2 * self.timeout:
                self.judge_from = now + self.interval
        elif now >= self.judge_from:
            self.held_since = None
        self.last = now
        return now

    def silent(self, last_heard: float) -> bool:
        """Whether the scheduler, last heard at `last_heard`, has been silent past the timeout."""
        now = time.monotonic()
        return now >= self.judge_from and now - last_heard > self.timeout
