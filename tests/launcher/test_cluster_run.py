"""`tfkv-run kvstore=dist_* cluster=local`: one command starts the whole job and reports it."""

import json
import os
import subprocess
import sys

import pytest
from conftest import TAG, Launching, tagged_pids, tfkv_run


def _tagged(tmp_path):
    return {TAG: f"cluster-run-{tmp_path.name}"}


@pytest.mark.slow
def test_one_command_runs_the_whole_job(tmp_path):
    env = {**_tagged(tmp_path), "PS_RESEND": "1"}  # a knob from the shell, one from the config (kvstore.chunk_bytes)
    proc = tfkv_run("kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=2",
                    "epochs=2", "progress=false", "kvstore.chunk_bytes=65536", cwd=tmp_path, env=env)
    out = proc.stdout + proc.stderr
    for prefix in ("[scheduler]", "[server 0]", "[server 1]", "[worker 0]", "[worker 1]"):
        assert prefix in out
    (metrics_path,) = tmp_path.glob("outputs/*/*/metrics.json")
    metrics = json.loads(metrics_path.read_text())
    assert metrics["epoch"] == 2 and metrics["test_accuracy"] > 0.8
    run = metrics_path.parent
    assert (run / "worker0.log").is_file() and (run / "worker1.log").is_file()
    assert "2 worker(s)" in (run / "worker1.log").read_text()
    knobs = json.loads((run / "knobs.json").read_text())  # the effective backend knobs, recorded
    assert (knobs["kvstore.chunk_bytes"]["value"], knobs["kvstore.resend"]["value"]) == (65536, True)
    roles = json.loads((run / "launch" / "plan.json").read_text())
    assert "TFKV_CHUNK_BYTES" in json.dumps(roles) and '"PS_RESEND": "1"' in json.dumps(roles)
    assert not tagged_pids(env[TAG], wait=15)


@pytest.mark.slow
# SIGINT (Ctrl-C, 130) of a local job is the launcher contract's (test_contract.py), checked here
# through tfkv-run; SIGTERM is a preemption first (tests/checkpoint/test_long_jobs.py).
@pytest.mark.parametrize("sig, said, status", [("SIGINT", "interrupted (Ctrl-C)", 130)])
def test_ctrl_c_ends_a_distributed_run_as_it_ends_a_single_one(tmp_path, sig, said, status):
    """Ctrl-C in the middle of training: the whole job stops, tfkv-run exits 130 as it does for a
    single process, with one line naming the signal and no traceback."""
    import signal

    env = {**os.environ, **_tagged(tmp_path)}
    run = Launching(["kvstore=dist_sync", "cluster=local", "epochs=100", "progress=false"], tmp_path, env,
                    timeout=240, program="tfkv-run")
    run.wait_for("steps/epoch")  # a worker is training
    run.proc.send_signal(getattr(signal, sig))
    rc, out = run.end(timeout=60)
    failures = [ln for ln in out.splitlines() if ln.startswith("tfkv-run:")]
    assert rc == status and len(failures) == 1 and said in failures[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # The launcher has sent SIGKILL to every role's group and reaped what it started; under a
    # loaded machine the kernel may take a moment to end them (tagged_pids' wait).
    assert not tagged_pids(env[TAG], wait=15)


@pytest.mark.parametrize("args,message", [
    (["kvstore=dist_sync"], "needs a parameter-server cluster: add cluster=local"),
    (["cluster=local"], "kvstore=local is a single-machine store"),
    (["kvstore=dist_async", "cluster=local", "kvstore.update_on_kvstore=false"], "needs the optimizer on the servers"),
    (["kvstore=dist_sync", "cluster=local", "cluster.num_workers=0"], "cluster.num_workers=0 must be at least 1"),
])
def test_cluster_config_mistakes_are_one_line(tmp_path, args, message):
    proc = tfkv_run(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_server_role_does_not_import_tensorflow(tmp_path):
    code = ("import sys, runpy; sys.argv=['tfkv-run']\n"
            "import tfkv.ps.node as n\n"
            "from tfkv.ps.cluster_env import ClusterEnv\n"
            "import tfkv.ps.server, tfkv.ps.scheduler\n"
            "assert 'tensorflow' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env={**os.environ})


@pytest.mark.slow
def test_tfkv_launch_of_tfkv_run_leaves_one_run_directory(tmp_path):
    """`tfkv-launch -n 2 -- tfkv-run kvstore=dist_sync`: the workers write into the launcher's
    run directory (metrics and checkpoints from worker 0, a log per worker) instead of making a
    Hydra run directory each."""
    env = _tagged(tmp_path)
    proc = subprocess.run(["tfkv-launch", "-n", "2", "-s", "1", "--launcher", "local", "--", "tfkv-run",
                           "kvstore=dist_sync", "epochs=1", "progress=false"], cwd=tmp_path,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (run,) = (tmp_path / "outputs").iterdir()  # one directory for the job, nothing else
    assert run.name.startswith("launch-")
    assert json.loads((run / "metrics.json").read_text())["epoch"] == 1
    assert (run / "worker0.log").is_file() and (run / "worker1.log").is_file()
    assert (run / "launch" / "plan.json").is_file()
    assert not list(tmp_path.glob("multirun"))
    assert not tagged_pids(env[TAG], wait=15)
