"""LeNet as in MXNet's examples (20/50 filters, 500 hidden units), with ReLU instead of tanh."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras

from tfkv.models._checks import check_dropout, image_size
from tfkv.models._common import logits


def build(input_shape: tuple[int, ...], num_classes: int, dropout: float = 0.0) -> keras.Model:
    """conv5x5(20) -> pool -> conv5x5(50) -> pool -> Dense(500) -> Dense(num_classes) logits.

    'same' padding (unlike the original 'valid') so that 8x8 digits still fit two 2x2 pools.
    """
    import keras  # here, not at import: config validation locates builders without TensorFlow
    check_dropout(dropout)
    # Two 2x2 pools: a 3x3 input would pool down to zero pixels.
    image_size("lenet", input_shape, 4, "2 pooling stages", "model=mlp")
    inputs = keras.Input(shape=tuple(input_shape), name="input")
    x = keras.layers.Conv2D(20, 5, padding="same", activation="relu", name="conv1")(inputs)
    x = keras.layers.MaxPooling2D(2, name="pool1")(x)
    x = keras.layers.Conv2D(50, 5, padding="same", activation="relu", name="conv2")(x)
    x = keras.layers.MaxPooling2D(2, name="pool2")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    x = keras.layers.Dense(500, activation="relu", name="dense1")(x)
    if dropout > 0:
        x = keras.layers.Dropout(float(dropout), name="dropout1")(x)
    return keras.Model(inputs, logits(x, num_classes), name="lenet")
