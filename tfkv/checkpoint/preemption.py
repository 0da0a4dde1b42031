"""SIGUSR1, the signal a batch system sends ahead of a preemption or the end of a time limit
(Slurm's `--signal=USR1@<seconds>`), and SIGTERM, the one it stops a job with: the run finishes
its step, checkpoints and stops with tfkv.errors.EXIT_PREEMPTED, and the same command with
`resume=auto` continues it.

The handler only notes the signal: worker 0 looks at the end of each step, where the weights,
optimizer state and data position agree and a checkpoint is exact. In a parameter-server job the
signal may reach any process first (Slurm sends SIGTERM to all at once); whoever gets it leaves
the flag file `.preempt` in the run directory (tfkv.preempt, the flag's one definition), which
worker 0 looks for (at most every LOOK seconds). Worker 0 checkpoints, leaves `.preempted` (its one line) for the launcher and
stops; the rest of the job stops with it, as after any worker's end. The launchers' own teardown
stops roles with SIGHUP (tfkv.launcher.supervisor.STOP), never SIGTERM, so that it is not taken
for a preemption.

SIGTERM is taken so by a worker and by a run that trains alone, not by a trial of a sweep (a
SIGTERM there ends the sweep: `takes_sigterm`).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Callable

# SIGNAL, DONE, ask and done are the flag's (tfkv.preempt), here too for the trainer and tfkv-run
from tfkv.preempt import DONE, FLAG, SIGNAL, ask, done  # noqa: F401

LOOK = 0.25  # seconds between worker 0's looks for the flag (a stat: nothing beside a step)


class Preemption:
    """While installed, SIGUSR1 (and SIGTERM with `terminate`) is noted instead of ending the
    process, and passed on through the run directory's flag; `restore()` puts the previous
    handlers back. Only the main thread may
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
        if self.signum is None:  # the first one asks; Slurm may deliver SIGTERM twice (to a role and its helper)
            self.signum = signum
            ask(self.run_dir, signal.Signals(signum).name)

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
            try:
                asked = (self.run_dir / FLAG).read_text().strip()
            except OSError:
                asked = None
            if asked is not None:  # the signal that asked (an empty flag: the batch script's USR1 trap)
                self.signum = signal.Signals[asked] if asked in signal.Signals.__members__ else SIGNAL
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


def takes_sigterm() -> bool:
    """Whether this process takes SIGTERM as a preemption: a worker of a launched job (no Hydra
    here) or one Hydra run, not a trial of a sweep (a SIGTERM there ends the sweep), and nothing
    of this process took SIGTERM before (its handler is the default one)."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return not HydraConfig.initialized() or HydraConfig.get().mode == RunMode.RUN
