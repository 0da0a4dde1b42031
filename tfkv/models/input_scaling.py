"""The data pipeline's input scaling as the first layers of an exported model, and taken off again.

tfkv's pipeline scales a built-in data set's inputs before the model sees them (raw pixels to
[0, 1], then the training split's mean and standard deviation: `tfkv.data.base.InputScaling`), so
the trained model expects scaled inputs. The exported model.keras starts with the same steps as
Keras preprocessing layers (`Rescaling`, `Normalization` with the training split's statistics),
so plain Keras given the data set's own inputs computes what tfkv evaluated. A model loaded with
`model.path` to train on has them taken off (`without`): tfkv's pipeline scales its inputs again.
"""

from __future__ import annotations

from typing import Any

#: The names of the layers `wrap` puts before the trained model.
SCALE, NORMALIZE = "tfkv_input_scale", "tfkv_input_normalization"


def wrap(model: Any, scaling: Any, input_spec: Any) -> Any:
    """`model` behind `scaling` (a `tfkv.data.base.InputScaling`, or None: `model` itself) for
    inputs of the unbatched `input_spec`. Float32 layers whatever the precision policy: they
    compute what the float32 pipeline computed."""
    if scaling is None:
        return model
    import keras
    import numpy as np

    inputs = keras.Input(shape=tuple(input_spec.shape), dtype="float32", name="raw_inputs")
    x = inputs
    if scaling.scale != 1.0:
        x = keras.layers.Rescaling(1.0 / scaling.scale, dtype="float32", name=SCALE)(x)
    if scaling.standardizes:
        mean, std = np.asarray(scaling.mean, np.float32), np.asarray(scaling.std, np.float32)
        per_channel = len(mean) > 1
        x = keras.layers.Normalization(axis=-1 if per_channel else None, mean=mean if per_channel else float(mean[0]),
                                       variance=std ** 2 if per_channel else float(std[0]) ** 2, dtype="float32",
                                       name=NORMALIZE)(x)
    return keras.Model(inputs, model(x), name=f"{model.name}_on_raw_inputs")


def without(model: Any) -> Any:
    """The trained model inside a model `wrap` made (`model` itself when it is not one)."""
    import keras

    names = {layer.name for layer in model.layers}
    if not names & {SCALE, NORMALIZE} or not isinstance(model.layers[-1], keras.Model):
        return model
    return model.layers[-1]
