"""Unpickle data files (CIFAR batches) without letting them run code.

A pickle can name any importable callable and call it while loading (`os.system` included), so
plain `pickle.load` on a downloaded file is remote code execution. This unpickler resolves only
the handful of globals that numpy arrays, bytes and plain containers need, and refuses the rest.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, BinaryIO, Callable

import numpy as np


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Python 3 writes bytes into protocol-2 pickles as `_codecs.encode(str, "latin1")`; allow
    # exactly that call rather than the whole codec machinery.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"refusing _codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


def _numpy_global(module: str, name: str) -> Callable[..., Any]:
    # Return the real object ourselves: importing the legacy `numpy.core` path warns on numpy 2.
    core = getattr(np, "_core", None) or np.core
    return getattr(getattr(core, module), name)


_ALLOWED: dict[tuple[str, str], Callable[[], Any]] = {
    ("_codecs", "encode"): lambda: _latin1_encode,
    ("numpy", "ndarray"): lambda: np.ndarray,
    ("numpy", "dtype"): lambda: np.dtype,
}
for _prefix in ("numpy.core", "numpy._core"):
    _ALLOWED[(f"{_prefix}.multiarray", "_reconstruct")] = (
        lambda: _numpy_global("multiarray", "_reconstruct"))
    # protocol >= 5 writes arrays through `_frombuffer` instead of `_reconstruct`
    _ALLOWED[(f"{_prefix}.numeric", "_frombuffer")] = lambda: _numpy_global("numeric", "_frombuffer")
for _module in ("builtins", "__builtin__"):  # py2 pickles name the builtins module `__builtin__`
    for _name, _obj in (("dict", dict), ("list", list), ("tuple", tuple), ("bytes", bytes),
                        ("bytearray", bytearray), ("str", str), ("int", int), ("float", float),
                        ("set", set), ("frozenset", frozenset)):
        _ALLOWED[(_module, _name)] = (lambda o=_obj: o)


class SafeUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the globals in `_ALLOWED`."""

    def find_class(self, module: str, name: str) -> Any:
        factory = _ALLOWED.get((module, name))
        if factory is None:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: only numpy arrays and plain "
                "containers are allowed in a data file"
            )
        return factory()


def load(file: BinaryIO, encoding: str = "bytes") -> Any:
    """Like `pickle.load`, restricted; `encoding="bytes"` keeps py2 strings as bytes (CIFAR keys)."""
    return SafeUnpickler(file, encoding=encoding).load()


def loads(data: bytes, encoding: str = "bytes") -> Any:
    return load(io.BytesIO(data), encoding=encoding)
