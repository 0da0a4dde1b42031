"""`logger=mlflow`: a run as an MLflow run, in an MLflow tracking store.

Params: the resolved config, flattened (`optimizer.lr`, `model._target_`, ...). Metrics: each
epoch's train_*/test_* values, samples_per_sec and lr, at step=epoch. The model: model.keras as
an artifact (a file, so no MLflow flavour and its extra packages are needed). The MLflow run ends
FINISHED, FAILED (the error in the tag tfkv.error), or KILLED (pruned by a sweeper, or Ctrl-C).
The store is `logger.tracking_uri`, by default a SQLite file, mlflow.db, in the directory tfkv-run
started in (`mlflow ui --backend-store-uri sqlite:///mlflow.db` there shows it). MLflow's client
is used directly, not its module-level active run, so that the runs of a sweep's trials in one
process never mix. MLflow is imported only when it is asked for.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Iterator

from tfkv.errors import ConfigError, TrialPruned
from tfkv.tracking import Hook, curves, hydra_job

log = logging.getLogger("tfkv")

MAX_PARAM = 6000  # MLflow refuses a longer param value


def default_uri() -> str:
    return f"sqlite:///{hydra_job.start_dir() / 'mlflow.db'}"


def params(cfg: Any) -> dict[str, str]:
    """The resolved config, flattened to MLflow params: `a.b.c` -> its value as the config spells
    it (strings as they are, other values as JSON: 0.05, true, null, [256, 128])."""
    from omegaconf import OmegaConf

    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
            return
        text = node if isinstance(node, str) else json.dumps(node)
        # MLflow's key alphabet: letters, digits, _ - . / and space
        flat[re.sub(r"[^\w\-./ ]", "_", prefix[:-1])] = text[:MAX_PARAM]

    walk(OmegaConf.to_container(cfg, resolve=True), "")
    return flat


class MlflowRun(Hook):
    """One tfkv run as one MLflow run."""

    def __init__(self, mlflow: Any, cfg: Any, run_dir: Path):
        self.mlflow = mlflow
        uri = cfg.logger.tracking_uri or default_uri()
        overrides = hydra_job.overrides(run_dir)
        try:
            with _store_lock(uri):  # the client makes a new store's tables
                self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
                experiment_id = self._experiment(cfg.logger.experiment, uri)
            run = self.client.create_run(experiment_id, run_name=" ".join(overrides)[:250] or Path(run_dir).name,
                                         tags={"tfkv.run_dir": str(run_dir), "tfkv.overrides": " ".join(overrides)[:MAX_PARAM]})
        except (mlflow.exceptions.MlflowException, OSError) as e:  # OSError: the SQLite file's directory
            raise ConfigError(f"logger.tracking_uri={uri}: MLflow cannot use this store ({_first_line(e)}); "
                              "give a writable sqlite:///<path> or a tracking server's http(s) URL") from None
        self.run_id = run.info.run_id
        entities = mlflow.entities
        self.client.log_batch(self.run_id, params=[entities.Param(k, v) for k, v in params(cfg).items()])
        log.info("MLflow: run %s in experiment %r of %s", self.run_id, cfg.logger.experiment, uri)

    def _experiment(self, name: str, uri: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        db = _sqlite_file(uri)
        # a SQLite store's artifacts beside it (MLflow's default is ./mlruns wherever this process runs)
        artifacts = (db.parent.resolve() / "mlruns").as_uri() if db else None
        try:
            return self.client.create_experiment(name, artifact_location=artifacts)
        except self.mlflow.exceptions.MlflowException:  # another trial's process made it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def epoch(self, epoch: int, record: dict[str, Any]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.mlflow.entities.Metric(k, float(record[k]), now, epoch) for k in curves(record)]
        self.client.log_batch(self.run_id, metrics=metrics)

    def end(self, final: dict[str, Any], run_dir: Path) -> None:
        model = Path(run_dir) / "model.keras"
        if model.is_file():
            self.client.log_artifact(self.run_id, str(model))

    def close(self, error: BaseException | None) -> None:
        if error is None:
            self.client.set_terminated(self.run_id, "FINISHED")
            return
        status = "KILLED" if isinstance(error, (TrialPruned, KeyboardInterrupt)) else "FAILED"
        try:  # the error that ended the run is what the user must see, not one of MLflow's
            self.client.set_tag(self.run_id, "tfkv.error", f"{type(error).__name__}: {_first_line(error)}"[:MAX_PARAM])
            self.client.set_terminated(self.run_id, status)
        except Exception as e:  # noqa: BLE001
            log.warning("MLflow: could not mark run %s %s (%s)", self.run_id, status, _first_line(e))


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """For a SQLite store: one process at a time creates its tables and the experiment (two
    trials starting together would both try, and one would fail)."""
    db = _sqlite_file(uri)
    if db is None:
        yield
        return
    with open(db.parent / f".{db.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


NOT_INSTALLED = "logger=mlflow needs MLflow, which is not installed here: pip install 'tfkv[mlflow]' (or choose logger=none)"


def check_installed() -> None:
    """ConfigError unless MLflow can be imported; without importing it (a second or more)."""
    try:
        spec = importlib.util.find_spec("mlflow")
    except ValueError:  # sys.modules["mlflow"] is None: Python's mark for a module that cannot be imported
        spec = None
    if spec is None:
        raise ConfigError(NOT_INSTALLED)


def build(cfg: Any, run_dir: Path) -> MlflowRun | None:
    if cfg.logger.name != "mlflow":
        return None
    try:
        import mlflow
        import mlflow.tracking  # noqa: F401 - MlflowClient
    except ImportError:
        raise ConfigError(NOT_INSTALLED) from None
    return MlflowRun(mlflow, cfg, run_dir)
