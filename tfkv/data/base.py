"""The in-memory `DataSet` record, the MXNet-style per-worker split of its training set, and the
`Context` a data factory is called in."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfkv.errors import DataError


@dataclass
class DataSet:
    """Train and test arrays of one data set, plus what the pipeline needs to normalise them.

    Image sets keep raw uint8 pixels (a quarter of the memory of float32); `mean`/`std` are
    per channel and apply after scaling to [0, 1] (see `input_scale`).
    """

    name: str
    x_train: np.ndarray  # (N, H, W, C) uint8, or float32 already scaled
    y_train: np.ndarray  # (N, ...) int32 class ids, or float32 targets (regression, soft labels)
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool = False  # random crop + flip of training images (16x16 and larger)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x_train.shape[1:])


@dataclass(frozen=True)
class Context:
    """What tfkv passes to a data factory that takes a parameter of the same name (tfkv.data.source),
    and what a built-in reader gets as one value (`streaming.reader`): which split, the (seed,
    epoch) its random streams come from, its batch size, and its share of the records (worker
    `rank` of `num_workers`). The defaults are a reader's called by hand: the training split's
    first epoch, on one worker."""

    split: str = "train"  # "train" | "test"
    seed: int = 0
    epoch: int = 1  # 1-based; 1 for the test split
    batch_size: int = 32  # this worker's (the test split: eval_batch_size)
    rank: int = 0
    num_workers: int = 1

    @property
    def train(self) -> bool:
        return self.split == "train"


def input_scale(x: np.ndarray) -> float:
    """Divisor that maps stored values to [0, 1]: 255 for raw pixels, 1 for float arrays."""
    return 255.0 if x.dtype == np.uint8 else 1.0


@dataclass(frozen=True)
class InputScaling:
    """What the pipeline does to a data set's inputs before the model sees them: x / `scale`,
    then (x - `mean`) / `std` per channel (the last axis; one value: every channel). The exported
    model starts with the same steps (tfkv.export), so it takes the inputs as the data set holds them."""

    scale: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def standardizes(self) -> bool:
        return not (all(m == 0 for m in self.mean) and all(s == 1 for s in self.std))


def input_scaling(ds: DataSet) -> InputScaling | None:
    """The scaling of `ds`'s inputs, None where they reach the model as stored: token ids
    (signed integers), or float inputs with no normalisation."""
    if np.issubdtype(ds.x_train.dtype, np.signedinteger):
        return None
    scaling = InputScaling(input_scale(ds.x_train), tuple(float(m) for m in ds.mean), tuple(float(s) for s in ds.std))
    return scaling if scaling.scale != 1.0 or scaling.standardizes else None


def shard_range(length: int, num_parts: int, part_index: int) -> tuple[int, int]:
    """[start, end) of worker `part_index`'s contiguous shard, as MXNet's SplitSampler cuts it.

    Every part gets `length // num_parts` examples; the remainder at the end is dropped so that
    all workers run the same number of steps (they meet at every gradient push).
    """
    if num_parts < 1:
        raise ValueError(f"num_parts={num_parts} must be at least 1")
    if not 0 <= part_index < num_parts:
        raise ValueError(f"part_index={part_index} must be in [0, {num_parts})")
    if length < 0:
        raise ValueError(f"length={length} must not be negative")
    part_len = length // num_parts
    start = part_len * part_index
    return start, start + part_len


def steps_per_epoch(ds: DataSet, batch_size: int, num_parts: int = 1) -> int:
    """Full batches one worker's shard yields per epoch (the remainder is dropped)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    start, end = shard_range(len(ds.x_train), num_parts, 0)
    shard = end - start
    steps = shard // batch_size
    if steps == 0:
        split = f" ({len(ds.x_train)} split over {num_parts} workers)" if num_parts > 1 else ""
        fix = (f"use a batch_size of at most {shard}" if shard else
               f"use at most {len(ds.x_train)} workers")
        raise DataError(
            f"dataset {ds.name}: a shard of {shard} training examples{split} is smaller than "
            f"batch_size={batch_size}; {fix}"
        )
    return steps
