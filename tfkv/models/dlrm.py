"""DLRM-like click-through-rate model: a bottom MLP on the dense features, one embedding per
categorical feature, their pairwise dot products (or concatenation), a top MLP, one logit.

Inputs are a dict, as tfkv.data.clicks makes them: "dense" float32 (d,) and "cat" integer
(f,), one id per categorical feature, column i indexing table i (`vocab_sizes[i]` rows).
`embedding=sharded` makes each table a `tfkv.layers.ShardedEmbedding` (the table lives in the
KVStore, a worker holds only the rows of its batch); `keras` a plain `keras.layers.Embedding`
(trained row-sparse with kvstore.row_sparse=true, else dense).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import keras

from tfkv.errors import ConfigError
from tfkv.models._common import logits

EMBEDDINGS = ("keras", "sharded")
INTERACTIONS = ("dot", "concat")


def _check(input_shape: Any, vocab_sizes: Sequence[int], embedding_dim: int, bottom: Sequence[int],
           top: Sequence[int], interaction: str, embedding: str) -> tuple[int, int]:
    """(dense width, categorical features) after checking the model node against the data."""
    if not isinstance(input_shape, Mapping) or set(input_shape) != {"dense", "cat"}:
        got = sorted(input_shape) if isinstance(input_shape, Mapping) else f"one input of shape {tuple(input_shape)}"
        raise ConfigError(f"model._target_=tfkv.models.dlrm.build needs dict inputs 'dense' and 'cat' "
                          f"(dataset=clicks makes them), the data set gives {got}")
    if embedding not in EMBEDDINGS:
        raise ConfigError(f"model.embedding={embedding!r} must be one of {', '.join(EMBEDDINGS)}")
    if interaction not in INTERACTIONS:
        raise ConfigError(f"model.interaction={interaction!r} must be one of {', '.join(INTERACTIONS)}")
    if int(embedding_dim) < 1 or any(int(h) < 1 for h in [*bottom, *top]):
        raise ConfigError(f"model.embedding_dim={embedding_dim}, model.bottom={list(bottom)} and "
                          f"model.top={list(top)} must be sizes of at least 1")
    features = int(input_shape["cat"][0]) if input_shape["cat"] else 1
    if len(vocab_sizes) != features or min(int(v) for v in vocab_sizes) < 1:
        raise ConfigError(f"model.vocab_sizes={list(vocab_sizes)} must give one table size (at least 1) per "
                          f"categorical feature: the data set has {features}; set it to the data set's "
                          "vocab_sizes (model.vocab_sizes=[...] as dataset.vocab_sizes)")
    return int(input_shape["dense"][0]), features


def _table(embedding: str, rows: int, dim: int, name: str, rows_per_batch: int | None) -> Any:
    import keras

    if embedding == "keras":
        return keras.layers.Embedding(rows, dim, name=name)
    try:
        from tfkv.layers import ShardedEmbedding
    except ImportError:
        raise ConfigError("model.embedding=sharded needs tfkv.layers.ShardedEmbedding, which this tfkv "
                          "lacks; use model.embedding=keras") from None
    if not rows_per_batch:
        raise ConfigError("model.embedding=sharded needs model.rows_per_batch (at least the batch size of "
                          "one device: the most distinct ids a batch can hold)")
    return ShardedEmbedding(rows, dim, rows_per_batch=int(rows_per_batch), name=name)


def build(input_shape: Any, vocab_sizes: Sequence[int] = (1000, 1000, 1000, 1000), embedding_dim: int = 16,
          bottom: Sequence[int] = (64,), top: Sequence[int] = (64, 32), interaction: str = "dot",
          embedding: str = "keras", rows_per_batch: int | None = None) -> keras.Model:
    """dense -> bottom MLP (ReLU, last layer `embedding_dim` wide); cat[:, i] -> table i
    (`embedding_dim`); `dot`: the pairwise dot products of those f+1 vectors beside the bottom
    output (DLRM's interaction), `concat`: all of them side by side; -> top MLP (ReLU) -> one logit."""
    import keras  # here, not at import: config validation locates builders without TensorFlow

    width, features = _check(input_shape, vocab_sizes, embedding_dim, bottom, top, interaction, embedding)
    dense = keras.Input(shape=(width,), name="dense")
    cat = keras.Input(shape=(features,), dtype="int64", name="cat")
    x = dense
    for i, units in enumerate([*bottom, embedding_dim], start=1):
        x = keras.layers.Dense(int(units), activation="relu", name=f"bottom{i}")(x)
    vectors = [x] + [_table(embedding, int(rows), int(embedding_dim), f"embedding{i}", rows_per_batch)(cat[:, i])
                     for i, rows in enumerate(vocab_sizes)]
    if interaction == "dot":
        stacked = keras.ops.stack(vectors, axis=1)  # (n, f+1, dim)
        n = len(vectors)
        dots = keras.ops.reshape(keras.ops.einsum("nid,njd->nij", stacked, stacked), (-1, n * n))
        pairs = [i * n + j for i in range(n) for j in range(i + 1, n)]  # each pair once
        x = keras.layers.Concatenate(name="interaction")([x, keras.ops.take(dots, pairs, axis=1)])
    else:
        x = keras.layers.Concatenate(name="interaction")(vectors)
    for i, units in enumerate(top, start=1):
        x = keras.layers.Dense(int(units), activation="relu", name=f"top{i}")(x)
    return keras.Model({"dense": dense, "cat": cat}, logits(x, 1), name="dlrm")
