"""Where a parameter-server process learns its role and its cluster: environment variables.

tfkv's own names come first; MXNet's (DMLC_*, PS_*, MXNET_KVSTORE_*) are read too, so a job
launched by hand the way the MXNet guide shows works unchanged. The tuning knobs (PS_RESEND,
MXNET_KVSTORE_*, TFKV_*_TIMEOUT, ...) are read through tfkv.knobs, their one table. Read once
into a dataclass.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

from tfkv import knobs
from tfkv.errors import TfkvError
from tfkv import keys as job_keys

ROLES = ("scheduler", "server", "worker")


def _get(env: Mapping[str, str], *names: str, default: str | None = None) -> str | None:
    for n in names:
        if env.get(n):
            return env[n]
    return default


class ClusterEnvError(TfkvError, ValueError):
    """An environment variable is missing or malformed; the message names it."""


@dataclass(frozen=True)
class ClusterEnv:
    role: str
    scheduler_host: str
    scheduler_port: int
    num_servers: int
    num_workers: int
    interface: str | None = None
    rank_hint: int | None = None  # the launcher's index, so that ranks match log prefixes
    bigarray_bound: int = 1_000_000
    verbose: int = 0
    resend: bool = False
    resend_timeout: float = 1.0  # seconds
    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 4.0
    # A server that leaves a request unanswered and does not answer a PING about it within this
    # many seconds fails the job (a dist_sync pull may wait longer: the server says it holds it).
    request_timeout: float = 60.0
    start_timeout: float = 120.0
    max_message_bytes: int = 1 << 31
    reduction_nthreads: int = 4  # servers sum arrays of >= bigarray_bound elements in this many threads
    chunk_bytes: int = 16 << 20  # a worker sends a key's part in messages of at most this many bytes
    fusion_bytes: int = 512 << 10  # messages to one peer go together until this many payload bytes wait
    keys: job_keys.Keys | None = field(default=None, repr=False)  # the job's CURVE keys; None: plain TCP
    advertise: tuple[str, int] | None = None  # TFKV_ADVERTISE_ADDRESS host:port a server registers (NAT, proxies)

    @staticmethod
    def role_of(env: Mapping[str, str] | None = None) -> str | None:
        """The role set in the environment, or None for an ordinary (non-cluster) process."""
        role = _get(os.environ if env is None else env, "TFKV_ROLE", "DMLC_ROLE")
        return role.lower() if role else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "ClusterEnv":
        env = os.environ if env is None else env

        def need(*names: str) -> str:
            value = _get(env, *names)
            if value is None:
                raise ClusterEnvError(f"{names[-1]} (or {names[0]}) is not set; a parameter-server "
                                      "process needs DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, "
                                      "DMLC_NUM_SERVER and DMLC_NUM_WORKER")
            return value

        def number(kind: type, value: str | None, name: str) -> int | float:
            try:
                return kind(value)
            except (TypeError, ValueError):
                raise ClusterEnvError(f"{name}={value!r} is not a {kind.__name__}") from None

        role = need("TFKV_ROLE", "DMLC_ROLE").lower()
        if role not in ROLES:
            raise ClusterEnvError(f"DMLC_ROLE={role!r} must be one of {', '.join(ROLES)}")
        hint = _get(env, "TFKV_RANK_HINT")
        try:
            keys = job_keys.keys_from_env(env)
        except job_keys.SecurityError as e:
            raise ClusterEnvError(str(e)) from None
        def knob(name: str) -> Any:  # tfkv.knobs: the one table of these variables
            try:
                return knobs.get(name, env)
            except ValueError as e:
                raise ClusterEnvError(str(e)) from None

        return cls(
            keys=keys,
            advertise=host_port(_get(env, "TFKV_ADVERTISE_ADDRESS"), "TFKV_ADVERTISE_ADDRESS"),
            role=role,
            scheduler_host=need("TFKV_SCHEDULER_HOST", "DMLC_PS_ROOT_URI"),
            scheduler_port=int(number(int, need("TFKV_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT"), "DMLC_PS_ROOT_PORT")),
            num_servers=int(number(int, need("TFKV_NUM_SERVER", "DMLC_NUM_SERVER"), "DMLC_NUM_SERVER")),
            num_workers=int(number(int, need("TFKV_NUM_WORKER", "DMLC_NUM_WORKER"), "DMLC_NUM_WORKER")),
            interface=knob("cluster.interface"),
            rank_hint=int(number(int, hint, "TFKV_RANK_HINT")) if hint else None,
            bigarray_bound=knob("kvstore.bigarray_bound"),
            verbose=knob("cluster.verbose"),
            resend=knob("kvstore.resend"),
            resend_timeout=knob("kvstore.resend_timeout") / 1000.0,
            heartbeat_interval=knob("cluster.heartbeat_interval"),
            heartbeat_timeout=knob("cluster.heartbeat_timeout"),
            request_timeout=knob("cluster.request_timeout"),
            start_timeout=knob("cluster.start_timeout"),
            max_message_bytes=knob("kvstore.max_message_bytes"),
            reduction_nthreads=max(1, knob("kvstore.reduction_nthreads")),
            chunk_bytes=max(4, knob("kvstore.chunk_bytes")),
            fusion_bytes=max(0, knob("kvstore.fusion_bytes")),
        )

    def enable_logging(self) -> None:
        """PS_VERBOSE must show, also in a plain script that configured no logging."""
        if self.verbose and not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")

    def bind_address(self) -> str:
        """The address this node listens on: the chosen interface's, else the one that routes
        to the scheduler. Never 0.0.0.0."""
        if self.interface:
            return interface_address(self.interface)
        return route_address(self.scheduler_host, self.scheduler_port)


def host_port(value: str | None, name: str) -> tuple[str, int] | None:
    """`host:port` (IPv6 as [addr]:port) from variable `name`, or a ClusterEnvError naming it."""
    if value is None:
        return None
    host, _, port = value.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return host, int(port)
    raise ClusterEnvError(f"{name}={value!r} must be host:port, with a port from 1 to 65535 "
                          "(e.g. 203.0.113.5:9000): the address workers should connect to")


def interface_address(name: str) -> str:
    """IPv4 address of a network interface such as eth0 (Linux SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        except OSError:
            known = ", ".join(n for _, n in socket.if_nameindex())
            raise ClusterEnvError(f"DMLC_INTERFACE={name!r} has no IPv4 address here; "
                                  f"interfaces: {known}") from None
    return socket.inet_ntoa(packed[20:24])


def route_address(host: str, port: int) -> str:
    """The local address the kernel would use to reach host:port (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), port or 9))
            return s.getsockname()[0]
    except OSError as e:
        raise ClusterEnvError(f"cannot reach the scheduler at {host}:{port} ({e}); check "
                              "DMLC_PS_ROOT_URI") from None
