"""KVStore types by name: `tfkv.store.create("local")`, as MXNet's `mx.kv.create`.

Types register a "module:Class" target so that naming or listing them imports nothing heavy;
the class is imported on `create`. The distributed types plug into the same registry.
"""

from __future__ import annotations

import importlib
from typing import Any

from tfkv.store.base import KVStore

_REGISTRY: dict[str, str] = {
    "local": "tfkv.store.local:LocalStore",
    "device": "tfkv.store.local:DeviceStore",
}


def register(name: str, target: str) -> None:
    """Add a store type: `target` is "package.module:Class", a `KVStore` subclass."""
    _REGISTRY[name] = target


def names() -> list[str]:
    return sorted(_REGISTRY)


def create(name: str = "local", **kwargs: Any) -> KVStore:
    """A new store of type `name`; kwargs go to its constructor (e.g. `devices=`)."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KVStore type {name!r}; known: {', '.join(names())}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["KVStore", "create", "names", "register"]
