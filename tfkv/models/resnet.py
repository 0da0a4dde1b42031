"""ResNet-18 for 32x32 images (the CIFAR variant: 3x3 stem, no max-pool, global average pool)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras

from tfkv.models._checks import check_width, image_size
from tfkv.models._common import logits

# (channel multiple of width, stride of the first block) per stage; two blocks each.
_STAGES = ((1, 1), (2, 2), (4, 2), (8, 2))
_BLOCKS_PER_STAGE = 2


def _conv_bn(x: keras.KerasTensor, filters: int, kernel: int, stride: int, name: str,
             suffix: str = "") -> keras.KerasTensor:
    # No bias: BatchNorm's mean subtraction would cancel it.
    import keras  # here, not at import: config validation locates builders without TensorFlow
    x = keras.layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False,
                            name=f"{name}conv{suffix}")(x)
    return keras.layers.BatchNormalization(name=f"{name}bn{suffix}")(x)


def _basic_block(x: keras.KerasTensor, filters: int, stride: int, name: str) -> keras.KerasTensor:
    """Two conv3x3+BN with an identity shortcut, or a 1x1 conv+BN one when the shape changes."""
    import keras
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = _conv_bn(x, filters, 1, stride, f"{name}_shortcut_")
    y = _conv_bn(x, filters, 3, stride, f"{name}_", "1")
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = _conv_bn(y, filters, 3, 1, f"{name}_", "2")
    y = keras.layers.Add(name=f"{name}_add")([y, shortcut])
    return keras.layers.ReLU(name=f"{name}_relu2")(y)


def build_resnet18(input_shape: tuple[int, ...], num_classes: int, width: int = 64) -> keras.Model:
    """conv3x3 stem -> 4 stages x 2 BasicBlocks (w, 2w, 4w, 8w) -> global average pool -> Dense.

    Layers are named conv1/bn1 (stem), stage{s}_block{b}_conv{1,2}/_bn{1,2}, and
    stage{s}_block{b}_shortcut_conv/_bn for projections, then 'avgpool' and 'fc'.
    """
    import keras
    downsamples = sum(1 for _, stride in _STAGES if stride == 2)
    # Below 8x8 the last stage would see only 'same'-padding zeros after the stride-2 convs.
    image_size("resnet18", input_shape, 2**downsamples, f"{downsamples} stride-2 stages",
               "model=mlp or lenet, or a 32x32 data set")
    width = check_width(width)
    inputs = keras.Input(shape=tuple(input_shape), name="input")
    x = keras.layers.Conv2D(width, 3, padding="same", use_bias=False, name="conv1")(inputs)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ReLU(name="relu1")(x)
    for s, (multiple, stride) in enumerate(_STAGES, start=1):
        for b in range(1, _BLOCKS_PER_STAGE + 1):
            x = _basic_block(x, multiple * width, stride if b == 1 else 1, f"stage{s}_block{b}")
    x = keras.layers.GlobalAveragePooling2D(name="avgpool")(x)
    return keras.Model(inputs, logits(x, num_classes), name="resnet18")
