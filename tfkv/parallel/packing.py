"""A dist store's 2-bit compression run inside the compiled step: each key's gradients (summed
over this machine's devices on the device that sums them) are quantised and packed as
TensorFlow ops (tfkv.store.tf_compression) next to where they were computed, a GPU's on the
GPU, so only the uint32 words leave the graph for the push (`KVStore.pushpull_packed_async`).

The error feedback lives here, as variables on that device: per key a flat float32 residual and,
with 2bit_momentum, a velocity. The words, residuals and velocities are the numpy Sender's
(tfkv.ps.compression), bit for bit. The store keeps this state with its worker's for its
checkpoints (`hold_feedback`). Chosen once, when the exchange is built, from the store's
declared `packed_push` and whether it compresses (`Packing.for_store`).
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, Sequence

import numpy as np
import tensorflow as tf

from tfkv.store import tf_compression


class Packing:
    """Per key of `keys`: its residual (and velocity) on `device`, and its gradients packed."""

    def __init__(self, store: Any, keys: Sequence[Hashable], device: str) -> None:
        self.store = store
        self.device = device
        self.plans = {k: store.packing(k) for k in keys}
        self.residuals: dict[Hashable, tf.Variable] = {}
        self.velocities: dict[Hashable, tf.Variable] = {}
        with tf.device(device):
            for k, plan in self.plans.items():
                self.residuals[k] = tf.Variable(tf.zeros([plan.size], tf.float32), trainable=False)
                if plan.momentum is not None:
                    self.velocities[k] = tf.Variable(tf.zeros([plan.size], tf.float32), trainable=False)
        store.hold_feedback(self)
        logging.getLogger("tfkv").info("gradient compression: pushes packed in the compiled step on %s", device)

    @classmethod
    def for_store(cls, store: Any, keys: Sequence[Hashable], device: str) -> Packing | None:
        """The packing of a store that takes packed pushes and compresses; None otherwise."""
        if not getattr(store, "packed_push", False) or not keys or store.packing(keys[0]) is None:
            return None
        return cls(store, keys, device)

    def pack(self, key: Hashable, values: list[Any]) -> list[tf.Tensor]:
        """The words of each part of `key`'s push: `values` (one per device) summed, then packed.
        The momentum is the store's when traced (set_optimizer before the first step)."""
        plan = self.store.packing(key)
        with tf.device(self.device):
            total = values[0] if len(values) == 1 else tf.add_n([tf.cast(v, tf.float32) for v in values])
            return tf_compression.pack_parts(total, self.residuals[key], plan.threshold, plan.bounds,
                                             self.velocities.get(key), plan.momentum or 0.0)

    def feedback_state(self) -> dict[tuple[Hashable, str], np.ndarray]:
        """Every key's residual (and velocity), for the store's checkpoint of this worker."""
        held = {(k, "residual"): v for k, v in self.residuals.items()}
        held.update({(k, "velocity"): v for k, v in self.velocities.items()})
        return {name: var.numpy() for name, var in held.items()}

    def restore_feedback(self, saved: dict[tuple[Hashable, str], np.ndarray]) -> None:
        """Put back what `feedback_state` gave; a key without an entry starts from zero."""
        for what, by_key in (("residual", self.residuals), ("velocity", self.velocities)):
            for k, var in by_key.items():
                value = saved.get((k, what))
                var.assign(value.reshape(-1) if value is not None else tf.zeros_like(var))
