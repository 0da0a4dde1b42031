"""Mixed precision: the Keras policy a run builds its model under, the devices that can run it,
and the dynamic loss scale that `mixed_float16` trains with.

Under `mixed_float16` / `mixed_bfloat16` (Keras's policies) layers compute in the half type and
keep float32 variables, so gradients, the KVStore and the optimizer stay float32. float16's
small range makes small gradients underflow to zero, so the loss is multiplied by a scale
before backprop and the gradients divided by it after, as Keras's LossScaleOptimizer does: a
step whose gradients are not all finite is skipped and the scale halved; after
`growth_steps` finite steps in a row it doubles. bfloat16 has float32's range: no scale.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from tfkv.errors import ConfigError

# Keras's LossScaleOptimizer defaults (initial_scale, dynamic_growth_steps)
INITIAL_SCALE = 2.0**15
GROWTH_STEPS = 2000
# The lowest NVIDIA compute capability whose tensor cores take each half type: float16 from
# Volta (7.0, Keras's own mixed_float16 device check), bfloat16 from Ampere (8.0). Below it the
# policy runs in emulation, slower than float32.
NEEDS_CAPABILITY = {"mixed_float16": (7, 0), "mixed_bfloat16": (8, 0)}


def set_policy(precision: str) -> None:
    """Build every model made after this under `precision` (a Keras dtype policy name)."""
    import keras

    keras.mixed_precision.set_global_policy(precision)


def check_devices(precision: str, capabilities: Sequence[tuple[str, tuple[int, int] | None]]) -> None:
    """Refuse, in one line, a policy one of the job's GPUs has no tensor cores for: `capabilities`
    is (device spec, compute capability, None for a CPU) per device. A CPU runs both half types
    (TensorFlow has CPU kernels for them): allowed, as Keras allows it."""
    need = NEEDS_CAPABILITY.get(precision)
    for spec, cc in capabilities:
        if need is not None and cc is not None and tuple(cc) < need:
            raise ConfigError(f"precision={precision}: {spec} has compute capability {cc[0]}.{cc[1]}, below the "
                              f"{need[0]}.{need[1]} whose tensor cores run {precision[6:]} (it would run slower than "
                              "float32); use precision=float32 on this GPU")


def gpu_capabilities(specs: Sequence[str], tf_devices: Sequence[str]) -> list[tuple[str, tuple[int, int] | None]]:
    """(spec, compute capability) of each device; None for CPUs and GPUs that report none."""
    gpus = tf.config.list_physical_devices("GPU")
    out: list[tuple[str, tuple[int, int] | None]] = []
    for spec, name in zip(specs, tf_devices):
        cc = None
        if "GPU" in name.upper():
            index = int(name.rsplit(":", 1)[1])
            if index < len(gpus):
                cc = tf.config.experimental.get_device_details(gpus[index]).get("compute_capability")
        out.append((spec, tuple(cc) if cc else None))
    return out


class LossScale:
    """Dynamic loss scaling's state (two variables, saved with a checkpoint) and its rule, all
    traceable."""

    def __init__(self, initial: float = INITIAL_SCALE, growth_steps: int = GROWTH_STEPS):
        with tf.device("/device:CPU:0"):
            self.scale = tf.Variable(float(initial), dtype=tf.float32, trainable=False, name="loss_scale")
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="loss_scale_good_steps")
        self.growth_steps = int(growth_steps)

    @property
    def variables(self) -> list[tf.Variable]:
        return [self.scale, self.good_steps]

    def scaled(self, loss: Any) -> Any:
        return tf.cast(loss, tf.float32) * self.scale

    def unscaled(self, grads: list[Any]) -> list[Any]:
        inverse = 1.0 / self.scale
        return [None if g is None else g * tf.cast(inverse, g.dtype) for g in grads]

    def update(self, finite: Any) -> None:
        """After a step: finite -> count it (doubling the scale every growth_steps); else halve."""
        finite = tf.convert_to_tensor(finite)
        grown = tf.logical_and(finite, self.good_steps + 1 >= self.growth_steps)
        self.scale.assign(tf.where(finite, tf.where(grown, self.scale * 2.0, self.scale), self.scale * 0.5))
        self.good_steps.assign(tf.where(finite, tf.where(grown, tf.zeros_like(self.good_steps),
                                                         self.good_steps + 1), tf.zeros_like(self.good_steps)))


def all_finite(grads: Sequence[Any]) -> Any:
    """Traceable: True when every gradient (a list of tensors, or lists of them) is finite."""
    flat = [g for g in tf.nest.flatten(list(grads)) if g is not None]
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in flat])
