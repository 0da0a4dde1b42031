"""A run directory's hold and its records: the Hydra callback that takes the directory's lock
before Hydra writes into it, and where an evaluation (`eval_only`) writes its record.

Hydra writes `.hydra/` (and opens the job's log) in the run directory before the job's code runs.
`hydra.callbacks.run_directory` (conf/config.yaml) takes the directory's lock
(tfkv.checkpoint.lock) in `on_run_start`, before any of that: a second `tfkv-run` on a directory
in use is refused in one line and leaves every file of the running job untouched. (A trial of a
sweep takes its directory's lock in the job, as a launched job's roles run inside their
launcher's hold.)

An evaluation never replaces another run's results. Into a directory that holds none (a fresh
one) it writes as any run does: `metrics.json`, `model.keras`, `config_resolved.yaml`,
`knobs.json`, `.hydra/`. Into a directory that holds a run's results (`RESULTS`: the run that
wrote the checkpoint, or an earlier evaluation), it writes them into `eval/<checkpoint>/` instead
(whose `config_resolved.yaml` is its whole config: Hydra writes no `.hydra/` for it there), and
only the log (`tfkv.log`) gets its lines added.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

# What a run leaves in its directory; an evaluation finding any of them writes beside them.
RESULTS = ("config_resolved.yaml", "metrics.json", "model.keras", "checkpoints")
EVALUATIONS = "eval"  # in a run directory: one folder per checkpoint evaluated there


def holds_results(run_dir: Path) -> bool:
    """Whether `run_dir` holds what a run (or an evaluation) wrote."""
    return any((Path(run_dir) / name).exists() for name in RESULTS)


def evaluation_dir(cfg: Any, run_dir: Path, search_root: Path, overrides: list[str]) -> Path:
    """Where the evaluation `cfg` asks for writes: `run_dir`, or `run_dir`/eval/<checkpoint> when
    `run_dir` holds results already. The checkpoint `cfg.resume` means is found here and put in
    `cfg.resume`, as the record then says (and it is read once, not searched for again)."""
    from tfkv import checkpoint
    from tfkv.errors import ConfigError

    found = checkpoint.find_resume(cfg.resume, run_dir, search_root, overrides)
    if found is None:  # resume=true or auto that found none (find_resume said so)
        raise ConfigError(f"eval_only=true: resume={cfg.resume} found no checkpoint to evaluate; give "
                          "resume=<run directory or checkpoint directory>")
    cfg.resume = os.path.abspath(found)
    if not holds_results(run_dir):
        return Path(run_dir)
    record = Path(run_dir) / EVALUATIONS / Path(found).name
    record.mkdir(parents=True, exist_ok=True)
    return record


class RunDirectory(Callback):
    """hydra.callbacks.run_directory: the run directory's lock from before Hydra writes into it
    until the run ends (or the process does), and an evaluation's `.hydra/` kept off a run's."""

    def __init__(self) -> None:
        self._held = contextlib.ExitStack()

    def on_run_start(self, config: Any, **kwargs: Any) -> None:
        from omegaconf import read_write

        from tfkv.checkpoint import lock
        from tfkv.errors import report
        from tfkv.ps import node

        if node.role() is not None:  # a role of a launched job: inside its launcher's hold
            return
        run_dir = Path(os.path.abspath(str(config.hydra.run.dir)))  # as Hydra's run_job makes it
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._held.enter_context(lock.hold(run_dir))
        except Exception as e:  # Hydra turns a callback's exception into a warning and goes on
            report("tfkv-run", e)  # a user's: one line and its status, here
            raise
        if config.get("eval_only") and holds_results(run_dir):  # the run's own .hydra/ stays
            with read_write(config.hydra):
                config.hydra.output_subdir = None  # the evaluation's config is in eval/<checkpoint>/

    def on_run_end(self, config: Any, **kwargs: Any) -> None:
        self._held.close()
