"""The one place that reads a process's role and dispatches on it; entry point of the
scheduler and server roles: `python -m tfkv.ps.node`.

The role and the cluster come from the environment (DMLC_ROLE, DMLC_PS_ROOT_URI, ... or the
TFKV_ names), as in MXNet, where every process of a job can run the same command: `role` says
which one this process plays, `run_unless_worker` runs a scheduler or a server to the end and
returns for a worker. `tfkv-run` calls `main` first, before Hydra or TensorFlow start, so a
server never imports TensorFlow; a `dist_*` store's constructor calls `run_unless_worker`, as
MXNet's KVStore creation does in every role.

A batch system's signals do not end a scheduler or server at once (tfkv.preempt.keep_serving): Slurm sends
SIGTERM to every process of a job together, and worker 0's checkpoint at its next step needs the
servers (their optimizer state). Either signal raises the run directory's preemption flag
(tfkv.preempt) and the role goes on; after SIGTERM it leaves GRACE seconds later if the job has
not ended it before. SIGINT (Ctrl-C) and SIGHUP (the launchers' teardown) end it at once.
"""

from __future__ import annotations

import logging
import sys
from typing import Mapping

from tfkv import preempt
from tfkv.errors import EXIT_INTERRUPTED, TfkvError, report
from tfkv.ps.cluster_env import ClusterEnv, ClusterEnvError

SERVING = ("scheduler", "server")  # the roles tfkv.ps runs; a worker runs the training command


def role(env: Mapping[str, str] | None = None) -> str | None:
    """The role this process plays in a job (TFKV_ROLE or DMLC_ROLE in `env`, os.environ unless
    given), or None for a process outside one (a single run, a launcher, a sweep)."""
    return ClusterEnv.role_of(env)


def run_unless_worker(env: ClusterEnv) -> None:
    """A scheduler or a server: run it until the job ends and exit the process with its status.
    A worker: return, to train."""
    if env.role != "worker":
        sys.exit(run_role(env))


def run_role(env: ClusterEnv) -> int:
    """Run the scheduler or a server until the job ends; the process's exit status."""
    if env.role == "scheduler":
        from tfkv.ps.scheduler import Scheduler

        return Scheduler(env).run()
    if env.role == "server":
        from tfkv.ps.server import Server

        return Server(env).run()
    raise _not_served(env.role)


def _not_served(name: str) -> ClusterEnvError:
    return ClusterEnvError(f"role {name!r} is not run by tfkv.ps.node; workers run the training command")


def main(workers_return: bool = False) -> None:
    """`python -m tfkv.ps.node`: the role the environment names, to the end (the process exits with
    its status; a worker is refused with one line). `workers_return`: tfkv-run's first step, where
    a worker, or a process outside a job, returns to train instead."""
    if workers_return and role() not in SERVING:
        return
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
                        stream=sys.stdout)
    preempt.keep_serving()
    try:
        env = ClusterEnv.from_env()
        run_unless_worker(env)
        raise _not_served(env.role)
    except TfkvError as e:  # a malformed environment, a cluster that cannot form, keys: one line
        report("tfkv", e)
    except OSError as e:  # a port taken
        print(f"tfkv: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
