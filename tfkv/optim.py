"""Optimizer update rules, written once as plain arithmetic and run by every KVStore.

A rule is a pure function of (update count, weight, gradient, state) over an array namespace
`ops`: the local/device stores run it with TensorFlow ops inside the training graph, the
parameter servers run it with numpy. One definition keeps `local` and `dist_*` numerically
alike. The formulas are MXNet's (the received gradient times rescale_grad, clipped to
clip_gradient, weight decay added, momentum as a velocity), and `create` takes MXNet's names
and arguments.
Optimizers are plain dataclasses so they travel between processes as JSON, never as pickles.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from types import UnionType
from typing import Any, Optional, Protocol, Union, get_args, get_origin, get_type_hints

import numpy as np

from tfkv import values


class Ops(Protocol):
    """The few array functions a rule needs beyond + - * / **."""

    def sqrt(self, x: Any) -> Any: ...
    def cos(self, x: Any) -> Any: ...
    def minimum(self, x: Any, y: Any) -> Any: ...
    def clip(self, x: Any, lo: float, hi: float) -> Any: ...
    def ge(self, x: Any, y: float) -> Any:
        """1.0 where x >= y else 0.0, as a float."""


class NumpyOps:
    sqrt = staticmethod(np.sqrt)
    cos = staticmethod(np.cos)
    minimum = staticmethod(np.minimum)
    clip = staticmethod(np.clip)

    @staticmethod
    def ge(x: Any, y: float) -> Any:
        return np.float32(np.asarray(x) >= y)


@dataclass
class Schedule:
    """Learning rate as a function of the number of updates already applied to a key."""

    name: str = "constant"  # constant | step | cosine
    lr: float = 0.1
    factor: float = 0.1  # step
    milestones: list[int] = field(default_factory=list)  # step: update counts
    total: int = 1  # cosine: update count at which the rate reaches 0
    warmup: int = 0  # updates of linear warm-up

    def __post_init__(self) -> None:
        _check_fields(self, "schedule")

    def __call__(self, t: Any, ops: Ops) -> Any:
        lr: Any = self.lr
        if self.name == "step":
            drops = sum((ops.ge(t, m) for m in self.milestones), 0.0)
            lr = self.lr * self.factor**drops
        elif self.name == "cosine":
            lr = self.lr * 0.5 * (1.0 + ops.cos(math.pi * ops.minimum(t, float(self.total)) / self.total))
        if self.warmup > 0:
            lr = lr * ops.minimum((t + 1.0) / self.warmup, 1.0)
        return lr


def _scaled(opt: Any, ops: Ops, grad: Any) -> Any:
    """MXNet's `rescale_grad * grad` (None: 1, MXNet's default)."""
    return grad if opt.rescale_grad is None or opt.rescale_grad == 1 else grad * opt.rescale_grad


def _clipped(opt: Any, ops: Ops, g: Any) -> Any:
    """MXNet's clip_gradient: g into [-c, c]; None leaves g alone."""
    return ops.clip(g, -opt.clip_gradient, opt.clip_gradient) if opt.clip_gradient else g


@dataclass
class SGD:
    """MXNet's SGD: g = clip(rescale_grad * grad, clip_gradient) + wd*w; w -= lr * g, or with
    momentum v = m*v - lr*g; w += v.

    `rescale_grad`: the gradient a store receives is multiplied by it first. MXNet's workers push
    gradient sums over their batch and Module sets rescale_grad = 1/batch (times the workers of a
    `dist_sync` job); tfkv's DataParallel and ModelParallel do the same when it is None (not set).
    Anywhere else None means 1, MXNet's default."""

    schedule: Schedule = field(default_factory=Schedule)
    momentum: float = 0.0
    wd: float = 0.0
    rescale_grad: Optional[float] = None
    clip_gradient: Optional[float] = None
    # MXNet's: a half-precision key's update runs on a float32 master copy of the weight with a
    # float32 state, and the key holds its cast (without: the update reads and writes half)
    multi_precision: bool = False
    name: str = "sgd"

    def __post_init__(self) -> None:
        _check_fields(self, "sgd")

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def step(self, ops: Ops, t: Any, weight: Any, grad: Any, state: tuple) -> tuple[Any, tuple]:
        lr = self.schedule(t, ops)
        g = _clipped(self, ops, _scaled(self, ops, grad))  # MXNet clips before adding wd
        if self.wd:
            g = g + self.wd * weight
        if self.momentum:
            v = self.momentum * state[0] - lr * g
            return weight + v, (v,)
        return weight - lr * g, ()


@dataclass
class Adam:
    """MXNet's Adam: g = clip(rescale_grad * grad + wd*w, clip_gradient), bias correction folded
    into the rate. `rescale_grad` as for SGD."""

    schedule: Schedule = field(default_factory=lambda: Schedule(lr=0.001))
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    wd: float = 0.0
    rescale_grad: Optional[float] = None
    clip_gradient: Optional[float] = None
    multi_precision: bool = False  # as SGD's
    name: str = "adam"

    def __post_init__(self) -> None:
        _check_fields(self, "adam")

    state_names = ("mean", "var")

    def step(self, ops: Ops, t: Any, weight: Any, grad: Any, state: tuple) -> tuple[Any, tuple]:
        t1 = t + 1.0
        g = _scaled(self, ops, grad)
        if self.wd:
            g = g + self.wd * weight
        g = _clipped(self, ops, g)  # MXNet's Adam clips after adding wd
        m = self.beta1 * state[0] + (1.0 - self.beta1) * g
        v = self.beta2 * state[1] + (1.0 - self.beta2) * g * g
        lr = self.schedule(t, ops) * ops.sqrt(1.0 - self.beta2**t1) / (1.0 - self.beta1**t1)
        return weight - lr * m / (ops.sqrt(v) + self.epsilon), (m, v)


Optimizer = SGD | Adam

_OPTIMIZERS: dict[str, type] = {"sgd": SGD, "adam": Adam}
_SCHEDULES = ("constant", "step", "cosine")


def names() -> list[str]:
    return sorted(_OPTIMIZERS)


def schedule_names() -> list[str]:
    return list(_SCHEDULES)


def to_dict(opt: Optimizer) -> dict[str, Any]:
    """A JSON-safe description, for sending an optimizer to the parameter servers."""
    return asdict(opt)


def from_dict(d: Any) -> Optimizer:
    """The optimizer that `to_dict` described (as sent to the parameter servers); ValueError
    naming the field for anything else: an unknown name or field, a value of the wrong type,
    a setting that would make the weights NaN."""
    name = d.get("name") if isinstance(d, dict) else None
    kind = _OPTIMIZERS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ValueError(f"optimizer {str(name)[:40]!r} is unknown; choose one of {', '.join(names())}")
    return _build(kind, d, name)


def _build(cls: type, d: Any, where: str) -> Any:
    """cls(**d), its dataclass fields built from nested dicts, after refusing unknown fields."""
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be an object, not {str(d)[:40]!r}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(str(k)[:40] for k in d if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; it has {', '.join(known)}")
    hints = get_type_hints(cls)
    return cls(**{k: _build(hints[k], v, f"{where}.{k}") if is_dataclass(hints[k]) else v for k, v in d.items()})


# What a field must hold beyond its declared type (checked for every field: a float is a finite
# number, an int an integer, ...), by field name, wherever it occurs: values that make the
# update NaN or meaningless are refused when an optimizer is made, not found in the weights.
# The rate `lr` is any finite number, as in MXNet, whose KVStore tests build an "add what you
# receive" updater as SGD with learning_rate=-1; whether a rate suits training is the
# tfkv-run config's check (tfkv.check), not the store API's.
_RANGES: dict[str, tuple[Any, str]] = {
    "total": (lambda v: v >= 1, "at least 1 (the update count where the cosine rate reaches 0)"),
    "warmup": (lambda v: v >= 0, "at least 0"),
    "milestones": (lambda v: all(m >= 0 for m in v), "a list of update counts of at least 0"),
    "momentum": (lambda v: v >= 0, "at least 0"),
    "beta1": (lambda v: 0 <= v < 1, "from 0 to below 1"),
    "beta2": (lambda v: 0 <= v < 1, "from 0 to below 1"),
    "epsilon": (lambda v: v > 0, "above 0"),
    "rescale_grad": (lambda v: v is None or v > 0, "above 0, or null (see SGD)"),
    "clip_gradient": (lambda v: v is None or v > 0, "above 0, or null for no clipping"),
    "multi_precision": (lambda v: isinstance(v, bool), "true or false"),
}


def _fits(value: Any, hint: Any) -> bool:
    if get_origin(hint) in (Union, UnionType):
        return any(_fits(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return values.is_number(value)
    if hint is int:
        return values.is_integer(value)
    if hint is str:
        return isinstance(value, str)
    if get_origin(hint) is list:
        return isinstance(value, list) and all(_fits(v, get_args(hint)[0]) for v in value)
    if is_dataclass(hint):
        return isinstance(value, hint)
    return True


_KINDS = {float: "a finite number", int: f"an integer below 2**{values.MAX_INT.bit_length() - 1}", str: "a string", type(None): "null"}


def _check_fields(obj: Any, label: str) -> None:
    """Every field of `obj` fits its declared type and range: ValueError naming it otherwise."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        where = f"{label}.{f.name}={repr(value)[:40]}"
        if not _fits(value, hint):
            kinds = [_KINDS.get(h, getattr(h, "__name__", str(h))) for h in (get_args(hint) or (hint,))]
            if get_origin(hint) is list:
                kinds = [f"a list of {getattr(get_args(hint)[0], '__name__', 'item')}s"]
            raise ValueError(f"{where} must be {' or '.join(kinds)}")
        check, what = _RANGES.get(f.name, (None, ""))
        if check is not None and not check(value):
            raise ValueError(f"{where} must be {what}")
    allowed = _SCHEDULES if isinstance(obj, Schedule) else (label,)
    if obj.name not in allowed:
        raise ValueError(f"{label}.name={obj.name!r} is unknown; choose one of {', '.join(allowed)}")


def from_config(cfg: Any, steps_per_epoch: int, epochs: int) -> Optimizer:
    """Build from a `tfkv.config.OptimizerConfig`, turning epochs into update counts."""
    s = cfg.schedule
    schedule = Schedule(
        name=s.name,
        lr=float(cfg.lr),
        factor=float(s.factor),
        milestones=[int(e * steps_per_epoch) for e in s.milestones],
        total=max(1, epochs * steps_per_epoch),
        warmup=int(s.warmup_epochs * steps_per_epoch),
    )
    scaling = {"rescale_grad": _maybe_float(cfg.rescale_grad), "clip_gradient": _maybe_float(cfg.clip_gradient),
               "multi_precision": bool(getattr(cfg, "multi_precision", False))}
    if cfg.name == "sgd":
        return SGD(schedule=schedule, momentum=float(cfg.momentum), wd=float(cfg.wd), **scaling)
    return Adam(schedule=schedule, beta1=float(cfg.beta1), beta2=float(cfg.beta2),
                epsilon=float(cfg.epsilon), wd=float(cfg.wd), **scaling)


def _maybe_float(value: Any) -> float | None:
    return None if value is None else float(value)


def with_rescale(opt: Optimizer, examples: int) -> Optimizer:
    """`opt` with rescale_grad = 1/examples unless it already has one: what MXNet's Module does
    for the gradient sums of `examples` examples that one update applies."""
    return opt if opt.rescale_grad is not None else replace(opt, rescale_grad=1.0 / examples)


# MXNet's constructor arguments (mx.optimizer.create(name, **kwargs)) and tfkv's field for each.
_MXNET_ARGS = {
    "sgd": ("learning_rate", "momentum", "wd", "rescale_grad", "clip_gradient", "multi_precision"),
    "adam": ("learning_rate", "beta1", "beta2", "epsilon", "wd", "rescale_grad", "clip_gradient", "multi_precision"),
}
_MXNET_LR = {"sgd": 0.01, "adam": 0.001}  # MXNet's default learning rates


def create(name: str, **kwargs: Any) -> Optimizer:
    """MXNet's `mx.optimizer.create("sgd", learning_rate=0.1, momentum=0.9, wd=1e-4,
    rescale_grad=1/128, clip_gradient=5)`: the name in any case, MXNet's argument names, defaults
    and meaning. An argument tfkv has no equivalent for is refused, named. `lazy_update=True`
    (MXNet's default) is what tfkv always does: a row-sparse key's update touches only the rows
    pushed (their state too), a dense key's every row; False is refused."""
    kind = str(name).lower()
    if kind not in _MXNET_ARGS:
        raise ValueError(f"optimizer {name!r} is not in tfkv; choose one of {', '.join(names())}")
    lazy = kwargs.pop("lazy_update", True)
    if not isinstance(lazy, (bool, np.bool_)) or not lazy:
        raise ValueError(f"optimizer {kind}: lazy_update={lazy!r} is not supported by tfkv; it always updates a "
                         "row-sparse key lazily (only the rows pushed, MXNet's default lazy_update=True): drop the "
                         "argument")
    unknown = sorted(set(kwargs) - set(_MXNET_ARGS[kind]))
    if unknown:
        raise ValueError(f"optimizer {kind}: argument(s) {', '.join(unknown)} not supported by tfkv; "
                         f"it takes {', '.join(_MXNET_ARGS[kind])}")
    lr = float(kwargs.pop("learning_rate", _MXNET_LR[kind]))
    return _OPTIMIZERS[kind](schedule=Schedule(lr=lr), **kwargs)
