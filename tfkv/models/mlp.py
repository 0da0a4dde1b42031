"""Multi-layer perceptron: flatten, ReLU hidden layers (cfg.hidden), a linear classifier."""

from __future__ import annotations

from typing import Any

import keras

from tfkv.models._common import logits


def build(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> keras.Model:
    """Flatten -> [Dense(h, relu) (+ Dropout)] for h in cfg.hidden -> Dense(num_classes) logits."""
    inputs = keras.Input(shape=tuple(input_shape), name="input")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for i, units in enumerate(cfg.hidden, start=1):
        x = keras.layers.Dense(int(units), activation="relu", name=f"dense{i}")(x)
        if cfg.dropout > 0:
            x = keras.layers.Dropout(float(cfg.dropout), name=f"dropout{i}")(x)
    return keras.Model(inputs, logits(x, num_classes), name="mlp")
