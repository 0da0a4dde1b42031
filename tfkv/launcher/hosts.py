"""The hosts file: one host per line as `host`, `host:port` or `user@host[:port]`, then optionally
`slots=N` (Open MPI's hostfile word: how many workers the host takes) and `role=server` (a server
host: it runs the servers and the scheduler and no worker, BytePS's CPU-only machines; once a line
says so, workers run only on the other hosts: tfkv.launcher.placement), `#` comments.

A bad line is a `HostsError` naming the file, the line number and what is wrong. A host may be
listed more than once (more processes go there; its slots add up: a line without slots= is one
slot), but always with the same user and port: the launchers tell hosts apart by name, so two ssh
servers behind one name need an alias each in the ssh config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tfkv.errors import ConfigError

_LINE = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<port>\d+))?"
                   r"(?P<words>(?:\s+(?:slots|role)\s*=\s*\S+)*)$")
_WORD = re.compile(r"(slots|role)\s*=\s*(\S+)")
ROLES = ("server",)  # what `role=` may say; a line without it is a worker host (or both, with no server host)


class HostsError(ConfigError):
    """The hosts file cannot be used; the message names the line."""


@dataclass(frozen=True)
class Host:
    name: str  # hostname or address, as written
    user: str | None = None
    port: int | None = None  # the ssh port
    slots: int | None = field(default=None, compare=False)  # `slots=N`: workers it takes; None: not said
    server: bool = field(default=False, compare=False)  # `role=server`: servers and the scheduler only

    def __str__(self) -> str:
        return (f"{self.user}@" if self.user else "") + self.name + (f":{self.port}" if self.port else "")


def parse_hosts(text: str, source: str = "hosts") -> list[Host]:
    """The file's hosts, one entry per line, in order."""
    hosts: list[Host] = []
    first: dict[str, tuple[int, Host]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise HostsError(f"{source}:{number}: {raw.strip()!r} is not a host; write host, host:port or "
                             "user@host[:port], then optionally slots=N and role=server, one per line")
        port = int(m["port"]) if m["port"] else None
        if port is not None and not 0 < port < 65536:
            raise HostsError(f"{source}:{number}: port {port} is out of range 1-65535")
        words = dict(_WORD.findall(m["words"]))
        slots, role = words.get("slots"), words.get("role")
        if slots is not None and not (slots.isdigit() and int(slots) > 0):
            raise HostsError(f"{source}:{number}: slots={slots} is not a number of workers; write slots=N, N >= 1")
        if role is not None and role not in ROLES:
            raise HostsError(f"{source}:{number}: role={role} is not a role a host takes; write role=server (servers "
                             "and the scheduler, no worker) or leave it out (a worker host)")
        if role and slots:
            raise HostsError(f"{source}:{number}: slots={slots} counts workers, but role=server takes none; drop one")
        host = Host(m["host"].strip("[]"), m["user"], port, int(slots) if slots else None, role == "server")
        seen = first.setdefault(host.name, (number, host))
        if seen[1] != host:
            raise HostsError(f"{source}:{number}: {host} and {seen[1]} (line {seen[0]}) are one host name with "
                             f"another user or port; give each ssh server its own alias (Host ... HostName "
                             f"{host.name} Port ...) in the ssh config and list the aliases")
        if seen[1].server != host.server:
            raise HostsError(f"{source}:{number}: {host.name} is a server host (role=server) on one line and a worker "
                             f"host on another (line {seen[0]}); a host is one or the other: say role=server on "
                             "every line of it or on none")
        hosts.append(host)
    if not hosts:
        raise HostsError(f"{source}: no hosts in the file; list one host per line")
    return hosts


def read_hosts(path: str | Path) -> list[Host]:
    p = Path(path).expanduser()
    try:
        text = p.read_text()
    except OSError as e:
        raise HostsError(f"hosts file {p}: {e.strerror}; pass an existing file with -H / cluster.hostfile") from None
    return parse_hosts(text, str(p))


def slots(hosts: list[Host]) -> dict[str, int] | None:
    """Each host's slots (lines add up; a line without slots= is one), in hosts-file order; None
    when no line says slots=, so that placement stays the round robin of the lines."""
    if all(h.slots is None for h in hosts):
        return None
    total: dict[str, int] = {}
    for h in hosts:
        total[h.name] = total.get(h.name, 0) + (h.slots or 1)
    return total
