"""`hydra/sweeper=tfkv_optuna`: Hydra's Optuna sweeper, with a pruner that stops bad trials early.

Hydra's own (`hydra/sweeper=optuna`) asks Optuna for trials and tells it what each job returned:
a job never learns which trial it is, the study lives in the sweeping process only, and a failed
trial's NaN ends the whole sweep (hydra-optuna-sweeper 1.3.0 tells FAIL with the value attached).
This sweeper keeps the study in storage every trial's processes reach (default: SQLite,
optuna.db in the sweep directory), gives each job `sweep.study`, `sweep.storage` and
`sweep.trial` so that its worker 0 reports the objective every epoch and asks the pruner
(tfkv.sweep.pruning), and tells Optuna each trial's outcome from the trial's record
(tfkv.sweep.trial): COMPLETE with its value, PRUNED, or FAIL. The direction is the config's
`direction`. Optuna is imported once a sweep starts, never when Hydra scans its plug-ins.

Hydra instantiates sweepers only from `hydra_plugins.*`: hydra_plugins/tfkv_sweep/tfkv_optuna.py
names this class there and registers the config below.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.utils import JobReturn, JobStatus
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper.config import OptunaSweeperConf
from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
from omegaconf import MISSING, DictConfig, OmegaConf

from tfkv.errors import ConfigError

log = logging.getLogger(__name__)

TARGET = "hydra_plugins.tfkv_sweep.tfkv_optuna.TfkvOptunaSweeper"
DB = "optuna.db"  # the study's SQLite file in the sweep directory, unless hydra.sweeper.storage says


# hydra/sweeper/pruner=<name>: Optuna's pruners with their settings (optuna 2.10's defaults).
@dataclass
class MedianPrunerConf:
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5  # no pruning before this many trials have finished
    n_warmup_steps: int = 0  # steps are epochs (1, 2, ...): none pruned before epoch n_warmup_steps
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class PercentilePrunerConf(MedianPrunerConf):
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = MISSING  # e.g. 25.0: pruned below the best 25% (MedianPruner: 50)


@dataclass
class SuccessiveHalvingPrunerConf:
    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Any = "auto"
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0
    bootstrap_count: int = 0


@dataclass
class HyperbandPrunerConf:
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: Any = "auto"
    reduction_factor: int = 3
    bootstrap_count: int = 0


@dataclass
class NopPrunerConf:
    _target_: str = "optuna.pruners.NopPruner"


PRUNERS = {"median": MedianPrunerConf, "percentile": PercentilePrunerConf,
           "successive_halving": SuccessiveHalvingPrunerConf, "hyperband": HyperbandPrunerConf,
           "nop": NopPrunerConf}


@dataclass
class TfkvOptunaSweeperConf(OptunaSweeperConf):
    _target_: str = TARGET
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "median"}])
    direction: Any = "${direction}"  # the run config's: which way `objective` is better
    storage: Optional[Any] = None  # null: sqlite:///<hydra.sweep.dir>/optuna.db
    # A failed trial is a result (tfkv's sweep.fail_fast ends a sweep at the first); below 1.0,
    # the sweep ends once more than this share of one batch of trials failed.
    max_failure_rate: float = 1.0
    pruner: Any = MISSING


class TfkvOptunaSweeper(OptunaSweeper):
    """Optuna's sweeper (its search space, samplers and launch batches) with a pruner."""

    def __init__(self, pruner: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pruner = pruner
        self.config: DictConfig | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.config = config
        directions = self.sweeper._get_directions()
        if len(directions) != 1:
            raise ConfigError(f"hydra.sweeper.direction={directions}: tfkv-run returns one objective; "
                              "give one direction (the default is the config's direction)")
        if directions[0] != config.direction:
            raise ConfigError(f"hydra.sweeper.direction={directions[0]} but direction={config.direction}; "
                              "leave hydra.sweeper.direction out (it follows direction) or set both alike")
        self.direction = directions[0]
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        self.storage_url = _absolute(self.sweeper.storage or f"sqlite:///{sweep_dir / DB}")
        self.sweep_dir = sweep_dir

    def sweep(self, arguments: List[str]) -> None:
        import optuna
        from hydra_plugins.hydra_optuna_sweeper import _impl

        from tfkv.sweep import pruning
        from tfkv.sweep.trial import SweepStopped

        impl, config = self.sweeper, self.config
        assert config is not None, "setup() comes first"
        optuna.logging.disable_default_handler()  # Optuna's lines through Hydra's log, as ours
        optuna.logging.enable_propagation()
        impl._process_searchspace_config()
        distributions, fixed = _impl.create_params_from_overrides(impl._parse_sweeper_params_config() + arguments)
        distributions = {**(impl.search_space_distributions or {}), **distributions}
        for name in fixed:
            distributions.pop(name, None)
        sampler, n_trials = impl.sampler, impl.n_trials
        if getattr(sampler, "func", None) is optuna.samplers.GridSampler:  # a partial: it needs the grid
            grid = {name: impl._to_grid_sampler_choices(d) for name, d in distributions.items()}
            sampler = sampler(grid)
            n_trials = min(n_trials, math.prod(len(v) for v in grid.values()))

        self.sweep_dir.mkdir(parents=True, exist_ok=True)  # the SQLite file's directory
        study = optuna.create_study(study_name=impl.study_name, storage=pruning.open_storage(self.storage_url),
                                    sampler=sampler, pruner=self.pruner, direction=self.direction,
                                    load_if_exists=True)
        pruner_node = config.hydra.sweeper.pruner
        study.set_user_attr(pruning.PRUNER_ATTR, OmegaConf.to_container(pruner_node, resolve=True))
        log.info("Optuna study %s (%s), storage %s, sampler %s, pruner %s", study.study_name, self.direction,
                 self.storage_url, type(sampler).__name__, type(self.pruner).__name__)

        left = n_trials
        while left > 0:
            trials = [study.ask() for _ in range(min(left, impl.n_jobs))]
            overrides = [[*params, *self._trial_overrides(study.study_name, t.number)]
                         for params, t in zip(impl._configure_trials(trials, distributions, fixed), trials)]
            try:
                returns = impl.launcher.launch(overrides, initial_job_idx=impl.job_idx)
            except BaseException:  # Ctrl-C, a launcher's error: these trials never finish
                for t in trials:
                    _tell(study, t, optuna.trial.TrialState.FAIL, None)
                raise
            impl.job_idx += len(returns)
            failed = 0
            for t, ret in zip(trials, returns):
                state, value = _outcome(ret)
                _tell(study, t, state, value)
                failed += state == optuna.trial.TrialState.FAIL
            for ret in returns:  # a task function raises only to end the sweep (fail_fast, SIGTERM)
                if ret.status == JobStatus.FAILED:
                    ret.return_value  # noqa: B018 - raises the job's exception
            if failed / len(returns) > impl.max_failure_rate:
                raise SweepStopped(f"{failed} of {len(returns)} trials of a batch failed, more than "
                                   f"hydra.sweeper.max_failure_rate={impl.max_failure_rate}; the sweep ends")
            left -= len(trials)
        self._write_results(study)

    def _trial_overrides(self, study: str, number: int) -> list[str]:
        """What makes a job a trial its worker 0 reports to (config.SweepConfig)."""
        from tfkv.sweep import pruning

        values = (_quoted(study), _quoted(self.storage_url), number)
        return [f"{key}={value}" for key, value in zip(pruning.TRIAL_KEYS, values)]

    def _write_results(self, study: Any) -> None:
        """optimization_results.yaml, as Hydra's Optuna sweeper writes it, with the trial counts."""
        import optuna

        counts = {s.name.lower(): len(study.get_trials(deepcopy=False, states=(s,)))
                  for s in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED,
                            optuna.trial.TrialState.FAIL)}
        results: dict[str, Any] = {"name": "optuna", "study_name": study.study_name, "storage": self.storage_url,
                                   "best_params": None, "best_value": None, "best_trial": None,
                                   "trials": {"complete": counts["complete"], "pruned": counts["pruned"],
                                              "failed": counts["fail"]}}
        if counts["complete"]:
            best = study.best_trial
            results.update(best_params=best.params, best_value=best.value, best_trial=best.number)
            log.info("Best trial #%d: %s %s; parameters %s", best.number, self.config.objective, best.value,
                     best.params)
        else:
            log.warning("no trial of study %s completed: no best parameters", study.study_name)
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")


def _tell(study: Any, trial: Any, state: Any, value: float | None) -> None:
    try:
        study.tell(trial, state=state, values=None if value is None else [value])
    except RuntimeError as e:
        # GridSampler stops the study once its grid is done, which only works inside
        # study.optimize; the trial's state is stored by then (Hydra's sweeper passes it too)
        if "Study.stop" not in str(e):
            raise


def _outcome(ret: JobReturn) -> tuple[Any, float | None]:
    """Optuna's state for a finished job, and its value where it completed: from the trial's
    record (trial.json) where the job left one, else from what the task function returned."""
    import optuna

    from tfkv.sweep import trial

    states = optuna.trial.TrialState
    if ret.status != JobStatus.COMPLETED:
        return states.FAIL, None
    record = trial.read(ret.hydra_cfg.hydra.runtime.output_dir) if ret.hydra_cfg else None
    status = record.get("status") if record else None
    if status == "pruned":
        return states.PRUNED, None  # Optuna keeps the last value the trial reported
    try:
        value = float(ret.return_value)
    except (TypeError, ValueError):
        return states.FAIL, None
    if status not in (None, "ok") or not math.isfinite(value):
        return states.FAIL, None
    return states.COMPLETE, value


def _absolute(url: str) -> str:
    """A SQLite URL with a relative path, made absolute: trials may run in other directories."""
    prefix = "sqlite:///"
    if url.startswith(prefix) and not url[len(prefix):].startswith("/") and url[len(prefix):] != ":memory:":
        return prefix + os.path.abspath(url[len(prefix):])
    return url


def _quoted(value: str) -> str:
    """`value` as one quoted Hydra override value (paths may hold spaces or quotes)."""
    return "'" + value.replace("'", "\\'") + "'"
