"""Which checkpoint a `resume` setting means, and whether it fits the config being run.

`resume=auto`: the newest valid checkpoint of this run's own directory, else a fresh start (the
setting a requeued or restarted job is run with: same command, same `hydra.run.dir`).
`resume=true`: the same, else the newest checkpoint of an earlier run of the same command
(overrides compared with `resume`, `eval_only`, `epochs` and `hydra.*` aside, so that raising
`epochs` extends a run). `resume=<dir>`: that run directory's newest valid checkpoint, or that
checkpoint directory itself. Where a run directory is searched, a damaged newest checkpoint is
passed over with a one-line warning naming the file, never used: the one before it is taken.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from tfkv.checkpoint.files import Damaged, all_in, load
from tfkv.errors import ConfigError

log = logging.getLogger("tfkv")

# What `resume` may say besides a run directory (YAML 1.1's words, as a user types them)
NO = ("false", "0", "no", "off", "")
YES = ("true", "1", "yes", "on")
AUTO = "auto"

# The settings whose change makes a checkpoint's variables or optimizer state another kind:
# compared before anything is built, the first difference named. (The store type and where the
# optimizer runs may change: every store saves its state in the same npz keys.) kvstore.row_sparse
# numbers the keys otherwise (the tables' after the dense ones), so their states would not match.
_MUST_FIT = ("model", "optimizer.name", "kvstore.row_sparse")
# What a checkpoint saved before a setting existed had, in effect
_BEFORE = {"kvstore.row_sparse": False}


def _same_command(overrides: list[str]) -> list[str]:
    """The overrides that make two commands the same run: `eval_only=true resume=true` evaluates
    the last checkpoint of the command it is added to, `epochs=20 resume=true` extends it."""
    return sorted(o for o in overrides
                  if not o.lstrip("+~").startswith(("resume=", "eval_only=", "epochs=", "hydra.")))


def newest_valid(run_dir: Path) -> Path | None:
    """The newest checkpoint of `run_dir` whose files check out; each damaged newer one is a
    warning line. None when there is none; a Damaged error when every one is damaged."""
    damaged: list[Damaged] = []
    for path in reversed(all_in(run_dir)):
        try:
            load(path)
        except Damaged as e:
            damaged.append(e)
            continue
        if damaged:
            log.warning("resume: passing over the damaged newer checkpoint%s (%s); continuing from %s",
                        "s" if len(damaged) > 1 else "", "; ".join(f"{e.file} {e.what}" for e in damaged), path)
        return path
    if damaged:
        raise damaged[0]
    return None


def find_resume(resume: Any, run_dir: Path, search_root: Path, overrides: list[str]) -> Path | None:
    """The checkpoint to continue from, or None to start fresh (see the module docstring)."""
    words = str(resume).lower()
    if resume is False or words in NO:
        return None
    if resume is True or words in YES or words == AUTO:
        own = newest_valid(run_dir) if Path(run_dir).is_dir() else None
        if own is not None or words == AUTO:
            if own is None:
                log.info("resume=auto: no checkpoint in %s yet; starting from scratch", run_dir)
            return own
        return _same_command_checkpoint(run_dir, search_root, overrides)
    path = Path(str(resume)).expanduser()
    if (path / "state.json").is_file():
        return path
    ckpt = newest_valid(path)
    if ckpt is None:
        raise ConfigError(f"resume={resume}: no checkpoint found in {path} (expected "
                          "checkpoints/epoch-NNNN/ inside a run directory)")
    return ckpt


def _same_command_checkpoint(run_dir: Path, search_root: Path, overrides: list[str]) -> Path | None:
    wanted = _same_command(overrides)
    candidates = []
    for hydra_dir in [*search_root.glob("outputs/*/*/.hydra"), *search_root.glob("multirun/*/*/*/.hydra")]:
        run = hydra_dir.parent
        if run.resolve() == Path(run_dir).resolve() or not all_in(run):
            continue
        try:
            theirs = yaml.safe_load((hydra_dir / "overrides.yaml").read_text()) or []
        except (OSError, yaml.YAMLError):
            continue
        if _same_command(theirs) == wanted:
            candidates.append(run)
    if not candidates:
        log.warning("resume: no earlier checkpoint of this command found; starting from scratch")
        return None
    return newest_valid(max(candidates, key=lambda run: all_in(run)[-1].stat().st_mtime))


def _get(node: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _first_difference(ours: Any, theirs: Any, where: str) -> str | None:
    """`where.key: <theirs> in the checkpoint, <ours> here` for the first key that differs."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs), key=str):
            found = _first_difference(ours.get(key), theirs.get(key), f"{where}.{key}")
            if found:
                return found
        return None
    if ours != theirs:
        return f"{where} is {theirs!r} in the checkpoint, {ours!r} here"
    return None


def check_fits(path: Path, config: dict[str, Any]) -> None:
    """Refuse, in one line naming the first difference, a checkpoint saved by a config whose
    model or optimizer state differs from `config`'s (the resolved config, as a dict).
    A checkpoint without its config (format 1) is checked when its weights are loaded."""
    recorded = Path(path) / "config.yaml"
    if not recorded.is_file():
        return
    try:
        theirs = yaml.safe_load(recorded.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"resume: {recorded} is not readable YAML ({e}); start afresh with resume=false") from None
    for key in _MUST_FIT:
        saved = _get(theirs, key)
        found = _first_difference(_get(config, key), _BEFORE.get(key) if saved is None else saved, key)
        if found:
            raise ConfigError(f"resume: checkpoint {path} does not fit this model and optimizer: {found}; "
                              "resume a run of the same model settings, or start afresh with resume=false")
