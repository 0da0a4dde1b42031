"""Applies a `tfkv.optim` rule to numpy arrays: the optimizer as the parameter servers run it.

Updates return a new weight array instead of writing in place, because the previous value may
still be in flight in a zero-copy send. Optimizer state is never sent, so SGD (the common case)
updates its momentum in place with one reusable scratch buffer per key: on a server the update
of a large key is memory-bound, and fresh multi-megabyte temporaries cost page faults.

A half-precision key (float16, bfloat16) is updated by the same float32 arithmetic: without the
optimizer's `multi_precision` its weight and state are read from and rounded back to the key's
dtype every update (MXNet's float16 update: an lr*grad below half's resolution of the weight is
lost); with it a float32 master copy of the weight and a float32 state are kept here, and the
key holds the master's cast (MXNet's multi_precision). State is held in float32 containers
either way, so GET_STATE and checkpoints are float32 for every key; the master copy is not
part of them (a restarted server starts it from the half weight).

A row-sparse key's shard is updated lazily (`update_rows`, MXNet's lazy_update): only the rows
pushed change, their per-row state is gathered, stepped by the same rule and scattered back, in
place (a row pull's reply is a fresh gathered array, so nothing in flight views the shard); the
other rows and their state stay as they are, and the update count is per key.
"""

from __future__ import annotations

import numpy as np

from tfkv import optim


class NumpyUpdater:
    def __init__(self, optimizer: optim.Optimizer):
        self.optimizer = optimizer
        self.state: dict[int, tuple[np.ndarray, ...]] = {}
        self.count: dict[int, int] = {}
        self._scratch: dict[int, np.ndarray] = {}
        self.master: dict[int, np.ndarray] = {}  # multi_precision: a half key's float32 weight

    def update(self, key: int, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """The new weight of `key` (of `weight`'s dtype) after `grad`."""
        if weight.dtype != np.float32:
            return self._update_half(key, weight, grad)
        return self._update32(key, weight, grad)

    def _update_half(self, key: int, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        grad = grad.astype(np.float32, copy=False)
        if getattr(self.optimizer, "multi_precision", False):
            master = self.master.get(key)
            new = self._update32(key, weight.astype(np.float32) if master is None else master, grad)
            self.master[key] = new
        else:
            new = self._update32(key, weight.astype(np.float32), grad)
            self.state[key] = tuple(s.astype(weight.dtype).astype(np.float32) for s in self.state[key])
        return new.astype(weight.dtype)

    def _update32(self, key: int, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        if key not in self.state:
            self.state[key] = tuple(np.zeros_like(weight) for _ in self.optimizer.state_names)
            self.count[key] = 0
        if isinstance(self.optimizer, optim.SGD):
            return self._sgd(key, weight, grad)
        new_weight, new_state = self.optimizer.step(optim.NumpyOps, np.float32(self.count[key]),
                                                    weight, grad, self.state[key])
        self.state[key] = tuple(np.asarray(s, np.float32) for s in new_state)
        self.count[key] += 1
        return np.asarray(new_weight, np.float32)

    def _sgd(self, key: int, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """optim.SGD.step, computed in place: g = clip(rescale*grad) + wd*w; v = m*v - lr*g; w + v."""
        opt = self.optimizer
        lr = np.float32(opt.schedule(np.float32(self.count[key]), optim.NumpyOps))
        rescale = 1.0 if opt.rescale_grad is None else float(opt.rescale_grad)
        step = self._scratch.get(key)
        if step is None or step.shape != weight.shape:
            step = self._scratch[key] = np.empty_like(weight)
        if opt.clip_gradient:
            np.multiply(grad, np.float32(rescale), out=step)
            np.clip(step, -opt.clip_gradient, opt.clip_gradient, out=step)
            if opt.wd:
                step += np.float32(opt.wd) * weight  # a temporary, only with both clip and wd
            step *= lr
        elif opt.wd:
            # lr*(rescale*g + wd*w) as lr*rescale*(g + (wd/rescale)*w): no temporary
            np.multiply(weight, np.float32(opt.wd / rescale), out=step)
            step += grad
            step *= np.float32(lr * rescale)
        else:
            np.multiply(grad, np.float32(lr * rescale), out=step)
        self.count[key] += 1
        if opt.momentum:
            (v,) = self.state[key]
            v *= np.float32(opt.momentum)
            v -= step
            return np.add(weight, v)
        return np.subtract(weight, step)

    def update_rows(self, key: int, table: np.ndarray, rows: np.ndarray, grad: np.ndarray) -> None:
        """Update `table` (local rows, width) in place at its unique `rows` by `grad` (len(rows),
        width). A half table's rows are updated in float32 as `update` does a half weight: state
        float32, rounded to half each update, or a float32 master copy with multi_precision."""
        if key not in self.state:
            self.state[key] = tuple(np.zeros(table.shape, np.float32) for _ in self.optimizer.state_names)
            self.count[key] = 0
        state = self.state[key]
        t = np.float32(self.count[key])
        half = table.dtype != np.float32
        master = None
        if half and getattr(self.optimizer, "multi_precision", False):
            master = self.master.get(key)
            if master is None:
                master = self.master[key] = table.astype(np.float32)
        weight = master[rows] if master is not None else table[rows].astype(np.float32, copy=False)
        grad = grad.astype(np.float32, copy=False)
        new_weight, new_state = self.optimizer.step(optim.NumpyOps, t, weight, grad, tuple(s[rows] for s in state))
        if master is not None:
            master[rows] = new_weight
        table[rows] = new_weight  # rounded to a half table's dtype
        for s, new in zip(state, new_state):
            s[rows] = np.asarray(new).astype(table.dtype).astype(np.float32) if half and master is None else new
        self.count[key] += 1

    def get_rows(self, key: int, rows: np.ndarray, width: int) -> tuple[list[np.ndarray], int]:
        """The states of a row-sparse key at `rows` (zeros before its first update), and its count."""
        state = self.state.get(key)
        if state is None:
            return [np.zeros((len(rows), width), np.float32) for _ in self.optimizer.state_names], self.count.get(key, 0)
        return [s[rows] for s in state], self.count[key]

    def set_rows(self, key: int, table: np.ndarray, rows: np.ndarray, states: list[np.ndarray], count: int) -> None:
        """Set a row-sparse key's states at `rows` (each (len(rows), width)) and its count."""
        if key not in self.state:
            self.state[key] = tuple(np.zeros(table.shape, np.float32) for _ in self.optimizer.state_names)
        for s, new in zip(self.state[key], states):
            s[rows] = new
        self.count[key] = int(count)

    def get(self, key: int, size: int) -> tuple[list[np.ndarray], int]:
        """The states of `key` (zeros before its first update) and its update count."""
        states = self.state.get(key) or tuple(np.zeros(size, np.float32) for _ in self.optimizer.state_names)
        return list(states), self.count.get(key, 0)

    def set(self, key: int, states: list[np.ndarray], count: int) -> None:
        self.state[key] = tuple(np.array(s, np.float32) for s in states)
        self.count[key] = int(count)
