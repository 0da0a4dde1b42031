"""One run's data as the trainer sees it: the `dataset` node's factory called for each split,
sharded, batched and counted the same way on every worker.

The factory is any callable named by `dataset._target_`. It may take, by name, the values of
`Context` (`split`, `seed`, `epoch`, `batch_size`, `rank`, `num_workers`); what it takes says what
it does itself, and tfkv does the rest:

- takes `rank` or `num_workers`: it returns this worker's shard; else tfkv shards the training
  split by (num_workers, rank);
- takes `batch_size`: it returns batches (training: full batches only); else tfkv batches;
- a `tf.data.Dataset` is taken in its own order (as `keras.Model.fit` takes one): a factory that
  shuffles takes `seed` and `epoch`. Arrays are shuffled by tfkv per (seed, epoch).

It returns a `tf.data.Dataset` of (x, y) pairs (x and y may be dicts: several inputs or
outputs), a pair of numpy arrays (x, y), `Split(either, num_classes=N)` to say how many classes
there are, or, for the built-in in-memory sets, a `DataSet` holding both splits.

The test split is evaluated in parts, one per worker (`test(parts, index)`; the trainer combines
the parts' tallies: `Parallel.evaluate_split`): every example of the split in exactly one part,
in order, none dropped, the last batch of a part possibly smaller. tfkv cuts in-memory sets into
contiguous parts and other data round robin by example (by batch where the factory batches);
a factory that shards itself is asked for part `rank` of `num_workers` of the test split, and
must keep that rule (the built-in readers deal records round robin). (1, 0): the whole split.

A factory's data is read through `Batches`: a TensorFlow error while reading it (a damaged
record, an image that does not decode) is one line naming the file and where in it, as the
built-in readers find it (`streaming.locating`), not a traceback from inside tf.data.

Every worker runs the same number of steps per epoch (they meet at every push): the fewest
full batches any worker's shard holds, from the data's cardinality when it is known (a reader
that can count cheaply says so with `tf.data.experimental.assert_cardinality`), else counted
once, or `steps_per_epoch` when the config sets it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from tfkv import target
from tfkv.data import streaming
from tfkv.data.base import Context, DataSet, input_scaling, steps_per_epoch
from tfkv.errors import ConfigError, DataError

log = logging.getLogger("tfkv")

# The keys of the dataset node that describe the data rather than being the factory's
# arguments (when the factory does not take them itself).
DESCRIPTION_KEYS = ("num_classes",)


PROVIDED = tuple(Context.__dataclass_fields__)


@dataclass
class Split:
    """A factory's result with what tfkv cannot read off the data: the number of classes."""

    data: Any  # a tf.data.Dataset of (x, y), or a pair of arrays
    num_classes: int | None = None


def _plain(node: Any) -> dict[str, Any]:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def _own_keys(fn: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(k for k in DESCRIPTION_KEYS if not target.accepts(fn, k))


def check(node: Mapping[str, Any]) -> Callable[..., Any]:
    """Check the dataset node before anything starts: its factory imports and takes these keys."""
    node = _plain(node)
    fn = target.locate(node.get("_target_") or "", "dataset._target_") if node.get("_target_") else None
    return target.check(node, "dataset", PROVIDED, _own_keys(fn) if fn else ())


class Source:
    """The train and test data of one worker, from the `dataset` node."""

    def __init__(self, node: Mapping[str, Any], seed: int, batch_size: int, eval_batch_size: int,
                 num_workers: int = 1, rank: int = 0, steps: int | None = None):
        self.node = _plain(node)
        self.fn = check(self.node)
        self.target = str(self.node["_target_"])
        self.seed, self.batch_size, self.eval_batch_size = int(seed), int(batch_size), int(eval_batch_size)
        self.num_workers, self.rank = int(num_workers), int(rank)
        self.shards_itself = target.accepts(self.fn, "rank") or target.accepts(self.fn, "num_workers")
        self.batches_itself = target.accepts(self.fn, "batch_size")
        self.num_classes: int | None = None
        first = self._call(self._context("train", 1))
        if _is_arrays(first):
            if self.batches_itself:
                raise DataError(f"dataset._target_={self.target} takes batch_size but returned arrays; return a "
                                "tf.data.Dataset of batches, or drop the batch_size parameter")
            first = self._as_memory(first, self._call(Context("test", self.seed, 1, self.eval_batch_size, 0, 1)))
        self.memory: DataSet | None = first if isinstance(first, DataSet) else None
        self._first: Any = None
        if self.memory is not None:
            self.name = self.memory.name
            self.num_classes = self.num_classes or self.memory.num_classes
            self.steps = steps or steps_per_epoch(self.memory, self.batch_size,
                                                  1 if self.shards_itself else self.num_workers)
        else:
            self.name = self.target.rsplit(".", 1)[-1]
            self._first = self._checked(first)
            self.steps = steps or self._count_steps()
        described = self.node.get("num_classes") if "num_classes" in _own_keys(self.fn) else None
        if self.num_classes is None and described is not None:
            self.num_classes = int(described)

    # -- what the model and the loss need to know ------------------------------------------------

    @property
    def input_spec(self) -> Any:
        """The unbatched `tf.TensorSpec`(s) of x."""
        import tensorflow as tf

        if self.memory is not None:
            x = self.memory.x_train
            dtype = tf.int32 if np.issubdtype(x.dtype, np.signedinteger) else tf.float32
            return tf.TensorSpec(x.shape[1:], dtype)
        return self._unbatched(self._spec[0])

    @property
    def input_scaling(self) -> Any:
        """What the pipeline does to the inputs before the model sees them
        (`tfkv.data.base.InputScaling`), None where it takes them as they are: a factory's
        tf.data.Dataset, or arrays that need no scaling."""
        return input_scaling(self.memory) if self.memory is not None else None

    @property
    def label_spec(self) -> Any:
        import tensorflow as tf

        if self.memory is not None:
            y = self.memory.y_train
            return tf.TensorSpec(y.shape[1:], tf.int32 if np.issubdtype(y.dtype, np.integer) else tf.float32)
        return self._unbatched(self._spec[1])

    @property
    def outputs(self) -> int | None:
        """What a builder's `num_classes` is: the number of classes, or for a floating-point label
        (a regression target, e.g. the csv reader's price column) the label's width, as a
        Keras regressor ends in Dense(width); None for class labels of an unknown count."""
        import tensorflow as tf

        spec = self.label_spec
        if not self.num_classes and isinstance(spec, tf.TensorSpec) and spec.dtype.is_floating:
            return int(np.prod([d or 1 for d in spec.shape]))
        return self.num_classes

    @property
    def input_shape(self) -> Any:
        """A tuple, or a dict input name -> tuple for dict inputs."""
        import tensorflow as tf

        return tf.nest.map_structure(lambda s: tuple(s.shape), self.input_spec)

    @property
    def positions(self) -> int:
        """Label positions per example: the sequence length for per-token class labels, else 1."""
        import tensorflow as tf

        spec = self.label_spec
        if isinstance(spec, tf.TensorSpec) and spec.dtype.is_integer and (spec.shape.rank or 0) >= 1:
            return int(np.prod([d or 1 for d in spec.shape]))
        return 1

    # -- the pipelines -----------------------------------------------------------------------------

    def train(self, epoch: int) -> Any:
        """This worker's batches of epoch `epoch`: exactly `steps` of them."""
        import tensorflow as tf

        from tfkv.data import pipeline

        if self.memory is not None:
            parts, index = (1, 0) if self.shards_itself else (self.num_workers, self.rank)
            data = pipeline.train_dataset(self.memory, self.batch_size, epoch, self.seed, parts, index,
                                          self.memory.augment)
            return data.take(self.steps)
        first, self._first = self._first, None  # epoch 1's pipeline is used once
        data = origin = first if first is not None and epoch == 1 else self._checked(
            self._call(self._context("train", epoch)))
        if not self.shards_itself and self.num_workers > 1:
            data = data.shard(self.num_workers, self.rank)
        if not self.batches_itself:
            data = data.batch(self.batch_size, drop_remainder=True)
        return Batches(data.take(self.steps).prefetch(tf.data.AUTOTUNE), origin, f"{self._what}, train split")

    def test(self, parts: int = 1, index: int = 0) -> Any:
        """Part `index` of `parts` of the test split (see the module docstring; default: the
        whole split) in order, in batches of eval_batch_size (the last may be smaller)."""
        import tensorflow as tf

        from tfkv.data import pipeline

        if self.memory is not None:
            return pipeline.test_dataset(self.memory, self.eval_batch_size, parts, index)
        what = f"{self._what}, test split"
        if self.shards_itself:
            data = self._checked(self._call(Context("test", self.seed, 1, self.eval_batch_size, index, parts)))
            return Batches(data, data, what)
        data = origin = self._checked(self._call(Context("test", self.seed, 1, self.eval_batch_size, 0, 1)))
        if parts > 1:  # round robin: by example, or by batch where the factory batches
            data = data.shard(parts, index)
        if not self.batches_itself:
            data = data.batch(self.eval_batch_size)
        return Batches(data.prefetch(tf.data.AUTOTUNE), origin, what)

    # -- inside ------------------------------------------------------------------------------------

    @property
    def _what(self) -> str:
        return f"dataset._target_={self.target}"

    def _context(self, split: str, epoch: int) -> Context:
        return Context(split, self.seed, epoch, self.batch_size, self.rank, self.num_workers)

    def _call(self, ctx: Context) -> Any:
        result = target.call(self.node, "dataset", asdict(ctx), _own_keys(self.fn))
        if isinstance(result, Split):
            if result.num_classes is not None:
                self.num_classes = int(result.num_classes)
            result = result.data
        return result

    def _as_memory(self, train: Any, test: Any) -> DataSet:
        """Arrays become an in-memory DataSet: tfkv shuffles them per (seed, epoch) as the built-in sets."""
        if not _is_arrays(test):
            raise DataError(f"dataset._target_={self.target} returned arrays for the train split and a "
                            f"{type(test).__name__} for the test split; return the same kind for both")
        for split, (x, y) in (("train", train), ("test", test)):
            if len(x) != len(y):
                raise DataError(f"dataset._target_={self.target} returned {len(x)} inputs and {len(y)} labels "
                                f"for the {split} split; return arrays of the same length")
        (x, y), (xt, yt) = train, test
        num_classes = self.num_classes
        if num_classes is None and np.issubdtype(y.dtype, np.integer) and len(y):
            num_classes = int(max(y.max(), yt.max() if len(yt) else 0)) + 1
        return DataSet(name=self.target.rsplit(".", 1)[-1], x_train=x, y_train=y, x_test=xt, y_test=yt,
                       num_classes=num_classes or 0, mean=(0.0,), std=(1.0,))

    def _checked(self, result: Any) -> Any:
        import tensorflow as tf

        if isinstance(result, tf.data.Dataset):
            spec = result.element_spec
            if isinstance(spec, tuple) and len(spec) == 2:
                self._spec = spec
                return result
            raise DataError(f"dataset._target_={self.target} returned a tf.data.Dataset whose elements are "
                            f"{_describe(spec)}, not (x, y) pairs; map them to (features, label)")
        raise DataError(f"dataset._target_={self.target} returned a {type(result).__name__}; return a "
                        "tf.data.Dataset of (x, y) pairs, a pair of numpy arrays (x, y), or "
                        "tfkv.data.Split(one of those, num_classes=N)")

    def _unbatched(self, spec: Any) -> Any:
        import tensorflow as tf

        if not self.batches_itself:
            return spec
        return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), spec)

    def _count_steps(self) -> int:
        """The fewest full batches of any worker's shard (every worker computes the same)."""
        import tensorflow as tf

        if self.shards_itself:
            counts = []
            for r in range(self.num_workers):
                data = self._first if r == self.rank else self._checked(
                    self._call(Context("train", self.seed, 1, self.batch_size, r, self.num_workers)))
                batches = data if self.batches_itself else data.batch(self.batch_size, drop_remainder=True)
                counts.append(_count(Batches(batches, data, f"{self._what}, train split"), self.target))
            steps = min(counts)
        else:
            n = _count(Batches(self._first, self._first, f"{self._what}, train split"), self.target)
            self._first = self._first.apply(tf.data.experimental.assert_cardinality(n))
            per = n // self.num_workers  # shard(num_workers, r): the last shards are the smallest
            steps = per if self.batches_itself else per // self.batch_size
        if steps < 1:
            over = f" over {self.num_workers} workers" if self.num_workers > 1 else ""
            raise DataError(f"dataset {self.name}: a worker's shard{over} holds no full batch of "
                            f"batch_size={self.batch_size}; lower batch_size or use fewer workers")
        return steps


def _is_arrays(result: Any) -> bool:
    return isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(a, np.ndarray) for a in result)


class Batches:
    """A factory's tf.data.Dataset as tfkv reads it (the trainer's loop, an evaluation, a count):
    an error TensorFlow raises while reading it becomes one line, the damaged file's as the reader
    that made `origin` locates it (`streaming.locating`), else, for a DataLossError, the error's own
    words and the split. Other errors (a bug in a factory's own map) keep their traceback."""

    def __init__(self, data: Any, origin: Any, what: str) -> None:
        self.data, self._origin, self._what = data, origin, what

    @property
    def element_spec(self) -> Any:
        return self.data.element_spec

    def cardinality(self) -> Any:
        return self.data.cardinality()

    def skip(self, count: int) -> Batches:
        return Batches(self.data.skip(count), self._origin, self._what)

    def __iter__(self) -> Any:
        with self._reading():
            yield from self.data

    def count(self) -> int:
        """Its elements, counted by reading it once (inside TensorFlow)."""
        with self._reading():
            return int(self.data.reduce(np.int64(0), lambda c, _: c + 1))

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        import tensorflow as tf

        try:
            yield
        except tf.errors.OpError as e:
            line = streaming.damage(self._origin)
            if line is None and not isinstance(e, tf.errors.DataLossError):
                raise
            raise DataError(line or f"{self._what}: reading it failed ({streaming.reason(e)}); check its "
                            "files") from None


def _count(data: Batches, name: str) -> int:
    n = int(data.cardinality())
    if n >= 0:
        return n
    if n == -1:  # INFINITE
        raise DataError(f"dataset._target_={name} is infinite (repeat() without a count); drop the repeat, "
                        "or set steps_per_epoch=N")
    log.info("counting the batches of %s once (set steps_per_epoch, or assert_cardinality in the factory, "
             "to skip this)", name)
    return data.count()


def _describe(spec: Any) -> str:
    return type(spec).__name__ if not isinstance(spec, tuple) else f"tuples of {len(spec)}"
