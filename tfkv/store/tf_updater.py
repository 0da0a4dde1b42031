"""Applies a `tfkv.optim` rule to TensorFlow variables, keeping its state in variables.

Used by the local/device stores (update in the store) and by data parallelism when every
device updates its own weights (`update_on_kvstore=false`). All of it can run inside a
tf.function. States save and load as plain numpy arrays keyed "<key>/<state name>".
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


class TFUpdater:
    def __init__(self, optimizer: optim.Optimizer):
        self.optimizer = optimizer
        self._state: dict[Hashable, tuple[tf.Variable, ...]] = {}
        self._count: dict[Hashable, tf.Variable] = {}

    def create_state(self, key: Hashable, weight: Any, device: str) -> None:
        with tf.device(device):
            self._state[key] = tuple(
                tf.Variable(tf.zeros(weight.shape, weight.dtype), trainable=False, name=f"{n}_{key}")
                for n in self.optimizer.state_names
            )
            self._count[key] = tf.Variable(0, dtype=tf.int64, trainable=False)

    def update(self, key: Hashable, weight: Any, grad: Any) -> None:
        """weight (a variable) <- rule(weight, grad); runs where the state lives."""
        count = self._count[key]
        t = tf.cast(count, tf.float32)
        new_weight, new_state = self.optimizer.step(TFOps, t, tf.convert_to_tensor(weight), grad,
                                                    self._state[key])
        weight.assign(new_weight)
        for var, value in zip(self._state[key], new_state):
            var.assign(value)
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
