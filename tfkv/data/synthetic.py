"""A random but learnable classification problem of any input shape, for tests and benchmarks."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tfkv.data.base import DataSet
from tfkv.errors import ConfigError


def load(seed: int = 0, num_train: int = 4096, num_test: int = 1024, shape: Sequence[int] = (32, 32, 3),
         num_classes: int = 10) -> DataSet:
    """Gaussian inputs labelled by the argmax of a fixed random linear map (both drawn from `seed`).

    A linear model can reach 100% on it, so a falling loss shows that training works.
    """
    shape = tuple(int(d) for d in shape)
    num_classes, num_train, num_test = int(num_classes), int(num_train), int(num_test)
    if not shape or min(shape) < 1:
        raise ConfigError(f"dataset.shape={list(shape)} must list positive sizes, e.g. [32,32,3]")
    if num_classes < 2:
        raise ConfigError(f"dataset.num_classes={num_classes} must be at least 2")
    if num_train < 1 or num_test < 1:
        raise ConfigError(
            f"dataset.num_train={num_train} and dataset.num_test={num_test} must both be at least 1"
        )
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((num_train + num_test, *shape), dtype=np.float32)
    projection = rng.standard_normal((int(np.prod(shape)), num_classes), dtype=np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ projection, axis=1).astype(np.int32)
    return DataSet(
        name="synthetic",
        x_train=x[:num_train],
        y_train=y[:num_train],
        x_test=x[num_train:],
        y_test=y[num_train:],
        num_classes=num_classes,
        mean=(0.0,),
        std=(1.0,),
    )
