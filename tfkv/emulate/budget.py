"""A host's CPU budget: a cgroup v1 cpu group with a CFS quota of `cpus` periods per period.

Every process of the host (its sshd, what ssh starts, what Host.popen starts) joins the group
before it execs, and its children stay in it, so together they get at most `cpus` cores.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tfkv.emulate.spec import CGROUP_CPU


def path(prefix: str, host: str, root: Path = CGROUP_CPU) -> Path:
    return root / f"{prefix}-{host}"


def make(group: Path, cpus: float) -> None:
    group.mkdir()
    period = int((group / "cpu.cfs_period_us").read_text())
    (group / "cpu.cfs_quota_us").write_text(str(max(int(cpus * period), 1000)))


def pids(group: Path) -> list[int]:
    try:
        return [int(p) for p in (group / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def kill(pid_lists, seconds: float = 10) -> None:
    """SIGKILL what the callable `pid_lists` names until it names nothing (a process may fork
    between a listing and its kill), for up to `seconds`."""
    deadline = time.monotonic() + seconds
    while (left := pid_lists()) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def remove(group: Path, seconds: float = 10) -> list[str]:
    """rmdir the group once its killed processes have left it; what was there to remove."""
    deadline = time.monotonic() + seconds
    while group.is_dir():
        try:
            group.rmdir()
            return [f"cgroup {group}"]
        except OSError:  # EBUSY while a killed process is still exiting
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    return []
