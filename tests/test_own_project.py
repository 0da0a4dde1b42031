"""A user's own project: `tfkv-run --config-dir conf +experiment=mine` from a directory holding
their conf/ and their package (recipes/own_project), on this machine and over ssh. Every role
of a launched job runs the config the launcher composed and recorded (config_resolved.yaml),
never one recomposed from the overrides (which lost --config-dir and hydra.searchpath)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cluster_hosts import loopback_host, ssh_site  # noqa: F401 - fixtures
from conftest import REPO, TAG, tagged_pids, tfkv_run
from cluster_hosts import run_remote_command

from tfkv import worker
from tfkv.errors import ConfigError
from tfkv.launcher import job, record
from tfkv.launcher.backends import mpi, yarn
from tfkv.launcher.plan import CONFIG, forwarded_env

PY = sys.executable
QUICK = ("epochs=1", "progress=false")
LOCAL = ("kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", *QUICK)
# Everything a shell, mpirun's -x or YARN's bash -c "..." could take apart.
ODD = {"text": "a 'b' \"c\" $HOME `x` ;|& \\ \u00fcn\u00efcode\nsecond line", "list": [1, 2.5, None, True],
       "empty": {}, "key with spaces": "v"}


def _project(tmp_path: Path) -> Path:
    """A copy of recipes/own_project, as the user's working directory."""
    work = tmp_path / "own_project"
    shutil.copytree(REPO / "recipes" / "own_project", work, ignore=shutil.ignore_patterns("outputs", "__pycache__"))
    return work


def _ran_the_recorded_config(run: Path, workers: int = 2) -> dict:
    """The recorded config, after checking that every worker logged its digest, and only it."""
    recorded = yaml.safe_load((run / "config_resolved.yaml").read_text())
    for rank in range(workers):
        said = re.findall(r"config sha256 ([0-9a-f]{64})", (run / f"worker{rank}.log").read_text())
        assert said == [worker.digest(recorded)], f"worker {rank} ran another config: {said}"
    return recorded


# -- fast ------------------------------------------------------------------------------------------

def _plan(tmp_path: Path, launcher: str, **kw) -> job.base.Job:
    (tmp_path / "hosts").write_text("127.0.0.1\n")
    opts = job.Options(launcher, 2, 1, str(tmp_path / "hosts"), secure=False, **kw)
    env = {CONFIG: worker.encode(ODD, None)}
    return job.plan_job(opts, [PY, "-m", "tfkv.worker"], tmp_path, tmp_path / "outputs" / "run", env)


def test_the_workers_config_passes_every_backend_unchanged(tmp_path):
    """The encoded config needs no quoting anywhere (YARN refuses ", $, ` and \\ in a variable),
    and decodes to exactly what was encoded after ssh's shell, mpirun's -x and YARN's -shell_env."""
    value = worker.encode(ODD, {"env_set": {"A": "b c"}})
    assert re.fullmatch(r"[A-Za-z0-9_=-]+", value) and worker.decode(value) == (ODD, {"env_set": {"A": "b c"}})
    # YARN: submitted as -shell_env NAME=value, accepted (no ConfigError) and intact.
    subs = yarn.submissions(_plan(tmp_path, "yarn"), "ds.jar")
    shell_env = [a for _, argv in subs for a in argv if a.startswith(f"{CONFIG}=")]
    assert shell_env and {worker.decode(a.split("=", 1)[1])[0] == ODD for a in shell_env} == {True}
    # mpirun: -x NAME=value.
    argv = mpi.mpirun_argv(_plan(tmp_path, "mpi"))
    (x,) = [argv[i + 1] for i, a in enumerate(argv) if a == "-x" and argv[i + 1].startswith(f"{CONFIG}=")]
    assert worker.decode(x.split("=", 1)[1])[0] == ODD
    # ssh: the remote shell command, run by a real shell as sshd runs it.
    ssh_job = _plan(tmp_path, "ssh", sync_dst_dir=str(tmp_path / "dst"))
    _, out = run_remote_command([PY, "-c", "import json, os; from tfkv.worker import decode; "
                                            f"print(json.dumps(decode(os.environ['{CONFIG}'])[0]))"],
                                 ssh_job.plan[-1].env, tmp_path)
    assert [json.loads(line) for line in out.split("\n") if line.startswith("{")] == [ODD], out


def test_the_record_names_the_config_file_and_nested_launchers_drop_it(tmp_path):
    j = _plan(tmp_path, "local")
    record.write(tmp_path, "local", j, ["tfkv-run"], {}, None)
    plan = json.loads((tmp_path / "launch" / "plan.json").read_text())
    assert {p["env"][CONFIG] for p in plan["processes"]} == {"<config_resolved.yaml>"}
    # A launcher started inside a worker must not hand this job's config to its own roles.
    assert forwarded_env({CONFIG: "x", "TFKV_KEEP": "y"}) == {"TFKV_KEEP": "y"}


@pytest.mark.parametrize("value", [None, "not-a-config"])
def test_a_worker_without_a_recorded_config_is_one_line(tmp_path, value):
    env = {k: v for k, v in os.environ.items() if k != CONFIG}
    env.update({"TFKV_RUN_DIR": str(tmp_path), **({CONFIG: value} if value else {})})
    proc = subprocess.run([PY, "-m", "tfkv.worker"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "start the job with tfkv-run" in proc.stderr


def test_a_config_too_large_for_an_environment_is_one_line():
    bulky = {"files": [os.urandom(16).hex() for _ in range(10_000)]}  # random: zlib cannot shrink it
    with pytest.raises(ConfigError, match=r"KiB compressed, more than a worker's environment can carry"):
        worker.encode(bulky, None)


def test_a_bad_override_in_a_distributed_run_is_refused_before_anything_starts(tmp_path):
    proc = tfkv_run(*LOCAL, "optimizer.lrr=0.5", cwd=tmp_path, check=False, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    assert proc.returncode == 2 and len(lines) == 1 and "lrr" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "tfkv: local job" not in proc.stdout
    assert not list(tmp_path.glob("outputs/*/*/launch"))


# -- slow: whole jobs ------------------------------------------------------------------------------

@pytest.mark.slow
def test_own_project_dist_sync_on_this_machine(tmp_path):
    """Issue 13's failing case: the workers recomposed `+experiment=mine` from the overrides
    without --config-dir, and each died with "Could not find 'experiment/mine'"."""
    work = _project(tmp_path)
    env = {TAG: f"own-local-{tmp_path.name}"}
    proc = tfkv_run("--config-dir", "conf", "+experiment=mine", *LOCAL, cwd=work, env=env, check=False,
                    timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    (metrics,) = work.glob("outputs/*/*/metrics.json")
    recorded = _ran_the_recorded_config(metrics.parent)
    assert recorded["model"]["_target_"] == "myproj.nets.build"
    rerun = (metrics.parent / "launch" / "rerun.sh").read_text()
    assert f"--config-dir={work / 'conf'}" in rerun and "+experiment=mine" in rerun
    assert json.loads(metrics.read_text())["test_accuracy"] > 0.5  # 4 classes: chance is 0.25
    assert not tagged_pids(env[TAG], wait=15)


@pytest.mark.slow
def test_own_project_dist_sync_over_ssh(loopback_host, ssh_site, tmp_path):
    """The project reaches the host by rsync (sync_dst_dir) and imports there from the synced
    directory; the workers run the recorded config; worker 0's run directory comes back."""
    work = _project(tmp_path)
    (work / "hosts").write_text("127.0.0.1\n")
    dst = tmp_path / "dst"
    env = {TAG: f"own-ssh-{tmp_path.name}", **ssh_site.env()}
    proc = tfkv_run("--config-dir", "conf", "+experiment=mine", "kvstore=dist_sync", "cluster=ssh",
                    "cluster.hostfile=hosts", "cluster.num_workers=2", "cluster.num_servers=1",
                    f"cluster.sync_dst_dir={dst}", f"cluster.python={PY}", *QUICK, cwd=work, env=env,
                    check=False, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (dst / "myproj" / "nets.py").is_file()  # the code went by rsync
    assert list(dst.glob("outputs/*/*/metrics.json"))  # where the workers ran
    (metrics,) = work.glob("outputs/*/*/metrics.json")  # copied back from worker 0's host, with the logs
    _ran_the_recorded_config(metrics.parent)
    assert json.loads(metrics.read_text())["epoch"] == 1
    assert not tagged_pids(env[TAG], wait=15)
