"""Sweeps (`tfkv-run -m`) with Hydra's basic sweeper and launcher: a failed trial is a result
(trial.json, the sweep table in sweep.csv and sweep.json, exit 1), sweep.fail_fast stops at the
first, the best trial is named by `direction`, and bad input (a config any trial would have, a
plug-in that is not installed) is one line before the first trial. Real tfkv-run processes."""

import csv
import json
import math
import re
from importlib import metadata
from pathlib import Path

import pytest
from conftest import tfkv_run

# tiny trials: a few steps of the bundled digits
QUICK = ["epochs=1", "steps_per_epoch=2", "progress=false"]

# The user's models, beside where tfkv-run starts: one with a bug, one that refuses its settings.
USER_MODULE = '''
import os
from pathlib import Path

from tfkv.errors import ConfigError, TrialPruned
from tfkv.sweep import trial


def buggy(**settings):
    raise RuntimeError("boom in the user's model\\nsecond line")


def refuses(**settings):
    raise ConfigError("this model refuses: it needs model.width")


def pruned(**settings):
    # as the pruning tracker does on worker 0 of a distributed trial: the mark, then the signal
    if os.environ.get("TFKV_RUN_DIR"):
        Path(os.environ["TFKV_RUN_DIR"], trial.PRUNED_FILE).write_text("{}")
    raise TrialPruned("pruned at epoch 1")
'''


def _sweep_dir(root: Path) -> Path:
    (sweep,) = root.glob("multirun/*/*")
    return sweep


def _tfkv_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("tfkv-run:")]


def test_a_failed_trial_is_a_result_and_the_sweep_goes_on(tmp_path):
    (tmp_path / "sweepmodels.py").write_text(USER_MODULE)
    proc = tfkv_run("-m", "model._target_=sweepmodels.refuses,tfkv.models.mlp.build,sweepmodels.buggy,"
                    "sweepmodels.pruned", *QUICK, cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out
    assert _tfkv_lines(proc.stderr)[-1] == "tfkv-run: 2 of 4 trials failed; see the table above"
    sweep = _sweep_dir(tmp_path)
    records = [json.loads((sweep / str(n) / "trial.json").read_text()) for n in range(4)]
    assert [r["status"] for r in records] == ["failed", "ok", "failed", "pruned"]  # pruned is no failure
    assert records[3]["reason"] == "pruned at epoch 1"
    assert records[0]["reason"] == "this model refuses: it needs model.width"
    assert records[2]["reason"] == "RuntimeError: boom in the user's model"
    # the bug's traceback is in that trial's log, not on the sweep's console
    log2 = Path(records[2]["log"]).read_text()
    assert log2 and "Traceback" in log2 and "sweepmodels.py" in log2
    ok = records[1]
    assert ok["objective"] == "test_accuracy" and ok["direction"] == "maximize"
    assert ok["value"] == pytest.approx(json.loads((sweep / "1" / "metrics.json").read_text())["test_accuracy"])
    assert ok["metrics"]["epoch"] == 1 and "history" not in ok["metrics"] and "test_loss" in ok["metrics"]
    assert ok["overrides"][0] == "model._target_=tfkv.models.mlp.build" and ok["num"] == 1
    for r in records:
        assert r["ended"] >= r["started"] and r["duration_s"] >= 0 and Path(r["run_dir"]).is_dir()
    assert records[0]["value"] is None and records[0]["metrics"] == {}
    # the table: printed, and in the sweep directory
    table = [ln for ln in proc.stdout.splitlines() if re.match(r"^\d\*? ", ln)]
    assert [ln.split()[2] for ln in table] == ["failed", "ok", "failed", "pruned"], out
    assert table[1].startswith("1*")
    assert "#2 failed: RuntimeError: boom in the user's model" in proc.stdout
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))
    assert [(r["num"], r["status"]) for r in rows] == [("0", "failed"), ("1", "ok"), ("2", "failed"), ("3", "pruned")]
    assert float(rows[1]["value"]) == pytest.approx(ok["value"]) and float(rows[1]["duration_s"]) > 0
    assert rows[0]["reason"] == records[0]["reason"] and rows[0]["value"] == ""
    assert float(rows[1]["test_loss"]) == pytest.approx(ok["metrics"]["test_loss"])
    summary = json.loads((sweep / "sweep.json").read_text())
    assert summary["best"] == 1 and summary["failed"] == 2 and summary["pruned"] == 1 and len(summary["trials"]) == 4


def test_fail_fast_ends_the_sweep_at_the_first_failure(tmp_path):
    (tmp_path / "sweepmodels.py").write_text(USER_MODULE)
    proc = tfkv_run("-m", "model._target_=sweepmodels.refuses,tfkv.models.mlp.build", "sweep.fail_fast=true",
                    *QUICK, cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = _tfkv_lines(proc.stderr)
    assert "trial #0" in line and "this model refuses" in line and "sweep.fail_fast=true" in line
    sweep = _sweep_dir(tmp_path)
    assert not (sweep / "1").exists()  # the second trial never started
    assert json.loads((sweep / "0" / "trial.json").read_text())["status"] == "failed"
    rows = list(csv.DictReader((sweep / "sweep.csv").open()))  # the table of what ran
    assert [(r["num"], r["status"]) for r in rows] == [("0", "failed")]


def test_a_successful_sweep_exits_0_and_names_the_best_trial_by_direction(tmp_path):
    proc = tfkv_run("-m", "optimizer.lr=0.5,0.0001", "objective=test_loss", "direction=minimize", *QUICK,
                    cwd=tmp_path)
    summary = json.loads((_sweep_dir(tmp_path) / "sweep.json").read_text())
    values = {t["num"]: t["value"] for t in summary["trials"]}
    assert [t["status"] for t in summary["trials"]] == ["ok", "ok"] and values[0] != values[1]
    best = min(values, key=values.get)  # the lower test loss, not the higher
    assert summary["best"] == best and summary["direction"] == "minimize" and summary["objective"] == "test_loss"
    assert f"best: trial #{best} (optimizer.lr=" in proc.stdout


def test_a_sweep_on_a_loss_names_the_lowest_loss_best(tmp_path):
    """direction follows the objective: a loss is minimised without direction=minimize."""
    proc = tfkv_run("-m", "optimizer.lr=0.5,0.0001", "objective=test_loss", *QUICK, cwd=tmp_path)
    sweep = _sweep_dir(tmp_path)
    summary = json.loads((sweep / "sweep.json").read_text())
    losses = {t["num"]: json.loads((sweep / str(t["num"]) / "metrics.json").read_text())["test_loss"]
              for t in summary["trials"]}
    best = min(losses, key=losses.get)
    assert losses[0] != losses[1] and summary["best"] == best and summary["direction"] == "minimize"
    assert f"best: trial #{best} (optimizer.lr=" in proc.stdout


def test_trials_that_return_different_objectives_are_one_line_before_the_first(tmp_path):
    proc = tfkv_run("-m", "metrics=[accuracy],[]", *QUICK, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _tfkv_lines(proc.stderr)
    assert "returns test_accuracy (maximize) but trial metrics=[] test_loss (minimize)" in line, line
    assert not (tmp_path / "multirun").exists()


@pytest.mark.parametrize("args,words", [
    (["objective=test_accuracy,test_acc"], ["trial objective=test_acc:", "did you mean test_accuracy?"]),
    (["optimizer=sgd,adam", "optimizer.momentum=0.9"], ["trial optimizer=adam:", "momentum", "AdamConfig"]),
    (["optimizer.lr=0.1,-1"], ["trial optimizer.lr=-1:", "must be positive"]),
    (["hydra/sweeper=tfkv_optuna", "optimizer.lr=interval(0.01,0.1)", "objective=bogus"],
     ["objective=bogus is not a value this run reports"]),
    (["dataset.test_fraction=0.2,${oc.env:TFKV_TEST_UNSET}"],
     ["trial dataset.test_fraction=${oc.env:TFKV_TEST_UNSET}:", "Environment variable 'TFKV_TEST_UNSET' not found"]),
    (["hydra/launcher=ray"], ["hydra/launcher/ray", "not installed", "pip install hydra-ray-launcher"]),
    (["hydra/sweeper=ax"], ["hydra/sweeper/ax", "pip install hydra-ax-sweeper"]),
])
def test_bad_input_of_any_trial_is_one_line_before_the_first_trial(tmp_path, args, words):
    proc = tfkv_run("-m", *args, *QUICK, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _tfkv_lines(proc.stderr)
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in line, line
    assert not (tmp_path / "multirun").exists()  # no trial started, not even the sweep directory


def test_version_names_tensorflow_hydra_and_zeromq(tmp_path):
    import tensorflow as tf
    import zmq

    proc = tfkv_run("--version", cwd=tmp_path)
    line = proc.stdout.strip()
    for part in (f"tfkv {metadata.version('tfkv')}", f"TensorFlow {tf.__version__}",
                 f"Hydra {metadata.version('hydra-core')}",
                 f"ZeroMQ {zmq.zmq_version()}", f"pyzmq {zmq.__version__}"):
        assert part in line, line


@pytest.mark.slow
def test_a_failed_or_pruned_distributed_trial_is_a_result(tmp_path):
    (tmp_path / "sweepmodels.py").write_text(USER_MODULE)
    proc = tfkv_run("-m", "kvstore=dist_sync", "cluster=local", "cluster.num_workers=1",
                    "model._target_=sweepmodels.buggy,sweepmodels.pruned,tfkv.models.mlp.build", *QUICK,
                    cwd=tmp_path, check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    sweep = _sweep_dir(tmp_path)
    failed, pruned, ok = (json.loads((sweep / str(n) / "trial.json").read_text()) for n in range(3))
    assert failed["status"] == "failed" and "the dist_sync job failed" in failed["reason"], failed
    # worker 0's mark tells the launching process that its job's failure was a pruning
    assert pruned["status"] == "pruned" and pruned["value"] is None, pruned
    assert ok["status"] == "ok" and math.isfinite(ok["value"]), ok
    # each trial was a whole job of its own (its plan in its own directory); the ok one trained
    assert all((sweep / str(n) / "launch" / "plan.json").is_file() for n in range(3))
    assert json.loads((sweep / "2" / "metrics.json").read_text())["epoch"] == 1


def test_precheck_checks_every_value_and_stays_bounded():
    from tfkv.sweep import precheck

    small = {"a": ["a=1", "a=2"], "b": ["b=x", "b=y"], "c": ["c=0"]}
    assert len(precheck.combinations(small)) == 4  # few: every combination
    big = {k: [f"{k}={i}" for i in range(n)] for k, n in (("a", 7), ("b", 5), ("c", 3))}
    rows = precheck.combinations(big)
    assert len(rows) == 7 <= precheck.MAX_CONFIGS  # many (105): each value once, not the product
    for key, values in big.items():
        assert {row[list(big).index(key)] for row in rows} == set(values)


def test_the_trial_record_is_json_without_nan(tmp_path):
    from tfkv.sweep import trial

    assert trial.read(tmp_path) is None
    trial.write(tmp_path, {"num": 0, "status": "failed", "value": float("nan"), "metrics": {"x": float("inf")}})
    assert trial.read(tmp_path) == {"num": 0, "status": "failed", "value": None, "metrics": {"x": None}}
    assert [p.name for p in tmp_path.iterdir()] == [trial.FILE]  # no temporary file left
    with pytest.raises(ValueError):
        trial.write(tmp_path, {"status": "done"})
    assert trial.final_metrics({"epoch": 2, "test_loss": 0.5, "history": [{}], "bad": float("nan")}) == {
        "epoch": 2, "test_loss": 0.5}
