"""A run whose training loss becomes NaN or infinite stops at that step: one line naming the
epoch and the step and the usual causes, a non-zero exit, the last finite checkpoint kept and no
exported model, alone (local and device stores) and on every worker of a distributed job.

The divergence is real, not injected into tfkv: one unnormalised example (1e20 times the others)
in epoch 2's data makes the squared error overflow float32 at a step known in advance."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tfkv import checkpoint

PACKAGE = '''
import numpy as np
import tensorflow as tf

BAD = 70  # the example of epoch 2 that is not normalised


def blows_up(split, epoch):
    """In order (no shuffle), so the bad example's step is known: BAD // batch_size + 1 alone,
    (BAD // 2) // batch_size + 1 on either worker of two (tfkv deals examples round robin)."""
    rng = np.random.default_rng(0 if split == "train" else 1)
    x = rng.standard_normal((256 if split == "train" else 64, 4)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)).astype(np.float32)
    if split == "train" and epoch >= 2:
        x[BAD] *= 1e20
    return tf.data.Dataset.from_tensor_slices((x, y))


def keeps_blowing_up(split, epoch):
    """From epoch 2 on every example overflows float16 (and float32's square)."""
    x, y = zip(*blows_up(split, 1).as_numpy_iterator())
    x = np.stack(x) * (1e20 if split == "train" and epoch >= 2 else 1.0)
    return tf.data.Dataset.from_tensor_slices((x.astype(np.float32), np.stack(y)))
'''

COMMON = ["progress=false", "dataset._target_=divpkg.blows_up", "~dataset.test_fraction",
          "+dataset.num_classes=1", "~model.dropout", "model.hidden=[8]", "loss=mse", "metrics=[mae]", "objective=test_mae",
          "optimizer.lr=0.01", "epochs=3", "batch_size=32"]
LINE = re.compile(r"training diverged: the loss became NaN or infinite at epoch {epoch}, step (\d+) of (\d+) \(worker (\d)\); "
                  r"lower optimizer\.lr, normalise the inputs, or set optimizer\.clipnorm; the last finite checkpoint, "
                  r"(\S+), is kept in ")


def stopped_lines(output: str, epoch: int = 2) -> list[tuple[str, ...]]:
    return re.findall(LINE.pattern.replace("{epoch}", str(epoch)), output)


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    (tmp_path / "divpkg.py").write_text(textwrap.dedent(PACKAGE))
    return tmp_path


def run(project: Path, *overrides: str, timeout: float = 300, run_dir: str = "out") -> subprocess.CompletedProcess:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(project), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-m", "tfkv.cli", f"hydra.run.dir={run_dir}", *COMMON, *overrides], cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout)


def check_stopped(project: Path, r: subprocess.CompletedProcess, step: int | None, epoch: int = 2,
                  run_dir: str = "out") -> list[tuple[str, ...]]:
    """The run stopped at `epoch`, `step` (a worker that stopped later names its own step), in
    one line; the previous epoch's checkpoint is the last and finite, and no model was exported."""
    output = r.stdout + r.stderr  # a distributed job's roles print to tfkv-run's stdout
    assert r.returncode != 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    found = stopped_lines(output, epoch)
    assert found, output[-3000:]
    assert step is None or min(int(s) for s, *_ in found) == step, found
    run_dir = project / run_dir
    newest = checkpoint.latest(run_dir)
    assert newest is not None and {name for *_, name in found} == {newest.name}, (found, newest)
    kept = checkpoint.load(newest)
    assert kept.epoch == epoch - 1 and kept.step == 0
    assert all(np.isfinite(w).all() for w in kept.weights)
    history = json.loads((run_dir / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in history] == list(range(1, epoch)) and np.isfinite(history[-1]["test_mae"])
    assert not (run_dir / "model.keras").exists()
    return found


@pytest.mark.parametrize("placement", [
    ["kvstore=local", "devices=[cpu:0]"],
    ["kvstore=device", "devices=[cpu:0,cpu:1]"],
])
def test_a_run_whose_loss_becomes_nan_stops_there_and_keeps_its_last_finite_checkpoint(
        project: Path, placement: list[str]) -> None:
    r = run(project, *placement)
    found = check_stopped(project, r, step=70 // 32 + 1)
    assert [(steps, worker) for _, steps, worker, _ in found] == [("8", "0")]
    # the line is the last word, once
    assert r.stderr.strip().splitlines()[-1].startswith("tfkv-run: training diverged"), r.stderr[-2000:]


def test_mixed_float16_skips_a_step_that_overflows_and_stops_once_its_scale_is_spent(project: Path) -> None:
    # one overflowing example: its step is skipped (weights kept, scale halved) and training goes on
    r = run(project, "precision=mixed_float16")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not stopped_lines(r.stdout + r.stderr), r.stderr[-3000:]
    # every step overflowing: skipped and halved from 2**15 until the scale is 1, 15 steps (fewer
    # when epoch 1 overflowed on its own at the start), so in epoch 3 of 8-step epochs; the run
    # stops there, epoch 2's checkpoint (epoch 1's weights: every step of epoch 2 was skipped) kept
    r = run(project, "precision=mixed_float16", "dataset._target_=divpkg.keeps_blowing_up", "epochs=4",
            run_dir="persistent")
    check_stopped(project, r, step=None, epoch=3, run_dir="persistent")


@pytest.mark.slow
@pytest.mark.parametrize("kvstore", ["dist_sync", "dist_async"])
def test_every_worker_of_a_distributed_job_stops_at_a_nan_loss(project: Path, kvstore: str) -> None:
    # examples dealt one at a time: the bad one (70, even) is worker 0's 36th, in its step 2 of
    # batches of 32; the others stop on worker 0's failure (or at their own NaN, a step later)
    r = run(project, f"kvstore={kvstore}", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1",
            timeout=420)
    found = check_stopped(project, r, step=(70 // 2) // 32 + 1)
    assert ("2", "4", "0") in {f[:3] for f in found}, found  # worker 0 names its step, of 4
    # the job's final line says why, from worker 0's own line, not only that it exited
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tfkv-run: the {kvstore} job failed: worker 0 exited with status 2: training diverged: "
                           "the loss became NaN or infinite at epoch 2, step 2 of 4 (worker 0)"), r.stderr[-3000:]
