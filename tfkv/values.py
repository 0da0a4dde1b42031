"""Which numbers tfkv takes, from the wire or a config: one bound and two checks.

Base module: the optimizer settings (tfkv.optim) and the wire's metadata schema (tfkv.ps.schema)
both check numbers with these, so neither imports the other for them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

# Every integer a node takes, from the wire or a config, is below float64's exact range: JSON
# admits integers of thousands of digits, which overflow float() (math.isfinite(10**400) raises
# OverflowError), numpy and every count they reach. One bound, used by every
# check of tfkv.ps.schema and of tfkv.optim.
MAX_INT = 1 << 53


def is_number(value: Any) -> bool:
    """A finite real number (not a bool), an integer one below MAX_INT in magnitude."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    if isinstance(value, numbers.Integral):
        return is_integer(value)
    try:
        return math.isfinite(value)
    except ArithmeticError:  # a Fraction or Decimal beyond float's range
        return False


def is_integer(value: Any) -> bool:
    """An integer (not a bool) below MAX_INT in magnitude."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and -MAX_INT < value < MAX_INT
