"""What the config's types cannot express but the config alone shows: keys an option does not
have, missing values, device syntax, numbers in range, the workload split. No registry is
consulted here: the checks that need one (known names, the store's capabilities, a model's
layer groups) are tfkv.check's `validate`, which runs these too, once, at the edge.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from tfkv.config import objective
from tfkv.config.device_specs import device_template, parse_device, split_batch
from tfkv.errors import ConfigError


def known(kind: str, value: str, names: list[str], group: str) -> None:
    """`value` is one of `names`, or one line listing them."""
    if value not in names:
        raise ConfigError(
            f"{kind}={value!r} is not known; choose one of {', '.join(sorted(names))} "
            f"(e.g. {group}={sorted(names)[0]})"
        )


def keys(node: Any, schema: type, prefix: str, option: str = "") -> None:
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
            hint = f"did you mean {prefix}{close[0]}?" if close else f"see {schema.__name__} in {schema.__module__.replace('.', '/')}.py"
            raise ConfigError(f"{prefix}{key} is not a setting tfkv knows ({hint})")
        child = node[key]
        if dataclasses.is_dataclass(fields[key]) and isinstance(child, DictConfig):
            keys(child, fields[key], f"{prefix}{key}.", option)


def no_missing(cfg: Any) -> None:
    """`???` in an option (dataset=tfrecord without files): the option says what it needs."""
    from omegaconf import OmegaConf

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]} is required by the chosen option and has no value; set {missing[0]}=..."
                          + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""))


def option_name(node: Any, group: str, key: str) -> str:
    """The option chosen in `group` (optimizer.name, cluster.launcher)."""
    from omegaconf import DictConfig

    if not isinstance(node, (DictConfig, dict)) or node.get(key) is None:
        raise ConfigError(f"{group}.{key} is missing; choose an option, e.g. {group}=<option> (see conf/{group}/)")
    return str(node[key])


def typed(node: Any, schema: type, group: str, option: str) -> Any:
    """`node` checked against the schema of its option and merged onto it (defaults filled in).
    A key the option does not have is one line naming the option's keys."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    keys(node, schema, f"{group}.", f"{group}={option}")
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or getattr(e, "key", None) or ""
        raise ConfigError(f"{f'{group}.{key}'.rstrip('.')}: {str(e).splitlines()[0]}") from None


def direction(cfg: Any) -> None:
    if cfg.direction not in (objective.AUTO, *objective.DIRECTIONS):
        raise ConfigError(f"direction={cfg.direction!r} is not a direction; write direction=maximize or "
                          "direction=minimize (which way objective is better), or direction=auto (from its name)")


def workload(cfg: Any) -> None:
    """Devices, seed, sizes, the work-load split and the optimizer's numbers."""
    devices = list(cfg.devices)
    if not devices:
        raise ConfigError("devices is empty; give at least one, e.g. devices=[cpu:0]")
    parsed = [device_template(d) or parse_device(d) for d in devices]
    if len(set(parsed)) != len(parsed):
        raise ConfigError(f"devices={devices} names a device twice; list each device once")
    if cfg.placement is not None and any(isinstance(i, str) for _, i in parsed):
        raise ConfigError(f"devices={devices} has a placeholder, which binds each data-parallel worker to its "
                          "GPU; a model split over devices (placement) names them: write gpu:N, or placement=null")
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
    clipnorm = cfg.optimizer.get("clipnorm")
    if clipnorm is not None and not 0 < clipnorm < float("inf"):
        raise ConfigError(f"optimizer.clipnorm={clipnorm} must be positive (the largest global gradient norm "
                          "a worker pushes), or null for no clipping")


def cluster_sizes(c: Any) -> None:
    """A launched job's size and heartbeat (cluster=none has neither)."""
    if c.launcher == "none":
        return
    for key in ("num_workers", "num_servers"):
        if getattr(c, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be at least 1")
    if c.heartbeat_timeout <= 0:
        raise ConfigError(f"cluster.heartbeat_timeout={c.heartbeat_timeout} must be positive")
    if c.max_restarts < 0:
        raise ConfigError(f"cluster.max_restarts={c.max_restarts} must be at least 0 (0: a failed job stays failed)")


def micro_batches(cfg: Any) -> bool:
    """micro_batches fits the parallelism; True when a placement is set (model parallelism)."""
    m = cfg.micro_batches
    if m < 1:
        raise ConfigError(f"micro_batches={m} must be at least 1")
    if cfg.placement is None:
        if m != 1:
            raise ConfigError(f"micro_batches={m} pipelines a model split over devices; set placement "
                              "(e.g. placement=auto) or leave micro_batches=1 for data parallelism")
        return False
    return True


def placement_shape(cfg: Any) -> None:
    """With a placement: one model copy, so no work-load split and no row-sparse tables (data
    parallelism's), and a batch that micro-batches fit."""
    if cfg.work_load_list is not None:
        raise ConfigError("work_load_list splits a batch between model copies (data parallelism); "
                          "with placement there is one copy, split by layers: drop one of the two")
    if cfg.kvstore.row_sparse:
        raise ConfigError("kvstore.row_sparse=true trains with data parallelism; with placement (model parallelism) "
                          "the embeddings train dense: set kvstore.row_sparse=false or placement=null")
    if cfg.micro_batches > cfg.batch_size:
        raise ConfigError(f"micro_batches={cfg.micro_batches} is more than batch_size={cfg.batch_size}; every "
                          "micro-batch needs at least one example")


def step_options(cfg: Any, names: tuple[str, ...]) -> None:
    """`precision` is one of `names` (Keras's policies tfkv trains with); loss scaling, clipnorm
    and XLA are data parallelism's (a model split over devices has none of them)."""
    if cfg.precision not in names:
        raise ConfigError(f"precision={cfg.precision!r} is not a policy tfkv trains with; choose one of "
                          f"{', '.join(names)} (e.g. precision=mixed_bfloat16)")
    if cfg.placement is not None and cfg.precision != "float32":
        # the layer groups' inputs are float32 (rounded to the half type they would be cast to:
        # an embedding's ids above 256 in bfloat16), and float16 needs loss scaling
        raise ConfigError(f"precision={cfg.precision} is data parallelism's; a model split over devices "
                          "(placement) trains in float32: set precision=float32 or placement=null")
    if cfg.placement is not None and cfg.jit_compile:
        raise ConfigError("jit_compile=true compiles each model copy's step (data parallelism); a model split "
                          "over devices (placement) is not compiled with XLA: set jit_compile=false or placement=null")
    if cfg.placement is not None and cfg.optimizer.get("clipnorm") is not None:
        raise ConfigError("optimizer.clipnorm clips each model copy's gradient (data parallelism); a model split "
                          "over devices (placement) is not clipped by norm: use optimizer.clip_gradient or placement=null")


def checkpointing(c: Any) -> None:
    """checkpoint.every_steps, every_minutes and keep_last: positive, or null."""
    for key, least in (("every_steps", 1), ("keep_last", 1)):
        value = getattr(c, key)
        if value is not None and value < least:
            raise ConfigError(f"checkpoint.{key}={value} must be at least {least}, or null "
                              f"({'no step checkpoints' if key == 'every_steps' else 'keep every checkpoint'})")
    if c.every_minutes is not None and not 0 < c.every_minutes < float("inf"):
        raise ConfigError(f"checkpoint.every_minutes={c.every_minutes} must be positive, or null (no timed checkpoints)")


def resume(cfg: Any, no: tuple[str, ...]) -> None:
    """resume is a bool, `auto` or a directory; eval_only needs one (`no`: what spells "no checkpoint")."""
    value = cfg.resume
    if not isinstance(value, (bool, str)):
        raise ConfigError(f"resume={value!r} must be true, false, auto or a run directory")
    if cfg.eval_only and (value is False or str(value).lower() in no):
        raise ConfigError("eval_only=true evaluates a checkpoint, but resume is false; name it with "
                          "resume=<run directory or checkpoint directory> (or resume=true: this command's last)")
