"""Structured-config schema for `tfkv-run`, registered in Hydra's ConfigStore.

The dataclasses are the single place where the shape and types of a run's configuration are
declared; OmegaConf rejects unknown keys and wrong types while Hydra composes the tree.
`validate()` then checks what a type cannot express (known names, device syntax, workload
shape) once, at the edge, before TensorFlow is imported. Nothing inside re-checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from tfkv.errors import ConfigError
from tfkv.store import compression


@dataclass
class ModelConfig:
    name: str = MISSING
    hidden: List[int] = field(default_factory=lambda: [256, 128])  # mlp only
    dropout: float = 0.0
    batch_norm: bool = True  # vgg11 only; resnet18 always has it
    width: int = 64  # channels of the first stage (vgg11, resnet18)
    # lstm_lm: `hidden` lists the LSTM layers' sizes; the embedding has embed_dim (0: hidden[0])
    embed_dim: int = 0


@dataclass
class DatasetConfig:
    name: str = MISSING
    root: str = "data"  # where mnist/cifar10 files live (relative to the working directory)
    download: bool = True  # fetch from the standard URL when files are missing and we are online
    augment: bool = False  # random crop + flip for image sets (cifar10)
    test_fraction: float = 0.2  # digits: share held out for testing
    # synthetic only: a learnable random problem
    num_train: int = 4096
    num_test: int = 1024
    shape: List[int] = field(default_factory=lambda: [32, 32, 3])
    num_classes: int = 10
    # text (ptb, embedded_text): tokens per training sequence, vocabulary cap (0: every word of
    # the training text), and the held-out split evaluated each epoch
    seq_len: int = 35
    vocab_size: int = 10000
    eval_split: str = "test"


@dataclass
class ScheduleConfig:
    name: str = "constant"  # constant | step | cosine
    factor: float = 0.1  # step: multiply the rate by this ...
    milestones: List[int] = field(default_factory=list)  # ... at these epochs
    warmup_epochs: float = 0.0  # linear warm-up from 0, any schedule


@dataclass
class OptimizerConfig:
    name: str = MISSING  # sgd | adam
    lr: float = 0.1
    momentum: float = 0.0  # sgd
    wd: float = 0.0
    beta1: float = 0.9  # adam
    beta2: float = 0.999  # adam
    epsilon: float = 1e-8  # adam
    # MXNet's: the summed gradient is multiplied by rescale_grad (null: 1 / the examples of one
    # update, every worker's for dist_sync, as MXNet's Module sets it), then clipped to
    # [-clip_gradient, clip_gradient] (null: no clipping)
    rescale_grad: Optional[float] = None
    clip_gradient: Optional[float] = None
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class CompressionConfig:
    # none | 2bit: what workers push to the parameter servers (dist_*) or devices send to be summed
    # (device), as MXNet's set_gradient_compression
    type: str = "none"
    # 2bit: each value sent is +threshold, -threshold or 0; on MXNet's scale (gradient sums over a
    # batch, see optimizer.rescale_grad), so MXNet's 0.5 means what it does there
    threshold: float = 0.5


@dataclass
class KVStoreConfig:
    type: str = MISSING
    # true: the store runs the optimizer (MXNet's default); false: the store only sums gradients
    # and every device applies the update to its own copy of the weights.
    update_on_kvstore: bool = True
    compression: CompressionConfig = field(default_factory=CompressionConfig)


@dataclass
class ClusterConfig:
    # none: this process trains alone (or is one role of a job started by hand with DMLC_*);
    # local | ssh | mpi | slurm | sge | yarn: start the scheduler, servers and workers that way.
    launcher: str = "none"
    num_workers: int = 2
    num_servers: int = 1
    hostfile: Optional[str] = None  # ssh/mpi: one host per line (host, host:port, user@host)
    sync_dst_dir: Optional[str] = None  # ssh: rsync the working directory there on every host
    python: str = "python3"  # the interpreter on the hosts
    host: str = "127.0.0.1"  # the scheduler's address
    port: int = 0  # the scheduler's port; 0 picks a free one
    interface: Optional[str] = None  # network interface servers listen on (DMLC_INTERFACE)
    heartbeat_timeout: float = 4.0  # seconds of silence before a node counts as failed
    verbose: int = 0  # PS_VERBOSE: 1 connections, 2 every message
    # CURVE authentication + encryption with fresh keys per job; false: plain TCP, with a
    # warning, for a trusted single machine only
    secure: bool = True




def is_distributed(kvstore_type: str) -> bool:
    return kvstore_type.startswith("dist")


@dataclass
class Config:
    model: ModelConfig = MISSING
    dataset: DatasetConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    kvstore: KVStoreConfig = MISSING
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    devices: List[str] = field(default_factory=lambda: ["cpu:0"])
    work_load_list: Optional[List[float]] = None
    batch_size: int = 64  # per machine; split across `devices`
    eval_batch_size: int = 1000
    epochs: int = 10
    seed: int = 0
    deterministic: bool = False  # tf.config.experimental.enable_op_determinism()
    resume: Any = False  # false | true (last checkpoint of the same command) | a run dir
    progress: bool = True  # progress bar on a terminal
    log_every: int = 20  # steps between progress-bar and TensorBoard step updates
    # Model parallelism: null = data parallelism (a model copy per device); `auto` = the model's
    # layer groups cut into balanced contiguous stages, one per device in `devices`; or a
    # mapping group -> device, e.g. {embed: gpu:0, lstm1: gpu:0, lstm2: gpu:1, decoder: gpu:1}.
    placement: Any = None
    micro_batches: int = 1  # with placement: pipeline each batch as this many micro-batches


def register() -> None:
    ConfigStore.instance().store(name="tfkv_schema", node=Config)


register()  # importing this module is what makes `tfkv_schema` known to Hydra


_DEVICE = re.compile(r"^(cpu|gpu):(\d+)$")


def parse_device(spec: str) -> tuple[str, int]:
    """`gpu:2` -> ("gpu", 2); anything else is a ConfigError."""
    m = _DEVICE.match(str(spec).strip().lower())
    if not m:
        raise ConfigError(
            f"devices: {spec!r} is not a device; write cpu:N or gpu:N, e.g. devices=[gpu:0,gpu:1]"
        )
    return m.group(1), int(m.group(2))


def split_batch(batch_size: int, work_load_list: Optional[List[float]], num_devices: int) -> list[int]:
    """Examples per device, MXNet's rule: proportional to the work load, the remainder to the last."""
    loads = list(work_load_list) if work_load_list else [1.0] * num_devices
    total = float(sum(loads))
    sizes = [int(round(w * batch_size / total)) for w in loads]
    sizes[-1] += batch_size - sum(sizes)
    return sizes


def validate(cfg: Any) -> None:
    """Reject what the schema's types cannot: unknown names, bad devices, a bad workload split."""
    from tfkv import data, models, store, optim

    def known(kind: str, value: str, names: list[str], group: str) -> None:
        if value not in names:
            raise ConfigError(
                f"{kind}={value!r} is not known; choose one of {', '.join(sorted(names))} "
                f"(e.g. {group}={sorted(names)[0]})"
            )

    known("model.name", cfg.model.name, models.names(), "model")
    known("dataset.name", cfg.dataset.name, data.names(), "dataset")
    known("optimizer.name", cfg.optimizer.name, optim.names(), "optimizer")
    known("optimizer.schedule.name", cfg.optimizer.schedule.name, optim.schedule_names(),
          "optimizer.schedule.name")
    kind = cfg.kvstore.type
    if kind not in store.names():  # MXNet's spelling of a type, or one of its types tfkv lacks: name ours
        try:
            use = store.canonical(kind)
        except ValueError as e:
            if str(kind).strip().lower() in store.INSTEAD:
                raise ConfigError(f"kvstore.type={kind!r}: {e}") from None
        else:
            raise ConfigError(f"kvstore.type={kind!r} is MXNet's name for {use}; write kvstore={use}")
    known("kvstore.type", kind, store.names(), "kvstore")

    devices = list(cfg.devices)
    if not devices:
        raise ConfigError("devices is empty; give at least one, e.g. devices=[cpu:0]")
    parsed = [parse_device(d) for d in devices]
    if len(set(parsed)) != len(parsed):
        raise ConfigError(f"devices={devices} names a device twice; list each device once")
    _validate_keys(cfg, Config, "")
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={cfg.seed} must be between 0 and {2**32 - 1} (numpy's and TensorFlow's range)")
    for key in ("batch_size", "eval_batch_size", "epochs", "log_every"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be at least 1")
    if cfg.work_load_list is not None:
        loads = list(cfg.work_load_list)
        if len(loads) != len(devices):
            raise ConfigError(
                f"work_load_list={loads} has {len(loads)} entries for {len(devices)} devices; "
                "give one weight per device"
            )
        if any(w <= 0 for w in loads):
            raise ConfigError(f"work_load_list={loads} must hold positive weights")
    sizes = split_batch(cfg.batch_size, cfg.work_load_list, len(devices))
    if min(sizes) < 1 and cfg.placement is None:  # with placement the batch is not split by device
        raise ConfigError(
            f"batch_size={cfg.batch_size} split over {devices} "
            f"(work_load_list={cfg.work_load_list}) gives {sizes} examples per device; "
            "every device needs at least one: raise batch_size or even out the work load"
        )
    if cfg.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr={cfg.optimizer.lr} must be positive")
    for key in ("rescale_grad", "clip_gradient"):
        value = getattr(cfg.optimizer, key)
        if value is not None and not 0 < value < float("inf"):
            raise ConfigError(f"optimizer.{key}={value} must be positive, or null for MXNet's default")
    try:  # every rule the optimizer itself holds (momentum, betas, epsilon, ...), the one definition
        optim.from_config(cfg.optimizer, 1, cfg.epochs)
    except ValueError as e:
        raise ConfigError(f"optimizer: {e}; fix it with optimizer.<setting>=...") from None
    _validate_model(cfg.model)
    _validate_cluster(cfg)
    _validate_placement(cfg)
    resume = cfg.resume
    if not isinstance(resume, (bool, str)):
        raise ConfigError(f"resume={resume!r} must be true, false or a run directory")


def _validate_keys(node: Any, schema: type, prefix: str) -> None:
    """Refuse keys the schema does not have: `+epoch=3` adds one past OmegaConf's struct check, and
    the run would silently ignore it."""
    from omegaconf import DictConfig

    fields = typing.get_type_hints(schema)
    for key in node.keys():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {prefix}{close[0]}?" if close else f"see {schema.__name__} in tfkv/config.py"
            raise ConfigError(f"{prefix}{key} is not a setting tfkv knows ({hint})")
        child = node[key]
        if dataclasses.is_dataclass(fields[key]) and isinstance(child, DictConfig):
            _validate_keys(child, fields[key], f"{prefix}{key}.")


def _validate_model(m: Any) -> None:
    """The sizes Keras would refuse with a traceback once the model is built."""
    if not 0 <= m.dropout < 1:
        raise ConfigError(f"model.dropout={m.dropout} must be at least 0 and below 1 (the share of units dropped)")
    if any(h < 1 for h in m.hidden):
        raise ConfigError(f"model.hidden={list(m.hidden)} must list layer sizes of at least 1, e.g. [256,128]")
    if m.width < 1:
        raise ConfigError(f"model.width={m.width} must be at least 1 (channels of the first stage)")
    if m.embed_dim < 0:
        raise ConfigError(f"model.embed_dim={m.embed_dim} must be 0 (the first LSTM's size) or more")


def _validate_cluster(cfg: Any) -> None:
    import os

    from tfkv.launcher.base import REGISTRY as LAUNCHERS

    c, kind = cfg.cluster, cfg.kvstore.type
    if c.launcher != "none" and c.launcher not in LAUNCHERS:
        raise ConfigError(f"cluster.launcher={c.launcher!r} is not known; choose one of none, "
                          f"{', '.join(LAUNCHERS.names())} (e.g. cluster=local)")
    in_job = bool(os.environ.get("TFKV_ROLE") or os.environ.get("DMLC_ROLE"))
    if is_distributed(kind):
        if c.launcher == "none" and not in_job:
            raise ConfigError(
                f"kvstore={kind} needs a parameter-server cluster: add cluster=local "
                "(cluster.num_workers=2 cluster.num_servers=1), or start the roles yourself with DMLC_ROLE etc.")
        if "async" in kind and not cfg.kvstore.update_on_kvstore:
            raise ConfigError(
                f"kvstore={kind} needs the optimizer on the servers (kvstore.update_on_kvstore=true): "
                "without one every push would overwrite the weights")
    elif c.launcher != "none":
        raise ConfigError(f"cluster={c.launcher} starts a parameter-server job, but kvstore={kind} is a "
                          "single-machine store; use kvstore=dist_sync (or dist_async, ...) or drop cluster=")
    comp = cfg.kvstore.compression
    try:
        compressing = compression.parse({"type": comp.type, "threshold": comp.threshold}, "kvstore.compression")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if compressing is not None:
        from tfkv import store

        if not store.compresses(kind):
            raise ConfigError(f"kvstore.compression.type={comp.type} compresses what devices send to be summed "
                              f"(kvstore=device) or workers push to parameter servers (dist_*); kvstore={kind} "
                              "sends neither: use kvstore=device or kvstore=dist_sync")
    for key in ("num_workers", "num_servers"):
        if getattr(c, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be at least 1")
    if c.heartbeat_timeout <= 0:
        raise ConfigError(f"cluster.heartbeat_timeout={c.heartbeat_timeout} must be positive")


def _validate_placement(cfg: Any) -> None:
    """Model parallelism: the model must declare layer groups and the mapping must fit them."""
    from tfkv import data, models
    from tfkv.parallel import placement

    model, dataset = cfg.model.name, cfg.dataset.name
    if (model in models.SEQUENCE) != (dataset in data.TEXT):
        raise ConfigError(
            f"model={model} and dataset={dataset} do not fit: language models "
            f"({', '.join(sorted(models.SEQUENCE))}) need a text data set "
            f"({', '.join(sorted(data.TEXT))}) and the other models image or vector data; "
            "e.g. +experiment=lstm_ptb")
    m = cfg.micro_batches
    if m < 1:
        raise ConfigError(f"micro_batches={m} must be at least 1")
    if cfg.placement is None:
        if m != 1:
            raise ConfigError(f"micro_batches={m} pipelines a model split over devices; set placement "
                              "(e.g. placement=auto) or leave micro_batches=1 for data parallelism")
        return
    if not models.has_groups(model):
        raise ConfigError(
            f"placement: model {model} declares no layer groups, so it cannot be split over devices; "
            f"model parallelism needs one that does ({', '.join(sorted(models.GROUPED))}) or placement=null")
    if cfg.work_load_list is not None:
        raise ConfigError("work_load_list splits a batch between model copies (data parallelism); "
                          "with placement there is one copy, split by layers: drop one of the two")
    if m > cfg.batch_size:
        raise ConfigError(f"micro_batches={m} is more than batch_size={cfg.batch_size}; every "
                          "micro-batch needs at least one example")
    placement.check(cfg.placement, models.group_names(cfg.model), list(cfg.devices), model)
