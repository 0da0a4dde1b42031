"""A synthetic click log, generated on the fly from a seed (no download): the CTR data set.

Each example has `num_dense` standard-normal dense features and one id per categorical feature
(`vocab_sizes`, one vocabulary each). Ids follow a power law (Zipf, exponent `zipf`): the rank-k
id of a vocabulary is drawn with probability proportional to 1/k**zipf, as the ids of a real
click log are, a few hot and a long tail; ranks are scattered over the vocabulary by a fixed
permutation (`scatter`), so that hot rows are not all at the start of a table sharded by range.

Clicks come from a hidden model: logit = bias + dense . w + sum over features of a per-id effect
+ sum over pairs of features of the dot product of per-id latent vectors (what a DLRM's dot
interaction can learn), click ~ Bernoulli(sigmoid(logit)). The per-id effects and vectors are
hashes of (seed, feature, id), so a vocabulary of any size costs no memory; frequent ids are
learnable, the tail is noise, and `oracle_logits` (the hidden logit) gives the best AUC any model
can reach on the same examples.

`generate` is the numpy core (no TensorFlow: the benchmarks draw batches from it); `load` is the
`dataset._target_` factory: a tf.data.Dataset of ({"dense": float32 (d,), "cat": int64 (f,)},
click float32 (1,)) pairs, the training split shuffled per (seed, epoch).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tfkv.errors import ConfigError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# the stream of examples each split draws from (the hidden model is the same for both)
_STREAMS = {"train": 1, "test": 2}


@dataclass(frozen=True)
class Clicks:
    """The shape of a click log and of its hidden model (everything `generate` needs but a seed)."""

    num_dense: int = 8
    vocab_sizes: tuple[int, ...] = (1000, 1000, 1000, 1000)
    zipf: float = 1.1  # the power law's exponent: larger, fewer distinct ids per batch
    latent_dim: int = 4  # of the hidden per-id vectors whose pairwise dots add to the logit
    effect_scale: float = 1.0  # std of the per-id effect
    pair_scale: float = 0.5  # std of each latent vector's components
    dense_scale: float = 0.7  # norm of the dense weights
    bias: float = -1.0  # sets the click rate (about 0.3 with the defaults)
    scatter: bool = True

    def __post_init__(self) -> None:
        if int(self.num_dense) < 1:
            raise ConfigError(f"dataset.num_dense={self.num_dense} must be at least 1")
        if not self.vocab_sizes or min(int(v) for v in self.vocab_sizes) < 1:
            raise ConfigError(f"dataset.vocab_sizes={list(self.vocab_sizes)} must list at least one "
                              "vocabulary size of at least 1, e.g. [1000,1000]")
        if not float(self.zipf) > 0:
            raise ConfigError(f"dataset.zipf={self.zipf} must be positive (1.1 is typical of click logs)")
        if int(self.latent_dim) < 0:
            raise ConfigError(f"dataset.latent_dim={self.latent_dim} must not be negative")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective hash of uint64s (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _normal(seed: int, feature: int, ids: np.ndarray, component: int) -> np.ndarray:
    """A standard normal per (seed, feature, id, component), from two hashes (Box-Muller)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        base = _mix(np.uint64(seed) * _GOLDEN + np.uint64(feature * 1000 + component + 1))
    h1 = _mix(ids.astype(np.uint64) * _GOLDEN + base)
    h2 = _mix(h1 + _GOLDEN)
    u1 = ((h1 >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0 ** 53
    u2 = (h2 >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def _multiplier(vocab: int) -> int:
    """An odd multiplier coprime to `vocab`: rank -> rank * m % vocab is a permutation."""
    m = 2654435761 % vocab or 1
    while math.gcd(m, vocab) != 1:
        m += 1
    return m


def zipf_ids(rng: np.random.Generator, n: int, vocab: int, exponent: float, scatter: bool = True) -> np.ndarray:
    """`n` ids in [0, vocab), rank k+1 drawn with probability ~ 1/(k+1)**exponent (the
    continuous power law's inverse CDF, floored: O(n) time and memory whatever the vocabulary)."""
    u = rng.random(n)
    top = float(vocab) + 1.0
    if abs(exponent - 1.0) < 1e-9:
        x = top ** u
    else:
        x = (1.0 + u * (top ** (1.0 - exponent) - 1.0)) ** (1.0 / (1.0 - exponent))
    rank = np.clip(np.floor(x).astype(np.int64) - 1, 0, vocab - 1)
    return rank * _multiplier(vocab) % vocab if scatter else rank


def oracle_logits(spec: Clicks, seed: int, dense: np.ndarray, cat: np.ndarray) -> np.ndarray:
    """The hidden model's logit of each example (float64, (n,))."""
    w = np.random.default_rng([seed, 0]).standard_normal(spec.num_dense)
    logit = spec.bias + dense.astype(np.float64) @ (w * spec.dense_scale / math.sqrt(spec.num_dense))
    vectors = []
    for f in range(cat.shape[1]):
        ids = cat[:, f]
        logit = logit + spec.effect_scale * _normal(seed, f, ids, 0)
        vectors.append(np.stack([_normal(seed, f, ids, 1 + c) for c in range(spec.latent_dim)], axis=1)
                       * spec.pair_scale)
    for f in range(len(vectors)):
        for g in range(f + 1, len(vectors)):
            logit = logit + np.einsum("nk,nk->n", vectors[f], vectors[g])
    return logit


def generate(spec: Clicks, seed: int, n: int, stream: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`n` examples of stream `stream` of the log of `seed`: dense float32 (n, d), cat int64
    (n, f), click float32 (n,). The same (spec, seed, stream, n) gives the same examples."""
    rng = np.random.default_rng([seed, stream])
    dense = rng.standard_normal((n, spec.num_dense), dtype=np.float32)
    cat = np.stack([zipf_ids(rng, n, int(v), float(spec.zipf), spec.scatter) for v in spec.vocab_sizes], axis=1)
    p = 1.0 / (1.0 + np.exp(-oracle_logits(spec, seed, dense, cat)))
    click = (rng.random(n) < p).astype(np.float32)
    return dense, cat.astype(np.int64), click


@functools.lru_cache(maxsize=4)
def _split(spec: Clicks, seed: int, n: int, stream: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return generate(spec, seed, n, stream)


def load(split: str, seed: int, epoch: int, num_train: int = 100_000, num_test: int = 20_000,
         num_dense: int = 8, vocab_sizes: Sequence[int] = (1000, 1000, 1000, 1000), zipf: float = 1.1,
         latent_dim: int = 4, scatter: bool = True) -> Any:
    """The `dataset._target_` factory: split `split` ("train" | "test") of the log of `seed` as a
    tf.data.Dataset of ({"dense", "cat"}, click (1,)); training examples in a fresh order each epoch."""
    import tensorflow as tf

    num_train, num_test = int(num_train), int(num_test)
    if num_train < 1 or num_test < 1:
        raise ConfigError(f"dataset.num_train={num_train} and dataset.num_test={num_test} must both be at least 1")
    spec = Clicks(num_dense=int(num_dense), vocab_sizes=tuple(int(v) for v in vocab_sizes), zipf=float(zipf),
                  latent_dim=int(latent_dim), scatter=bool(scatter))
    dense, cat, click = _split(spec, int(seed), num_train if split == "train" else num_test, _STREAMS[split])
    if split == "train":  # tfkv takes a tf.data.Dataset in its own order: shuffle per (seed, epoch) here
        order = np.random.default_rng([int(seed), 3, int(epoch)]).permutation(len(click))
        dense, cat, click = dense[order], cat[order], click[order]
    return tf.data.Dataset.from_tensor_slices(({"dense": dense, "cat": cat}, click[:, None]))
