"""How many CPUs this process may use: its affinity, lowered by a cgroup CPU quota where one is set.

`os.cpu_count()` says what the machine has; a server may be pinned to fewer (`taskset`, a batch
scheduler's cpuset: `os.sched_getaffinity`) or given a share of them (a container's or the
emulated cluster's CFS quota: cgroup v1's cpu.cfs_quota_us / cpu.cfs_period_us, cgroup v2's
cpu.max). The quota of the process's own group and of every group above it counts: the smallest
wins, rounded up (a host of 1.5 cores runs two threads, each throttled to its share). A server
sizes its pool of summing and updating threads by it (tfkv.ps.reduction). No TensorFlow here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def usable(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may keep busy: at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = quota_cpus(proc_cgroup, root)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def quota_cpus(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup (the smallest along its path to the root), in CPUs;
    None where no quota is set or no cgroup file can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2's unified hierarchy
            quotas += _along(root / "unified" if (root / "unified" / "cgroup.controllers").exists() else root,
                             path, _v2)
        elif "cpu" in controllers.split(","):
            quotas += _along(root / controllers if (root / controllers).is_dir() else root / "cpu", path, _v1)
    return min(quotas) if quotas else None


def _along(mount: Path, path: str, read) -> list[float]:
    """The quotas `read` finds in the group at `path` under `mount` and in each group above it
    (inside a cgroup namespace `path` may name nothing here: the mount's own group counts then)."""
    group = mount / path.lstrip("/")
    found = []
    while True:
        quota = read(group)
        if quota is not None:
            found.append(quota)
        if group == mount or mount not in group.parents:
            return found
        group = group.parent


def _v1(group: Path) -> float | None:
    try:
        quota = int((group / "cpu.cfs_quota_us").read_text())
        period = int((group / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v2(group: Path) -> float | None:
    try:
        quota, period = (group / "cpu.max").read_text().split()
        return int(quota) / int(period) if quota != "max" and int(period) > 0 else None
    except (OSError, ValueError):
        return None
