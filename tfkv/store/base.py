"""The KVStore interface every store type implements, with MXNet's calling conventions.

A key is an int or a str, one kind per store (MXNet refuses the mix). A value is one array, or a list of arrays (one per device) that the
store sums before it stores or updates. `push`/`pull`/`init` also take a list of keys with a
list of values. `priority` (an int, or one per key) orders a store's requests, higher first,
where it has any to order (the parameter-server client); the single-machine stores run inside
one graph and ignore it. What a store can do beyond the common API is a capability query, not
a guess from its type name.

A key initialised with a `RowSparse` or a `Table` (tfkv.store.sparse) is row-sparse, as MXNet's
row_sparse weights: pushes carry rows (summed, and with an optimizer MXNet's lazy update of only
those rows), `row_sparse_pull` returns the rows asked for. As in MXNet, a dense `pull` of such a
key gives its whole value where the store holds it whole (local, device) and is refused in one
line naming it by the dist_* stores (as MXNet's dist kvstore: use row_sparse_pull); `pushpull`
of it is refused. Rows pushed to a dense key are the dense value they stand for (zeros elsewhere),
as MXNet's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Hashable, Iterator, Mapping, Sequence

import numpy as np

from tfkv import knobs
from tfkv.store import sparse
from tfkv.store.sparse import RowSparse

Key = Hashable
#: MXNet's updater: updater(key, received, stored) changes `stored` in place (or returns the new value)
Updater = Callable[[Any, Any, Any], Any]
#: MXNet's capability names (`kv.is_capable(KVStore.OPTIMIZER)`)
OPTIMIZER = "optimizer"
#: ps-lite's node groups, as MXNet's num_dead_node takes them (sums of these name several groups)
SCHEDULER, SERVER_GROUP, WORKER_GROUP = 1, 2, 4


def pairs(key: Key | Sequence[Key], value: Any) -> Iterator[tuple[Key, list[Any]]]:
    """Normalise MXNet's argument forms to (key, [one value per device]) pairs."""
    if isinstance(key, (list, tuple)):
        if value is None:
            value = [None] * len(key)
        if len(value) != len(key):
            raise ValueError(f"{len(key)} keys but {len(value)} values")
        for k, v in zip(key, value):
            if isinstance(k, (list, tuple)):
                yield from pairs(k, v)
            else:  # the common case, without a generator per key (a model's keys, every step)
                yield k, _per_device(v)
        return
    yield key, _per_device(value)


def _per_device(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def key_kind(key: Any) -> str:
    """"int" or "str": the two kinds of key MXNet takes."""
    if isinstance(key, str):
        return "str"
    if isinstance(key, (int, np.integer)):
        return "int"
    raise TypeError(f"key {key!r} is a {type(key).__name__}; a KVStore key is an int or a str")


def writable(value: Any) -> bool:
    """Can take a result in place, as every MXNet NDArray can: a tf.Variable or a writable numpy
    array (a tf.Tensor is immutable)."""
    if isinstance(value, np.ndarray):
        return bool(value.flags.writeable)
    return callable(getattr(value, "assign", None))


def in_place(key: Key | Sequence[Key], value: Any) -> Any:
    """pushpull's `out` when none is given: MXNet writes the result into `value`; here into each
    of its arrays that can be written (see `writable`), in `pull`'s `out` form."""
    if isinstance(key, (list, tuple)):
        return [in_place(k, v) for k, v in zip(key, value)]
    values = value if isinstance(value, (list, tuple)) else [value]
    return [v for v in values if writable(v)]


def gpu_p2p(env: Mapping[str, str] | None = None, values: Mapping[str, Any] | None = None) -> bool:
    """kvstore.gpu_p2p, TFKV_ENABLE_GPU_P2P / MXNET_ENABLE_GPU_P2P (default 1): the `device` types
    sum a key's device values device-to-device; 0: through host memory (copied to the CPU, summed there).
    From the run's resolved knob `values` that the trainer passes a store (its `knobs`); without
    them, from this process's environment (`env`, os.environ unless given), as MXNet's scripts set it."""
    return bool(knobs.value("kvstore.gpu_p2p", values, env))


class KVStore(ABC):
    """Sums what devices (and, for dist types, machines) push; serves the result on pull."""

    #: the registry name, e.g. "local"
    type: str = ""
    OPTIMIZER = OPTIMIZER  # MXNet's `kv.is_capable(kv.OPTIMIZER)`
    #: push/pull are TensorFlow ops that may be traced into the training tf.function
    traceable: bool = False
    #: values cross machines (a parameter server); False for the single-machine stores
    distributed: bool = False
    #: an update applies every worker's push of a step together (trivially, with one worker);
    #: False for the `dist_async` types, whose servers apply each push as it arrives
    sync: bool = True
    #: takes 2-bit gradient compression (set_gradient_compression): `device` and every dist type
    compression: bool = False
    #: takes a key's push as 2-bit words packed by the caller (`packing`, `pushpull_packed_async`:
    #: the dist types, packed inside the compiled step), when compression is set
    packed_push: bool = False
    #: kvstore.timeline's recorder of this worker (tfkv.timeline.Timeline): a dist store's when
    #: the setting is on; None (off) for every other store
    timeline: Any = None
    #: has pushpull_async/arrivals: push a key and request it back without waiting (safe to
    #: call from a TensorFlow op's thread), take the replies as they come
    async_pushpull: bool = False
    #: the `device` types' choice (MXNET_ENABLE_GPU_P2P): a key's device values are summed on
    #: the first device rather than in host memory
    sum_on_device: bool = False

    @property
    def rank(self) -> int:
        """This worker's index among `num_workers`."""
        return 0

    @property
    def num_workers(self) -> int:
        return 1

    @abstractmethod
    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        """Give each key its initial value; a key is initialised once."""

    @abstractmethod
    def push(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> None:
        """Sum the value(s) of each key; with an optimizer set, update the stored weight."""

    @abstractmethod
    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0,
             ignore_sparse: bool = True) -> Any:
        """Copy each key's stored value into `out` (variables), or return it when out is None. A
        RowSparse out is left unchanged, as MXNet's (ignore_sparse=True, its default); with
        ignore_sparse=False it gets the whole value, where the store holds it whole (local, device)."""

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None, priority: int | Sequence[int] = 0) -> Any:
        """Push, then pull into `out`; without `out`, as MXNet, into `value` (every array of it
        that can be written, see `writable`), and the result is also returned. Dense keys only."""
        self._refuse_row_sparse(key)
        self.push(key, value, priority)
        if out is not None:
            return self.pull(key, out, priority)
        self.pull(key, in_place(key, value), priority)
        return self.pull(key, None, priority)

    def pushpull_async(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> list[Any]:
        """Push the keys and ask for them back without waiting, where the store can (see
        `async_pushpull`); returns what `arrivals` takes. Here: push now, pull in `arrivals`."""
        self._refuse_row_sparse(key)
        self.push(key, value, priority)
        return list(key) if isinstance(key, (list, tuple)) else [key]

    def arrivals(self, pending: Sequence[Any]) -> Iterator[tuple[Key, Any]]:
        """(key, value) for each of `pending` (from pushpull_async), as each becomes available."""
        for k in pending:
            yield k, self.pull(k)

    # -- row-sparse keys (tfkv.store.sparse) ------------------------------------------------------

    def is_row_sparse(self, key: Key) -> bool:
        """Whether `key` was initialised row-sparse (with a RowSparse or a Table)."""
        return False

    def row_sparse_pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0,
                        row_ids: Any = None) -> Any:
        """MXNet's: the rows `row_ids` (any order, repeats allowed; whole numbers, of an integer or
        a float dtype) of a row-sparse key, as a RowSparse whose ids are unique and sorted. A list
        of keys takes a list of row_ids (one per key) or one array for all. With `out` (a
        RowSparse, a list per key: one per device) the result is written into it in place and
        None returned; a key's row_ids may be a list of arrays, one per out, and then out i gets
        rows row_ids[i] only (a row not among them is zero in it), as MXNet's."""
        asked = sparse.requests(key, row_ids, out)
        return sparse.deliver(key, asked, [self._pull_rows(k, ids) for k, ids in sparse.flat(asked)], out)

    def row_sparse_pull_async(self, key: Key | Sequence[Key], row_ids: Any, priority: int | Sequence[int] = 0) -> Any:
        """Ask for the rows now, take them later with `rows` (a prefetch). Here: pulled at once;
        the dist store sends the requests without waiting (safe from a TensorFlow op's thread)."""
        return self.row_sparse_pull(key, priority=priority, row_ids=row_ids)

    def set_rows(self, key: Key, rows: Any) -> None:
        """Replace rows of an initialised row-sparse key with `rows` (a RowSparse, ids unique):
        a table put back by pieces (a checkpoint's). In a job worker 0's are kept; every worker
        calls `barrier` before pulling them."""
        raise NotImplementedError(f"kvstore={self.type} cannot set rows of key {key!r}")

    def rows(self, pending: Any) -> Any:
        """What `row_sparse_pull` would have returned for the request `pending` stands for."""
        return pending

    def pull_rows(self, key: Key, row_ids: Any) -> Any:
        """The rows `row_ids` of a row-sparse key in the order of the ids (repeats repeated),
        shape row_ids.shape + row shape: what an embedding lookup needs. The single-machine
        stores return a tf.Tensor and may be traced; others a numpy array."""
        return self.row_sparse_pull(key, row_ids=row_ids).gather(row_ids)

    def _pull_rows(self, key: Key, row_ids: Any) -> RowSparse:
        """One key's rows for row_sparse_pull (ids unique and sorted); each store type's own."""
        raise ValueError(f"row_sparse_pull of key {key!r}: kvstore={self.type} holds no row-sparse keys")

    def _refuse_row_sparse(self, key: Key | Sequence[Key]) -> None:
        """pushpull takes dense keys only: one line naming a row-sparse key."""
        for k in (key if isinstance(key, (list, tuple)) else [key]):
            if not isinstance(k, (list, tuple)) and self.is_row_sparse(k):
                raise sparse.refused("pushpull", k)

    def broadcast(self, key: Key | Sequence[Key], value: Any, out: Any, priority: int | Sequence[int] = 0) -> None:
        """Initialise keys from `value` and copy them into every `out`."""
        self.init(key, value)
        self.pull(key, out, priority)

    def sum_over_workers(self, values: Any) -> np.ndarray:
        """Every worker's `values` (a float vector of the same length on each) summed elementwise
        in float64, the same result on every worker; a barrier too. For small control values (an
        evaluation's metric state), not gradients. With one worker: `values` as float64."""
        return np.array(values, dtype=np.float64).reshape(-1)

    @abstractmethod
    def set_optimizer(self, optimizer: Any) -> None:
        """Run `optimizer` (a `tfkv.optim` rule) inside the store on every push."""

    def set_gradient_compression(self, compression_params: Mapping[str, Any] | None) -> None:
        """MXNet's API: {"type": "2bit", "threshold": 0.5} compresses what is sent to be summed:
        between devices (`device`) or from workers to the parameter servers (`dist_*`). The
        threshold applies to what is pushed: gradient sums over a batch, as in MXNet (see
        tfkv.optim's rescale_grad). `local` sums in host memory and accepts only {"type": "none"},
        as MXNet's refuses compression."""
        from tfkv.ps import compression

        if compression.parse(compression_params) is not None:
            raise ValueError(f"gradient compression applies to what devices send to be summed (kvstore=device) or "
                             f"workers push to parameter servers (dist_*); kvstore={self.type} sends neither")

    def barrier(self) -> None:
        """Wait until every worker reaches this point (a no-op with one worker)."""

    def all_workers(self, ok: bool) -> bool:
        """True when every worker of the job passed True at this call, which every worker of a
        synchronous job makes at the same point: a vote, a one-value sum_over_workers. With one worker,
        or dist_async (whose workers never wait for each other), this worker's own `ok`."""
        return bool(ok)

    #: whether every worker must call `share_feedback` at a checkpoint's step before worker 0's
    #: save_optimizer_states (a dist_sync store of several workers that compresses)
    shares_feedback = False

    def share_feedback(self) -> None:
        """Every worker at the same step: hand its gradient compression's error feedback to
        worker 0, whose next save_optimizer_states includes it (tfkv.store.dist_feedback)."""

    @abstractmethod
    def save_optimizer_states(self, fname: str) -> None:
        """Write the optimizer state held by the store (npz, no pickle)."""

    @abstractmethod
    def load_optimizer_states(self, fname: str) -> None: ...

    def is_capable(self, capability: str) -> bool:
        """MXNet's capability query. OPTIMIZER ("optimizer"): the store can run an optimizer on
        push (every tfkv type can). An unknown capability is a ValueError, as in MXNet."""
        if str(capability).lower() == OPTIMIZER:
            return True
        raise ValueError(f"unknown capability {capability!r}; known: {OPTIMIZER!r}")

    def num_dead_node(self, node_id: int, timeout: float = 60) -> int:
        """MXNet's count of the nodes of `node_id` (SCHEDULER 1, SERVER_GROUP 2, WORKER_GROUP 4, or
        a sum of them) silent for more than `timeout` seconds. tfkv ends the whole job once a node
        is silent for the heartbeat timeout (4 s by default), so a store that can still be asked
        counts none; a single-machine store has no other nodes."""
        if not isinstance(node_id, (int, np.integer)) or not 1 <= int(node_id) <= 7:
            raise ValueError(f"node_id={node_id!r}: give a node group, 1 (scheduler), 2 (servers), 4 (workers) "
                             "or a sum of them")
        return 0

    def set_updater(self, updater: Updater) -> None:
        """MXNet's `_set_updater`: run `updater(key, received, stored)` on every push instead of
        an optimizer. Only a store that updates in this process can call Python."""
        raise ValueError(f"kvstore={self.type} cannot run a Python updater: its updates run on the parameter "
                         "servers, which take only a tfkv.optim rule (set_optimizer), never code")

    def _set_updater(self, updater: Updater) -> None:
        """MXNet's name for `set_updater`."""
        self.set_updater(updater)

    def _check_key(self, key: Key) -> None:
        """One kind of key per store (MXNet: "Mixed key types are not allowed")."""
        kind = key_kind(key)
        if self._key_kind is None:
            self._key_kind = kind
        elif kind != self._key_kind:
            raise ValueError(f"key {key!r} is a {kind}, but this store's keys are {self._key_kind}s: a store takes "
                             "int keys or str keys, never both (as MXNet)")

    _key_kind: str | None = None

    def name_keys(self, names: Mapping[Key, str]) -> None:
        """What this store's messages call these keys in place of `key 10`: a trainer keys its
        tables by number and names each by its layer (`layer embedding0 (...)`). The keys stay."""
        self._key_names = {**self._key_names, **names}

    def key_phrase(self, key: Key) -> str:
        """How a message names `key`: the name given it by name_keys, else `key 'emb'`."""
        return self._key_names.get(key) or f"key {key!r}"

    _key_names: Mapping[Key, str] = {}

    def close(self) -> None:
        """Leave cleanly and release sockets and threads; a store is unusable afterwards."""

    def abort(self, reason: str) -> None:
        """Leave after a failure: a distributed store tells its peers at once, naming `reason`."""
