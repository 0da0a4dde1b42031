"""Per-epoch checkpoints in a run directory, and finding the one a `resume` means.

A checkpoint is a directory `checkpoints/epoch-NNNN/` holding `weights.npz` (every variable of
the model, in order), `optimizer.npz` (the optimizer state, wherever it ran) and `state.json`
(epoch, variable names, the metrics history). It is written under a temporary name, every file
fsynced, and renamed: a crash or a full disk while saving never leaves a half checkpoint that
resume would pick, and a failed save removes its temporary directory. Reading one checks every
file and names the damaged one in a single line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import yaml

from tfkv.errors import ConfigError, OutputError

CHECKPOINTS = "checkpoints"

log = logging.getLogger("tfkv")


@dataclass
class Checkpoint:
    path: Path
    epoch: int
    weights: list[np.ndarray]
    weight_names: list[str]
    optimizer: dict[str, np.ndarray]
    history: list[dict[str, Any]]


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk; a rename is durable only after."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: Path, epoch: int, weights: Sequence[np.ndarray], weight_names: Sequence[str],
         write_optimizer: Callable[[str], None], history: list[dict[str, Any]]) -> Path:
    """Write checkpoint `epoch`; `write_optimizer(path)` writes the optimizer npz there."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"epoch-{epoch:04d}"
    tmp = root / f".epoch-{epoch:04d}.tmp"
    for stale in root.glob(".epoch-*.tmp"):  # left by a process killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        np.savez(tmp / "weights.npz", **{f"w{i:04d}": w for i, w in enumerate(weights)})
        write_optimizer(str(tmp / "optimizer.npz"))
        (tmp / "state.json").write_text(json.dumps(
            {"epoch": epoch, "weight_names": list(weight_names), "history": history}, indent=1))
        for name in ("weights.npz", "optimizer.npz", "state.json"):
            _fsync(tmp / name)
        _fsync(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only fills the disk
        if isinstance(e, OSError):
            raise OutputError(f"checkpoint of epoch {epoch}: cannot write {e.filename or tmp} "
                                       f"({e.strerror or e}); free space there or pick another "
                                       "hydra.run.dir") from None
        raise
    return final


def latest(run_dir: Path) -> Path | None:
    found = _epochs(Path(run_dir) / CHECKPOINTS)
    return found[-1] if found else None


def _epochs(root: Path) -> list[Path]:
    return sorted(root.glob("epoch-[0-9][0-9][0-9][0-9]"))


def _damaged(file: Path, what: str) -> ConfigError:
    """One line: the file, what is wrong with it, and the checkpoint to use instead."""
    earlier = [p for p in _epochs(file.parent.parent) if p.name < file.parent.name]
    fix = (f"resume from the one before it (resume={earlier[-1]}) or start afresh (resume=false)" if earlier
           else "start afresh (resume=false)")
    return ConfigError(f"resume: checkpoint file {file} {what}; {fix}")


def _npz(file: Path) -> dict[str, np.ndarray]:
    """Every array of an npz file, read in full (so a bad CRC anywhere shows here)."""
    try:
        if file.stat().st_size == 0:
            raise _damaged(file, "is empty (0 bytes)")
        with np.load(file, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except FileNotFoundError:
        raise _damaged(file, "is missing") from None
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        # numpy and zipfile describe truncation and flipped bytes in their own words
        raise _damaged(file, f"is damaged or not an npz file ({type(e).__name__}: {e})") from None


def _state(file: Path) -> dict[str, Any]:
    try:
        state = json.loads(file.read_text())
    except FileNotFoundError:
        raise _damaged(file, "is missing") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _damaged(file, f"is not readable JSON ({e})") from None
    if not isinstance(state, dict):
        raise _damaged(file, "does not hold a JSON object")
    epoch = state.get("epoch")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise _damaged(file, f"has no valid 'epoch' (found {epoch!r}; expected a whole number >= 0)")
    names = state.get("weight_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _damaged(file, "has no valid 'weight_names' (expected a list of variable names)")
    if not isinstance(state.get("history", []), list):
        raise _damaged(file, "has a 'history' that is not a list")
    return state


def load(path: Path) -> Checkpoint:
    """Read checkpoint `path`; a missing or damaged file is a ConfigError that names it."""
    path = Path(path)
    state = _state(path / "state.json")
    arrays = _npz(path / "weights.npz")
    wanted = [f"w{i:04d}" for i in range(len(state["weight_names"]))]
    if set(arrays) != set(wanted):  # sets: names past w9999 are not in text order
        raise _damaged(path / "weights.npz", f"holds {len(arrays)} arrays where state.json names "
                                             f"{len(wanted)} variables")
    optimizer = _npz(path / "optimizer.npz")
    return Checkpoint(path, state["epoch"], [arrays[k] for k in wanted], state["weight_names"], optimizer,
                      state.get("history", []))


# What `resume` may say besides a run directory (YAML 1.1's words, as a user types them)
NO = ("false", "0", "no", "off", "")
YES = ("true", "1", "yes", "on")


def _same_command(overrides: list[str]) -> list[str]:
    """The overrides that make two commands the same run: `eval_only=true resume=true` evaluates
    the last checkpoint of the command it is added to."""
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("resume=", "eval_only=", "hydra.")))


def find_resume(resume: Any, run_dir: Path, search_root: Path, overrides: list[str]) -> Path | None:
    """The checkpoint to continue from, or None to start fresh.

    `resume=true`: the newest checkpoint of an earlier run of the same command (same overrides,
    `resume` aside) under `search_root`'s outputs/ and multirun/. `resume=<dir>`: that run
    directory's newest checkpoint, or that checkpoint directory itself.
    """
    words = str(resume).lower()
    if resume is False or words in NO:
        return None
    if resume is True or words in YES:
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
        if not candidates:
            log.warning("resume: no earlier checkpoint of this command found; starting from scratch")
            return None
        return max(candidates, key=lambda p: p.stat().st_mtime)
    path = Path(str(resume)).expanduser()
    if (path / "state.json").is_file():
        return path
    ckpt = latest(path)
    if ckpt is None:
        raise ConfigError(f"resume={resume}: no checkpoint found in {path} (expected "
                          f"{CHECKPOINTS}/epoch-NNNN/ inside a run directory)")
    return ckpt
