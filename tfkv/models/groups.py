"""`LayerGroup`: what a model builder declares for model parallelism (MXNet's `ctx_group`).

It lives with the models, below tfkv.parallel: a builder declares its groups without knowing how
they are placed, and tfkv.parallel.placement (which decides the devices) imports it from here.
No TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class LayerGroup:
    """A named, contiguous piece of a model that lives on one device as a whole.

    `make()` returns fresh Keras layers, applied in order; the caller creates them inside
    `tf.device(...)` so that their variables are created there. `input_shape` is one example's
    input to the group (no batch axis); `flops` the forward FLOPs per example; `params` the
    number of trainable parameters.
    """

    name: str
    make: Callable[[], list[Any]]
    input_shape: tuple[int, ...]
    flops: float
    params: int
