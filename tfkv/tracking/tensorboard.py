"""TensorBoard: a run's scalars in its `tensorboard/` (the running values every `log_every` steps as
train/step_<name>, each epoch's record as epoch/<name>), and the run as one session of the HParams
dashboard, so `tensorboard --logdir <sweep dir>` shows a sweep's trials as a table and a
parallel-coordinates plot.

The session is written through the scalars' writer: its hyper-parameters are a few that every run
has (optimizer, optimizer.lr, batch_size, kvstore, model, dataset, epochs) and the job's overrides
(what a sweep varies, as typed); its metrics are the scalars written there (epoch/test_accuracy,
epoch/lr, ...), which the HParams plug-in finds by itself. No experiment summary is written: a
trial knows only its own values, and from the sessions it reads the plug-in builds every column
and its range for the whole sweep. When the run ends, the session gets its status (success,
failure; unknown for a pruned or interrupted run, which TensorBoard has no status for).
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path
from typing import Any

import tensorflow as tf
from omegaconf import OmegaConf
from tensorboard.plugins.hparams import api as hp
from tensorboard.plugins.hparams import api_pb2, summary as hparams_summary

from tfkv.errors import TrialPruned
from tfkv.export import written
from tfkv.tracking import Hook, StepEnd, curves, hydra_job

log = logging.getLogger("tfkv")

# TensorBoard follows only the newest event file of a run directory (without --reload_multifile),
# so a second writer's file would hide the first's later scalars: one writer per directory.
_WRITERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

Value = bool | int | float | str


def writer(run_dir: Path) -> Any:
    """The summary writer of `run_dir`/tensorboard, shared by everything in this process that
    writes there while someone holds it."""
    logdir = str(Path(run_dir).resolve() / "tensorboard")
    found = _WRITERS.get(logdir)
    if found is None:
        found = _WRITERS[logdir] = tf.summary.create_file_writer(logdir)
    return found


def hparams(cfg: Any, overrides: list[str]) -> dict[str, Value]:
    """The run's hyper-parameters: the standard ones, then each override's key with the value
    the config has there (typed), or the override's text for a group choice (`optimizer=adam`)."""
    values: dict[str, Value] = {
        "optimizer": str(cfg.optimizer.name), "optimizer.lr": float(cfg.optimizer.lr),
        "batch_size": int(cfg.batch_size), "kvstore": str(cfg.kvstore.type), "model": _target(cfg.model),
        "dataset": _target(cfg.dataset), "epochs": int(cfg.epochs),
    }
    for override in overrides:
        parts = hydra_job.split(override)
        if parts is None:
            continue
        key, text = parts
        value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
        values[key] = value if isinstance(value, (bool, int, float, str)) else text
    return values


def _target(node: Any) -> str:
    """What builds a model or data set: its _target_, or the saved model's path."""
    return str(node.get("_target_") or node.get("path") or "?")


class TensorBoard(Hook):
    """One run's scalars, and the run as a session of the HParams dashboard."""

    def __init__(self, cfg: Any, run_dir: Path):
        self.logdir = Path(run_dir) / "tensorboard"
        self.writer = written(lambda: writer(run_dir), self.logdir)
        with self.writer.as_default():
            # flushed with the first epoch; a failed run's close() flushes it
            hp.hparams(hparams(cfg, hydra_job.overrides(run_dir)))

    def step(self, end: StepEnd) -> None:
        if end.running is None:
            return
        with self.writer.as_default():
            for name, value in end.running.items():
                tf.summary.scalar(f"train/step_{name}", value, step=end.global_step)

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        """The epoch's scalars, which are also the session's metrics."""
        with self.writer.as_default():
            for name in curves(record):
                tf.summary.scalar(f"epoch/{name}", record[name], step=epoch)
        written(self.writer.flush, self.logdir)

    def close(self, error: BaseException | None) -> None:
        if error is None:
            status = api_pb2.STATUS_SUCCESS
        elif isinstance(error, (TrialPruned, KeyboardInterrupt)):
            status = api_pb2.STATUS_UNKNOWN
        else:
            status = api_pb2.STATUS_FAILURE
        try:
            with self.writer.as_default():
                tf.summary.experimental.write_raw_pb(hparams_summary.session_end_pb(status).SerializeToString(),
                                                     step=0)
            self.writer.flush()
        except (OSError, tf.errors.OpError) as e:  # a full disk: the run's own outcome stands
            log.warning("TensorBoard: could not record how the run ended (%s)", str(e).splitlines()[0])


def build(cfg: Any, run_dir: Path) -> TensorBoard:
    return TensorBoard(cfg, run_dir)
