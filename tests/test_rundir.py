"""A run directory belongs to one job at a time (tfkv.checkpoint.lock): two real `tfkv-run`
processes on one `hydra.run.dir`, a refused one that leaves every file of the running one as it
was, and a requeue after the holder was killed with SIGKILL. An evaluation (eval_only) into a
run's own directory records beside the run's results, never over them (tfkv.rundir)."""

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import tfkv_run


@pytest.mark.slow
def test_a_second_job_on_a_run_directory_in_use_is_refused_and_a_requeue_after_kill_9_resumes(tmp_path):
    run = tmp_path / "run"
    args = ["progress=false", "resume=auto", f"hydra.run.dir={run}"]
    first = subprocess.Popen(["tfkv-run", "epochs=200", *args], cwd=tmp_path, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        next(ln for ln in first.stdout if "epoch 2/200" in ln)  # its checkpoints are being written
        second = tfkv_run("epochs=200", *args, cwd=tmp_path, check=False, timeout=120)
        assert first.poll() is None, "the first job must still run"
        lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert (f"the run directory {run} is in use by another tfkv-run job (pid {first.pid} on "
                f"{socket.gethostname()} since ") in lines[0], lines
        assert "epoch 1/" not in second.stdout  # it neither resumed nor trained
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    finally:
        first.kill()
        first.wait()
    newest = max(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("epoch-*"))
    # the requeue: the same command once the holder is gone, one epoch more than it checkpointed
    requeue = tfkv_run(f"epochs={newest + 1}", *args, cwd=tmp_path, timeout=300)
    assert f"epoch {newest + 1}/{newest + 1}" in requeue.stdout, requeue.stdout
    metrics = json.loads((run / "metrics.json").read_text())
    assert len(metrics["history"]) == newest + 1 and metrics["resumes"], metrics.keys()


def _files(run: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `run`: its bytes (the lock file's size: opening and closing it would end a
    lock this process holds) and its modification time (ns)."""
    return {str(p.relative_to(run)): (p.read_bytes() if p.name != ".tfkv.lock" else p.stat().st_size,
                                      p.stat().st_mtime_ns) for p in sorted(run.rglob("*")) if p.is_file()}


def _refused(second: subprocess.CompletedProcess, run: Path, holder: int) -> None:
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert f"the run directory {run} is in use by another tfkv-run job (pid {holder} on " in lines[0], lines


def test_a_refused_job_writes_nothing_into_the_directory_in_use(tmp_path):
    """The lock is taken before Hydra writes .hydra/ (tfkv.rundir): a second job refused by it
    leaves every file as it was, the same bytes and times, and adds none."""
    from tfkv.checkpoint import lock

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    for name, text in {".hydra/config.yaml": "seed: 0\n", ".hydra/overrides.yaml": "[]\n",
                       "config_resolved.yaml": "seed: 0\n", "tfkv.log": "epoch 1/9\n"}.items():
        (run / name).write_text(text)
    with lock.hold(run):  # this process is the running job
        before = _files(run)
        second = tfkv_run("seed=1", "epochs=1", f"hydra.run.dir={run}", cwd=tmp_path, check=False, timeout=120)
        assert _files(run) == before
    _refused(second, run, os.getpid())


@pytest.mark.slow
def test_a_job_refused_by_a_running_one_leaves_every_file_of_it_untouched(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(["tfkv-run", "epochs=200", "progress=false", f"hydra.run.dir={run}"], cwd=tmp_path,
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        next(ln for ln in first.stdout if "epoch 1/200" in ln)  # training, its files written
        first.send_signal(signal.SIGSTOP)  # nothing of it changes its files now
        before = _files(run)
        assert {".hydra/config.yaml", ".hydra/overrides.yaml", "config_resolved.yaml", "knobs.json"} <= set(before)
        second = tfkv_run("epochs=3", "seed=7", "progress=false", f"hydra.run.dir={run}", cwd=tmp_path,
                          check=False, timeout=120)
        assert _files(run) == before  # bytes and times of every file, and no file more
        _refused(second, run, first.pid)
        first.send_signal(signal.SIGCONT)
        assert first.poll() is None, "the first job must still run"
    finally:
        first.kill()
        first.wait()


def _keras_test_metrics(ckpt: Path) -> tuple[float, float]:
    """(loss, accuracy) of a digits MLP checkpoint's weights on the test split, by plain Keras:
    the inputs normalised by the training split's statistics, as the pipeline gives them."""
    import keras
    import numpy as np

    from tfkv import checkpoint
    from tfkv.data import digits

    ds = digits.load()
    x = (ds.x_test - np.float32(ds.mean[0])) / np.float32(ds.std[0])
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(256, "relu"),
                              keras.layers.Dense(128, "relu"), keras.layers.Dense(10)])
    model.set_weights(checkpoint.load(ckpt).weights)
    logits = model.predict(x, verbose=0)
    loss = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(ds.y_test, logits))
    return loss, float(np.mean(np.argmax(logits, axis=1) == ds.y_test))


@pytest.mark.slow
def test_eval_only_into_the_runs_own_directory_keeps_its_results_and_records_beside_them(tmp_path):
    """After a 3-epoch run in R, eval_only of epoch 1's checkpoint into R: the run's model,
    metrics and records stay as they were; the evaluation is R/eval/epoch-0001/, its numbers
    those of plain Keras on the checkpoint's weights. Into a fresh directory it is at the top."""
    run = tmp_path / "R"
    args = ["epochs=3", "steps_per_epoch=3", "progress=false"]
    tfkv_run(*args, f"hydra.run.dir={run}", cwd=tmp_path)
    kept = {name: body for name, (body, _) in _files(run).items()  # (the log and the lock are each job's)
            if name not in ("tfkv.log", ".tfkv.lock") and "/" not in name or name.startswith(".hydra/")}
    assert {"model.keras", "metrics.json", "config_resolved.yaml", ".hydra/overrides.yaml"} <= set(kept)
    ckpt = run / "checkpoints" / "epoch-0001"
    proc = tfkv_run(*args, f"hydra.run.dir={run}", f"resume={ckpt}", "eval_only=true", cwd=tmp_path)
    assert {name: _files(run)[name][0] for name in kept} == kept  # model.keras, metrics.json, ... as they were
    assert len(json.loads((run / "metrics.json").read_text())["history"]) == 3
    record = run / "eval" / "epoch-0001"
    assert f"run directory {record}" in proc.stdout
    evaluated = json.loads((record / "metrics.json").read_text())
    loss, accuracy = _keras_test_metrics(ckpt)
    assert evaluated["epoch"] == 1 and evaluated["checkpoint"] == str(ckpt)
    assert evaluated["test_loss"] == pytest.approx(loss, rel=1e-5)
    assert evaluated["test_accuracy"] == pytest.approx(accuracy, abs=1e-7)
    assert (record / "model.keras").is_file() and "eval_only: true" in (record / "config_resolved.yaml").read_text()
    # into a fresh directory, what any run leaves: at its top
    fresh = tmp_path / "E"
    tfkv_run(*args, f"hydra.run.dir={fresh}", f"resume={run}", "eval_only=true", cwd=tmp_path)
    again = json.loads((fresh / "metrics.json").read_text())
    assert again["checkpoint"] == str(run / "checkpoints" / "epoch-0003") and not (fresh / "eval").exists()
    assert {"model.keras", "config_resolved.yaml", ".hydra/overrides.yaml"} <= set(_files(fresh))
    assert again["test_loss"] == pytest.approx(_keras_test_metrics(run / "checkpoints" / "epoch-0003")[0], rel=1e-5)
