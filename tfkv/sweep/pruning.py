"""(being written this session)"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def build(cfg: Any, run_dir: Path) -> None:
    return None
