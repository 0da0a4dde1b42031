"""`cluster.*`: how a parameter-server job is started, the one definition of every cluster option.

Each setting is a dataclass field whose metadata carries its one-line help (and, for the options
`tfkv-launch` has always spelled with one letter, that letter). The `cluster=` config options
(conf/cluster/*.yaml extend these schemas), the job options (`tfkv.launcher.job.Options`) and the
`tfkv-launch` flags (`tfkv.launcher.cli`) are all derived from these fields, so a new setting
is written once, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional

from tfkv import knobs


def setting(default: Any, help: str, short: str | None = None) -> Any:  # noqa: A002 - argparse's word
    """A cluster option: its default, its one-line help, and `tfkv-launch`'s one-letter flag if any."""
    return dataclasses.field(default=default, metadata={"help": help, "short": short})


def knob(key: str) -> Any:
    """A setting that is a backend knob: default and help from its row in tfkv.knobs (its
    variable, named in the help, overrides it)."""
    k = knobs.BY_KEY[key]
    return setting(k.default, k.doc if k.env in k.doc else f"{k.doc} ({k.env})")


@dataclass
class NoCluster:
    # none: this process trains alone (or is one role of a job started by hand with DMLC_*);
    # local | ssh | mpi | slurm | sge | yarn: start the scheduler, servers and workers that way.
    launcher: str = setting("none", "how to start the processes")


@dataclass
class ClusterConfig(NoCluster):
    """What every launcher takes (cluster=local has exactly these)."""

    num_workers: int = setting(2, "number of worker processes", "-n")
    num_servers: int = setting(1, "number of server processes", "-s")
    host: str = setting("127.0.0.1", "the scheduler's address when there is no hosts file")
    port: int = setting(0, "the scheduler's port (default: a free one)")
    interface: Optional[str] = knob("cluster.interface")
    heartbeat_timeout: float = knob("cluster.heartbeat_timeout")
    heartbeat_interval: float = knob("cluster.heartbeat_interval")
    request_timeout: float = knob("cluster.request_timeout")
    start_timeout: float = knob("cluster.start_timeout")
    verbose: int = knob("cluster.verbose")
    # CURVE authentication + encryption with fresh keys per job; false: plain TCP, with a
    # warning, for a trusted single machine only
    secure: bool = setting(True, "CURVE authentication and encryption with fresh keys per job "
                                 "(--no-secure: plain TCP, for a trusted single machine only)")
    max_restarts: int = setting(0, "start a failed job again, up to this many times (tfkv-run: from its "
                                   "newest checkpoint)")
    workers_per_host: Optional[int] = setting(None, "workers on each host, filling the hosts in hosts-file order "
                                                    "(e.g. one per GPU with devices=[gpu:{local_rank}]); default: "
                                                    "round robin, or the hosts file's slots=")


@dataclass
class RemoteCluster(ClusterConfig):
    """Launchers that start roles on other hosts (mpi, slurm, sge, yarn)."""

    hostfile: Optional[str] = setting(None, "hosts file, one host per line: host, host:port or user@host "
                                            "(required by ssh; mpi without one runs on this machine)", "-H")
    python: str = setting("python3", "the Python interpreter on the hosts")
    spare_hosts: Optional[List[str]] = setting(None, "hosts that take the place of a host whose roles failed "
                                                     "twice, on a restart (cluster.max_restarts; ssh and mpi)")


@dataclass
class SSHCluster(RemoteCluster):
    sync_dst_dir: Optional[str] = setting(None, "rsync the current directory to this path on every host first")
    ssh_config: Optional[str] = knob("cluster.ssh_config")


@dataclass
class MPICluster(RemoteCluster):
    mpirun_args: str = knob("cluster.mpirun_args")


@dataclass
class SlurmCluster(RemoteCluster):
    srun_args: str = knob("cluster.srun_args")
    sbatch_args: str = knob("cluster.sbatch_args")


@dataclass
class SGECluster(RemoteCluster):
    qsub_args: str = knob("cluster.qsub_args")


@dataclass
class YarnCluster(RemoteCluster):
    yarn_memory_mb: int = knob("cluster.yarn_memory_mb")
    yarn_server_memory_mb: int = knob("cluster.yarn_server_memory_mb")
    yarn_vcores: int = knob("cluster.yarn_vcores")
    yarn_queue: Optional[str] = knob("cluster.yarn_queue")


# cluster.launcher -> the settings that launcher has (a launcher from a plug-in: ClusterConfig's,
# or the schema its class declares as `config`)
CLUSTER_SCHEMAS: dict[str, type] = {"none": NoCluster, "local": ClusterConfig, "ssh": SSHCluster,
                                    "mpi": MPICluster, "slurm": SlurmCluster, "sge": SGECluster,
                                    "yarn": YarnCluster}


def options(*schemas: type, first: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """Every setting of `schemas`, once each (the first schema's field wins), the names in
    `first` leading in that order (positional arguments), the rest in declaration order."""
    seen: dict[str, dataclasses.Field] = {}
    for schema in schemas:
        for f in dataclasses.fields(schema):
            seen.setdefault(f.name, f)
    return [seen[n] for n in first if n in seen] + [f for n, f in seen.items() if n not in first]
