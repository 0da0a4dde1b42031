"""Data sets by name and per-worker sharding. Importing this package does not import TensorFlow.

`load(cfg)` returns an in-memory `DataSet`; `train_dataset`/`test_dataset` wrap it in tf.data
pipelines (TensorFlow is imported there, on first call). Training data is split across workers
the way MXNet's SplitSampler does it (`shard_range`) and reshuffled per (seed, epoch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tfkv.data.base import DataSet, shard_range, steps_per_epoch
from tfkv.errors import ConfigError
from tfkv.registry import Registry

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = ["DataSet", "names", "load", "shard_range", "steps_per_epoch", "train_dataset",
           "test_dataset"]

# name -> "module:function"; imported on use so that e.g. sklearn loads only for digits
REGISTRY = Registry("data set", {
    "cifar10": "tfkv.data.cifar10:load",
    "digits": "tfkv.data.digits:load",
    "mnist": "tfkv.data.mnist:load",
    "synthetic": "tfkv.data.synthetic:load",
    "ptb": "tfkv.data.ptb:load",
    "embedded_text": "tfkv.data.ptb:load_embedded",
})
names = REGISTRY.names

# Text sets for language models: x and y are (n, seq_len) token ids, y the next token of x.
TEXT = {"ptb", "embedded_text"}


def load(cfg: Any, seed: int = 0) -> DataSet:
    """The data set `cfg.name` (a `tfkv.config.DatasetConfig`); `seed` only matters for synthetic."""
    name = str(cfg.name)
    if name not in REGISTRY:
        raise ConfigError(
            f"dataset.name={name!r} is not known; choose one of {', '.join(names())} "
            "(e.g. dataset=digits)"
        )
    return REGISTRY.get(name)(cfg, seed)


def train_dataset(ds: DataSet, batch_size: int, epoch: int, seed: int, num_parts: int = 1,
                  part_index: int = 0, augment: bool = False) -> "tf.data.Dataset":
    """See `tfkv.data.pipeline.train_dataset`."""
    from tfkv.data import pipeline

    return pipeline.train_dataset(ds, batch_size, epoch, seed, num_parts, part_index, augment)


def test_dataset(ds: DataSet, batch_size: int) -> "tf.data.Dataset":
    """See `tfkv.data.pipeline.test_dataset`."""
    from tfkv.data import pipeline

    return pipeline.test_dataset(ds, batch_size)
