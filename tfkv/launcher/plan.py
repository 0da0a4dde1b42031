"""Which role runs where, and with which environment: the plan every launcher backend executes.

Placement follows MXNet's launch.py: the scheduler on the first host; servers, then workers,
cycling through the hosts (5 hosts, 3 servers, 3 workers: servers on hosts 1-3, workers on
hosts 4, 5, 1). With worker slots (`slots=N` in the hosts file, or cluster.workers_per_host),
workers fill the hosts' slots in hosts-file order instead (8 workers, `a slots=4` and `b slots=4`:
workers 0-3 on a, 4-7 on b), as mpirun's by-slot mapping does; servers still cycle from the
first host and take no slot. With server hosts (`role=server` in the hosts file,
cluster.server_hosts: tfkv.launcher.placement), the scheduler runs on the first server host, the
servers cycle over the server hosts and the workers over the others (or fill their slots).

Every worker learns its index among the workers on its host (TFKV_LOCAL_RANK) and their number
(TFKV_LOCAL_SIZE), for `devices=[gpu:{local_rank}]`; the scheduler and the servers get
CUDA_VISIBLE_DEVICES=-1, so that they never hold GPU memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from tfkv.config.device_specs import LOCAL_RANK, LOCAL_SIZE
from tfkv.errors import ConfigError
from tfkv.preempt import RUN_DIR  # the job's run directory as the roles see it (defined there: the flag is in it)

# The config a tfkv-run job's workers run (tfkv.worker): the launcher's, as it recorded it.
CONFIG = "TFKV_CONFIG"

# Variables of the launching shell that every role gets too, on every backend and host (local,
# ssh, mpi, yarn; Slurm and SGE pass the whole environment): the MXNet/tfkv knobs a user exports
# (PS_RESEND, MXNET_KVSTORE_*, TFKV_HEARTBEAT_TIMEOUT, ...) and what dmlc's ssh tracker passes on.
FORWARD_PREFIXES = ("TFKV_", "DMLC_", "PS_", "MXNET_")
FORWARD_NAMES = ("OMP_NUM_THREADS", "KMP_AFFINITY", "LD_LIBRARY_PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL")
# ...but never what the plan decides for each role (its role, the scheduler, the job's size, keys,
# run directory and config; the TFKV_ twins of DMLC_ names would override the plan's), nor the
# launcher's own ssh config: a launcher started from inside another job must not pass that job's
# on; nor what belongs to one node (TFKV_ADVERTISE_ADDRESS, one server's host:port: every server
# would register the same one).
NOT_FORWARDED = frozenset({
    "DMLC_ROLE", "TFKV_ROLE", "TFKV_RANK_HINT", "DMLC_PS_ROOT_URI", "TFKV_SCHEDULER_HOST", "DMLC_PS_ROOT_PORT",
    "TFKV_SCHEDULER_PORT", "DMLC_NUM_SERVER", "TFKV_NUM_SERVER", "DMLC_NUM_WORKER", "TFKV_NUM_WORKER",
    "TFKV_CURVE_PUBLIC", "TFKV_CURVE_SECRET", "TFKV_CURVE_KEYFILE", "TFKV_SECRETS_ON_STDIN",
    "TFKV_SSH_CONFIG", "TFKV_ADVERTISE_ADDRESS", RUN_DIR, CONFIG, LOCAL_RANK, LOCAL_SIZE})
# What the scheduler and servers get: no GPU (CUDA and TensorFlow stop at the first bad index).
NO_GPU = {"CUDA_VISIBLE_DEVICES": "-1"}


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The launching shell's variables that reach every role, wherever it runs."""
    return {k: v for k, v in environ.items()
            if (k.startswith(FORWARD_PREFIXES) or k in FORWARD_NAMES) and k not in NOT_FORWARDED}


@dataclass
class Process:
    name: str  # "worker 1": also the prefix of its output lines
    role: str
    rank: int
    host: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def pinned(argv: list[str], cpus: str | None) -> list[str]:
    """`argv` run on `cpus` only (taskset, util-linux's, on every Linux host; the list is checked
    by tfkv.launcher.placement.check_cpus), or as it is."""
    return ["taskset", "-c", str(cpus).replace(" ", ""), *argv] if cpus is not None else argv


def worker_hosts(num_workers: int, num_servers: int, hosts: list[str], workers_per_host: int | None = None,
                 slots: Mapping[str, int] | None = None, source: str = "the hosts file") -> list[str]:
    """Each worker's host: MXNet's round robin after the servers; or, with `slots` (host -> slots,
    hosts-file order) or `workers_per_host`, the hosts' slots filled in order. More workers than
    slots, or workers_per_host above a host's slots, is a ConfigError naming `source`."""
    if workers_per_host is None and slots is None:
        return [hosts[(num_servers + i) % len(hosts)] for i in range(num_workers)]
    distinct = list(dict.fromkeys(hosts))
    if workers_per_host is not None:
        over = [h for h in distinct if slots and workers_per_host > slots[h]]
        if over:
            raise ConfigError(f"cluster.workers_per_host={workers_per_host} is above the {slots[over[0]]} slot(s) of "
                              f"host {over[0]} in {source}; raise its slots= or lower workers_per_host")
        capacity = {h: workers_per_host for h in distinct}
        why = f"cluster.workers_per_host={workers_per_host} on each of its {len(distinct)} host(s)"
    else:
        capacity = dict(slots or {})
        why = ", ".join(f"{h}: {n}" for h, n in capacity.items())
    total = sum(capacity.values())
    if num_workers > total:
        raise ConfigError(f"cluster.num_workers={num_workers} is more than the {total} worker slot(s) of {source} "
                          f"({why}); add hosts or slots=, or lower num_workers")
    return [h for h in distinct for _ in range(capacity[h])][:num_workers]


def make_plan(num_workers: int, num_servers: int, worker_argv: list[str], node_argv: list[str],
              hosts: list[str], scheduler_host: str, scheduler_port: int,
              extra_env: dict[str, str] | None = None, show_host: bool = False,
              placed_workers: list[str] | None = None, local_ranks: bool = True,
              server_hosts: Sequence[str] = (), cpus: tuple[str | None, str | None] = (None, None)) -> list[Process]:
    """The scheduler, `num_servers` servers and `num_workers` workers, placed on `hosts`
    (the scheduler and servers on `server_hosts` when given; the workers on `placed_workers` when
    given: see `worker_hosts`). `cpus`: the CPU lists the scheduler and servers, and the workers,
    are pinned to (`pinned`); None: not pinned. With `show_host`, names (and
    so output prefixes) carry the host: "worker 1 @node2". `local_ranks`: whether the plan's hosts
    are where the workers run, so that it can tell each its local rank (not so where a resource
    manager picks the nodes: the role helper finds it there, see tfkv.launcher.role)."""
    base = {
        "DMLC_PS_ROOT_URI": scheduler_host, "DMLC_PS_ROOT_PORT": str(scheduler_port),
        "DMLC_NUM_SERVER": str(num_servers), "DMLC_NUM_WORKER": str(num_workers), **(extra_env or {}),
    }

    def env(role: str, rank: int) -> dict[str, str]:
        return {**base, "DMLC_ROLE": role, "TFKV_RANK_HINT": str(rank)}

    def name(role: str, host: str) -> str:
        return f"{role} @{host}" if show_host else role

    servers_on = list(server_hosts) or hosts
    node_argv = pinned(list(node_argv), cpus[0])
    plan = [Process(name("scheduler", servers_on[0]), "scheduler", 0, servers_on[0], list(node_argv),
                    {**env("scheduler", 0), **NO_GPU})]
    for i in range(num_servers):
        host = servers_on[i % len(servers_on)]
        plan.append(Process(name(f"server {i}", host), "server", i, host, list(node_argv),
                            {**env("server", i), **NO_GPU}))
    placed = placed_workers or worker_hosts(num_workers, num_servers, hosts)
    for i, host in enumerate(placed):
        argv = pinned([a.replace("{rank}", str(i)) for a in worker_argv], cpus[1])  # {rank}: e.g. a per-worker log name
        local = {LOCAL_RANK: str(placed[:i].count(host)), LOCAL_SIZE: str(placed.count(host))} if local_ranks else {}
        plan.append(Process(name(f"worker {i}", host), "worker", i, host, argv, {**env("worker", i), **local}))
    return plan


def worker_overrides(argv: Sequence[str], environ: Mapping[str, str], role: str | None) -> list[str]:
    """The Hydra overrides that make tfkv-run, as the workers' command of `tfkv-launch -- tfkv-run
    ...`, write into the job's run directory (metrics, checkpoints from worker 0; `worker<rank>.log`
    each) and not into one of its own; only those `argv` does not set itself. Empty outside a
    launched job. `role`: the role this process plays (tfkv.ps.node.role, which reads it). (The
    workers of `tfkv-run cluster=...` itself run tfkv.worker instead: the launcher's recorded
    config, no Hydra of their own.)"""
    run_dir = environ.get(RUN_DIR)
    if not run_dir or role != "worker":
        return []
    wanted = {"hydra.run.dir": run_dir, "hydra.output_subdir": "null",
              "hydra.job.name": f"worker{environ.get('TFKV_RANK_HINT', '')}"}
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    return [f"{k}={v}" for k, v in wanted.items() if k not in given]
