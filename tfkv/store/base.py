"""The KVStore interface every store type implements, with MXNet's calling conventions.

A key is an int or a str. A value is one array, or a list of arrays (one per device) that the
store sums before it stores or updates. `push`/`pull`/`init` also take a list of keys with a
list of values. `priority` (an int, or one per key) orders a store's requests, higher first,
where it has any to order (the parameter-server client); the single-machine stores run inside
one graph and ignore it. What a store can do beyond the common API is a capability query, not
a guess from its type name.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, Hashable, Iterator, Mapping, Sequence

Key = Hashable


def pairs(key: Key | Sequence[Key], value: Any) -> Iterator[tuple[Key, list[Any]]]:
    """Normalise MXNet's argument forms to (key, [one value per device]) pairs."""
    if isinstance(key, (list, tuple)):
        if value is None:
            value = [None] * len(key)
        if len(value) != len(key):
            raise ValueError(f"{len(key)} keys but {len(value)} values")
        for k, v in zip(key, value):
            yield from pairs(k, v)
        return
    if value is None:
        yield key, []
    elif isinstance(value, (list, tuple)):
        yield key, list(value)
    else:
        yield key, [value]


def gpu_p2p(env: Mapping[str, str] | None = None) -> bool:
    """TFKV_ENABLE_GPU_P2P / MXNET_ENABLE_GPU_P2P (default 1): the `device` types sum a key's
    device values device-to-device; 0: through host memory (copied to the CPU, summed there)."""
    env = os.environ if env is None else env
    for name in ("TFKV_ENABLE_GPU_P2P", "MXNET_ENABLE_GPU_P2P"):
        if env.get(name):
            return env[name].strip().lower() not in ("0", "false", "no", "off")
    return True


class KVStore(ABC):
    """Sums what devices (and, for dist types, machines) push; serves the result on pull."""

    #: the registry name, e.g. "local"
    type: str = ""
    #: push/pull are TensorFlow ops that may be traced into the training tf.function
    traceable: bool = False
    #: values cross machines (a parameter server); False for the single-machine stores
    distributed: bool = False
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
    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int | Sequence[int] = 0) -> Any:
        """Copy each key's stored value into `out` (variables), or return it when out is None."""

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None, priority: int | Sequence[int] = 0) -> Any:
        self.push(key, value, priority)
        return self.pull(key, out if out is not None else None, priority)

    def pushpull_async(self, key: Key | Sequence[Key], value: Any, priority: int | Sequence[int] = 0) -> list[Any]:
        """Push the keys and ask for them back without waiting, where the store can (see
        `async_pushpull`); returns what `arrivals` takes. Here: push now, pull in `arrivals`."""
        self.push(key, value, priority)
        return list(key) if isinstance(key, (list, tuple)) else [key]

    def arrivals(self, pending: Sequence[Any]) -> Iterator[tuple[Key, Any]]:
        """(key, value) for each of `pending` (from pushpull_async), as each becomes available."""
        for k in pending:
            yield k, self.pull(k)

    def broadcast(self, key: Key | Sequence[Key], value: Any, out: Any, priority: int | Sequence[int] = 0) -> None:
        """Initialise keys from `value` and copy them into every `out`."""
        self.init(key, value)
        self.pull(key, out, priority)

    @abstractmethod
    def set_optimizer(self, optimizer: Any) -> None:
        """Run `optimizer` (a `tfkv.optim` rule) inside the store on every push."""

    def set_gradient_compression(self, compression_params: Mapping[str, Any] | None) -> None:
        """MXNet's API: {"type": "2bit", "threshold": 0.5} compresses what workers push to the
        parameter servers. A single-machine store sums inside one graph and sends nothing over a
        wire, so it accepts only {"type": "none"} (MXNet refuses compression for `local` too)."""
        from tfkv.store import compression

        if compression.parse(compression_params) is not None:
            raise ValueError(f"gradient compression applies to pushes to parameter servers; kvstore={self.type} "
                             "has none (use a dist_* type)")

    def barrier(self) -> None:
        """Wait until every worker reaches this point (a no-op with one worker)."""

    @abstractmethod
    def save_optimizer_states(self, fname: str) -> None:
        """Write the optimizer state held by the store (npz, no pickle)."""

    @abstractmethod
    def load_optimizer_states(self, fname: str) -> None: ...

    def is_capable(self, capability: str) -> bool:
        """MXNet's capability query; "optimizer": can run an optimizer in the store."""
        return capability == "optimizer"

    def close(self) -> None:
        """Leave cleanly and release sockets and threads; a store is unusable afterwards."""

    def abort(self, reason: str) -> None:
        """Leave after a failure: a distributed store tells its peers at once, naming `reason`."""
