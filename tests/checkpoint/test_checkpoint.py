"""Checkpoints: a damaged one is refused in one line naming the file; a save that fails (a full
disk) leaves no partial directory behind; what is published is fsynced first."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import need_root, tfkv_run

from tfkv import checkpoint
from tfkv.errors import ConfigError, TfkvError


def _save(run_dir: Path, epoch: int) -> Path:
    weights = [np.arange(6, dtype=np.float32).reshape(2, 3) + epoch, np.ones(3, np.float32)]
    return checkpoint.save(run_dir, epoch, weights, ["dense/kernel", "dense/bias"],
                           lambda path: np.savez(path, **{"0/mom": np.zeros(3, np.float32)}),
                           [{"epoch": e} for e in range(1, epoch + 1)])


def _flip_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _drop_epoch(f: Path) -> None:
    state = json.loads(f.read_text())
    del state["epoch"]
    f.write_text(json.dumps(state))


DAMAGE = {
    "truncated": ("weights.npz", lambda f: f.write_bytes(f.read_bytes()[:200]), "weights.npz is damaged"),
    "empty": ("weights.npz", lambda f: f.write_bytes(b""), "weights.npz is empty (0 bytes)"),
    "byte-flipped": ("weights.npz", _flip_byte, "weights.npz is damaged"),
    "no epoch": ("state.json", _drop_epoch, "state.json has no valid 'epoch'"),
    "optimizer missing": ("optimizer.npz", lambda f: f.unlink(), "optimizer.npz is missing"),
    "state not json": ("state.json", lambda f: f.write_bytes(b"\xff{"), "state.json is not readable JSON"),
}


def test_a_saved_checkpoint_loads_back(tmp_path):
    _save(tmp_path, 1)
    ckpt = checkpoint.load(checkpoint.find_resume(str(tmp_path), tmp_path / "new", tmp_path, []))
    assert ckpt.epoch == 1 and ckpt.weight_names == ["dense/kernel", "dense/bias"]
    np.testing.assert_array_equal(ckpt.weights[0], np.arange(6, dtype=np.float32).reshape(2, 3) + 1)
    assert list(ckpt.optimizer) == ["0/mom"] and ckpt.history == [{"epoch": 1}]


def test_a_checkpoint_of_more_than_ten_thousand_variables_loads_back(tmp_path):
    """Array names w0000..w10000: 'w10000' sorts among the 'w1000x' in text order."""
    weights = [np.full(1, i, np.float32) for i in range(10_001)]
    checkpoint.save(tmp_path, 1, weights, [f"v{i}" for i in range(10_001)],
                    lambda path: np.savez(path, **{"0/mom": np.zeros(1, np.float32)}), [])
    ckpt = checkpoint.load(checkpoint.latest(tmp_path))
    assert [float(w[0]) for w in ckpt.weights] == list(range(10_001))


def _edit_epoch(f: Path) -> None:
    """Still valid JSON, another position: only the checksum can tell."""
    state = json.loads(f.read_text())
    state["epoch"] += 5
    f.write_text(json.dumps(state))


DAMAGE["edited"] = ("state.json", _edit_epoch, "state.json does not match its checksum in SHA256SUMS")
DAMAGE["sums missing"] = ("SHA256SUMS", lambda f: f.unlink(), "SHA256SUMS is missing")


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, case):
    name, damage, message = DAMAGE[case]
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    damage(newest / name)
    with pytest.raises(ConfigError) as e:
        checkpoint.load(newest)
    text = str(e.value)
    assert "\n" not in text and str(newest / name) in text and message in text, text
    assert f"resume={tmp_path / 'checkpoints' / 'epoch-0001'}" in text, text  # the one to use instead


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_resuming_a_run_passes_over_a_damaged_newest_checkpoint_with_one_warning(tmp_path, case, caplog):
    name, damage, message = DAMAGE[case]
    _save(tmp_path, 1)
    damage(_save(tmp_path, 2) / name)
    with caplog.at_level("WARNING", logger="tfkv"):
        found = checkpoint.find_resume(str(tmp_path), tmp_path / "new", tmp_path, [])
    assert found == tmp_path / "checkpoints" / "epoch-0001"
    (line,) = [r.getMessage() for r in caplog.records]
    assert message in line and "continuing from" in line and str(found) in line, line
    np.testing.assert_array_equal(checkpoint.load(found).weights[0], np.arange(6, dtype=np.float32).reshape(2, 3) + 1)


def test_a_run_whose_only_checkpoint_is_damaged_is_refused_not_restarted(tmp_path):
    (_save(tmp_path, 1) / "weights.npz").write_bytes(b"")
    for resume in (str(tmp_path), "auto"):
        with pytest.raises(ConfigError, match="start afresh"):
            checkpoint.find_resume(resume, tmp_path, tmp_path, [])


def _one_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("tfkv-run:")]
    return line


def test_tfkv_run_refuses_another_models_or_a_truncated_checkpoint_in_one_line(tmp_path):
    tfkv_run("epochs=1", "progress=false", "hydra.run.dir=first", cwd=tmp_path)
    for other, first in (("model.hidden=[32]", "model.hidden is [256, 128] in the checkpoint, [32] here"),
                         ("optimizer=adam", "optimizer.name is 'sgd' in the checkpoint, 'adam' here")):
        line = _one_line(tfkv_run("epochs=2", "progress=false", "resume=first", other, cwd=tmp_path, check=False))
        assert "does not fit this model and optimizer" in line and first in line and "resume=false" in line, line
    weights = tmp_path / "first" / "checkpoints" / "epoch-0001" / "weights.npz"
    weights.write_bytes(weights.read_bytes()[:300])
    line = _one_line(tfkv_run("epochs=2", "progress=false", "resume=first", cwd=tmp_path, check=False))
    assert str(weights.resolve()) in line or str(Path("first") / "checkpoints") in line, line
    assert "weights.npz is damaged" in line and "resume=false" in line, line


def test_a_failed_save_leaves_no_partial_checkpoint(tmp_path):
    _save(tmp_path, 1)

    def disk_full(path: str) -> None:
        raise OSError(28, "No space left on device", path)

    with pytest.raises(TfkvError) as e:
        checkpoint.save(tmp_path, 2, [np.ones(2, np.float32)], ["w"], disk_full, [])
    assert "No space left on device" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch-0001"]


def test_a_stale_temporary_checkpoint_is_removed_by_the_next_save(tmp_path):
    stale = tmp_path / "checkpoints" / ".epoch-0007.tmp"
    stale.mkdir(parents=True)
    (stale / "weights.npz").write_bytes(b"x" * 1000)
    _save(tmp_path, 1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch-0001"]


@pytest.mark.slow  # strace is no pip package: the slow suite, which .ci/run installs it for
def test_checkpoint_files_are_fsynced_before_the_rename(tmp_path):
    """strace shows every file's and the directory's fsync come before the rename that publishes them."""
    if not shutil.which("strace"):  # the order of system calls cannot be seen without it
        if os.environ.get("CI"):
            pytest.fail("strace is not installed, and CI must run this test: .ci/run installs it")
        pytest.skip("strace is not installed (apt-get install strace)")
    here = Path(__file__).parent  # this module, and tests/ for the conftest it imports
    code = ("import sys, numpy as np; sys.path[:0] = [%r, %r]\n"
            "from test_checkpoint import _save; from pathlib import Path; _save(Path(%r), 1)\n"
            % (str(here), str(here.parent), str(tmp_path)))
    log = tmp_path / "strace.log"
    subprocess.run(["strace", "-f", "-e", "trace=openat,fsync,rename,renameat,renameat2", "-o", str(log),
                    sys.executable, "-c", code], check=True, timeout=120)
    calls = log.read_text().splitlines()
    fds: dict[str, str] = {}
    synced, renamed_at = [], None
    for i, line in enumerate(calls):
        if "openat(" in line and ".epoch-0001.tmp" in line and "= " in line:
            fd = line.rsplit("= ", 1)[1].split()[0]
            fds[fd] = line.split('"')[1]
        elif "fsync(" in line:
            fd = line.split("fsync(")[1].split(")")[0]
            if fd in fds:
                synced.append(os.path.basename(fds.pop(fd)))
        elif "rename" in line and ".epoch-0001.tmp" in line:
            renamed_at = i
            break
    assert renamed_at is not None, "the checkpoint was not published by a rename"
    assert {"weights.npz", "optimizer.npz", "state.json", ".epoch-0001.tmp"} <= set(synced), synced


# -- a real full disk: a tmpfs too small for one checkpoint holds the run directory ----------------

DIST_JOB = ["kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1", "epochs=2",
            "progress=false", "model.hidden=[512,256]"]  # weights alone: 0.67 MB


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    need_root("mounting a tmpfs")  # skips for a non-root developer only; under CI a failure
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"cannot mount a tmpfs as root: {proc.stderr.strip()}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk: Path, *open_files: Path) -> None:
    """Take every free byte of `disk`, also the room left in the last page of `open_files`."""
    for path, chunk in [(disk / "ballast", 4096), *((f, 1) for f in open_files)]:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while os.write(fd, b"\0" * chunk):
                pass
        except OSError:
            pass  # full
        finally:
            os.close(fd)
    assert shutil.disk_usage(disk).free < 4096


def _check_failed_job(proc_rc: int, out: str, err: str, run: Path) -> None:
    assert proc_rc == 2, out + err
    assert "Traceback" not in out + err and "Logging error" not in out + err, out + err
    lines = [ln for ln in err.splitlines() if ln.startswith("tfkv-run:")]
    assert len(lines) == 1 and "the dist_sync job failed: worker 0" in lines[0], err
    assert "No space left on device" in out  # the worker's own line says why
    assert not list((run / "checkpoints").glob(".epoch-*")), "a partial checkpoint was left behind"


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_ends_the_job_in_one_line_and_cleans_up(tmp_path, tiny_disk):
    run = tiny_disk / "run"
    proc = tfkv_run(*DIST_JOB, f"hydra.run.dir={run}", cwd=tmp_path, check=False, timeout=240)
    _check_failed_job(proc.returncode, proc.stdout, proc.stderr, run)
    assert shutil.disk_usage(tiny_disk).used < 200_000  # the 0.6 MB the partial checkpoint took are free


@pytest.mark.slow
def test_the_launcher_survives_its_own_log_on_a_full_disk(tmp_path, tiny_disk):
    """The disk is full from the moment the job starts: job.log, the worker logs and the
    checkpoint all fail; the launcher still ends with its one line."""
    run = tiny_disk / "run"
    proc = subprocess.Popen([shutil.which("tfkv-run"), *DIST_JOB, f"hydra.run.dir={run}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    try:
        for line in proc.stdout:  # once a role speaks, the record is written and job.log open
            out.append(line)
            if line.startswith("["):
                _fill(tiny_disk, run / "launch" / "job.log")
                break
        rest, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    out = "".join(out) + rest
    _check_failed_job(proc.returncode, out, err, run)
    assert "cannot write" in out and "job.log" in out  # said once, not a traceback
