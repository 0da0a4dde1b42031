"""Keras model builders by name. Importing this package does not import TensorFlow."""

from __future__ import annotations

from typing import Any

from tfkv.registry import Registry

# Each builder: (cfg: ModelConfig, input_shape, num_classes) -> built keras.Model giving logits.
REGISTRY = Registry("model", {
    "mlp": "tfkv.models.mlp:build",
    "lenet": "tfkv.models.lenet:build",
    "vgg11": "tfkv.models.vgg:build_vgg11",
    "resnet18": "tfkv.models.resnet:build_resnet18",
})
names = REGISTRY.names


def build(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """Build the model `cfg.name` (a `tfkv.config.ModelConfig`) for inputs of `input_shape`.

    Returns a built `keras.Model` whose output is unnormalised logits of shape (batch, num_classes).
    """
    return REGISTRY.get(cfg.name)(cfg, tuple(input_shape), num_classes)
