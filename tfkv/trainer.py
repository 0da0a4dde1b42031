"""The epoch loop: data -> data- or model-parallel step -> store; metrics, progress, checkpoints.

The trainer asks the store only for what the MXNet API offers (rank, num_workers, optimizer
state), so every KVStore type, local or distributed, runs through it unchanged. `placement`
picks model parallelism (`tfkv.parallel.model_parallel`) instead of data parallelism; both
have the same interface. Every value the criterion reports (`loss`, each metric, per-output
losses, `perplexity` for sequence labels with a crossentropy loss: see `tfkv.parallel.metrics`)
goes to the progress line, TensorBoard and metrics.json as `train_<name>` / `test_<name>`; the
test values are of the whole test split, each worker of a job evaluating its part of it.
A training loss that is NaN or infinite fails its step inside the graph (tfkv.parallel.metrics)
and ends the run in one line naming the epoch and step (Diverged), the last finite checkpoint kept.
Worker 0 checkpoints at every epoch's end and where `checkpoint.every_steps`/`every_minutes` say
(tfkv.checkpoint); a run resumed from the middle of an epoch skips that epoch's batches already
taken, so it sees the batches, dropout masks and updates an uninterrupted run would have.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from tfkv.errors import ConfigError, Diverged, Preempted
from tfkv.export import write_metrics, written
from tfkv.tracking import metric_keys

log = logging.getLogger("tfkv")


def _summary(history: list[dict[str, Any]], resumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    last = history[-1]
    # The first epoch pays for tracing and warm-up; steady state is what a user plans with.
    steady = history[1:] or history
    samples = sum(h["samples"] for h in steady)
    seconds = sum(h["train_seconds"] for h in steady)
    return {
        "epoch": last["epoch"],
        **{k: last[k] for k in metric_keys(last)},
        "samples_per_sec": samples / seconds if seconds else 0.0,
        "history": history,
        **({"resumes": resumes} if resumes else {}),
    }


def train(cfg: Any, run_dir: Path, overrides: list[str], search_root: Path | None = None) -> dict[str, Any]:
    """Train as `cfg` (a validated `tfkv.config.Config`) says; return the final metrics."""
    from tfkv.tfimport import import_tensorflow

    import_tensorflow()  # first, before keras imports it: without TF's load-time log lines
    import keras

    from tfkv.parallel import precision

    # The models of this run are built under its precision; the process's policy is put back
    # after it (a sweep's next trial, or a test, builds under its own).
    before = keras.mixed_precision.global_policy().name
    precision.set_policy(cfg.precision)
    try:
        return _train(cfg, run_dir, overrides, search_root)
    finally:
        precision.set_policy(before)


def _train(cfg: Any, run_dir: Path, overrides: list[str], search_root: Path | None) -> dict[str, Any]:
    from tfkv.tfimport import import_tensorflow

    tf = import_tensorflow()
    import keras
    from omegaconf import OmegaConf
    from tqdm import tqdm

    from tfkv import checkpoint, data, export, models, optim, store as stores, tracking
    from tfkv.config import split_batch
    from tfkv.parallel import devices as devices_mod
    from tfkv.parallel.criterion import Criterion
    from tfkv.parallel.data_parallel import DataParallel
    from tfkv.parallel.metrics import nonfinite
    from tfkv.parallel.precision import LossScale, check_devices, gpu_capabilities
    from tfkv.ps import compression
    from tfkv.tracking.tensorboard import writer as summary_writer

    run_dir = Path(run_dir)
    tf_devices = devices_mod.setup(cfg.devices)
    check_devices(cfg.precision, gpu_capabilities(cfg.devices, tf_devices))
    keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()

    # eval_only of a dist_* config runs here alone, with no job: it pushes nothing (device: a
    # store of this process that takes the job's compression settings)
    store = stores.create("device" if cfg.eval_only and stores.capabilities(cfg.kvstore.type).distributed else cfg.kvstore.type,
                          devices=tf_devices)
    trackers: list[Any] = []
    saver: Any = None  # checkpoint.Writer, once training starts
    # SIGUSR1 (a batch system's warning) or SIGTERM (its stop) to any process of the job: worker 0
    # checkpoints at the end of a step and stops the job, resumable (tfkv.checkpoint.preemption);
    # not SIGTERM in a trial of a sweep.
    preemption = checkpoint.Preemption(run_dir, terminate=checkpoint.takes_sigterm())
    try:
        # Before any key exists; the store decides what compression means for it. The config's
        # names are not the API's (its 2bit is the API's 2bit_momentum: tfkv.ps.compression.KINDS).
        compressing = compression.from_config(cfg.kvstore.compression.type, cfg.kvstore.compression.threshold)
        store.set_gradient_compression(compressing.params() if compressing else None)
        source = data.Source(cfg.dataset, cfg.seed, cfg.batch_size, cfg.eval_batch_size, store.num_workers,
                             store.rank, cfg.steps_per_epoch)
        steps = source.steps
        optimizer = optim.from_config(cfg.optimizer, steps, cfg.epochs)
        lr_at = _lr_schedule(optimizer, store)
        resume_from = checkpoint.find_resume(cfg.resume, run_dir, search_root or Path.cwd(), overrides)
        config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
        if resume_from:  # before anything is built: the first setting that differs, in one line
            checkpoint.check_fits(resume_from, OmegaConf.to_container(cfg, resolve=True))
        ckpt = checkpoint.load(resume_from) if resume_from else None

        criterion = Criterion.from_config(cfg.loss, cfg.metrics)
        sizes = split_batch(cfg.batch_size, cfg.work_load_list, len(tf_devices))
        try:
            if cfg.placement is not None:
                dp = _model_parallel(cfg, source, tf_devices, store, optimizer, criterion,
                                     ckpt.weights if ckpt else None)
            else:
                dp = DataParallel(
                    lambda: models.build(cfg.model, input_shape=source.input_shape, input_spec=source.input_spec,
                                         num_classes=source.outputs),
                    tf_devices, store, optimizer, sizes,
                    update_on_kvstore=cfg.kvstore.update_on_kvstore,
                    initial_weights=ckpt.weights if ckpt else None,
                    criterion=criterion,
                    loss_scale=LossScale() if cfg.precision == "mixed_float16" else None,
                    clipnorm=cfg.optimizer.clipnorm, jit_compile=cfg.jit_compile,
                )
            if ckpt and not cfg.eval_only:  # evaluation needs no optimizer state (a dist_* one fits no other store)
                dp.load_optimizer(ckpt.optimizer, run_dir)
                _set_rng(dp, ckpt.rng)
        except (ValueError, KeyError) as e:
            if not ckpt:
                raise
            # resume=<dir> of a run with another model or optimizer: Keras or the updater says what differs
            raise ConfigError(f"resume: checkpoint {ckpt.path} does not fit this model and optimizer "
                              f"({str(e).splitlines()[0]}); resume a run of the same model settings, "
                              "or start afresh with resume=false") from None
        if cfg.eval_only:
            final = export.evaluate(cfg, source, dp, ckpt, run_dir)
            store.close()
            return final
        history: list[dict[str, Any]] = list(ckpt.history) if ckpt else []
        resumes: list[dict[str, Any]] = list(ckpt.resumes) if ckpt else []
        start, skip = (ckpt.epoch + 1, ckpt.step) if ckpt else (1, 0)
        if ckpt:
            resumes.append({"from": str(ckpt.path), "epoch": ckpt.epoch, "step": ckpt.step,
                            "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
            log.info("resumed from %s at epoch %d%s (resume %d of this run)", ckpt.path, ckpt.epoch,
                     f", step {ckpt.step} of epoch {ckpt.epoch + 1}" if ckpt.step else "", len(resumes))
        chief = store.rank == 0
        if chief:
            preemption.clear()
        policy = checkpoint.Policy.from_config(cfg.checkpoint)

        saver = checkpoint.Writer()  # published in the background: training does not wait for the fsyncs

        def save(epoch: int, step: int = 0, background: bool = True) -> None:
            saver.save(run_dir, epoch, dp.get_weights(), dp.weight_names(), dp.save_optimizer, history,
                       step=step, rng=_rng_state(dp), config=config_yaml, resumes=resumes,
                       keep_last=cfg.checkpoint.keep_last, background=background)
            policy.saved()
        if cfg.placement is not None:
            log.info("%s split over %s (batch %d in %d micro-batches), kvstore=%s, %d worker(s), "
                     "%d steps/epoch", models.name(cfg.model), ",".join(cfg.devices), cfg.batch_size,
                     cfg.micro_batches, store.type, store.num_workers, steps)
        else:
            log.info("%s on %s (batch %s per device), kvstore=%s, %d worker(s), %d steps/epoch",
                     models.name(cfg.model), ",".join(cfg.devices), sizes, store.type, store.num_workers, steps)
        # one writer per run directory, shared with the HParams tracker (tfkv.tracking.tensorboard)
        writer = written(lambda: summary_writer(run_dir), run_dir / "tensorboard") if chief else None
        trackers = tracking.for_run(cfg, run_dir) if chief else []

        for epoch in range(start, cfg.epochs + 1):
            batches = source.train(epoch)
            first = skip if epoch == start else 0  # a mid-epoch checkpoint: its steps are done
            if first:  # the epoch's order is a function of (seed, epoch): the same batches follow
                batches = batches.skip(first)
            bar = tqdm(total=steps, desc=f"epoch {epoch}/{cfg.epochs}", unit="step", leave=False,
                       disable=None if (cfg.progress and chief) else True, mininterval=0.5)
            # The workers start the clock together: otherwise a worker's epoch would include
            # waiting for worker 0's checkpoint and the others' evaluation (no-op alone).
            store.barrier()
            t0 = time.perf_counter()
            for i, (x, y) in enumerate(batches, first + 1):
                try:
                    dp.step(x, y)
                except tf.errors.InvalidArgumentError as e:  # before anything saves or evaluates the weights
                    if not nonfinite(e):
                        raise
                    raise _diverged(epoch, i, steps, store.rank, run_dir, saver) from None
                if chief and i < steps:  # mid-epoch (the epoch's end has its own checkpoint below)
                    stop = preemption.requested
                    if stop or policy.due((epoch - 1) * steps + i):
                        save(epoch - 1, i, background=not stop)  # a preempted job ends on a durable one
                    if stop:
                        raise _preempted(preemption, run_dir, store.distributed)
                if i % cfg.log_every == 0 or i == steps:
                    running = dp.peek_metrics()
                    bar.update(i - bar.n)
                    rate = (i - first) * cfg.batch_size * store.num_workers / (time.perf_counter() - t0)
                    bar.set_postfix({**{k: f"{v:.4f}" for k, v in running.items()},
                                     "lr": f"{lr_at((epoch - 1) * steps + i):.3g}", "samples/s": f"{rate:.0f}"})
                    if writer is not None:
                        with writer.as_default():
                            for name, value in running.items():
                                tf.summary.scalar(f"train/step_{name}", value, step=(epoch - 1) * steps + i)
            seconds = time.perf_counter() - t0
            bar.close()
            train, seen = dp.take_metrics()
            # BatchNorm statistics: this worker's copies averaged; worker 0's are evaluated and saved.
            dp.sync_non_trainable()
            # Each worker evaluates its part of the test split; the parts' tallies are summed.
            t_eval = time.perf_counter()
            test = dp.evaluate_split(source.test)
            eval_seconds = time.perf_counter() - t_eval
            # Workers of a synchronous job move in step: the job's rate is this worker's times
            # the number of workers.
            record = {
                "epoch": epoch,
                **{f"train_{k}": v for k, v in train.items()},
                **{f"test_{k}": v for k, v in test.items()},
                "samples_per_sec": seen * store.num_workers / seconds,
                "worker_samples_per_sec": seen / seconds,
                "samples": seen * store.num_workers, "train_seconds": seconds,
                "lr": lr_at(epoch * steps),  # of the epoch's last update
                # the test split's examples, and how many of them this worker evaluated
                "evaluated_examples": dp.evaluated[1], "worker_evaluated_examples": dp.evaluated[0],
                "eval_seconds": eval_seconds,  # this worker's, the parts' sum included
            }
            if first:  # the training values are of the steps after the checkpoint
                record["resumed_at_step"] = first
            history.append(record)
            log.info("epoch %d/%d  %s  %.0f samples/s  %.1fs", epoch, cfg.epochs,
                     "  ".join(f"{k} {record[k]:.4f}" for k in metric_keys(record)),
                     record["samples_per_sec"], seconds)
            if chief:
                with writer.as_default():
                    for name in tracking.curves(record):
                        tf.summary.scalar(f"epoch/{name}", record[name], step=epoch)
                written(writer.flush, run_dir / "tensorboard")
                save(epoch)
                write_metrics(run_dir, _summary(history, resumes))
            for tracker in trackers:  # after the record is on disk: a pruned trial keeps its epochs
                tracker.epoch(epoch, record)
            if chief and preemption.requested and epoch < cfg.epochs:
                saver.wait()
                raise _preempted(preemption, run_dir, store.distributed)
        if not history:
            raise RuntimeError(f"nothing to train: epochs={cfg.epochs} and the checkpoint is at "
                               f"epoch {start - 1}")
        final = _summary(history, resumes)
        if chief:
            saver.wait()
            write_metrics(run_dir, final)
        store.barrier()
    except BaseException as e:
        if saver is not None:
            saver.close()  # what the run saved last still lands, when it can
        store.abort(f"{type(e).__name__}: {e}")
        tracking.close(trackers, e)
        raise
    finally:
        preemption.restore()
    store.close()
    try:
        if chief:  # the trained model (model.keras, saved_model/), once no worker waits for this one
            export.write(cfg, source, dp.get_weights(), run_dir)
        for tracker in trackers:
            tracker.end(final, run_dir)
    except BaseException as e:
        tracking.close(trackers, e)
        raise
    tracking.close(trackers, None)
    return final


def objective(cfg: Any, final: dict[str, Any], run_dir: Path) -> float:
    """The run's `objective` (what a sweeper optimises), logged with where the run's files are."""
    if cfg.objective not in final:
        reported = ", ".join(k for k, v in final.items() if isinstance(v, (int, float)) and k != "epoch")
        raise ConfigError(f"objective={cfg.objective} is not a metric of this run; it reports {reported}: "
                          "choose one of those, e.g. objective=test_loss")
    value = float(final[cfg.objective])
    log.info("done: %s %.4f after %d epochs; run directory %s", cfg.objective, value, final.get("epoch", 0), run_dir)
    return value


def _lr_schedule(optimizer: Any, store: Any) -> Callable[[int], float]:
    """The learning rate of this worker's `step`-th update (from 1) as the schedule gives it: what
    MXNet reports as the optimizer's learning_rate (Adam's bias correction is not in it). A key's
    update count is the job's: one per step where updates are summed or local, one per push of
    every worker with dist_async (counted as if the workers kept pace)."""
    from tfkv import optim

    per_step = 1 if store.sync else store.num_workers
    return lambda step: float(optimizer.schedule(np.float32((step - 1) * per_step), optim.NumpyOps))


def _preempted(preemption: Any, run_dir: Path, launched: bool) -> Preempted:
    """Worker 0's stop after its checkpoint: one line, also for the launcher of a `launched` job."""
    from tfkv import checkpoint

    newest = checkpoint.latest(run_dir)
    line = (f"preempted ({preemption.name}): checkpoint {newest.name if newest else '?'} is in {run_dir}; "
            "the same command with resume=auto (or resume=<that directory>) continues it")
    preemption.stopped(line if launched else None)
    return Preempted(line)


def _diverged(epoch: int, step: int, steps: int, rank: int, run_dir: Path, saver: Any) -> Diverged:
    """The one line for a training loss that became NaN or infinite at (epoch, step); the
    checkpoints saved before it (all finite: this is checked at every step) stay."""
    from tfkv import checkpoint

    saver.close()  # the last checkpoint may still be landing in the background
    newest = checkpoint.latest(run_dir)
    kept = (f"the last finite checkpoint, {newest.name}, is kept in {run_dir}" if newest is not None
            else "no checkpoint was saved before it")
    return Diverged(f"training diverged: the loss became NaN or infinite at epoch {epoch}, step {step} of {steps} "
                    f"(worker {rank}); lower optimizer.lr, normalise the inputs, or set optimizer.clipnorm; {kept}")


def _random_generators(dp: Any) -> list[Any]:
    """The models' random-generator states (Keras SeedGenerators: dropout's masks), every copy's,
    then the step's own state (mixed_float16's loss scale), which a checkpoint keeps with them."""
    models = getattr(dp, "replicas", None) or getattr(dp, "models", [])
    step_state = dp.step_state() if hasattr(dp, "step_state") else []
    return [v for m in models for v in m.variables if v.path.endswith("seed_generator_state")] + step_state


def _rng_state(dp: Any) -> dict[str, np.ndarray]:
    return {f"{i:04d}": np.asarray(v.numpy()) for i, v in enumerate(_random_generators(dp))}


def _set_rng(dp: Any, saved: dict[str, np.ndarray]) -> None:
    """Put the saved generator states back; a checkpoint from before they were saved keeps the
    fresh ones (its masks after resume differ from an uninterrupted run's)."""
    variables = _random_generators(dp)
    if len(saved) != len(variables):
        if saved or variables:
            log.warning("resume: the checkpoint holds %d random-generator states for %d here; "
                        "the random draws (dropout) start afresh", len(saved), len(variables))
        return
    for i, v in enumerate(variables):
        v.assign(saved[f"{i:04d}"])


def _model_parallel(cfg: Any, source: Any, tf_devices: list[str], store: Any, optimizer: Any,
                    criterion: Any, initial_weights: Any) -> Any:
    """The model's layer groups on the devices `cfg.placement` names, the plan logged."""
    from tfkv import models
    from tfkv.parallel import placement
    from tfkv.parallel.model_parallel import ModelParallel

    groups = models.build_groups(cfg.model, source.input_shape, source.outputs)
    specs = placement.assign(cfg.placement, groups, list(cfg.devices), models.name(cfg.model))
    mode = "placement=auto" if placement.is_auto(cfg.placement) else "placement from config"
    log.info("%s", placement.format_plan(placement.stages(groups, specs),
                                         f"model-parallel plan ({mode}, {cfg.micro_batches} micro-batches)"))
    by_spec = {placement.canonical(d): t for d, t in zip(cfg.devices, tf_devices)}
    return ModelParallel(groups, [by_spec[s] for s in specs], store, optimizer, cfg.batch_size,
                         micro_batches=cfg.micro_batches, update_on_kvstore=cfg.kvstore.update_on_kvstore,
                         initial_weights=initial_weights, criterion=criterion)
