"""What a run reports as it trains, beyond metrics.json: the hooks the trainer calls, and the
trackers among them (TensorBoard, MLflow) that worker 0 builds from its config.

A `Hook` has Keras' callback shape: `epoch_begin`, `step` after every step, `epoch` after every
epoch's record (trackers: once it is written), `end` once the model is exported, and `close`
always, with the exception that ended the run, if any. A hook may stop the run from `step` or
`epoch` by raising (a checkpoint's preemption, `tfkv.errors.TrialPruned`). Each tracker module
has `build(cfg, run_dir) -> Hook | None` (None: not wanted by this config) and is listed in
BUILDERS. The entry layer passes the builders of its own trackers in (`for_run`'s `more`: a
sweep's pruner, tfkv.sweep.pruning), so that this layer names nothing above it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence

# module:function of every tracker builder of this package, in the order they are called
BUILDERS = (
    "tfkv.tracking.tensorboard:build",  # scalars and the HParams session (always)
    "tfkv.tracking.mlflow_log:build",  # logger=mlflow
)


# What an epoch's record has besides its train_*/test_* values that is worth a curve.
CURVE_EXTRAS = ("samples_per_sec", "lr")


def metric_keys(record: dict[str, Any]) -> list[str]:
    """The train_<name> / test_<name> values of an epoch's record (not its bookkeeping)."""
    return [k for k in record if k.startswith(("train_", "test_")) and k != "train_seconds"]


def curves(record: dict[str, Any]) -> list[str]:
    """The values of an epoch's record that go to TensorBoard and MLflow as curves over epochs."""
    return [*metric_keys(record), *(k for k in CURVE_EXTRAS if k in record)]


class StepEnd(NamedTuple):
    """Where a run is after one step, and its running values when they are looked at."""

    epoch: int
    step: int  # of the epoch, from 1
    global_step: int  # of the run, from 1
    # every `log_every` steps and at the epoch's last (None between): the epoch's running values so
    # far (`loss`, each metric) and its samples per second since the epoch's clock started
    running: dict[str, float] | None
    samples_per_sec: float


class Hook:
    """What the trainer calls as the run goes; each method does nothing until a hook overrides it."""

    def epoch_begin(self, epoch: int) -> None:
        """Before epoch `epoch`'s first step."""

    def step(self, end: StepEnd) -> None:
        """After every step."""

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        """After epoch `epoch`: its record (train_*, test_*, samples_per_sec, lr, ...)."""

    def end(self, final: dict[str, Any], run_dir: Path) -> None:
        """The run's final metrics, once model.keras is in `run_dir`."""

    def close(self, error: BaseException | None) -> None:
        """Always last; `error` ended the run early (None: it finished)."""


#: a tracker's builder: (cfg, run_dir) -> its hook, or None where the config does not want it
Builder = Callable[[Any, Path], Optional[Hook]]


class Hooks(Hook):
    """Several hooks as one, each called in turn in the order given."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = list(hooks)

    def epoch_begin(self, epoch: int) -> None:
        for hook in self.hooks:
            hook.epoch_begin(epoch)

    def step(self, end: StepEnd) -> None:
        for hook in self.hooks:
            hook.step(end)

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        for hook in self.hooks:
            hook.epoch(epoch, record)

    def end(self, final: dict[str, Any], run_dir: Path) -> None:
        for hook in self.hooks:
            hook.end(final, run_dir)

    def close(self, error: BaseException | None) -> None:
        close(self.hooks, error)


def for_run(cfg: Any, run_dir: Path, more: Sequence[Builder] = ()) -> list[Hook]:
    """The trackers this run's config asks for: BUILDERS', then those of `more` (the entry
    layer's, e.g. a sweep's pruner), in that order. When one cannot be built (an MLflow store that
    refuses), those already built are closed with that error before it is raised, so that their
    runs end failed instead of staying open."""
    trackers: list[Hook] = []
    try:
        for build in [*map(_builder, BUILDERS), *more]:
            tracker = build(cfg, Path(run_dir))
            if tracker is not None:
                trackers.append(tracker)
    except BaseException as e:
        close(trackers, e)
        raise
    return trackers


def _builder(spec: str) -> Builder:
    module, fn = spec.split(":")
    return getattr(importlib.import_module(module), fn)


def close(hooks: list[Hook], error: BaseException | None) -> None:
    """Every hook's last call: how the run ended (`error`, or None when it finished)."""
    for hook in hooks:
        hook.close(error)
