"""Running loss and metrics of one phase (train or test), kept inside the compiled step.

Shared by data and model parallelism, so both count the same way: summed example losses (and
regularisation, n examples x sum(model.losses), as training adds it), examples seen, and the
criterion's Keras metric objects, all with their state on the CPU. They are read back to Python
only when the trainer asks (`take`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import tensorflow as tf

from tfkv.parallel.criterion import Criterion, perplexity

CPU = "/device:CPU:0"


class Tally:
    """One phase's running sums and metric objects; `prepare(y)` (eager) before the first
    compiled `add`, `take` to read and reset."""

    def __init__(self, criterion: Criterion) -> None:
        self.criterion = criterion
        with tf.device(CPU):
            self._reg = tf.Variable(0.0, dtype=tf.float64, trainable=False)
            self._seen = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._outputs: list[str | None] | None = None
        self._loss: dict[str | None, Any] = {}  # per output: summed example losses
        self._metrics: list[tuple[str, str | None, Any]] = []
        self._perplexity = False

    def prepare(self, y: Any) -> None:
        """Make the metric objects for the outputs labels `y` name (eagerly: a compiled step
        must not create variables)."""
        if self._outputs is not None:
            return
        names = self.criterion.output_names(y)
        with tf.device(CPU):
            self._loss = {n: tf.Variable(0.0, dtype=tf.float64, trainable=False) for n in names}
            self._metrics = self.criterion.new_metrics(names)
        self._perplexity = self.criterion.perplexity(y)
        self._outputs = names

    def add(self, y: Any, pred: Any, losses: dict[str | None, Any], examples: Any, reg: Any = None) -> None:
        """Accumulate one piece (traceable): its labels and outputs (for the metrics), its
        per-output example losses, its example count and, when given, the model's
        regularisation sum(model.losses) (counted once per example, as training adds it)."""
        n = tf.cast(examples, tf.int64)
        for name, values in losses.items():
            self._loss[name].assign_add(tf.reduce_sum(tf.cast(values, tf.float64)))
        self._seen.assign_add(n)
        if reg is not None:
            self.add_regularization(reg, n)
        for _, output, metric in self._metrics:
            metric.update_state(y if output is None else y[output], pred if output is None else pred[output])

    def add_regularization(self, reg: Any, examples: Any) -> None:
        """Traceable: `examples` times the regularisation `reg`, into the reported loss."""
        self._reg.assign_add(tf.cast(reg, tf.float64) * tf.cast(examples, tf.float64))

    def take(self) -> tuple[dict[str, float], int]:
        """`peek()`, then reset."""
        taken = self.peek()
        self.reset()
        return taken

    def peek(self) -> tuple[dict[str, float], int]:
        """({name: value per example} since the last reset, examples). Names: `loss` (data +
        regularisation, as Keras reports it), `<output>_loss` for dict outputs, each metric's
        name, and `perplexity` for sequence labels with a crossentropy loss."""
        seen = int(self._seen.numpy())
        per = 1.0 / max(seen, 1)
        data = {n: float(v.numpy()) * per for n, v in self._loss.items()}
        values = {"loss": sum(data.values()) + float(self._reg.numpy()) * per}
        if len(data) > 1 or None not in data:
            values.update({f"{n}_loss": v for n, v in data.items()})
        values.update({name: float(m.result()) for name, _, m in self._metrics})
        if self._perplexity:
            values["perplexity"] = perplexity(sum(data.values()))
        return values, seen

    def reset(self) -> None:
        for v in (self._reg, *self._loss.values()):
            v.assign(0.0)
        self._seen.assign(0)
        for _, _, m in self._metrics:
            m.reset_state()



def evaluate(tally: Tally, eval_step: Callable[[Any, Any], None],
             batches: Iterable[tuple[Any, Any]]) -> dict[str, float]:
    """Every value of `tally` per example over (x, y) batches; `eval_step(x, y)` adds a batch."""
    tally.reset()
    for x, y in batches:
        tally.prepare(y)
        eval_step(x, y)
    return tally.take()[0]
