"""The structured-config schema of a `tfkv-run` config, registered in Hydra's ConfigStore.

The dataclasses are the single place where the shape and types of a run's configuration are
declared (`cluster.*`: every launcher's in tfkv.config.cluster, each backend's own beside it in
tfkv.launcher.backends, registered as `schema/cluster/<name>` by tfkv.plugins.register_schemas when
Hydra scans its plug-ins); OmegaConf rejects unknown keys and wrong types while Hydra composes the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from tfkv import knobs
from tfkv.config.cluster import NoCluster


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
    lr: float = 0.1  # learning rate
    wd: float = 0.0  # weight decay (MXNet's wd)
    # MXNet's: the summed gradient is multiplied by rescale_grad (null: 1 / the examples of one
    # update, every worker's for dist_sync, as MXNet's Module sets it), then clipped to
    # [-clip_gradient, clip_gradient] (null: no clipping)
    rescale_grad: Optional[float] = None
    clip_gradient: Optional[float] = None  # see rescale_grad; null: no clipping
    # null, or the most the global L2 norm of each worker's gradient (of its mean loss over its
    # batch, all its devices together) may be: scaled down to it before it is pushed (Keras's
    # global_clipnorm, per worker; see docs/guides/precision-and-devices.md)
    clipnorm: Optional[float] = None
    # MXNet's: the store (or its servers) keeps float32 master weights and optimizer state for
    # half-precision (float16/bfloat16) keys and hands out their cast; false: the update runs in half
    multi_precision: bool = False
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = 0.0  # 0: plain SGD


@dataclass
class AdamConfig(OptimizerConfig):
    lr: float = 0.001
    beta1: float = 0.9  # decay rate of the first-moment estimate
    beta2: float = 0.999  # decay rate of the second-moment estimate
    epsilon: float = 1e-8  # added to the denominator, for numerical stability


@dataclass
class CompressionConfig:
    # none | 2bit | 2bit_mxnet: how what workers push to the parameter servers (dist_*) or devices
    # send to be summed (device) is compressed (tfkv.ps.compression.KINDS):
    # 2bit: SGD's momentum applied by each sender before quantising (DGC's momentum correction),
    #   with error feedback; the store's optimizer then runs without momentum (needs
    #   optimizer=sgd and update_on_kvstore=true). Keeps accuracy with momentum.
    # 2bit_mxnet: MXNet's exact 2-bit (its set_gradient_compression({"type": "2bit"})): the
    #   gradient is quantised and the store's optimizer, momentum included, runs on what arrives.
    type: str = "none"
    # each value sent is +threshold, -threshold or 0; on MXNet's scale (gradient sums over a
    # batch, see optimizer.rescale_grad), so MXNet's 0.5 means what it does there
    threshold: float = 0.5
    # beyond MXNet (dist_* only): the servers' replies to pulls are 2-bit too, with error feedback
    # kept on the servers, so each worker's copy follows the servers' weights (in dist_sync every
    # worker's copy is the same, bit for bit); row-sparse keys stay uncompressed
    both_ways: bool = False
    # the threshold of those replies (weight changes, not gradients); null: 8 times one step's
    # largest change under the servers' optimizer: SGD's lr x rescale_grad x threshold x the
    # workers summed / (1 - momentum), Adam's lr; without an optimizer on the servers, threshold
    pull_threshold: Optional[float] = None


@dataclass
class _KVStoreSettings:
    type: str = MISSING  # the store type, chosen by kvstore=<option> (tfkv.store.REGISTRY)
    # true: the store runs the optimizer (MXNet's default); false: the store only sums gradients
    # and every device applies the update to its own copy of the weights.
    update_on_kvstore: bool = True
    # true: every keras.layers.Embedding of the model trains row-sparse, the model unchanged: its
    # table is a row-sparse key of the store (the servers', by rows, for dist_*), its gradient is
    # pushed as the rows the batch touched and the store updates only those (MXNet's lazy update),
    # the rows a batch reads are refreshed from the store before it (requested while the previous
    # batch computes). tfkv.layers.ShardedEmbedding trains so always, keeping only the batch's
    # rows on a worker. Needs update_on_kvstore=true; not with placement (model parallelism).
    row_sparse: bool = False
    compression: CompressionConfig = field(default_factory=CompressionConfig)


# kvstore.*: the settings above, then every kvstore.* backend knob as its row in tfkv.knobs
# declares it (type, default, help naming the variable that overrides it)
KVStoreConfig = make_dataclass("KVStoreConfig", knobs.fields("kvstore"), bases=(_KVStoreSettings,))
KVStoreConfig.__module__ = __name__


OPTIMIZER_SCHEMAS: dict[str, type] = {"sgd": SGDConfig, "adam": AdamConfig}


@dataclass
class ExportConfig:
    saved_model: bool = False  # also a SavedModel (model.export) for serving, beside model.keras


@dataclass
class CheckpointConfig:
    """When checkpoints are written (tfkv.checkpoint): at every epoch's end always, and as these say."""

    every_steps: Optional[int] = None  # null, or a checkpoint after every N-th step of the run (mid-epoch)
    every_minutes: Optional[float] = None  # null, or one after the first step N minutes past the last
    keep_last: Optional[int] = None  # null: keep every checkpoint; k: only the newest k


@dataclass
class SweepConfig:
    """How a sweep (`tfkv-run -m`) treats this run as one of its trials."""

    fail_fast: bool = False  # true: the first failed trial ends the sweep (Hydra's own behaviour)
    # Set by the tfkv_optuna sweeper for each trial it asks (never by hand): the study the
    # trial's worker 0 reports its per-epoch objective to, so that a pruner can stop it.
    study: Optional[str] = None
    storage: Optional[str] = None  # with study: the Optuna storage it lives in
    trial: Optional[int] = None  # with study: this trial's number in it


@dataclass
class LoggerConfig:
    """Where runs are logged beside TensorBoard (always written): `logger=mlflow`."""

    name: str = "none"  # none | mlflow
    tracking_uri: Optional[str] = None  # mlflow: null = a SQLite store, mlflow.db, where tfkv-run started
    experiment: str = "tfkv"  # mlflow: the experiment the runs go to


# logger=<name>: the loggers beside TensorBoard (tfkv.tracking)
LOGGERS = ("none", "mlflow")

# precision=<name>: Keras's mixed-precision policies tfkv trains with (tfkv.parallel.precision)
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


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
    # the value tfkv-run returns (to a sweeper); null: test_accuracy where reported, else test_loss
    objective: Optional[str] = None
    # auto (from objective's name: tfkv.config.objective) | maximize | minimize: which way it is better
    direction: str = "auto"
    optimizer: Any = MISSING  # one of OPTIMIZER_SCHEMAS, by optimizer.name
    kvstore: KVStoreConfig = MISSING  # chosen by kvstore=<option>
    cluster: Any = field(default_factory=lambda: {"launcher": "none"})  # one launcher's settings (tfkv.launcher.base.schemas)
    # the devices this process trains on: cpu:N, gpu:N, or gpu:{local_rank} (a launched worker's own GPU)
    devices: List[str] = field(default_factory=lambda: ["cpu:0"])
    work_load_list: Optional[List[float]] = None  # each device's share of the batch (null: equal shares)
    batch_size: int = 64  # per machine; split across `devices`
    eval_batch_size: int = 1000  # examples per batch when evaluating the test split
    epochs: int = 10  # passes over the training data
    steps_per_epoch: Optional[int] = None  # null: the fewest full batches of any worker's shard
    seed: int = 0  # the random seed (0 to 2**32 - 1)
    deterministic: bool = False  # tf.config.experimental.enable_op_determinism()
    # false | auto (newest valid checkpoint of this run directory, else fresh) | true (auto, else the
    # last checkpoint of the same command, epochs aside) | a run or checkpoint directory
    resume: Any = False
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # evaluate the `resume` checkpoint on the test split, no training (tfkv.export). null means
    # false, so that `+eval_only=true` works as well as `eval_only=true` (Hydra's `+key=value`
    # adds a key only where it is absent or null)
    eval_only: Optional[bool] = None
    export: ExportConfig = field(default_factory=ExportConfig)
    progress: bool = True  # progress bar on a terminal
    log_every: int = 20  # steps between progress-bar and TensorBoard step updates
    # Model parallelism: null = data parallelism (a model copy per device); `auto` = the model's
    # layer groups cut into balanced contiguous stages, one per device in `devices`; or a
    # mapping group -> device, e.g. {embed: gpu:0, lstm1: gpu:0, lstm2: gpu:1, decoder: gpu:1}.
    placement: Any = None
    micro_batches: int = 1  # with placement: pipeline each batch as this many micro-batches
    # float32 | mixed_float16 (with dynamic loss scaling) | mixed_bfloat16: Keras's dtype policy
    # the model is built under (variables, gradients and the store stay float32)
    precision: str = "float32"
    jit_compile: bool = False  # compile each device's forward and backward pass with XLA
    sweep: SweepConfig = field(default_factory=SweepConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def register() -> None:
    store = ConfigStore.instance()
    store.store(name="tfkv_schema", node=Config)
    # Each option's schema, which its yaml (conf/optimizer/adam.yaml, ...) extends in its defaults
    # list: every setting the option has can be overridden without `+`, others are refused by Hydra.
    for option, schema in OPTIMIZER_SCHEMAS.items():
        store.store(group="schema/optimizer", name=option, node=schema)
    # cluster=none's here; each launcher's, which the launcher layer declares, by tfkv.plugins.register_schemas
    store.store(group="schema/cluster", name="none", node=NoCluster)



# What every run reports beside the loss and metrics (see tfkv.trainer).
ALWAYS_REPORTED = ("samples_per_sec", "train_perplexity", "test_perplexity")
