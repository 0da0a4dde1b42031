"""Optimizer update rules, written once as plain arithmetic and run by every KVStore.

A rule is a pure function of (update count, weight, gradient, state) over an array namespace
`ops`: the local/device stores run it with TensorFlow ops inside the training graph, the
parameter servers run it with numpy. One definition keeps `local` and `dist_*` numerically
alike. The formulas are MXNet's (weight decay added to the gradient, momentum as a velocity).
Optimizers are plain dataclasses so they travel between processes as JSON, never as pickles.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np


class Ops(Protocol):
    """The few array functions a rule needs beyond + - * / **."""

    def sqrt(self, x: Any) -> Any: ...
    def cos(self, x: Any) -> Any: ...
    def minimum(self, x: Any, y: Any) -> Any: ...
    def ge(self, x: Any, y: float) -> Any:
        """1.0 where x >= y else 0.0, as a float."""


class NumpyOps:
    sqrt = staticmethod(np.sqrt)
    cos = staticmethod(np.cos)
    minimum = staticmethod(np.minimum)

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


@dataclass
class SGD:
    """w -= lr * (g + wd*w), with momentum as MXNet: v = m*v - lr*(g + wd*w); w += v."""

    schedule: Schedule = field(default_factory=Schedule)
    momentum: float = 0.0
    wd: float = 0.0
    name: str = "sgd"

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def step(self, ops: Ops, t: Any, weight: Any, grad: Any, state: tuple) -> tuple[Any, tuple]:
        lr = self.schedule(t, ops)
        g = grad + self.wd * weight if self.wd else grad
        if self.momentum:
            v = self.momentum * state[0] - lr * g
            return weight + v, (v,)
        return weight - lr * g, ()


@dataclass
class Adam:
    """Adam with MXNet's bias correction folded into the rate; wd added to the gradient."""

    schedule: Schedule = field(default_factory=lambda: Schedule(lr=0.001))
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    wd: float = 0.0
    name: str = "adam"

    state_names = ("mean", "var")

    def step(self, ops: Ops, t: Any, weight: Any, grad: Any, state: tuple) -> tuple[Any, tuple]:
        t1 = t + 1.0
        g = grad + self.wd * weight if self.wd else grad
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


def from_dict(d: dict[str, Any]) -> Optimizer:
    d = dict(d)
    kind = _OPTIMIZERS.get(d.get("name", ""))
    if kind is None:
        raise ValueError(f"unknown optimizer {d.get('name')!r}")
    d["schedule"] = Schedule(**d.get("schedule", {}))
    return kind(**d)


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
    if cfg.name == "sgd":
        return SGD(schedule=schedule, momentum=float(cfg.momentum), wd=float(cfg.wd))
    return Adam(schedule=schedule, beta1=float(cfg.beta1), beta2=float(cfg.beta2),
                epsilon=float(cfg.epsilon), wd=float(cfg.wd))
