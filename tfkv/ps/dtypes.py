"""The dtypes a KVStore key holds: float32, or half precision (float16, bfloat16), as MXNet's stores.

A key's dtype is fixed when it is initialised: a half-precision value makes a half key, anything
else a float32 key (as before: ints and float64 are cast). Half keys are strict: a push, pull or
init value of another dtype mixed with a half one is refused with one line naming the key and
both dtypes (a cast done silently would double the bytes moved, or drop precision unseen).
Pulling into an `out` of another dtype casts, as MXNet's CopyFromTo does. bfloat16 is
`ml_dtypes.bfloat16`, TensorFlow's own numpy type for it. No TensorFlow here.
"""

from __future__ import annotations

from typing import Any, Hashable

import ml_dtypes
import numpy as np

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HALF = (FLOAT16, BFLOAT16)


def of(value: Any) -> np.dtype:
    """The numpy dtype of a numpy array, a tf.Tensor or tf.Variable (its as_numpy_dtype), or
    anything numpy makes an array of."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return np.asarray(value).dtype
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))


def is_half(dtype: Any) -> bool:
    """float16 or bfloat16 (numpy or TensorFlow dtype)."""
    return np.dtype(getattr(dtype, "as_numpy_dtype", dtype)) in HALF


def any_half(values: Any) -> bool:
    """Whether any of `values` is half precision; a float32 numpy array is passed over at the
    cost of an identity check (a dist_* push checks every value it sends)."""
    for v in values:
        dtype = getattr(v, "dtype", None)
        if dtype is not FLOAT32 and dtype is not None and is_half(dtype):
            return True
    return False


def key_dtype(value: Any) -> np.dtype:
    """The dtype a key initialised with `value` holds: its own if half, else float32."""
    dtype = of(value)
    return dtype if dtype in HALF else FLOAT32


def check(key: Hashable, held: np.dtype, value: Any, what: str = "push") -> None:
    """Refuse a value of another dtype than the half key `held` names (or a half value for a
    float32 key): ValueError, one line."""
    got = of(value)
    if got != held and (held in HALF or got in HALF):
        raise ValueError(f"{what} of key {key!r}: a {got.name} value for a {held.name} key (a key's dtype is fixed "
                         f"at init); cast it first, e.g. value.astype({held.name!r}) or tf.cast(value, {held.name!r})")
