"""What the built-in streaming readers (TFRecord, image folder, CSV, npy/npz) share: picking a
split's files, the (seed, epoch) streams, each worker's share of the records, the batch count
they `assert_cardinality`, and the one-line errors for files that are not there or damaged.

Every reader shards by record index *before* decoding anything: worker `rank` of `num_workers`
takes records rank, rank + num_workers, ... of the epoch's order, which every worker computes
alike from (seed, epoch). So the shards of one epoch are disjoint and cover the set, and a
worker holds at most a shuffle buffer and a few batches, never the whole set.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import weakref
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tfkv.data.base import Context
from tfkv.errors import ConfigError

log = logging.getLogger(__name__)

SPLITS = ("train", "test")
# Salts keep a reader's independent random streams apart (file order vs record buffer).
FILE_ORDER, RECORDS = 1, 2
_WARNED: set[str] = set()
# A reader's dataset -> how to find the damaged file when reading it fails (see `locating`).
_LOCATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reader(load: Callable[..., Any]) -> Callable[..., Any]:
    """A built-in reader's `load(..., context: Context)` as the factory tfkv calls: it takes
    `Context`'s values by name, with a reader's defaults (so tfkv sees that it shards and batches
    itself: tfkv.data.source), and hands them to `load` as one checked `Context`."""
    own = [p for name, p in inspect.signature(load).parameters.items() if name != "context"]
    given = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
             for f in dataclasses.fields(Context)]

    @functools.wraps(load)
    def factory(*args: Any, **kwargs: Any) -> Any:
        context = Context(**{p.name: kwargs.pop(p.name) for p in given if p.name in kwargs})
        check_context(context)
        return load(*args, context=context, **kwargs)

    factory.__signature__ = inspect.signature(load).replace(parameters=[*own, *given])  # type: ignore[attr-defined]
    return factory


def check_context(context: Context) -> None:
    """The injected parameters make sense (a direct caller may pass anything)."""
    if context.split not in SPLITS:
        raise ConfigError(f"split={context.split!r} must be one of {', '.join(SPLITS)}")
    if context.batch_size < 1:
        raise ConfigError(f"batch_size={context.batch_size} must be at least 1")
    if context.num_workers < 1 or not 0 <= context.rank < context.num_workers:
        raise ConfigError(f"rank={context.rank} must be in [0, num_workers={context.num_workers})")


def for_split(value: Any, split: str, key: str) -> Any:
    """`value` itself, or `value[split]` when it is a {train: ..., test: ...} mapping.

    One value for both splits evaluates on the training data: allowed (a quick look at a
    set with no held-out part), but logged, since it is rarely what a run should report.
    """
    if isinstance(value, Mapping):
        if split not in value:
            raise ConfigError(f"dataset.{key} has no {split!r} entry (it has {', '.join(map(str, value))}); "
                              f"add dataset.{key}.{split}")
        return value[split]
    if split == "test" and key not in _WARNED:  # once: the test split is made again every epoch
        _WARNED.add(key)
        log.warning("dataset.%s is one value for both splits: the test split evaluates the training "
                    "data; give dataset.%s={train: ..., test: ...} for a held-out set", key, key)
    return value


def match_files(patterns: str | Sequence[str], key: str) -> list[str]:
    """The sorted files matching a glob (or several), local or any file system TensorFlow reads."""
    import tensorflow as tf

    patterns = [patterns] if isinstance(patterns, (str, os.PathLike)) else list(patterns)
    files: list[str] = []
    for pattern in patterns:
        found = sorted(tf.io.gfile.glob(os.fspath(pattern)))
        if not found:
            raise ConfigError(f"dataset.{key}={os.fspath(pattern)!r} matches no file; give a glob of "
                              "existing files (relative paths start at the run's working directory)")
        files += found
    return files


def stream_seed(seed: int, epoch: int, salt: int) -> int:
    """A 31-bit seed for one random stream of (seed, epoch), the same on every worker."""
    return int(np.random.default_rng([seed, epoch, salt]).integers(2**31 - 1))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """0..n-1 in this epoch's order: a permutation by (seed, epoch), or as stored."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, FILE_ORDER]).permutation(n)


def share(n: int, context: Context) -> tuple[np.ndarray, int]:
    """This worker's records of `n` indexed ones, in the epoch's order (shuffled for training), and
    the batches they make."""
    order = epoch_order(n, context.seed, context.epoch, context.train)[context.rank::context.num_workers]
    return order, batch_count(len(order), context.batch_size, context.train)


def shard_count(n: int, num_workers: int, rank: int) -> int:
    """Records worker `rank` gets of `n` when the records are dealt round robin."""
    return len(range(rank, n, num_workers))


def batch_count(records: int, batch_size: int, train: bool) -> int:
    """Batches of a shard: full ones only for training (every worker steps alike), else all."""
    return records // batch_size if train else -(-records // batch_size)


def cached_by_stat(cache: dict, path: str, compute: Callable[[], Any], *extra: Any) -> Any:
    """`compute()` for `path` (and `extra` settings), remembered for as long as the file keeps its
    size and modification time."""
    import tensorflow as tf

    stat = tf.io.gfile.stat(path)
    key = (path, stat.length, stat.mtime_nsec, *extra)
    if key not in cache:
        cache[key] = compute()
    return cache[key]



def deal(records: Any, total: int, convert: Callable[..., Any], context: Context, shuffle_buffer: int) -> Any:
    """This worker's batches of a stream of `total` raw records that every worker reads in the same
    order: its round-robin share, kept raw until then (the others' records cost no decoding),
    shuffled through a bounded buffer by (seed, epoch) for training, batched, and `convert`ed a
    batch at a time in a parallel map, with the exact batch count asserted."""
    import tensorflow as tf

    c = context
    records = records.shard(c.num_workers, c.rank)
    if c.train:
        records = records.shuffle(shuffle_buffer, seed=stream_seed(c.seed, c.epoch, RECORDS),
                                  reshuffle_each_iteration=False)
    batches = batch_count(shard_count(total, c.num_workers, c.rank), c.batch_size, c.train)
    return (records.batch(c.batch_size, drop_remainder=c.train)
            .map(convert, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .apply(tf.data.experimental.assert_cardinality(batches))
            .prefetch(tf.data.AUTOTUNE))


def locating(data: Any, locate: Callable[[], str | None]) -> Any:
    """`data`, remembered with `locate`: called when reading `data` fails (TensorFlow's error
    names neither the file nor the reader), it finds the damaged file and returns one line
    naming it and where in it, or None. `tfkv.data.Source` asks it (`damage`)."""
    _LOCATORS[data] = locate
    return data


def damage(data: Any) -> str | None:
    """The line `locating` gave for `data`'s files, or None when none was given or none found."""
    locate = _LOCATORS.get(data)
    return locate() if locate is not None else None


def reason(error: Any) -> str:
    """A TensorFlow error's own words, without the function node and op TensorFlow adds."""
    text = str(getattr(error, "message", None) or error).strip().splitlines()[0]
    text = re.sub(r"^\{\{[^}]*\}\}\s*", "", text)
    return re.sub(r"\s*\[Op:[^\]]*\].*$", "", text)

