"""The 8x8 handwritten digits shipped inside tfkv (digits.npz), split into a fixed train/test pair.

The 1797 images are the test part of UCI's "Optical Recognition of Handwritten Digits" (E.
Alpaydin, C. Kaynak, 1998; CC BY 4.0), as scikit-learn's `load_digits` gives them, in its order:
uint8 counts 0..16 of 4x4 pixel blocks, and their class ids. 45 KB shipped with the package
instead of scikit-learn and SciPy installed on every node to read them.
"""

from __future__ import annotations

from importlib import resources

import numpy as np

from tfkv.data.base import DataSet
from tfkv.errors import ConfigError

SPLIT_SEED = 0  # not the run seed: the test set must be the same for every run


def raw() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) uint8 in 0..16, labels (1797,) int32), as stored."""
    with resources.files(__package__).joinpath("digits.npz").open("rb") as f, np.load(f, allow_pickle=False) as z:
        return z["images"], z["labels"].astype(np.int32)


def load(test_fraction: float = 0.2) -> DataSet:
    """1797 digits as (8, 8, 1) float32 in [0, 1]; `test_fraction` of them held out for testing.

    Normalisation statistics come from the training split, so no test information leaks in.
    """
    x, y = raw()
    n = len(x)
    fraction = float(test_fraction)
    n_test = int(round(n * fraction))
    if not 0 < n_test < n:
        raise ConfigError(
            f"dataset.test_fraction={fraction} leaves {n_test} of {n} digits for testing; "
            "choose a value between 0 and 1, e.g. dataset.test_fraction=0.2"
        )
    order = np.random.default_rng(SPLIT_SEED).permutation(n)
    x = (x / 16.0).astype(np.float32).reshape(n, 8, 8, 1)  # pixel values are counts 0..16
    test, train = order[:n_test], order[n_test:]
    x_train = x[train]
    return DataSet(
        name="digits",
        x_train=x_train,
        y_train=y[train],
        x_test=x[test],
        y_test=y[test],
        num_classes=10,
        mean=(float(x_train.mean()),),
        std=(float(x_train.std()),),
    )
