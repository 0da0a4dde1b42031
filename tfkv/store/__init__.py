"""KVStore types by name: `tfkv.store.create("local")`, as MXNet's `mx.kv.create`.

Types register a "module:Class" target so that naming or listing them imports nothing heavy;
the class is imported on `create`. The distributed types plug into the same registry. MXNet's
other spellings of these types work too (any case, `dist` for `dist_sync`, ...), and the types
MXNet has and tfkv does not are refused naming the type to use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tfkv.registry import Registry
from tfkv.store.base import KVStore
from tfkv.store.sparse import RowSparse, Table


@dataclass(frozen=True)
class Capabilities:
    """What a store type can do (MXNet's `is_capable`, asked of a type name). Each class declares
    them as class attributes (`KVStore.distributed`, `.sync`, `.compression`); tfkv's own types
    repeat them in `BUILTIN` so that asking never imports a class (and with it TensorFlow), and
    a test holds the two equal. A plug-in's are read from its class."""

    distributed: bool = False  # a parameter-server job: scheduler, servers and workers, launched
    sync: bool = True  # each update sums every worker's push of the step (False: dist_async*)
    compression: bool = False  # takes 2-bit gradient compression (MXNet: device and every dist type)

    @classmethod
    def of(cls, store_class: type) -> "Capabilities":
        """The capabilities a store class declares."""
        return cls(distributed=bool(store_class.distributed), sync=bool(store_class.sync),
                   compression=bool(store_class.compression))


REGISTRY = Registry("KVStore type", {
    "local": "tfkv.store.local:LocalStore",
    "device": "tfkv.store.local:DeviceStore",
    "dist_sync": "tfkv.store.dist:DistStore",
    "dist_async": "tfkv.store.dist:DistAsync",
    "dist_sync_device": "tfkv.store.dist:DistSyncDevice",
    "dist_async_device": "tfkv.store.dist:DistAsyncDevice",
}, plugins="tfkv.stores")  # and installed packages' types (tfkv.plugins)
BUILTIN = {
    "local": Capabilities(),
    "device": Capabilities(compression=True),
    "dist_sync": Capabilities(distributed=True, compression=True),
    "dist_async": Capabilities(distributed=True, sync=False, compression=True),
    "dist_sync_device": Capabilities(distributed=True, compression=True),
    "dist_async_device": Capabilities(distributed=True, sync=False, compression=True),
}
register = REGISTRY.register
names = REGISTRY.names

# MXNet's other names for the same types (its create() lower-cases the name; "dist" without
# "_async" is synchronous, "device" sums on the devices; the local_* names are its older ones).
ALIASES = {
    "dist": "dist_sync",
    "dist_device_sync": "dist_sync_device",
    "dist_device_async": "dist_async_device",
    "local_update_cpu": "local",
    "local_allreduce_cpu": "local",
    "local_allreduce_device": "device",
}
# MXNet types tfkv has no counterpart for, and what to use instead.
INSTEAD = {
    "nccl": "device (sums on the devices)",
    "horovod": "dist_sync (tfkv's own parameter server)",
    "byteps": "dist_sync (tfkv's own parameter server)",
    "dist_p3": "dist_sync (whose requests already go out in priority order)",
    "dist_sync_p3": "dist_sync (whose requests already go out in priority order)",
}
REGISTRY.reserve(*ALIASES, *INSTEAD)  # a plug-in may not take MXNet's names for types


def canonical(name: str) -> str:
    """tfkv's name for the KVStore type MXNet calls `name`; ValueError naming the type to use
    for one tfkv does not have, or listing the known names."""
    key = str(name).strip().lower()
    if name in REGISTRY:
        return name
    if key in REGISTRY:
        return key
    if key in ALIASES:
        return ALIASES[key]
    if key in INSTEAD:
        raise ValueError(f"KVStore type {name!r} is MXNet's, not tfkv's; use {INSTEAD[key]}")
    raise ValueError(f"unknown KVStore type {name!r}; known: {', '.join(names())} "
                     f"(and MXNet's {', '.join(sorted(ALIASES))})")


def capabilities(name: str) -> Capabilities:
    """What the type MXNet or tfkv calls `name` declares it can do; tfkv's own types without an
    import, a plug-in's from its class. ValueError for a name no registry knows (`canonical`)."""
    kind = canonical(name)
    if kind in BUILTIN:
        return BUILTIN[kind]
    return Capabilities.of(REGISTRY.get(kind))


def create(name: str = "local", **kwargs: Any) -> KVStore:
    """A new store of type `name` (tfkv's or MXNet's name for it); kwargs go to its constructor
    (e.g. `devices=`)."""
    return REGISTRY.get(canonical(name))(**kwargs)


__all__ = ["Capabilities", "KVStore", "RowSparse", "Table", "canonical", "capabilities", "create", "names", "register"]
