"""Keras layers tfkv provides: `ShardedEmbedding`, an embedding whose table lives in the KVStore.

Built by tfkv's data parallelism (inside `serving_rows()`), a `ShardedEmbedding` holds no table:
its `embeddings` variable is a cache of `rows_per_batch` rows and `row_ids` the global ids those
rows are (sorted; unused slots hold `input_dim`, past every real id). A lookup maps each id to
its slot with a binary search (tf.searchsorted), so the gradient of the cache is a
tf.IndexedSlices whose indices, through `row_ids`, are the table's rows: what is pushed to the
store as a row-sparse value (tfkv.parallel.sparse loads the rows each batch reads and pushes
the rows it touched). The table itself is a `tfkv.store.Table` key the store creates, never
materialised on a worker.

Built anywhere else (plain Keras, a loaded model.keras) it is a `keras.layers.Embedding` with
the whole table, and tfkv's export saves it as one (`keras_config`), so `keras.models.load_model`
needs no tfkv.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf

#: The table's initialisations a `tfkv.store.Table` knows, and the Keras initializer of each
#: for a layer built without a store (same distribution, not the same draws).
INITS = ("uniform", "normal", "zeros")

_building = threading.local()


@contextlib.contextmanager
def serving_rows() -> Iterator[None]:
    """Inside, a ShardedEmbedding that is built holds a cache of rows, not the table (what a
    store-backed trainer builds its model copies under)."""
    before = getattr(_building, "rows", False)
    _building.rows = True
    try:
        yield
    finally:
        _building.rows = before


def _keras_initializer(init: str, scale: float, seed: int) -> Any:
    if init == "uniform":
        return keras.initializers.RandomUniform(-scale, scale, seed=seed)
    if init == "normal":
        return keras.initializers.RandomNormal(stddev=scale, seed=seed)
    return keras.initializers.Zeros()


@keras.saving.register_keras_serializable(package="tfkv")
class ShardedEmbedding(keras.layers.Embedding):
    """An embedding table of `input_dim` rows of `output_dim` values held by the KVStore (its
    servers, for dist_*); a worker keeps the rows of the current batch only: at most
    `rows_per_batch` distinct ids per batch of a worker (all its devices together). The table
    starts as `init` ("uniform" in [-scale, scale], "normal" with stddev `scale`, or "zeros"),
    drawn by the store from `seed`."""

    def __init__(self, input_dim: int, output_dim: int, rows_per_batch: int, init: str = "uniform",
                 scale: float = 0.05, seed: int = 0, **kwargs: Any) -> None:
        if init not in INITS:
            raise ValueError(f"ShardedEmbedding: init={init!r}; use one of {', '.join(INITS)}")
        if not isinstance(rows_per_batch, int) or rows_per_batch <= 0:
            raise ValueError(f"ShardedEmbedding: rows_per_batch={rows_per_batch!r}; give the most distinct ids one "
                             "batch of a worker may hold (a positive integer)")
        kwargs.pop("embeddings_initializer", None)  # from init/scale/seed
        super().__init__(input_dim, output_dim, embeddings_initializer=_keras_initializer(init, scale, seed), **kwargs)
        self.rows_per_batch = rows_per_batch
        self.init, self.scale, self.seed = init, float(scale), int(seed)
        self.holds_rows = False  # set at build: a cache of rows (under serving_rows) or the whole table
        # Set by the trainer when it cannot compute the ids ahead (a subclassed model): called
        # with a batch's distinct ids at lookup time, returns (sorted ids, their rows).
        self.fetch: Callable[[Any], tuple[Any, Any]] | None = None

    def build(self, input_shape: Any = None) -> None:
        if self.built:
            return
        if not getattr(_building, "rows", False):
            super().build(input_shape)
            return
        self.holds_rows = True
        self._embeddings = self.add_weight(shape=(self.rows_per_batch, self.output_dim), initializer="zeros",
                                           name="embeddings", trainable=True)
        self.row_ids = self.add_weight(shape=(self.rows_per_batch,), initializer=keras.initializers.Constant(
            self.input_dim), dtype="int64", name="row_ids", trainable=False)
        self.built = True

    def call(self, inputs: Any) -> Any:
        if not self.holds_rows:
            return super().call(inputs)
        ids = tf.cast(inputs, tf.int64)
        flat = tf.reshape(ids, [-1])
        if self.fetch is not None:
            self._fetch_now(flat)
        cache = tf.convert_to_tensor(self._embeddings.value)
        slots = tf.minimum(tf.searchsorted(tf.convert_to_tensor(self.row_ids.value), flat), self.rows_per_batch - 1)
        out = tf.gather(cache, slots)
        return tf.cast(tf.reshape(out, tf.concat([tf.shape(ids), [self.output_dim]], 0)), self.compute_dtype)

    def _fetch_now(self, flat: Any) -> None:
        """The rows of this batch's ids from the store, into the cache, before they are read."""
        wanted = tf.unique(flat).y
        got_ids, rows = tf.numpy_function(self.fetch, [wanted], [tf.int64, tf.float32], stateful=True)
        n = tf.shape(got_ids)[0]
        pad = self.rows_per_batch - n
        self.row_ids.assign(tf.concat([got_ids, tf.fill([pad], tf.cast(self.input_dim, tf.int64))], 0))
        self._embeddings.assign(tf.concat([tf.reshape(rows, [-1, self.output_dim]),
                                           tf.zeros([pad, self.output_dim], self._embeddings.dtype)], 0))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.pop("embeddings_initializer", None)
        config.update(rows_per_batch=self.rows_per_batch, init=self.init, scale=self.scale, seed=self.seed)
        return config

    def keras_config(self) -> dict[str, Any]:
        """The config of the plain `keras.layers.Embedding` this layer is exported as."""
        return keras.layers.Embedding.get_config(self)

    @property
    def table_shape(self) -> tuple[int, int]:
        return (self.input_dim, self.output_dim)


__all__ = ["INITS", "ShardedEmbedding", "serving_rows"]
