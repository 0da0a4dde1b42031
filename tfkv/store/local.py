"""The single-machine stores: `local` (sum and update in host memory) and `device` (on the
accelerators, keys spread over them).

Their push/pull are TensorFlow ops, so data parallelism traces them into the same tf.function
as the forward and backward passes: one graph per step, no Python between devices (unless a
Python updater is set, MXNet's `_set_updater`, which runs in a `tf.numpy_function`). The
`device` store also takes 2-bit gradient compression (MXNet's, or 2bit_momentum): each device
quantises its value with its own residual (and velocity) and only the 2-bit words travel to the
device that sums; those are saved with the optimizer state.

Keys may hold float16 or bfloat16 values (numpy, `ml_dtypes.bfloat16`, or tf tensors): a key
keeps the dtype it was initialised with, device values are summed in it (as MXNet's), a push of
another dtype to a half key (or a half value to a float32 key) is refused naming both
(tfkv.ps.dtypes), and a pull into an `out` of another dtype casts, as MXNet's CopyFromTo. An
optimizer in the store updates a half key in float32 (tfkv.store.tf_updater: rounded to half
each update, or on a float32 master copy with `multi_precision`). 2-bit compression keeps its
residuals in float32 and the decoded sum is cast back to the key's dtype.

Row-sparse keys (init with a tfkv.store.RowSparse or Table; tfkv.store.tf_rows) are a float32
or float16 variable of the whole table here too, as MXNet's local store holds them (a float16
key's devices' rows summed in float16, as MXNet's, and updated in float32 as a dense half key).
A push of rows (a RowSparse, a tf.IndexedSlices, or one per device) is summed without
densifying and, with an
optimizer, updates only those rows and their state (MXNet's lazy update); without one the key
becomes the pushed rows, zero elsewhere (MXNet's). `row_sparse_pull` and `pull_rows` gather rows.
All of it works eagerly and inside a tf.function (rows then come back as tensors). A Python
updater, and gradient compression, are refused for them in one line naming the key. A dense
`pull` of one gives the whole table, as MXNet's local store. A tf.IndexedSlices pushed to a dense
key is densified, as TensorFlow does, and so is a RowSparse (scattered into the key's shape, rows
summed), as MXNet's.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tfkv.store import sparse, tf_compression, tf_rows
from tfkv.ps import compression, dtypes, memory
from tfkv.store.base import Key, KVStore, Updater, gpu_p2p, pairs
from tfkv.store.sparse import RowSparse
from tfkv.store.tf_updater import TFUpdater


# A Table's copies while it is made: its draw, and the variable the draw is copied into.
TABLE_COPIES = 2


class LocalStore(KVStore):
    """Every key lives in host memory (the first CPU device); devices' values are summed there."""

    type = "local"
    traceable = True

    def __init__(self, devices: Sequence[str] | None = None, knobs: Mapping[str, Any] | None = None):
        """`knobs`: the run's resolved knob values by config key (tfkv.knobs.resolve), as the
        trainer passes them; None: this process's environment's (MXNET_ENABLE_GPU_P2P, ...)."""
        self._devices = list(devices) if devices else ["/device:CPU:0"]
        self._values: dict[Hashable, tf.Variable] = {}
        self._home: dict[Hashable, str] = {}
        self._sparse: set[Hashable] = set()  # the row-sparse keys
        self._updater: TFUpdater | None = None
        self._py_updater: Updater | None = None  # MXNet's _set_updater: a Python callable
        # Read once: the choice is traced into the step's graph.
        self._sum_on_home = gpu_p2p(values=knobs)

    def _place(self, key: Hashable, value: Any) -> str:
        return "/device:CPU:0"

    def _var(self, key: Hashable) -> tf.Variable:
        self._check_key(key)
        try:
            return self._values[key]
        except KeyError:
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first") from None

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        for k, values in pairs(key, value):
            self._check_key(k)
            if k in self._values:
                raise ValueError(f"key {k!r} is already initialised")
            value = values[0]
            if isinstance(value, sparse.Table):  # refused before TensorFlow runs out of memory drawing it
                sparse.check_room(self.key_phrase(k), value, TABLE_COPIES, memory.available())
            if sparse.is_sparse_init(value):
                value = tf_rows.initial(k, value)
                self._sparse.add(k)
            home = self._place(k, value)
            with tf.device(home):
                self._values[k] = tf.Variable(tf.identity(value), trainable=False)
            self._home[k] = home
            if self._updater is not None:
                self._updater.create_state(k, self._values[k], home)
            self._key_added(k)

    def _key_added(self, key: Hashable) -> None:
        """A key was initialised (the device store gives it compression residuals)."""

    def push(self, key: Key | Sequence[Key], value: Any, priority: int = 0) -> None:
        for k, values in pairs(key, value):
            var = self._var(k)
            if k in self._sparse:
                self._push_rows(k, var, values)
                continue
            held = dtypes.of(var)
            values = [tf_rows.densified(k, v, var.shape) if isinstance(v, RowSparse) else v for v in values]
            for v in values:
                dtypes.check(k, held, v)
            merged = self._merge(k, values)
            with tf.device(self._home[k]):
                if self._py_updater is not None:
                    self._run_py_updater(k, var, merged)
                elif self._updater is not None:
                    self._updater.update(k, var, merged)
                else:
                    var.assign(merged)

    def _push_rows(self, key: Hashable, var: tf.Variable, values: list[Any]) -> None:
        """A row-sparse key's push: every device's rows summed, then the lazy update (or, with
        no optimizer, the key becomes those rows)."""
        if self._py_updater is not None:
            raise sparse.refused("updater", key)
        if getattr(self, "_compression", None) is not None:
            raise sparse.refused("compression", key)
        parts = [tf_rows.rows_of(key, v, var.shape, var.dtype) for v in values]
        with tf.device(self._home[key] if self._sum_on_home else "/device:CPU:0"):
            ids, rows = tf_rows.summed(parts)
        # After the checks: a push refused in a graph (an id out of range) changes nothing.
        with tf.device(self._home[key]), tf.control_dependencies([ids, rows]):
            if self._updater is not None:
                self._updater.update_rows(key, var, ids, rows)
            else:
                var.assign(tf.zeros_like(var))
                var.scatter_update(tf.IndexedSlices(rows, ids))

    def is_row_sparse(self, key: Key) -> bool:
        return key in self._sparse

    def _sparse_var(self, key: Key) -> tf.Variable:
        var = self._var(key)
        if key not in self._sparse:
            raise sparse.refused("sparse_pull", key)
        return var

    def set_rows(self, key: Key, rows: Any) -> None:
        var = self._sparse_var(key)
        given = sparse.check_rows(key, RowSparse.of(rows, tuple(var.shape)), tuple(var.shape),
                                  var.dtype.as_numpy_dtype, what="set_rows")
        with tf.device(self._home[key]):
            var.scatter_update(tf.IndexedSlices(tf.constant(given.data), tf.constant(given.indices)))

    def _pull_rows(self, key: Key, row_ids: Any) -> RowSparse:
        """The rows, ids unique and sorted: numpy eagerly, tensors inside a tf.function."""
        var = self._sparse_var(key)
        ids = tf_rows.unique_sorted(tf_rows.checked_ids(key, row_ids, var.shape[0]))
        with tf.device(self._home[key]):
            data = tf.gather(var, ids)
        if tf.executing_eagerly():
            return RowSparse(data.numpy(), ids.numpy(), tuple(var.shape))
        return RowSparse(data, ids, tuple(var.shape))

    def pull_rows(self, key: Key, row_ids: Any) -> tf.Tensor:
        """The rows `row_ids` in their order (a tf.Tensor of shape row_ids.shape + row shape),
        eagerly or traced: the trainer's lookup of an embedding's rows."""
        var = self._sparse_var(key)
        ids = tf_rows.checked_ids(key, row_ids, var.shape[0], "pull_rows")
        with tf.device(self._home[key]):
            rows = tf.gather(var, ids)
        return tf.reshape(rows, tf.concat([tf.shape(row_ids, out_type=tf.int32), tf.shape(rows)[1:]], 0))

    def _merge(self, key: Hashable, values: list[Any]) -> Any:
        """The sum of a key's device values."""
        if len(values) == 1:
            return values[0]
        # Where the devices' values meet: on the key's home device (peer to peer), or, with GPU
        # P2P disabled, in host memory, then the result goes to the home device.
        with tf.device(self._home[key] if self._sum_on_home else "/device:CPU:0"):
            return tf.add_n([tf.identity(v) for v in values])

    def _run_py_updater(self, key: Hashable, var: tf.Variable, merged: Any) -> None:
        """MXNet's updater(key, received, stored) on numpy arrays: it changes `stored` in place
        (as MXNet's NDArray) or returns the new value."""
        updater = self._py_updater

        def run(received: np.ndarray, weight: np.ndarray) -> np.ndarray:
            stored = np.array(weight)  # writable, as MXNet's stored NDArray
            result = updater(key, received, stored)
            return np.asarray(stored if result is None else result, weight.dtype).reshape(weight.shape)

        new = tf.numpy_function(run, [merged, tf.convert_to_tensor(var)], var.dtype, stateful=True)
        var.assign(tf.ensure_shape(new, var.shape))

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0, ignore_sparse: bool = True) -> Any:
        """MXNet's: each key's whole value (a row-sparse key's too: this store holds it whole) into
        `out`, or returned. A RowSparse out is left unchanged unless ignore_sparse=False, which
        gives it every row (sparse.dense_outs)."""
        results = []
        for k, outs in pairs(key, out):
            var = self._var(k)
            outs, whole = sparse.dense_outs(k, outs, ignore_sparse)
            for o in whole:
                sparse.whole(o, var.numpy() if tf.executing_eagerly() else tf.identity(var))
            for o in outs:
                if not isinstance(o, np.ndarray):
                    o.assign(var if o.dtype == var.dtype else tf.cast(var, o.dtype))  # cast: MXNet's CopyFromTo
                elif tf.executing_eagerly():  # MXNet's out= may be a host array: written in place
                    np.copyto(o, var.numpy())
                else:
                    raise TypeError(f"pull of key {k!r}: a numpy out can only be written eagerly; inside a "
                                    "tf.function give a tf.Variable")
            if out is None:
                results.append(tf.identity(var))
        if out is None:
            return results if isinstance(key, (list, tuple)) else results[0]
        return None

    def set_optimizer(self, optimizer: Any) -> None:
        self._py_updater = None
        self._updater = TFUpdater(optimizer)
        for k, var in self._values.items():
            self._updater.create_state(k, var, self._home[k])

    def set_updater(self, updater: Updater) -> None:
        """MXNet's `_set_updater`: every push calls `updater(key, received, stored)` with numpy
        arrays (`stored` to change in place, or return the new value) instead of an optimizer."""
        if not callable(updater):
            raise TypeError(f"updater {updater!r} is not callable; give a function (key, received, stored)")
        self._updater, self._py_updater = None, updater

    def _require_updater(self) -> TFUpdater:
        if self._updater is None:
            what = "a Python updater, whose state is its own" if self._py_updater else "no optimizer"
            raise RuntimeError(f"this store has {what}; call set_optimizer() first")
        return self._updater

    def save_optimizer_states(self, fname: str) -> None:
        np.savez(fname, **self._require_updater().get_states())

    def load_optimizer_states(self, fname: str) -> None:
        with np.load(fname, allow_pickle=False) as f:
            self._require_updater().set_states(dict(f))


class DeviceStore(LocalStore):
    """Keys live on the training devices, each on the least loaded so far (by size), as MXNet's
    `device` store; the sum and the update run there."""

    type = "device"
    compression = True

    def __init__(self, devices: Sequence[str] | None = None, knobs: Mapping[str, Any] | None = None):
        super().__init__(devices, knobs)
        self._load = {d: 0 for d in self._devices}

    def _place(self, key: Hashable, value: Any) -> str:
        home = min(self._devices, key=lambda d: self._load[d])
        self._load[home] += int(np.prod(value.shape))
        return home

    _compression: compression.Setting | None = None  # between devices, when set
    _momentum = 0.0  # what each device applies before quantising (2bit_momentum)
    _user_optimizer: Any = None  # what set_optimizer was given (its updater may run without momentum)

    def set_gradient_compression(self, compression_params: Mapping[str, Any] | None) -> None:
        """MXNet's: {"type": "2bit", "threshold": 0.5} compresses what each device sends to the
        device that sums a key, with a residual per key per device (error feedback) kept on that
        device; {"type": "2bit_momentum", ...} also keeps a velocity there, applies the
        optimizer's momentum before quantising and updates without it (tfkv.ps.compression).
        Call it outside a tf.function (it makes variables); a new setting starts the residuals
        afresh. Two-way compression ("both_ways") is the parameter servers' (dist_*): refused."""
        setting = compression.parse(compression_params)
        if setting is not None and setting.both_ways:
            raise ValueError(f"gradient compression both_ways=True compresses the parameter servers' replies to "
                             f"pulls; kvstore={self.type} has no servers: use a dist_* type (dist_sync, dist_async, "
                             "dist_sync_device, dist_async_device) or leave both_ways out")
        if setting != self._compression:
            self._residuals: dict[Hashable, list[tf.Variable]] = {}
            self._velocities: dict[Hashable, list[tf.Variable]] = {}
            self._compression = setting
            for k in self._values:
                self._key_added(k)
            if self._user_optimizer is not None:
                self.set_optimizer(self._user_optimizer)

    def set_optimizer(self, optimizer: Any) -> None:
        served, self._momentum = compression.split_momentum(self._compression, optimizer)
        self._user_optimizer = optimizer
        super().set_optimizer(served)

    def set_updater(self, updater: Updater) -> None:
        self._user_optimizer = None
        super().set_updater(updater)

    def _key_added(self, key: Hashable) -> None:
        if self._compression is None or key in self._sparse:  # row-sparse keys are never compressed
            return
        size = int(np.prod(self._values[key].shape))
        self._residuals[key] = self._per_device(size)
        if self._compression.kind.worker_momentum:
            self._velocities[key] = self._per_device(size)

    def _per_device(self, size: int) -> list[tf.Variable]:
        """A flat float32 zero variable of `size` on each device."""
        out = []
        for d in self._devices:
            with tf.device(d):
                out.append(tf.Variable(tf.zeros([size], tf.float32), trainable=False))
        return out

    def _merge(self, key: Hashable, values: list[Any]) -> Any:
        setting = self._compression
        if setting is None:
            return super()._merge(key, values)
        if setting.kind.worker_momentum and self._updater is None:
            raise RuntimeError(f"gradient compression {setting.kind.name} applies the optimizer's momentum on the "
                               "devices: call set_optimizer (an SGD) before pushing")
        if len(values) > len(self._residuals[key]):
            raise ValueError(f"push of key {key!r}: {len(values)} values for the store's {len(self._residuals[key])} "
                             "devices")
        var = self._values[key]
        if len(values) == 1:
            # A lone value crosses no device link: MXNet's CommDevice::Reduce returns it as it is,
            # before compressing; 2bit_momentum's momentum still applies (the updater has none).
            if not setting.kind.worker_momentum:
                return super()._merge(key, values)
            velocity = self._velocities[key][0]
            velocity.assign(self._momentum * velocity + tf.reshape(tf.cast(values[0], tf.float32), [-1]))
            return tf.reshape(tf.cast(velocity, var.dtype), var.shape)
        velocities = self._velocities.get(key) or [None] * len(values)
        words = []
        for v, r, u in zip(values, self._residuals[key], velocities):
            with tf.device(r.device):  # quantised where it was computed: only words travel
                words.append(tf_compression.pack(v, r, setting.threshold, u, self._momentum))
        size = int(np.prod(var.shape))
        with tf.device(self._home[key] if self._sum_on_home else "/device:CPU:0"):
            decoded = [tf_compression.unpack(w, size, setting.threshold) for w in words]
            total = decoded[0] if len(decoded) == 1 else tf.add_n(decoded)
            return tf.reshape(tf.cast(total, var.dtype), var.shape)  # float32 decoded; a half key's back to half

    def _compression_state(self) -> dict[str, tf.Variable]:
        """The devices' residuals and velocities by checkpoint entry, "<key>/compression_<what>_<device>"."""
        held = {"residual": getattr(self, "_residuals", {}), "velocity": getattr(self, "_velocities", {})}
        return {f"{k}/compression_{what}_{i}": var for what, by_key in held.items()
                for k, per_device in by_key.items() for i, var in enumerate(per_device)}

    def save_optimizer_states(self, fname: str) -> None:
        """The optimizer's state and the compression's (a resumed run goes on as if never stopped)."""
        np.savez(fname, **self._require_updater().get_states(),
                 **{name: var.numpy() for name, var in self._compression_state().items()})

    def load_optimizer_states(self, fname: str) -> None:
        """As saved; compression state the file lacks (saved without compression) starts from zero."""
        super().load_optimizer_states(fname)
        with np.load(fname, allow_pickle=False) as f:
            for name, var in self._compression_state().items():
                var.assign(f[name] if name in f.files else tf.zeros_like(var))
