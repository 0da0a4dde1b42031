"""Name -> "module:attribute" registries whose entries are imported only when used.

Models, data sets and KVStore types plug in this way, so that listing or validating names
(the config layer, the launcher, the servers) never imports TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any


class Registry:
    def __init__(self, kind: str, entries: dict[str, str]):
        self.kind = kind
        self._entries = dict(entries)

    def register(self, name: str, target: str) -> None:
        """Add or replace `name`; `target` is "package.module:attribute"."""
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Any:
        """Import and return what `name` stands for; KeyError lists the known names."""
        try:
            module, attr = self._entries[name].split(":")
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None
        return getattr(importlib.import_module(module), attr)
