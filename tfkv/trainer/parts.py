"""A run built from its parts: the store, the data source, the optimizer and its schedule, the
data- or model-parallel step, and where it resumes (a checkpoint's weights, optimizer state,
random generators and history), each checked as it is made, in one line when it does not fit.

The trainer asks the store only for what the MXNet API offers (rank, num_workers, optimizer
state), so every KVStore type, local or distributed, runs through it unchanged. `placement`
picks model parallelism (`tfkv.parallel.model_parallel`) instead of data parallelism; both
have the same interface.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from tfkv.errors import ConfigError
from tfkv.trainer import rng

log = logging.getLogger("tfkv")


@dataclass
class Run:
    """What a run trains with, and its record so far (the resumed checkpoint's, then its own)."""

    cfg: Any  # the validated tfkv.config.Config
    run_dir: Path
    store: Any
    source: Any  # tfkv.data.Source
    parallel: Any  # tfkv.parallel.base.Parallel: DataParallel or ModelParallel
    lr_at: Callable[[int], float]  # the learning rate of this worker's n-th step (from 1)
    ckpt: Any  # the tfkv.checkpoint.Checkpoint resumed from, or None
    config_yaml: str  # the resolved config, as each checkpoint keeps it
    saver: Any  # tfkv.checkpoint.Writer: worker 0's checkpoints, published in the background
    history: list[dict[str, Any]]  # each epoch's record
    resumes: list[dict[str, Any]]  # where the run was resumed, each time

    @property
    def chief(self) -> bool:
        return self.store.rank == 0

    @property
    def steps(self) -> int:
        """Steps per epoch."""
        return self.source.steps

    @property
    def start(self) -> int:
        """The first epoch to train."""
        return self.ckpt.epoch + 1 if self.ckpt else 1

    @property
    def skip(self) -> int:
        """The steps of the first epoch already taken (a mid-epoch checkpoint's)."""
        return self.ckpt.step if self.ckpt else 0


def devices(cfg: Any) -> list[str]:
    """This process's TensorFlow devices for `cfg.devices`, checked against the precision; the
    random seed and op determinism set."""
    from tfkv.tfimport import import_tensorflow

    tf = import_tensorflow()
    import keras

    from tfkv.parallel import devices as devices_mod
    from tfkv.parallel.precision import check_devices, gpu_capabilities

    tf_devices = devices_mod.setup(cfg.devices)
    check_devices(cfg.precision, gpu_capabilities(cfg.devices, tf_devices))
    keras.utils.set_random_seed(cfg.seed)
    if cfg.deterministic:
        tf.config.experimental.enable_op_determinism()
    return tf_devices


def store(cfg: Any, tf_devices: list[str], knobs: Mapping[str, Any] | None = None) -> Any:
    """The run's KVStore, given the run's resolved `knobs` (tfkv.knobs.resolve) where its class
    takes them (tfkv's own do; a plug-in's constructor that does not reads its environment). eval_only
    of a dist_* config runs here alone, with no job: it pushes nothing (device: a store of this
    process that takes the job's compression settings)."""
    from tfkv import store as stores
    from tfkv.target import parameters

    alone = cfg.eval_only and stores.capabilities(cfg.kvstore.type).distributed
    kind = "device" if alone else cfg.kvstore.type
    named, any_keyword = parameters(stores.REGISTRY.get(stores.canonical(kind)))
    given = {"knobs": knobs} if knobs is not None and ("knobs" in named or any_keyword) else {}
    return stores.create(kind, devices=tf_devices, **given)


def compress(cfg: Any, kvstore: Any) -> Any:
    """The run's kvstore.compression given to `kvstore`, before any key exists (the store decides
    what it means for it): its tfkv.ps.compression Setting, or None. Also how the cluster
    benchmark's workers (benchmarks/jobs.py) take a contender's kvstore.* settings, as a run does."""
    from tfkv.ps import compression

    # The config's names are not the API's (its 2bit is the API's 2bit_momentum: tfkv.ps.compression.KINDS).
    comp = cfg.kvstore.compression
    compressing = compression.from_config(comp.type, comp.threshold, both_ways=comp.both_ways,
                                          pull_threshold=comp.pull_threshold)
    kvstore.set_gradient_compression(compressing.params() if compressing else None)
    return compressing


def build(cfg: Any, run_dir: Path, kvstore: Any, tf_devices: list[str], overrides: list[str],
          search_root: Path) -> Run:
    """The run's parts around `kvstore`, resumed where `cfg.resume` says."""
    from omegaconf import OmegaConf

    from tfkv import checkpoint, data, optim
    from tfkv.ps import compression

    compressing = compress(cfg, kvstore)
    if compressing and kvstore.rank == 0:
        log.info("%s", compression.describe(compressing))
    source = data.Source(cfg.dataset, cfg.seed, cfg.batch_size, cfg.eval_batch_size, kvstore.num_workers,
                         kvstore.rank, cfg.steps_per_epoch)
    optimizer = optim.from_config(cfg.optimizer, source.steps, cfg.epochs)
    resume_from = checkpoint.find_resume(cfg.resume, run_dir, search_root, overrides)
    config_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    if resume_from:  # before anything is built: the first setting that differs, in one line
        checkpoint.check_fits(resume_from, OmegaConf.to_container(cfg, resolve=True))
    ckpt = checkpoint.load(resume_from) if resume_from else None
    parallel = _parallel(cfg, source, tf_devices, kvstore, optimizer, ckpt, run_dir)
    if compressing and getattr(parallel, "sparse", None) and not cfg.eval_only:  # before the first step
        from tfkv.parallel.sparse import compression_refused

        raise compression_refused(parallel.sparse.tables, cfg.kvstore.compression.type)
    run = Run(cfg, run_dir, kvstore, source, parallel, lr_schedule(optimizer, kvstore), ckpt, config_yaml,
              checkpoint.Writer(), list(ckpt.history) if ckpt else [], list(ckpt.resumes) if ckpt else [])
    if not cfg.eval_only:
        _resumed(run)
        _describe(run, tf_devices)
    return run


def lr_schedule(optimizer: Any, kvstore: Any) -> Callable[[int], float]:
    """The learning rate of this worker's `step`-th update (from 1) as the schedule gives it: what
    MXNet reports as the optimizer's learning_rate (Adam's bias correction is not in it). A key's
    update count is the job's: one per step where updates are summed or local, one per push of
    every worker with dist_async (counted as if the workers kept pace)."""
    from tfkv import optim

    per_step = 1 if kvstore.sync else kvstore.num_workers
    return lambda step: float(optimizer.schedule(np.float32((step - 1) * per_step), optim.NumpyOps))


def _parallel(cfg: Any, source: Any, tf_devices: list[str], kvstore: Any, optimizer: Any, ckpt: Any,
              run_dir: Path) -> Any:
    """The data- or model-parallel step, with the checkpoint's weights, optimizer state and
    random generators when the run resumes."""
    from tfkv.config import split_batch
    from tfkv.parallel.criterion import Criterion

    criterion = Criterion.from_config(cfg.loss, cfg.metrics)
    sizes = split_batch(cfg.batch_size, cfg.work_load_list, len(tf_devices))
    weights = ckpt.weights if ckpt else None
    try:
        if cfg.placement is not None:
            parallel = _model_parallel(cfg, source, tf_devices, kvstore, optimizer, criterion, weights)
        else:
            parallel = _data_parallel(cfg, source, tf_devices, sizes, kvstore, optimizer, criterion, weights)
        if ckpt and not cfg.eval_only:  # evaluation needs no optimizer state (a dist_* one fits no other store)
            parallel.load_optimizer(ckpt.optimizer, run_dir)
            rng.restore(parallel, ckpt.rng)
    except (ValueError, KeyError) as e:
        if not ckpt:
            raise
        # resume=<dir> of a run with another model or optimizer: Keras or the updater says what differs
        raise ConfigError(f"resume: checkpoint {ckpt.path} does not fit this model and optimizer "
                          f"({str(e).splitlines()[0]}); resume a run of the same model settings, "
                          "or start afresh with resume=false") from None
    return parallel


def _data_parallel(cfg: Any, source: Any, tf_devices: list[str], sizes: list[int], kvstore: Any, optimizer: Any,
                   criterion: Any, initial_weights: Any) -> Any:
    """A copy of the model per device, each taking its `sizes` share of the batch."""
    from tfkv import models
    from tfkv.parallel.data_parallel import DataParallel
    from tfkv.parallel.precision import LossScale

    return DataParallel(
        lambda: models.build(cfg.model, input_shape=source.input_shape, input_spec=source.input_spec,
                             num_classes=source.outputs),
        tf_devices, kvstore, optimizer, sizes,
        update_on_kvstore=cfg.kvstore.update_on_kvstore,
        initial_weights=initial_weights,
        criterion=criterion,
        loss_scale=LossScale() if cfg.precision == "mixed_float16" else None,
        clipnorm=cfg.optimizer.clipnorm, jit_compile=cfg.jit_compile,
        row_sparse=cfg.kvstore.row_sparse, evaluate_only=cfg.eval_only,
    )


def _model_parallel(cfg: Any, source: Any, tf_devices: list[str], kvstore: Any, optimizer: Any,
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
    return ModelParallel(groups, [by_spec[s] for s in specs], kvstore, optimizer, cfg.batch_size,
                         micro_batches=cfg.micro_batches, update_on_kvstore=cfg.kvstore.update_on_kvstore,
                         initial_weights=initial_weights, criterion=criterion)


def _resumed(run: Run) -> None:
    """A resumed run's record of where it resumed, this time too, and its line."""
    ckpt = run.ckpt
    if not ckpt:
        return
    run.resumes.append({"from": str(ckpt.path), "epoch": ckpt.epoch, "step": ckpt.step,
                        "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    log.info("resumed from %s at epoch %d%s (resume %d of this run)", ckpt.path, ckpt.epoch,
             f", step {ckpt.step} of epoch {ckpt.epoch + 1}" if ckpt.step else "", len(run.resumes))


def _describe(run: Run, tf_devices: list[str]) -> None:
    """The line that says what trains where."""
    from tfkv import models
    from tfkv.config import split_batch

    cfg, kvstore = run.cfg, run.store
    if cfg.placement is not None:
        log.info("%s split over %s (batch %d in %d micro-batches), kvstore=%s, %d worker(s), "
                 "%d steps/epoch", models.name(cfg.model), ",".join(cfg.devices), cfg.batch_size,
                 cfg.micro_batches, kvstore.type, kvstore.num_workers, run.steps)
    else:
        sizes = split_batch(cfg.batch_size, cfg.work_load_list, len(tf_devices))
        log.info("%s on %s (batch %s per device), kvstore=%s, %d worker(s), %d steps/epoch",
                 models.name(cfg.model), ",".join(cfg.devices), sizes, kvstore.type, kvstore.num_workers,
                 run.steps)
