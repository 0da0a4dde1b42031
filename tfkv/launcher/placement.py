"""Which hosts take the servers and which the workers, and the CPUs each role may use on its host.

Server hosts (BytePS's placement: CPU-only machines summing while the GPU hosts compute) are the
hosts-file lines that say `role=server`, and the hosts `cluster.server_hosts` names (hosts of the
hosts file). With any, the scheduler runs on the first server host, the servers cycle over the
server hosts, and the workers go only on the other hosts (round robin, or their slots=). Without
any, placement is MXNet's (tfkv.launcher.plan). Only a launcher that runs each role on the host the
plan gives it (its `places_roles` trait: ssh, mpi) can honour them; the others are refused.

On a host that runs both (a GPU host's idle cores), `cluster.server_cpus` and `cluster.worker_cpus`
pin the servers (and the scheduler) and the workers to disjoint CPU sets, taskset's list syntax
(`0-3,8`): each role's command runs under `taskset -c LIST`, so it and every thread it starts
(TensorFlow sizes its thread pools from the CPUs it may use) stay in their set, whatever the launcher.

Everything here is checked before any process starts; a bad setting is one ConfigError line.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from tfkv.errors import ConfigError
from tfkv.launcher import base
from tfkv.launcher.hosts import Host

_CPUS = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def server_hosts(launcher: str, hostfile: str | None, hosts: Sequence[Host], named: Sequence[str] | None,
                 num_servers: int) -> list[str]:
    """The job's server hosts in hosts-file order (empty: MXNet's placement), or a ConfigError."""
    named = [str(n) for n in named or []]
    if named and not hostfile:
        raise ConfigError("cluster.server_hosts names hosts of the hosts file; give one (-H hosts / "
                          "cluster.hostfile=hosts), or mark its server lines role=server")
    distinct = list(dict.fromkeys(h.name for h in hosts))
    unknown = [n for n in named if n not in distinct]
    if unknown:
        raise ConfigError(f"cluster.server_hosts: {unknown[0]} is not a host of {hostfile} (its hosts: "
                          f"{', '.join(distinct)}); name hosts of the hosts file")
    twice = [n for i, n in enumerate(named) if n in named[:i]]
    if twice:
        raise ConfigError(f"cluster.server_hosts: {twice[0]} is listed twice; name each server host once")
    servers = [n for n in distinct if n in named or any(h.server for h in hosts if h.name == n)]
    if not servers:
        return []
    needs_placing(launcher, f"server hosts ({', '.join(servers)})",
                  "server hosts are for --launcher {placing}, or drop role=server / cluster.server_hosts")
    if len(servers) >= len(distinct):
        raise ConfigError(f"{len(servers)} server host(s) but {hostfile} holds only {len(distinct)} host(s): no host is "
                          "left for the workers; list worker hosts too, or name fewer server hosts")
    if num_servers < len(servers):
        raise ConfigError(f"cluster.num_servers={num_servers} is fewer than the {len(servers)} server hosts "
                          f"({', '.join(servers)}): one would be idle; raise num_servers (-s) to at least "
                          f"{len(servers)} or name fewer server hosts")
    return servers


def needs_placing(launcher: str, what: str, instead: str) -> None:
    """A ConfigError, `what` first, unless `launcher` places roles on hosts (its `places_roles`
    trait); `instead` says what to do, {placing} naming the launchers that do."""
    traits = base.traits(launcher)
    if not traits.places_roles:
        placing = " or ".join(n for n in base.REGISTRY.names() if base.traits(n).places_roles)
        raise ConfigError(f"{what}: the {launcher} launcher does not place roles on hosts "
                          f"({'the resource manager picks the nodes' if traits.chooses_nodes else 'one machine'}); "
                          + instead.format(placing=placing))


def check_on_hosts(plan: Sequence[Any], found: Mapping[str, Any], server_cpus: str | None,
                   worker_cpus: str | None) -> None:
    """After the pre-flight, before any role starts: each pinned role's CPUs are CPUs its host
    lets it use (`found`: host -> the CPUs the pre-flight saw there, None where unknown)."""
    for p in plan:
        key, cpus = ("worker_cpus", worker_cpus) if p.role == "worker" else ("server_cpus", server_cpus)
        there = found.get(p.host)
        missing = sorted(cpu_set(cpus, f"cluster.{key}") - set(there)) if there is not None else []
        if missing:
            raise ConfigError(f"cluster.{key}={cpus} names CPU(s) {', '.join(map(str, missing))} that {p.name} may not "
                              f"use on {p.host} (the pre-flight found CPUs {_ranges(there)}); name CPUs of that host")


def _ranges(cpus: Sequence[int]) -> str:
    """0,1,2,3,8 as 0-3,8: taskset's list syntax."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


def cpu_set(text: str | None, where: str) -> set[int]:
    """The CPUs of a taskset list (`0-3,8`); empty for None; a ConfigError naming `where` if malformed."""
    if text is None:
        return set()
    spec = str(text).replace(" ", "")
    if not _CPUS.match(spec):
        raise ConfigError(f"{where}={text!r} is not a CPU list; write CPU numbers and ranges as taskset -c takes "
                          "them, e.g. 0-3,8")
    got: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ConfigError(f"{where}={text!r}: the range {part} runs backwards; write {hi}-{lo}")
        got.update(range(lo, hi + 1))
    return got


def check_cpus(server_cpus: str | None, worker_cpus: str | None) -> None:
    """Both CPU lists well formed and disjoint (the point of pinning is that they do not share)."""
    servers = cpu_set(server_cpus, "cluster.server_cpus")
    shared = servers & cpu_set(worker_cpus, "cluster.worker_cpus")
    if shared:
        raise ConfigError(f"cluster.server_cpus={server_cpus} and cluster.worker_cpus={worker_cpus} share CPU(s) "
                          f"{', '.join(map(str, sorted(shared)))}; give the servers and the workers disjoint sets")

