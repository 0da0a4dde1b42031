"""Training metrics kept inside the compiled step: summed loss, correct predictions, examples.

Shared by data and model parallelism, so both count the same way (sums of per-position loss
and hits per example) and only read them back to Python when the trainer asks.
"""

from __future__ import annotations

from typing import Any, Iterable

import tensorflow as tf


def loss_and_hits(labels: Any, logits: Any) -> tuple[Any, Any]:
    """Per-position cross-entropy (float32) and the number of correct predictions (int64)."""
    logits = tf.cast(logits, tf.float32)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    hits = tf.equal(tf.argmax(logits, -1, output_type=labels.dtype), labels)
    return losses, tf.reduce_sum(tf.cast(hits, tf.int64))


class RunningMetrics:
    def __init__(self) -> None:
        with tf.device("/device:CPU:0"):
            self._loss = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self._correct = tf.Variable(0, dtype=tf.int64, trainable=False)
            self._seen = tf.Variable(0, dtype=tf.int64, trainable=False)

    def add(self, loss_sums: list[Any], corrects: list[Any], examples: Any) -> None:
        """Accumulate (traceable): per-piece summed losses and hit counts, and the example count."""
        self._loss.assign_add(tf.add_n([tf.cast(v, tf.float64) for v in loss_sums]))
        self._correct.assign_add(tf.add_n(corrects))
        self._seen.assign_add(tf.cast(examples, tf.int64))

    def take(self) -> tuple[float, float, int]:
        """(loss per example, correct per example, examples) since the last call, and reset."""
        seen = int(self._seen.numpy())
        loss = float(self._loss.numpy()) / max(seen, 1)
        acc = float(self._correct.numpy()) / max(seen, 1)
        self._loss.assign(0.0)
        self._correct.assign(0)
        self._seen.assign(0)
        return loss, acc, seen

    def peek_loss(self) -> float:
        return float(self._loss.numpy()) / max(int(self._seen.numpy()), 1)


def evaluate(eval_step: Any, batches: Iterable[tuple[Any, Any]]) -> tuple[float, float]:
    """(loss, hits) per example over (x, y) batches; `eval_step(x, y)` gives their sums."""
    loss, correct, n = 0.0, 0, 0
    for x, y in batches:
        batch_loss, batch_correct = eval_step(x, y)
        loss += float(batch_loss)
        correct += int(batch_correct)
        n += int(y.shape[0])
    return loss / max(n, 1), correct / max(n, 1)
