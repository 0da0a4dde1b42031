"""`cluster.*`: how a parameter-server job is started: the settings every launcher has, and how a
setting is declared.

Each setting is a dataclass field whose metadata carries its one-line help (and, for the options
`tfkv-launch` has always spelled with one letter, that letter). These are the schemas every
launcher's settings derive from: cluster=none's (`NoCluster`), cluster=local's (`ClusterConfig`) and
those of launchers that reach other hosts (`RemoteCluster`). A backend's own settings are defined
in its module beside it (tfkv.launcher.backends.ssh's `SSHCluster`, ...), as a plug-in's are, and
reach Hydra's ConfigStore through the launcher registry (tfkv.plugins.register_schemas). The
`cluster=` config options (conf/cluster/*.yaml extend `schema/cluster/<name>`), the job options
(`tfkv.launcher.job.Options`) and the `tfkv-launch` flags (`tfkv.launcher.cli`) are all derived
from these fields, so a new setting is written once, in its schema.
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
    server_cpus: Optional[str] = setting(None, "CPUs (taskset's list, e.g. 0-3) the scheduler and servers are pinned "
                                               "to on their host, apart from cluster.worker_cpus: a GPU host's idle "
                                               "cores; default: not pinned")
    worker_cpus: Optional[str] = setting(None, "CPUs (taskset's list, e.g. 4-15) the workers are pinned to on their "
                                               "host, disjoint from cluster.server_cpus; default: not pinned")
    dry_run: bool = setting(False, "print every command and script the job would run, and start nothing "
                                   "(no pre-flight, no keys written)")


@dataclass
class RemoteCluster(ClusterConfig):
    """Launchers that start roles on other hosts (ssh, mpi, slurm, sge, yarn)."""

    hostfile: Optional[str] = setting(None, "hosts file, one host per line: host, host:port or user@host, then "
                                            "optionally slots=N, role=server (required by ssh; mpi without one runs "
                                            "on this machine)", "-H")
    server_hosts: Optional[List[str]] = setting(None, "hosts of the hosts file that run the servers and the scheduler "
                                                      "and no worker (as role=server there; ssh and mpi); the "
                                                      "workers run on the others")
    python: str = setting("python3", "the Python interpreter on the hosts")
    spare_hosts: Optional[List[str]] = setting(None, "hosts that take the place of a host whose roles failed "
                                                     "twice, on a restart (cluster.max_restarts; ssh and mpi)")


def options(*schemas: type, first: tuple[str, ...] = ()) -> list[dataclasses.Field]:
    """Every setting of `schemas`, once each (the first schema's field wins), the names in
    `first` leading in that order (positional arguments), the rest in declaration order."""
    seen: dict[str, dataclasses.Field] = {}
    for schema in schemas:
        for f in dataclasses.fields(schema):
            seen.setdefault(f.name, f)
    return [seen[n] for n in first if n in seen] + [f for n, f in seen.items() if n not in first]
