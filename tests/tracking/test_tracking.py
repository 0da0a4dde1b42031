"""Where people look: the learning rate and samples/s in the progress bar, metrics.json and
TensorBoard; TensorBoard's HParams dashboard and an MLflow store, read back through TensorBoard's
own hparams plug-in and MLflow's own client."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tfkv_run
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from tfkv import check, cli
from tfkv.errors import ConfigError, TrialPruned

SHORT = ["epochs=2", "steps_per_epoch=4", "batch_size=32", "progress=false"]
ALL_STATUSES = ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"]


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[*SHORT, *overrides])
    check.validate(cfg)
    return cfg


def _train(tmp_path: Path, *overrides: str, name: str = "run") -> tuple[dict, Path]:
    from tfkv.trainer import train

    run_dir = tmp_path / name
    run_dir.mkdir(parents=True)
    return train(_cfg(*overrides), run_dir, list(overrides), search_root=tmp_path), run_dir


def _scalars(logdir: Path, tag: str) -> dict[int, float]:
    """{step: value} of a tf.summary.scalar, as TensorBoard's event reader sees it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return {e.step: float(tensor_util.make_ndarray(e.tensor_proto)) for e in acc.Tensors(tag)}


def _hparams_dashboard(logdir: Path) -> tuple[dict, dict]:
    """What TensorBoard's HParams dashboard gets for `tensorboard --logdir logdir`: the experiment
    (hparam and metric columns) and the session groups (the table's rows), from the hparams
    plug-in's own HTTP routes over TensorBoard's event multiplexer."""
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import hparams_plugin
    from werkzeug.test import Client

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    plugin = hparams_plugin.HParamsPlugin(base_plugin.TBContext(logdir=str(logdir), data_provider=provider,
                                                                multiplexer=mux))
    apps = plugin.get_plugin_apps()

    def post(route: str, body: dict) -> dict:
        response = Client(apps[route]).post(route, data=json.dumps(body))
        assert response.status_code == 200, response.get_data(as_text=True)
        return json.loads(response.get_data(as_text=True))

    experiment = post("/experiment", {"experimentName": ""})
    groups = post("/session_groups", {"startIndex": 0, "sliceSize": 100, "allowedStatuses": ALL_STATUSES,
                                      "aggregationType": "AGGREGATION_AVG"})
    return experiment, groups


def _metric(session: dict, tag: str) -> float:
    (value,) = [m["value"] for m in session.get("metricValues", []) if m["name"]["tag"] == tag]
    return value


def test_lr_and_samples_per_sec_each_epoch(tmp_path):
    """A step schedule's drop shows in each epoch's record and in TensorBoard's epoch/lr."""
    final, run_dir = _train(tmp_path, "optimizer.schedule.name=step", "optimizer.schedule.milestones=[1]")
    history = json.loads((run_dir / "metrics.json").read_text())["history"]
    assert [h["lr"] for h in history] == pytest.approx([0.1, 0.01])
    assert _scalars(run_dir / "tensorboard", "epoch/lr") == pytest.approx({1: 0.1, 2: 0.01})
    rates = _scalars(run_dir / "tensorboard", "epoch/samples_per_sec")
    assert sorted(rates) == [1, 2] and all(r > 0 for r in rates.values())


class _Terminal(io.StringIO):
    """stderr as a terminal: tqdm draws its bar only there."""

    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_lr_and_samples_per_sec(tmp_path, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    _train(tmp_path, "progress=true", "optimizer=adam", "optimizer.lr=0.003")
    out = terminal.getvalue()
    assert "epoch 2/2" in out and "lr=0.003" in out, out[-2000:]
    rates = [float(part.split("=")[1].rstrip(",]")) for part in out.split() if part.startswith("samples/s=")]
    assert rates and all(r > 0 for r in rates), out[-2000:]


def test_run_shows_in_hparams_dashboard(tmp_path):
    """One run is one session of the HParams dashboard: the standard hyper-parameters, the
    metrics (objective, test_*) as TensorBoard's plug-in reads them, and its status."""
    final, run_dir = _train(tmp_path, "optimizer.lr=0.05", "batch_size=16")
    experiment, groups = _hparams_dashboard(tmp_path)
    hparams = {h["name"] for h in experiment["hparamInfos"]}
    assert {"optimizer", "optimizer.lr", "batch_size", "kvstore", "model", "dataset"} <= hparams
    metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
    assert {"epoch/test_accuracy", "epoch/test_loss", "epoch/lr"} <= metrics
    (group,) = groups["sessionGroups"]
    assert group["hparams"]["optimizer"] == "sgd" and group["hparams"]["optimizer.lr"] == pytest.approx(0.05)
    assert group["hparams"]["batch_size"] == 16 and group["hparams"]["kvstore"] == "local"
    assert group["hparams"]["model"] == "tfkv.models.mlp.build"
    (session,) = group["sessions"]
    assert session["status"] == "STATUS_SUCCESS"
    assert _metric(session, "epoch/test_accuracy") == pytest.approx(final["test_accuracy"], rel=1e-5)


def test_failed_run_ends_its_session_failed(tmp_path):
    from tfkv.tracking import tensorboard

    tracker = tensorboard.build(_cfg(), tmp_path / "run")
    tracker.close(RuntimeError("the data went away"))
    _, groups = _hparams_dashboard(tmp_path)
    (group,) = groups["sessionGroups"]
    assert group["sessions"][0]["status"] == "STATUS_FAILURE"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One SQLite MLflow store for the module's tests (making its tables takes seconds); each
    test logs to an experiment of its own."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/tracking.db"


def _mlflow(uri: str, experiment: str = "tfkv"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(experiment)
    assert experiment is not None
    return client, client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


def test_mlflow_logs_params_epochs_model_and_status(tmp_path, store):
    final, run_dir = _train(tmp_path, "logger=mlflow", f"logger.tracking_uri={store}", "logger.experiment=epochs",
                            "optimizer.lr=0.05")
    client, (run,) = _mlflow(store, "epochs")
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["optimizer.lr"] == "0.05" and params["optimizer.name"] == "sgd"
    assert params["model._target_"] == "tfkv.models.mlp.build" and params["epochs"] == "2"
    for key in ("test_accuracy", "train_loss", "lr", "samples_per_sec"):
        history = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in history) == [1, 2], key
    last = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "test_accuracy")}[2]
    assert last == pytest.approx(final["test_accuracy"])
    (artifact,) = [a for a in client.list_artifacts(run.info.run_id) if a.path == "model.keras"]
    assert artifact.file_size == (run_dir / "model.keras").stat().st_size
    # the artifacts beside the SQLite store, not in whatever directory the run started in
    assert (Path(store[len("sqlite:///"):]).parent / "mlruns").is_dir() and not (Path.cwd() / "mlruns").exists()


def test_mlflow_run_ends_with_the_error(tmp_path, store):
    """A failure ends the MLflow run FAILED with the error's line; a pruned trial or Ctrl-C, KILLED."""
    from tfkv.tracking import mlflow_log

    cfg = _cfg("logger=mlflow", f"logger.tracking_uri={store}", "logger.experiment=errors")
    for error in (RuntimeError("a worker died"), KeyboardInterrupt(), TrialPruned("pruned at epoch 1")):
        tracker = mlflow_log.build(cfg, tmp_path)
        tracker.epoch(1, {"epoch": 1, "train_loss": 0.5, "test_accuracy": 0.75, "lr": 0.1, "samples": 128})
        tracker.close(error)
    client, runs = _mlflow(store, "errors")
    assert [r.info.status for r in runs] == ["FAILED", "KILLED", "KILLED"]
    assert runs[0].data.tags["tfkv.error"] == "RuntimeError: a worker died"
    assert all(r.data.metrics == {"train_loss": 0.5, "test_accuracy": 0.75, "lr": 0.1} for r in runs)


@pytest.mark.parametrize("uri,reason", [("foo://bar", "unsupported URI 'foo://bar'"),
                                        ("sqlite:////proc/tfkv/mlflow.db", "No such file or directory")])
def test_mlflow_store_it_cannot_use_is_one_line(tmp_path, uri, reason):
    from tfkv.tracking import mlflow_log

    with pytest.raises(ConfigError, match=rf"^logger.tracking_uri={uri}: MLflow cannot use this store") as e:
        mlflow_log.build(_cfg("logger=mlflow", f"logger.tracking_uri={uri}"), tmp_path)
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_mlflow_not_installed_is_one_line(tmp_path, monkeypatch):
    from tfkv.tracking import mlflow_log

    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=["logger=mlflow"])
    monkeypatch.setitem(sys.modules, "mlflow", None)  # what `import mlflow` finds when it is absent
    # refused when the config is validated, before anything starts; and by worker 0's tracker
    for attempt in (lambda: check.validate(cfg), lambda: mlflow_log.build(cfg, tmp_path)):
        with pytest.raises(ConfigError, match=r"^logger=mlflow needs MLflow.*pip install 'tfkv\[mlflow\]'") as e:
            attempt()
        assert "\n" not in str(e.value)


@pytest.mark.slow
def test_trials_starting_together_share_a_new_store(tmp_path):
    """Parallel trials (hydra/launcher=joblib) all log to the SQLite store that the first of them
    creates: none fails making its tables or the experiment."""
    script = ("import sys; from pathlib import Path; from omegaconf import OmegaConf; "
              "from tfkv.tracking import mlflow_log; "
              "cfg = OmegaConf.create({'logger': {'name': 'mlflow', 'tracking_uri': sys.argv[1], 'experiment': 'tfkv'}, "
              "'trial': int(sys.argv[2])}); "
              "mlflow_log.build(cfg, Path(sys.argv[2])).close(None)")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    procs = [subprocess.Popen([sys.executable, "-c", script, uri, str(n)], cwd=tmp_path, stderr=subprocess.PIPE,
                              text=True) for n in range(2)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-2000:]
    client, runs = _mlflow(uri)
    assert sorted(r.data.params["trial"] for r in runs) == ["0", "1"]
    assert {r.info.status for r in runs} == {"FINISHED"}


@pytest.mark.slow
def test_sweep_is_one_hparams_table_and_one_mlflow_run_per_trial(tmp_path):
    """`tfkv-run -m` of two trials: TensorBoard over the sweep directory shows both trials with
    the swept value and their metrics; MLflow's default store (mlflow.db where tfkv-run started)
    has one finished run per trial."""
    tfkv_run("-m", "optimizer.lr=0.05,0.2", "logger=mlflow", *SHORT, cwd=tmp_path)
    (sweep,) = (tmp_path / "multirun").glob("*/*")
    finals = {}  # the swept lr -> that trial's metrics.json
    for n in (0, 1):
        (lr,) = [float(o.split("=")[1]) for o in OmegaConf.load(sweep / str(n) / ".hydra" / "overrides.yaml")
                 if o.startswith("optimizer.lr=")]
        finals[lr] = json.loads((sweep / str(n) / "metrics.json").read_text())
    experiment, groups = _hparams_dashboard(sweep)
    (lr,) = [h for h in experiment["hparamInfos"] if h["name"] == "optimizer.lr"]
    assert lr["domainInterval"] == {"minValue": 0.05, "maxValue": 0.2}
    sessions = {g["hparams"]["optimizer.lr"]: g["sessions"][0] for g in groups["sessionGroups"]}
    assert sorted(sessions) == pytest.approx([0.05, 0.2])
    for value, session in sessions.items():
        assert session["status"] == "STATUS_SUCCESS"
        assert _metric(session, "epoch/test_accuracy") == pytest.approx(finals[value]["test_accuracy"], rel=1e-5)

    client, runs = _mlflow(f"sqlite:///{tmp_path}/mlflow.db")
    assert [r.info.status for r in runs] == ["FINISHED", "FINISHED"]
    assert sorted(r.data.params["optimizer.lr"] for r in runs) == ["0.05", "0.2"]
    for run in runs:
        lr = float(run.data.params["optimizer.lr"])
        assert run.data.metrics["test_accuracy"] == pytest.approx(finals[lr]["test_accuracy"])


def test_the_entry_layer_passes_its_trackers_in_after_the_packages_own(tmp_path):
    """for_run builds tfkv.tracking's own trackers, then the builders the entry layer passes (a
    sweep's pruner: tfkv-run and tfkv.worker pass tfkv.sweep.pruning.build), in that order; one
    that is not wanted (None) is left out. The package names no tracker above it."""
    from tfkv import tracking
    from tfkv.sweep import pruning
    from tfkv.tracking import tensorboard

    seen = []

    class Marker(tracking.Hook):
        pass

    def wanted(cfg, run_dir):
        seen.append(run_dir)
        return Marker()

    built = tracking.for_run(_cfg(), tmp_path / "run", [lambda cfg, run_dir: None, wanted, pruning.build])
    assert [type(t) for t in built] == [tensorboard.TensorBoard, Marker]  # no trial: no pruner
    assert seen == [tmp_path / "run"]
    tracking.close(built, None)
    package = Path(tracking.__file__).parent
    upward = re.compile(r"[\"']tfkv\.(sweep|cli|worker)|(import|from) tfkv\.(sweep|cli|worker)")  # by string or import
    assert not [f.name for f in package.glob("*.py") if upward.search(f.read_text())]
