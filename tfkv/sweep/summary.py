"""The sweep table: a Hydra callback (conf/config.yaml, hydra.callbacks) that checks every trial's
config before the first trial starts (tfkv.sweep.precheck) and, at the end, gathers each trial's
record (tfkv.sweep.trial) under hydra.sweep.dir into a table printed on the console and written
there as sweep.csv and sweep.json, naming the best trial by `direction`.

Whichever launcher ran the trials (in this process, in joblib's, on Slurm's nodes), their records
are files in the sweep directory, so the table is read from there. tfkv-run reads `failed()`
after the sweep to exit 1 when any trial failed (a pruned trial is a result, not a failure), and
calls `finish()` itself when the sweep ended early (sweep.fail_fast, Ctrl-C), where Hydra calls no
on_multirun_end.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from tfkv.sweep import trial

log = logging.getLogger("tfkv")

# The sweep of this process: its directory once it started, whether its table is written, and
# what the table found.
_state: dict[str, Any] = {"dir": None, "done": False, "failed": 0, "total": 0}


class SweepTable(Callback):
    """hydra.callbacks.sweep_table: precheck at the start, the table at the end."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        from tfkv.sweep import precheck

        # resolving the directory here fixes its ${now:} for the whole sweep (Hydra caches it)
        _state.update(dir=Path(str(config.hydra.sweep.dir)), done=False, failed=0, total=0)
        # Hydra turns a callback's exception into a warning and goes on: bad input exits here,
        # in one line, before the sweep directory or any trial exists.
        problem = precheck.problem(config)
        if problem is not None:
            print(f"tfkv-run: {problem}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        finish()


def finish() -> None:
    """Print and write the table of the sweep this process ran, once; nothing outside a sweep."""
    if _state["dir"] is None or _state["done"]:
        return
    _state["done"] = True
    sweep_dir = _state["dir"]
    records = gather(sweep_dir)
    _state["total"] = len(records)
    _state["failed"] = sum(r["status"] == "failed" for r in records)
    if not records:
        return
    best = best_trial(records)
    print(table(records, best))
    write(sweep_dir, records, best)
    if best is not None:
        print(f"best: trial #{best['num']} ({' '.join(_own(best, records)) or '-'}) {best['objective']} "
              f"{best['value']:.4f} ({best['direction']}); {best['run_dir']}")
    print(f"sweep table: {sweep_dir / 'sweep.csv'} and sweep.json")


def failed() -> tuple[int, int]:
    """(failed trials, all trials) of the sweep this process ran."""
    return _state["failed"], _state["total"]


def gather(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every trial of the sweep, by number: its record, or, for a job that died before writing one
    (killed by its batch system, out of memory), a failed row made from Hydra's files."""
    records: dict[str, dict[str, Any]] = {}
    for path in sorted(sweep_dir.rglob(trial.FILE)):
        rec = trial.read(path.parent)
        if rec is not None:
            records[str(path.parent)] = rec
    for hydra_yaml in sorted(sweep_dir.rglob(".hydra/hydra.yaml")):
        run_dir = hydra_yaml.parent.parent
        if str(run_dir) not in records:
            records[str(run_dir)] = _unrecorded(run_dir, hydra_yaml)
    return sorted(records.values(), key=lambda r: (r.get("num") is None, r.get("num") or 0))


def _unrecorded(run_dir: Path, hydra_yaml: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    try:
        hc = OmegaConf.load(hydra_yaml).hydra
        num, overrides = int(hc.job.num), list(hc.overrides.task)
    except Exception:  # noqa: BLE001 - a half-written file: the row still says the job left nothing
        num, overrides = None, []
    return trial.failed(num, overrides, run_dir, "the job ended without recording its trial (killed? see its log)")


def best_trial(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The ok trial with the best value in its `direction`; None if no trial finished."""
    done = [r for r in records if r["status"] == "ok" and isinstance(r.get("value"), (int, float))
            and math.isfinite(r["value"])]
    if not done:
        return None
    sign = -1.0 if done[0].get("direction") == "minimize" else 1.0
    return max(done, key=lambda r: sign * r["value"])


def _metric_names(records: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for r in records:
        names.update(dict.fromkeys(r.get("metrics") or {}))
    return list(names)


def _own(record: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """The trial's overrides that not every trial shares: what tells it apart on the console
    (sweep.csv and sweep.json have them all). The tfkv_optuna sweeper's sweep.study/storage/trial
    (where the job reports its epochs) tell no trial apart: left out."""
    from tfkv.sweep.pruning import TRIAL_KEYS

    mine = [o for o in record.get("overrides") or [] if not o.startswith(tuple(f"{k}=" for k in TRIAL_KEYS))]
    if len(records) < 2:  # one trial: nothing to tell apart, all its overrides say what it is
        return mine
    shared = set.intersection(*(set(r.get("overrides") or []) for r in records))
    return [o for o in mine if o not in shared]


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) >= 1e4 or abs(value) < 1e-3 and value != 0 else f"{value:.4f}"
    return str(value)


def table(records: list[dict[str, Any]], best: dict[str, Any] | None = None) -> str:
    """The console table: one row a trial, then each failed or pruned trial's reason."""
    objective = next((r["objective"] for r in records if r.get("objective")), "value")
    metrics = [m for m in _metric_names(records) if m != objective]
    head = ["#", "overrides", "status", objective, *metrics, "duration"]
    rows = []
    for r in records:
        mark = "*" if best is not None and r is best else ""
        rows.append([f"{r.get('num', '?')}{mark}", " ".join(_own(r, records)) or "-", r["status"],
                     _number(r.get("value")), *[_number((r.get("metrics") or {}).get(m)) for m in metrics],
                     "-" if r.get("duration_s") is None else f"{r['duration_s']:.1f}s"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in records:
        if r["status"] != "ok":
            lines.append(f"#{r.get('num', '?')} {r['status']}: {r.get('reason')}"
                         + (f" (log {r['log']})" if r.get("log") else ""))
    return "\n".join(lines)


def write(sweep_dir: Path, records: list[dict[str, Any]], best: dict[str, Any] | None) -> None:
    """sweep.csv (one row a trial, a column a final metric) and sweep.json (the records)."""
    metrics = _metric_names(records)
    fields = ["num", "status", "reason", "value", "duration_s", "overrides", "run_dir", "log"]
    with open(sweep_dir / "sweep.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*fields, *metrics])
        for r in records:
            row = [" ".join(r.get(k) or []) if k == "overrides" else r.get(k) for k in fields]
            out.writerow([*("" if v is None else v for v in row),
                          *("" if (r.get("metrics") or {}).get(m) is None else r["metrics"][m] for m in metrics)])
    first = next((r for r in records if r.get("objective")), {})
    summary = {"objective": first.get("objective"), "direction": first.get("direction"),
               "best": None if best is None else best["num"],
               "failed": sum(r["status"] == "failed" for r in records),
               "pruned": sum(r["status"] == "pruned" for r in records), "trials": records}
    tmp = sweep_dir / ".sweep.json.tmp"
    tmp.write_text(json.dumps(trial.plain(summary), indent=1))
    tmp.replace(sweep_dir / "sweep.json")
