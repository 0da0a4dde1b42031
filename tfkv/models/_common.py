"""The classifier layer the built-in models share."""

from __future__ import annotations

import keras


def logits(x: keras.KerasTensor, num_classes: int) -> keras.KerasTensor:
    """The classifier layer, always named 'fc'.

    Pinned to float32 so a global mixed-precision policy still yields float32 logits for the loss.
    """
    return keras.layers.Dense(num_classes, name="fc", dtype="float32")(x)
