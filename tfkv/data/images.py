"""A folder of images per class, streamed: `dataset._target_: tfkv.data.images.load`.

Keras's `image_dataset_from_directory` conventions: each sub-folder of `directory` is a class
(class ids in sorted name order, or `class_names`' order), images are .bmp/.gif/.jpeg/.jpg/.png
at any depth below it, decoded to `color_mode` channels and resized to `image_size` as float32
in [0, 255] (divided by `scale` when given), labels as `label_mode` says. Only the list of file
names is held: each worker takes its share of the (seed, epoch)-shuffled list and reads and
decodes those files in a parallel map, a batch ahead of training. A file that does not decode
is one line naming it.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import tensorflow as tf

from tfkv.data import streaming
from tfkv.data.base import Context
from tfkv.data.source import Split
from tfkv.errors import ConfigError, DataError

FORMATS = (".bmp", ".gif", ".jpeg", ".jpg", ".png")  # what keras lists and tf.io.decode_image reads
CHANNELS = {"grayscale": 1, "rgb": 3, "rgba": 4}
LABEL_MODES = ("int", "categorical", "binary")


def index_directory(directory: str, class_names: Sequence[str] | None = None,
                    follow_links: bool = False) -> tuple[list[str], np.ndarray, list[str]]:
    """(image paths, their class ids, class names) of a folder of class sub-folders, in sorted order."""
    if not os.path.isdir(directory):
        raise ConfigError(f"dataset.directory={directory!r} is not a folder; give the folder that holds one "
                          "sub-folder of images per class")
    found = sorted(d for d in os.listdir(directory) if os.path.isdir(os.path.join(directory, d)))
    names = list(class_names) if class_names is not None else found
    missing = sorted(set(names) - set(found))
    if missing:
        raise ConfigError(f"dataset.class_names: {', '.join(missing)} not found in {directory} "
                          f"(its sub-folders: {', '.join(found) or 'none'})")
    if not names:
        raise DataError(f"dataset.directory={directory!r} has no sub-folders; put each class's images "
                        "in a sub-folder named after the class")
    paths, labels = [], []
    for label, name in enumerate(names):
        root = os.path.join(directory, name)
        for here, dirs, files in os.walk(root, followlinks=follow_links):
            dirs.sort()  # os.walk's order is the file system's; sorting makes it the same everywhere
            for f in sorted(files):
                if f.lower().endswith(FORMATS):
                    paths.append(os.path.join(here, f))
                    labels.append(label)
    if not paths:
        raise DataError(f"dataset.directory={directory!r} holds no {'/'.join(FORMATS)} file in its class "
                        "sub-folders")
    return paths, np.asarray(labels, np.int32), names


@streaming.reader
def load(
    directory: Any,
    image_size: Sequence[int] = (256, 256),
    color_mode: str = "rgb",
    label_mode: str = "int",
    class_names: Sequence[str] | None = None,
    validation_split: float | None = None,
    interpolation: str = "bilinear",
    follow_links: bool = False,
    scale: float | None = None,
    *,
    context: Context,
) -> Any:
    """This worker's batches of (images, labels) for one epoch of `split`, and the number of classes.

    `directory`: one folder, or {train: folder, test: folder}. With one folder and
    `validation_split`, the test split is that fraction of its images (picked by `seed`, the
    same for every epoch), as keras's `subset="validation"` is.
    """
    if color_mode not in CHANNELS:
        raise ConfigError(f"dataset.color_mode={color_mode!r} must be one of {', '.join(CHANNELS)}")
    if label_mode not in LABEL_MODES:
        raise ConfigError(f"dataset.label_mode={label_mode!r} must be one of {', '.join(LABEL_MODES)}")
    if len(image_size) != 2 or not all(isinstance(d, int) and d > 0 for d in image_size):
        raise ConfigError(f"dataset.image_size={list(image_size)!r} must be [height, width]")
    if validation_split is not None and not 0 < validation_split < 1:
        raise ConfigError(f"dataset.validation_split={validation_split} must be between 0 and 1")
    if validation_split is not None:
        if not isinstance(directory, (str, os.PathLike)):
            raise ConfigError("dataset.validation_split takes one dataset.directory; with {train, test} "
                              "folders drop validation_split")
        paths, labels, names = index_directory(os.fspath(directory), class_names, follow_links)
        order = np.random.default_rng([context.seed, 0]).permutation(len(paths))  # fixed for the run, not per epoch
        cut = len(paths) - int(validation_split * len(paths))
        keep = order[:cut] if context.train else order[cut:]
        paths, labels = [paths[i] for i in np.sort(keep)], labels[np.sort(keep)]
    else:
        folder = os.fspath(streaming.for_split(directory, context.split, "directory"))
        paths, labels, names = index_directory(folder, class_names, follow_links)
    if label_mode == "binary" and len(names) != 2:
        raise ConfigError(f"dataset.label_mode=binary needs 2 classes, {len(names)} found ({', '.join(names)}); "
                          "use label_mode=int or categorical")
    channels = CHANNELS[color_mode]
    size = [int(d) for d in image_size]
    problem = unreadable(paths[:1], channels)  # one image now: a folder of something else fails before training
    if problem:
        raise DataError(problem)

    train = context.train
    order, batches = streaming.share(len(paths), context)

    def read(path: tf.Tensor, label: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
        image = tf.image.resize(image, size, method=interpolation)
        image.set_shape((*size, channels))
        if scale is not None:
            image = image / float(scale)
        if label_mode == "categorical":
            label = tf.one_hot(label, len(names))
        elif label_mode == "binary":
            label = tf.cast(label, tf.float32)[None]
        return image, label

    mine = [paths[i] for i in order]
    data = (tf.data.Dataset.from_tensor_slices((np.asarray(mine), labels[order]))
            .map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .batch(context.batch_size, drop_remainder=train)
            .apply(tf.data.experimental.assert_cardinality(batches))
            .prefetch(tf.data.AUTOTUNE))
    return Split(streaming.locating(data, lambda: unreadable(mine, channels)), num_classes=len(names))


def unreadable(paths: Sequence[str], channels: int) -> str | None:
    """The line for the first of `paths` that cannot be read or decoded as an image, or None
    (all of them are tried only after reading failed: TensorFlow's error names no file)."""
    for path in paths:
        try:
            tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
        except (tf.errors.InvalidArgumentError, tf.errors.NotFoundError, tf.errors.DataLossError) as e:
            return f"dataset.directory: {path} is not a readable image ({streaming.reason(e)}); remove or replace it"
    return None
