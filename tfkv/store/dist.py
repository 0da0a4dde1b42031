"""The `dist_sync`, `dist_async`, `dist_sync_device` and `dist_async_device` KVStore types: the
worker-side facade of the parameter server (MXNet's KVStore API over `tfkv.ps`).

Where a key's parts live and how a pulled key is put back together is `tfkv.ps.parts` (a key
on one server picked as MXNet does, `key * 9973 % num_servers`, or cut into one part per server
above MXNET_KVSTORE_BIGARRAY_BOUND, and parts over TFKV_CHUNK_BYTES cut into chunks); requests,
their answers and waiting are `tfkv.ps.worker.ServerLink`, used through its API only. A push
first sums this machine's device values (in host memory, or on the first device for the
`*_device` types), then sends one message per part without waiting; a pull sends every part's
request before it waits for any answer. Requests go out in priority order (higher first).
`pushpull` and `pushpull_async` send each key's push and pull as one request (a PUSHPULL per
part, small keys fused into one per server; under PS_RESEND a push and then a pull:
`ServerLink.pushpulls`), so the servers answer early keys while later pushes are still on the
wire (both directions of the link busy at once, where pushing everything before pulling leaves
one idle); `arrivals` hands out each key as its last part arrives. DataParallel calls
`pushpull_async` from inside its compiled step, per key, as backprop produces the gradients
(hence the link's lock: the sockets are used from a TensorFlow thread). With
`set_gradient_compression` pushes are 2-bit compressed (`tfkv.ps.compression`) with one
residual per key chunk kept on the worker; with the `2bit_momentum` kind also one velocity per
chunk, the optimizer's momentum applied here, and the servers get the optimizer with momentum 0
(`compression.split_momentum`). Those worker-side arrays are not in a checkpoint (worker 0
alone writes it): a resumed job starts them from zero, and says so.

A key initialised with a float16 or bfloat16 value holds that dtype (tfkv.ps.dtypes): this
machine's values are summed in it and travel at 2 bytes a value; a value of another dtype is
refused naming both. Only float32 keys are fused into a PUSHPULL (it carries one dtype).

A row-sparse key (a table sharded by rows over every server) is `tfkv.store.dist_rows`. Rows (a
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
from typing import Any, Hashable, Iterator, Mapping, Sequence

import numpy as np

from tfkv.errors import EXIT_PEER_FAILED
from tfkv.ps import dtypes, memory, node, parts
from tfkv.ps.feedback import Sender
from tfkv.ps import protocol as P
from tfkv.ps.cluster_env import ClusterEnv
from tfkv.ps.parts import Layout, Pull, RowPlacement
from tfkv.ps.scheduler_link import SchedulerLink
from tfkv.ps.worker import ServerLink
from tfkv.store import sparse
from tfkv.store.base import Key, KVStore, gpu_p2p, in_place, pairs
from tfkv.store.dist_optimizer import ServerOptimizer
from tfkv.store.dist_rows import RowSparseKeys, TableKey


class DistStore(ServerOptimizer, RowSparseKeys, KVStore):
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
        self.servers = ServerLink(env, self.link, self._key_name)
        # A key's push and pull as one PUSHPULL, or (PS_RESEND) as two requests, the pulls once
        # every push is acknowledged: a pull must not overtake a push that was lost and is being resent.
        self._pushpulls = self.servers.pushpulls
        self._ids: dict[Hashable, int] = {}
        self._layouts: dict[int, Layout] = {}
        self._sender: Sender | None = None  # 2-bit compression of pushes, when set
        self._tables: dict[int, TableKey] = {}  # row-sparse keys, by id
        self.push_bytes = 0  # payload bytes of every PUSH sent (measures compression), row ids included
        self.pull_bytes = 0  # payload bytes asked for by pulls (the values, and row ids sent), replies' values
        self.sum_on_device = self.on_device and gpu_p2p(values=knobs)
        # MXNet's store leaves in its destructor, and its scripts end without a teardown call:
        # this one leaves when the interpreter exits (close() unregisters it). An exception left in
        # sys.last_value already (IPython sets it for every traceback it displays) is not the one
        # that ends this interpreter: _at_exit only heeds a newer one.
        self._shown_before = getattr(sys, "last_value", None)
        atexit.register(self._at_exit)
        if self.rank == 0:
            self.servers.wait([self.servers.request(s, P.Message(P.Type.CONFIGURE, meta={"sync": self.sync}))
                               for s in range(self.servers.count)])
        self.barrier()

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def num_workers(self) -> int:
        return self.link.num_workers

    # -- keys ----------------------------------------------------------------------------------

    def _id(self, key: Hashable) -> int:
        """The key's id on the servers, the same on every worker. An int key in [0, 2**40) is its
        own id (so `key * 9973 % servers` places it as in MXNet); any other key (a str, a negative
        or a larger int) takes the next id from 2**40 in init order, which every worker shares,
        as MXNet numbers its str keys. So two distinct keys never share an id."""
        self._check_key(key)
        kid = self._ids.get(key)
        if kid is None:
            if isinstance(key, (int, np.integer)) and 0 <= int(key) < parts.NAMED_KEY_BASE:
                kid = int(key)
            else:
                kid = parts.NAMED_KEY_BASE + self._named
                if kid >> parts.CHUNK_SHIFT:
                    raise ValueError(f"key {key!r}: more than {(1 << parts.CHUNK_SHIFT) - parts.NAMED_KEY_BASE} keys")
                self._named += 1
            self._ids[key] = kid
        return kid

    _named = 0  # keys numbered from parts.NAMED_KEY_BASE so far

    def _key_name(self, kid: int) -> str:
        """What messages call key id `kid`: its key as the caller gave it, or the name given it."""
        return self.key_phrase(next((k for k, i in self._ids.items() if i == kid), kid))

    def _layout(self, key: Hashable) -> tuple[int, Layout]:
        kid = self._ids.get(key) if type(key) is int or type(key) is str else None
        layout = self._layouts.get(kid)  # type: ignore[arg-type]
        if layout is not None:  # an initialised key of exactly int or str: of this store's kind (checked at init)
            return kid, layout  # type: ignore[return-value]
        self._check_key(key)
        kid = self._ids.get(key)
        if kid is None or kid not in self._layouts:
            raise KeyError(f"key {key!r} was not initialised; call init({key!r}, value) first")
        return kid, self._layouts[kid]

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
            kid = self._id(k)
            if kid in self._layouts or kid in self._tables:
                raise ValueError(f"key {k!r} is already initialised")
            dtype = dtypes.key_dtype(values[0])
            flat = self._merge(k, values[:1], dtype)
            self._layouts[kid] = layout = parts.plan(kid, tuple(np.shape(values[0])), self.servers.count,
                                                     self.env.bigarray_bound, self.env.chunk_bytes, dtype)
            # Only float32 keys are fused: a PUSHPULL of many keys carries one dtype (half keys go
            # as a one-key PUSHPULL each, still batched into one ZeroMQ message per server).
            layout.fusable = (len(layout.parts) == 1 and dtype is dtypes.FLOAT32
                              and self.servers.fusable(dtype.itemsize * layout.size))
            if self.rank == 0:  # worker 0's value wins; the others wait at the barrier
                for part in layout.parts:
                    self.servers.request(part.server, P.Message(P.Type.INIT, key=part.skey,
                                                                data=flat[part.start:part.end]))
        self.servers.settle()
        self.barrier()

    def push(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> None:
        self._check_can_push()
        for k, values in self._ordered(list(pairs(key, value)), priority):
            if self._tables and self.is_row_sparse(k):
                self._push_rows(k, values)
            else:
                self._push_key(k, values)
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
            if asked and self._tables and self.is_row_sparse(k):
                raise sparse.refused("pull", k)
            items.append((k, dense if asked else None))
        self.servers.fence()
        pulls = [self._request_pull(k, outs) for k, outs in self._ordered(items, priority) if outs is not None]
        return self._finish(key, out, pulls)

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None,
                 priority: int | Sequence[int] = 0) -> Any:
        """Push each key and request it back at once, so that replies stream back while later
        keys are still going out (both directions of the link busy, not one after the other).
        Without `out` the result goes into `value`, as MXNet's (see base.in_place), and is returned."""
        if self._tables:
            self._refuse_row_sparse(key)
        into = out if out is not None else self._in_place(key, value)
        return self._finish(key, out, self.pushpull_async(key, value, priority, out=into))

    def _in_place(self, key: Key | Sequence[Key], value: Any) -> Any:
        """base.in_place, with a numpy value of a key's size but another shape (a flat gradient)
        viewed in the key's shape, so the result still lands in it."""
        if isinstance(key, (list, tuple)):
            return [self._in_place(k, v) for k, v in zip(key, value)]
        shape = self._layout(key)[1].shape
        return [o.reshape(shape) if isinstance(o, np.ndarray) and o.shape != shape and o.flags.c_contiguous
                and o.size == int(np.prod(shape)) else o for o in in_place(key, value)]

    def pushpull_async(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0,
                       out: Any = None) -> list[Pull]:
        """Push each key and send its pull request without waiting for anything; `arrivals` (or
        `wait`) takes the replies and writes them into `out` if given. Safe to call from a
        TensorFlow op's thread (DataParallel pushes each gradient as backprop produces it)."""
        if self._tables:  # per key and step: nothing to look up in a job without tables
            self._refuse_row_sparse(key)
        self._check_can_push()
        outs = dict(pairs(key, out))
        with self.servers.lock:
            items = self._ordered(list(pairs(key, value)), priority)
            if not self._pushpulls:
                return self._pushes_then_pulls(items, outs)
            pulls = []
            fusing = self._sender is None  # a 2-bit payload is no float32 slice of a fused one
            for k, values in items:  # each pull right behind its push: replies flow while pushes do
                layout = self._layout(k)[1]
                if fusing and layout.fusable:
                    pulls.append(self._pushpull_fused(k, layout, values, outs[k]))
                else:
                    pulls.append(self._pushpull_parts(k, layout, values, outs[k]))
            return pulls

    def _pushes_then_pulls(self, items: list[tuple[Key, list[Any]]], outs: dict[Key, list[Any]]) -> list[Pull]:
        for k, values in items:
            self._push_key(k, values)
        self.servers.fence()
        return [self._request_pull(k, outs[k]) for k, _ in items]

    def _pushpull_parts(self, k: Key, layout: Layout, values: list[Any], outs: list[Any]) -> Pull:
        """A key's push and pull as one PUSHPULL per part, its payload the message's last frame.
        (A PUSH with its PULL's header behind the payload costs libzmq a write more per message.)"""
        pull = Pull(k, layout, outs)  # checks the outs before anything is sent
        flat = self._flat(k, layout, values)
        self.pull_bytes += flat.nbytes
        pull.expect([self.servers.request(part.server, self._carrying(P.Type.PUSHPULL, part.skey,
                                                                      flat[part.start:part.end]))
                     for part in layout.parts])
        return pull

    def _pushpull_fused(self, k: Key, layout: Layout, values: list[Any], outs: list[Any]) -> Pull:
        """A small key's push and pull, staged with its server's other small keys into one
        PUSHPULL request (ServerLink.pushpull)."""
        pull = Pull(k, layout, outs)  # checks the outs before anything is sent
        flat = self._flat(k, layout, values)
        part = layout.parts[0]
        self.push_bytes += flat.nbytes
        self.pull_bytes += flat.nbytes
        pull.expect([self.servers.pushpull(part.server, part.skey, flat)])
        return pull

    def arrivals(self, pulls: Sequence[Pull]) -> Iterator[tuple[Key, np.ndarray]]:
        """(key, value) for each of `pulls` as soon as all of its parts have arrived, in arrival
        order; the value is also written into the pull's `outs`."""
        return self.servers.gather(pulls)

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
        if self._sender is not None and self._sender.setting.kind.worker_momentum and not self._has_optimizer:
            raise RuntimeError(f"gradient compression {self._sender.setting.kind.name} applies the optimizer's momentum "
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

    def _push_key(self, k: Key, values: list[Any]) -> None:
        layout = self._layout(k)[1]
        flat = self._flat(k, layout, values)
        for part in layout.parts:
            self.servers.push(part.server, self._carrying(P.Type.PUSH, part.skey, flat[part.start:part.end]))

    def _carrying(self, kind: P.Type, skey: int, part: np.ndarray) -> P.Message:
        """A PUSH or PUSHPULL of one key part: 2-bit compressed with `set_gradient_compression`
        (its residual changes here, once; a resend under PS_RESEND repeats the frames)."""
        msg = P.Message(kind, key=skey, data=part)
        if self._sender is not None:
            msg.data = self._sender.pack(skey, part)
            msg.dtype, msg.count = P.DType.TWOBIT, part.size
        self.push_bytes += msg.data.nbytes
        return msg

    def _request_pull(self, k: Key, outs: list[Any]) -> Pull:
        _, layout = self._layout(k)
        pull = Pull(k, layout, outs)  # checks the outs before anything is sent
        self.pull_bytes += layout.size * layout.dtype.itemsize
        pull.expect([self.servers.request(part.server, P.Message(P.Type.PULL, key=part.skey))
                     for part in layout.parts])
        return pull

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

    def abort(self, reason: str) -> None:
        if not self._closed:
            self._closed = True
            atexit.unregister(self._at_exit)
            self.link.abort(reason)

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
