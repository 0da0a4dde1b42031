"""The scheduler: membership, ranks, barriers and failure detection for one job.

It waits for every server and worker to register, gives each a rank and the address book
(where every server listens), then watches heartbeats. Barriers are released when every worker
has arrived; a barrier whose workers each bring a vector releases them with its sum
(`tfkv.ps.sums`). When a node goes silent for longer than the heartbeat timeout, every remaining node
is told which one failed and the scheduler exits non-zero; when every worker reports DONE, the
servers are told to shut down and it exits 0. A worker that reports DONE before the others has
left for good: the servers are told (LEFT), so that a synchronous round it never pushed into
fails at once instead of waiting for it, and a barrier, which needs every worker, is refused
with an ERROR naming it, both to workers already waiting and to any that arrive later. No
TensorFlow here.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq

from tfkv.errors import EXIT_PEER_FAILED, EXIT_PEER_SILENT
from tfkv.ps import protocol as P
from tfkv.ps import security, sums
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.scheduler_link import node_name
from tfkv.ps.strangers import Strangers

log = logging.getLogger("tfkv.ps")


@dataclass
class Node:
    identity: bytes
    role: str
    host: str
    port: int
    rank_hint: int | None
    hostname: str
    pid: int
    id: int = 0
    rank: int = 0
    last_seen: float = 0.0
    done: bool = False

    @property
    def name(self) -> str:
        return node_name(self.role, self.rank)


class Scheduler:
    def __init__(self, env: ClusterEnv):
        self.env = env
        self.sock = security.router_socket(env.keys)  # control traffic: a few messages per node
        try:
            self.sock.bind(f"tcp://{env.scheduler_host}:{env.scheduler_port}")
        except zmq.ZMQError as e:
            raise OSError(f"scheduler cannot listen on {env.scheduler_host}:{env.scheduler_port} ({e}); "
                          "pick another DMLC_PS_ROOT_PORT or a local address for DMLC_PS_ROOT_URI") from None
        self.nodes: dict[bytes, Node] = {}
        self._formed = False  # every node registered: from then on only members are heard
        self._strangers = Strangers("scheduler")
        # Messages heard from members once the cluster formed, by type: the control plane's load,
        # logged when the job ends (python -m benchmarks control_plane reads the heartbeat rate).
        self.heard: Counter[str] = Counter()
        self._next_look = 0.0  # when `_silent` next looks for silent nodes
        self._behind_since: float | None = None  # since when messages wait each time it would look
        self._last_call = 0.0  # when `_silent` was last called (the loop's pace)
        self._looked = time.monotonic()  # when `_silent` last judged

    def run(self) -> int:
        """Run the job's membership to the end: 0 when every worker finished, EXIT_PEER_FAILED
        when a node failed, EXIT_PEER_SILENT when one went silent (hung, or dead without a word),
        1 when the cluster never formed."""
        if not self._gather():
            return 1
        formed = time.monotonic()
        status = self._watch()
        log.info("scheduler: heard %s in %.1f s since the cluster formed", ", ".join(
            f"{n} {kind}" for kind, n in sorted(self.heard.items())) or "nothing", time.monotonic() - formed)
        return status

    def _recv(self, timeout_ms: float) -> tuple[bytes, P.Message] | None:
        """The next message, decoded and checked against its schema; None for nothing, for a
        malformed one (answered with an error, to a stranger only a few times) and, once the cluster formed, for anything from
        a connection that is not a node of the job (dropped unread)."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(copy=False)
        identity = frames[0].bytes
        if self._formed and identity not in self.nodes:
            return None
        try:
            return identity, P.decode(frames[1:])
        except P.ProtocolError as e:
            # Tell a member what it sent wrong, and a registering node why it gets no place.
            self._refuse(identity, P.refusal(frames[1:], str(e)), f"a malformed message: {e}")
            return None

    def _refuse(self, identity: bytes, error: P.Message, what: str) -> None:
        """Answer with `error`: always a node of the job; anyone else (a node still registering,
        a stranger) only while its few answers last (tfkv.ps.strangers), then silently."""
        if identity not in self.nodes and not self._strangers.may_answer(identity):
            return
        log.warning("scheduler: refused %s", what)
        try:
            self.sock.send_multipart([identity, *P.encode(error)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # its connection is gone: nothing to tell

    def _send(self, node: Node, msg: P.Message) -> None:
        self.sock.send_multipart([node.identity, *P.encode(msg)], copy=False)

    def _gather(self) -> bool:
        want = {"server": self.env.num_servers, "worker": self.env.num_workers}
        deadline = time.monotonic() + self.env.start_timeout
        log.info("scheduler: waiting for %d servers and %d workers on %s:%d", want["server"],
                 want["worker"], self.env.scheduler_host, self.env.scheduler_port)
        while len(self.nodes) < sum(want.values()):
            if time.monotonic() > deadline:
                have = {r: sum(n.role == r for n in self.nodes.values()) for r in want}
                missing = ", ".join(f"{want[r] - have[r]} {r}(s)" for r in want if have[r] < want[r])
                reason = f"only {len(self.nodes)} of {sum(want.values())} nodes registered within " \
                         f"{self.env.start_timeout:.0f} s (missing {missing})"
                log.error("scheduler: %s", reason)
                for node in self.nodes.values():
                    self._send(node, P.Message(P.Type.FAILED, meta={"node": "the cluster", "reason": reason}))
                return False
            got = self._recv(200)
            if got is None:
                continue
            identity, msg = got
            if msg.type != P.Type.REGISTER:
                continue
            m = msg.meta  # checked by protocol.decode against REGISTER's schema: types and ranges
            role = m["role"]
            if sum(n.role == role for n in self.nodes.values()) >= want[role]:
                self._refuse(identity, P.error(msg, f"no place for a {role!r} in this job"), f"a {role} with no place")
                continue
            self.nodes[identity] = Node(identity, role, m["host"], m["port"], m.get("rank_hint"), m["hostname"],
                                        m["pid"])
            if self.env.verbose >= 1:
                log.info("scheduler: %s registered from %s (pid %s)", role, m.get("hostname"), m.get("pid"))

        self._formed = True
        next_id = 1
        for role in ("server", "worker"):
            members = [n for n in self.nodes.values() if n.role == role]
            members.sort(key=lambda n: (n.rank_hint is None, n.rank_hint or 0))
            for rank, node in enumerate(members):
                node.rank, node.id = rank, next_id
                next_id += 1
        servers = sorted((n for n in self.nodes.values() if n.role == "server"), key=lambda n: n.rank)
        book: dict[str, Any] = {
            "num_servers": self.env.num_servers, "num_workers": self.env.num_workers,
            "servers": [{"rank": n.rank, "id": n.id, "host": n.host, "port": n.port} for n in servers],
            "nodes": [{"id": n.id, "role": n.role, "rank": n.rank, "hostname": n.hostname, "pid": n.pid}
                      for n in self.nodes.values()],
        }
        now = time.monotonic()
        for node in self.nodes.values():
            node.last_seen = now
            self._send(node, P.Message(P.Type.ADDRESS_BOOK, meta={**book, "id": node.id, "rank": node.rank}))
        log.info("scheduler: cluster complete: %s", ", ".join(
            f"{n.name}@{n.hostname}" for n in sorted(self.nodes.values(), key=lambda n: n.id)))
        return True

    def _fail(self, culprit: str, reason: str, status: int = EXIT_PEER_FAILED) -> int:
        log.error("scheduler: %s failed (%s); stopping every node", culprit, reason)
        for node in self.nodes.values():
            if not node.done and node.name != culprit:
                self._send(node, P.Message(P.Type.FAILED, meta={"node": culprit, "reason": reason}))
        return status

    def _refuse_barrier(self, waiting: dict[bytes, P.Message], number: int, left: Node) -> None:
        """Answer every worker waiting at barrier `number` with an ERROR: `left` finished, so it
        never comes and the barrier can never be released."""
        for identity, barrier in waiting.items():
            reason = (f"barrier {number} can never be released: {left.name} left the job (it finished "
                      "and closed its store) and will not reach it")
            log.error("scheduler: %s: %s", self.nodes[identity].name, reason)
            self._send(self.nodes[identity], P.error(barrier, reason, left=left.name))
        waiting.clear()

    def _watch(self) -> int:
        waiting: dict[bytes, P.Message] = {}  # who is at the barrier, with its BARRIER (and the sum it brings)
        workers = [n for n in self.nodes.values() if n.role == "worker"]
        released = 0  # barriers released so far: the one waited on is released + 1
        left: Node | None = None  # the first worker that finished while others still work
        while True:
            got = self._recv(self.env.heartbeat_interval * 500)
            now = time.monotonic()
            if got is not None:
                identity, msg = got
                node = self.nodes.get(identity)
                if node is None:
                    continue  # a stranger: not part of this job
                node.last_seen = now
                self.heard[msg.type.name] += 1
                if msg.type == P.Type.HEARTBEAT:
                    self._send(node, P.Message(P.Type.HEARTBEAT, reply=True))
                elif msg.type == P.Type.BARRIER and node.role == "worker":
                    waiting[identity] = msg
                    if left is not None:
                        self._refuse_barrier(waiting, released + 1, left)
                    elif len(waiting) == len(workers):
                        ranked = sorted(workers, key=lambda n: n.rank)
                        try:
                            meta = sums.release([waiting[w.identity].meta for w in ranked], [w.name for w in ranked])
                        except ValueError as e:
                            return self._fail(node.name, str(e))
                        for w in workers:
                            self._send(w, P.Message(P.Type.BARRIER_DONE, meta=meta))
                        waiting.clear()
                        released += 1
                elif msg.type == P.Type.DONE and node.role == "worker":
                    node.done = True
                    if self.env.verbose >= 1:
                        log.info("scheduler: %s finished", node.name)
                    if all(w.done for w in workers):
                        for n in self.nodes.values():
                            if n.role == "server":
                                self._send(n, P.Message(P.Type.SHUTDOWN))
                        log.info("scheduler: every worker finished; shutting the servers down")
                        return 0
                    left = left or node
                    for n in self.nodes.values():
                        if n.role == "server":
                            self._send(n, P.Message(P.Type.LEFT, meta={"id": node.id, "node": node.name}))
                    self._refuse_barrier(waiting, released + 1, left)
                elif msg.type == P.Type.FAILED:
                    return self._fail(node.name, (msg.meta or {}).get("reason", "it reported a failure"))
            silent = self._silent(now)
            if silent is not None:
                return self._fail(silent.name, f"no heartbeat for {now - silent.last_seen:.1f} s "
                                               f"from pid {silent.pid} on {silent.hostname}", EXIT_PEER_SILENT)

    def _silent(self, now: float) -> Node | None:
        """The first node not heard from for longer than the heartbeat timeout, or None.

        Judged every half heartbeat interval, not after every message (a look is O(nodes), so
        per message it cost O(nodes^2) per interval), and only once what has already arrived is
        read: a scheduler that got no CPU for a while (a loaded machine) finds the nodes' heartbeats
        of that while waiting in its socket, and must not blame a node for its own delay. A backlog
        that lasts a whole heartbeat timeout of reading is judged anyway. After such a while the
        socket may not show them yet (ZeroMQ's I/O thread got no CPU either and has not read them
        from the kernel): a loop that was held up looks one heartbeat interval later, unless it
        has not judged for two heartbeat timeouts (a machine that never lets it catch up)."""
        held_up = self._last_call and now - self._last_call > self.env.heartbeat_interval
        self._last_call = now
        if held_up and now - self._looked < 2 * self.env.heartbeat_timeout:
            self._next_look = max(self._next_look, now + self.env.heartbeat_interval)
        if now < self._next_look:
            return None
        if self.sock.poll(0):
            self._behind_since = self._behind_since or now
            if now - self._behind_since < self.env.heartbeat_timeout:
                return None
        self._behind_since = None
        self._next_look, self._looked = now + self.env.heartbeat_interval / 2, now
        return next((n for n in self.nodes.values()
                     if not n.done and now - n.last_seen > self.env.heartbeat_timeout), None)
