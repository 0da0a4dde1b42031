"""Sweeps on Slurm through the real hydra-submitit-launcher: `tfkv-run -m hydra/launcher=submitit_slurm
kvstore=dist_sync cluster=slurm ...` submits every trial as one Slurm job (a task of submitit's job
array); inside its allocation tfkv-run's task function starts the scheduler, the servers and the
workers as one srun step beside submitit's own. The Slurm cell is the real slurmctld/slurmd of
tests/cluster_daemons.py. It has no accounting database, so submitit's sacct polls fail (it warns
and waits for each trial's result file instead), which is what a site without slurmdbd gets.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_daemons import slurm  # noqa: F401  (session fixture)
from conftest import TAG, tagged_pids


def test_an_allocation_smaller_than_the_job_is_one_line():
    from tfkv.errors import ConfigError
    from tfkv.launcher import base
    from tfkv.launcher.backends import slurm as slurm_launcher
    from tfkv.launcher.plan import make_plan

    assert slurm_launcher.allocation_cpus({"SLURM_JOB_CPUS_PER_NODE": "8(x2),4"}) == 20
    assert slurm_launcher.allocation_cpus({}) is None
    plan = make_plan(2, 1, ["python", "w.py"], ["python", "-m", "tfkv.ps.node"], ["n1"], "n1", 9000, {})
    job = base.Job(plan=plan)
    env = {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "6", "SLURM_ARRAY_TASK_ID": "0",
           "SLURM_JOB_CPUS_PER_NODE": "3", "SLURM_STEP_ID": "0"}
    with pytest.raises(ConfigError) as e:
        slurm_launcher.check_allocation(job, env)
    assert str(e.value) == ("the Slurm allocation of job 7 (array task 6_0) has 3 CPU(s), and the job's 4 tasks "
                            "(scheduler, 1 server(s), 2 worker(s)) need one each: allocate 4, e.g. salloc -n 4, "
                            "or with hydra/launcher=submitit_slurm hydra.launcher.cpus_per_task=4")
    slurm_launcher.check_allocation(job, {**env, "SLURM_JOB_CPUS_PER_NODE": "4"})
    # submitit with nodes=2 runs its function, so this launcher, in two tasks: both would start the job
    with pytest.raises(ConfigError, match="runs as 2 tasks of step 0 of Slurm job 7 .* each would start"):
        slurm_launcher.check_allocation(job, {**env, "SLURM_JOB_CPUS_PER_NODE": "4(x2)", "SLURM_STEP_NUM_TASKS": "2"})
    # beside the step that runs tfkv-run, the roles' step overlaps it; in salloc's shell it need not
    assert "--overlap" in slurm_launcher.srun_argv(job, "j", env)
    assert "--overlap" not in slurm_launcher.srun_argv(job, "j", {k: v for k, v in env.items() if k != "SLURM_STEP_ID"})


def _sweep_dir(cwd: Path) -> Path:
    (sweep,) = cwd.glob("multirun/*/*")
    return sweep


@pytest.mark.slow
def test_each_trial_is_one_slurm_job_running_the_whole_job(slurm, tmp_path):  # noqa: F811
    """Three trials, one Slurm job each, with room for 4 tasks (hydra.launcher.cpus_per_task=4):
    2 workers (4 tasks) and 1 worker (3 tasks) train inside their allocations; 5 workers (7 tasks)
    do not fit, and that trial fails with tfkv's one line while the sweep goes on."""
    tag = f"sweep-slurm-{tmp_path.name}"
    name = f"tfkv-sweep-{os.getpid()}-{tmp_path.name[-8:]}"  # the trials' Slurm job name, for scancel
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not inside an allocation
    env.update({TAG: tag, "SLURM_CONF": str(slurm.conf)})
    args = ["tfkv-run", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.cpus_per_task=4",
            f"hydra.launcher.name={name}", "hydra.launcher.timeout_min=10", "kvstore=dist_sync", "cluster=slurm",
            f"cluster.python={sys.executable}", "cluster.num_workers=2,1,5", "epochs=1", "steps_per_epoch=4",
            "progress=false"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    finally:
        subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=60)
    print(f"3-trial submitit sweep: {time.monotonic() - t0:.1f} s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-4000:]
    assert "tfkv-run: 1 of 3 trials failed" in proc.stderr, out[-4000:]

    sweep = _sweep_dir(tmp_path)
    array = {p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)}
    jobs = {}
    for num, workers in ((0, 2), (1, 1)):
        run = sweep / str(num)
        record = json.loads((run / "trial.json").read_text())
        assert record["status"] == "ok", record
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["epoch"] == 1 and record["value"] == pytest.approx(metrics["test_accuracy"])
        log = (run / "launch" / "job.log").read_text()
        # the roles ran as one srun step of this trial's own allocation, not as a batch job of their own
        m = re.search(rf"tfkv: the job's {2 + workers} tasks run as one srun step in Slurm job \d+ "
                      rf"\(array task (\d+_{num})\)", log)
        assert m, log[-3000:]
        jobs[num] = m.group(1)
        assert m.group(1) in array  # submitit's own record of the job (.submitit/<array id>_<task>)
        for role in ["scheduler", "server 0"] + [f"worker {i}" for i in range(workers)]:
            assert f"[{role}] tfkv-role: {role} exited with status 0" in log, log[-3000:]
        assert not (run / "launch" / "slurm").exists()
    assert jobs[0] != jobs[1]

    failed = json.loads((sweep / "2" / "trial.json").read_text())
    assert failed["status"] == "failed", failed
    assert failed["reason"].startswith("the Slurm allocation of job ") and "7 tasks" in failed["reason"], failed
    assert "hydra.launcher.cpus_per_task=7" in failed["reason"], failed
    assert "\n" not in failed["reason"]
    table = json.loads((sweep / "sweep.json").read_text())
    assert len(table["trials"]) == 3 and table["failed"] == 1
    assert not tagged_pids(tag, wait=15)


@pytest.mark.slow
def test_a_trial_slurm_cancels_is_recorded_and_the_sweep_ends(slurm, tmp_path):  # noqa: F811
    """scancel of a running trial (as a time limit or a preemption would end it): Slurm sends
    SIGTERM, the trial stops its job, records itself failed and still hands submitit its result,
    so the sweep ends (without accounting, submitit would otherwise wait for that file forever)."""
    tag = f"sweep-scancel-{tmp_path.name}"
    name = f"tfkv-cancel-{os.getpid()}-{tmp_path.name[-8:]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({TAG: tag, "SLURM_CONF": str(slurm.conf)})
    args = ["tfkv-run", "-m", "hydra/launcher=submitit_slurm", "hydra.launcher.cpus_per_task=4",
            f"hydra.launcher.name={name}", "kvstore=dist_sync", "cluster=slurm", f"cluster.python={sys.executable}",
            "epochs=50", "progress=false", "optimizer.lr=0.1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the trial's roles run in its allocation: cancel the job
            logs = list(tmp_path.glob("multirun/*/*/0/launch/job.log"))
            if logs and "[scheduler]" in logs[0].read_text():
                break
            time.sleep(0.2)
        assert logs, "the trial never started its job"
        subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=60, check=True)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        subprocess.run(["scancel", "--name", name], env=env, capture_output=True, timeout=60)
    print(f"cancelled submitit trial: {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 1 and "tfkv-run: 1 of 1 trials failed" in out, out[-4000:]
    record = json.loads((_sweep_dir(tmp_path) / "0" / "trial.json").read_text())
    assert record["status"] == "failed" and record["reason"].startswith("stopped"), record
    assert not tagged_pids(tag, wait=15)
