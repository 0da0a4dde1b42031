"""Data: any factory named by `dataset._target_` (see `tfkv.data.source`), the built-in sets
(digits, mnist, cifar10, ptb, embedded text, synthetic) and streaming readers, per-worker
sharding. Importing this package does not import TensorFlow.

`Source` is one run's data as the trainer sees it; in-memory sets are `DataSet`s that
`train_dataset`/`test_dataset` wrap in tf.data pipelines (TensorFlow is imported there, on first
call). Training data is split across workers the way MXNet's SplitSampler does it
(`shard_range`) and reshuffled per (seed, epoch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tfkv.data.base import DataSet, shard_range, steps_per_epoch
from tfkv.data.source import Context, Source, Split

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["Context", "DataSet", "Source", "Split", "shard_range", "steps_per_epoch", "train_dataset",
           "test_dataset"]


def train_dataset(ds: DataSet, batch_size: int, epoch: int, seed: int, num_parts: int = 1,
                  part_index: int = 0, augment: bool = False) -> "tf.data.Dataset":
    """See `tfkv.data.pipeline.train_dataset`."""
    from tfkv.data import pipeline

    return pipeline.train_dataset(ds, batch_size, epoch, seed, num_parts, part_index, augment)


def test_dataset(ds: DataSet, batch_size: int) -> "tf.data.Dataset":
    """See `tfkv.data.pipeline.test_dataset`."""
    from tfkv.data import pipeline

    return pipeline.test_dataset(ds, batch_size)
