"""Name -> "module:attribute" registries whose entries are imported only when used.

Models, data sets and KVStore types plug in this way, so that listing or validating names
(the config layer, the launcher, the servers) never imports TensorFlow. A registry given an
entry-point group also holds what installed packages declare there: read from their metadata
(`entry_points`, nothing imported) the first time a name is not found or the names are listed;
tfkv's own names (and those `reserve`d) win over a plug-in's. A broken plug-in is one warning
(`warn`); making plug-ins Hydra config options is the cli layer's part (tfkv.plugins).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
from typing import Any

from tfkv.errors import ConfigError

log = logging.getLogger("tfkv")

# A config option's name: what Hydra's override grammar takes unquoted and a file name can hold.
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")

_warned: set[tuple[str, str, str]] = set()


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

    def own(self) -> list[str]:
        """tfkv's own names (and those registered at run time), in the order given; no plug-in is read."""
        return [n for n in self._entries if n not in self._from_plugin]

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
        return resolve(self._from_plugin[name], f"{self.kind} {name!r}")

    def _load_plugins(self) -> None:
        if self._group is None:
            return
        group, self._group = self._group, None  # once per process
        for ep in entry_points(group):
            if ep.name.lower() in self._reserved or ep.name in self._entries:
                warn(ep, f"{ep.name!r} is tfkv's own {self.kind}; tfkv's is used, the plug-in is ignored")
                continue
            self._entries[ep.name] = f"{ep.module}:{ep.attr}"
            self._from_plugin[ep.name] = ep


def where(ep: importlib.metadata.EntryPoint) -> str:
    """How a warning names a plug-in: its entry point and the package that declares it."""
    dist = ep.dist.name if ep.dist is not None else "an unknown package"
    return f"plug-in {ep.name} = {ep.value} ([{ep.group}] of package {dist})"


def warn(ep: importlib.metadata.EntryPoint, problem: str) -> None:
    """One warning line per plug-in and problem, however often it is met."""
    key = (ep.group, ep.name, problem)
    if key not in _warned:
        _warned.add(key)
        log.warning("tfkv: %s: %s", where(ep), problem)


@functools.cache
def entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """The usable entry points of `group` (packages' metadata only, nothing imported); a name
    two packages declare goes to the first, as importlib.metadata lists them."""
    chosen: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=group):
        if not _NAME.match(ep.name):
            warn(ep, "its name is not a config option name (letters, digits, _ and -); the plug-in is ignored")
        elif not ep.attr:
            warn(ep, "it names a module, not module:attribute; the plug-in is ignored")
        elif ep.name in chosen:
            other = chosen[ep.name].dist
            warn(ep, f"package {other.name if other else '?'} has a plug-in of that name too; "
                     "that one is used, this one is ignored")
        else:
            chosen[ep.name] = ep
    return tuple(chosen.values())


def resolve(ep: importlib.metadata.EntryPoint, what: str) -> Any:
    """Import what `ep` names; a failure is one ConfigError line naming the plug-in."""
    try:
        return ep.load()
    except Exception as e:  # anything the plug-in's import raises is the plug-in's, not tfkv's
        dist = ep.dist.name if ep.dist is not None else "its package"
        raise ConfigError(f"{what} comes from {where(ep)}, which fails to import: {foreign_error(e)}; "
                          f"fix or uninstall {dist}") from None


def foreign_error(e: BaseException) -> str:
    """An exception raised by someone else's code, as `Type: its first line`."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
