"""A data set factory: Gaussian blobs, one per class, as numpy arrays."""

import numpy as np


def make(split, seed, n=600, features=8, classes=3, *, spread=0.5):
    rng = np.random.default_rng(seed + (split == "test"))
    y = rng.integers(0, classes, n)
    centres = np.random.default_rng(12345).normal(size=(classes, features)) * 3
    x = (centres[y] + rng.normal(scale=spread, size=(n, features))).astype("float32")
    return x, y.astype("int64")
