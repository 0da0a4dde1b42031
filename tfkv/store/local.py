"""The single-machine stores: `local` (sum and update in host memory) and `device` (on the
accelerators, keys spread over them).

Their push/pull are TensorFlow ops, so data parallelism traces them into the same tf.function
as the forward and backward passes: one graph per step, no Python between devices.
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import numpy as np
import tensorflow as tf

from tfkv.store.base import Key, KVStore, gpu_p2p, pairs
from tfkv.store.tf_updater import TFUpdater


class LocalStore(KVStore):
    """Every key lives in host memory (the first CPU device); devices' values are summed there."""

    type = "local"
    traceable = True

    def __init__(self, devices: Sequence[str] | None = None):
        self._devices = list(devices) if devices else ["/device:CPU:0"]
        self._values: dict[Hashable, tf.Variable] = {}
        self._home: dict[Hashable, str] = {}
        self._updater: TFUpdater | None = None
        # Read once: the choice is traced into the step's graph.
        self._sum_on_home = gpu_p2p()

    def _place(self, key: Hashable, value: Any) -> str:
        return "/device:CPU:0"

    def _var(self, key: Hashable) -> tf.Variable:
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first") from None

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        for k, values in pairs(key, value):
            if k in self._values:
                raise ValueError(f"key {k!r} is already initialised")
            home = self._place(k, values[0])
            with tf.device(home):
                self._values[k] = tf.Variable(tf.identity(values[0]), trainable=False)
            self._home[k] = home
            if self._updater is not None:
                self._updater.create_state(k, self._values[k], home)

    def push(self, key: Key | Sequence[Key], value: Any, priority: int = 0) -> None:
        for k, values in pairs(key, value):
            var = self._var(k)
            if len(values) == 1:
                merged = values[0]
            else:
                # Where the devices' values meet: on the key's home device (peer to peer), or,
                # with GPU P2P disabled, in host memory, then the result goes to the home device.
                with tf.device(self._home[k] if self._sum_on_home else "/device:CPU:0"):
                    merged = tf.add_n([tf.identity(v) for v in values])
            with tf.device(self._home[k]):
                if self._updater is not None:
                    self._updater.update(k, var, merged)
                else:
                    var.assign(merged)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0) -> Any:
        results = []
        for k, outs in pairs(key, out):
            var = self._var(k)
            for o in outs:
                o.assign(var)
            if not outs:
                results.append(tf.identity(var))
        if out is None:
            return results if isinstance(key, (list, tuple)) else results[0]
        return None

    def set_optimizer(self, optimizer: Any) -> None:
        self._updater = TFUpdater(optimizer)
        for k, var in self._values.items():
            self._updater.create_state(k, var, self._home[k])

    def _require_updater(self) -> TFUpdater:
        if self._updater is None:
            raise RuntimeError("this store has no optimizer; call set_optimizer() first")
        return self._updater

    def save_optimizer_states(self, fname: str) -> None:
        np.savez(fname, **self._require_updater().get_states())

    def load_optimizer_states(self, fname: str) -> None:
        with np.load(fname, allow_pickle=False) as f:
            self._require_updater().set_states(dict(f))


class DeviceStore(LocalStore):
    """Keys live on the training devices, each on the least loaded so far (by size), as MXNet's
    `device` store; the sum and the update run there."""

    type = "device"

    def __init__(self, devices: Sequence[str] | None = None):
        super().__init__(devices)
        self._load = {d: 0 for d in self._devices}

    def _place(self, key: Hashable, value: Any) -> str:
        home = min(self._devices, key=lambda d: self._load[d])
        self._load[home] += int(np.prod(value.shape))
        return home
