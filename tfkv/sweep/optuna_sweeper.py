"""`hydra/sweeper=tfkv_optuna`: Optuna's search, on Optuna's public API (ask and tell), with a
pruner that stops bad trials early and a study every trial's processes share.

Hydra's own Optuna sweeper (`hydra/sweeper=optuna`, hydra-optuna-sweeper) pins Optuna 2, keeps
its study in the sweeping process and never lets a job know which trial it is. This one asks
Optuna (4 or later) for each batch of trials, gives each job `sweep.study`, `sweep.storage` and
`sweep.trial` so that its worker 0 reports the objective every epoch and asks the pruner
(tfkv.sweep.pruning), launches the batch with Hydra's launcher, and tells Optuna each trial's
outcome from the trial's record (tfkv.sweep.trial): COMPLETE with its value, PRUNED, or FAIL.
The study lives in a storage every trial reaches: by default a journal file (Optuna's
JournalStorage), optuna.journal in the sweep directory, which trials on other hosts share through
the file system without a database server; `hydra.sweeper.storage` may name another journal
file (`journal:<path>`, or a path) or a database URL (sqlite:///..., postgresql://...). The
direction is the objective's (tfkv.config.objective), which `hydra.sweeper.direction` may only
repeat. Optuna is imported once a sweep starts, never when Hydra scans its plug-ins.

The search space is Hydra's sweep syntax (on the command line or in hydra.sweeper.params), read
with Hydra's public override parser: choice(...) and a,b,c are categorical, range(...) an
integer (or stepped float) range, interval(...) a float or int interval, tag(log, ...) on a log
scale. Hydra instantiates sweepers only from `hydra_plugins.*`: hydra_plugins/tfkv_sweep/
tfkv_optuna.py names this class there and registers the config below.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf

from tfkv.errors import ConfigError

log = logging.getLogger(__name__)

TARGET = "hydra_plugins.tfkv_sweep.tfkv_optuna.TfkvOptunaSweeper"
JOURNAL = "optuna.journal"  # the study's file in the sweep directory, unless hydra.sweeper.storage says


# hydra/sweeper/sampler=<name>: Optuna's samplers, the settings a sweep usually sets (others: +key=).
@dataclass
class TPESamplerConf:
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    constant_liar: bool = False  # trials of one batch (n_jobs > 1) steer away from each other


@dataclass
class RandomSamplerConf:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConf:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1


@dataclass
class GridSamplerConf:
    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True  # the grid is the search space, known once the sweep's overrides are
    seed: Optional[int] = None


@dataclass
class NSGAIISamplerConf:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: Optional[int] = None
    population_size: int = 50


SAMPLERS = {"tpe": TPESamplerConf, "random": RandomSamplerConf, "cmaes": CmaEsSamplerConf,
            "grid": GridSamplerConf, "nsgaii": NSGAIISamplerConf}
# hydra/sweeper/pruner=<name>: Optuna's pruners with their settings (Optuna's defaults).
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
class TfkvOptunaSweeperConf:
    _target_: str = TARGET
    _recursive_: bool = False  # sampler and pruner built once Optuna is known to be there (setup)
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}, {"pruner": "median"}])
    sampler: Any = MISSING
    pruner: Any = MISSING
    # null: the objective's (tfkv.config.objective); set, it must be the same
    direction: Optional[str] = None
    # null: journal:<hydra.sweep.dir>/optuna.journal; journal:<path> (or a path), or a database URL
    storage: Optional[str] = None
    study_name: Optional[str] = None  # null: Optuna names a new study
    n_trials: int = 20
    n_jobs: int = 2  # trials launched at once (one batch)
    # A failed trial is a result (tfkv's sweep.fail_fast ends a sweep at the first); below 1.0,
    # the sweep ends once more than this share of one batch of trials failed.
    max_failure_rate: float = 1.0
    params: Optional[Dict[str, str]] = None  # the search space: {key: sweep}, before the command line's


class TfkvOptunaSweeper(Sweeper):
    """Optuna's ask and tell around Hydra's launcher, one batch of n_jobs trials at a time."""

    def __init__(self, sampler: Any, pruner: Any, direction: Optional[str], storage: Optional[str],
                 study_name: Optional[str], n_trials: int, n_jobs: int, max_failure_rate: float,
                 params: Optional[DictConfig]) -> None:
        self.sampler, self.pruner, self.declared = sampler, pruner, direction
        self.storage, self.study_name = storage, study_name
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, max(1, n_jobs), max_failure_rate
        self.params = {} if params is None else {str(k): str(v) for k, v in params.items()}
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.job_idx = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.utils import instantiate

        from tfkv import check
        from tfkv.sweep import pruning

        pruning.check_optuna()
        self.sampler, self.pruner = instantiate(self.sampler), instantiate(self.pruner)
        self.config = config
        self.objective, self.direction = check.objective_of(config)
        if self.declared is not None and str(self.declared) != self.direction:  # the precheck said so first
            raise ConfigError(f"hydra.sweeper.direction={self.declared} but objective {self.objective} is to "
                              f"{self.direction}; leave hydra.sweeper.direction out (it follows the objective)")
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        self.storage_url = pruning.storage_url(self.storage or f"journal:{self.sweep_dir / JOURNAL}")
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> None:
        import optuna

        from tfkv.sweep import pruning
        from tfkv.sweep.trial import SweepStopped

        config = self.config
        assert config is not None, "setup() comes first"
        optuna.logging.disable_default_handler()  # Optuna's lines through Hydra's log, as ours
        optuna.logging.enable_propagation()
        distributions, fixed = search_space([f"{k}={v}" for k, v in self.params.items()] + arguments)
        sampler, n_trials = self.sampler, self.n_trials
        if getattr(sampler, "func", None) is optuna.samplers.GridSampler:  # a partial: it needs the grid
            grid = {name: _grid(name, d) for name, d in distributions.items()}
            sampler = sampler(grid)
            n_trials = min(n_trials, math.prod(len(v) for v in grid.values()))
        elif warning := too_many_trials(n_trials, distributions):  # Optuna's samplers repeat a finite space's points
            log.warning("%s", warning)

        self.sweep_dir.mkdir(parents=True, exist_ok=True)  # the study file's directory
        storage = pruning.open_storage(self.storage_url)
        self._same_direction(storage)
        study = optuna.create_study(study_name=self.study_name, storage=storage, sampler=sampler,
                                    pruner=self.pruner, direction=self.direction, load_if_exists=True)
        study.set_user_attr(pruning.PRUNER_ATTR, OmegaConf.to_container(config.hydra.sweeper.pruner, resolve=True))
        log.info("Optuna %s study %s (%s), storage %s, sampler %s, pruner %s", optuna.__version__, study.study_name,
                 self.direction, self.storage_url, type(sampler).__name__, type(self.pruner).__name__)

        left = n_trials
        while left > 0:
            trials = [study.ask(distributions) for _ in range(min(left, self.n_jobs))]
            overrides = [[*(f"{name}={value}" for name, value in {**t.params, **fixed}.items()),
                          *self._trial_overrides(study.study_name, t.number)] for t in trials]
            try:
                returns = self.launcher.launch(overrides, initial_job_idx=self.job_idx)
            except BaseException:  # Ctrl-C, a launcher's error: these trials never finish
                for t in trials:
                    _tell(study, t, optuna.trial.TrialState.FAIL, None)
                raise
            self.job_idx += len(returns)
            failed = 0
            for t, ret in zip(trials, returns):
                state, value = _outcome(ret)
                _tell(study, t, state, value)
                failed += state == optuna.trial.TrialState.FAIL
            for ret in returns:  # a task function raises only to end the sweep (fail_fast, SIGTERM)
                if ret.status == JobStatus.FAILED:
                    ret.return_value  # noqa: B018 - raises the job's exception
            if failed / len(returns) > self.max_failure_rate:
                raise SweepStopped(f"{failed} of {len(returns)} trials of a batch failed, more than "
                                   f"hydra.sweeper.max_failure_rate={self.max_failure_rate}; the sweep ends")
            left -= len(trials)
        self._write_results(study)

    def _same_direction(self, storage: Any) -> None:
        """A named study that exists already (Optuna loads it, load_if_exists) is better the way
        the objective is: else its best trial would be the worst of this sweep's, and Optuna's
        samplers would steer the search the wrong way. Refused before any trial runs."""
        import optuna

        if self.study_name is None:  # Optuna names a new study
            return
        try:
            found = optuna.load_study(study_name=self.study_name, storage=storage)
        except KeyError:  # no study of that name yet: this sweep makes it
            return
        ways = [d.name.lower() for d in found.directions]
        if ways != [self.direction]:
            raise ConfigError(f"hydra.sweeper.study_name={self.study_name}: the study in {self.storage_url} is to "
                              f"{','.join(ways)} but objective {self.objective} is to {self.direction}; name another "
                              "study, or sweep an objective (objective=, direction=) that is better the study's way")

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
            log.info("Best trial #%d: %s %s; parameters %s", best.number, self.objective, best.value,
                     best.params)
        else:
            log.warning("no trial of study %s completed: no best parameters", study.study_name)
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")


def search_space(overrides: List[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Optuna's distributions of the swept keys, and the keys set to one value, from Hydra's
    sweep syntax: a later override of a key replaces an earlier one (params, then the command line)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import IntervalSweep, RangeSweep, Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    distributions: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for o in OverridesParser.create().parse_overrides(overrides):
        key = o.get_key_element()
        distributions.pop(key, None)
        fixed.pop(key, None)
        value = o.value()
        if not o.is_sweep_override():
            fixed[key] = o.get_value_element_as_str()
        elif o.is_interval_sweep():
            assert isinstance(value, IntervalSweep)
            log_scale = "log" in (value.tags or set())
            if isinstance(value.start, int) and isinstance(value.end, int) or "int" in (value.tags or set()):
                distributions[key] = IntDistribution(int(value.start), int(value.end), log=log_scale)
            else:
                distributions[key] = FloatDistribution(float(value.start), float(value.end), log=log_scale)
        elif o.is_range_sweep() and not value.shuffle:
            assert isinstance(value, RangeSweep)
            values = list(o.sweep_iterator())
            if not values:
                raise ConfigError(f"{key}: {o.input_line} has no value; give a range with at least one")
            if all(isinstance(v, int) for v in values) and isinstance(value.step, int):
                distributions[key] = IntDistribution(values[0], values[-1], step=abs(value.step)) \
                    if value.step > 0 else CategoricalDistribution(values)
            else:  # Hydra's range leaves out its stop, as Python's does; Optuna's high is the last value
                distributions[key] = FloatDistribution(min(values), max(values), step=abs(float(value.step))) \
                    if len(values) > 1 else CategoricalDistribution(values)
        else:  # choice(...), a,b,c, a shuffled range, glob(...): their values, as Hydra writes them
            distributions[key] = CategoricalDistribution(list(o.sweep_iterator(transformer=Transformer.encode)))
    return distributions, fixed


def too_many_trials(n_trials: int, distributions: dict[str, Any]) -> str | None:
    """The warning for more trials than a finite search space has points (every key a choice or a
    stepped range), or None: a sampler other than the grid's would run some points again."""
    try:
        points = math.prod(len(_grid(name, d)) for name, d in distributions.items())
    except ConfigError:  # a continuous key: the space has no end
        return None
    if n_trials <= points:
        return None
    return (f"hydra.sweeper.n_trials={n_trials} but the search space has only {points} point(s): trials beyond "
            f"the first {points} run points again; ask for hydra.sweeper.n_trials={points}, add a continuous key "
            "(interval(...)), or use hydra/sweeper/sampler=grid to run each point once")


def _grid(name: str, distribution: Any) -> list[Any]:
    """GridSampler's values for one key: a choice's, or every value of an integer or stepped range."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    step = getattr(distribution, "step", None)
    if step is None or distribution.log:
        raise ConfigError(f"{name}: hydra/sweeper/sampler=grid needs a finite set of values, not "
                          f"{type(distribution).__name__}({distribution.low}, {distribution.high}); "
                          "use choice(...) or range(...)")
    count = int(round((distribution.high - distribution.low) / step)) + 1
    return [distribution.low + i * step for i in range(count)]


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


def _quoted(value: str) -> str:
    """`value` as one quoted Hydra override value (paths may hold spaces or quotes)."""
    return "'" + value.replace("'", "\\'") + "'"
