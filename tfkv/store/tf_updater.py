"""Applies a `tfkv.optim` rule to TensorFlow variables, keeping its state in variables.

Used by the local/device stores (update in the store) and by data parallelism when every
device updates its own weights (`update_on_kvstore=false`); `update_rows` is MXNet's lazy update
of a row-sparse key (only the rows pushed, and their state, change). All of it can run inside a
tf.function. States save and load as plain numpy arrays keyed "<key>/<state name>".

A half-precision weight (float16, bfloat16) is updated by the rule in float32, as on the
parameter servers (tfkv.ps.updater): without the optimizer's `multi_precision` the weight and
its state are rounded to the weight's dtype every update (MXNet's half update); with it a float32
master weight and float32 state are kept, and the weight gets the master's cast. State variables
are float32 for a half weight either way (saved as such). A master weight is not part of the
saved state: a store made afresh (a restarted job) starts it from the half weight.
"""

from __future__ import annotations

from typing import Any, Hashable

import numpy as np
import tensorflow as tf

from tfkv import optim


class TFOps:
    sqrt = staticmethod(tf.sqrt)
    cos = staticmethod(tf.cos)
    minimum = staticmethod(tf.minimum)
    clip = staticmethod(tf.clip_by_value)

    @staticmethod
    def ge(x: Any, y: float) -> Any:
        return tf.cast(x >= y, tf.float32)


_HALF = (tf.float16, tf.bfloat16)


class TFUpdater:
    def __init__(self, optimizer: optim.Optimizer):
        self.optimizer = optimizer
        self._state: dict[Hashable, tuple[tf.Variable, ...]] = {}
        self._count: dict[Hashable, tf.Variable] = {}
        self._master: dict[Hashable, tf.Variable] = {}  # multi_precision: a half weight's float32 copy

    def create_state(self, key: Hashable, weight: Any, device: str) -> None:
        half = weight.dtype in _HALF
        with tf.device(device):
            self._state[key] = tuple(
                tf.Variable(tf.zeros(weight.shape, tf.float32 if half else weight.dtype), trainable=False,
                            name=f"{n}_{key}")
                for n in self.optimizer.state_names
            )
            self._count[key] = tf.Variable(0, dtype=tf.int64, trainable=False)
            if half and getattr(self.optimizer, "multi_precision", False):
                self._master[key] = tf.Variable(tf.cast(weight, tf.float32), trainable=False, name=f"master_{key}")

    def update(self, key: Hashable, weight: Any, grad: Any) -> None:
        """weight (a variable) <- rule(weight, grad); runs where the state lives."""
        count = self._count[key]
        t = tf.cast(count, tf.float32)
        half = weight.dtype if weight.dtype in _HALF else None
        master = self._master.get(key)
        if half is None:
            w = tf.convert_to_tensor(weight)
        else:
            w = tf.convert_to_tensor(master) if master is not None else tf.cast(weight, tf.float32)
            grad = tf.cast(grad, tf.float32)
        new_weight, new_state = self.optimizer.step(TFOps, t, w, grad, self._state[key])
        if half is not None and master is None:  # MXNet's half update: state rounded to half too
            new_state = tuple(tf.cast(tf.cast(v, half), tf.float32) for v in new_state)
        elif master is not None:
            master.assign(new_weight)
        weight.assign(new_weight if half is None else tf.cast(new_weight, half))
        for var, value in zip(self._state[key], new_state):
            var.assign(value)
        count.assign_add(1)

    def update_rows(self, key: Hashable, weight: Any, ids: Any, grad: Any) -> None:
        """MXNet's lazy update of a row-sparse key: the rule applied to the rows `ids` (unique)
        of `weight` (a float32 or half variable) and of its state, with `grad` their summed gradients,
        and scattered back; other rows and their state are left alone. The count is the key's,
        one per update however many rows it names."""
        count = self._count[key]
        states = self._state[key]
        half = weight.dtype if weight.dtype in _HALF else None
        master = self._master.get(key)
        if half is None:
            rows = tf.gather(weight, ids)
        else:  # a half table's rows updated in float32, as `update` does a half weight
            rows = tf.gather(master, ids) if master is not None else tf.cast(tf.gather(weight, ids), tf.float32)
            grad = tf.cast(grad, tf.float32)
        new_rows, new_state = self.optimizer.step(TFOps, tf.cast(count, tf.float32), rows, grad,
                                                  tuple(tf.gather(s, ids) for s in states))
        if half is not None and master is None:  # MXNet's half update: state rounded to half too
            new_state = tuple(tf.cast(tf.cast(v, half), tf.float32) for v in new_state)
        elif master is not None:
            master.scatter_update(tf.IndexedSlices(new_rows, ids))
        weight.scatter_update(tf.IndexedSlices(new_rows if half is None else tf.cast(new_rows, half), ids))
        for var, value in zip(states, new_state):
            var.scatter_update(tf.IndexedSlices(value, ids))
        count.assign_add(1)

    def get_states(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for key, states in self._state.items():
            for name, var in zip(self.optimizer.state_names, states):
                out[f"{key}/{name}"] = var.numpy()
            out[f"{key}/count"] = np.asarray(self._count[key].numpy())
        return out

    def set_states(self, states: dict[str, np.ndarray]) -> None:
        for key, vars_ in self._state.items():
            for name, var in zip(self.optimizer.state_names, vars_):
                var.assign(_entry(states, f"{key}/{name}", var.shape))
            self._count[key].assign(int(_entry(states, f"{key}/count", ())))


def _entry(states: dict[str, np.ndarray], name: str, shape: Any) -> np.ndarray:
    if name not in states:
        raise ValueError(f"optimizer state has no entry {name!r}: was it saved for another model "
                         "or another optimizer?")
    value = np.asarray(states[name])
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"optimizer state {name!r} has shape {value.shape}, expected {tuple(shape)}")
    return value
