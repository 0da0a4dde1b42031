"""Per-epoch checkpoints in a run directory, and finding the one a `resume` means.

A checkpoint is a directory `checkpoints/epoch-NNNN/` holding `weights.npz` (every variable of
the model, in order), `optimizer.npz` (the optimizer state, wherever it ran) and `state.json`
(epoch, variable names, the metrics history). It is written under a temporary name and renamed,
so a crash while saving never leaves a half checkpoint that resume would pick.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from tfkv.errors import ConfigError

CHECKPOINTS = "checkpoints"


@dataclass
class Checkpoint:
    path: Path
    epoch: int
    weights: list[np.ndarray]
    weight_names: list[str]
    optimizer: dict[str, np.ndarray]
    history: list[dict[str, Any]]


def save(run_dir: Path, epoch: int, weights: Sequence[np.ndarray], weight_names: Sequence[str],
         write_optimizer: Callable[[str], None], history: list[dict[str, Any]]) -> Path:
    """Write checkpoint `epoch`; `write_optimizer(path)` writes the optimizer npz there."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"epoch-{epoch:04d}"
    tmp = root / f".epoch-{epoch:04d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    np.savez(tmp / "weights.npz", **{f"w{i:04d}": w for i, w in enumerate(weights)})
    write_optimizer(str(tmp / "optimizer.npz"))
    (tmp / "state.json").write_text(json.dumps(
        {"epoch": epoch, "weight_names": list(weight_names), "history": history}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / CHECKPOINTS).glob("epoch-[0-9][0-9][0-9][0-9]"))
    return found[-1] if found else None


def load(path: Path) -> Checkpoint:
    path = Path(path)
    try:
        state = json.loads((path / "state.json").read_text())
        with np.load(path / "weights.npz", allow_pickle=False) as f:
            weights = [f[f"w{i:04d}"] for i in range(len(f.files))]
        with np.load(path / "optimizer.npz", allow_pickle=False) as f:
            optimizer = {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"resume: checkpoint {path} is unreadable ({e}); "
                          "pick an earlier one with resume=<run dir>") from None
    return Checkpoint(path, int(state["epoch"]), weights, state["weight_names"], optimizer,
                      state.get("history", []))


def _same_command(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("resume=", "hydra.")))


def find_resume(resume: Any, run_dir: Path, search_root: Path, overrides: list[str]) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    `resume=true`: the newest checkpoint of an earlier run of the same command (same overrides,
    `resume` aside) under `search_root`'s outputs/ and multirun/. `resume=<dir>`: that run
    directory's newest checkpoint, or that checkpoint directory itself.
    """
    if resume is False or str(resume).lower() in ("false", "0", "no", ""):
        return None
    if resume is True or str(resume).lower() in ("true", "1", "yes"):
        wanted = _same_command(overrides)
        candidates = []
        for hydra_dir in [*search_root.glob("outputs/*/*/.hydra"), *search_root.glob("multirun/*/*/*/.hydra")]:
            run = hydra_dir.parent
            if run.resolve() == Path(run_dir).resolve():
                continue
            ckpt = latest(run)
            if ckpt is None:
                continue
            try:
                theirs = yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or []
            except (OSError, yaml.YAMLError):
                continue
            if _same_command(theirs) == wanted:
                candidates.append(ckpt)
        return max(candidates, key=lambda p: p.stat().st_mtime) if candidates else None
    path = Path(str(resume)).expanduser()
    if (path / "state.json").is_file():
        return path
    ckpt = latest(path)
    if ckpt is None:
        raise ConfigError(f"resume={resume}: no checkpoint found in {path} (expected "
                          f"{CHECKPOINTS}/epoch-NNNN/ inside a run directory)")
    return ckpt
