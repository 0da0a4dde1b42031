"""Forwarders between the workers and one server for the data-plane tests: what a network, or
someone on its path, does to the messages.

`Proxy` passes every message on as it is (a ROUTER for the workers, a DEALER to the server per
worker connection), each through `deliveries`, which its subclasses change: `LossyProxy` drops,
duplicates and delays (a bad network), tests/ps/test_protocol_attacks.py forges handshake answers.
It needs no keys: the data plane's messages are sealed end to end (tfkv.ps.channel)."""

import heapq
import random
import threading
import time

import zmq

from tfkv.ps import security


class Proxy:
    """Forward every message between the workers and the server at `server` (an address, or a
    callable giving it once the cluster formed), listening on 127.0.0.1:`port`."""

    def __init__(self, port: int, server):
        self.port, self.server = port, server
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def deliveries(self, to_server: bool, ident: bytes, frames: list[bytes]) -> list[tuple[float, list]]:
        """(delay in seconds, frames) of each message to deliver for one received."""
        return [(0.0, frames)]

    def _run(self) -> None:
        ctx = zmq.Context()
        front = ctx.socket(zmq.ROUTER)
        front.setsockopt(zmq.LINGER, 0)
        security.server_socket(front, None)
        front.bind(f"tcp://127.0.0.1:{self.port}")
        backs: dict[bytes, zmq.Socket] = {}
        owner: dict[zmq.Socket, bytes] = {}
        poller = zmq.Poller()
        poller.register(front, zmq.POLLIN)
        queue: list[tuple[float, int, object, list[bytes]]] = []
        n = 0
        self.ready.set()
        while not self.stop.is_set():
            for sock, _ in poller.poll(5):
                frames = sock.recv_multipart()
                if sock is front:
                    ident, frames = frames[0], frames[1:]
                    if ident not in backs:
                        b = ctx.socket(zmq.DEALER)
                        b.setsockopt(zmq.LINGER, 0)
                        security.client_socket(b, None)
                        if callable(self.server):
                            self.server = self.server()  # known once the cluster formed
                        b.connect(self.server)
                        backs[ident], owner[b] = b, ident
                        poller.register(b, zmq.POLLIN)
                    target, to_server = backs[ident], True
                else:
                    ident, target, to_server = owner[sock], front, False
                for delay, out in self.deliveries(to_server, ident, frames):
                    n += 1
                    heapq.heappush(queue, (time.monotonic() + delay, n, target, out if to_server else [ident, *out]))
            now = time.monotonic()
            while queue and queue[0][0] <= now:
                _, _, target, out = heapq.heappop(queue)
                target.send_multipart(out)
        for s in [front, *backs.values()]:
            s.close()
        ctx.term()


class LossyProxy(Proxy):
    """Drops, duplicates and delays a share of the messages each way (seeded): a bad network."""

    def __init__(self, port: int, server, seed: int = 1, drop: float = 0.1, dup: float = 0.1, delay: float = 0.1):
        self.rng = random.Random(seed)
        self.drop, self.dup, self.delay = drop, dup, delay
        self.stats = {"dropped": 0, "duplicated": 0, "delayed": 0, "forwarded": 0}
        super().__init__(port, server)

    def deliveries(self, to_server: bool, ident: bytes, frames: list[bytes]) -> list[tuple[float, list]]:
        x = self.rng.random()
        if x < self.drop:
            self.stats["dropped"] += 1
            return []
        if x < self.drop + self.dup:
            self.stats["duplicated"] += 1
            out = [(0.0, frames), (self.rng.uniform(0, 0.05), frames)]
        elif x < self.drop + self.dup + self.delay:
            self.stats["delayed"] += 1
            out = [(self.rng.uniform(0.01, 0.2), frames)]
        else:
            out = [(0.0, frames)]
        self.stats["forwarded"] += len(out)
        return out
