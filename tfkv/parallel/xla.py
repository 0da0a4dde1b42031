"""XLA's refusal to compile a training step (jit_compile=true), as one line naming the op."""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import tensorflow as tf

from tfkv.errors import ConfigError


@contextlib.contextmanager
def xla_refusal() -> Iterator[None]:
    """XLA's refusal to compile the step (an op it has no kernel for) as one line naming the op."""
    try:
        yield
    except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError) as e:
        text = str(e)
        if "XLA" not in text:
            raise
        ops = re.findall(r"(\w+) \(No registered '\w+' OpKernel for XLA", text)
        what = f"op {', '.join(dict.fromkeys(ops))}" if ops else text.strip().splitlines()[0][:200]
        raise ConfigError(f"jit_compile=true: XLA cannot compile this model's step ({what}); "
                          "set jit_compile=false") from None
