"""What the trackers know of the Hydra job a run belongs to: its overrides (what a sweep varies)
and the directory tfkv-run started in, alike in tfkv-run's own process and in a launched
worker 0 (`python -m tfkv.worker`), which runs without Hydra in the same run directory."""

from __future__ import annotations

import os
from pathlib import Path


def overrides(run_dir: Path) -> list[str]:
    """The job's task overrides (`optimizer.lr=0.1`, `model=lenet`): Hydra's record in the run
    directory (.hydra/overrides.yaml, which a worker finds too), else the live Hydra job's."""
    from omegaconf import OmegaConf

    recorded = Path(run_dir) / ".hydra" / "overrides.yaml"
    if recorded.is_file():
        return [str(o) for o in OmegaConf.load(recorded)]
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def split(override: str) -> tuple[str, str] | None:
    """`+key=value` -> (key, value); None for a deletion (`~key`) or one of Hydra's own settings."""
    key, sep, value = override.partition("=")
    key = key.lstrip("+")
    if not sep or key.startswith(("~", "hydra.", "hydra/")):
        return None
    return key, value


def start_dir() -> Path:
    """Where tfkv-run started: Hydra's runtime cwd, or this process's working directory (a
    launched worker starts in the launcher's directory or its synced copy)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path(os.getcwd())
