"""Scheduler ports: each job on this machine gets its own, and never one the kernel hands out itself.

A launcher picks the scheduler's port before any role starts; the scheduler binds it seconds
later. Two things could take the port in between, and both happen when trials of a sweep run side
by side (`hydra/launcher=joblib`, `hydra/launcher=tfkv`):
- another tfkv launcher on this machine picking at the same moment. Each picked port is leased:
  the picking process binds the abstract Unix socket `tfkv-port-<port>` (Linux) and holds it until
  the job ends (`release_port`) or the process dies, when the kernel drops the name by itself,
  so a crash leaves no stale lease. A port whose name is taken is skipped.
- the kernel choosing a local port for someone's outgoing connection (a `connect()`, e.g. another
  job's ZeroMQ links) or for a bind to port 0. Ports are therefore picked outside the kernel's
  ephemeral range (`ip_local_port_range`), outside `ip_local_reserved_ports`, and below 49152,
  where pyzmq's `bind_to_random_port` (the servers' ports) starts.

Abstract socket names belong to the network namespace, as ports do. Where they do not exist (not
Linux) the range alone protects the port.
"""

from __future__ import annotations

import random
import socket
import sys
import threading
from pathlib import Path

LOW, HIGH = 20000, 49152  # [LOW, HIGH): above most fixed service ports, below the servers' range
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range
_TRIES = 500

_leases: dict[int, socket.socket] = {}
_lock = threading.Lock()


def _ephemeral() -> range:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        lo, hi = _DEFAULT_EPHEMERAL
    return range(lo, hi + 1)


def _reserved() -> set[int]:
    """The admin's ip_local_reserved_ports ("8080,9000-9010"): kept for services that bind them."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text().strip()
    except OSError:
        return set()
    ports: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        ports.update(range(int(lo), int(hi or lo) + 1))
    return ports


def candidates() -> list[int]:
    """The ports a scheduler may get here; when the kernel hands out every port of the range
    itself, the whole range (then only the lease protects a port)."""
    ephemeral, reserved = _ephemeral(), _reserved()
    ports = [p for p in range(LOW, HIGH) if p not in ephemeral and p not in reserved]
    return ports or [p for p in range(LOW, HIGH) if p not in reserved]


def _lease(port: int) -> socket.socket | None:
    """This process's lease on `port`, or None when another process holds it."""
    if not sys.platform.startswith("linux"):
        return socket.socket()  # nothing to hold: a placeholder closed like a lease
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0tfkv-port-{port}")  # a leading NUL: the abstract namespace, no file
    except OSError:
        s.close()
        return None
    return s


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, leased to this process until `release_port` or its exit:
    no other tfkv process on this machine gets it meanwhile, nor does the kernel for a connection."""
    ports = candidates()
    # SystemRandom: a user's random.seed() must not make two processes try the same ports in order
    for port in random.SystemRandom().sample(ports, min(_TRIES, len(ports))):
        with _lock:
            if port in _leases:
                continue
            lease = _lease(port)
            if lease is None:
                continue
            if _bindable(host, port):
                _leases[port] = lease
                return port
            lease.close()
    raise OSError(f"no free TCP port on {host} among {_TRIES} tried in {LOW}-{HIGH - 1} outside the kernel's "
                  "ephemeral range; set the scheduler's port (cluster.port / --port)")


def release_port(port: int) -> None:
    """End this process's lease on `port` (the job that used it ended); nothing if it holds none."""
    with _lock:
        lease = _leases.pop(port, None)
    if lease is not None:
        lease.close()
