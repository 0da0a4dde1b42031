"""One job of a sweep (`tfkv-run -m`) run as a trial: whatever happens it is recorded in its
run directory (tfkv.sweep.trial) and the sweep goes on, unless Ctrl-C or sweep.fail_fast ends it."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("tfkv")


def run(cfg: Any, job: Callable[[Any], float], explain: Callable[[BaseException], str | None]) -> float | None:
    """`job(cfg)` as one trial of a sweep: a result whatever happens (`explain`: an error's
    one line, None for a bug). Its record (tfkv.sweep.trial) says ok,
    failed (with the one-line reason; an unexpected error's traceback goes to the job's log) or
    pruned; the sweeper gets the objective's value, or None where there is no finite one (failed,
    pruned, diverged), and the sweep goes on: Hydra's Optuna sweeper (1.3.0) marks None failed,
    while a NaN ends its sweep (it tells Optuna FAIL with the NaN attached, which Optuna
    refuses). Ctrl-C still ends the whole sweep; with sweep.fail_fast=true a failure does too
    (SweepStopped), once recorded."""
    import math
    import time

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from tfkv.errors import TrialPruned
    from tfkv.sweep import trial

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    record = trial.failed(int(hc.job.num), OmegaConf.to_container(hc.overrides.task, resolve=False), run_dir,
                          None, objective=cfg.get("objective"), direction=cfg.get("direction"),
                          log=_log_file(run_dir, hc), started=time.time())
    value = math.nan
    try:
        value = job(cfg)
        record["status"] = "ok"
    except TrialPruned as e:
        record.update(status="pruned", reason=str(e))
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C or SIGTERM: recorded, then the sweep ends
        record["reason"] = "interrupted" if isinstance(e, KeyboardInterrupt) else f"stopped (exit {e.code})"
        if not _batch_job_of_its_own():
            raise
    except Exception as e:
        text = explain(e)
        if text is not None and trial.was_pruned(run_dir):  # a dist_* job whose worker 0 was pruned
            # its mark says why (pruning.py); the job's own line names only worker 0's exit status
            reason = json.loads((run_dir / trial.PRUNED_FILE).read_text()).get("reason")
            record.update(status="pruned", reason=reason or text)
        else:
            if text is None:  # a bug: its traceback belongs in the job's log, its first line here
                _log_traceback()
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                text = f"{type(e).__name__}: {first}" if first else type(e).__name__
            record["reason"] = text
    finally:
        try:
            metrics = json.loads((run_dir / "metrics.json").read_text())
        except (OSError, ValueError):
            metrics = {}
        record["metrics"] = trial.final_metrics(metrics)
        # what the run's check resolved (tfkv.config.objective): objective null, direction auto
        record.update(objective=cfg.get("objective"), direction=cfg.get("direction"))
        record["ended"] = time.time()
        record["duration_s"] = round(record["ended"] - record["started"], 3)
        record["value"] = value if record["status"] == "ok" else None
        trial.write(run_dir, record)
    if record["status"] == "ok":
        return value if math.isfinite(value) else None
    log.warning("trial #%d %s: %s (log %s)", record["num"], record["status"], record["reason"], record["log"])
    if (record["status"] == "failed" and cfg.get("sweep") is not None and cfg.sweep.fail_fast
            and not _batch_job_of_its_own()):
        shown = " ".join(record["overrides"]) or "(no overrides)"
        raise trial.SweepStopped(f"trial #{record['num']} ({shown}) failed: {record['reason']}; "
                                 "sweep.fail_fast=true ends the sweep there")
    return None


def _batch_job_of_its_own() -> bool:
    """The trial runs in a batch job of its own (hydra-submitit-launcher's, SUBMITIT_EXECUTOR set):
    a signal there is the batch system ending this job (scancel, a time limit, a preemption), not
    the user ending the sweep, and the sweep waits for the job's result file, which submitit writes
    only when the task function returns or raises an Exception: the trial returns, recorded failed.
    (All of that sweep's trials are submitted at once, so sweep.fail_fast cannot stop the others.)"""
    return bool(os.environ.get("SUBMITIT_EXECUTOR"))


def _log_file(run_dir: Path, hc: Any) -> str:
    """The job's log file: Hydra's file handler's, where job logging has one."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return str(run_dir / f"{hc.job.name}.log")


def _log_traceback() -> None:
    """The traceback of the exception being handled, into the job's log file only: the sweep's
    console gets the trial's one line; without a log file, the console gets it all."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "trial failed with an unexpected error",
                            None, sys.exc_info())
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for handler in files:
        handler.handle(record)
    if not files:
        log.handle(record)
