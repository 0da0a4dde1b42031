"""What a run reports as it trains, beyond metrics.json: trackers the trainer calls on worker 0.

Each tracker module has `build(cfg, run_dir) -> Tracker | None` (None: not wanted by this
config) and is listed in BUILDERS. The trainer calls `epoch` after every epoch's record is
written, `end` once the model is exported, and `close` always, with the exception that ended
the run, if any. A tracker may stop the run from `epoch` by raising `tfkv.errors.TrialPruned`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol

# module:function of every tracker builder, in the order they are called
BUILDERS = (
    "tfkv.tracking.tensorboard:build",  # HParams summaries, learning rate (always)
    "tfkv.tracking.mlflow_log:build",  # logger=mlflow
    "tfkv.sweep.pruning:build",  # a trial of the tfkv_optuna sweeper: per-epoch values to its pruner
)


# What an epoch's record has besides its train_*/test_* values that is worth a curve.
CURVE_EXTRAS = ("samples_per_sec", "lr")


def metric_keys(record: dict[str, Any]) -> list[str]:
    """The train_<name> / test_<name> values of an epoch's record (not its bookkeeping)."""
    return [k for k in record if k.startswith(("train_", "test_")) and k != "train_seconds"]


def curves(record: dict[str, Any]) -> list[str]:
    """The values of an epoch's record that go to TensorBoard and MLflow as curves over epochs."""
    return [*metric_keys(record), *(k for k in CURVE_EXTRAS if k in record)]


class Tracker(Protocol):
    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        """After epoch `epoch`: its record (train_*, test_*, samples_per_sec, lr, ...)."""

    def end(self, final: dict[str, Any], run_dir: Path) -> None:
        """The run's final metrics, once model.keras is in `run_dir`."""

    def close(self, error: BaseException | None) -> None:
        """Always last; `error` ended the run early (None: it finished)."""


def for_run(cfg: Any, run_dir: Path) -> list[Tracker]:
    """The trackers this run's config asks for. When one cannot be built (an MLflow store that
    refuses), those already built are closed with that error before it is raised, so that their
    runs end failed instead of staying open."""
    trackers: list[Tracker] = []
    try:
        for spec in BUILDERS:
            module, fn = spec.split(":")
            tracker = getattr(importlib.import_module(module), fn)(cfg, Path(run_dir))
            if tracker is not None:
                trackers.append(tracker)
    except BaseException as e:
        close(trackers, e)
        raise
    return trackers


def close(trackers: list[Tracker], error: BaseException | None) -> None:
    """Every tracker's last call: how the run ended (`error`, or None when it finished)."""
    for tracker in trackers:
        tracker.close(error)
