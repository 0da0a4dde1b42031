"""The trial record: what one job of a sweep (`tfkv-run -m`) left, in `<its run dir>/trial.json`.

The process that runs a job's task function (tfkv.cli) writes it whatever happened: ok, failed
(with the one-line reason) or pruned. The sweep table (tfkv.sweep.summary), the Optuna sweeper
(which tells a pruned trial from a failed one) and the tfkv launcher read it back. Fields:
num, overrides, status ("ok" | "failed" | "pruned"), reason, objective, direction, value,
metrics (the final numbers of metrics.json, no history), started, ended, duration_s, log,
run_dir; a writer may add its own (the tfkv launcher adds "hosts").
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

FILE = "trial.json"
# Worker 0's pruning tracker writes this into the run directory before it raises TrialPruned, so
# the process that launched a dist_* trial knows its job's failure was a pruning.
PRUNED_FILE = "pruned.json"

STATUSES = ("ok", "failed", "pruned")


class SweepStopped(BaseException):
    """A trial failed under sweep.fail_fast=true: the sweep ends after recording it.

    Not an Exception, as Ctrl-C is not: Hydra's run_job makes every Exception the job's result,
    and the basic launcher runs the rest of its batch before the sweeper looks at any result."""


def write(run_dir: Path | str, record: dict[str, Any]) -> Path:
    """Write `record` as run_dir/trial.json, atomically (readers never see half a file)."""
    if record.get("status") not in STATUSES:
        raise ValueError(f"trial status must be one of {STATUSES}, not {record.get('status')!r}")
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / FILE
    fd, tmp = tempfile.mkstemp(prefix=".trial.", suffix=".json.tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(plain(record), f, indent=1, allow_nan=False)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def failed(num: int | None, overrides: list[str], run_dir: Path | str, reason: str | None, *,
           objective: str | None = None, direction: str | None = None, log: str | None = None,
           **more: Any) -> dict[str, Any]:
    """A record with every field, status failed: a trial that failed before its job could say
    more, or (tfkv.sweep.task) one about to run, whose outcome replaces these values. `more`:
    fields to set as well (started, hosts, ...)."""
    return {"num": num, "overrides": list(overrides), "status": "failed", "reason": reason,
            "objective": objective, "direction": direction, "value": None, "metrics": {},
            "started": None, "ended": None, "duration_s": None, "log": log, "run_dir": str(run_dir), **more}


def read(run_dir: Path | str) -> dict[str, Any] | None:
    """The trial record of this run directory, or None where the job wrote none (yet)."""
    try:
        return json.loads((Path(run_dir) / FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def was_pruned(run_dir: Path | str) -> bool:
    """Whether worker 0 of this run's job marked it pruned (PRUNED_FILE)."""
    return (Path(run_dir) / PRUNED_FILE).is_file()


def final_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """The final numeric values of a metrics.json (or of what train() returned): no history,
    no lists, no NaN (JSON has none)."""
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = v
    return out


def plain(value: Any) -> Any:
    """JSON has no NaN or infinity: a non-finite float is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
