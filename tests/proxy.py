"""Forwarders between the workers and one server for the data-plane tests: what a network, or
someone on its path, does to the messages.

`Proxy` passes every message on as it is (a ROUTER for the workers, a DEALER to the server per
worker connection), each through `deliveries`, which its subclasses change: `LossyProxy` drops,
duplicates and delays (a bad network), tests/ps/test_protocol_attacks.py forges handshake answers.
It needs no keys: the data plane's messages are sealed end to end (tfkv.ps.channel).
`CuttingTcpProxy` passes TCP bytes on and cuts a connection once, as a failing network does."""

import heapq
import random
import socket
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


class CuttingTcpProxy:
    """A TCP proxy (bytes, not ZeroMQ messages) between the workers and one server at `server` (an
    address "host:port", or a callable giving (host, port) once the cluster formed), listening on
    127.0.0.1:`port`, that cuts its first connection once, where a network failure would: after
    passing on `passed` whole messages from the server (0: before the first, a data-plane
    WELCOME, reaches the worker; 1: just after it). Both ends see the connection close; ZeroMQ
    reconnects (the server sees a new connection) and from then on every byte is passed on.

    It reads ZMTP 3 framing from the server (a 64-byte greeting, then frames: a flags byte, a size
    of 1 byte or, with the LONG flag, 8, and the body) to know where a message ends."""

    _MORE, _LONG, _COMMAND = 1, 2, 4

    def __init__(self, port: int, server, passed: int):
        self.server, self.passed = server, passed
        self.cut_at: float | None = None  # time.monotonic() of the cut
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", port))
        self._listener.settimeout(0.2)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self._listener.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                worker, _ = self._listener.accept()
            except socket.timeout:
                continue
            if callable(self.server):
                self.server = "%s:%d" % self.server()
            host, port = self.server.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            self.connections += 1
            cutting = self.connections == 1
            threading.Thread(target=self._pump, args=(worker, upstream), daemon=True).start()
            threading.Thread(target=self._from_server, args=(upstream, worker, cutting), daemon=True).start()

    @staticmethod
    def _shut(*socks: socket.socket) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        self._shut(src, dst)

    def _from_server(self, server: socket.socket, worker: socket.socket, cutting: bool) -> None:
        """Pass the server's bytes on; on the connection to cut, frame by frame up to the cut."""
        buf, greeting = b"", 64  # greeting bytes still to pass on (at once: each end waits for the other's)
        try:
            while cutting:
                data = server.recv(1 << 16)
                if not data:
                    break
                buf += data
                while True:  # pass on each whole unit: the greeting, then frames
                    if greeting:
                        worker.sendall(buf[:greeting])
                        buf, greeting = buf[greeting:], max(0, greeting - len(buf))
                        if greeting:
                            break
                        continue
                    if len(buf) < 2:
                        break
                    flags = buf[0]
                    head = 9 if flags & self._LONG else 2
                    if len(buf) < head:
                        break
                    size = int.from_bytes(buf[1:head], "big")
                    if len(buf) < head + size:
                        break
                    message = not flags & self._COMMAND
                    if message and not self.passed:
                        return self._cut(server, worker)
                    worker.sendall(buf[:head + size])
                    buf = buf[head + size:]
                    if message and not flags & self._MORE:  # the message's last frame is through
                        self.passed -= 1
            worker.sendall(buf)
            self._pump(server, worker)
        except OSError:
            self._shut(server, worker)

    def _cut(self, *socks: socket.socket) -> None:
        self.cut_at = time.monotonic()
        self._shut(*socks)
