"""Config nodes that name a callable by `_target_` (Hydra's instantiate conventions): import it,
check the node's keys against its signature, and call it with what tfkv provides.

A model builder or data factory may ask for values tfkv knows (`input_shape`, `num_classes`,
`split`, `rank`, ...) by taking a parameter of that name; the node's other keys are its keyword
arguments. Everything that can go wrong before the call (the import, an unknown or a missing
argument) is a one-line `ConfigError` that names the config key and the fix.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Iterable, Mapping

from tfkv.errors import ConfigError
from tfkv.tfimport import quietly

# Hydra's own keys in an instantiable node: never arguments of the callable.
HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})


def locate(path: str, key: str) -> Callable[..., Any]:
    """The callable `path` ("pkg.module.name" or "pkg.module:name") names; `key` is the config key."""
    text = str(path).strip()
    module_name, sep, attr = text.partition(":")
    if not sep:
        module_name, _, attr = text.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{key}={text!r} does not name a callable; write package.module.function")
    try:
        module = quietly(module_name)  # TensorFlow's load-time lines, should it load it, as tfkv-run's own
    except ImportError as e:
        # e.name: the module that is missing, which may be one the target's module imports
        missing = getattr(e, "name", None) or module_name
        where = "" if missing == module_name else f" (it imports {missing!r}, which is missing)"
        raise ConfigError(f"{key}={text!r}: cannot import {module_name!r}{where}; run from the directory "
                          f"that holds the package, or install it (pip install -e .)") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ConfigError(f"{key}={text!r}: importing {module_name!r} failed: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" (did you mean {module_name}.{close[0]}?)" if close else ""
        raise ConfigError(f"{key}={text!r}: module {module_name!r} has no {attr!r}{hint}") from None
    if not callable(obj):
        raise ConfigError(f"{key}={text!r} is a {type(obj).__name__}, not a callable")
    return obj


def parameters(fn: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool]:
    """The named parameters of `fn` (a class: of its __init__), and whether it takes **kwargs."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: accept what is given
        return {}, True
    named = {n: p for n, p in sig.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` declares a parameter `name` (a factory asking for a value tfkv provides)."""
    named, _ = parameters(fn)
    return name in named


def check(node: Mapping[str, Any], key: str, provided: Iterable[str] = (),
          extra_keys: Iterable[str] = ()) -> Callable[..., Any]:
    """Import `node._target_` and check that every other key is an argument it takes, and that
    every argument without a default is given (by the node or by tfkv: `provided`).
    `extra_keys` are keys tfkv itself reads from the node. Returns the callable."""
    target = node.get("_target_")
    if target is None:
        raise ConfigError(f"{key} needs _target_: the callable that builds it, e.g. {key}._target_=mypkg.module.build")
    fn = locate(target, f"{key}._target_")
    named, var_kw = parameters(fn)
    provided, extra = set(provided), set(extra_keys)
    given = [str(k) for k in node.keys() if k not in HYDRA_KEYS and k not in extra]
    clash = [k for k in given if k in provided]
    if clash:
        raise ConfigError(f"{key}.{clash[0]} is provided by tfkv (it is one of {', '.join(sorted(provided))}); "
                          f"remove it from {key}")
    unknown = [k for k in given if k not in named]
    if unknown and not var_kw:
        valid = sorted(n for n in named if n not in provided)
        close = difflib.get_close_matches(unknown[0], valid, n=1)
        hint = f"did you mean {key}.{close[0]}? " if close else ""
        raise ConfigError(f"{key}.{unknown[0]} is not an argument of {target}; {hint}"
                          f"its arguments: {', '.join(valid) or '(none)'}")
    if not node.get("_partial_", False):
        missing = [n for n, p in named.items() if p.default is p.empty and n not in given and n not in provided
                   and not (p.kind is p.POSITIONAL_OR_KEYWORD and n == "self")]
        if missing:
            raise ConfigError(f"{key}: {target} needs {missing[0]}; set {key}.{missing[0]}=...")
    return fn


def call(node: Mapping[str, Any], key: str, provided: Mapping[str, Any] | None = None,
         extra_keys: Iterable[str] = ()) -> Any:
    """Call `node._target_` (Hydra's instantiate: nested `_target_`s and `_partial_` work) with the
    node's arguments plus those of `provided` that the callable declares."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    provided = dict(provided or {})
    fn = check(node, key, provided, extra_keys)
    named, _ = parameters(fn)
    wanted = {k: v for k, v in provided.items() if k in named}  # passed as they are, never through OmegaConf
    extra = set(extra_keys)
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    body = {k: v for k, v in dict(node).items() if k not in extra}
    partial = bool(body.get("_partial_", False))
    bound = instantiate({**body, "_partial_": True})  # the node's own arguments, nested _target_s built
    return functools.partial(bound, **wanted) if partial else bound(**wanted)
