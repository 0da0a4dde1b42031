"""`.npy` / `.npz` arrays, memory-mapped: `dataset._target_: tfkv.data.npy.load`.

`x` and `y` name .npy files, or `npz` names an archive and `x_key`/`y_key` its members (by
default x_train/y_train and x_test/y_test, as keras's mnist.npz has them). Arrays are mapped,
not read: each batch is gathered by index from the map inside tf.data, and the pages it touched
are handed back to the kernel afterwards, so a worker's resident memory stays at a few batches
however large the files are (they stay in the page cache, shared by every worker).

`np.load(mmap_mode="r")` maps a .npy but silently reads a whole .npz member into memory; a
member stored uncompressed (`np.savez`) is a plain .npy inside the zip, so it is mapped at its
offset. A compressed member (`np.savez_compressed`) cannot be mapped and is refused.
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from tfkv.data import streaming
from tfkv.data.base import Context
from tfkv.errors import ConfigError, DataError

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zip local file header (zipfile.structFileHeader)


def _release(array: np.ndarray) -> None:
    """Drop this process's mapping of the pages it read (they stay cached): RSS stays flat."""
    base = array
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "_mmap", None) or getattr(base, "base", None)
    if isinstance(base, mmap.mmap):
        base.madvise(mmap.MADV_DONTNEED)


def map_npy(path: str, key: str) -> np.ndarray:
    """A read-only memory map of a .npy file."""
    if not os.path.isfile(path):
        raise ConfigError(f"dataset.{key}={path!r} is not a file; give the path of a .npy file")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise DataError(f"dataset.{key}: {path} is not an array file numpy can map ({e})") from None
    if not isinstance(array, np.memmap):
        raise ConfigError(f"dataset.{key}={path!r} is not a .npy file; give .npy files as x/y, or an .npz as npz")
    return array


def map_npz_member(path: str, member: str, key: str) -> np.ndarray:
    """A read-only memory map of the uncompressed member `member` of an .npz archive."""
    if not os.path.isfile(path):
        raise ConfigError(f"dataset.npz={path!r} is not a file; give the path of an .npz archive")
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n[:-4] for n in zf.namelist() if n.endswith(".npy")]
            if member not in names:
                raise ConfigError(f"dataset.{key}={member!r} is not in {path} (it has {', '.join(names)}); "
                                  f"set dataset.{key} to one of them")
            info = zf.getinfo(member + ".npy")
    except zipfile.BadZipFile:
        raise DataError(f"dataset.npz: {path} is not an .npz (zip) archive") from None
    if info.compress_type != zipfile.ZIP_STORED:
        raise DataError(f"dataset.npz: member {member!r} of {path} is compressed (np.savez_compressed) and cannot "
                        "be memory-mapped; save it with np.savez or as .npy files")
    try:
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            fields = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            f.seek(info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1])  # + name + extra field
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):  # 3.0 only adds UTF-8 field names, which np.savez never writes
                raise DataError(f"dataset.npz: member {member!r} of {path} is .npy format {version}; "
                                "save it with np.savez")
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read_header(f)
            if dtype.hasobject:
                raise DataError(f"dataset.npz: member {member!r} of {path} holds Python objects; store numbers")
            offset = f.tell()
        return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")
    except (ValueError, struct.error, OSError) as e:  # a damaged header, or data cut short
        raise DataError(f"dataset.npz: member {member!r} of {path}, at byte {info.header_offset}, is damaged "
                        f"({e}); write the archive again") from None


@streaming.reader
def load(
    x: Any = None,
    y: Any = None,
    npz: Any = None,
    x_key: Any = None,
    y_key: Any = None,
    scale: float | None = None,
    *,
    context: Context,
) -> Any:
    """This worker's batches of (x, y) for one epoch of `split`, gathered from memory maps.

    `x`, `y`: .npy paths, or {train: path, test: path}. Or `npz`: an archive (or {train, test}
    of archives) with members `x_key`/`y_key` (default x_<split>, y_<split>). `scale`: x is
    cast to float32 and divided by it (255 for uint8 pixels).
    """
    split = context.split
    if npz is not None:
        if x is not None or y is not None:
            raise ConfigError("dataset: give either x and y (.npy files) or npz (an archive), not both")
        # one archive usually holds both splits under different keys: no warning for a single path
        path = os.fspath(npz[split] if isinstance(npz, Mapping) else npz)
        xs = map_npz_member(path, f"x_{split}" if x_key is None else str(streaming.for_split(x_key, split, "x_key")),
                            "x_key")
        ys = map_npz_member(path, f"y_{split}" if y_key is None else str(streaming.for_split(y_key, split, "y_key")),
                            "y_key")
        where = path
    elif x is None or y is None:
        raise ConfigError("dataset: give x and y (.npy files), or npz (an .npz archive)")
    else:
        xs = map_npy(os.fspath(streaming.for_split(x, split, "x")), "x")
        ys = map_npy(os.fspath(streaming.for_split(y, split, "y")), "y")
        where = f"{streaming.for_split(x, split, 'x')} and {streaming.for_split(y, split, 'y')}"
    if xs.ndim == 0 or ys.ndim == 0 or len(xs) != len(ys):
        rows = [len(a) if a.ndim else "no" for a in (xs, ys)]
        raise DataError(f"dataset: x has {rows[0]} rows, y {rows[1]} ({where}); "
                        "give arrays with one row per example")
    if scale is not None and (not isinstance(scale, (int, float)) or scale <= 0):
        raise ConfigError(f"dataset.scale={scale!r} must be a positive number (x is divided by it)")

    train, rows = context.train, context.batch_size
    order, batches = streaming.share(len(xs), context)
    if train:
        order = order[: batches * rows].reshape(batches, rows)
        index = tf.data.Dataset.from_tensor_slices(order)
    else:
        index = tf.data.Dataset.from_tensor_slices(order).batch(rows)

    def gather(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.sort(idx)  # ascending reads; the set in the batch is what matters, not its order
        xb, yb = np.ascontiguousarray(xs[idx]), np.ascontiguousarray(ys[idx])
        _release(xs)
        _release(ys)
        return xb, yb

    def to_xy(idx: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        xb, yb = tf.numpy_function(gather, [idx], [tf.as_dtype(xs.dtype), tf.as_dtype(ys.dtype)], stateful=False)
        known = rows if train else None
        xb = tf.ensure_shape(xb, (known, *xs.shape[1:]))
        yb = tf.ensure_shape(yb, (known, *ys.shape[1:]))
        return (xb if scale is None else tf.cast(xb, tf.float32) / float(scale)), yb

    data = (index.map(to_xy, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .apply(tf.data.experimental.assert_cardinality(batches))
            .prefetch(tf.data.AUTOTUNE))
    return data
