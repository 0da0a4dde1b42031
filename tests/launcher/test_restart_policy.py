"""cluster.max_restarts restarts only what a restart can cure (tfkv.launcher.process.repeats),
through the real local launcher: a role killed by a signal is restarted; a role's own error
(tfkv's config error, status 2; an uncaught exception, status 1, e.g. a model factory that
raises) is not, and the final line says why none was tried, or that the restarts were spent."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import tfkv_run


def _launch(tmp_path, script: str, restarts: int = 2) -> subprocess.CompletedProcess:
    """tfkv-launch, one worker running `script` (sh) in tmp_path; each attempt appends to `attempts`."""
    return subprocess.run(["tfkv-launch", "-n", "1", "--launcher", "local", "--run-dir", "rec", "--max-restarts",
                           str(restarts), "--", "sh", "-c", f"echo x >> attempts; {script}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)


def _attempts(tmp_path) -> int:
    return len((tmp_path / "attempts").read_text().split())


@pytest.mark.parametrize("status", [1, 2])
def test_a_roles_own_error_is_not_restarted_and_the_line_says_why(tmp_path, status):
    proc = _launch(tmp_path, f"exit {status}")
    assert proc.returncode == 1 and "tfkv: restart" not in proc.stdout, proc.stdout
    assert _attempts(tmp_path) == 1
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-launch:")]
    assert f"worker 0 exited with status {status}; not restarted: a role's own error, which a restart meets " \
           "again" in line, line


def test_a_role_killed_by_a_signal_is_restarted(tmp_path):
    worker = f"{sys.executable} {Path(__file__).parents[1] / 'dist_worker.py'} updates out{{rank}}.json 2"
    proc = _launch(tmp_path, f'if [ "$(wc -l < attempts)" -eq 1 ]; then kill -9 $$; fi; exec {worker}')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tfkv: restart 1 of 2: worker 0 was killed by SIGKILL" in proc.stdout
    assert _attempts(tmp_path) == 2 and (tmp_path / "out0.json").is_file()  # the restarted worker's result


def test_restarts_spent_are_said_in_the_final_line(tmp_path):
    proc = _launch(tmp_path, "kill -9 $$", restarts=1)
    assert _attempts(tmp_path) == 2
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-launch:")]
    assert "worker 0 was killed by SIGKILL; all 1 restart(s) of cluster.max_restarts spent" in line, line


RAISES = textwrap.dedent("""
    def build(input_shape, num_classes, **settings):
        raise RuntimeError("this factory always fails")
""")


@pytest.mark.slow
def test_tfkv_run_does_not_restart_a_model_factory_that_raises(tmp_path):
    (tmp_path / "broken_model.py").write_text(RAISES)
    proc = tfkv_run("kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.max_restarts=2",
                    "model._target_=broken_model.build", "epochs=1", "progress=false", "hydra.run.dir=run",
                    cwd=tmp_path, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "tfkv: restart" not in proc.stdout, proc.stdout[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "job failed: worker" in line and "not restarted: a role's own error" in line, line
    assert not (tmp_path / "run" / "launch" / "restarts.json").exists()
