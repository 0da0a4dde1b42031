"""The working tree copied to a host with real `rsync` over `ssh` (the same ssh config, never a
prompt), and a run directory copied back: what `--sync-dst-dir` does for the ssh launcher."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from tfkv.launcher.base import Job
from tfkv.launcher.hosts import Host
from tfkv.launcher.record import EXCLUDE
from tfkv.launcher.backends.ssh_connect import run, ssh_command

if TYPE_CHECKING:
    from fabric import Connection

RSYNC_IDLE_TIMEOUT = 120  # seconds without a byte moved before rsync gives up


def rsync(src: str, dst: str, host: Host, mirror: bool = False, ssh_config: str | None = None) -> str | None:
    """Run rsync over ssh (src or dst is `HOST:path`); None, or rsync's last words on failure.
    `mirror`: make dst like src (--delete), leaving out run outputs, .git and caches (EXCLUDE)."""
    extra = ["--delete", *[f"--exclude={d}/" for d in EXCLUDE]] if mirror else []
    # --timeout: a link that goes silent ends the copy instead of hanging the launch (or its teardown)
    ssh = shlex.join(ssh_command(host, ssh_config))
    cmd = ["rsync", "-az", f"--timeout={RSYNC_IDLE_TIMEOUT}", *extra, "-e", ssh, src, dst]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "rsync is not installed on this machine; apt-get install rsync"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return None if r.returncode == 0 else (lines[-1] if lines else f"rsync exited with status {r.returncode}")


def remote_spec(host: Host, path: str) -> str:
    return f"[{host.name}]:{path}" if ":" in host.name else f"{host.name}:{path}"


def copy_back(job: Job, conns: dict[str, Connection], ssh_config: str | None = None) -> str | None:
    """Worker 0's run directory, from its host into run_dir, when the tree was synced and
    the workers wrote there (tfkv-run's workers do; a tfkv-launch command may not)."""
    if not job.run_dir or not job.remote_run_dir or job.remote_run_dir == str(job.run_dir):
        return None
    worker0 = next((p for p in job.plan if p.role == "worker" and p.rank == 0), None)
    if worker0 is None or worker0.host not in conns:
        return None
    host = next((h for h in job.hosts if h.name == worker0.host), Host(worker0.host))
    try:
        there = run(conns[worker0.host], f"test -d {shlex.quote(job.remote_run_dir)}", 30).exited == 0
    except Exception as e:  # noqa: BLE001 - one line for the result
        return f"copying the run directory back from {host} failed ({type(e).__name__}: {e})"
    if not there:
        return None
    Path(job.run_dir).mkdir(parents=True, exist_ok=True)
    problem = rsync(remote_spec(host, job.remote_run_dir.rstrip("/") + "/"), f"{job.run_dir}/", host,
                    ssh_config=ssh_config)
    return f"copying {remote_spec(host, job.remote_run_dir)} back failed ({problem})" if problem else None
