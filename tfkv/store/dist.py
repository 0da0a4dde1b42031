"""The `dist_sync`, `dist_async`, `dist_sync_device` and `dist_async_device` KVStore types: the
worker-side facade of the parameter server (MXNet's KVStore API over `tfkv.ps`).

Where a key's parts live and how a pulled key is put back together is `tfkv.ps.parts` (a key
on one server picked as MXNet does, `key * 9973 % num_servers`, or cut into one part per server
above MXNET_KVSTORE_BIGARRAY_BOUND, and parts over TFKV_CHUNK_BYTES cut into chunks); the
requests are built by `tfkv.ps.kvworker.KVWorker` (`worker`), numbered and awaited by
`tfkv.ps.worker.ServerLink` (`servers`: waiting, settling), no message built here. A push
first sums this machine's device values (in host memory, or on the first device for the
`*_device` types), then hands the flat value to `tfkv.ps.kvworker.KVWorker`, which builds the
requests (one message per part, sent without waiting); a pull sends every part's request before
it waits for any answer. Requests go out in priority order (higher first). `pushpull` and
`pushpull_async` send each key's push and pull as one request (a PUSHPULL per part, small keys
fused into one per server; under PS_RESEND a push and then a pull: `KVWorker.pushpull`), so the
servers answer early keys while later pushes are still on the wire (both directions of the link
busy at once, where pushing everything before pulling leaves one idle); `arrivals` hands out
each key as its last part arrives. DataParallel calls
`pushpull_async` from inside its compiled step, per key, as backprop produces the gradients
(hence the link's lock: the sockets are used from a TensorFlow thread). With
`set_gradient_compression` pushes are 2-bit compressed (`tfkv.ps.compression`) with one
residual per key chunk kept on the worker; with the `2bit_momentum` kind also one velocity per
chunk, the optimizer's momentum applied here, and the servers get the optimizer with momentum 0
(`compression.split_momentum`). A compiled step packs its gradients itself, as TensorFlow ops,
and pushes the words (`tfkv.store.dist_feedback`: `packed_push`). The worker-side arrays go
into the optimizer state file under the worker's rank (worker 0 alone writes a checkpoint:
another worker's start from zero on resume, and it says so).

A key initialised with a float16 or bfloat16 value holds that dtype (tfkv.ps.dtypes): this
machine's values are summed in it and travel at 2 bytes a value; a value of another dtype is
refused naming both. Only float32 keys are fused into a PUSHPULL (it carries one dtype).

The keys (ids, layouts, tables) are `tfkv.store.dist_keys.Keys`. A row-sparse key (a table
sharded by rows over every server) is `tfkv.store.dist_rows`. Rows (a
RowSparse or tf.IndexedSlices) pushed to a dense key go as the dense value they stand for, as
MXNet's; a RowSparse out of a dense `pull` is left as it is (MXNet's ignore_sparse=True).

Creating a store in a process whose role is `server` or `scheduler` runs that role and exits,
as MXNet does, so one command can be started for every role of a job. A worker's store leaves
when the interpreter exits, as MXNet's does in its destructor (see `_at_exit`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from tfkv import timeline
from tfkv.errors import EXIT_PEER_FAILED
from tfkv.ps import dtypes, memory, node
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.kvworker import KVWorker
from tfkv.ps.parts import Layout, Pull, RowPlacement
from tfkv.ps.scheduler_link import SchedulerLink
from tfkv.ps.worker import ServerLink
from tfkv.store import dist_rows, sparse
from tfkv.store.base import Key, KVStore, gpu_p2p, in_place, pairs
from tfkv.store.dist_feedback import WorkerFeedback
from tfkv.store.dist_keys import Keys
from tfkv.store.dist_optimizer import ServerOptimizer
from tfkv.store.sparse import RowSparse


class _WorkerCount:
    """A byte count the store shows (and a benchmark resets), kept by its KVWorker."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, store: Any, owner: type | None = None) -> Any:
        return self if store is None else getattr(store.worker, self.name)

    def __set__(self, store: Any, value: int) -> None:
        setattr(store.worker, self.name, value)


class DistStore(WorkerFeedback, ServerOptimizer, KVStore):
    type = "dist_sync"
    distributed = True
    async_pushpull = True
    sync = True
    compression = True
    on_device = False

    def __init__(self, devices: Sequence[str] | None = None, env: ClusterEnv | None = None,
                 knobs: Mapping[str, Any] | None = None):
        """`env`: this worker's ClusterEnv, else read from the environment with the knob values
        `knobs` (the run's, by config key: tfkv.knobs.resolve) or, without them, the environment's."""
        env = env or ClusterEnv.from_env(knobs=knobs)
        node.run_unless_worker(env)
        RowPlacement(1, 1, env.row_sharding)  # an unknown kvstore.row_sharding refused before the job forms
        self.env = env
        memory.keep_freed_buffers()  # the same large buffers every step (tfkv.ps.memory)
        self._devices = list(devices or [])
        self.link = SchedulerLink(env, "worker")
        self.keys = Keys(self._check_key, self.key_phrase)
        self.servers = ServerLink(env, self.link, self.keys.name)
        self.worker = KVWorker(self.servers)  # every request to the servers is built there
        self.timeline = self.worker.timeline = timeline.of(env.timeline, "worker", self.rank)  # None: off
        self.sum_on_device = self.on_device and gpu_p2p(values=knobs)
        # MXNet's store leaves in its destructor, and its scripts end without a teardown call:
        # this one leaves when the interpreter exits (close() unregisters it). An exception left in
        # sys.last_value already (IPython sets it for every traceback it displays) is not the one
        # that ends this interpreter: _at_exit only heeds a newer one.
        self._shown_before = getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        if self.rank == 0:
            self.worker.configure(self.sync)
        self.barrier()

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def num_workers(self) -> int:
        return self.link.num_workers

    # Payload bytes of every PUSH sent (measures compression), row ids included; payload bytes
    # asked for by pulls (the values, and row ids sent). Counted where requests are built.
    push_bytes = _WorkerCount()
    pull_bytes = _WorkerCount()

    def _merge(self, k: Key, values: list[Any], dtype: np.dtype) -> np.ndarray:
        """One flat array of the key's `dtype`: the sum of this machine's device values (a half
        key's summed in its dtype, as MXNet's; each checked to be of it, tfkv.ps.dtypes)."""
        if len(values) == 1:
            v = values[0]
            if type(v) is np.ndarray and v.dtype is dtype and v.flags.c_contiguous:
                return v.reshape(-1)  # the common case: one float32 numpy gradient, as it is
        if dtype is not dtypes.FLOAT32 or dtypes.any_half(values):
            for v in values:
                dtypes.check(k, dtype, v)
        if len(values) > 1 and self.sum_on_device:
            # GPU P2P: sum on the first device; without it the values are summed below, in host memory.
            import tensorflow as tf

            with tf.device(self._devices[0] if self._devices else "/device:CPU:0"):
                values = [tf.add_n([tf.identity(v) for v in values])]
        arrays = [np.asarray(v, dtype=dtype) for v in values]
        total = arrays[0] if len(arrays) == 1 else np.add(arrays[0], arrays[1])
        for a in arrays[2:]:
            np.add(total, a, out=total)
        return np.ascontiguousarray(total).reshape(-1)

    @staticmethod
    def _ordered(items: list[tuple[Key, list[Any]]], priority: int | Sequence[int]) -> list[tuple[Key, list[Any]]]:
        if isinstance(priority, (list, tuple)):
            return [it for _, it in sorted(zip(priority, items), key=lambda t: -t[0])]
        return items

    # -- the KVStore API -----------------------------------------------------------------------

    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        for k, values in pairs(key, value):
            if values and sparse.is_sparse_init(values[0]):
                self._init_table(k, values[0])
                continue
            kid = self.keys.new(k)
            dtype = dtypes.key_dtype(values[0])
            flat = self._merge(k, values[:1], dtype)
            self.keys.layouts[kid] = layout = self.worker.plan(kid, tuple(np.shape(values[0])), dtype,
                                                               self.env.bigarray_bound, self.env.chunk_bytes)
            if self.rank == 0:  # worker 0's value wins; the others wait at the barrier
                self.worker.init(layout, flat)
        self.servers.settle()
        self.barrier()

    def push(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> None:
        self._check_can_push()
        for k, values in self._ordered(list(pairs(key, value)), priority):
            if self.keys.tables and self.keys.is_row_sparse(k):
                self._push_rows(k, values)
            else:
                layout = self.keys.layout(k)[1]
                self.worker.push(layout, self._flat(k, layout, values))
        self.servers.flush()  # a push is on its way when push returns (pushpull_async's wait for its arrivals)
        self.servers.poll()  # collect answers that are already here (errors surface early)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0,
             ignore_sparse: bool = True) -> Any:
        """MXNet's dist pull: a RowSparse out is left unchanged (ignore_sparse=True, its default);
        ignore_sparse=False, and the pull of a row-sparse key into a dense out, are refused as
        there (a table may be larger than this worker: row_sparse_pull its rows)."""
        items: list[tuple[Key, Any]] = []
        for k, outs in pairs(key, out):
            dense, whole = sparse.dense_outs(k, outs, ignore_sparse)
            if whole:
                raise sparse.refused("ignore_sparse", k)
            asked = out is None or bool(dense)  # a key whose every out is skipped is not pulled
            if asked and self.keys.tables and self.keys.is_row_sparse(k):
                raise sparse.refused("pull", k)
            items.append((k, dense if asked else None))
        self.servers.fence()
        pulls = [self.worker.pull(k, self.keys.layout(k)[1], outs)
                 for k, outs in self._ordered(items, priority) if outs is not None]
        return self._finish(key, out, pulls)

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None,
                 priority: int | Sequence[int] = 0) -> Any:
        """Push each key and request it back at once, so that replies stream back while later
        keys are still going out (both directions of the link busy, not one after the other).
        Without `out` the result goes into `value`, as MXNet's (see base.in_place), and is returned."""
        if self.keys.tables:
            self._refuse_row_sparse(key)
        into = out if out is not None else self._in_place(key, value)
        return self._finish(key, out, self.pushpull_async(key, value, priority, out=into))

    def _in_place(self, key: Key | Sequence[Key], value: Any) -> Any:
        """base.in_place, with a numpy value of a key's size but another shape (a flat gradient)
        viewed in the key's shape, so the result still lands in it."""
        if isinstance(key, (list, tuple)):
            return [self._in_place(k, v) for k, v in zip(key, value)]
        shape = self.keys.layout(key)[1].shape
        return [o.reshape(shape) if isinstance(o, np.ndarray) and o.shape != shape and o.flags.c_contiguous
                and o.size == int(np.prod(shape)) else o for o in in_place(key, value)]

    def pushpull_async(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0,
                       out: Any = None) -> list[Pull]:
        """Push each key and send its pull request without waiting for anything; `arrivals` (or
        `wait`) takes the replies and writes them into `out` if given. Safe to call from a
        TensorFlow op's thread (DataParallel pushes each gradient as backprop produces it)."""
        if self.keys.tables:  # per key and step: nothing to look up in a job without tables
            self._refuse_row_sparse(key)
        self._check_can_push()
        outs = dict(pairs(key, out))
        with self.servers.lock:
            return self.worker.pushpull(self._pushpulled(self._ordered(list(pairs(key, value)), priority), outs))

    def _pushpulled(self, items: list[tuple[Key, list[Any]]],
                    outs: dict[Key, list[Any]]) -> Iterator[tuple[Key, Layout, list[Any], Any]]:
        """(key, layout, outs, its flat value when asked for) of each key, for KVWorker.pushpull."""
        for k, values in items:
            layout = self.keys.layout(k)[1]
            yield k, layout, outs[k], lambda k=k, layout=layout, values=values: self._flat(k, layout, values)

    def arrivals(self, pulls: Sequence[Pull]) -> Iterator[tuple[Key, np.ndarray]]:
        """(key, value) for each of `pulls` as soon as all of its parts have arrived, in arrival
        order; the value is also written into the pull's `outs`."""
        replies = self.worker.gather(pulls)
        return replies if self.timeline is None else self.timeline.arrivals(replies)

    def wait(self, pulls: Sequence[Pull]) -> dict[Key, np.ndarray]:
        """Every pull's value, by key, once all have arrived."""
        return dict(self.arrivals(pulls))

    def sum_over_workers(self, values: Any) -> np.ndarray:
        """Through the scheduler's barrier (tfkv.ps.sums): exact and alike for dist_sync and
        dist_async, whose servers would apply a push rather than sum it."""
        self.servers.settle()
        return self.link.barrier(np.asarray(values, dtype=np.float64).reshape(-1))

    def _finish(self, key: Key | Sequence[Key], out: Any, pulls: list[Pull]) -> Any:
        results = self.wait(pulls)
        if out is not None:
            return None
        if isinstance(key, (list, tuple)):
            return [results[k] for k in key]
        return results[key]

    def _check_can_push(self) -> None:
        if not self.sync and not self._has_optimizer:
            raise RuntimeError(f"{self.type} needs an optimizer on the servers (set_optimizer, "
                               "update_on_kvstore=true): without one each push would replace the weights")
        sender = self.worker.sender
        if sender is not None and sender.setting.kind.worker_momentum and not self._has_optimizer:
            raise RuntimeError(f"gradient compression {sender.setting.kind.name} applies the optimizer's momentum "
                               "on the workers: call set_optimizer (an SGD) before pushing")

    def _flat(self, k: Key, layout: Layout, values: list[Any]) -> np.ndarray:
        """This machine's values of key `k` summed into one flat array of its size and dtype; rows
        (a RowSparse or tf.IndexedSlices) as the dense value they stand for (sparse.densify)."""
        if type(values[0]) is not np.ndarray and any(sparse.is_rows(v) for v in values):
            values = [sparse.densify(k, v, layout.shape) if sparse.is_rows(v) else v for v in values]
        flat = self._merge(k, values, layout.dtype)
        if flat.size != layout.size:
            raise ValueError(f"key {k!r}: pushed {flat.size} values, it holds {layout.size}")
        return flat

    # -- row-sparse keys (tfkv.store.dist_rows) --------------------------------------------------

    def is_row_sparse(self, key: Key) -> bool:
        return self.keys.is_row_sparse(key)

    def _init_table(self, k: Key, value: Any) -> None:
        """Make `k` a table on every server: each server makes its shard from the description
        (a Table's init, or zeros), then a RowSparse's rows are sent in chunks to their owners."""
        kid, spec, rows = self.keys.new_table(k, value, self.servers.count, self.env.row_sharding)
        if self.rank == 0:  # worker 0's value wins; the others wait at the barrier
            table = self.keys.tables[kid]
            self.worker.init_table(kid, table, spec)
            if rows is not None:
                self.worker.set_rows(kid, table, rows.indices, rows.data, self.env.chunk_bytes)

    def set_rows(self, key: Key, rows: Any) -> None:
        kid, table = self.keys.table(key, "sparse_pull")
        given = sparse.check_rows(key, RowSparse.of(rows, table.shape), table.shape, table.dtype, what="set_rows")
        if self.rank == 0:  # worker 0's rows win, as with init; the caller's barrier waits for them
            self.worker.set_rows(kid, table, given.indices, given.data, self.env.chunk_bytes)
            self.servers.settle()

    def _push_rows(self, k: Key, values: list[Any]) -> None:
        """This machine's rows of `k` summed sparsely, then one PUSH to each server owning some
        (every server, in a synchronous job)."""
        kid, table = self.keys.table(k)
        if self.worker.sender is not None:
            raise sparse.refused("compression", k)
        rows = dist_rows.pushed(k, values, table)
        self.worker.push_rows(kid, table, rows.indices, rows.data, self.sync)

    def row_sparse_pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0,
                        row_ids: Any = None) -> Any:
        """MXNet's: every key's rows requested (from the servers that own them) before any is awaited."""
        pending = self._request_rows(key, sparse.requests(key, row_ids, out), priority)
        return sparse.deliver(key, pending.asked, dist_rows.arrived(self.worker, pending), out)

    def _pull_rows(self, key: Key, row_ids: Any) -> RowSparse:
        return dist_rows.arrived(self.worker, self.row_sparse_pull_async(key, row_ids))[0]

    def row_sparse_pull_async(self, key: Key | Sequence[Key], row_ids: Any, priority: int | Sequence[int] = 0) -> Any:
        """Send each key's row requests now, without waiting (safe from a TensorFlow op's thread);
        `rows` takes the answer. In a synchronous job, asked after this worker's push of a round,
        the rows include that round's update."""
        return self._request_rows(key, sparse.requests(key, row_ids), priority)

    def _request_rows(self, key: Any, asked: list[sparse.Asked], priority: int | Sequence[int]) -> Any:
        order = [i for i, _ in self._ordered([(i, []) for i in range(len(asked))], priority)]
        return dist_rows.request(self.keys, self.worker, key, asked, order, self.env.chunk_bytes)

    def rows(self, pending: Any) -> Any:
        """What row_sparse_pull would have returned for the request `pending` stands for."""
        return sparse.deliver(pending.key, pending.asked, dist_rows.arrived(self.worker, pending), None)

    def barrier(self) -> None:
        self.servers.settle()
        self.link.barrier()

    def all_workers(self, ok: bool) -> bool:
        """Whether every worker of a synchronous job was ok: a one-value sum through the
        scheduler's barrier (sum_over_workers). dist_async's workers never wait for each other."""
        if not self.sync or self.num_workers == 1:
            return bool(ok)
        return float(self.sum_over_workers([0.0 if ok else 1.0])[0]) == 0.0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        self.servers.settle()
        self.link.done()
        self.servers.close()
        if self.timeline is not None:
            self.timeline.close()

    def abort(self, reason: str) -> None:
        if not self._closed:
            self._closed = True
            atexit.unregister(self._at_exit)
            self.link.abort(reason)
            if self.timeline is not None:
                self.timeline.close()

    def _at_exit(self) -> None:
        """The interpreter is exiting without close(): after an uncaught exception (which the
        interpreter has just printed, and left in sys.last_value) leave as failed, so the job
        stops now naming it; after a normal end leave as close() does, so the job can end 0."""
        exc = getattr(sys, "last_value", None)
        if exc is not None and exc is not self._shown_before:
            self.abort(f"{type(exc).__name__}: {exc}")
            if getattr(exc, "exit_code", None) == EXIT_PEER_FAILED:  # errors.reacting: a peer left
                sys.stdout.flush()
                logging.shutdown()
                os._exit(EXIT_PEER_FAILED)  # the interpreter would exit 1, as for a failure of its own
            return
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - an atexit hook cannot raise: fail the job instead
            print(f"tfkv: {self.link.name}: leaving at exit failed ({type(e).__name__}: {e})", file=sys.stderr,
                  flush=True)
            self._closed = False
            self.abort(f"leaving at exit failed: {type(e).__name__}: {e}")
            sys.stdout.flush()
            logging.shutdown()  # os._exit skips the atexit hook that would flush the log handlers
            os._exit(1)  # an exception in an atexit hook would not change the exit status

    _closed = False
    _shown_before: BaseException | None = None


class DistAsync(DistStore):
    type = "dist_async"
    sync = False


class DistSyncDevice(DistStore):
    type = "dist_sync_device"
    on_device = True


class DistAsyncDevice(DistStore):
    type = "dist_async_device"
    sync = False
    on_device = True
