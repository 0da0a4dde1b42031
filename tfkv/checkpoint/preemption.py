"""SIGUSR1, the signal a batch system sends ahead of a preemption or the end of a time limit
(Slurm's `--signal=USR1@<seconds>`): the run finishes its step, checkpoints and stops with
tfkv.errors.EXIT_PREEMPTED, and the same command with `resume=auto` continues it.

The handler only notes the signal: worker 0 looks at the end of each step, where the weights,
optimizer state and data position agree and a checkpoint is exact. In a parameter-server job the
signal may reach any worker or the launcher (`tfkv-run`) first; whoever gets it leaves the flag
file `.preempt` in the run directory, which worker 0 looks for (at most every LOOK seconds). Worker 0
checkpoints, leaves `.preempted` (its one line) for the launcher and stops; the rest of the job
stops with it, as after any worker's end.

SIGTERM (what Slurm, `timeout` or `kill` send to stop a process) is taken the same way by a run
that trains in its own process alone (`takes_sigterm`): it owns its step, finishes it in a blink
and exits 75 with a checkpoint of where it was. In a parameter-server job SIGTERM keeps its
meaning, stop now: a launcher's teardown sends it to every role, and Slurm sends it to every
process of a job at once (servers included), so no step could be finished.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Callable

SIGNAL = signal.SIGUSR1
FLAG = ".preempt"  # in the run directory: a preemption was asked for
DONE = ".preempted"  # in the run directory: worker 0 checkpointed and stopped; its line
LOOK = 0.25  # seconds between worker 0's looks for the flag (a stat: nothing beside a step)


def ask(run_dir: Path) -> None:
    """Ask worker 0 of the job writing into `run_dir` to checkpoint and stop."""
    try:
        (Path(run_dir) / FLAG).touch()
    except OSError:
        pass  # a run directory that cannot be written ends the job on its own


def done(run_dir: Path) -> str | None:
    """Worker 0's line when it stopped for a preemption (the marker is removed), else None."""
    marker = Path(run_dir) / DONE
    try:
        line = marker.read_text().strip()
    except OSError:
        return None
    marker.unlink(missing_ok=True)
    return line


class Preemption:
    """While installed, SIGUSR1 is noted instead of ending the process, and passed on through the
    run directory's flag; `restore()` puts the previous handler back. Only the main thread may
    set a handler: elsewhere nothing changes but the flag is still looked for."""

    def __init__(self, run_dir: Path, clock: Callable[[], float] = time.monotonic, terminate: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.signum: int | None = None
        self.clock = clock
        self._looked = clock()
        self._old: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (SIGNAL, signal.SIGTERM) if terminate else (SIGNAL,):
                self._old[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, _frame: object) -> None:
        self.signum = signum
        ask(self.run_dir)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def clear(self) -> None:
        """Forget a flag an earlier, stopped run left (worker 0, before it starts)."""
        for name in (FLAG, DONE):
            (self.run_dir / name).unlink(missing_ok=True)

    @property
    def requested(self) -> bool:
        """A signal came here, or (looked for every LOOK seconds) to another process of the job."""
        if self.signum is None and self.clock() - self._looked >= LOOK:
            self._looked = self.clock()
            if (self.run_dir / FLAG).exists():
                self.signum = SIGNAL
        return self.signum is not None

    def stopped(self, line: str | None) -> None:
        """Worker 0 checkpointed and stops: the flag goes, and a launcher (`line` given) gets its marker."""
        if line is not None:
            (self.run_dir / DONE).write_text(line + "\n")
        (self.run_dir / FLAG).unlink(missing_ok=True)

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}


def takes_sigterm(distributed: bool) -> bool:
    """Whether this run takes SIGTERM as a preemption: it trains alone (no parameter-server job)
    as one Hydra run, not a trial of a sweep (a SIGTERM there ends the sweep), and nothing of
    this process took SIGTERM before (its handler is the default one)."""
    if distributed or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.RUN
