"""Name -> "module:attribute" registries whose entries are imported only when used.

Models, data sets and KVStore types plug in this way, so that listing or validating names
(the config layer, the launcher, the servers) never imports TensorFlow. A registry given an
entry-point group also holds what installed packages declare there (tfkv.plugins): read from
their metadata the first time a name is not found or the names are listed; tfkv's own names
(and those `reserve`d) win over a plug-in's.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any


class Registry:
    def __init__(self, kind: str, entries: dict[str, str], plugins: str | None = None):
        self.kind = kind
        self._entries = dict(entries)
        self._group = plugins  # the entry-point group of this kind's plug-ins, e.g. "tfkv.stores"
        self._reserved = {name.lower() for name in entries}  # what a plug-in may not call itself
        self._from_plugin: dict[str, Any] = {}  # name -> its entry point

    def register(self, name: str, target: str) -> None:
        """Add or replace `name`; `target` is "package.module:attribute"."""
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def reserve(self, *names: str) -> None:
        """Names a plug-in may not take (other spellings of tfkv's own)."""
        self._reserved.update(n.lower() for n in names)

    def plugins(self) -> dict[str, Any]:
        """The names that plug-ins added, each with its entry point."""
        self._load_plugins()
        return dict(self._from_plugin)

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        if name not in self._entries:
            self._load_plugins()
        return name in self._entries

    def get(self, name: str) -> Any:
        """Import and return what `name` stands for; KeyError lists the known names."""
        if name not in self:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        module, attr = self._entries[name].split(":")
        if name not in self._from_plugin:
            return functools.reduce(getattr, attr.split("."), importlib.import_module(module))
        from tfkv import plugins

        return plugins.resolve(self._from_plugin[name], f"{self.kind} {name!r}")

    def _load_plugins(self) -> None:
        if self._group is None:
            return
        group, self._group = self._group, None  # once per process
        from tfkv import plugins

        for ep in plugins.entry_points(group):
            if ep.name.lower() in self._reserved or ep.name in self._entries:
                plugins.warn(ep, f"{ep.name!r} is tfkv's own {self.kind}; tfkv's is used, the plug-in is ignored")
                continue
            self._entries[ep.name] = f"{ep.module}:{ep.attr}"
            self._from_plugin[ep.name] = ep
