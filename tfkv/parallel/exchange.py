"""How a data-parallel step's gradients reach the store and its replies the copies: one class
per way, chosen once, when the DataParallel is built, from the store's declared capabilities
(`traceable`, `async_pushpull`) and the config (a loss scale), never from a store's name, as
Keras builds its train function once.

- `InGraphExchange`: a store whose push and pull are TensorFlow ops (local, device), or none at
  all (one device on one machine): the whole step, exchange included, is one tf.function; a
  loss-scaled step whose gradients are not finite is skipped inside it (`tf.cond`).
- `StreamedExchange`: a store that can push while backprop goes on (`async_pushpull`, the
  parameter-server client) and no loss scale: each key's gradients are pushed from inside the
  compiled step by a hook (a `tf.numpy_function`) as soon as they exist, the last layer's first,
  and asked back at once; the replies are written into the copies after the step. With 2-bit
  compression and a store that takes packed pushes (`packed_push`) the gradients are packed in
  the step as TensorFlow ops (tfkv.parallel.packing) and only the words reach the hook.
- `AfterBackpropExchange`: any other store, or a loss scale (which decides after the whole
  backprop whether anything is pushed): the gradients leave the compiled step, every worker
  votes on their finiteness (`KVStore.all_workers`), then every key is pushed and pulled.

Each owns its use of the row-sparse tables (tfkv.parallel.sparse: rows loaded before the step,
pushed in it or after it) and its handling of the loss scale. `timings` accumulates the seconds
of each phase of the two that go through a non-traceable store (compute, including the pushes
made from inside it; push, the part spent pushing; pull, waiting for replies; assign).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from tfkv.parallel.backprop import Backprop, Rows, row_values
from tfkv.parallel.base import arrived
from tfkv.parallel.packing import Packing
from tfkv.parallel.precision import LossScale, all_finite
from tfkv.parallel.replicas import Replicas


class Exchange:
    """What every exchange is given: the copies, their backprop, the loss scale (or None)."""

    def __init__(self, replicas: Replicas, backprop: Backprop, loss_scale: LossScale | None) -> None:
        self.replicas = replicas
        self.store = replicas.store
        self.keys = replicas.keys
        self.backprop = backprop
        self.loss_scale = loss_scale
        self.tables: Any = replicas.sparse if replicas.sparse is not None else _NoTables()
        # Seconds per phase of a non-traceable store's step, summed over steps (reset in place).
        self.timings: dict[str, float] = {"compute": 0.0, "push": 0.0, "pull": 0.0, "assign": 0.0, "steps": 0}
        self.timeline = self.store.timeline  # a dist store's, under kvstore.timeline (None: off)

    def step(self, x: Any, y: Any, upcoming: Any) -> None:
        """Train on batch (x, y); `upcoming`: the next batch's x, whose table rows may be requested now."""
        raise NotImplementedError


def choose(replicas: Replicas, loss_scale: LossScale | None) -> type[Exchange]:
    """The exchange for these copies' store and this config (see the module docstring)."""
    store = replicas.store
    if store.traceable or not replicas.uses_store:
        return InGraphExchange
    # Loss scaling decides after the whole backprop whether anything is pushed, so the pushes
    # cannot start from inside it.
    if store.async_pushpull and loss_scale is None:
        return StreamedExchange
    return AfterBackpropExchange


class InGraphExchange(Exchange):
    """Forward, backward, push and pull (or the one device's own update) in one tf.function."""

    def __init__(self, replicas: Replicas, backprop: Backprop, loss_scale: LossScale | None) -> None:
        super().__init__(replicas, backprop, loss_scale)
        self._step = tf.function(self._fused_step)
        tables = replicas.sparse
        # The tables' pushed rows were pushed in the step; a skipped step's are not.
        self._rows_after: Callable[[Rows, Any, Any], None] = (
            (lambda rows, finite, upcoming: tables.after(rows if bool(finite) else None, upcoming))
            if tables is not None else (lambda rows, finite, upcoming: None))

    def step(self, x: Any, y: Any, upcoming: Any) -> None:
        self.tables.before(x, upcoming)  # this batch's rows into the copies
        rows, finite = self._step(x, y)
        self._rows_after(rows, finite, upcoming)

    def _fused_step(self, x: Any, y: Any) -> tuple[Rows, Any]:
        """Returns the tables' rows and whether the gradients were finite (false: a skipped step,
        nothing pushed)."""
        grads, rows = self.backprop(x, y)
        if self.loss_scale is None:
            self._update(grads, rows)
            return rows, tf.constant(True)
        finite = all_finite(grads + row_values(rows))  # this machine's devices: one graph, nothing to agree on
        tf.cond(finite, lambda: self._update(grads, rows), lambda: None)
        self.loss_scale.update(finite)
        return rows, finite

    def _update(self, grads: list[list[Any]], rows: Rows) -> None:
        """The update of one step: through the store (the tables' rows too), or the one device's own."""
        replicas, store = self.replicas, self.store
        if not replicas.uses_store:
            replicas.apply_aggregated(grads[0])
            return
        self.tables.push_traced(rows)
        for k in self.keys:
            store.push(k, [g[k] for g in grads], priority=-k)
            if replicas.update_on_kvstore:
                store.pull(k, out=[p[k] for p in replicas.params], priority=-k)
            else:
                replicas.update_copies(k, store.pull(k, priority=-k))


class _Replied(Exchange):
    """An exchange whose pulls are requested as pushpull_async and taken after backprop: the
    replies, as they arrive, written into every copy in one compiled call (weights with
    update_on_kvstore, else summed gradients for each copy's updater)."""

    def __init__(self, replicas: Replicas, backprop: Backprop, loss_scale: LossScale | None) -> None:
        super().__init__(replicas, backprop, loss_scale)
        self._write = tf.function(replicas.assign_all if replicas.update_on_kvstore else replicas.apply_aggregated)

    def _finish(self, pending: list[Any], t0: float, t1: float, t2: float) -> None:
        """Take the replies to `pending` and write them; the phases' seconds (t0 compute t1 push t2)."""
        pulled, waited = arrived(self.store, self.keys, pending)
        self._write(pulled)
        t3 = time.perf_counter()
        if self.timeline is not None:
            self.timeline.step(t0, t1, t2 + waited, t3)
        tm = self.timings
        tm["compute"] += t1 - t0
        tm["pull"] += waited
        tm["assign"] += t3 - t2 - waited
        tm["steps"] += 1


class StreamedExchange(_Replied):
    """Each key pushed and asked back from inside backprop, as soon as its gradients exist."""

    def __init__(self, replicas: Replicas, backprop: Backprop, loss_scale: LossScale | None) -> None:
        if loss_scale is not None:
            raise ValueError("a loss-scaled step cannot push from inside backprop: use AfterBackpropExchange")
        super().__init__(replicas, backprop, loss_scale)
        self._inflight: list[Any] = []  # pulls requested from inside the compiled step
        self._hook_error: BaseException | None = None
        self._grads = tf.function(self._forward_backward_pushing)
        devices, store = replicas.devices, replicas.store
        # Summed where the numpy path sums (the first device, or host memory), and packed there.
        home = devices[0] if len(devices) == 1 or store.sum_on_device else "/device:CPU:0"
        self.packing = Packing.for_store(store, list(self.keys), home)

    def step(self, x: Any, y: Any, upcoming: Any) -> None:
        self.tables.before(x, upcoming)
        clock = time.perf_counter
        t0 = clock()
        rows = self._grads(x, y)  # pushes every dense key from inside, as its gradients are ready
        if self._hook_error is not None:
            error, self._hook_error, self._inflight = self._hook_error, None, []
            raise error
        t1 = clock()
        self.tables.after(rows, upcoming)  # before the dense replies are waited for
        t2 = clock()
        self.timings["push"] += t2 - t1
        pending, self._inflight = self._inflight, []
        self._finish(pending, t0, t1, t2)

    def _forward_backward_pushing(self, x: Any, y: Any) -> Rows:
        grads, rows = self.backprop(x, y)
        devices, store = self.replicas.devices, self.store
        # Stateful ops run in program order, so the hooks fire in backprop's order: the last
        # layer's first, each as soon as its gradients exist.
        for k in reversed(self.keys):
            values = [g[k] for g in grads]
            push = store.pushpull_async
            if self.packing is not None:
                values, push = self.packing.pack(k, values), store.pushpull_packed_async
            elif len(values) > 1 and store.sum_on_device:
                with tf.device(devices[0]):
                    values = [tf.add_n(values)]
            tf.numpy_function(functools.partial(self._push_hook, push, k), values, Tout=tf.int32, stateful=True,
                              name=f"push_{k}")
        return rows

    def _push_hook(self, push: Callable[[int, list[np.ndarray]], list[Any]], key: int, *values: np.ndarray) -> np.int32:
        # Runs on a TensorFlow thread: an exception here would come back wrapped in a TF error,
        # so it is kept and raised as itself once the step returns.
        if self._hook_error is None:
            t = time.perf_counter()
            try:
                self._inflight.extend(push(key, list(values)))
            except BaseException as e:  # noqa: BLE001 - re-raised by step()
                self._hook_error = e
            self.timings["push"] += time.perf_counter() - t
        return np.int32(0)


class AfterBackpropExchange(_Replied):
    """Every key pushed and asked back once backprop is over (and, with a loss scale, once every
    worker found its gradients finite)."""

    def __init__(self, replicas: Replicas, backprop: Backprop, loss_scale: LossScale | None) -> None:
        super().__init__(replicas, backprop, loss_scale)
        self._grads = tf.function(self._checked_gradients)
        # Without a loss scale every step's gradients go: nothing to vote on.
        self._agreed_finite: Callable[[Any], bool] = self._vote if loss_scale is not None else (lambda finite: True)

    def step(self, x: Any, y: Any, upcoming: Any) -> None:
        self.tables.before(x, upcoming)
        clock = time.perf_counter
        t0 = clock()
        grads, rows, finite = self._grads(x, y)
        t1 = clock()
        if not self._agreed_finite(finite):
            self.tables.after(None, upcoming)
            self.timings["compute"] += t1 - t0
            self.timings["steps"] += 1
            return
        # Priority k: backprop's order, the last layer first (the order the gradients came).
        pending = self.store.pushpull_async(self.keys, [[g[k] for g in grads] for k in self.keys],
                                            priority=list(self.keys))
        self.tables.after(rows, upcoming)
        t2 = clock()
        self.timings["push"] += t2 - t1
        self._finish(pending, t0, t1, t2)

    def _checked_gradients(self, x: Any, y: Any) -> tuple[list[list[Any]], Rows, Any]:
        grads, rows = self.backprop(x, y)
        finite = all_finite(grads + row_values(rows)) if self.loss_scale is not None else tf.constant(True)
        return grads, rows, finite

    def _vote(self, finite: Any) -> bool:
        """Whether every worker's gradients were finite (dist_sync: every worker skips the same
        steps, so the weights stay alike); the loss scale updated by the answer."""
        agreed = self.store.all_workers(bool(finite))
        self.loss_scale.update(agreed)
        return agreed


class _NoTables:
    """The row-sparse tables' calls, for a model without any: nothing to load or push."""

    def before(self, x: Any, upcoming: Any) -> None:
        pass

    def after(self, rows: Rows | None, upcoming: Any) -> None:
        pass

    def push_traced(self, rows: Rows) -> None:
        pass
