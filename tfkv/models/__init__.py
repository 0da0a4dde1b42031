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
    "lstm_lm": "tfkv.models.lstm_lm:build",
})
names = REGISTRY.names

# Models that declare named layer groups for model parallelism (`placement=`): name -> module
# with `group_names(cfg)` (no TensorFlow; the config layer checks placements with it) and
# `build_groups(cfg, input_shape, num_classes)` -> [tfkv.parallel.placement.LayerGroup].
GROUPED = {"lstm_lm": "tfkv.models.lstm_lm"}

# Models whose logits have a time axis, (batch, seq_len, classes): they need a text data set.
SEQUENCE = {"lstm_lm"}


def build(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """Build the model `cfg.name` (a `tfkv.config.ModelConfig`) for inputs of `input_shape`.

    Returns a built `keras.Model` whose output is unnormalised logits of shape (batch, num_classes), or
    (batch, seq_len, num_classes) for the `SEQUENCE` models.
    """
    return REGISTRY.get(cfg.name)(cfg, tuple(input_shape), num_classes)


def has_groups(name: str) -> bool:
    return name in GROUPED


def group_names(cfg: Any) -> list[str]:
    """The layer groups of model `cfg.name`, in order, from the config alone (no TensorFlow)."""
    import importlib

    return importlib.import_module(GROUPED[cfg.name]).group_names(cfg)


def build_groups(cfg: Any, input_shape: tuple[int, ...], num_classes: int) -> list[Any]:
    """The layer groups of model `cfg.name` (`tfkv.parallel.placement.LayerGroup`s), unbuilt."""
    import importlib

    return importlib.import_module(GROUPED[cfg.name]).build_groups(cfg, tuple(input_shape), num_classes)
