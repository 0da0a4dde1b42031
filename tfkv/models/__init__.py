"""Keras model builders by name. Importing this package does not import TensorFlow."""

from __future__ import annotations

import importlib
from typing import Any

# name -> "module:function"; builders are imported only when a model is built.
_REGISTRY: dict[str, str] = {
    "mlp": "tfkv.models.mlp:build",
    "lenet": "tfkv.models.lenet:build",
    "vgg11": "tfkv.models.vgg:build_vgg11",
    "resnet18": "tfkv.models.resnet:build_resnet18",
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def build(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """Build the model `cfg.name` (a `tfkv.config.ModelConfig`) for inputs of `input_shape`.

    Returns a built `keras.Model` whose output is unnormalised logits of shape (batch, num_classes).
    """
    module, func = _REGISTRY[cfg.name].split(":")
    return getattr(importlib.import_module(module), func)(cfg, tuple(input_shape), num_classes)
