"""One emulated host, and how a process is started on it.

A process on a host runs in the host's network namespace, in a UTS namespace whose hostname is
the host's name, in a mount namespace where /etc/hosts names every host of the cluster, and in
the host's CPU cgroup. It shares this machine's filesystem, Python and PID numbers, so /proc here
shows it and tfkv imports there.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tfkv.emulate import budget, net

# Joins the cgroup (if any) before exec, so the command and all it starts count against it;
# then names the host and shows it the cluster's /etc/hosts. $1: cgroup.procs or "", $2: name,
# $3: the hosts file; the command follows.
_ENTER = ('[ -z "$1" ] || echo $$ > "$1" || exit 125; hostname "$2" && mount --bind "$3" /etc/hosts || exit 125; '
          'shift 3; exec "$@"')


@functools.cache
def _which(program: str) -> str:
    return shutil.which(program) or program


@dataclass
class Host:
    """A host of an emulated cluster (see HostSpec for cpus and the link)."""

    name: str
    address: str  # "10.201.N.x"
    cpus: float | None
    link_in: str | None
    link_out: str | None
    namespace: str  # its network namespace: /run/netns/<namespace>
    cgroup: Path | None  # its cpu cgroup, None when its CPU is unlimited
    etc_hosts: Path = field(repr=False)

    def command(self, argv: list[str]) -> list[str]:
        """argv, as a command run here that runs it on this host."""
        procs = str(self.cgroup / "cgroup.procs") if self.cgroup else ""
        # nsenter, not `ip netns exec`, which mounts a /sys of its own and hides /sys/fs/cgroup.
        # By absolute path: a caller's env= may have no PATH.
        return [_which("nsenter"), f"--net=/run/netns/{self.namespace}", _which("unshare"), "--uts", "--mount", "--",
                "/bin/sh", "-c", _ENTER, f"on-{self.name}", procs, self.name, str(self.etc_hosts), *argv]

    def popen(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start argv on this host (its pid is the process's own once the wrappers exec it)."""
        return subprocess.Popen(self.command(argv), env=env, cwd=cwd, **popen_kwargs)

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None,
            **run_kwargs) -> subprocess.CompletedProcess:
        """Run argv on this host to its end."""
        return subprocess.run(self.command(argv), env=env, cwd=cwd, **run_kwargs)

    def pids(self) -> list[int]:
        """Every process on this host: those in its network namespace and in its cgroup."""
        found = set(net.namespace_pids(self.namespace))
        if self.cgroup:
            found |= set(budget.pids(self.cgroup))
        return sorted(found)
