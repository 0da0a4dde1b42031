"""Long jobs (issue 18): checkpoints every N steps, pruned to the newest k, checksummed; an exact
resume from the middle of an epoch, also after kill -9 of a whole dist_sync job; resume=auto; a
kill -9 while a checkpoint is written leaves the one before it valid; SIGUSR1 checkpoints at the
next step and exits 75, resumable."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import tfkv_run
from hydra import compose, initialize_config_dir

from tfkv import check, checkpoint, cli
from tfkv.errors import ConfigError

# 22 steps per epoch: checkpoints after steps 7, 14, 21 (epoch 1) and 28, 35, 42 (epoch 2: 6, 13, 20)
JOB = ["progress=false", "checkpoint.every_steps=7", "model.dropout=0.3", "resume=auto"]


def _weights(ckpt: Path) -> list[np.ndarray]:
    with np.load(ckpt / "weights.npz") as f:
        return [f[k] for k in sorted(f.files)]


def _same_weights(a: Path, b: Path) -> None:
    for x, y in zip(_weights(a), _weights(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """An uninterrupted run of JOB, 2 epochs, keeping the newest 3 checkpoints."""
    root = tmp_path_factory.mktemp("straight")
    proc = tfkv_run(*JOB, "epochs=2", "checkpoint.keep_last=3", "hydra.run.dir=run", cwd=root)
    assert "resume=auto: no checkpoint in" in proc.stdout + proc.stderr  # a fresh start, said once
    return root / "run"


def test_step_checkpoints_are_written_pruned_and_checksummed(straight):
    ckpts = checkpoint.all_in(straight)
    assert [p.name for p in ckpts] == ["epoch-0002-step-000013", "epoch-0002-step-000020", "epoch-0002"]
    assert not list((straight / "checkpoints").glob(".*"))  # no temporary left behind
    state = json.loads((ckpts[0] / "state.json").read_text())
    assert (state["epoch"], state["step"], [h["epoch"] for h in state["history"]]) == (1, 13, [1])
    assert "every_steps: 7" in (ckpts[0] / "config.yaml").read_text()
    assert np.load(ckpts[0] / "rng.npz").files  # dropout's generator state
    if shutil.which("sha256sum"):  # the sums are in the standard tool's format
        subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=ckpts[0], check=True)


def test_a_run_resumed_mid_epoch_ends_with_the_uninterrupted_weights_and_extends(straight, tmp_path):
    """The run directory holds only the mid-epoch checkpoint (as after a kill at step 13 of epoch
    2); the same command with epochs raised to 3 resumes it and goes on."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "epoch-0002-step-000013", run / "checkpoints" / "epoch-0002-step-000013")
    proc = tfkv_run(*JOB, "epochs=3", f"hydra.run.dir={run}", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert "resumed from" in out and "at epoch 1, step 13 of epoch 2 (resume 1 of this run)" in out, out[-2000:]
    # dropout's masks, the data order and the optimizer state all continue: bit-identical weights
    _same_weights(run / "checkpoints" / "epoch-0002", straight / "checkpoints" / "epoch-0002")
    metrics = json.loads((run / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3] and metrics["epoch"] == 3
    clean = json.loads((straight / "metrics.json").read_text())["history"]
    assert metrics["history"][1]["test_accuracy"] == clean[1]["test_accuracy"]
    assert metrics["history"][1]["resumed_at_step"] == 13
    (resume,) = metrics["resumes"]
    assert (resume["epoch"], resume["step"]) == (1, 13) and resume["from"].endswith("epoch-0002-step-000013")


@pytest.mark.parametrize("override,message", [
    ("checkpoint.keep_last=0", "checkpoint.keep_last=0 must be at least 1, or null"),
    ("checkpoint.every_steps=-5", "checkpoint.every_steps=-5 must be at least 1, or null"),
    ("checkpoint.every_minutes=-1.5", "checkpoint.every_minutes=-1.5 must be positive, or null"),
    ("checkpoint.every_minutes=0", "checkpoint.every_minutes=0.0 must be positive, or null"),
])
def test_bad_checkpoint_settings_are_refused_at_the_edge(override, message):
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[override])
    with pytest.raises(ConfigError) as e:
        check.validate(cfg)
    assert str(e.value) == message + (" (no step checkpoints)" if "every_steps" in override else
                                      " (keep every checkpoint)" if "keep_last" in override else
                                      " (no timed checkpoints)")


def test_keep_last_zero_is_one_line_and_exit_2_before_training(tmp_path):
    proc = tfkv_run("checkpoint.keep_last=0", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert "checkpoint.keep_last=0 must be at least 1" in line


def test_policy_counts_steps_and_minutes():
    now = [0.0]
    policy = checkpoint.Policy(every_steps=5, every_minutes=1, clock=lambda: now[0])
    assert [s for s in range(1, 16) if policy.due(s)] == [5, 10, 15]
    now[0] = 61
    assert policy.due(3)
    policy.saved()
    assert not policy.due(4)


# A checkpoint save in its own process, killed -9 while it writes: the previous checkpoint stays
# the newest valid one, and the next save clears what the killed one left.
SAVER = """
import sys, time, numpy as np
from pathlib import Path
from tfkv import checkpoint

def slow_optimizer(path):
    np.savez(path, m=np.zeros(3, np.float32))
    print("writing", flush=True)
    time.sleep(60)

w = [np.full((2, 3), float(sys.argv[2]), np.float32)]
checkpoint.save(Path(sys.argv[1]), int(sys.argv[2]), w, ["w"], slow_optimizer if sys.argv[3] == "slow" else
                (lambda p: np.savez(p, m=np.zeros(3, np.float32))), [], config="x: 1\\n")
"""


def test_kill_9_while_a_checkpoint_is_written_leaves_the_previous_one_valid(tmp_path):
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-c", SAVER, str(run), "1", "fast"], check=True, timeout=60)
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(run), "2", "slow"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [".epoch-0002.tmp", "epoch-0001"]
    found = checkpoint.find_resume("auto", run, tmp_path, [])
    assert found == run / "checkpoints" / "epoch-0001" and checkpoint.load(found).weights[0][0, 0] == 1.0
    subprocess.run([sys.executable, "-c", SAVER, str(run), "2", "fast"], check=True, timeout=60)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["epoch-0001", "epoch-0002"]


# -- a whole dist_sync job killed -9 mid-epoch, then the same command again ----------------------

DIST = ["kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", "epochs=4",
        "deterministic=true", "progress=false", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
        "resume=auto", "hydra.run.dir=run"]


@pytest.mark.slow
def test_a_dist_sync_job_killed_mid_epoch_and_rerun_ends_with_the_uninterrupted_weights(tmp_path):
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    clean.mkdir(), crashed.mkdir()
    tfkv_run(*DIST, cwd=clean, timeout=240)

    job = subprocess.Popen(["tfkv-run", *DIST], cwd=crashed, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # its own process group: the whole job, killed at once
    deadline = time.monotonic() + 240
    try:
        while not list((crashed / "run" / "checkpoints").glob("epoch-0003-step-*")):
            assert job.poll() is None and time.monotonic() < deadline, "the job ended before it could be killed"
            time.sleep(0.02)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
    assert not (crashed / "run" / "checkpoints" / "epoch-0004").exists()

    proc = tfkv_run(*DIST, cwd=crashed, timeout=240)  # the same command, as a requeued job runs it
    assert "resumed from" in proc.stdout + proc.stderr
    run = crashed / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4] and len(metrics["resumes"]) == 1
    assert metrics["resumes"][0]["step"] > 0, metrics["resumes"]  # killed, and resumed, mid-epoch
    _same_weights(run / "checkpoints" / "epoch-0004", clean / "run" / "checkpoints" / "epoch-0004")
    np.testing.assert_array_equal(*(np.load(r / "checkpoints" / "epoch-0004" / "optimizer.npz")["0/momentum"]
                                    for r in (run, clean / "run")))


# -- preemption: SIGUSR1 (Slurm's --signal=USR1@<seconds>) ---------------------------------------

PREEMPTIBLE = ["batch_size=8", "optimizer.lr=0.02", "epochs=2", "progress=false", "checkpoint.every_steps=50",
               "resume=auto", "hydra.run.dir=run"]  # 179 steps per epoch


@pytest.mark.slow
def test_sigusr1_checkpoints_at_the_next_step_exits_75_and_the_same_command_continues_exactly(tmp_path):
    clean, preempted = tmp_path / "clean", tmp_path / "preempted"
    clean.mkdir(), preempted.mkdir()
    baseline = subprocess.Popen(["tfkv-run", *PREEMPTIBLE], cwd=clean, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # beside the preempted run: the suite's time
    job = subprocess.Popen(["tfkv-run", *PREEMPTIBLE], cwd=preempted, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list((preempted / "run" / "checkpoints").glob("epoch-0001-step-000050")):
            assert job.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
            time.sleep(0.01)
        job.send_signal(signal.SIGUSR1)
        _, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 75, err[-2000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("tfkv-run:")]
    newest = checkpoint.latest(preempted / "run")
    assert f"preempted (SIGUSR1): checkpoint {newest.name} is in" in line and "resume=auto" in line, line
    assert newest.name.startswith("epoch-0001-step-") or newest.name.startswith("epoch-0002-step-"), newest

    tfkv_run(*PREEMPTIBLE, cwd=preempted)  # the same command again, as a requeued job runs it
    assert baseline.wait(timeout=240) == 0
    _same_weights(preempted / "run" / "checkpoints" / "epoch-0002", clean / "run" / "checkpoints" / "epoch-0002")
    metrics = json.loads((preempted / "run" / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2] and len(metrics["resumes"]) == 1
