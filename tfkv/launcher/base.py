"""What every launcher backend receives and returns, and the registry of backends.

A backend only decides how each planned process starts on its host (a local process, an ssh
channel, an MPI rank, a Slurm task, an SGE task, a YARN container), keeps the job's output in
one stream with `[role @host]` prefixes, and tears every process down when one fails or the
user presses Ctrl-C. Roles find each other through the scheduler, not through the launcher.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

from tfkv.launcher.hosts import Host
from tfkv.launcher.plan import Process
from tfkv.registry import Registry


@dataclass
class Job:
    plan: list[Process]  # every role, with its host, command line and environment
    hosts: list[Host] = field(default_factory=list)  # empty: this machine only
    workdir: Path = field(default_factory=Path.cwd)  # the directory synced to every host
    sync_dst_dir: str | None = None  # where `workdir` goes on every host (ssh)
    run_dir: Path | None = None  # where the job's record is written
    # The run directory as the workers on the hosts see it (under sync_dst_dir when the tree is
    # synced); a backend whose workers write elsewhere copies it back into run_dir at the end.
    remote_run_dir: str | None = None
    python: str = "python3"  # the interpreter on the hosts
    # Host name (as the hosts file has it) -> the address the host reported for itself in the
    # pre-flight (ssh: the address its sshd was reached at). The scheduler binds it, every role
    # connects to it: an ssh alias means nothing to bind() or to the other hosts' resolvers.
    addresses: dict[str, str] = field(default_factory=dict)
    # The workers' devices when the launcher knows them (tfkv-run's config): the pre-flight checks
    # that a {local_rank} device exists on its host (tfkv.launcher.job.check_gpus).
    devices: list[str] | None = None


@dataclass
class Result:
    returncode: int
    failure: str | None  # what failed first, e.g. "worker 1 @node2 exited with status 1"
    requeued: bool = False  # preempted, the batch job requeued itself: it goes on without the launcher
    restarts: str | None = None  # with cluster.max_restarts: spent, or why none was tried

    def told(self) -> str:
        """The failure as the final line tells it: with how cluster.max_restarts went."""
        return f"{self.failure}; {self.restarts}" if self.restarts else str(self.failure)


class Launcher(Protocol):
    name: str

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        """Check what the backend needs (binaries, hosts) before anything starts, raising a
        ConfigError with one line per problem; return the tfkv/TF/Python versions per host and
        fill `job.addresses` with what the hosts say their addresses are."""

    def launch(self, job: Job, out: IO[str]) -> Result:
        """Start every process of `job.plan`, stream its output to `out`, wait for the end."""


REGISTRY = Registry("launcher", {
    "local": "tfkv.launcher.local:LocalLauncher",
    "ssh": "tfkv.launcher.ssh:SSHLauncher",
    "mpi": "tfkv.launcher.mpi:MPILauncher",
    "slurm": "tfkv.launcher.slurm:SlurmLauncher",
    "sge": "tfkv.launcher.sge:SGELauncher",
    "yarn": "tfkv.launcher.yarn:YarnLauncher",
}, plugins="tfkv.launchers")  # and installed packages' launchers (tfkv.plugins)
REGISTRY.reserve("none")  # cluster.launcher=none: no launcher


def create(name: str) -> Launcher:
    return REGISTRY.get(name)()
