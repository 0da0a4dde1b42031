"""`cluster.spare_hosts`: which host a restarted job leaves out, and which spare takes its place.

With `cluster.max_restarts`, a failed job is started again on the same hosts. A host whose roles
failed in FAILURES attempts (counted over the whole job; a failure line names the blamed roles
with their host, "worker 1 @node2 exited with status 5") is left out of the next attempt when a
spare host is left: the next spare, in the order given, takes its place in the hosts file (every
line of it, so its roles and slots move together). A spare that fails as often is replaced in
turn. Only a launcher that places roles on hosts (its `places_roles` trait: ssh, mpi) takes
spares; they are checked before anything starts: each a hosts-file host (`host`, `host:port`,
`user@host[:port]`), none twice, none a host the hosts file already names.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from tfkv.errors import ConfigError
from tfkv.launcher import placement
from tfkv.launcher.hosts import Host, parse_hosts, read_hosts

FAILURES = 2  # attempts in which a host's roles failed before it is left out


def check(launcher: str, hostfile: str | None, spare_hosts: Sequence[str] | None) -> list[Host]:
    """The spare hosts, or a ConfigError in one line saying what is wrong with them."""
    if not spare_hosts:
        return []
    placement.needs_placing(launcher, "cluster.spare_hosts", "spare hosts are for --launcher {placing} with a hosts file")
    if not hostfile:
        raise ConfigError("cluster.spare_hosts needs a hosts file (-H hosts / cluster.hostfile=hosts): a spare "
                          "takes the place of one of its hosts")
    spares = parse_hosts("\n".join(str(s) for s in spare_hosts), "cluster.spare_hosts")
    used = {h.name for h in read_hosts(hostfile)}
    seen: set[str] = set()
    for spare in spares:
        if spare.name in used:
            raise ConfigError(f"cluster.spare_hosts: {spare.name} is already a host of {hostfile}; a spare host "
                              "must be one the job does not use")
        if spare.name in seen:
            raise ConfigError(f"cluster.spare_hosts: {spare.name} is listed twice; name each spare host once")
        seen.add(spare.name)
    return spares


@dataclass
class Spares:
    """The hosts of a job's attempts: failures counted per host, hosts left out, spares left."""

    left: list[Host]  # the spares not yet used, in order
    failures: Counter = field(default_factory=Counter)
    instead: dict[str, Host] = field(default_factory=dict)  # a hosts-file name -> the host in its place

    def current(self, name: str) -> str:
        """The host that runs what the hosts file puts on `name` now."""
        return self.instead[name].name if name in self.instead else name

    def failed(self, failure: str, hosts: Sequence[str]) -> list[str]:
        """Count an attempt that failed with `failure` (its line) on `hosts` (the hosts-file names):
        each host a blamed role ran on (`@host` in the line) once; the hosts counted."""
        running = {self.current(h) for h in hosts}
        blamed = sorted({m for m in re.findall(r"@([\w.\-\[\]:]+?)(?=[\s,;)]|$)", failure) if m in running})
        self.failures.update(blamed)
        return blamed

    def replace(self, hosts: Sequence[str]) -> list[tuple[str, str]]:
        """Leave out each host that failed FAILURES times, while spares are left: the (host, spare)
        pairs of this restart, in hosts-file order."""
        done: list[tuple[str, str]] = []
        for name in dict.fromkeys(hosts):
            now = self.current(name)
            if self.failures[now] >= FAILURES and self.left:
                spare = self.left.pop(0)
                self.instead[name] = spare
                done.append((now, spare.name))
        return done

    def hosts_file(self, original: str | Path, dst: Path) -> Path:
        """`original` with each line's host swapped for the one in its place (the rest of the
        line, slots= or a comment, kept), written to `dst`."""
        lines = []
        for raw in Path(original).expanduser().read_text().splitlines():
            body = raw.split("#", 1)[0].strip()
            if body:
                (host,) = parse_hosts(body.split()[0], str(original))
                if host.name in self.instead:
                    raw = raw.replace(body.split()[0], str(self.instead[host.name]), 1)
            lines.append(raw)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text("\n".join(lines) + "\n")
        return dst
