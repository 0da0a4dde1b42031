"""Argument and input-size checks of the built-in model builders (no TensorFlow: the model
groups' module imports them too)."""

from __future__ import annotations

from tfkv.errors import ConfigError


def image_size(model: str, input_shape: tuple[int, ...], min_side: int, why: str,
               alternatives: str) -> tuple[int, int]:
    """Return (height, width) of an (H, W, C) input, or raise a one-line ConfigError.

    Checked up-front because Keras would otherwise fail deep inside a pooling layer with a
    message about negative dimensions that does not say which setting to change.
    """
    if len(input_shape) != 3:
        shape = "(" + ", ".join(str(d) for d in input_shape) + ("," if len(input_shape) == 1 else "") + ")"
        raise ConfigError(
            f"model {model} needs image inputs (height, width, channels); dataset gives shape "
            f"{shape}: pick model=mlp, or an image data set"
        )
    height, width = int(input_shape[0]), int(input_shape[1])
    if min(height, width) < min_side:
        raise ConfigError(
            f"model {model} needs inputs of at least {min_side}x{min_side} ({why}); "
            f"dataset gives {height}x{width}: pick {alternatives}"
        )
    return height, width


def check_dropout(rate: float) -> None:
    if not 0 <= rate < 1:
        raise ConfigError(f"model.dropout={rate} must be at least 0 and below 1 (the share of units dropped)")


def check_width(width: int) -> int:
    if int(width) < 1:
        raise ConfigError(f"model.width={width} must be at least 1 (channels of the first stage)")
    return int(width)
