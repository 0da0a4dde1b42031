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
from tfkv.ps.reduction import Reducer

#: values an SGD update takes per block: its step, weight, gradient, velocity and new weight
#: (1.25 MiB of float32 in all) stay in a core's cache between the block's passes
BLOCK = 1 << 16


class NumpyUpdater:
    def __init__(self, optimizer: optim.Optimizer, reducer: Reducer | None = None):
        self.optimizer = optimizer
        self.reducer = reducer  # a server's threads for large keys (None: this thread alone)
        self.state: dict[int, tuple[np.ndarray, ...]] = {}
        self.count: dict[int, int] = {}
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
            self.state[key] = tuple(np.zeros(weight.shape, np.float32) for _ in self.optimizer.state_names)
            self.count[key] = 0
        t = np.float32(self.count[key])
        self.count[key] += 1
        if isinstance(self.optimizer, optim.SGD):
            return self._sgd(key, t, weight, grad)
        return self._step(key, t, weight, grad)

    def _step(self, key: int, t: np.float32, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """The optimizer's own rule (optim.NumpyOps), range by range over the threads: each value's
        new weight and state depend on its own values alone."""
        new = np.empty(weight.shape, np.float32)
        states = [np.empty(s.shape, np.float32) for s in self.state[key]]
        w, g, old = _flat(weight), _flat(grad), [_flat(s) for s in self.state[key]]
        out, out_states = _flat(new), [_flat(s) for s in states]

        def span(s: slice) -> None:
            new_weight, new_state = self.optimizer.step(optim.NumpyOps, t, w[s], g[s], tuple(x[s] for x in old))
            out[s] = new_weight
            for dst, value in zip(out_states, new_state):
                dst[s] = value

        self._run(span, weight.size)
        self.state[key] = tuple(states)
        return new

    def _sgd(self, key: int, t: np.float32, weight: np.ndarray, grad: np.ndarray) -> np.ndarray:
        """optim.SGD.step, computed block by block (`BLOCK` values, so a block's step and velocity
        stay in the CPU's cache between its few passes) and range by range over the threads:
        g = clip(rescale*grad) + wd*w; v = m*v - lr*g; w + v. The same float32 operations per
        value whatever the blocks and threads, and no temporary the size of the key."""
        opt = self.optimizer
        lr = np.float32(opt.schedule(t, optim.NumpyOps))
        rescale = 1.0 if opt.rescale_grad is None else float(opt.rescale_grad)
        new = np.empty(weight.shape, np.float32)
        w, g, out = _flat(weight), _flat(grad), _flat(new)
        v = _flat(self.state[key][0]) if opt.momentum else None

        def span(s: slice) -> None:
            step = np.empty(min(BLOCK, s.stop - s.start), np.float32)
            for lo in range(s.start, s.stop, BLOCK):
                b = slice(lo, min(lo + BLOCK, s.stop))
                _sgd_block(opt, lr, rescale, w[b], g[b], None if v is None else v[b], out[b], step[:b.stop - lo])

        self._run(span, weight.size)
        return new

    def _run(self, fn, size: int) -> None:
        if self.reducer is None:
            fn(slice(0, size))
        else:
            self.reducer.run(fn, size)

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
        self.state[key] = tuple(np.array(s, np.float32, order="C") for s in states)
        self.count[key] = int(count)


def _flat(a: np.ndarray) -> np.ndarray:
    """A key's values as one row: a view of what is written (C-ordered here), of a key's pushed
    and stored arrays too (contiguous on a server; elsewhere a copy, only read)."""
    return a.reshape(-1)


def _sgd_block(opt: optim.SGD, lr: np.float32, rescale: float, w: np.ndarray, g: np.ndarray,
               v: np.ndarray | None, out: np.ndarray, step: np.ndarray) -> None:
    """One block of NumpyUpdater._sgd: `out` = the new weights, `v` (the velocity) updated in place."""
    if opt.clip_gradient:
        np.multiply(g, np.float32(rescale), out=step)
        np.clip(step, -opt.clip_gradient, opt.clip_gradient, out=step)
        if opt.wd:
            step += np.float32(opt.wd) * w  # a block-sized temporary, only with both clip and wd
        step *= lr
    elif opt.wd:
        # lr*(rescale*g + wd*w) as lr*rescale*(g + (wd/rescale)*w): no temporary
        np.multiply(w, np.float32(opt.wd / rescale), out=step)
        step += g
        step *= np.float32(lr * rescale)
    else:
        np.multiply(g, np.float32(lr * rescale), out=step)
    if v is not None:
        v *= np.float32(opt.momentum)
        v -= step
        np.add(w, v, out=out)
    else:
        np.subtract(w, step, out=out)
