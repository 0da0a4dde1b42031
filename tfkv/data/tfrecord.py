"""TFRecord files of `tf.train.Example`s, streamed: `dataset._target_: tfkv.data.tfrecord.load`.

The feature spec lives in the config (name -> {shape, dtype, default, decode, scale}); `label`
names y and the other features make x (one feature: that tensor; several: a dict of inputs).
Records are dealt to workers before anything is parsed, shuffled by (seed, epoch) through a
bounded buffer, batched, then parsed a batch at a time with `tf.io.parse_example` in a
parallel map. A worker holds the shuffle buffer and a few batches, never the set.

Records are counted once per file (by skipping from length to length, not reading payloads)
and remembered while the file is unchanged, so the pipeline states its exact batch count.
A damaged file is one line naming it and the byte of the damaged record, whether the count
finds it (a length past the end of the file) or reading does (a checksum that does not match).
The first record is parsed against the spec when the reader is made, so a spec that does
not fit the files is one line naming the feature before training starts.
"""

from __future__ import annotations

import math
import os
import re
import struct
from typing import Any, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfkv.data import streaming
from tfkv.data.base import Context
from tfkv.errors import ConfigError, DataError

DTYPES = {"float32": tf.float32, "int64": tf.int64, "string": tf.string}
KIND = {"float32": "float_list", "int64": "int64_list", "string": "bytes_list"}  # Example's field
IMAGE = "image"  # decode: PNG, JPEG, GIF or BMP bytes (tf.io.decode_image)
RAW = {"uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32", "float64"}
SPEC_KEYS = {"shape", "dtype", "default", "decode", "scale"}
READERS = 4  # files read at once: fixed (never AUTOTUNE) so every worker sees one record order
_COUNTS: dict = {}


class Feature:
    """One checked entry of the feature spec."""

    def __init__(self, name: str, entry: Any):
        key = f"dataset.features.{name}"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{key} must be a mapping such as {{shape: [3], dtype: float32}}, not {entry!r}")
        unknown = set(entry) - SPEC_KEYS
        if unknown:
            raise ConfigError(f"{key} has unknown key(s) {', '.join(sorted(map(str, unknown)))}; "
                              f"valid keys: {', '.join(sorted(SPEC_KEYS))}")
        self.name, self.key = name, key
        self.dtype = str(entry.get("dtype", "float32"))
        if self.dtype not in DTYPES:
            raise ConfigError(f"{key}.dtype={self.dtype!r} is not a tf.train.Example type; "
                              f"use one of {', '.join(DTYPES)}")
        shape = entry.get("shape", [])
        if not isinstance(shape, Sequence) or isinstance(shape, str) or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise ConfigError(f"{key}.shape={shape!r} must be a list of sizes, e.g. [28, 28, 1] ([] for a scalar)")
        self.shape = tuple(int(d) for d in shape)
        self.decode = None if entry.get("decode") is None else str(entry["decode"])
        if self.decode is not None:
            if self.decode != IMAGE and self.decode not in RAW:
                raise ConfigError(f"{key}.decode={self.decode!r} is not known; use {IMAGE} (PNG/JPEG/GIF/BMP "
                                  f"bytes) or the dtype of raw bytes ({', '.join(sorted(RAW))})")
            if self.dtype != "string":
                raise ConfigError(f"{key}.decode needs the bytes of a string feature; set {key}.dtype=string")
            if self.decode == IMAGE and len(self.shape) != 3:
                raise ConfigError(f"{key}.shape={list(self.shape)} must be [height, width, channels] to decode images")
        self.default = entry.get("default")
        if self.default is not None and self.decode is not None:
            raise ConfigError(f"{key}.default cannot go with decode; drop one")
        self.scale = entry.get("scale")
        if self.scale is not None and (not isinstance(self.scale, (int, float)) or self.scale <= 0):
            raise ConfigError(f"{key}.scale={self.scale!r} must be a positive number (x is divided by it)")

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return () if self.decode is not None else self.shape

    def parse_spec(self) -> tf.io.FixedLenFeature:
        default = self.default
        if default is not None:
            default = np.broadcast_to(np.asarray(default), self.shape).tolist()
        return tf.io.FixedLenFeature(self.stored_shape, DTYPES[self.dtype], default_value=default)

    def finish(self, values: tf.Tensor) -> tf.Tensor:
        """A batch of parsed values -> decoded, scaled tensors of shape (batch, *shape)."""
        if self.decode == IMAGE:
            spec = tf.TensorSpec(self.shape, tf.uint8)
            values = tf.map_fn(lambda b: tf.ensure_shape(tf.io.decode_image(
                b, channels=self.shape[-1], expand_animations=False), self.shape), values, fn_output_signature=spec)
        elif self.decode is not None:
            values = tf.reshape(tf.io.decode_raw(values, self.decode), (-1, *self.shape))
        if self.scale is not None:
            values = tf.cast(values, tf.float32) / float(self.scale)
        return values

    def check(self, example: tf.train.Example, path: str) -> None:
        """One stored record fits this entry, or one line saying what to change."""
        stored = example.features.feature
        if self.name not in stored:
            if self.default is not None:
                return
            raise DataError(f"{self.key}: the records of {path} have no feature {self.name!r} (they have "
                            f"{', '.join(sorted(stored))}); fix the name or give {self.key}.default")
        kind = stored[self.name].WhichOneof("kind")
        if kind != KIND[self.dtype]:
            actual = {v: k for k, v in KIND.items()}.get(kind, kind)
            raise DataError(f"{self.key}.dtype={self.dtype} but {path} stores {self.name!r} as {actual}; "
                            f"set {self.key}.dtype={actual}")
        values = getattr(stored[self.name], kind).value
        if self.decode is None:
            if len(values) != math.prod(self.shape):
                raise DataError(f"{self.key}.shape={list(self.shape)} holds {math.prod(self.shape)} values but "
                                f"{path} stores {len(values)} per record; set {self.key}.shape to match "
                                f"(e.g. [{len(values)}])")
            return
        if len(values) != 1:
            raise DataError(f"{self.key}: {path} stores {len(values)} byte strings per record, decode takes one")
        if self.decode == IMAGE:
            try:
                got = tuple(tf.io.decode_image(values[0], expand_animations=False).shape)
            except tf.errors.InvalidArgumentError:
                raise DataError(f"{self.key}.decode=image but {path} holds bytes that are not an image; "
                                f"set {self.key}.decode to their raw dtype (e.g. uint8)") from None
            if got[:2] != self.shape[:2]:
                raise DataError(f"{self.key}.shape={list(self.shape)} but the images of {path} are "
                                f"{list(got)}; set {self.key}.shape=[{got[0]}, {got[1]}, {self.shape[2]}]")
            return
        want = math.prod(self.shape) * np.dtype(self.decode).itemsize
        if len(values[0]) != want:
            raise DataError(f"{self.key}: shape {list(self.shape)} of {self.decode} is {want} bytes but {path} "
                            f"stores {len(values[0])} per record; fix {self.key}.shape or {self.key}.decode")


def count_records(path: str, compression: str | None = None) -> int:
    """Records in one file, remembered while the file keeps its size and modification time."""
    return streaming.cached_by_stat(_COUNTS, path, lambda: _count(path, compression), compression)


def _count(path: str, compression: str | None) -> int:
    if compression:  # no skipping through a compressed stream: let TensorFlow read it
        return _read_all(path, compression)
    # A record is: uint64 length, uint32 CRC of it, payload, uint32 CRC; hop over the payloads.
    opener = tf.io.gfile.GFile if "://" in path else open
    n, size = 0, tf.io.gfile.stat(path).length
    with opener(path, "rb") as f:
        pos = 0
        while pos < size:
            head = f.read(8)
            end = pos + 16 + struct.unpack("<Q", head)[0] if len(head) == 8 else size + 1
            if end > size:  # a damaged length, or the file cut short: never seek past the end
                raise DataError(_damaged_line(path, pos, "its length runs past the end of the file: a damaged "
                                              "length field, or the file is cut short"))
            pos = end
            f.seek(pos)
            n += 1
    return n


def _read_all(path: str, compression: str | None) -> int:
    """The records of `path`, read and checksummed by TensorFlow; a damaged one is one line."""
    try:
        return int(tf.data.TFRecordDataset(path, compression_type=compression or None)
                   .reduce(np.int64(0), lambda n, _: n + 1))
    except tf.errors.DataLossError as e:
        at = re.search(r"record at (\d+)", e.message)
        where = int(at.group(1)) if at else None
        raise DataError(_damaged_line(path, where, streaming.reason(e), compression)) from None


def _damaged_line(path: str, offset: int | None, why: str, compression: str | None = None) -> str:
    where = "" if offset is None else f" at byte {offset}" + (" of its decompressed stream" if compression else "")
    return (f"dataset.files: {path} has a damaged record{where} ({why}); replace the file, or leave it out "
            "of dataset.files")


def damaged(paths: Sequence[str], compression: str | None) -> str | None:
    """The line for the first of `paths` that TensorFlow cannot read to its end, or None (read
    only after reading failed: TensorFlow's error names no file)."""
    for path in paths:
        try:
            _read_all(path, compression)
        except DataError as e:
            return str(e)
    return None


def _first_example(path: str, compression: str | None) -> tf.train.Example | None:
    try:
        raw = next(iter(tf.data.TFRecordDataset(path, compression_type=compression).take(1)), None)
    except (tf.errors.DataLossError, tf.errors.InvalidArgumentError) as e:
        raise DataError(f"dataset.files: {path} is not a readable TFRecord file ({e.message.splitlines()[0]}); "
                        "check dataset.compression and the file") from None
    if raw is None:
        return None
    try:
        return tf.train.Example.FromString(raw.numpy())
    except Exception:  # protobuf's DecodeError: the payload is some other message
        raise DataError(f"dataset.files: the records of {path} are not tf.train.Example messages") from None


@streaming.reader
def load(
    files: Any,
    features: Mapping[str, Any],
    label: str,
    shuffle_buffer: int = 10_000,
    compression: str | None = None,
    *,
    context: Context,
) -> Any:
    """This worker's batches of (x, y) for one epoch of `split`.

    `files`: a glob (or list of globs), or {train: glob, test: glob}. `features`: name ->
    {shape: [...], dtype: float32|int64|string, default: value, decode: image|<raw dtype>,
    scale: divisor}. `label`: the feature that is y (a `num_classes` key beside them tells the model).
    Training batches are full and shuffled by (seed, epoch); test batches keep file order.
    """
    if not isinstance(features, Mapping) or not features:
        raise ConfigError("dataset.features must map each feature name to {shape: [...], dtype: ...}")
    spec = [Feature(str(name), entry) for name, entry in features.items()]
    if label not in features:
        raise ConfigError(f"dataset.label={label!r} is not one of dataset.features ({', '.join(map(str, features))}); "
                          "name the feature that holds y")
    if len(spec) < 2:
        raise ConfigError(f"dataset.features has only the label {label!r}; add the input feature(s)")
    if compression not in (None, "", "GZIP", "ZLIB"):
        raise ConfigError(f"dataset.compression={compression!r} must be null, GZIP or ZLIB")
    paths = streaming.match_files(streaming.for_split(files, context.split, "files"), "files")
    example = _first_example(paths[0], compression)
    if example is None:
        raise DataError(f"dataset.files: {paths[0]} holds no record; remove it or write records to it")
    for feature in spec:
        feature.check(example, paths[0])

    train = context.train
    total = sum(count_records(p, compression) for p in paths)
    ordered = [paths[i] for i in streaming.epoch_order(len(paths), context.seed, context.epoch, train)]
    records = tf.data.TFRecordDataset(ordered, compression_type=compression or None,
                                      num_parallel_reads=min(len(ordered), READERS))
    parse_spec = {f.name: f.parse_spec() for f in spec}

    def parse(serialized: tf.Tensor) -> tuple[Any, tf.Tensor]:
        parsed = tf.io.parse_example(serialized, parse_spec)
        out = {f.name: f.finish(parsed[f.name]) for f in spec}
        y = out.pop(label)
        return (next(iter(out.values())) if len(out) == 1 else out), y

    data = streaming.deal(records, total, parse, context, shuffle_buffer)
    return streaming.locating(data, lambda: damaged(ordered, compression))


def write(path: str | os.PathLike, columns: Mapping[str, np.ndarray]) -> None:
    """Write arrays of equal length as tf.train.Example records, one per row (for tests, benchmarks
    and users converting their data): floats -> float_list, integers -> int64_list, bytes -> bytes_list."""
    n = len(next(iter(columns.values())))
    with tf.io.TFRecordWriter(os.fspath(path)) as writer:
        for i in range(n):
            feature = {}
            for name, col in columns.items():
                v = col[i]
                if isinstance(v, (bytes, np.bytes_)):
                    feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[bytes(v)]))
                elif np.issubdtype(np.asarray(v).dtype, np.floating):
                    feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=np.ravel(v)))
                else:
                    feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=np.ravel(v)))
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
