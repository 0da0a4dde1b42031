"""The working tree copied to a host with real `rsync` over `ssh` (the same ssh config, never a
prompt), and a run directory copied back: what `--sync-dst-dir` does for the ssh launcher."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from tfkv.launcher.base import Job, Program
from tfkv.launcher.hosts import Host
from tfkv.launcher.record import EXCLUDE
from tfkv.launcher.request import Command
from tfkv.launcher.backends.ssh_connect import run, ssh_command

if TYPE_CHECKING:
    from fabric import Connection

RSYNC_IDLE_TIMEOUT = 120  # seconds without a byte moved before rsync gives up
# The programs the ssh launcher runs here (its `programs`): ssh for rsync and for a user's own check.
SSH = Program("ssh", "install the OpenSSH client (apt-get install openssh-client)")
RSYNC = Program("rsync", "apt-get install rsync")


def rsync_argv(src: str, dst: str, host: Host, mirror: bool = False, ssh_config: str | None = None) -> list[str]:
    """The rsync over ssh that copies `src` to `dst` (one is `HOST:path`).
    `mirror`: make dst like src (--delete), leaving out run outputs, .git and caches (EXCLUDE)."""
    extra = ["--delete", *[f"--exclude={d}/" for d in EXCLUDE]] if mirror else []
    # --timeout: a link that goes silent ends the copy instead of hanging the launch (or its teardown)
    ssh = shlex.join(ssh_command(host, ssh_config))
    return [RSYNC.name, "-az", f"--timeout={RSYNC_IDLE_TIMEOUT}", *extra, "-e", ssh, src, dst]


def rsync(src: str, dst: str, host: Host, mirror: bool = False, ssh_config: str | None = None) -> str | None:
    """Run `rsync_argv`; None, or rsync's last words on failure."""
    return run_rsync(rsync_argv(src, dst, host, mirror, ssh_config))


def run_rsync(argv: list[str]) -> str | None:
    """Run an rsync command line; None, or rsync's last words on failure."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"rsync is not installed on this machine; {RSYNC.hint}"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return None if r.returncode == 0 else (lines[-1] if lines else f"rsync exited with status {r.returncode}")


def remote_spec(host: Host, path: str) -> str:
    return f"[{host.name}]:{path}" if ":" in host.name else f"{host.name}:{path}"


def sync_argv(job: Job, host: Host, ssh_config: str | None = None) -> list[str]:
    """The pre-flight's copy of the working tree to `host` (with --sync-dst-dir)."""
    return rsync_argv(f"{job.workdir}/", remote_spec(host, str(job.sync_dst_dir).rstrip("/") + "/"), host, True,
                      ssh_config)


def commands(job: Job, ssh_config: str | None = None) -> tuple[list[Command], list[Command]]:
    """The rsyncs of a job (for its request): the working tree to every host first, worker 0's
    run directory back at the end (`copy_back`: when the tree was synced and it is there)."""
    there = [Command(f"rsync to {h}", sync_argv(job, h, ssh_config), cwd=str(job.workdir))
             for h in dict.fromkeys(job.hosts)] if job.sync_dst_dir else []
    worker0 = next((p for p in job.plan if p.role == "worker" and p.rank == 0), None)
    if not job.run_dir or not job.remote_run_dir or job.remote_run_dir == str(job.run_dir) or worker0 is None:
        return there, []
    host = next((h for h in job.hosts if h.name == worker0.host), Host(worker0.host))
    back = rsync_argv(remote_spec(host, job.remote_run_dir.rstrip("/") + "/"), f"{job.run_dir}/", host,
                      ssh_config=ssh_config)
    return there, [Command(f"rsync back from {host}", back)]


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
