"""tf.data input pipelines over a `DataSet`: worker shard, per-epoch shuffle, augment, normalise.

This is the only data module that imports TensorFlow; `tfkv.data` loads it on first use.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from tfkv.data.base import DataSet, input_scaling, shard_range, steps_per_epoch

PAD = 4  # pixels of zero padding around an image before the random crop back to its size
MIN_AUGMENT_SIZE = 16  # smaller images (digits) lose too much to a 4-pixel shift; never augment
_AUGMENT_SALT = 0x5EED  # keeps the augmentation stream apart from the shuffle stream of (seed, epoch)


def _to_unit(ds: DataSet) -> Callable[[tf.Tensor], tf.Tensor]:
    if np.issubdtype(ds.x_train.dtype, np.signedinteger):
        return lambda x: x  # token ids stay integers (exact, no cast back in the embedding)
    scaling = input_scaling(ds)
    scale = scaling.scale if scaling is not None else 1.0

    def to_unit(x: tf.Tensor) -> tf.Tensor:
        x = tf.cast(x, tf.float32)
        return x / scale if scale != 1.0 else x

    return to_unit


def _labels(y: np.ndarray) -> np.ndarray:
    """Labels as the model's loss takes them: class ids as int32, anything else (regression
    targets, soft labels) as float32, never cast to ids."""
    return y.astype(np.int32 if np.issubdtype(y.dtype, np.integer) else np.float32, copy=False)


def _standardize(ds: DataSet) -> Callable[[tf.Tensor], tf.Tensor]:
    scaling = input_scaling(ds)
    if scaling is None or not scaling.standardizes:
        return lambda x: x
    # per-channel constants broadcast over the last axis
    mean, std = np.asarray(scaling.mean, np.float32), np.asarray(scaling.std, np.float32)
    return lambda x: (x - tf.constant(mean)) / tf.constant(std)


def _crop_and_flip(x: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """Per-example random PAD-pixel shift (zero fill) and horizontal flip of a (B, H, W, C) batch."""
    b, h, w, _ = x.shape
    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
    offsets = tf.random.stateless_uniform([b, 2], seed=crop_seed, minval=0, maxval=2 * PAD + 1,
                                          dtype=tf.int32)
    padded = tf.pad(x, [[0, 0], [PAD, PAD], [PAD, PAD], [0, 0]])
    # gather rows then columns: one independent crop per example, with static output shapes
    rows = offsets[:, :1] + tf.range(h)[None, :]
    cols = offsets[:, 1:] + tf.range(w)[None, :]
    x = tf.gather(padded, rows, axis=1, batch_dims=1)
    x = tf.gather(x, cols, axis=2, batch_dims=1)
    flip = tf.random.stateless_uniform([b], seed=flip_seed) < 0.5
    return tf.where(flip[:, None, None, None], tf.reverse(x, axis=[2]), x)


def _can_augment(ds: DataSet) -> bool:
    shape = ds.input_shape
    return len(shape) == 3 and shape[0] >= MIN_AUGMENT_SIZE and shape[1] >= MIN_AUGMENT_SIZE


def train_dataset(ds: DataSet, batch_size: int, epoch: int, seed: int, num_parts: int = 1,
                  part_index: int = 0, augment: bool = False) -> tf.data.Dataset:
    """One epoch of this worker's shard: shuffled by (seed, epoch), full batches only.

    The order depends only on (seed, epoch, shard), so resuming at epoch e replays it exactly.
    Yields (float32 normalised x of shape (batch_size, *input_shape), or int32 token ids as
    stored, and y of (batch_size,) or (batch_size, seq_len, ...): int32 class ids, or float32
    targets as given).
    """
    steps = steps_per_epoch(ds, batch_size, num_parts)
    start, end = shard_range(len(ds.x_train), num_parts, part_index)
    order = start + np.random.default_rng([seed, epoch]).permutation(end - start)
    order = order[: steps * batch_size]  # drop_remainder, decided before copying anything
    # Gather in the stored dtype (uint8 for images) and batch by reshaping: one compact copy per
    # epoch, each element already a static-shape batch, float conversion deferred to the map.
    x = ds.x_train[order].reshape(steps, batch_size, *ds.input_shape)
    y = _labels(ds.y_train[order]).reshape(steps, batch_size, *ds.y_train.shape[1:])
    data = tf.data.Dataset.from_tensor_slices((x, y))
    to_unit, standardize = _to_unit(ds), _standardize(ds)

    if augment and _can_augment(ds):
        base = int(np.random.default_rng([seed, epoch, part_index, _AUGMENT_SALT]).integers(2**62))

        def prepare(step: tf.Tensor, xy: tuple[tf.Tensor, tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
            # stateless ops keyed on (epoch stream, batch index): reproducible and order-free
            step_seed = tf.stack([tf.constant(base, tf.int64), step])
            return standardize(_crop_and_flip(to_unit(xy[0]), step_seed)), xy[1]

        data = data.enumerate().map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    else:
        data = data.map(lambda xb, yb: (standardize(to_unit(xb)), yb),
                        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return data.prefetch(tf.data.AUTOTUNE)


def test_dataset(ds: DataSet, batch_size: int, num_parts: int = 1, part_index: int = 0) -> tf.data.Dataset:
    """Part `part_index` of `num_parts` contiguous parts of the test set (sizes differing by at
    most one example, none dropped; default: the whole set), in order, the last batch possibly
    smaller, normalised like training."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if not 0 <= part_index < num_parts:
        raise ValueError(f"part_index={part_index} must be in [0, num_parts={num_parts})")
    to_unit, standardize = _to_unit(ds), _standardize(ds)
    n = len(ds.x_test)
    start, end = n * part_index // num_parts, n * (part_index + 1) // num_parts
    data = tf.data.Dataset.from_tensor_slices((ds.x_test[start:end], _labels(ds.y_test[start:end])))
    data = data.batch(batch_size).map(lambda xb, yb: (standardize(to_unit(xb)), yb),
                                      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return data.prefetch(tf.data.AUTOTUNE)
