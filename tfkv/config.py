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
from tfkv.ps import compression


@dataclass
class ScheduleConfig:
    name: str = "constant"  # constant | step | cosine
    factor: float = 0.1  # step: multiply the rate by this ...
    milestones: List[int] = field(default_factory=list)  # ... at these epochs
    warmup_epochs: float = 0.0  # linear warm-up from 0, any schedule


@dataclass
class OptimizerConfig:
    """What every optimizer takes."""

    name: str = MISSING  # sgd | adam
    lr: float = 0.1
    wd: float = 0.0
    # MXNet's: the summed gradient is multiplied by rescale_grad (null: 1 / the examples of one
    # update, every worker's for dist_sync, as MXNet's Module sets it), then clipped to
    # [-clip_gradient, clip_gradient] (null: no clipping)
    rescale_grad: Optional[float] = None
    clip_gradient: Optional[float] = None
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = 0.0


@dataclass
class AdamConfig(OptimizerConfig):
    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8


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
class NoCluster:
    # none: this process trains alone (or is one role of a job started by hand with DMLC_*);
    # local | ssh | mpi | slurm | sge | yarn: start the scheduler, servers and workers that way.
    launcher: str = "none"


@dataclass
class ClusterConfig(NoCluster):
    """What every launcher takes (cluster=local has exactly these)."""

    num_workers: int = 2
    num_servers: int = 1
    host: str = "127.0.0.1"  # the scheduler's address
    port: int = 0  # the scheduler's port; 0 picks a free one
    interface: Optional[str] = None  # network interface servers listen on (DMLC_INTERFACE)
    heartbeat_timeout: float = 4.0  # seconds of silence before a node counts as failed
    verbose: int = 0  # PS_VERBOSE: 1 connections, 2 every message
    # CURVE authentication + encryption with fresh keys per job; false: plain TCP, with a
    # warning, for a trusted single machine only
    secure: bool = True


@dataclass
class RemoteCluster(ClusterConfig):
    """Launchers that start roles on other hosts (mpi, slurm, sge, yarn)."""

    hostfile: Optional[str] = None  # mpi: one host per line (host, host:port, user@host)
    python: str = "python3"  # the interpreter on the hosts


@dataclass
class SSHCluster(RemoteCluster):
    sync_dst_dir: Optional[str] = None  # rsync the working directory there on every host


# cluster.launcher -> the settings that launcher has (a launcher from a plug-in: ClusterConfig's,
# or the schema its class declares as `config`)
CLUSTER_SCHEMAS: dict[str, type] = {"none": NoCluster, "local": ClusterConfig, "ssh": SSHCluster,
                                    "mpi": RemoteCluster, "slurm": RemoteCluster, "sge": RemoteCluster,
                                    "yarn": RemoteCluster}
OPTIMIZER_SCHEMAS: dict[str, type] = {"sgd": SGDConfig, "adam": AdamConfig}


@dataclass
class ExportConfig:
    saved_model: bool = False  # also a SavedModel (model.export) for serving, beside model.keras


@dataclass
class SweepConfig:
    """How a sweep (`tfkv-run -m`) treats this run as one of its trials."""

    fail_fast: bool = False  # true: the first failed trial ends the sweep (Hydra's own behaviour)
    # Set by the tfkv_optuna sweeper for each trial it asks (never by hand): the study the
    # trial's worker 0 reports its per-epoch objective to, so that a pruner can stop it.
    study: Optional[str] = None
    storage: Optional[str] = None
    trial: Optional[int] = None


@dataclass
class LoggerConfig:
    """Where runs are logged beside TensorBoard (always written): `logger=mlflow`."""

    name: str = "none"  # none | mlflow
    tracking_uri: Optional[str] = None  # mlflow: null = a SQLite store, mlflow.db, where tfkv-run started
    experiment: str = "tfkv"  # mlflow: the experiment the runs go to


# logger=<name>: the loggers beside TensorBoard (tfkv.tracking)
LOGGERS = ("none", "mlflow")


def is_distributed(kvstore_type: str) -> bool:
    return kvstore_type.startswith("dist")


@dataclass
class Config:
    # Any callable returning a keras.Model (_target_ + its keyword arguments), or {path: x.keras}
    model: Any = MISSING
    # Any data factory (_target_ + its keyword arguments); see tfkv.data.source
    dataset: Any = MISSING
    # A Keras loss name, a _target_ node, or {output name: loss}; null: sparse categorical
    # crossentropy on logits (what the built-in classifiers output). Then Keras metrics: a list,
    # or {output name: list}.
    loss: Any = None
    metrics: Any = None  # null: accuracy when the loss is a crossentropy (as above), else none
    objective: str = "test_accuracy"  # the metric tfkv-run returns (to a sweeper)
    direction: str = "maximize"  # maximize | minimize: which way `objective` is better
    optimizer: Any = MISSING  # one of OPTIMIZER_SCHEMAS, by optimizer.name
    kvstore: KVStoreConfig = MISSING
    cluster: Any = field(default_factory=lambda: {"launcher": "none"})  # one of CLUSTER_SCHEMAS
    devices: List[str] = field(default_factory=lambda: ["cpu:0"])
    work_load_list: Optional[List[float]] = None
    batch_size: int = 64  # per machine; split across `devices`
    eval_batch_size: int = 1000
    epochs: int = 10
    steps_per_epoch: Optional[int] = None  # null: the fewest full batches of any worker's shard
    seed: int = 0
    deterministic: bool = False  # tf.config.experimental.enable_op_determinism()
    resume: Any = False  # false | true (last checkpoint of the same command) | a run dir
    # evaluate the `resume` checkpoint on the test split, no training (tfkv.export). null means
    # false: Hydra's `+key=value` adds a key only where it is absent or null, and the issue's
    # spelling is `+eval_only=true` (eval_only=true works too)
    eval_only: Optional[bool] = None
    export: ExportConfig = field(default_factory=ExportConfig)
    progress: bool = True  # progress bar on a terminal
    log_every: int = 20  # steps between progress-bar and TensorBoard step updates
    # Model parallelism: null = data parallelism (a model copy per device); `auto` = the model's
    # layer groups cut into balanced contiguous stages, one per device in `devices`; or a
    # mapping group -> device, e.g. {embed: gpu:0, lstm1: gpu:0, lstm2: gpu:1, decoder: gpu:1}.
    placement: Any = None
    micro_batches: int = 1  # with placement: pipeline each batch as this many micro-batches
    sweep: SweepConfig = field(default_factory=SweepConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="tfkv_schema", node=Config)
    # Each option's schema, which its yaml (conf/optimizer/adam.yaml, ...) extends in its defaults
    # list: every setting the option has can be overridden without `+`, others are refused by Hydra.
    for group, schemas in (("optimizer", OPTIMIZER_SCHEMAS), ("cluster", CLUSTER_SCHEMAS)):
        for option, schema in schemas.items():
            store.store(group=f"schema/{group}", name=option, node=schema)


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
    """Reject what the schema's types cannot: unknown names, keys the chosen option does not have,
    bad devices, a bad workload split, a model or data factory that does not take its settings.
    Each option node (optimizer, cluster) is replaced by its typed form, defaults filled in."""
    from tfkv import checkpoint, models, store, optim
    from tfkv.data import source

    def known(kind: str, value: str, names: list[str], group: str) -> None:
        if value not in names:
            raise ConfigError(
                f"{kind}={value!r} is not known; choose one of {', '.join(sorted(names))} "
                f"(e.g. {group}={sorted(names)[0]})"
            )

    _validate_keys(cfg, Config, "")
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # `???` in an option (dataset=tfrecord without files): the option says what it needs
        raise ConfigError(f"{missing[0]} is required by the chosen option and has no value; set {missing[0]}=..."
                          + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""))
    optimizer_name = _option_name(cfg.optimizer, "optimizer", "name")
    known("optimizer.name", optimizer_name, optim.names(), "optimizer")
    cfg.optimizer = typed(cfg.optimizer, OPTIMIZER_SCHEMAS[optimizer_name], "optimizer", optimizer_name)
    known("optimizer.schedule.name", cfg.optimizer.schedule.name, optim.schedule_names(),
          "optimizer.schedule.name")
    launcher = _option_name(cfg.cluster, "cluster", "launcher")
    cfg.cluster = typed(cfg.cluster, cluster_schema(launcher), "cluster", launcher)
    models.check(cfg.model)
    source.check(cfg.dataset)
    _validate_objective(cfg)
    if cfg.direction not in ("maximize", "minimize"):
        raise ConfigError(f"direction={cfg.direction!r} is not a direction; write direction=maximize or "
                          "direction=minimize (which way objective is better)")
    known("logger", cfg.logger.name, list(LOGGERS), "logger")
    if cfg.logger.name == "mlflow":  # before anything starts, not at worker 0's first epoch
        from tfkv.tracking import mlflow_log

        mlflow_log.check_installed()
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
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"seed={cfg.seed} must be between 0 and {2**32 - 1} (numpy's and TensorFlow's range)")
    if cfg.steps_per_epoch is not None and cfg.steps_per_epoch < 1:
        raise ConfigError(f"steps_per_epoch={cfg.steps_per_epoch} must be at least 1, or null (from the data)")
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
    _validate_cluster(cfg)
    _validate_placement(cfg)
    resume = cfg.resume
    if not isinstance(resume, (bool, str)):
        raise ConfigError(f"resume={resume!r} must be true, false or a run directory")
    if cfg.eval_only and (resume is False or str(resume).lower() in checkpoint.NO):
        raise ConfigError("eval_only=true evaluates a checkpoint, but resume is false; name it with "
                          "resume=<run directory or checkpoint directory> (or resume=true: this command's last)")


def _validate_keys(node: Any, schema: type, prefix: str, option: str = "") -> None:
    """Refuse keys the schema does not have: `+epoch=3` adds one past OmegaConf's struct check,
    `optimizer=adam optimizer.momentum=0.9` one that only another option has; either way the run
    would silently ignore it."""
    from omegaconf import DictConfig

    fields = typing.get_type_hints(schema)
    for key in node.keys():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            if option:
                mean = f" (did you mean {prefix}{close[0]}?)" if close else ""
                raise ConfigError(f"{prefix}{key} is not a setting of {option}{mean}; its settings: "
                                  f"{', '.join(sorted(fields))}")
            hint = f"did you mean {prefix}{close[0]}?" if close else f"see {schema.__name__} in tfkv/config.py"
            raise ConfigError(f"{prefix}{key} is not a setting tfkv knows ({hint})")
        child = node[key]
        if dataclasses.is_dataclass(fields[key]) and isinstance(child, DictConfig):
            _validate_keys(child, fields[key], f"{prefix}{key}.", option)


# What every run reports beside the loss and metrics (see tfkv.trainer).
ALWAYS_REPORTED = ("samples_per_sec", "train_perplexity", "test_perplexity")


def _validate_objective(cfg: Any) -> None:
    """The loss and metrics build (names known, `_target_`s import), and `objective` is one of the
    values the run will report, so a sweep does not learn it only after the first trial trains."""
    from tfkv.parallel.criterion import Criterion

    criterion = Criterion.from_config(cfg.loss, cfg.metrics)
    names = criterion.value_names()  # without Keras metric objects, which would start TensorFlow
    reported = [f"{phase}_{n}" for phase in ("train", "test") for n in names] + list(ALWAYS_REPORTED)
    objective = str(cfg.objective)
    if cfg.get("eval_only") and not objective.startswith("test_"):
        raise ConfigError(f"objective={objective}: eval_only reports only test values; choose one, e.g. "
                          "objective=test_loss")
    # a model with dict outputs reports <phase>_<output>_<metric> too: known once the data is
    per_output = any(objective.startswith(f"{phase}_") and objective.endswith(f"_{n}")
                     for phase in ("train", "test") for n in names)
    if objective not in reported and not per_output:
        close = difflib.get_close_matches(objective, reported, n=1)
        mean = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"objective={objective} is not a value this run reports; {mean}it reports "
                          f"{', '.join(reported[:-2])} (and perplexities for language models)")


def _option_name(node: Any, group: str, key: str) -> str:
    from omegaconf import DictConfig

    if not isinstance(node, (DictConfig, dict)) or node.get(key) is None:
        raise ConfigError(f"{group}.{key} is missing; choose an option, e.g. {group}=<option> (see conf/{group}/)")
    return str(node[key])


def cluster_schema(launcher: str) -> type:
    """The settings of `cluster.launcher`: its own schema, or (a plug-in's) the declared or common one."""
    if launcher in CLUSTER_SCHEMAS:
        return CLUSTER_SCHEMAS[launcher]
    from tfkv.launcher.base import REGISTRY as LAUNCHERS

    if launcher in LAUNCHERS:
        return getattr(LAUNCHERS.get(launcher), "config", None) or ClusterConfig
    raise ConfigError(f"cluster.launcher={launcher!r} is not known; choose one of "
                      f"{', '.join(sorted(set(CLUSTER_SCHEMAS) | set(LAUNCHERS.names())))} (e.g. cluster=local)")


def typed(node: Any, schema: type, group: str, option: str) -> Any:
    """`node` checked against the schema of its option and merged onto it (defaults filled in).
    A key the option does not have is one line naming the option's keys."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _validate_keys(node, schema, f"{group}.", f"{group}={option}")
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or ""
        return _raise(f"{group}.{key}".rstrip("."), str(e).splitlines()[0])


def _raise(key: str, why: str) -> Any:
    raise ConfigError(f"{key}: {why}")


def _validate_cluster(cfg: Any) -> None:
    import os

    c, kind = cfg.cluster, cfg.kvstore.type
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
    if c.launcher == "none":
        return
    for key in ("num_workers", "num_servers"):
        if getattr(c, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be at least 1")
    if c.heartbeat_timeout <= 0:
        raise ConfigError(f"cluster.heartbeat_timeout={c.heartbeat_timeout} must be positive")


def _validate_placement(cfg: Any) -> None:
    """Model parallelism: the model must declare layer groups and the mapping must fit them."""
    from tfkv import models
    from tfkv.parallel import placement

    m = cfg.micro_batches
    if m < 1:
        raise ConfigError(f"micro_batches={m} must be at least 1")
    if cfg.placement is None:
        if m != 1:
            raise ConfigError(f"micro_batches={m} pipelines a model split over devices; set placement "
                              "(e.g. placement=auto) or leave micro_batches=1 for data parallelism")
        return
    name = models.name(cfg.model)
    if models.layer_groups(cfg.model) is None:
        raise ConfigError(
            f"placement: model {name} declares no layer groups, so it cannot be split over devices; "
            "model parallelism needs a builder with group_names and build_groups (e.g. model=lstm_lm) or placement=null")
    if cfg.work_load_list is not None:
        raise ConfigError("work_load_list splits a batch between model copies (data parallelism); "
                          "with placement there is one copy, split by layers: drop one of the two")
    if m > cfg.batch_size:
        raise ConfigError(f"micro_batches={m} is more than batch_size={cfg.batch_size}; every "
                          "micro-batch needs at least one example")
    placement.check(cfg.placement, models.group_names(cfg.model), list(cfg.devices), name)
