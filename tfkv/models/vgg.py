"""VGG-11 for 32x32 images (the CIFAR variant: one linear classifier after the last pool)."""

from __future__ import annotations


from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras

from tfkv.models._checks import check_dropout, check_width, image_size
from tfkv.models._common import logits

# Channel multiples of width; "M" is a 2x2 max-pool.
_VGG11 = (1, "M", 2, "M", 4, 4, "M", 8, 8, "M", 8, 8, "M")


def build_vgg11(input_shape: tuple[int, ...], num_classes: int, width: int = 64, batch_norm: bool = True,
                dropout: float = 0.0) -> keras.Model:
    """Eight conv3x3 (+BN) + ReLU layers in five pooled blocks, then Flatten -> Dense logits.

    Layers are named block{b}_conv{c} / _bn{c} / _relu{c} and pool{b}, so a checkpoint path reads
    e.g. 'block3_conv2/kernel'.
    """
    import keras  # here, not at import: config validation locates builders without TensorFlow
    pools = _VGG11.count("M")
    image_size("vgg11", input_shape, 2**pools, f"{pools} pooling stages",
               "model=mlp or lenet, or a 32x32 data set")
    width = check_width(width)
    check_dropout(dropout)
    inputs = keras.Input(shape=tuple(input_shape), name="input")
    x = inputs
    block, conv = 1, 1
    for item in _VGG11:
        if item == "M":
            x = keras.layers.MaxPooling2D(2, name=f"pool{block}")(x)
            block, conv = block + 1, 1
            continue
        name = f"block{block}_"
        # A bias before BatchNorm is cancelled by its mean subtraction, so leave it out.
        x = keras.layers.Conv2D(item * width, 3, padding="same", use_bias=not batch_norm,
                                name=f"{name}conv{conv}")(x)
        if batch_norm:
            x = keras.layers.BatchNormalization(name=f"{name}bn{conv}")(x)
        x = keras.layers.ReLU(name=f"{name}relu{conv}")(x)
        conv += 1
    x = keras.layers.Flatten(name="flatten")(x)
    if dropout > 0:
        x = keras.layers.Dropout(float(dropout), name="dropout")(x)
    return keras.Model(inputs, logits(x, num_classes), name="vgg11")
