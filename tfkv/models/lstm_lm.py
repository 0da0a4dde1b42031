"""Multi-layer LSTM language model (spec 004's example): embedding -> LSTM layers -> decoder.

The model is declared as named layer groups, `embed`, `lstm1` .. `lstmN`, `decoder`, so that
model parallelism can put each on its own device (`placement={embed: gpu:0, lstm1: gpu:0, ...}`);
`build()` chains the same groups into one Keras model for data parallelism, with the weights in
the same order, so checkpoints move between the two.

Inputs are (batch, seq_len) token ids (float or int; the embedding casts them), outputs
(batch, seq_len, vocab) logits of the next token at every position. The model is stateless per
sequence: every sequence starts from a zero LSTM state, and sequences of a batch are independent
(unlike the reference's carried state across batches), which lets the data pipeline shuffle
sequences and the pipeline cut a batch anywhere. Dropout, when set, is applied to the
non-recurrent connections (after the embedding and after every LSTM layer), as in Zaremba et al.

Importing this module does not import TensorFlow: the config layer asks it for group names.
"""

from __future__ import annotations

from typing import Any, Sequence

from tfkv.errors import ConfigError
from tfkv.models._checks import check_dropout
from tfkv.models.groups import LayerGroup


def group_names(hidden: Sequence[int] = (200, 200), **_: Any) -> list[str]:
    """The layer groups of a model with `len(hidden)` LSTM layers, in order (from the model's
    config alone: the config layer checks a placement with it before anything is built)."""
    return ["embed", *(f"lstm{i}" for i in range(1, len(hidden) + 1)), "decoder"]


def _seq_len(input_shape: tuple[int, ...]) -> int:
    if len(input_shape) != 1:
        shape = "(" + ", ".join(str(d) for d in input_shape) + ")"
        raise ConfigError(f"model lstm_lm needs token sequences (seq_len,); dataset gives shape {shape}: "
                          "use dataset=ptb")
    return int(input_shape[0])


def build_groups(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (200, 200),
                 embed_dim: int = 0, dropout: float = 0.0) -> list[LayerGroup]:
    """The model's layer groups with their cost estimates (forward FLOPs and parameters per example).

    Costs: an LSTM layer does 4 gates x (input + hidden) x hidden multiply-adds per step, 2 FLOPs
    each, over seq_len steps; the decoder 2 x hidden x vocab per position; the embedding lookup
    one copy per element (it is memory-bound, nearly free next to the matrix products).
    """
    import keras

    steps, vocab = _seq_len(input_shape), int(num_classes)
    hidden = [int(h) for h in hidden]
    if not hidden or min(hidden) < 1:
        raise ConfigError(f"model.hidden={hidden} must list one positive size per LSTM layer, e.g. [200,200]")
    if embed_dim < 0:
        raise ConfigError(f"model.embed_dim={embed_dim} must be 0 (the first LSTM's size) or more")
    check_dropout(dropout)
    embed_dim = int(embed_dim) or hidden[0]
    rate = float(dropout)

    def dropout(name: str) -> list[Any]:
        return [keras.layers.Dropout(rate, name=name)] if rate > 0 else []

    groups = [LayerGroup(
        "embed", lambda: [_embedding_class()(vocab, embed_dim, name="embedding"), *dropout("dropout0")],
        (steps,), flops=float(steps * embed_dim), params=vocab * embed_dim)]
    width = embed_dim
    for i, units in enumerate(hidden, start=1):
        def make(i: int = i, units: int = units) -> list[Any]:
            return [keras.layers.LSTM(units, return_sequences=True, name=f"lstm{i}"), *dropout(f"dropout{i}")]
        groups.append(LayerGroup(f"lstm{i}", make, (steps, width),
                                 flops=float(8 * (width + units) * units * steps),
                                 params=4 * (width + units + 1) * units))
        width = units
    # float32 logits even under a mixed-precision policy, as the other models' classifier layer
    groups.append(LayerGroup(
        "decoder", lambda: [keras.layers.Dense(vocab, name="decoder", dtype="float32")],
        (steps, width), flops=float(2 * width * vocab * steps), params=(width + 1) * vocab))
    return groups


_EMBEDDING: Any = None


def _embedding_class() -> Any:
    """keras' Embedding, but its weight gradient is a dense tensor, as MXNet's Embedding gives by
    default (sparse_grad=False): the stores, updaters and parameter servers sum and update plain
    tensors, and a vocabulary-sized dense gradient is small next to the decoder's."""
    global _EMBEDDING
    if _EMBEDDING is None:
        import keras
        import tensorflow as tf

        @tf.custom_gradient
        def dense_grad(table: Any) -> Any:
            return tf.identity(table), lambda dy: tf.convert_to_tensor(dy)

        class Embedding(keras.layers.Embedding):
            def call(self, inputs: Any) -> Any:
                ids = tf.cast(inputs, tf.int32)  # int32 from the pipeline; other int dtypes from callers
                return tf.gather(dense_grad(tf.convert_to_tensor(self.embeddings)), ids)

        _EMBEDDING = Embedding
    return _EMBEDDING


def build(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (200, 200), embed_dim: int = 0,
          dropout: float = 0.0) -> Any:
    """All groups chained into one built `keras.Model` named lstm_lm (for data parallelism)."""
    import keras

    groups = build_groups(input_shape, num_classes, hidden, embed_dim, dropout)
    layers = [layer for g in groups for layer in g.make()]
    return keras.Sequential([keras.Input(shape=groups[0].input_shape, dtype="int32"), *layers], name="lstm_lm")


# Model parallelism: the builder declares its layer groups (tfkv.models.layer_groups reads these).
build.group_names = group_names  # type: ignore[attr-defined]
build.build_groups = build_groups  # type: ignore[attr-defined]
