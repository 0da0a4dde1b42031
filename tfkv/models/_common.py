"""The classifier layer the built-in models share."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras


def logits(x: keras.KerasTensor, num_classes: int) -> keras.KerasTensor:
    """The classifier layer, always named 'fc'.

    Pinned to float32 so a global mixed-precision policy still yields float32 logits for the loss.
    """
    import keras  # here, not at import: config validation locates builders without TensorFlow
    return keras.layers.Dense(num_classes, name="fc", dtype="float32")(x)
