"""Per-epoch values to the Optuna study of a `hydra/sweeper=tfkv_optuna` trial, and its pruner's
verdict: the tracker (tfkv.tracking) that stops a bad trial early.

The sweeper gives each job `sweep.study`, `sweep.storage` and `sweep.trial` (the trial's number)
and keeps the pruner's config node in the study (PRUNER_ATTR), since Optuna stores no pruner.
Worker 0 reports `record[objective]` at step = epoch (Optuna's study holds the direction, so
the value goes as it is); when the pruner says so it writes PRUNED_FILE in the run directory
(the launching process of a dist_* trial learns from it that the job's failure was a pruning)
and raises TrialPruned. Optuna is imported only in a trial.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from tfkv.errors import ConfigError, TrialPruned
from tfkv.sweep import trial as trial_record
from tfkv.tracking import Hook

log = logging.getLogger(__name__)

# The overrides the sweeper gives each job it asks for (config.SweepConfig): where to report.
TRIAL_KEYS = ("sweep.study", "sweep.storage", "sweep.trial")
# The study's user attribute with the pruner's config node (a `_target_` under optuna.pruners).
PRUNER_ATTR = "tfkv_pruner"
# Only Optuna's pruners are built from what the study's storage says: it may be a shared database.
PRUNER_PREFIX = "optuna.pruners."


JOURNAL = "journal:"  # storage=journal:<path>: Optuna's JournalStorage in that file
OPTUNA = 4  # the oldest Optuna major version tested (public ask/tell, JournalFileBackend)


def check_optuna() -> None:
    """Optuna 4 or later is installed, else one line saying what to install."""
    import importlib.util
    from importlib import metadata

    try:
        version = metadata.version("optuna") if importlib.util.find_spec("optuna") else None
    except (ValueError, metadata.PackageNotFoundError):  # ValueError: sys.modules["optuna"] is None
        version = None
    if version is None or int(version.split(".")[0]) < OPTUNA:
        found = f"finds Optuna {version}" if version else "needs Optuna, which is not installed"
        raise ConfigError(f"hydra/sweeper=tfkv_optuna {found}; it needs Optuna {OPTUNA} or later: "
                          "pip install 'tfkv[sweep]' (Hydra's own hydra/sweeper=optuna, which pins Optuna 2, "
                          "belongs in an environment of its own)")


def storage_url(storage: str) -> str:
    """The study's storage as every trial names it: `journal:<absolute path>` for a journal file
    (written `journal:<path>` or as a bare path), a database URL with a relative SQLite path made
    absolute (trials may run in other directories)."""
    if storage.startswith(JOURNAL):
        return JOURNAL + os.path.abspath(os.path.expanduser(storage[len(JOURNAL):]))
    if "://" not in storage:
        return JOURNAL + os.path.abspath(os.path.expanduser(storage))
    prefix = "sqlite:///"
    path = storage[len(prefix):]
    if storage.startswith(prefix) and not path.startswith("/") and path != ":memory:":
        return prefix + os.path.abspath(path)
    return storage


def open_storage(url: str) -> Any:
    """Optuna's storage at `url` (storage_url's form). A journal file is shared through the file
    system by every process and host that sees it (Optuna's lock file beside it, safe on NFS);
    a database is opened uncached, so every read sees other processes' writes, and SQLite waits
    for another process's write instead of failing."""
    import optuna

    if url.startswith(JOURNAL):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len(JOURNAL):]))
    engine = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(url, engine_kwargs=engine)


def build_pruner(node: Any) -> Any:
    """The pruner a study's PRUNER_ATTR node describes (None: Optuna's NopPruner)."""
    import optuna
    from hydra.utils import instantiate

    if node is None:
        return optuna.pruners.NopPruner()
    targets = _targets(node)
    bad = [t for t in targets if not str(t).startswith(PRUNER_PREFIX)]
    if bad or not targets:
        raise ConfigError(f"the study's pruner {bad[0] if bad else node!r} is not one of Optuna's "
                          f"({PRUNER_PREFIX}*); choose one with hydra/sweeper/pruner=median|percentile|"
                          "hyperband|successive_halving|nop")
    return instantiate(node)


def _targets(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "_target_"] + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


class Pruning(Hook):
    """Worker 0's side of one trial: report each epoch, stop when the pruner says so (no `end`:
    the sweeper tells Optuna the trial's outcome from its record)."""

    def __init__(self, cfg: Any, run_dir: Path, trial: Any) -> None:
        self.objective = str(cfg.objective)
        self.epochs = int(cfg.epochs)
        self.run_dir = Path(run_dir)
        self.trial = trial
        self.pruner = type(trial.study.pruner).__name__
        self.where = f"trial {cfg.sweep.trial} of study {cfg.sweep.study}"

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        if self.objective not in record:
            return  # objective is a value of the run's end only: nothing to compare per epoch
        value = float(record[self.objective])
        self.trial.report(value, step=epoch)
        if epoch < self.epochs and self.trial.should_prune():
            reason = (f"pruned at epoch {epoch}/{self.epochs} by the sweep's {self.pruner}: {self.objective} "
                      f"{value:.4f} is worse than its peers' at that epoch ({self.where})")
            # the reason too: a dist_* trial's launching process sees only worker 0's exit status
            (self.run_dir / trial_record.PRUNED_FILE).write_text(json.dumps(
                {"epoch": epoch, "value": value if math.isfinite(value) else None, "reason": reason}))
            raise TrialPruned(reason)


def build(cfg: Any, run_dir: Path) -> Pruning | None:
    """The tracker of a running tfkv_optuna trial (sweep.trial set), else None."""
    sweep = cfg.get("sweep")
    if sweep is None or sweep.get("trial") is None:
        return None
    import optuna

    check_optuna()
    storage = open_storage(str(sweep.storage))
    study = optuna.load_study(study_name=str(sweep.study), storage=storage)
    if str(cfg.direction) != study.direction.name.lower():
        raise ConfigError(f"direction={cfg.direction} but the sweep's study {sweep.study} is to "
                          f"{study.direction.name.lower()}; set hydra.sweeper.direction to the same")
    study.pruner = build_pruner(study.user_attrs.get(PRUNER_ATTR))
    trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(str(sweep.study)),
                                                               int(sweep.trial))
    state = storage.get_trial(trial_id).state
    if state.is_finished():  # this run repeats a trial of a finished sweep (its rerun.sh)
        log.warning("trial %s of study %s is %s: this run reports nothing to it", sweep.trial, sweep.study,
                    state.name)
        return None
    return Pruning(cfg, run_dir, optuna.trial.Trial(study, trial_id))
