"""The project's models: any callable that returns a keras.Model.

tfkv passes `input_shape` and `num_classes` (the data's) because the function takes parameters
of those names; the other arguments come from the `model` node of the config (conf/model/*.yaml).
"""

from __future__ import annotations

import keras


def build(input_shape: tuple[int, ...], num_classes: int, width: int = 32, blocks: int = 2) -> keras.Model:
    """A small residual MLP: Dense(width) then `blocks` residual Dense blocks, logits out."""
    inputs = keras.Input(shape=tuple(input_shape), name="features")
    x = keras.layers.Dense(width, activation="relu", name="stem")(inputs)
    for i in range(blocks):
        h = keras.layers.Dense(width, activation="relu", name=f"block{i}_dense")(x)
        x = keras.layers.Add(name=f"block{i}_add")([x, h])
    outputs = keras.layers.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resmlp")
