"""Which role runs where, and with which environment: the plan every launcher backend executes.

Placement follows MXNet's launch.py: the scheduler on the first host; servers, then workers,
cycling through the hosts (5 hosts, 3 servers, 3 workers: servers on hosts 1-3, workers on
hosts 4, 5, 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

# The job's run directory as the roles see it, in every role's environment: a worker that runs
# tfkv-run writes there (see worker_overrides) instead of making a Hydra run directory of its own.
RUN_DIR = "TFKV_RUN_DIR"
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
    "TFKV_SSH_CONFIG", "TFKV_ADVERTISE_ADDRESS", RUN_DIR, CONFIG})


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


def make_plan(num_workers: int, num_servers: int, worker_argv: list[str], node_argv: list[str],
              hosts: list[str], scheduler_host: str, scheduler_port: int,
              extra_env: dict[str, str] | None = None, show_host: bool = False) -> list[Process]:
    """The scheduler, `num_servers` servers and `num_workers` workers, placed on `hosts`; with
    `show_host`, names (and so output prefixes) carry the host: "worker 1 @node2"."""
    base = {
        "DMLC_PS_ROOT_URI": scheduler_host, "DMLC_PS_ROOT_PORT": str(scheduler_port),
        "DMLC_NUM_SERVER": str(num_servers), "DMLC_NUM_WORKER": str(num_workers), **(extra_env or {}),
    }

    def env(role: str, rank: int) -> dict[str, str]:
        return {**base, "DMLC_ROLE": role, "TFKV_RANK_HINT": str(rank)}

    def name(role: str, host: str) -> str:
        return f"{role} @{host}" if show_host else role

    plan = [Process(name("scheduler", hosts[0]), "scheduler", 0, hosts[0], list(node_argv), env("scheduler", 0))]
    for i in range(num_servers):
        host = hosts[i % len(hosts)]
        plan.append(Process(name(f"server {i}", host), "server", i, host, list(node_argv), env("server", i)))
    for i in range(num_workers):
        host = hosts[(num_servers + i) % len(hosts)]
        argv = [a.replace("{rank}", str(i)) for a in worker_argv]  # e.g. a per-worker log name
        plan.append(Process(name(f"worker {i}", host), "worker", i, host, argv, env("worker", i)))
    return plan


def worker_overrides(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """The Hydra overrides that make tfkv-run, as the workers' command of `tfkv-launch -- tfkv-run
    ...`, write into the job's run directory (metrics, checkpoints from worker 0; `worker<rank>.log`
    each) and not into one of its own; only those `argv` does not set itself. Empty outside a
    launched job. (The workers of `tfkv-run cluster=...` itself run tfkv.worker instead: the
    launcher's recorded config, no Hydra of their own.)"""
    run_dir = environ.get(RUN_DIR)
    if not run_dir or (environ.get("TFKV_ROLE") or environ.get("DMLC_ROLE") or "").lower() != "worker":
        return []
    wanted = {"hydra.run.dir": run_dir, "hydra.output_subdir": "null",
              "hydra.job.name": f"worker{environ.get('TFKV_RANK_HINT', '')}"}
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv}
    return [f"{k}={v}" for k, v in wanted.items() if k not in given]
