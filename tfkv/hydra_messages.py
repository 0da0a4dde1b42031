"""Hydra's and OmegaConf's errors as one line with a hint (the nearest name, the option's keys,
the plug-in to install): the cli layer's part of one-line errors (tfkv.errors has the rest),
shared by tfkv-run and its sweeps' checks. The option's keys are tfkv.check's answer, from the
config tfkv.config.tree composes.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from typing import Any


def one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, folded into one line with a hint."""
    from hydra.errors import MissingConfigException, OverrideParseException

    parts = []
    for e in (exc, exc.__cause__):
        if e is not None and str(e).strip():
            parts.append(str(e).strip().splitlines()[0].rstrip("."))
    text = ": ".join(dict.fromkeys(parts))
    plugin = _plugin_package(str(getattr(exc, "missing_cfg_file", "") or ""))
    if isinstance(exc, MissingConfigException) and plugin:
        # hydra/launcher=ray: a Hydra plug-in that is not installed
        extra = _extra_with(plugin)
        # tfkv's extra pins what the plug-in needs with tfkv (optuna 2's SQLite storage: SQLAlchemy<2)
        also = f"pip install 'tfkv[{extra}]', which has it with the versions tfkv is tested with, or " if extra else ""
        return f"{text}: it is a Hydra plug-in that is not installed; {also}pip install {plugin}"
    if isinstance(exc, MissingConfigException) and exc.options:
        # `model=resnet19`: Hydra's list of what there is, and the nearest name
        group, _, wanted = str(exc.missing_cfg_file).rpartition("/")
        mxnet = _mxnet_store(wanted) if group.endswith("kvstore") else None
        if mxnet:  # kvstore=nccl: the type to use, as tfkv.store.create says it
            return f"{text}; {mxnet}; see tfkv-run --help"
        text += f"; available: {', '.join(exc.options)}"
        close = difflib.get_close_matches(wanted, exc.options, n=1)
        if close:
            text += f" (did you mean {close[0]!r}?)"
    elif "No match in the defaults list" in str(exc):
        # `experiment=x`: a group that is not in the defaults is added with +, as Hydra's second line says
        m = re.search(r"use (\+\S+)", str(exc))
        if m:
            text += f"; to add it, write {m.group(1)}"
    elif "is not a ListConfig" in str(exc.__cause__):  # devices=cpu:0
        text += "; write a list in brackets, e.g. devices=[cpu:0]"
    elif re.search(r"is not in struct|not in '\w+'", str(exc.__cause__)) and _option_keys(str(exc)):
        # (not in 'AdamConfig': the option's schema, conf/optimizer/adam.yaml's defaults)
        # optimizer=adam optimizer.momentum=0.9: the key belongs to another option of the group
        text += f"; {_option_keys(str(exc))}"
        return text
    elif isinstance(exc, OverrideParseException):
        text += ("; write lists as key=[a,b] and quote a value holding spaces or special characters "
                 "for both the shell and Hydra, e.g. 'key=\"a value\"'")
    cause = exc.__cause__ or exc
    key, schema = getattr(cause, "key", None), getattr(cause, "object_type", None)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    if key is not None and str(key) not in known:  # a known key with a bad value needs no spelling hint
        close = difflib.get_close_matches(str(key), known, n=1)
        if close:
            text += f" (did you mean {close[0]!r}?)"
    return text + "; see tfkv-run --help"


def _mxnet_store(name: str) -> str | None:
    """For a KVStore type MXNet has and tfkv has not as an option (nccl, horovod, local_update_cpu):
    which one to use (tfkv.store's tables, as its canonical() says for the Python API); None for any other name."""
    from tfkv import store

    key = name.strip().lower()
    if key in store.INSTEAD:
        return f"{name} is MXNet's KVStore type, not tfkv's; write kvstore={store.INSTEAD[key]}"
    return f"{name} is MXNet's name for {store.ALIASES[key]}; write kvstore={store.ALIASES[key]}" \
        if key in store.ALIASES else None


# Hydra's launcher and sweeper plug-ins on PyPI, by the option name each registers.
HYDRA_PLUGINS = {
    "hydra/launcher": {"joblib": "hydra-joblib-launcher", "ray": "hydra-ray-launcher",
                       "ray_aws": "hydra-ray-launcher", "rq": "hydra-rq-launcher",
                       "submitit_local": "hydra-submitit-launcher", "submitit_slurm": "hydra-submitit-launcher"},
    "hydra/sweeper": {"ax": "hydra-ax-sweeper", "optuna": "hydra-optuna-sweeper", "nevergrad": "hydra-nevergrad-sweeper"},
}


def _extra_with(package: str) -> str | None:
    """The extra of the installed tfkv that requires `package` (`sweep`), from tfkv's metadata."""
    from importlib import metadata

    try:
        requires = metadata.requires("tfkv") or []
    except metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.match(r"([A-Za-z0-9_.\-]+).*;\s*extra\s*==\s*[\"']([\w-]+)[\"']", req)
        if m and m.group(1).lower() == package.lower():
            return m.group(2)
    return None


def _plugin_package(missing: str) -> str | None:
    """The pip package of a missing `hydra/launcher/<name>` or `hydra/sweeper/<name>`, if known."""
    group, _, name = missing.rpartition("/")
    return HYDRA_PLUGINS.get(group, {}).get(name)


def _option_keys(message: str) -> str | None:
    """For `Could not override 'G.K'` where G is an option group: the keys the chosen option has,
    read from the config composed without the overrides of G's keys."""
    m = re.search(r"override '(\w+)\.([\w.]+)'", message)
    if not m or m.group(1) not in ("optimizer", "cluster", "model", "dataset", "kvstore"):
        return None
    group = m.group(1)
    try:
        from tfkv import check
        from tfkv.config import tree

        args = [a for a in sys.argv[1:] if "=" in a and not a.startswith("-")
                and not a.lstrip("+~").startswith(f"{group}.")]
        dirs = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config-dir=")]
        node = tree.compose(args, dirs)[group]
        option, keys = check.option_settings(group, node)
        key, *inner = m.group(2).split(".")
        if inner and key in keys:  # kvstore.compression.typ: a setting of the option's setting
            return _inner_keys(f"{group}.{key}", node[key], inner)
        owner = tree.option_with(group, key)
    except Exception:  # noqa: BLE001 - only a better message; the plain one stands without it
        return None
    close = difflib.get_close_matches(key, keys, n=1)
    if owner is not None:  # model.path=my.keras: a setting of model=saved
        mean = f"{group}.{key} is a setting of {group}={owner}: write {group}={owner} {group}.{key}=...; "
    else:
        mean = f"did you mean {group}.{close[0]}? " if close else ""
    return f"{mean}{group} {option} has the settings: {', '.join(keys)}"


def _inner_keys(where: str, node: Any, path: list[str]) -> str | None:
    """For `G.K.x.y` where G.K is a node of the option (kvstore.compression): the nearest key of
    the node that holds `y`, and that node's keys (not the option's, where no name is near)."""
    from omegaconf import DictConfig

    for part in path[:-1]:
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node, where = node[part], f"{where}.{part}"
    if not isinstance(node, DictConfig):
        return None
    keys = [str(k) for k in node.keys()]
    close = difflib.get_close_matches(path[-1], keys, n=1)
    mean = f"did you mean {where}.{close[0]}? " if close else ""
    return f"{mean}{where} has the settings: {', '.join(keys)}"
