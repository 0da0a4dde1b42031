"""The epoch loop: data -> data- or model-parallel step -> store; metrics, progress, checkpoints.

The trainer asks the store only for what the MXNet API offers (rank, num_workers, optimizer
state), so every KVStore type, local or distributed, runs through it unchanged. `placement`
picks model parallelism (`tfkv.parallel.model_parallel`) instead of data parallelism; both
have the same interface. For language models (labels with a time axis) losses and accuracies
are per token and each epoch also reports perplexity, exp(mean token loss).
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tfkv.errors import ConfigError, OutputError

log = logging.getLogger("tfkv")


def _summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    last = history[-1]
    # The first epoch pays for tracing and warm-up; steady state is what a user plans with.
    steady = history[1:] or history
    samples = sum(h["samples"] for h in steady)
    seconds = sum(h["train_seconds"] for h in steady)
    summary = {
        "epoch": last["epoch"],
        "test_accuracy": last["test_accuracy"],
        "test_loss": last["test_loss"],
        "train_loss": last["train_loss"],
        "train_accuracy": last["train_accuracy"],
        "samples_per_sec": samples / seconds if seconds else 0.0,
        "history": history,
    }
    for key in ("train_perplexity", "test_perplexity"):
        if key in last:
            summary[key] = last[key]
    return summary


def _perplexity(mean_token_loss: float) -> float:
    return math.exp(min(mean_token_loss, 700.0))  # exp overflows a float past ~709


def train(cfg: Any, run_dir: Path, overrides: list[str], search_root: Path | None = None) -> dict[str, Any]:
    """Train as `cfg` (a validated `tfkv.config.Config`) says; return the final metrics."""
    import keras
    import tensorflow as tf
    from tqdm import tqdm

    from tfkv import checkpoint, data, models, optim, store as stores
    from tfkv.config import split_batch
    from tfkv.parallel import devices as devices_mod
    from tfkv.parallel.criterion import Criterion
    from tfkv.parallel.data_parallel import DataParallel

    run_dir = Path(run_dir)
    tf_devices = devices_mod.setup(cfg.devices)
    keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()

    store = stores.create(cfg.kvstore.type, devices=tf_devices)
    try:
        # Before any key exists; the store decides what compression means for it.
        store.set_gradient_compression({"type": cfg.kvstore.compression.type,
                                        "threshold": cfg.kvstore.compression.threshold})
        source = data.Source(cfg.dataset, cfg.seed, cfg.batch_size, cfg.eval_batch_size, store.num_workers,
                             store.rank, cfg.steps_per_epoch)
        steps = source.steps
        optimizer = optim.from_config(cfg.optimizer, steps, cfg.epochs)
        resume_from = checkpoint.find_resume(cfg.resume, run_dir, search_root or Path.cwd(), overrides)
        ckpt = checkpoint.load(resume_from) if resume_from else None

        positions = source.positions
        criterion = Criterion.from_config(cfg.loss, cfg.metrics)
        sizes = split_batch(cfg.batch_size, cfg.work_load_list, len(tf_devices))
        try:
            if cfg.placement is not None:
                dp = _model_parallel(cfg, source, tf_devices, store, optimizer, criterion,
                                     ckpt.weights if ckpt else None)
            else:
                dp = DataParallel(
                    lambda: models.build(cfg.model, input_shape=source.input_shape, input_spec=source.input_spec,
                                         num_classes=source.num_classes),
                    tf_devices, store, optimizer, sizes,
                    update_on_kvstore=cfg.kvstore.update_on_kvstore,
                    initial_weights=ckpt.weights if ckpt else None,
                    criterion=criterion,
                )
            if ckpt:
                dp.load_optimizer(ckpt.optimizer, run_dir)
        except (ValueError, KeyError) as e:
            if not ckpt:
                raise
            # resume=<dir> of a run with another model or optimizer: Keras or the updater says what differs
            raise ConfigError(f"resume: checkpoint {ckpt.path} does not fit this model and optimizer "
                              f"({str(e).splitlines()[0]}); resume a run of the same model settings, "
                              "or start afresh with resume=false") from None
        history: list[dict[str, Any]] = list(ckpt.history) if ckpt else []
        start = ckpt.epoch + 1 if ckpt else 1
        if ckpt:
            log.info("resumed from %s at epoch %d", ckpt.path, ckpt.epoch)
        chief = store.rank == 0
        if cfg.placement is not None:
            log.info("%s split over %s (batch %d in %d micro-batches), kvstore=%s, %d worker(s), "
                     "%d steps/epoch", models.name(cfg.model), ",".join(cfg.devices), cfg.batch_size,
                     cfg.micro_batches, store.type, store.num_workers, steps)
        else:
            log.info("%s on %s (batch %s per device), kvstore=%s, %d worker(s), %d steps/epoch",
                     models.name(cfg.model), ",".join(cfg.devices), sizes, store.type, store.num_workers, steps)
        writer = _written(lambda: tf.summary.create_file_writer(str(run_dir / "tensorboard")),
                          run_dir / "tensorboard") if chief else None

        for epoch in range(start, cfg.epochs + 1):
            batches = source.train(epoch)
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{cfg.epochs}", unit="step", leave=False,
                       disable=None if (cfg.progress and chief) else True, mininterval=0.5)
            # The workers start the clock together: otherwise a worker's epoch would include
            # waiting for worker 0's checkpoint and the others' evaluation (no-op alone).
            store.barrier()
            t0 = time.perf_counter()
            for i, (x, y) in enumerate(batches, 1):
                dp.step(x, y)
                if i % cfg.log_every == 0 or i == steps:
                    loss = dp.peek_loss()
                    bar.update(i - bar.n)
                    bar.set_postfix(loss=f"{loss:.4f}")
                    if writer is not None:
                        with writer.as_default():
                            tf.summary.scalar("train/step_loss", loss, step=(epoch - 1) * steps + i)
            seconds = time.perf_counter() - t0
            bar.close()
            train_loss, train_acc, seen = dp.take_metrics()
            dp.sync_non_trainable()
            test_loss, test_acc = dp.evaluate(source.test())
            # per example -> per position (token): a no-op for classification
            train_loss, train_acc, test_loss, test_acc = (
                v / positions for v in (train_loss, train_acc, test_loss, test_acc))
            # Workers of a synchronous job move in step: the job's rate is this worker's times
            # the number of workers.
            record = {
                "epoch": epoch, "train_loss": train_loss, "train_accuracy": train_acc,
                "test_loss": test_loss, "test_accuracy": test_acc,
                "samples_per_sec": seen * store.num_workers / seconds,
                "worker_samples_per_sec": seen / seconds,
                "samples": seen * store.num_workers, "train_seconds": seconds,
            }
            if positions > 1:
                record["train_perplexity"] = _perplexity(train_loss)
                record["test_perplexity"] = _perplexity(test_loss)
            history.append(record)
            log.info("epoch %d/%d  train_loss %.4f  train_acc %.4f  test_loss %.4f  test_acc %.4f  "
                     "%.0f samples/s  %.1fs", epoch, cfg.epochs, train_loss, train_acc, test_loss,
                     test_acc, record["samples_per_sec"], seconds)
            if positions > 1:
                log.info("epoch %d/%d  train_perplexity %.2f  test_perplexity %.2f  (%s split)",
                         epoch, cfg.epochs, record["train_perplexity"], record["test_perplexity"],
                         cfg.dataset.get("eval_split", "test"))
            if chief:
                with writer.as_default():
                    for name in ("train_loss", "train_accuracy", "test_loss", "test_accuracy",
                                 "samples_per_sec", "train_perplexity", "test_perplexity"):
                        if name in record:
                            tf.summary.scalar(f"epoch/{name}", record[name], step=epoch)
                _written(writer.flush, run_dir / "tensorboard")
                checkpoint.save(run_dir, epoch, dp.get_weights(), dp.weight_names(),
                                dp.save_optimizer, history)
                _write_metrics(run_dir, _summary(history))
        if not history:
            raise RuntimeError(f"nothing to train: epochs={cfg.epochs} and the checkpoint is at "
                               f"epoch {start - 1}")
        final = _summary(history)
        if chief:
            _write_metrics(run_dir, final)
        store.barrier()
    except BaseException as e:
        store.abort(f"{type(e).__name__}: {e}")
        raise
    store.close()
    return final


def _model_parallel(cfg: Any, source: Any, tf_devices: list[str], store: Any, optimizer: Any,
                    criterion: Any, initial_weights: Any) -> Any:
    """The model's layer groups on the devices `cfg.placement` names, the plan logged."""
    from tfkv import models
    from tfkv.parallel import placement
    from tfkv.parallel.model_parallel import ModelParallel

    groups = models.build_groups(cfg.model, source.input_shape, source.num_classes)
    specs = placement.assign(cfg.placement, groups, list(cfg.devices), models.name(cfg.model))
    mode = "placement=auto" if placement.is_auto(cfg.placement) else "placement from config"
    log.info("%s", placement.format_plan(placement.stages(groups, specs),
                                         f"model-parallel plan ({mode}, {cfg.micro_batches} micro-batches)"))
    by_spec = {placement.canonical(d): t for d, t in zip(cfg.devices, tf_devices)}
    return ModelParallel(groups, [by_spec[s] for s in specs], store, optimizer, cfg.batch_size,
                         micro_batches=cfg.micro_batches, update_on_kvstore=cfg.kvstore.update_on_kvstore,
                         initial_weights=initial_weights, criterion=criterion)


def _written(write: Callable[[], Any], where: Path) -> Any:
    """`write()`'s result; TensorFlow's or the system's failure to write `where` (a full disk) as
    the one-line OutputError, not a traceback from inside TensorFlow."""
    import tensorflow as tf

    try:
        return write()
    except OSError as e:
        reason = e.strerror or str(e)
    except tf.errors.OpError as e:
        # "{{function_node ...}} PATH; No space left on device\n\tFailed to flush ...": the reason
        reason = e.message.splitlines()[0].rsplit("; ", 1)[-1]
    raise OutputError(f"cannot write {where} ({reason}); free space there or choose another hydra.run.dir")


def _write_metrics(run_dir: Path, metrics: dict[str, Any]) -> None:
    tmp = run_dir / ".metrics.json.tmp"

    def write() -> None:
        try:
            tmp.write_text(json.dumps(metrics, indent=1))
            tmp.replace(run_dir / "metrics.json")
        finally:
            tmp.unlink(missing_ok=True)

    _written(write, run_dir / "metrics.json")
