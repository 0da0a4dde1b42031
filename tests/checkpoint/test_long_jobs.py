"""Long jobs (issue 18): checkpoints every N steps, pruned to the newest k, checksummed; an exact
resume from the middle of an epoch, also after kill -9 of a whole dist_sync job; resume=auto; a
kill -9 while a checkpoint is written leaves the one before it valid; SIGUSR1 (SIGTERM to a single
run) checkpoints at the next step and exits 75, resumable; under Slurm the job requeues itself and
goes on; cluster.max_restarts restarts a job that lost a worker."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from cluster_daemons import slurm  # noqa: F401
from cluster_hosts import loopback_host, netns_hosts, ssh_site  # noqa: F401
from conftest import TAG, tagged_pids, tfkv_run
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
    ("cluster.max_restarts=-1", "cluster.max_restarts=-1 must be at least 0"),
])
def test_bad_checkpoint_and_restart_settings_are_refused_at_the_edge(override, message):
    with initialize_config_dir(config_dir=cli.conf_dir(), version_base="1.3"):
        cfg = compose("config", overrides=[override, "kvstore=dist_sync", "cluster=local"])
    with pytest.raises(ConfigError) as e:
        check.validate(cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


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
from typing import Callable
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


def test_tfkv_launch_max_restarts_starts_a_failed_job_again_and_records_why(tmp_path):
    """Any command: the first attempt's worker fails, the restarted job runs to its end."""
    worker = f"{sys.executable} {Path(__file__).parents[1] / 'workers' / 'dist_worker.py'} updates out{{rank}}.json 2"
    proc = subprocess.run(["tfkv-launch", "-n", "1", "--launcher", "local", "--run-dir", "rec", "--max-restarts", "2",
                           "--", "sh", "-c", f"if [ -e tried ]; then exec {worker}; fi; touch tried; exit 5"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("tfkv: restart 1 of 2: worker 0 exited with status 5") == 1, proc.stdout
    (restart,) = json.loads((tmp_path / "rec" / "launch" / "restarts.json").read_text())
    assert (restart["attempt"], restart["cause"]) == (1, "worker 0 exited with status 5")
    assert (tmp_path / "out0.json").is_file()  # the restarted worker's result


# -- a whole dist_sync job preempted, killed -9 mid-epoch, and run again -------------------------

DIST = ["kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", "epochs=2",
        "batch_size=16", "deterministic=true", "progress=false", "checkpoint.every_steps=4",
        "checkpoint.keep_last=2", "resume=auto", "hydra.run.dir=run", "cluster.max_restarts=1"]
# (44 steps per epoch and worker)


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    """tfkv-run in its own process group (the whole job, killed at once), its output in cwd/out.txt."""
    with open(cwd / "out.txt", "w") as out:
        return subprocess.Popen(["tfkv-run", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _kill(job: subprocess.Popen) -> None:
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the job ended, every process of it
    job.wait(timeout=30)


def _wait_for_checkpoint(job: subprocess.Popen, run: Path, past: Path | None = None) -> Path:
    """The first step checkpoint newer than `past` (by position) the running job writes."""
    deadline = time.monotonic() + 240
    while True:
        newest = checkpoint.latest(run)
        if newest is not None and "-step-" in newest.name and (past is None or
                                                               checkpoint.position(newest) > checkpoint.position(past)):
            return newest
        assert job.poll() is None and time.monotonic() < deadline, "the job ended before it could be stopped"
        time.sleep(0.01)


def _worker_pid(job: subprocess.Popen, rank: int) -> int:
    """The process of worker `rank` among the launcher's children (the local launcher's roles)."""
    for task in Path(f"/proc/{job.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if b"tfkv.worker" in Path(f"/proc/{child}/cmdline").read_bytes() and f"TFKV_RANK_HINT={rank}".encode() in environ:
                return int(child)
    raise AssertionError(f"worker {rank} is not running")


def _preempted(job: subprocess.Popen, cwd: Path, signame: str, lines: int = 1) -> Path:
    """The checkpoint a preempted job (run in cwd/run) ended at: status 75 and its `lines` lines,
    the first naming the checkpoint."""
    out = (cwd / "out.txt").read_text()
    assert job.returncode == 75, out[-3000:]
    said = [ln for ln in out.splitlines() if ln.startswith("tfkv-run:")]
    assert len(said) == lines, said
    line = said[0]
    preempted = checkpoint.latest(cwd / "run")
    assert f"preempted ({signame}): checkpoint {preempted.name} is in" in line, line
    return preempted


@pytest.fixture(scope="module")
def dist_straight(tmp_path_factory):
    """An uninterrupted DIST job, started when a test first asks for it and run beside the stopped
    jobs (the suite's time); calling the fixture's value waits for it and gives its run directory."""
    root = tmp_path_factory.mktemp("dist_straight")
    job = _start(DIST, root)

    def done() -> Path:
        assert job.wait(timeout=240) == 0, (root / "out.txt").read_text()[-3000:]
        return root / "run"
    yield done
    _kill(job)


@pytest.mark.slow
@pytest.mark.xdist_group("dist_straight")  # one worker of pytest-xdist: they share the baseline
def test_a_dist_sync_job_preempted_killed_and_restarted_ends_with_the_uninterrupted_weights(dist_straight, tmp_path):
    """SIGUSR1 to the launcher: worker 0 checkpoints at a step's end, the job exits 75; the same
    command again is killed -9 whole in the middle of an epoch; the same command once more resumes,
    loses worker 1 to kill -9 mid-epoch, restarts itself (cluster.max_restarts=1) and ends with
    the weights and optimizer state of a job that was never stopped."""
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    run = crashed / "run"

    job = _start(DIST, crashed)
    try:
        _wait_for_checkpoint(job, run)
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=120)
    finally:
        _kill(job)
    preempted = _preempted(job, crashed, "SIGUSR1")
    assert not (run / "checkpoints" / "epoch-0002").exists() and not list(run.glob(".preempt*"))

    job = _start(DIST, crashed)
    try:
        killed_after = _wait_for_checkpoint(job, run, past=preempted)
    finally:
        _kill(job)
    assert not (run / "checkpoints" / "epoch-0002").exists()

    job = _start(DIST, crashed)
    try:
        restarted_after = _wait_for_checkpoint(job, run, past=killed_after)
        os.kill(_worker_pid(job, 1), signal.SIGKILL)
        job.wait(timeout=240)
    finally:
        _kill(job)
    out = (crashed / "out.txt").read_text()
    assert job.returncode == 0, out[-3000:]
    assert f"resumed from {killed_after}" in out  # the whole job's kill -9: resumed mid-epoch
    assert "tfkv: restart 1 of 1: worker 1 was killed by SIGKILL" in out
    (restart,) = json.loads((run / "launch" / "restarts.json").read_text())
    assert restart["cause"] == "worker 1 was killed by SIGKILL"
    clean = dist_straight()
    metrics = json.loads((run / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert [r["from"] for r in metrics["resumes"]][:2] == [str(preempted), str(killed_after)], metrics["resumes"]
    assert len(metrics["resumes"]) == 3 and checkpoint.position(Path(metrics["resumes"][2]["from"])) >= \
        checkpoint.position(restarted_after)
    _same_weights(run / "checkpoints" / "epoch-0002", clean / "checkpoints" / "epoch-0002")
    np.testing.assert_array_equal(*(np.load(r / "checkpoints" / "epoch-0002" / "optimizer.npz")["0/momentum"]
                                    for r in (run, clean)))


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


@pytest.mark.slow
@pytest.mark.xdist_group("dist_straight")  # one worker of pytest-xdist: they share the baseline
def test_sigterm_to_every_process_of_a_dist_sync_job_checkpoints_exits_75_and_the_same_command_continues(
        dist_straight, tmp_path):
    """SIGTERM mid-epoch to every process of the job at once, as Slurm sends it (the launcher's
    group and each role's): the servers and the scheduler serve on, worker 0 checkpoints at its
    next step, every process ends, status 75; the same command (resume=auto) ends with the weights
    and optimizer state of a job that was never stopped. (SIGTERM to tfkv-run alone raises the
    same flag as SIGUSR1 does, above: tests/launcher/test_launcher.py checks it is raised.)"""
    run = tmp_path / "run"
    job = _start(DIST, tmp_path)
    try:
        _wait_for_checkpoint(job, run)
        roles = [int(c) for task in Path(f"/proc/{job.pid}/task").iterdir()
                 for c in (task / "children").read_text().split()]  # each the leader of its own group
        assert len(roles) == 4, roles  # scheduler, server, 2 workers
        for group in [job.pid, *roles]:
            os.killpg(group, signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        _kill(job)
    preempted = _preempted(job, tmp_path, "SIGTERM")
    assert "-step-" in preempted.name  # mid-epoch
    for group in [job.pid, *roles]:  # no process of the job is left, in any of its groups
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)

    job = _start(DIST, tmp_path)  # the same command again, as a requeued job runs it
    assert job.wait(timeout=240) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    assert f"resumed from {preempted}" in (tmp_path / "out.txt").read_text()
    _same_weights(run / "checkpoints" / "epoch-0002", dist_straight() / "checkpoints" / "epoch-0002")
    np.testing.assert_array_equal(*(np.load(r / "checkpoints" / "epoch-0002" / "optimizer.npz")["0/momentum"]
                                    for r in (run, dist_straight())))


@pytest.mark.slow
def test_a_compressed_dist_sync_job_preempted_at_any_step_continues_with_every_workers_residuals(tmp_path):
    """2-bit compression (2bit: residuals and velocities on each worker): SIGUSR1 is seen by worker
    0 alone, at a step of its own; the vote after each step makes worker 1 hand its state over at
    that step too, so the checkpoint holds both workers' and the same command continues to the
    weights of a job never stopped."""
    compressed = [*DIST, "kvstore.compression.type=2bit"]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    straight.mkdir()
    crashed.mkdir()
    clean = _start(compressed, straight)
    job = _start(compressed, crashed)
    try:
        _wait_for_checkpoint(job, crashed / "run")
        job.send_signal(signal.SIGUSR1)
        job.wait(timeout=120)
    finally:
        _kill(job)
    preempted = _preempted(job, crashed, "SIGUSR1")
    with np.load(preempted / "optimizer.npz") as f:
        for rank in (0, 1):
            assert any(f[k].any() for k in f.files if k.startswith(f"worker_feedback/{rank}/") and "residual" in k)
    job = _start(compressed, crashed)
    assert job.wait(timeout=240) == 0, (crashed / "out.txt").read_text()[-3000:]
    out = (crashed / "out.txt").read_text()
    assert f"resumed from {preempted}" in out and "start from zero" not in out
    assert clean.wait(timeout=240) == 0, (straight / "out.txt").read_text()[-3000:]
    _same_weights(crashed / "run" / "checkpoints" / "epoch-0002", straight / "run" / "checkpoints" / "epoch-0002")


# -- preemption of a single process: SIGTERM (SIGUSR1: the Slurm test below) ---------------------

@pytest.mark.slow
def test_sigterm_to_a_single_run_checkpoints_exits_75_and_the_same_command_continues_exactly(straight, tmp_path):
    """The straight run's command, signalled once its handler is in place (the log's resume line):
    checkpoint after step 1, status 75; the same command again ends with the straight weights."""
    args = [*JOB, "epochs=2", "checkpoint.keep_last=3", "hydra.run.dir=run"]
    job = subprocess.Popen(["tfkv-run", *args], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        lines = []
        for line in job.stdout:
            lines.append(line)
            if "resume=auto: no checkpoint in" in line:
                job.send_signal(signal.SIGTERM)
                break
        lines += job.stdout.readlines()
        job.wait(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 75, "".join(lines)[-3000:]
    (line,) = [ln for ln in lines if ln.startswith("tfkv-run:")]
    assert "preempted (SIGTERM): checkpoint epoch-0001-step-000001 is in" in line and "resume=auto" in line, line
    assert [p.name for p in checkpoint.all_in(tmp_path / "run")] == ["epoch-0001-step-000001"]

    proc = tfkv_run(*args, cwd=tmp_path)  # the same command again, as a requeued job runs it
    assert "at epoch 0, step 1 of epoch 1" in proc.stdout + proc.stderr
    _same_weights(tmp_path / "run" / "checkpoints" / "epoch-0002", straight / "checkpoints" / "epoch-0002")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2] and len(metrics["resumes"]) == 1


# -- Ctrl-C while a checkpoint is being written ----------------------------------------------------

# A model of 4.3 M weights (17 MB, and as much SGD momentum): its checkpoint's files take tens of
# milliseconds to write, long enough to be caught in the middle, at every second step.
BIG = ["progress=false", "model.hidden=[2048,2048]", "checkpoint.every_steps=2", "checkpoint.keep_last=2",
       "resume=auto", "hydra.run.dir=run"]


def _stopped_while_writing(job: subprocess.Popen, run: Path) -> str:
    """The name of a checkpoint whose files `job` was writing when it was stopped (SIGSTOP); its
    temporary directory has not got its last file, state.json, yet."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:
        staged = [p for p in (run / "checkpoints").glob(".epoch-*.tmp")] if (run / "checkpoints").is_dir() else []
        if staged:
            job.send_signal(signal.SIGSTOP)
            if staged[0].is_dir() and not (staged[0] / "state.json").exists():
                return staged[0].name[1:-len(".tmp")]
            job.send_signal(signal.SIGCONT)  # caught too late: the next one
            while staged[0].exists() and job.poll() is None:
                time.sleep(0.001)
        time.sleep(0.001)
    raise AssertionError("no checkpoint was caught being written")


@pytest.mark.slow
def test_ctrl_c_while_a_checkpoint_is_written_publishes_it_exits_130_and_the_run_resumes_from_it(tmp_path):
    job = subprocess.Popen(["tfkv-run", "epochs=3", *BIG], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        name = _stopped_while_writing(job, tmp_path / "run")
        job.send_signal(signal.SIGINT)  # Ctrl-C, in the middle of the checkpoint's files
        job.send_signal(signal.SIGCONT)
        out, err = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 130, err[-3000:]
    written = tmp_path / "run" / "checkpoints" / name
    assert written.is_dir(), f"{name} was dropped: {sorted(p.name for p in written.parent.iterdir())}"
    ckpt = checkpoint.load(written)  # complete: every file there and matching its checksum
    assert (ckpt.epoch, ckpt.step) == checkpoint.position(written) and len(ckpt.weights) == 6
    assert not list((tmp_path / "run" / "checkpoints").glob(".*"))
    assert "finishing the checkpoint being written first" in out, out[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line.startswith("tfkv-run: interrupted") and f"checkpoint {name} is in" in line, line
    # the same command again goes on from it, to the end of its epoch
    epoch = ckpt.epoch + 1
    again = tfkv_run(f"epochs={epoch}", *BIG, cwd=tmp_path, timeout=300)
    at = f", step {ckpt.step} of epoch {epoch}" if ckpt.step else ""  # (an epoch's end: at the epoch alone)
    assert f"resumed from {written} at epoch {ckpt.epoch}{at} (resume" in again.stdout, again.stdout[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == list(range(1, epoch + 1))


DIST_BIG = ["kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", *BIG]


def _ctrl_c_while_worker_0_writes(job: subprocess.Popen, run: Path,
                                  worker_0: Callable[[], int]) -> tuple[str, str, str]:
    """A terminal's Ctrl-C (SIGINT to the launcher's process group) to a dist job while worker 0
    (`worker_0()`, once the job has a checkpoints directory) is stopped (SIGSTOP) writing a
    checkpoint, before it pulled the servers' optimizer state; worker 0 is let go on 1 s later,
    when a teardown that did not wait for it would have ended the servers. The checkpoint's
    name, the job's output and its errors."""
    deadline = time.monotonic() + 300
    while not (run / "checkpoints").is_dir():
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()
        time.sleep(0.01)
    worker0 = worker_0()
    while True:  # worker 0 stopped with the servers' optimizer state still to pull
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint was caught being written"
        staged = list((run / "checkpoints").glob(".epoch-*.tmp"))
        if staged:
            os.kill(worker0, signal.SIGSTOP)
            if staged[0].is_dir() and not (staged[0] / "optimizer.npz").exists():
                name = staged[0].name[1:-len(".tmp")]
                break
            os.kill(worker0, signal.SIGCONT)
            while staged[0].exists() and job.poll() is None:
                time.sleep(0.001)
        time.sleep(0.001)
    os.killpg(job.pid, signal.SIGINT)  # Ctrl-C at the terminal
    time.sleep(1)  # the launcher's teardown would have ended the servers by now
    with contextlib.suppress(ProcessLookupError):  # (or worker 0 itself: the defect)
        os.kill(worker0, signal.SIGCONT)
    out, err = job.communicate(timeout=120)
    return name, out, err


def _published_whole(job: subprocess.Popen, run: Path, name: str, out: str, err: str) -> checkpoint.Checkpoint:
    """The checkpoint `name` that a Ctrl-C caught being written (_ctrl_c_while_worker_0_writes):
    published whole, with the servers' optimizer state, the job ended with status 130."""
    assert job.returncode == 130, (out + err)[-3000:]
    written = run / "checkpoints" / name
    assert written.is_dir(), f"{name} was dropped: {sorted(p.name for p in written.parent.iterdir())}\n{out}\n{err}"
    ckpt = checkpoint.load(written)  # complete: every file there and matching its checksum
    assert (ckpt.epoch, ckpt.step) == checkpoint.position(written)
    with np.load(written / "optimizer.npz") as state:  # the servers' momentum, pulled after the Ctrl-C
        assert np.abs(state["0/momentum"]).sum() > 0
    assert not list((run / "checkpoints").glob(".*"))
    assert "finishing the checkpoint being written first" in out, out[-3000:]
    return ckpt


@pytest.mark.slow
def test_ctrl_c_while_worker_0_of_a_dist_sync_job_writes_a_checkpoint_publishes_it_exits_130_and_resumes(tmp_path):
    """Issue 40, point 14: a terminal's Ctrl-C while worker 0 is writing a checkpoint, before it
    pulled the servers' optimizer state: the launcher passes it on to the workers and tears the
    job down only once they ended, so the servers still answer and the checkpoint is published
    whole; status 130, no process left; the same command goes on from it."""
    run = tmp_path / "run"
    job = subprocess.Popen(["tfkv-run", "epochs=3", *DIST_BIG], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    roles: list[int] = []

    def worker_0() -> int:
        roles.extend(int(c) for task in Path(f"/proc/{job.pid}/task").iterdir()
                     for c in (task / "children").read_text().split())
        return _worker_pid(job, 0)

    try:
        name, out, err = _ctrl_c_while_worker_0_writes(job, run, worker_0)
    finally:
        _kill(job)
    ckpt = _published_whole(job, run, name, out, err)
    assert f"checkpoint {name} is in" in [ln for ln in err.splitlines() if ln.startswith("tfkv-run:")][-1], err
    for group in roles:  # no process of the job is left, in any of its groups
        with pytest.raises(ProcessLookupError):
            os.killpg(group, 0)
    epoch = ckpt.epoch + 1
    again = tfkv_run(f"epochs={epoch}", *DIST_BIG, cwd=tmp_path, timeout=600)
    assert f"resumed from {run / 'checkpoints' / name}" in again.stdout + again.stderr, again.stdout[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == list(range(1, epoch + 1))


def _remote_worker_pid(tag: str, rank: int) -> int:
    """The process of worker `rank` of the ssh job tagged `tag` (not its wrapper, whose command
    line carries the role's too)."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (b"tfkv.worker" in cmdline and b"tfkv-ssh" not in cmdline and f"{TAG}={tag}".encode() in environ
                and f"TFKV_RANK_HINT={rank}".encode() in environ):
            return int(proc.name)
    raise AssertionError(f"worker {rank} is not running")


@pytest.mark.slow
def test_ctrl_c_while_worker_0_of_a_dist_sync_job_over_ssh_writes_a_checkpoint_publishes_it_and_exits_130(
        loopback_host, ssh_site, tmp_path):  # noqa: F811
    """Issue 40, point 14, on the ssh launcher (real sshd on 127.0.0.1): the Ctrl-C reaches worker
    0's remote group as SIGINT over ssh, and the teardown waits for it, so the checkpoint it is
    writing is published whole; status 130, no process left on the host."""
    tag = f"ctrlc-ssh-{tmp_path.name}-{os.getpid()}"
    (tmp_path / "hosts").write_text(f"{loopback_host.alias}\n")
    run = tmp_path / "run"
    job = subprocess.Popen(
        ["tfkv-run", "epochs=3", "kvstore=dist_sync", "cluster=ssh", "cluster.hostfile=hosts",
         "cluster.num_workers=2", "cluster.num_servers=1", f"cluster.python={sys.executable}", *BIG],
        cwd=tmp_path, env={**os.environ, **ssh_site.env(), TAG: tag}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        name, out, err = _ctrl_c_while_worker_0_writes(job, run, lambda: _remote_worker_pid(tag, 0))
    finally:
        _kill(job)
    _published_whole(job, run, name, out, err)
    assert not tagged_pids(tag, wait=15), "processes of the job left behind"


# -- a Slurm batch job preempted (SIGUSR1 ahead of it), requeued, and continued -------------------

def _slurm_job(job_id: str, env: dict[str, str], done, timeout: float = 120) -> dict[str, str]:
    """`scontrol show job` of `job_id`, polled until `done(fields)`."""
    from tfkv.launcher import requeue

    deadline = time.monotonic() + timeout
    while True:
        fields = requeue.job_fields(job_id, env)
        if done(fields):
            return fields
        assert time.monotonic() < deadline, f"Slurm job {job_id}: {fields}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_slurm_job_signalled_mid_epoch_requeues_itself_and_ends_with_the_uninterrupted_weights(
        slurm, straight, tmp_path):  # noqa: F811
    """The README's batch script on the real Slurm daemons: `scancel --signal=USR1 --batch` (what
    --signal=B:USR1@N sends ahead of a preemption) after the first step checkpoint; tfkv-run
    checkpoints at the next step, requeues its job (Restarts=1), and the job, started again by
    Slurm with the same command and run directory, ends with the straight run's weights."""
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n#SBATCH --requeue --signal=B:USR1@120 --open-mode=append\n"
                      f"exec tfkv-run {' '.join(JOB)} epochs=2 checkpoint.keep_last=3 "
                      "'hydra.run.dir=outputs/slurm-${oc.env:SLURM_JOB_ID}'\n")
    env = {**slurm.env, "PYTHONUNBUFFERED": "1"}
    job_id = subprocess.run(["sbatch", "--parsable", "-o", "job.out", str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    run, log = tmp_path / "outputs" / f"slurm-{job_id}", tmp_path / "job.out"
    deadline = time.monotonic() + 120
    # the resume line: the handler is in place and the first step (a second or more: the step is
    # traced) is ahead; a whole epoch of this job is shorter than scancel's way to the process
    while "resume=auto: no checkpoint in" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no output"
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True, timeout=60)
    fields = _slurm_job(job_id, env, lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING")
    # Slurm holds a requeued job for two minutes (its begin time) before starting it again: the
    # test makes it eligible now, as `scontrol update` lets an operator do, but not within the
    # second the node revoked the first run's credential (slurmd refuses a new one of that same
    # second: "Job credential revoked", the job FAILED).
    time.sleep(1.5)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True, timeout=60)
    fields = _slurm_job(job_id, env, lambda f: f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"))
    out = log.read_text()
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0"), out[-3000:]
    assert f"tfkv-run: requeueing Slurm job {job_id} (restart 1)" in out, out[-3000:]
    assert "tfkv-run: preempted (SIGUSR1): checkpoint epoch-0001-step-0000" in out  # mid-epoch
    (restart,) = json.loads((run / "launch" / "restarts.json").read_text())
    assert (restart["attempt"], restart["cause"]) == (1, f"preempted; requeued Slurm job {job_id}")
    metrics = json.loads((run / "metrics.json").read_text())
    (resume,) = metrics["resumes"]
    assert [h["epoch"] for h in metrics["history"]] == [1, 2] and "-step-" in resume["from"]
    assert f"resumed from {resume['from']}" in out
    _same_weights(run / "checkpoints" / "epoch-0002", straight / "checkpoints" / "epoch-0002")


def test_the_batch_scripts_requeue_asks_for_workers_that_resume_by_themselves(tmp_path, capsys, monkeypatch):
    """The slurm launcher's batch script requeues a preempted job only when its workers start
    with resume=auto (else the requeued job would start afresh over the checkpoint): one line."""
    from tfkv.launcher import requeue

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    (tmp_path / "config_resolved.yaml").write_text("resume: false\nepochs: 2\n")
    assert requeue.main(tmp_path) == 1
    assert capsys.readouterr().out == ("tfkv: not requeued: the job's workers start with resume=False, so a requeued "
                                       "job would not continue from the checkpoint; run it with resume=auto to have "
                                       "it requeued\n")
    (tmp_path / "config_resolved.yaml").write_text("resume: auto\n")
    assert requeue.workers_resume(tmp_path) == "auto"


@pytest.mark.slow
def test_the_slurm_launchers_batch_job_preempted_mid_epoch_requeues_itself_and_ends_with_the_uninterrupted_weights(
        slurm, dist_straight, tmp_path):  # noqa: F811
    """`tfkv-run cluster=slurm` from outside an allocation (sbatch of the roles' srun, --requeue):
    Slurm's warning ahead of a preemption to the batch script (`scancel --signal=USR1 --batch`,
    what --signal=B:USR1@N sends) after a step checkpoint; tfkv-run exits 75 at a step checkpoint,
    the job's script requeues it (Restarts=1) and tfkv-run leaves it be, and the job, started
    again by Slurm, resumes there and ends with the weights of the uninterrupted local DIST job.
    (Not SIGTERM to every process: srun takes it as the order to kill its step at once.)"""
    import re

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **slurm.env}
    args = [a.replace("cluster=local", "cluster=slurm") for a in DIST] + [
        f"cluster.python={sys.executable}", "cluster.sbatch_args=--requeue"]
    with open(tmp_path / "out.txt", "w") as out:
        job = subprocess.Popen(["tfkv-run", *args], cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    run, job_id = tmp_path / "run", None
    try:
        try:
            _wait_for_checkpoint(job, run)
            (job_id,) = re.findall(r"Submitted batch job (\d+)", (tmp_path / "out.txt").read_text())
            subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=env, check=True, timeout=60)
            job.wait(timeout=120)
        finally:
            _kill(job)
        preempted = _preempted(job, tmp_path, "SIGUSR1", lines=2)
        assert "-step-" in preempted.name  # mid-epoch
        assert "tfkv-run: its Slurm batch job requeued itself" in (tmp_path / "out.txt").read_text()
        _slurm_job(job_id, env, lambda f: f.get("Restarts") == "1" and f.get("JobState") == "PENDING")
        time.sleep(1.5)  # see the requeue test above: not within the second the first run's credential was revoked
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, check=True, timeout=60)
        fields = _slurm_job(job_id, env, lambda f: f.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"))
    finally:
        if job_id:
            subprocess.run(["scancel", job_id], env=env, timeout=60)
    log = (run / "launch" / "slurm" / "job.log").read_text()
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", "1", "0:0"), log[-3000:]
    assert f"tfkv: requeueing Slurm job {job_id} (restart 1)" in log and f"resumed from {preempted}" in log, log[-3000:]
    assert not (run / "launch" / "curve.key").exists()  # the job's keys, kept for its second run, went with it
    _same_weights(run / "checkpoints" / "epoch-0002", dist_straight() / "checkpoints" / "epoch-0002")


# -- cluster.spare_hosts ----------------------------------------------------------------------------

def test_a_host_whose_roles_failed_in_two_attempts_gives_way_to_the_next_spare(tmp_path):
    """The planning step: failures counted per host over attempts (a line names each blamed role
    with its host), the host left out at its second, every line of it moved, spares in order."""
    from tfkv.launcher import spares

    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1  # the scheduler's\nroot@node2:2222\nnode1\n")
    names = ["node1", "node2", "node1"]
    spare = spares.Spares(spares.check("ssh", str(hostfile), ["node3", "me@node4:22"]))
    assert spare.failed("worker 1 @node2 exited with status 5", names) == ["node2"]
    assert spare.replace(names) == []  # once: the same hosts again
    assert spare.failed("server 0 @node1 and worker 1 @node2 stopped answering (...)", names) == ["node1", "node2"]
    assert spare.replace(names) == [("node2", "node3")]  # node1 failed once only
    assert spare.hosts_file(hostfile, tmp_path / "next").read_text() == \
        "node1  # the scheduler's\nnode3\nnode1\n"
    spare.failed("worker 0 @node1 was killed by SIGKILL", names)
    spare.failed("worker 1 @node3 exited with status 1", names)  # the spare's first
    assert spare.replace(names) == [("node1", "node4")]
    assert spare.hosts_file(hostfile, tmp_path / "next").read_text() == \
        "me@node4:22  # the scheduler's\nnode3\nme@node4:22\n"
    spare.failed("worker 1 @node3 exited with status 1", names)
    assert spare.replace(names) == []  # node3 failed twice, but no spare is left: it stays


@pytest.mark.parametrize("launcher,hostfile,spare,message", [
    ("slurm", "hosts", ["node3"], "cluster.spare_hosts: the slurm launcher does not place roles on hosts"),
    ("ssh", "hosts", ["node1"], "cluster.spare_hosts: node1 is already a host of"),
    ("mpi", "hosts", ["node3", "node3"], "cluster.spare_hosts: node3 is listed twice"),
    ("mpi", None, ["node3"], "cluster.spare_hosts needs a hosts file"),
    ("ssh", "hosts", ["no de"], "cluster.spare_hosts:1: 'no de' is not a host"),
])
def test_bad_spare_hosts_are_one_line_before_anything_starts(tmp_path, launcher, hostfile, spare, message):
    (tmp_path / "hosts").write_text("node1\nnode2\n")
    from tfkv.launcher import job

    opts = job.Options(launcher, 1, 1, str(tmp_path / hostfile) if hostfile else None, spare_hosts=spare,
                       max_restarts=2)
    with pytest.raises(ConfigError) as e:
        job.launch(opts, ["true"], tmp_path, tmp_path / "run", ["tfkv-launch"], sys.stdout)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "run").exists()  # nothing planned, nothing recorded


@pytest.mark.slow
def test_a_host_that_failed_twice_is_replaced_by_a_spare_over_ssh(netns_hosts, ssh_site, tmp_path):  # noqa: F811
    """tfkv-launch over real ssh, hosts file node1, spare node2: the job's worker fails wherever
    the host is node1 (its own hostname); after its second failure the third attempt runs every
    role on node2 and the job ends well."""
    (tmp_path / "hosts").write_text("node1\n")
    shutil.copy(Path(__file__).parents[1] / "workers" / "dist_worker.py", tmp_path)
    worker = f'[ "$(hostname)" = node1 ] && exit 5; exec {sys.executable} dist_worker.py updates out{{rank}}.json 2'
    proc = subprocess.run(["tfkv-launch", "-n", "1", "-s", "1", "-H", "hosts", "--launcher", "ssh", "--python",
                           sys.executable, "--run-dir", "rec", "--max-restarts", "2", "--spare-hosts", "node2", "--",
                           "sh", "-c", worker], cwd=tmp_path, env={**os.environ, **ssh_site.env()},
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "tfkv: restart 1 of 2: worker 0 @node1 exited with status 5\n" in out
    assert ("tfkv: restart 2 of 2: worker 0 @node1 exited with status 5; node1 failed in 2 attempts, spare host "
            "node2 takes its place") in out
    assert out.count("tfkv: ssh job, 1 server(s), 1 worker(s) - node1: scheduler, server 0, worker 0") == 2, out
    assert "tfkv: ssh job, 1 server(s), 1 worker(s) - node2: scheduler, server 0, worker 0" in out
    plan = json.loads((tmp_path / "rec" / "launch" / "plan.json").read_text())["processes"]
    assert {p["host"] for p in plan} == {"node2"}
    first, second = json.loads((tmp_path / "rec" / "launch" / "restarts.json").read_text())
    assert "replaced" not in first and second["replaced"] == {"node1": "node2"}
    assert (tmp_path / "rec" / "launch" / "hosts").read_text() == "node2\n"  # the record: the last attempt's
    assert json.loads((tmp_path / "out0.json").read_text())["final"]


@pytest.mark.slow
@pytest.mark.parametrize("submit,said", [
    (["sbatch", "--parsable", "--no-requeue", "--wrap", "sleep 60"], "is not requeueable; submit it with sbatch --requeue"),
    (["salloc", "--no-shell", "-n", "1"], "is not a batch job (salloc or srun)"),
])
def test_a_job_slurm_may_not_requeue_is_left_alone_in_one_line(slurm, tmp_path, submit, said):  # noqa: F811
    """tfkv.launcher.requeue as a preempted tfkv-run runs it, inside a job Slurm will not requeue:
    one line why, no restart recorded, the job untouched."""
    from tfkv.launcher import requeue

    proc = subprocess.run(submit, cwd=tmp_path, env=slurm.env, capture_output=True, text=True, timeout=60, check=True)
    job_id = (proc.stdout.strip() or proc.stderr.split("Granted job allocation")[1].split()[0]).split(";")[0]
    try:
        lines: list[str] = []
        assert not requeue.requeue(tmp_path, lines.append, {**slurm.env, "SLURM_JOB_ID": job_id})
        assert len(lines) == 1 and said in lines[0] and f"Slurm job {job_id} " in lines[0], lines
        assert not (tmp_path / "launch" / "restarts.json").exists()
        assert requeue.job_fields(job_id, slurm.env)["Restarts"] == "0"
    finally:
        subprocess.run(["scancel", job_id], env=slurm.env, timeout=60)
