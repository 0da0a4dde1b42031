"""scikit-learn's bundled 8x8 handwritten digits, split into a fixed train/test pair."""

from __future__ import annotations

import numpy as np

from tfkv.data.base import DataSet
from tfkv.errors import ConfigError

SPLIT_SEED = 0  # not the run seed: the test set must be the same for every run


def load(test_fraction: float = 0.2) -> DataSet:
    """1797 digits as (8, 8, 1) float32 in [0, 1]; `test_fraction` of them held out for testing.

    Normalisation statistics come from the training split, so no test information leaks in.
    """
    from sklearn.datasets import load_digits  # sklearn is slow to import; only this set needs it

    x, y = load_digits(return_X_y=True)
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
    y = y.astype(np.int32)
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
