"""Entry point of the scheduler and server roles: `python -m tfkv.ps.node`.

The role and the cluster come from the environment (DMLC_ROLE, DMLC_PS_ROOT_URI, ... or the
TFKV_ names), as in MXNet, where every process of a job can run the same command. `tfkv-run`
calls `main` too, before Hydra or TensorFlow start, so a server never imports TensorFlow.

A batch system's signals do not end a scheduler or server at once (tfkv.preempt.keep_serving): Slurm sends
SIGTERM to every process of a job together, and worker 0's checkpoint at its next step needs the
servers (their optimizer state). Either signal raises the run directory's preemption flag
(tfkv.preempt) and the role goes on; after SIGTERM it leaves GRACE seconds later if the job has
not ended it before. SIGINT (Ctrl-C) and SIGHUP (the launchers' teardown) end it at once.
"""

from __future__ import annotations

import logging
import sys

from tfkv import preempt
from tfkv.errors import EXIT_INTERRUPTED, TfkvError, report
from tfkv.ps.cluster_env import ClusterEnv, ClusterEnvError

log = logging.getLogger("tfkv")


def run_role(env: ClusterEnv) -> int:
    """Run the scheduler or a server until the job ends; the process's exit status."""
    if env.role == "scheduler":
        from tfkv.ps.scheduler import Scheduler

        return Scheduler(env).run()
    if env.role == "server":
        from tfkv.ps.server import Server

        return Server(env).run()
    raise ClusterEnvError(f"role {env.role!r} is not run by tfkv.ps.node; workers run the training command")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
                        stream=sys.stdout)
    preempt.keep_serving()
    try:
        sys.exit(run_role(ClusterEnv.from_env()))
    except TfkvError as e:  # a malformed environment, a cluster that cannot form, keys: one line
        report("tfkv", e)
    except OSError as e:  # a port taken
        print(f"tfkv: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
