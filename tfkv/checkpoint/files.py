"""The on-disk checkpoint: one directory per saved position, written atomically, read with checks.

`checkpoints/epoch-NNNN/` is saved at the end of epoch NNNN; `checkpoints/epoch-NNNN-step-SSSSSS/`
in the middle of epoch NNNN, after its step SSSSSS (`checkpoint.every_steps`/`every_minutes`).
Each holds `weights.npz` (every variable of the model, in order; a row-sparse table written by
row pieces pulled from the store, never whole on worker 0, and read back memory-mapped), `optimizer.npz` (the optimizer
state, wherever it ran: the parameter servers' too), `rng.npz` (the models' random-generator
states: dropout's masks go on where they stopped), `state.json` (the position: completed epochs
and steps into the next; the variable names, the metrics history, the resumes so far),
`config.yaml` (the resolved config) and `SHA256SUMS` (`sha256sum -c` format) over all of them.

It is written under a temporary name, every file fsynced, and renamed: a crash or a full disk
while saving never leaves a half checkpoint that resume would pick, and a failed save removes
its temporary directory. Reading one checks every file, then the checksums (which also catch a
change that leaves a file readable), and names the damaged one in a single line (`Damaged`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from tfkv.errors import ConfigError, OutputError, unwritable
from tfkv.store import npz

CHECKPOINTS = "checkpoints"
SUMS = "SHA256SUMS"
FORMAT = 2  # 1: per-epoch checkpoints without rng.npz, config.yaml and SHA256SUMS (still read)
_NAME = re.compile(r"^epoch-(\d{4,})(?:-step-(\d{6,}))?$")


@dataclass
class Checkpoint:
    path: Path
    epoch: int  # epochs completed
    weights: list[np.ndarray]
    weight_names: list[str]
    optimizer: dict[str, np.ndarray]
    history: list[dict[str, Any]]
    step: int = 0  # steps done of epoch `epoch + 1` (0: at an epoch's end)
    rng: dict[str, np.ndarray] = field(default_factory=dict)
    config: str | None = None  # the resolved config's YAML (format 2)
    resumes: list[dict[str, Any]] = field(default_factory=list)


class Damaged(ConfigError):
    """A checkpoint file that cannot be trusted; `file` and `what` say which and why."""

    def __init__(self, file: Path, what: str, fix: str) -> None:
        super().__init__(f"resume: checkpoint file {file} {what}; {fix}")
        self.file, self.what = file, what


def name(epoch: int, step: int = 0) -> str:
    """The directory of position (`epoch` completed, `step` steps into the next)."""
    return f"epoch-{epoch:04d}" if step == 0 else f"epoch-{epoch + 1:04d}-step-{step:06d}"


def position(path: Path) -> tuple[int, int] | None:
    """(epochs completed, steps into the next) that a checkpoint directory's name says; None for
    anything else."""
    m = _NAME.match(Path(path).name)
    if not m:
        return None
    return (int(m.group(1)), 0) if m.group(2) is None else (int(m.group(1)) - 1, int(m.group(2)))


def all_in(run_dir: Path) -> list[Path]:
    """Every published checkpoint of a run directory, oldest position first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [(position(p), p) for p in root.glob("epoch-*") if p.is_dir()] if root.is_dir() else []
    return [p for pos, p in sorted((pos, p) for pos, p in found if pos is not None)]


def latest(run_dir: Path) -> Path | None:
    found = all_in(run_dir)
    return found[-1] if found else None


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the disk; a rename is durable only after."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(file: Path) -> str:
    with open(file, "rb") as f:
        if hasattr(hashlib, "file_digest"):  # Python 3.11: read in blocks
            return hashlib.file_digest(f, "sha256").hexdigest()
        return hashlib.sha256(f.read()).hexdigest()  # 3.10


@dataclass
class Staged:
    """A checkpoint whose files are written under their temporary name, not yet durable or
    visible: `publish` checksums, fsyncs and renames it."""

    tmp: Path
    final: Path
    run_dir: Path
    keep_last: int | None = None


def stage(run_dir: Path, epoch: int, weights: Sequence[np.ndarray], weight_names: Sequence[str],
          write_optimizer: Callable[[str], None], history: list[dict[str, Any]], *, step: int = 0,
          rng: dict[str, np.ndarray] | None = None, config: str = "", resumes: list[dict[str, Any]] | None = None,
          keep_last: int | None = None) -> Staged:
    """Write the files of position (`epoch` completed, `step` into the next) under a temporary
    name; `write_optimizer(path)` writes the optimizer npz there. What needs the model and the
    store happens here; what only needs the disk (checksums, fsync) is `publish`'s."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / name(epoch, step)
    tmp = root / f".{final.name}.tmp"
    for stale in root.glob(".epoch-*.tmp"):  # left by a process killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        npz.save(tmp / "weights.npz", {f"w{i:04d}": w for i, w in enumerate(weights)})
        write_optimizer(str(tmp / "optimizer.npz"))
        np.savez(tmp / "rng.npz", **(rng or {}))
        (tmp / "config.yaml").write_text(config)
        (tmp / "state.json").write_text(json.dumps(
            {"format": FORMAT, "epoch": epoch, "step": step, "weight_names": list(weight_names),
             "history": history, "resumes": resumes or []}, indent=1))
    except BaseException as e:
        error = _failed(e, tmp, final)
        if error is e:
            raise
        raise error from None
    return Staged(tmp, final, Path(run_dir), keep_last)


def publish(staged: Staged) -> Path:
    """Checksum and fsync a staged checkpoint and rename it into place (then prune, with
    `keep_last`): until the rename, resume sees the previous checkpoint as the newest."""
    tmp, final = staged.tmp, staged.final
    try:
        files = ("weights.npz", "optimizer.npz", "rng.npz", "config.yaml", "state.json")
        (tmp / SUMS).write_text("".join(f"{_sha256(tmp / f)}  {f}\n" for f in files))
        for f in (*files, SUMS):
            _fsync(tmp / f)
        _fsync(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync(final.parent)
    except BaseException as e:
        error = _failed(e, tmp, final)
        if error is e:
            raise
        raise error from None
    if staged.keep_last:
        prune(staged.run_dir, staged.keep_last)
    return final


def _failed(e: BaseException, tmp: Path, final: Path) -> BaseException:
    shutil.rmtree(tmp, ignore_errors=True)  # a partial checkpoint only fills the disk
    if isinstance(e, OSError):
        return OutputError(f"checkpoint {final.name}: cannot write {e.filename or tmp} ({e.strerror or e}); "
                           f"{unwritable(e.errno)}")
    return e


def save(run_dir: Path, epoch: int, weights: Sequence[np.ndarray], weight_names: Sequence[str],
         write_optimizer: Callable[[str], None], history: list[dict[str, Any]], **kwargs: Any) -> Path:
    """`stage` and `publish` in one call: the checkpoint is durable and in place when it returns
    (keyword arguments: `stage`'s)."""
    return publish(stage(run_dir, epoch, weights, weight_names, write_optimizer, history, **kwargs))


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` checkpoints; the removed ones."""
    old = all_in(run_dir)[:-keep_last]
    for path in old:
        # renamed first, so that a kill mid-removal leaves a stale temporary, never half a checkpoint
        doomed = path.with_name(f".{path.name}.tmp")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return old


def _damaged(file: Path, what: str) -> Damaged:
    """The file, what is wrong with it, and the checkpoint to use instead."""
    mine = position(file.parent)
    earlier = [p for p in all_in(file.parent.parent.parent) if mine is not None and position(p) < mine]
    fix = (f"resume from the one before it (resume={earlier[-1]}) or start afresh (resume=false)" if earlier
           else "start afresh (resume=false)")
    return Damaged(file, what, fix)


def _npz(file: Path) -> dict[str, np.ndarray]:
    """Every array of an npz file, a large one memory-mapped (a table: never read whole here;
    the checksums catch damage inside it)."""
    try:
        if file.stat().st_size == 0:
            raise _damaged(file, "is empty (0 bytes)")
        return npz.load(file)
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
    for key in ("epoch", "step"):
        value = state.get(key, 0 if key == "step" else None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _damaged(file, f"has no valid '{key}' (found {value!r}; expected a whole number >= 0)")
    names = state.get("weight_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _damaged(file, "has no valid 'weight_names' (expected a list of variable names)")
    for key in ("history", "resumes"):
        if not isinstance(state.get(key, []), list):
            raise _damaged(file, f"has a '{key}' that is not a list")
    return state


def _check_sums(path: Path) -> None:
    """Every file SHA256SUMS names has that digest; a checkpoint of format 2 must have it."""
    sums = path / SUMS
    if not sums.is_file():
        if (path / "rng.npz").exists() or (path / "config.yaml").exists():  # format 2 without its sums
            raise _damaged(sums, "is missing")
        return  # format 1: each file's own checks below
    try:
        lines = [ln.split("  ", 1) for ln in sums.read_text().splitlines() if ln]
    except (OSError, ValueError) as e:
        raise _damaged(sums, f"is not readable ({e})") from None
    if not lines or any(len(ln) != 2 for ln in lines):
        raise _damaged(sums, "is not a list of '<sha256>  <file>' lines")
    for digest, file in lines:
        target = path / file
        if Path(file).name != file:
            raise _damaged(sums, f"names {file!r}, not a file of the checkpoint")
        if not target.is_file():
            raise _damaged(target, "is missing")
        if _sha256(target) != digest:
            raise _damaged(target, f"does not match its checksum in {SUMS} (truncated or damaged)")


def load(path: Path) -> Checkpoint:
    """Read checkpoint `path`; a missing or damaged file is a `Damaged` error that names it."""
    path = Path(path)
    state = _state(path / "state.json")
    arrays = _npz(path / "weights.npz")
    wanted = [f"w{i:04d}" for i in range(len(state["weight_names"]))]
    if set(arrays) != set(wanted):  # sets: names past w9999 are not in text order
        raise _damaged(path / "weights.npz", f"holds {len(arrays)} arrays where state.json names "
                                             f"{len(wanted)} variables")
    optimizer = _npz(path / "optimizer.npz")
    rng = _npz(path / "rng.npz") if (path / "rng.npz").exists() else {}
    config = (path / "config.yaml").read_text() if (path / "config.yaml").exists() else None
    _check_sums(path)  # last: each file's own check names the damage more precisely where it sees it
    return Checkpoint(path, state["epoch"], [arrays[k] for k in wanted], state["weight_names"], optimizer,
                      state.get("history", []), state.get("step", 0), rng, config, state.get("resumes", []))
