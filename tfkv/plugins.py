"""Plug-ins from other packages: KVStore types, launchers, models and data sets that an installed
distribution declares under the entry-point groups `tfkv.stores`, `tfkv.launchers`,
`tfkv.models` and `tfkv.datasets`.

A store or launcher plug-in joins its registry (`tfkv.store.REGISTRY`, `tfkv.launcher.base.REGISTRY`),
which reads the entry points the first time a name is not its own (tfkv.registry: the base-level
discovery, so the registries import nothing above them); a store class is imported when it is
created. This module is the cli layer's part: the plug-ins as Hydra config options. `load()` makes every plug-in a config option of its Hydra group: `kvstore=<name>`;
`cluster=<name>`, typed by the settings schema the launcher class declares (`config`); and
`model=<name>` / `dataset=<name>` whose node is the callable's `_target_` with its keyword
defaults that are plain config values, so `model=<name> model.width=8` works as it does for
tfkv's own options. Those defaults are read from the module's source, not by running it, so
listing plug-ins never imports TensorFlow (a callable that is not a plain `def` or class in its
module is imported to read its signature).

A broken plug-in (a module that cannot be found or read, a name tfkv or another plug-in already
has) is one warning naming its package and entry point, and the other configs still run; tfkv's
own names always win. A plug-in store or launcher whose module fails to import is one ConfigError
line when it is chosen.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
from pathlib import Path
from typing import Any

from tfkv.errors import ConfigError
from tfkv.registry import entry_points, foreign_error, resolve, warn


# Hydra config group -> the entry-point group its plug-ins are declared in.
GROUPS = {"kvstore": "tfkv.stores", "cluster": "tfkv.launchers", "model": "tfkv.models",
          "dataset": "tfkv.datasets"}

_loaded = False


def load() -> None:
    """Register every plug-in as a config option in Hydra's ConfigStore (call before Hydra
    composes; once per process is enough)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from hydra.core.config_store import ConfigStore

    from tfkv.launcher.base import REGISTRY as LAUNCHERS
    from tfkv.store import REGISTRY as STORES

    options: dict[str, list[tuple[importlib.metadata.EntryPoint, Any]]] = {
        "kvstore": [(ep, {"type": name}) for name, ep in STORES.plugins().items()],
        "cluster": [(ep, node) for name, ep in LAUNCHERS.plugins().items()
                    if (node := _cluster_node(ep, name)) is not None],
    }
    for group in ("model", "dataset"):
        options[group] = [(ep, node) for ep in entry_points(GROUPS[group])
                          if (node := _target_node(ep, _provided(group))) is not None]
    store = ConfigStore.instance()
    for group, found in options.items():
        own = _own_options(group)
        for ep, node in found:
            if ep.name in own:
                warn(ep, f"{group}={ep.name} is tfkv's own option; tfkv's is used, the plug-in is ignored")
            else:
                store.store(group=group, name=ep.name, node=node)


def register_schemas() -> None:
    """tfkv's launchers' settings as `schema/cluster/<name>` in Hydra's ConfigStore, which
    conf/cluster/<name>.yaml extends: the schema each backend's class declares (`config`, in its
    module), read through the launcher registry as a plug-in's is (`_cluster_node`). Called when
    Hydra scans its plug-ins (hydra_plugins/tfkv_launchers), before any config is composed."""
    from hydra.core.config_store import ConfigStore

    from tfkv.launcher import base

    store = ConfigStore.instance()
    for name in base.REGISTRY.own():
        store.store(group="schema/cluster", name=name, node=base.settings(name))


def _cluster_node(ep: importlib.metadata.EntryPoint, name: str) -> Any:
    """A plug-in launcher's option: the settings schema its class declares (`config`, else every
    launcher's), typed as tfkv's own options are, so each of its settings is overridden without
    `+` and any other key is refused. The class is imported for it: launchers are light."""
    from omegaconf import OmegaConf

    from tfkv.launcher.base import settings

    try:
        node = OmegaConf.structured(settings(name))
        node.launcher = name
    except ConfigError as e:  # the plug-in's module fails to import
        warn(ep, f"{e}; the plug-in is ignored")
        return None
    except Exception as e:  # a `config` that is no schema with a `launcher` setting
        warn(ep, f"its config schema does not work ({foreign_error(e)}): make it a dataclass derived from "
                 "tfkv.config.ClusterConfig; the plug-in is ignored")
        return None
    return node


def _provided(group: str) -> set[str]:
    """The parameters tfkv itself passes to a model builder or a data factory: not config keys."""
    if group == "model":
        from tfkv.models import PROVIDED
    else:
        from tfkv.data.source import PROVIDED
    return set(PROVIDED)


def _own_options(group: str) -> set[str]:
    """tfkv's own options of a config group (its conf/<group>/*.yaml)."""
    from tfkv import conf_dir

    return {p.stem for p in Path(conf_dir(), group).glob("*.yaml")}


def _target_node(ep: importlib.metadata.EntryPoint, injected: set[str]) -> dict[str, Any] | None:
    """`{_target_: module.attr, <keyword defaults>}` for a model or data set plug-in, or None
    (with a warning) when its callable cannot be found or read."""
    try:
        defaults = _defaults_from_source(ep.module, ep.attr)
        if defaults is None:  # not a plain def or class in its module: ask the object itself
            defaults = _defaults_from_object(resolve(ep, f"{ep.group} {ep.name!r}"))
    except ConfigError as e:
        warn(ep, f"{e}; the plug-in is ignored")
        return None
    except Exception as e:  # a missing module, unreadable source: the plug-in's problem
        warn(ep, f"cannot read its parameters ({foreign_error(e)}); the plug-in is ignored")
        return None
    return {"_target_": f"{ep.module}.{ep.attr}",
            **{k: v for k, v in defaults.items() if k not in injected}}


def _defaults_from_source(module: str, attr: str) -> dict[str, Any] | None:
    """The keyword defaults of top-level `def attr` (or `class attr`'s `__init__`) in `module`'s
    source, read without running the module; None when the source does not show them plainly."""
    spec = importlib.util.find_spec(module)  # imports the parent packages, not the module itself
    if spec is None:
        raise ModuleNotFoundError(f"no module named {module!r}")
    if "." in attr or not spec.origin or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_bytes(), spec.origin)
    found: ast.AST | None = None
    for stmt in tree.body:  # the last top-level binding of the name is the one the module exports
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if stmt.name == attr:  # names bound inside another definition are its own
                found = stmt
        elif attr in _binds(stmt):
            found = None
    if isinstance(found, ast.ClassDef) and not found.decorator_list:
        init = next((s for s in found.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
        if init is None:  # the class inherits its __init__
            return None
        found, not_keywords = init, init.args.posonlyargs + (init.args.posonlyargs + init.args.args)[:1]  # self
    elif isinstance(found, ast.FunctionDef):
        not_keywords = found.args.posonlyargs
    if not isinstance(found, ast.FunctionDef) or found.decorator_list:  # a decorator may change the signature
        return None
    args = found.args
    positional = args.posonlyargs + args.args
    named = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
    named += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    out = {}
    for arg, default in named:
        if any(arg is a for a in not_keywords):
            continue
        try:
            value = _plain(ast.literal_eval(default))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue  # not a literal: not a plain config value
        if value is not _NOT_PLAIN:
            out[arg.arg] = value
    return out


def _binds(stmt: ast.stmt) -> set[str]:
    """Every name a top-level statement may bind (assignments, imports, definitions inside it)."""
    names = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _defaults_from_object(obj: Any) -> dict[str, Any]:
    out = {}
    for p in inspect.signature(obj).parameters.values():
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty:
            value = _plain(p.default)
            if value is not _NOT_PLAIN:
                out[p.name] = value
    return out


_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """`value` as a config value (tuples as lists), or _NOT_PLAIN when it is none."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        items = {k: _plain(v) for k, v in value.items()}
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items.values()) else items
    return _NOT_PLAIN
