"""What every process of a job shares about a preemption, whatever its role: the run directory's
flag file by which any of them asks worker 0 to checkpoint and stop, and how long a process that
got SIGTERM goes on (GRACE) before it leaves.

A batch system stops a job with SIGTERM to every process of it at once (Slurm: then SIGKILL after
KillWait, 30 s by default), and warns ahead of it with SIGUSR1 (`--signal=B:USR1@120`). Whoever
gets either raises the flag; worker 0 finishes its step, checkpoints and stops the job
(tfkv.checkpoint.preemption). The scheduler and the servers keep serving meanwhile: worker 0's
checkpoint reads the servers' optimizer state, and the job ends them as it ends. No TensorFlow here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

# The job's run directory as the roles see it, in every role's environment: a worker that runs
# tfkv-run writes there (see tfkv.launcher.plan.worker_overrides) instead of making a Hydra run
# directory of its own; the flag below is in it.
RUN_DIR = "TFKV_RUN_DIR"
FLAG = ".preempt"  # in the run directory: a preemption was asked for
# Seconds a process goes on after SIGTERM for the job to checkpoint and end by itself (below
# Slurm's default KillWait of 30 s, which ends everything with SIGKILL).
GRACE = 20.0


def ask(run_dir: Path | str, signame: str = "SIGUSR1") -> None:
    """Ask worker 0 of the job writing into `run_dir` to checkpoint and stop; the flag holds the
    name of the signal that asked (worker 0's line names it)."""
    try:
        (Path(run_dir) / FLAG).write_text(signame + "\n")
    except OSError:
        pass  # a run directory that cannot be written ends the job on its own


def ask_from_env(signame: str, environ: Mapping[str, str] | None = None) -> None:
    """`ask` for the run directory this role was started with (none outside a launched job)."""
    run_dir = (os.environ if environ is None else environ).get(RUN_DIR)
    if run_dir:
        ask(run_dir, signame)
