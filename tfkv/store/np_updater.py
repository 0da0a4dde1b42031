"""Applies a `tfkv.optim` rule to numpy arrays: the optimizer as the parameter servers run it.

Updates return new arrays instead of writing in place, because the previous value may still be
in flight in a zero-copy send.
"""

from __future__ import annotations

import numpy as np

from tfkv import optim


class NumpyUpdater:
    def __init__(self, optimizer: optim.Optimizer):
        self.optimizer = optimizer
        self.state: dict[int, tuple[np.ndarray, ...]] = {}
        self.count: dict[int, int] = {}

    def update(self, key: int, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        if key not in self.state:
            self.state[key] = tuple(np.zeros_like(weight) for _ in self.optimizer.state_names)
            self.count[key] = 0
        new_weight, new_state = self.optimizer.step(optim.NumpyOps, np.float32(self.count[key]),
                                                    weight, grad, self.state[key])
        self.state[key] = tuple(np.asarray(s, np.float32) for s in new_state)
        self.count[key] += 1
        return np.asarray(new_weight, np.float32)

    def get(self, key: int, size: int) -> tuple[list[np.ndarray], int]:
        """The states of `key` (zeros before its first update) and its update count."""
        states = self.state.get(key) or tuple(np.zeros(size, np.float32) for _ in self.optimizer.state_names)
        return list(states), self.count.get(key, 0)

    def set(self, key: int, states: list[np.ndarray], count: int) -> None:
        self.state[key] = tuple(np.array(s, np.float32) for s in states)
        self.count[key] = int(count)
