"""The preemption flag, the one definition every process of a job shares, whatever its role.

A batch system stops a job with SIGTERM to every process of it at once (Slurm: then SIGKILL after
KillWait, 30 s by default), and warns ahead of it with SIGUSR1 (`--signal=B:USR1@120`). Whoever
gets either raises the run directory's flag (FLAG, `ask`); worker 0 finishes its step,
checkpoints, leaves DONE (its one line) for the launcher and stops the job
(tfkv.checkpoint.preemption watches the flag in the trainer; the launcher takes its own SIGTERM
in tfkv.launcher.signals and reads DONE with `done`). A scheduler or server keeps serving
meanwhile (`keep_serving`): worker 0's checkpoint reads the servers' optimizer state, and the job
ends them as it ends. No TensorFlow here.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Mapping

log = logging.getLogger("tfkv")

# The job's run directory as the roles see it, in every role's environment: a worker that runs
# tfkv-run writes there (see tfkv.launcher.plan.worker_overrides) instead of making a Hydra run
# directory of its own; the flag below is in it.
RUN_DIR = "TFKV_RUN_DIR"
FLAG = ".preempt"  # in the run directory: a preemption was asked for
DONE = ".preempted"  # in the run directory: worker 0 checkpointed and stopped; its line
SIGNAL = signal.SIGUSR1  # a batch system's warning ahead of a preemption or a time limit
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


def done(run_dir: Path | str) -> str | None:
    """Worker 0's line when it stopped for a preemption (the marker is removed), else None."""
    marker = Path(run_dir) / DONE
    try:
        line = marker.read_text().strip()
    except OSError:
        return None
    marker.unlink(missing_ok=True)
    return line


def keep_serving(grace: float = GRACE) -> None:
    """In a scheduler or server: SIGTERM and SIGUSR1 raise the preemption flag instead of ending
    the role; SIGTERM also ends it `grace` seconds later (SIGALRM), as a process killed by SIGTERM
    (143). SIGINT (Ctrl-C) and SIGHUP (the launchers' teardown) still end it at once. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return

    def asked(signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        ask_from_env(name)
        if signum == signal.SIGTERM and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            log.warning("%s: serving on until the job ends, at most %.0f s", name, grace)
            signal.setitimer(signal.ITIMER_REAL, grace)

    def leave(_signum: int, _frame: object) -> None:
        log.warning("the job did not end within %.0f s of SIGTERM; leaving", grace)
        raise SystemExit(128 + signal.SIGTERM)

    for sig in (signal.SIGTERM, SIGNAL):
        signal.signal(sig, asked)
    signal.signal(signal.SIGALRM, leave)
