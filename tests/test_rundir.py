"""A run directory belongs to one job at a time (tfkv.checkpoint.lock): two real `tfkv-run`
processes on one `hydra.run.dir`, and a requeue after the holder was killed with SIGKILL."""

import json
import signal
import socket
import subprocess

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
