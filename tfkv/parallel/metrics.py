"""Running loss and metrics of one phase (train or test), kept inside the compiled step.

Shared by data and model parallelism, so both count the same way: summed example losses (and
regularisation, n examples x sum(model.losses), as training adds it), examples seen, and the
criterion's Keras metric objects, all with their state on the CPU. They are read back to Python
only when the trainer asks (`take`).

Every value here is a sum over examples (Keras's own metrics keep totals, counts and confusion
counts), so the tallies of disjoint shards of a split, summed variable by variable (`state`,
`set_state`), are the tally of the whole split: how the workers of a job combine their shares of
an evaluation (`evaluate`). A metric of another class may keep state that is not a sum (a running
maximum): `unsummable` names it, and its evaluation is not split.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf

from tfkv.parallel.criterion import Criterion, perplexity

CPU = "/device:CPU:0"
# What a training step fails with when its loss is not finite (see Tally's `forgiven`).
NONFINITE = "tfkv: the training loss is not finite"


class Tally:
    """One phase's running sums and metric objects; `prepare(y)` (eager) before the first
    compiled `add`, `take` to read and reset.

    With `forgiven` (the training tally), a piece whose loss is NaN or infinite fails the step
    inside the graph (an InvalidArgumentError carrying NONFINITE: `nonfinite`), with no read back
    to Python, unless `forgiven()` (traceable) is true: a loss scale that skips the step."""

    def __init__(self, criterion: Criterion, forgiven: Callable[[], Any] | None = None) -> None:
        self.criterion = criterion
        self._forgiven = forgiven
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
        total = tf.constant(0.0, tf.float64)
        for name, values in losses.items():
            piece = tf.reduce_sum(tf.cast(values, tf.float64))
            self._loss[name].assign_add(piece)
            total += piece
        self._seen.assign_add(n)
        if reg is not None:
            self.add_regularization(reg, n)
            total += tf.cast(reg, tf.float64)
        if self._forgiven is not None:
            tf.debugging.Assert(tf.logical_or(tf.math.is_finite(total), self._forgiven()), [NONFINITE])
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

    @property
    def prepared(self) -> bool:
        """Whether the metric objects exist (after the first `prepare`)."""
        return self._outputs is not None

    def unsummable(self) -> list[str]:
        """The reported names of the metrics whose state tfkv cannot sum over shards: those of a
        class that is not Keras's own (a subclass may keep anything)."""
        return [name for name, _, m in self._metrics if not type(m).__module__.startswith("keras.")]

    def _variables(self) -> list[Any]:
        """Every variable of the tally, in an order every worker shares."""
        return [self._reg, self._seen, *(self._loss[n] for n in self._outputs or []),
                *(v for _, _, m in self._metrics for v in m.variables)]

    def state(self) -> np.ndarray:
        """Every variable's value, flattened into one float64 vector (counts exact up to 2**53)."""
        return flat(self._variables())

    def set_state(self, state: np.ndarray) -> None:
        """The inverse of `state`."""
        assign_flat([[v] for v in self._variables()], state)


def nonfinite(error: BaseException) -> bool:
    """Whether `error` is a training step's failure on a non-finite loss (Tally's `forgiven`)."""
    return isinstance(error, tf.errors.InvalidArgumentError) and NONFINITE in str(error)


def numpy_dtype(variable: Any) -> np.dtype:
    """A tf.Variable's or a Keras variable's dtype as numpy's."""
    return np.dtype(getattr(variable.dtype, "as_numpy_dtype", variable.dtype))


def flat(variables: Sequence[Any]) -> np.ndarray:
    """The variables' values end to end, as one float64 vector."""
    values = [np.asarray(v.numpy(), dtype=np.float64).reshape(-1) for v in variables]
    return np.concatenate(values) if values else np.zeros(0)


def assign_flat(copies: Sequence[Sequence[Any]], values: np.ndarray) -> None:
    """The inverse of `flat`: each group of `copies` (one variable's copies) takes its piece of
    `values`, in each variable's own dtype."""
    offset = 0
    for group in copies:
        shape = tuple(group[0].shape)
        n = int(np.prod(shape))
        piece = np.asarray(values[offset:offset + n]).reshape(shape)
        for v in group:
            v.assign(piece.astype(numpy_dtype(v)))
        offset += n
    if offset != len(values):
        raise ValueError(f"{len(values)} values for variables of {offset}")


def evaluate(tally: Tally, eval_step: Callable[[Any, Any], None], batches: Iterable[tuple[Any, Any]],
             combine: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[dict[str, float], int, int]:
    """Every value of `tally` per example over (x, y) batches; `eval_step(x, y)` adds a batch.
    With `combine` (every worker's state vector -> their sum), the batches are this worker's
    share of the split and the values are of every worker's together. Returns (values, examples
    of this worker, examples of all)."""
    tally.reset()
    empty = True
    for x, y in batches:
        tally.prepare(y)
        eval_step(x, y)
        empty = False
    if combine is None:
        values, seen = tally.take()
        return values, seen, seen
    if empty:
        # An empty share (fewer examples than workers): one batch of none still makes every
        # variable the others have (a metric may make its own at its first update).
        x, y = _no_examples(batches)
        tally.prepare(y)
        eval_step(x, y)
    own = tally.peek()[1]
    tally.set_state(combine(tally.state()))
    values, seen = tally.take()
    return values, own, seen


def _no_examples(batches: Any) -> tuple[Any, Any]:
    """A batch of zero examples shaped as `batches`' (a tf.data.Dataset: its element_spec)."""
    spec = getattr(batches, "element_spec", None)
    if spec is None:
        raise ValueError("a worker's share of the test split is empty and its batches do not say their shape; "
                         "give a tf.data.Dataset")
    return tuple(tf.nest.map_structure(
        lambda s: tf.zeros([0, *(d if d is not None else 1 for d in s.shape[1:])], s.dtype), part) for part in spec)
