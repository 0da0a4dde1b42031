"""KVStore types by name: `tfkv.store.create("local")`, as MXNet's `mx.kv.create`.

Types register a "module:Class" target so that naming or listing them imports nothing heavy;
the class is imported on `create`. The distributed types plug into the same registry.
"""

from __future__ import annotations

from typing import Any

from tfkv.registry import Registry
from tfkv.store.base import KVStore

REGISTRY = Registry("KVStore type", {
    "local": "tfkv.store.local:LocalStore",
    "device": "tfkv.store.local:DeviceStore",
    "dist_sync": "tfkv.store.dist:DistStore",
    "dist_async": "tfkv.store.dist:DistAsync",
    "dist_sync_device": "tfkv.store.dist:DistSyncDevice",
    "dist_async_device": "tfkv.store.dist:DistAsyncDevice",
})
register = REGISTRY.register
names = REGISTRY.names


def create(name: str = "local", **kwargs: Any) -> KVStore:
    """A new store of type `name`; kwargs go to its constructor (e.g. `devices=`)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown KVStore type {name!r}; known: {', '.join(names())}")
    return REGISTRY.get(name)(**kwargs)


__all__ = ["KVStore", "create", "names", "register"]
