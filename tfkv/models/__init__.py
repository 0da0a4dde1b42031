"""Keras models: the built-in zoo, and what tfkv asks of any model builder.

A model is any callable that returns a `keras.Model`, named by `model._target_`; the other keys
of the `model` node are its keyword arguments, and it may ask for the data set's description by
taking a parameter named `input_shape` (a tuple, or a dict name -> tuple for dict inputs),
`input_spec` (the unbatched `tf.TensorSpec`s of x) or `num_classes`. `model.path` starts from
a saved `.keras` model instead. The built-in zoo (tfkv.models.mlp.build, ...) is ordinary
`_target_` entries in conf/model/.

A builder that declares named layer groups for model parallelism (`placement=`) carries two
attributes: `group_names(**kwargs)` (the groups from the config alone, no TensorFlow) and
`build_groups(input_shape, num_classes, **kwargs)` -> [tfkv.models.groups.LayerGroup].
Importing this package does not import TensorFlow.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from tfkv import target
from tfkv.errors import ConfigError

# What tfkv passes to a model builder that takes a parameter of that name.
PROVIDED = ("input_shape", "input_spec", "num_classes")
# Keys of the model node that tfkv reads itself.
OWN_KEYS = ("path",)


def _plain(node: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def check(node: Mapping[str, Any]) -> Callable[..., Any] | None:
    """Check the model node before anything starts: its callable imports and takes these keys.
    Returns the builder (None for `model.path`)."""
    node = _plain(node)
    if node.get("path") is not None:
        extra = sorted(k for k in node if k != "path")
        if extra:
            raise ConfigError(f"model.path loads a saved model; model.{extra[0]} has no meaning with it: remove it")
        return None
    return target.check(node, "model", PROVIDED, OWN_KEYS)


def arguments(node: Mapping[str, Any]) -> dict[str, Any]:
    """The builder's keyword arguments from the node (tfkv's and Hydra's keys aside)."""
    return {k: v for k, v in _plain(node).items() if k not in target.HYDRA_KEYS and k not in OWN_KEYS}


def build(node: Mapping[str, Any], **provided: Any) -> Any:
    """The `keras.Model` the node describes; `provided`: input_shape, input_spec, num_classes
    (num_classes None when the data set does not say)."""
    node = _plain(node)
    if node.get("path") is not None:
        return _load(str(node["path"]))
    fn = check(node)
    if target.accepts(fn, "num_classes") and provided.get("num_classes") is None:
        raise ConfigError("model: the builder takes num_classes but the data set does not say how many classes "
                          "it has; set ++dataset.num_classes=N (or return tfkv.data.Split(data, num_classes=N) "
                          "from the factory)")
    model = target.call(node, "model", provided, OWN_KEYS)
    import keras

    if not isinstance(model, keras.Model):
        raise ConfigError(f"model._target_={node['_target_']} returned a {type(model).__name__}, not a keras.Model; "
                          "return the model (e.g. keras.Model(inputs, outputs))")
    return _built(model, provided.get("input_spec"), str(node["_target_"]))


def _built(model: Any, input_spec: Any, name: str) -> Any:
    """`model` with every weight made. A subclassed model whose builder never called it has none
    yet (its layers make theirs on their first call): without this, the store would get no keys and
    nothing would train. Built as Keras's `fit` builds it before its first batch: called once on
    symbolic inputs of the data's spec (`backend.compute_output_spec`: no data computed, no
    graph node left on the model)."""
    if input_spec is None or all(layer.built for layer in model._flatten_layers()):
        return model
    import tensorflow as tf
    from keras.src import backend

    x = tf.nest.map_structure(lambda s: backend.KerasTensor((None, *s.shape), s.dtype.name), input_spec)
    try:
        backend.compute_output_spec(model, x, training=False)
    except Exception as e:  # noqa: BLE001 - the model's own error, in its first line
        shapes = tf.nest.map_structure(lambda s: tuple(s.shape), input_spec)
        raise ConfigError(f"model._target_={name} returned a model that is not built, and calling it on a batch "
                          f"of the data's inputs (shape {shapes} per example) fails: {str(e).strip().splitlines()[0]}; "
                          "make the model take the data's inputs, or build it in the builder "
                          "(model.build(shape) or a keras.Input)") from None
    return model


def _load(path: str) -> Any:
    import os

    import keras

    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise ConfigError(f"model.path={path}: no such file ({full}); give a .keras file saved by model.save")
    from tfkv.models import input_scaling

    try:
        model = keras.models.load_model(full, compile=False)
    except Exception as e:  # noqa: BLE001 - Keras says why in its first line
        raise ConfigError(f"model.path={path} cannot be loaded: {str(e).splitlines()[0]}; "
                          "give a .keras file saved by keras' model.save") from None
    return input_scaling.without(model)  # a tfkv export's scaling: the pipeline scales its inputs


def layer_groups(node: Mapping[str, Any]) -> Any:
    """The builder's layer-group declaration (see the module docstring), or None."""
    node = _plain(node)
    if node.get("path") is not None:
        return None
    fn = target.locate(node["_target_"], "model._target_")
    return fn if callable(getattr(fn, "group_names", None)) and callable(getattr(fn, "build_groups", None)) else None


def group_names(node: Mapping[str, Any]) -> list[str]:
    """The layer groups of the model, in order, from the config alone."""
    return list(layer_groups(node).group_names(**arguments(node)))


def build_groups(node: Mapping[str, Any], input_shape: tuple[int, ...], num_classes: int) -> list[Any]:
    """The model's layer groups (`tfkv.models.groups.LayerGroup`s), unbuilt."""
    return layer_groups(node).build_groups(tuple(input_shape), num_classes, **arguments(node))


def name(node: Mapping[str, Any]) -> str:
    """A short name for logs: the builder's module and function, or the saved model's file."""
    node = _plain(node)
    return str(node.get("path") or node.get("_target_", "model")).rsplit("/", 1)[-1]
