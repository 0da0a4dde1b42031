"""The random-generator states a checkpoint keeps with the weights (dropout's masks, mixed_float16's
loss scale), so that a resumed run draws what an uninterrupted one would have."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("tfkv")


def generators(parallel: Any) -> list[Any]:
    """The models' random-generator states (Keras SeedGenerators: dropout's masks), every copy's,
    then the step's own state (mixed_float16's loss scale), which a checkpoint keeps with them."""
    models = getattr(parallel, "replicas", None) or getattr(parallel, "models", [])
    step_state = parallel.step_state() if hasattr(parallel, "step_state") else []
    return [v for m in models for v in m.variables if v.path.endswith("seed_generator_state")] + step_state


def state(parallel: Any) -> dict[str, np.ndarray]:
    """The states as a checkpoint holds them: {"0000": array, ...} in `generators` order."""
    return {f"{i:04d}": np.asarray(v.numpy()) for i, v in enumerate(generators(parallel))}


def restore(parallel: Any, saved: dict[str, np.ndarray]) -> None:
    """Put the saved generator states back; a checkpoint from before they were saved keeps the
    fresh ones (its masks after resume differ from an uninterrupted run's)."""
    variables = generators(parallel)
    if len(saved) != len(variables):
        if saved or variables:
            log.warning("resume: the checkpoint holds %d random-generator states for %d here; "
                        "the random draws (dropout) start afresh", len(saved), len(variables))
        return
    for i, v in enumerate(variables):
        v.assign(saved[f"{i:04d}"])
