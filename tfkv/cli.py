"""`tfkv-run`: the Hydra app. Composes and validates the config, then trains.

With a `dist_*` KVStore and a cluster launcher, this process only plans and launches the job:
the scheduler, the servers and the workers (each running `tfkv-run` again as a worker) start as
their own processes, and this one waits and reports. A process whose environment gives it a
role (DMLC_ROLE=server, ...) takes that role before Hydra or TensorFlow start.

A mistake a user can fix (a typo, a wrong type, an unknown name, a missing data set) is printed
as one line and exits with status 2, before TensorFlow starts where the config alone shows it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from tfkv import config as config_schema
from tfkv.errors import TfkvError

log = logging.getLogger("tfkv")


def conf_dir() -> str:
    """The config tree: inside the installed package, or at the top of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"tfkv's config tree is missing (looked in {here / 'conf'}); reinstall tfkv")


config_schema.register()


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def _main(cfg: DictConfig) -> Any:
    try:
        return _job(cfg)
    except TfkvError as e:  # exit here: past this point Hydra adds its own lines to the message
        print(f"tfkv-run: {e}", file=sys.stderr)
        sys.exit(2)


def _job(cfg: DictConfig) -> dict[str, Any]:
    config_schema.validate(cfg)
    from hydra.core.hydra_config import HydraConfig

    from tfkv.store.cluster_env import ClusterEnv

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    in_job = ClusterEnv.role_of() is not None
    if not in_job:
        (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if config_schema.is_distributed(cfg.kvstore.type):
            return _launch(cfg, run_dir, list(hc.overrides.task), Path(hc.runtime.cwd))
    from tfkv.trainer import train

    final = train(cfg, run_dir, list(hc.overrides.task), search_root=Path(hc.runtime.cwd))
    log.info("done: test_accuracy %.4f after %d epochs; run directory %s",
             final["test_accuracy"], final["epoch"], run_dir)
    return {k: v for k, v in final.items() if k != "history"}


def _launch(cfg: DictConfig, run_dir: Path, overrides: list[str], cwd: Path) -> dict[str, Any]:
    """Start the whole parameter-server job; its workers write into this run directory."""
    import json

    from tfkv.errors import ClusterFailed
    from tfkv.launcher import job

    c = cfg.cluster
    opts = job.Options(c.launcher, c.num_workers, c.num_servers, c.hostfile, c.sync_dst_dir, c.interface,
                       c.host, c.port, c.heartbeat_timeout, c.verbose, c.python, c.secure)
    python = sys.executable if c.launcher == "local" else c.python
    worker = [python, "-m", "tfkv.cli", *overrides]  # they write into run_dir: plan.worker_overrides
    result = job.launch(opts, worker, cwd, run_dir, ["tfkv-run", *overrides], sys.stdout)
    if result.returncode > 128:  # stopped by Ctrl-C (130) or SIGTERM (143): exit as a single run does
        print(f"tfkv-run: the {cfg.kvstore.type} job failed: {result.failure}; logs in {run_dir}", file=sys.stderr)
        sys.exit(result.returncode)
    if result.failure:
        raise ClusterFailed(f"the {cfg.kvstore.type} job failed: {result.failure}; logs in {run_dir}")
    final = json.loads((run_dir / "metrics.json").read_text())
    log.info("done: test_accuracy %.4f after %d epochs; run directory %s",
             final["test_accuracy"], final["epoch"], run_dir)
    return {k: v for k, v in final.items() if k != "history"}


def _one_line(exc: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages, folded into one line with a hint."""
    parts = []
    for e in (exc, exc.__cause__):
        if e is not None and str(e).strip():
            parts.append(str(e).strip().splitlines()[0].rstrip("."))
    text = ": ".join(dict.fromkeys(parts))
    cause = exc.__cause__ or exc
    key, schema = getattr(cause, "key", None), getattr(cause, "object_type", None)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []
    if key is not None and str(key) not in known:  # a known key with a bad value needs no spelling hint
        close = difflib.get_close_matches(str(key), known, n=1)
        if close:
            text += f" (did you mean {close[0]!r}?)"
    return text + "; see tfkv-run --help"


def run() -> None:
    """Console entry point of `tfkv-run`."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfkv.store.cluster_env import ClusterEnv

    if ClusterEnv.role_of() in ("scheduler", "server"):
        from tfkv.store import node

        node.main()  # serves until the job ends, then exits
    from tfkv.launcher.plan import worker_overrides

    sys.argv += worker_overrides(sys.argv[1:], os.environ)  # a launched job's worker: its run directory
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        _main()
        return
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # let Hydra's errors reach us instead of printing them
    try:
        _main()
    except TfkvError as e:
        print(f"tfkv-run: {e}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"tfkv-run: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("tfkv-run: interrupted; the last finished epoch's checkpoint is in the run "
              "directory (resume=true continues from it)", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    run()
