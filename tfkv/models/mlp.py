"""Multi-layer perceptron: flatten, ReLU hidden layers (`hidden`), a linear classifier."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import keras

from tfkv.errors import ConfigError
from tfkv.models._checks import check_dropout
from tfkv.models._common import logits


def build(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (256, 128),
          dropout: float = 0.0) -> keras.Model:
    """Flatten -> [Dense(h, relu) (+ Dropout)] for h in hidden -> Dense(num_classes) logits."""
    import keras  # here, not at import: config validation locates builders without TensorFlow
    check_dropout(dropout)
    if any(int(h) < 1 for h in hidden):
        raise ConfigError(f"model.hidden={list(hidden)} must list layer sizes of at least 1, e.g. [256,128]")
    inputs = keras.Input(shape=tuple(input_shape), name="input")
    x = keras.layers.Flatten(name="flatten")(inputs)
    for i, units in enumerate(hidden, start=1):
        x = keras.layers.Dense(int(units), activation="relu", name=f"dense{i}")(x)
        if dropout > 0:
            x = keras.layers.Dropout(float(dropout), name=f"dropout{i}")(x)
    return keras.Model(inputs, logits(x, num_classes), name="mlp")
