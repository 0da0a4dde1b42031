"""What a backend runs, as data (tfkv.launcher.request), and the dry run that prints it: the
request's parts alone, a missing program's refusal read from the backend's trait, and
`tfkv-launch --dry-run` / `tfkv-run ... cluster.dry_run=true` as a user runs them, with the
programs they would start on PATH as stand-ins that leave a mark if anything runs them. Each
backend's request for a fixed job is held against its golden file in test_contract.py."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tfkv_run

from tfkv.errors import ConfigError
from tfkv.keys import SECRET
from tfkv.launcher import base
from tfkv.launcher.request import HIDDEN, Command, Request


def test_a_command_s_environment_is_the_launching_shell_s_less_what_it_drops_plus_what_it_sets():
    c = Command("worker 0", ["python3", "train.py"], {"A": "1", "B": "2"}, unset=("C",))
    assert c.environ({"B": "0", "C": "3", "D": "4"}) == {"A": "1", "B": "2", "D": "4"}


def test_the_text_hides_the_job_s_keys_and_names_where_each_command_runs(tmp_path):
    request = Request([Command("scheduler", ["python3", "-m", "tfkv.ps.node"], {SECRET: "s3cr3t", "X": "a b"},
                               cwd="/work"),
                       Command("worker 0 @node1", ["sh", "-c", "cd /w && exec python3 train.py"], host="node1")],
                      {str(tmp_path / "job.sh"): "#!/bin/bash\nexit 0\n"})
    text = request.text()
    assert "s3cr3t" not in text and f"{SECRET}='{HIDDEN}'" in text
    assert f"# script {tmp_path / 'job.sh'}\n#!/bin/bash\nexit 0\n" in text
    assert "# scheduler (here, in /work)\n" in text and "#   X='a b'\n" in text
    assert text.endswith("# worker 0 @node1 (on node1)\ncd /w && exec python3 train.py\n")
    assert not (tmp_path / "job.sh").exists()  # text() writes nothing; write() does
    request.write()
    assert (tmp_path / "job.sh").read_text() == "#!/bin/bash\nexit 0\n"


@pytest.mark.parametrize("name", [n for n in base.REGISTRY.own() if base.backend_class(n).programs])
def test_a_missing_program_is_one_line_with_the_hint_the_backend_declares(name, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    cls = base.backend_class(name)
    first = cls.programs[0]
    with pytest.raises(ConfigError) as e:
        cls.need()
    assert str(e.value) == f"{first.name} is not on PATH; {first.hint}"


def _stand_ins(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """PATH with every program a backend declares as a script that leaves a mark when run."""
    bin_dir, marks = tmp_path / "bin", tmp_path / "marks"
    bin_dir.mkdir()
    marks.mkdir()
    for name in {p.name for n in base.REGISTRY.own() for p in base.backend_class(n).programs}:
        (bin_dir / name).write_text(f"#!/bin/sh\ntouch {marks}/{name}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, marks


@pytest.mark.parametrize("launcher", ["local", "slurm", "sge", "yarn", "mpi"])
def test_tfkv_launch_dry_run_prints_every_command_and_script_and_starts_nothing(launcher, tmp_path):
    env, marks = _stand_ins(tmp_path)
    work, worker = tmp_path / "work", tmp_path / "worker.py"
    work.mkdir()
    worker.write_text(f"open({str(marks / 'worker')!r}, 'w')\n")
    exe = shutil.which("tfkv-launch")
    assert exe, "tfkv-launch is not on PATH: install the package first"
    proc = subprocess.run([exe, "-n", "2", "-s", "1", "--launcher", launcher, "--dry-run", "--run-dir", "job",
                           "--", sys.executable, str(worker)],
                          cwd=work, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"tfkv: dry run of a {launcher} job, 1 server(s), 2 worker(s) - ")
    first = {"local": "# scheduler (here", "slurm": "# script ", "sge": "# script ", "yarn": "# scheduler (here",
             "mpi": "# mpirun (here"}[launcher]
    assert proc.stdout.splitlines()[1].startswith(first), proc.stdout[:500]
    program = {"local": None, "slurm": "sbatch", "sge": "qsub", "yarn": "yarn", "mpi": "mpirun"}[launcher]
    if program:
        assert f"\n{program} " in proc.stdout
    assert list(marks.iterdir()) == [] and list(work.iterdir()) == []  # nothing ran, nothing was written


def test_tfkv_run_cluster_dry_run_prints_the_job_and_starts_none(tmp_path):
    env, marks = _stand_ins(tmp_path)
    proc = tfkv_run("kvstore=dist_sync", "cluster=sge", "cluster.dry_run=true", "hydra.run.dir=run", cwd=tmp_path,
                    env=env)
    assert "tfkv: dry run of a sge job, 1 server(s), 2 worker(s)" in proc.stdout
    assert "\nqsub -sync y -t 1-3 " in proc.stdout and "tfkv.worker" in proc.stdout  # the workers run the config
    assert list(marks.iterdir()) == []
    assert not (tmp_path / "run" / "launch").exists() and not (tmp_path / "run" / "knobs.json").exists()


def test_a_dry_run_of_an_evaluation_is_refused_before_anything(tmp_path):
    proc = tfkv_run("kvstore=dist_sync", "cluster=local", "cluster.dry_run=true", "+eval_only=true",
                    "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert "cluster.dry_run=true prints the job a launcher would start, but eval_only=true" in proc.stderr
