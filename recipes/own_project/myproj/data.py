"""The project's data: a factory tfkv calls once per split (and epoch).

It takes `split` (tfkv passes "train" or "test"); its other arguments come from the `dataset`
node of the config (conf/dataset/*.yaml). It returns numpy arrays, so tfkv shards the training
split across the workers, shuffles it per epoch and batches it. It generates its data itself:
nothing to download.
"""

from __future__ import annotations

import numpy as np

from tfkv.data import Split


def blobs(split: str, num_samples: int = 1024, num_features: int = 8, num_classes: int = 4,
          spread: float = 0.5, test_fraction: float = 0.25, data_seed: int = 0) -> Split:
    """Gaussian blobs, one per class around fixed random centres; the same set on every worker
    (`data_seed`), cut into a train and a test split."""
    rng = np.random.default_rng(data_seed)
    centres = rng.normal(0.0, 2.0, size=(num_classes, num_features))
    y = rng.integers(0, num_classes, size=num_samples)
    x = centres[y] + rng.normal(0.0, spread, size=(num_samples, num_features))
    cut = int(num_samples * (1.0 - test_fraction))
    part = slice(0, cut) if split == "train" else slice(cut, None)
    return Split((x[part].astype(np.float32), y[part].astype(np.int32)), num_classes=num_classes)
