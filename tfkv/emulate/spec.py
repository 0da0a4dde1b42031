"""What an emulated host is (HostSpec) and whether this machine can hold a cluster of them.

`check(specs)` raises Refused with one line (what is wrong, where, how to fix it) before anything
is made: not root, no cgroup v1 cpu controller, more CPU than the machine has, a cpus of 0 or
less, a rate tc does not read, a bad or repeated host name, too many hosts, a missing program.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself, so it must be started by absolute path
MAX_HOSTS = 64  # host i is 10.x.y.(i+1) on a /24, and its veth name must stay under 16 characters
MIN_CPUS = 0.01  # the kernel's smallest CFS quota is 1 ms per 100 ms period

# tc's rate units (tc(8) "RATES"): bits or bytes per second, decimal prefixes.
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_UNIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_HOSTNAME = re.compile(r"^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$")


class Refused(Exception):
    """A cluster this machine cannot hold; its message is one line, and nothing was made."""


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate ("1gbit", "100mbit", "12.5mbps")."""
    m = _RATE.match(rate.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(rate)
    return float(m.group(1)) * _UNIT[m.group(2)]


@dataclass(frozen=True)
class HostSpec:
    """One host: its name (also its hostname), CPU budget in cores (None: unlimited) and link rate.

    `link` sets both directions; `link_in` (traffic into the host) and `link_out` (out of it)
    override it per direction; None is unlimited. Rates are tc's: "100mbit", "1gbit", "10gbit".
    """

    name: str
    cpus: float | None = None
    link: str | None = None
    link_in: str | None = None
    link_out: str | None = None

    @property
    def rate_in(self) -> str | None:
        return self.link_in or self.link

    @property
    def rate_out(self) -> str | None:
        return self.link_out or self.link


def check(specs: list[HostSpec], euid: int | None = None, cpu_count: int | None = None,
          cgroup_root: Path = CGROUP_CPU) -> None:
    """Raise Refused (one line) unless this machine can make these hosts."""
    euid = os.geteuid() if euid is None else euid
    cpu_count = cpu_count or os.cpu_count() or 1
    if euid != 0:
        raise Refused("an emulated cluster needs root (network namespaces, tc, cgroups): run it as root")
    if not specs:
        raise Refused("no hosts asked for: give at least one (--hosts N)")
    if len(specs) > MAX_HOSTS:
        raise Refused(f"{len(specs)} hosts asked for, at most {MAX_HOSTS}: ask for fewer")
    seen: set[str] = set()
    for spec in specs:
        if not _HOSTNAME.match(spec.name):
            raise Refused(f"host name {spec.name!r} is not a hostname: use lower-case letters, digits and '-', "
                          "starting with a letter, at most 32 characters")
        if spec.name in seen:
            raise Refused(f"host name {spec.name!r} is given twice: every host needs a name of its own")
        seen.add(spec.name)
        if spec.cpus is not None and not spec.cpus >= MIN_CPUS:
            raise Refused(f"host {spec.name}: cpus={spec.cpus} is not a CPU budget: give cores as a fraction "
                          f"of at least {MIN_CPUS} (0.4 is 40% of one core), or leave it unlimited")
        for direction, rate in (("link_in", spec.rate_in), ("link_out", spec.rate_out)):
            if rate is None:
                continue
            try:
                rate_bits(rate)
            except ValueError:
                raise Refused(f"host {spec.name}: {direction}={rate!r} is not a rate tc reads: write a positive "
                              "number and a unit, e.g. 100mbit, 1gbit, 10gbit (or 12.5mbps, bytes)") from None
    budgets = [s.cpus for s in specs if s.cpus is not None]
    if sum(budgets) > cpu_count + 1e-9:
        raise Refused(f"the hosts' cpus add up to {sum(budgets):g} cores and this machine has {cpu_count}: "
                      "give them less (--cpus), or fewer hosts")
    if budgets and not (cgroup_root / "cpu.cfs_quota_us").is_file():
        raise Refused(f"no cgroup v1 cpu controller at {cgroup_root} (cpu.cfs_quota_us), so a CPU budget cannot "
                      "be kept: mount it (mount -t cgroup -o cpu,cpuacct none /sys/fs/cgroup/cpu) or leave cpus unset")
    programs = ["ip", "nsenter", "unshare", "ssh-keygen", SSHD]
    if any(s.rate_in or s.rate_out for s in specs):
        programs.append("tc")
    missing = [p for p in programs if not (shutil.which(p) or Path(p).is_file())]
    if missing:
        raise Refused(f"{', '.join(missing)} missing, needed for an emulated cluster: "
                      "apt-get install iproute2 util-linux openssh-server openssh-client")
