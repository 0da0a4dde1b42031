"""Training a run: its parts built (tfkv.trainer.parts), the loop over its epochs
(tfkv.trainer.loop) with worker 0's hooks on it (tfkv.trainer.hooks, tfkv.tracking), then the
trained model exported; and the run's objective, which a sweeper optimises.

Every value the criterion reports goes to the progress line, TensorBoard and metrics.json as
`train_<name>` / `test_<name>`. Worker 0 checkpoints at every epoch's end and where
`checkpoint.every_steps`/`every_minutes` say (tfkv.checkpoint), and on a preemption at the end of
a step, then stops resumable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from tfkv.errors import ConfigError

log = logging.getLogger("tfkv")


def train(cfg: Any, run_dir: Path, overrides: list[str], search_root: Path | None = None, *,
          knobs: Mapping[str, Any] | None = None, trackers: Sequence[Callable[[Any, Path], Any]] = ()) -> dict[str, Any]:
    """Train as `cfg` (a validated `tfkv.config.Config`) says; return the final metrics.
    `knobs`: the run's resolved knob values by config key (tfkv.knobs.resolve), handed to its store
    (None: the store reads this process's environment). `trackers`: the entry layer's tracker
    builders (tfkv.tracking.Builder, e.g. a sweep's pruner), built on worker 0 after tfkv.tracking's own."""
    from tfkv.tfimport import import_tensorflow

    import_tensorflow()  # first, before keras imports it: without TF's load-time log lines
    import keras

    from tfkv.parallel import precision

    # The models of this run are built under its precision; the process's policy is put back
    # after it (a sweep's next trial, or a test, builds under its own).
    before = keras.mixed_precision.global_policy().name
    precision.set_policy(cfg.precision)
    try:
        return _train(cfg, run_dir, overrides, search_root, knobs, trackers)
    finally:
        precision.set_policy(before)


def _train(cfg: Any, run_dir: Path, overrides: list[str], search_root: Path | None, knobs: Mapping[str, Any] | None,
           trackers: Sequence[Callable[[Any, Path], Any]]) -> dict[str, Any]:
    from tfkv import checkpoint, export
    from tfkv.tracking import Hooks
    from tfkv.trainer import hooks as chief_hooks, loop, parts

    run_dir = Path(run_dir)
    tf_devices = parts.devices(cfg)
    kvstore = parts.store(cfg, tf_devices, knobs)
    # SIGUSR1 (a batch system's warning) or SIGTERM (its stop) to any process of the job: worker 0
    # checkpoints at the end of a step and stops the job, resumable (tfkv.checkpoint.preemption);
    # not SIGTERM in a trial of a sweep.
    preemption = checkpoint.Preemption(run_dir, terminate=checkpoint.takes_sigterm())
    run: parts.Run | None = None
    hooks = Hooks([])
    try:
        run = parts.build(cfg, run_dir, kvstore, tf_devices, overrides, search_root or Path.cwd())
        if cfg.eval_only:
            final = export.evaluate(cfg, run.source, run.parallel, run.ckpt, run_dir)
            kvstore.close()
            return final
        hooks = Hooks(chief_hooks.for_chief(run, preemption, trackers))
        final = loop.fit(run, hooks)
        weights = _trained_weights(run) if run.chief else None
    except BaseException as e:
        if run is not None:
            run.saver.close()  # what the run saved last still lands, when it can
        kvstore.abort(f"{type(e).__name__}: {e}")
        hooks.close(e)
        raise
    finally:
        preemption.restore()
    kvstore.close()
    try:
        if run.chief:  # the trained model (model.keras, saved_model/), once no worker waits for this one
            export.write(cfg, run.source, weights, run_dir)
        hooks.end(final, run_dir)
    except BaseException as e:
        hooks.close(e)
        raise
    hooks.close(None)
    return final


def _trained_weights(run: Any) -> list[Any]:
    """The trained weights, taken while the store is open. A model with row-sparse tables takes
    them from the checkpoint of its last epoch (memory-mapped: its tables were written there by
    rows), so that no table is ever whole on worker 0."""
    from tfkv import checkpoint

    run.saver.wait()
    last = run.saver.last or (run.ckpt.path if run.ckpt else None)  # no epoch left to train: the resumed one
    if getattr(run.parallel, "sparse", None) is None or last is None:
        return run.parallel.get_weights()
    return checkpoint.load(last).weights


def objective(cfg: Any, final: dict[str, Any], run_dir: Path) -> float:
    """The run's `objective` (what a sweeper optimises), logged with where the run's files are."""
    if cfg.objective not in final:
        reported = ", ".join(k for k, v in final.items() if isinstance(v, (int, float)) and k != "epoch")
        raise ConfigError(f"objective={cfg.objective} is not a metric of this run; it reports {reported}: "
                          "choose one of those, e.g. objective=test_loss")
    value = float(final[cfg.objective])
    log.info("done: %s %.4f after %d epochs; run directory %s", cfg.objective, value, final.get("epoch", 0), run_dir)
    return value
