"""The record a launched job leaves in its run directory, enough to trace a result and run the
job again from that directory alone.

    launch/plan.json      which role ran where, with which command and environment
    launch/hosts          the hosts file as it was
    launch/tree.json      a hash of the synced working tree, file by file (when synced)
    launch/versions.json  tfkv, TensorFlow and Python versions on each host
    launch/rerun.sh       the command line, run from the recorded working directory
    launch/job.log        the merged output of every role (of every attempt)
    launch/restarts.json  each restart (cluster.max_restarts, a Slurm requeue): when, which attempt, and why
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path
from typing import IO, Any, Sequence

from tfkv import gpus
from tfkv.launcher.plan import CONFIG

# Never part of the synced tree: run outputs, VCS data, caches.
EXCLUDE = ("outputs", "multirun", ".git", "__pycache__", ".pytest_cache", "launch")

def local_versions() -> dict[str, Any]:
    """Versions on this host, how many GPUs a role started here would see (tfkv.gpus; None:
    unknown) and which CPUs it may run on (for cluster.server_cpus / worker_cpus);
    `python -m tfkv.launcher.record` prints them as JSON for a remote pre-flight check."""
    from importlib.metadata import PackageNotFoundError, version

    import tfkv

    tf = "missing"
    for name in ("tensorflow", "tensorflow-cpu"):
        try:
            tf = version(name)
            break
        except PackageNotFoundError:
            continue
    return {"python": platform.python_version(), "tfkv": tfkv.__version__, "tensorflow": tf, "gpus": gpus.count(),
            "cpus": sorted(os.sched_getaffinity(0))}


def ssh_address(environ: dict[str, str] | None = None) -> str | None:
    """This host's own address as the launcher reached it over ssh: the server half of
    SSH_CONNECTION ("client-ip client-port server-ip server-port", set by sshd). A host the
    hosts file names by an ssh alias (`Host node1` / `HostName 10.0.0.2`) is known by that name
    only to the launcher's ssh; this is what its roles can bind and reach. None outside ssh, and
    for IPv6 (tfkv's sockets are IPv4)."""
    fields = (os.environ if environ is None else environ).get("SSH_CONNECTION", "").split()
    if len(fields) != 4:
        return None
    address = fields[2].removeprefix("::ffff:")  # an IPv4 client of a dual-stack sshd
    return None if ":" in address else address


def tree_hash(root: Path) -> dict[str, Any]:
    """sha256 of every file under `root` (EXCLUDE aside) and one digest over them all."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDE)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_symlink() or not path.is_file():
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            files[str(path.relative_to(root))] = h.hexdigest()
    total = hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(files.items())).encode()).hexdigest()
    return {"sha256": total, "files": files}


# A failure line's role (`worker 1 @node2 exited with status 2`) and tfkv's own one-line error,
# as a role prints it to the job log (`[worker 1] tfkv-run: <what is wrong>`, tfkv.errors.report).
_ROLE = re.compile(r"(?P<role>.+?)(?: @\S+)? exited with status 2\b")
_SAID = re.compile(r"\[(?P<role>[^\]]+)\] tfkv(?:-run)?: (?P<text>.+)")  # not tfkv-role's own exit line
_TAIL = 1 << 20  # the end of a long job's log is where a role's last line is


def said(log: Path, failure: str) -> str | None:
    """The one line of tfkv's own error (exit status 2: the config, the data, a diverged loss)
    that the role a failure names printed last to the job log, so that the job's final line says
    why and not only that it exited; None for any other failure or a log that cannot be read."""
    m = _ROLE.match(failure)
    if m is None:
        return None
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        s = _SAID.fullmatch(line.strip())
        if s and s["role"] == m["role"]:
            return s["text"]
    return None


class Tee:
    """A text stream that writes to the console and to the job log.

    The log is a copy: when it cannot be written (a full disk) the console still gets everything,
    with one line saying the log stopped, and the job's own outcome is what the launcher reports.
    """

    def __init__(self, console: IO[str], path: Path):
        self.console = console
        self.path = path
        self.file: IO[str] | None = open(path, "a", buffering=1)

    def _to_file(self, action: Any) -> None:
        if self.file is None:
            return
        try:
            action(self.file)
        except OSError as e:
            file, self.file = self.file, None
            try:
                file.close()
            except OSError:
                pass  # its buffer cannot be written either
            self.console.write(f"tfkv: cannot write {self.path} ({e.strerror or e}); the rest of the "
                               "job's output goes to this console only\n")

    def write(self, text: str) -> int:
        self.console.write(text)
        self._to_file(lambda f: f.write(text))
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self._to_file(lambda f: f.flush())

    def close(self) -> None:
        self._to_file(lambda f: f.close())
        self.file = None


def write(run_dir: Path, launcher: str, job: Any, argv: Sequence[str], versions: dict[str, Any],
          hostfile: str | None) -> Path:
    """Write the record (all but the log) under run_dir/launch; returns that directory."""
    d = Path(run_dir) / "launch"
    d.mkdir(parents=True, exist_ok=True)
    from tfkv.keys import SECRET_NAMES

    # The job's keys are never recorded: a rerun makes fresh ones. The workers' config (encoded,
    # unreadable here) is the run directory's config_resolved.yaml.
    shown = {**{k: "<not recorded>" for k in SECRET_NAMES}, CONFIG: "<config_resolved.yaml>"}
    plan = [{"name": p.name, "role": p.role, "rank": p.rank, "host": p.host, "argv": p.argv,
             "env": {k: shown.get(k, v) for k, v in p.env.items()}}
            for p in job.plan]
    (d / "plan.json").write_text(json.dumps({
        "launcher": launcher, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "workdir": str(job.workdir),
        "sync_dst_dir": job.sync_dst_dir, "processes": plan}, indent=1))
    if hostfile:
        (d / "hosts").write_text(Path(hostfile).expanduser().read_text())
    if job.sync_dst_dir:  # only a synced tree is hashed: a local job's directory may be anything
        (d / "tree.json").write_text(json.dumps(tree_hash(Path(job.workdir)), indent=1))
    (d / "versions.json").write_text(json.dumps(versions, indent=1))
    rerun = d / "rerun.sh"
    rerun.write_text("#!/bin/sh\n# Re-run this job as it was launched.\n"
                     f"cd {shlex.quote(str(job.workdir))} && exec {shlex.join([sys.executable if a == 'python' else a for a in argv])}\n")
    rerun.chmod(0o755)
    return d


def restart(run_dir: Path, attempt: int, cause: str, replaced: dict[str, str] | None = None) -> None:
    """Add a restart to launch/restarts.json (the job starts attempt `attempt`, counted from 1;
    `replaced`: each host left out -> the spare host in its place, cluster.spare_hosts)."""
    path = Path(run_dir) / "launch" / "restarts.json"
    try:
        done = json.loads(path.read_text())
    except (OSError, ValueError):
        done = []
    done.append({"attempt": attempt, "cause": cause, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 **({"replaced": replaced} if replaced else {})})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a single run's first (a requeue)
        path.write_text(json.dumps(done, indent=1))
    except OSError as e:  # a full disk: the restart goes on, its line is in the job's output
        print(f"tfkv: cannot write {path} ({e.strerror or e})", file=sys.stderr)


if __name__ == "__main__":
    print(json.dumps({**local_versions(), "hostname": platform.node(), "address": ssh_address()}))

