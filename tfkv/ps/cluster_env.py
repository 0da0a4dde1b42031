"""Where a parameter-server process learns its role and its cluster: environment variables.

tfkv's own names come first; MXNet's (DMLC_*, PS_*, MXNET_KVSTORE_*) are read too, so a job
launched by hand the way the MXNet guide shows works unchanged. Read once into a dataclass:
the process wiring (role, scheduler, sizes, keys) declared here, and one attribute per knob the
parameter-server runtime reads (PS_RESEND, MXNET_KVSTORE_*, TFKV_*_TIMEOUT, ...), derived from
its row in tfkv.knobs, the one table of them: its name is the row's config setting, its default
the row's. `role_of` is the one reading of the role alone (tfkv.ps.node.role asks it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from tfkv import knobs
from tfkv.errors import TfkvError, with_article
from tfkv import keys as job_keys

ROLES = ("scheduler", "server", "worker")


def _get(env: Mapping[str, str], *names: str, default: str | None = None) -> str | None:
    for n in names:
        if env.get(n):
            return env[n]
    return default


class ClusterEnvError(TfkvError, ValueError):
    """An environment variable is missing or malformed; the message names it."""


def _knob_fields(cls: type) -> type:
    """Every knob the parameter-server runtime reads (tfkv.knobs.read_by(PS)) as a field of
    `cls` after its own, named by its config setting, its default the row's as ClusterEnv holds
    it (e.g. resend_timeout in seconds): ClusterEnv.fusion_bytes, .heartbeat_timeout, ..."""
    for k in knobs.read_by(knobs.PS):
        cls.__annotations__[k.setting] = Optional[k.type] if k.default is None else k.type
        setattr(cls, k.setting, None if k.default is None else k.in_cluster_env(k.default))
    return cls


@dataclass(frozen=True)
@_knob_fields
class ClusterEnv:
    """A role's place in its job, then the knobs its runtime reads (`_knob_fields`; e.g.
    fusion_bytes, or resend_timeout in seconds; each one's meaning is its row's doc)."""

    role: str
    scheduler_host: str
    scheduler_port: int
    num_servers: int
    num_workers: int
    rank_hint: int | None = None  # the launcher's index, so that ranks match log prefixes
    keys: job_keys.Keys | None = field(default=None, repr=False)  # the job's CURVE keys; None: plain TCP
    advertise: tuple[str, int] | None = None  # TFKV_ADVERTISE_ADDRESS host:port a server registers (NAT, proxies)

    @staticmethod
    def role_of(env: Mapping[str, str] | None = None) -> str | None:
        """The role set in the environment, or None for an ordinary (non-cluster) process."""
        role = _get(os.environ if env is None else env, "TFKV_ROLE", "DMLC_ROLE")
        return role.lower() if role else None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, knobs: Mapping[str, Any] | None = None) -> "ClusterEnv":
        """The role's wiring from `env` (os.environ unless given); its knob attributes from `knobs`
        (the run's resolved values by config key, tfkv.knobs.resolve) or, without them, from `env`."""
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
                raise ClusterEnvError(f"{name}={value!r} is not {with_article(kind.__name__)}") from None

        role = cls.role_of(env) or need("TFKV_ROLE", "DMLC_ROLE")  # need: the line naming what is unset
        if role not in ROLES:
            raise ClusterEnvError(f"DMLC_ROLE={role!r} must be one of {', '.join(ROLES)}")
        hint = _get(env, "TFKV_RANK_HINT")
        try:
            keys = job_keys.keys_from_env(env)
        except job_keys.SecurityError as e:
            raise ClusterEnvError(str(e)) from None
        return cls(
            keys=keys,
            advertise=host_port(_get(env, "TFKV_ADVERTISE_ADDRESS"), "TFKV_ADVERTISE_ADDRESS"),
            role=role,
            scheduler_host=need("TFKV_SCHEDULER_HOST", "DMLC_PS_ROOT_URI"),
            scheduler_port=int(number(int, need("TFKV_SCHEDULER_PORT", "DMLC_PS_ROOT_PORT"), "DMLC_PS_ROOT_PORT")),
            num_servers=int(number(int, need("TFKV_NUM_SERVER", "DMLC_NUM_SERVER"), "DMLC_NUM_SERVER")),
            num_workers=int(number(int, need("TFKV_NUM_WORKER", "DMLC_NUM_WORKER"), "DMLC_NUM_WORKER")),
            rank_hint=int(number(int, hint, "TFKV_RANK_HINT")) if hint else None,
            **knob_values(env, knobs),
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


def knob_values(env: Mapping[str, str], values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """ClusterEnv's knob attributes as `values` (resolved, by config key) give them, else as `env`
    sets them (tfkv.knobs.value: the value, the variable, else the row's default); a variable its
    type does not take is a ClusterEnvError naming it."""
    out = {}
    for k in knobs.read_by(knobs.PS):
        try:
            value = knobs.value(k.key, values, env)
        except ValueError as e:
            raise ClusterEnvError(str(e)) from None
        out[k.setting] = None if value is None else k.in_cluster_env(value)
    return out


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
