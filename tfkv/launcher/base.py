"""What every launcher backend is, receives and returns, and the registry of backends.

A backend only decides how each planned process starts on its host (a local process, an ssh
channel, an MPI rank, a Slurm task, an SGE task, a YARN container), keeps the job's output in
one stream with `[role @host]` prefixes, and tears every process down when one fails or the
user presses Ctrl-C. Roles find each other through the scheduler, not through the launcher.

What a backend is, the shared core (tfkv.launcher.job, spares, the sweeps' launcher) asks of its
class, never of its name: each declares its traits (`Traits`: places roles on the hosts file's
hosts, lets a resource manager choose the nodes, knows each worker's local rank, gets the job's
keys by environment, runs on this machine, requeues itself), as store types declare their
capabilities; the programs it runs on this machine, each with how to install it (`programs`: the
refusal when one is missing, and the docs' command checker, read it); and its settings schema
(`config`, a dataclass derived from tfkv.config.cluster.ClusterConfig and defined in the backend's
own module, as a Hydra launcher plug-in declares its config). tfkv's backends and installed
packages' are found the same way, through `REGISTRY`, and so are their settings (`schemas`: Hydra's
`schema/cluster/<name>` nodes, the job's options, tfkv-launch's flags). A backend is constructed
with its settings, validated once.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, Mapping

from tfkv.config.cluster import ClusterConfig, NoCluster
from tfkv.errors import ConfigError
from tfkv.launcher.hosts import Host
from tfkv.launcher.plan import Process
from tfkv.launcher.request import Request
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


@dataclass(frozen=True)
class Traits:
    """What a backend is, as its class declares it (`Traits.of`); read by the shared core."""

    places_roles: bool = False  # runs each role on the hosts-file host the plan gives it (spares, sweeps' packing)
    chooses_nodes: bool = False  # a resource manager picks the nodes: no slots, no workers_per_host
    local_ranks: bool = True  # the plan's hosts are where workers run: the plan gives each its local rank
    needs_hostfile: bool = False  # nothing to run on without a hosts file
    secrets_by_env: bool = False  # the job's keys go in the roles' environment (else a key file only the user reads)
    runs_here: bool = False  # every role on this machine: this interpreter, the scheduler on cluster.host

    @classmethod
    def of(cls, backend: type) -> "Traits":
        return cls(**{f.name: bool(getattr(backend, f.name, f.default)) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Program:
    """A program a backend runs on this machine, and how its user gets it."""

    name: str
    hint: str  # e.g. "install Open MPI (apt-get install openmpi-bin) or load your MPI module"

    def need(self) -> str:
        """Its name, as a user types it; a ConfigError line when it is not on PATH."""
        if not shutil.which(self.name):
            raise ConfigError(f"{self.name} is not on PATH; {self.hint}")
        return self.name


class Backend:
    """What every launcher is: its name, its traits (class attributes, see Traits), the programs
    it runs here (`programs`), its settings schema, and the steps of a job: `preflight`, `request`
    (what it would run, by a pure function) and `launch` (run it). Constructed with its settings,
    an instance of `config` (tfkv.launcher.job.backend builds it from the job's options and knob values)."""

    name: ClassVar[str]
    config: ClassVar[type] = ClusterConfig
    places_roles: ClassVar[bool] = False
    chooses_nodes: ClassVar[bool] = False
    local_ranks: ClassVar[bool] = True
    needs_hostfile: ClassVar[bool] = False
    secrets_by_env: ClassVar[bool] = False
    runs_here: ClassVar[bool] = False
    # What it runs on this machine (the first: the one that starts the job), each with its install hint.
    programs: ClassVar[tuple[Program, ...]] = ()

    def __init__(self, settings: Any = None) -> None:
        self.settings = settings if settings is not None else self.config()

    @classmethod
    def requeues_itself(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether a job this backend starts may run again without it after a preemption (the
        slurm backend's batch job requeues itself)."""
        return False

    @classmethod
    def need(cls, *names: str) -> str:
        """Refuse, one line each, the programs of `programs` named (all when none is) that are not
        on PATH; the first name."""
        found = [p.need() for p in cls.programs if not names or p.name in names]
        return found[0] if found else ""

    def preflight(self, job: Job) -> dict[str, dict[str, Any]]:
        """Check what the backend needs (binaries, hosts) before anything starts, raising a
        ConfigError with one line per problem; return the tfkv/TF/Python versions per host and
        fill `job.addresses` with what the hosts say their addresses are."""
        raise NotImplementedError

    def request(self, job: Job, files: Path, name: str = "tfkv", environ: Mapping[str, str] | None = None) -> Request:
        """What `launch` runs for `job`, by a pure function (no process started, no file written):
        its commands and the scripts it would write into `files` (the job's directory for them);
        `name`: the job's unique name (tfkv.launcher.backends.batch.job_name); `environ`: the
        launching shell's environment (None: this process's)."""
        raise NotImplementedError(f"the {self.name} launcher cannot say what it would run (no `request`)")

    def launch(self, job: Job, out: IO[str]) -> Result:
        """Start every process of `job.plan` (its `request`), stream its output to `out`, wait for the end."""
        raise NotImplementedError


REGISTRY = Registry("launcher", {
    "local": "tfkv.launcher.backends.local:LocalLauncher",
    "ssh": "tfkv.launcher.backends.ssh:SSHLauncher",
    "mpi": "tfkv.launcher.backends.mpi:MPILauncher",
    "slurm": "tfkv.launcher.backends.slurm:SlurmLauncher",
    "sge": "tfkv.launcher.backends.sge:SGELauncher",
    "yarn": "tfkv.launcher.backends.yarn:YarnLauncher",
}, plugins="tfkv.launchers")  # and installed packages' launchers (tfkv.plugins)
REGISTRY.reserve("none")  # cluster.launcher=none: no launcher


def schemas(plugins: bool = False) -> dict[str, type]:
    """Each launcher's settings, by `cluster.launcher` (none: NoCluster): tfkv's in REGISTRY's order
    and, with `plugins`, what installed launchers declare (one whose class fails to import is
    left out here and refused when chosen)."""
    found: dict[str, type] = {"none": NoCluster}
    for name in REGISTRY.own():
        found[name] = settings(name)
    for name in REGISTRY.plugins() if plugins else ():
        try:
            found[name] = settings(name)
        except (ConfigError, AttributeError):
            continue
    return found


def settings(name: str) -> type:
    """The settings schema launcher `name` declares (`config`; a plug-in without one: every
    launcher's, ClusterConfig)."""
    return getattr(backend_class(name), "config", None) or ClusterConfig


def backend_class(name: str) -> type[Backend]:
    """The class of launcher `name` (imported: backends are light, no TensorFlow)."""
    if name not in REGISTRY:
        raise ConfigError(f"launcher {name!r} is not known; choose one of {', '.join(REGISTRY.names())}")
    return REGISTRY.get(name)


def traits(name: str) -> Traits:
    """What launcher `name` declares it is."""
    return Traits.of(backend_class(name))


def create(name: str, settings: Any = None) -> Backend:
    """Launcher `name` with its settings (an instance of its `config`; None: the schema's defaults)."""
    return backend_class(name)(settings)
