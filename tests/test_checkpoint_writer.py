"""checkpoint.Writer: a checkpoint of exactly the step it was taken at, made durable off the
trainer's thread, one in flight at a time, its failure raised on the trainer's thread."""

import errno
import threading

import numpy as np
import pytest

from tfkv import checkpoint
from tfkv.checkpoint import files
from tfkv.errors import OutputError


def _save(writer, run, epoch, value, **kwargs):
    weights = [np.full((2, 3), value, np.float32)]
    writer.save(run, epoch, weights, ["w"], lambda p: np.savez(p, m=np.zeros(3, np.float32)), [],
                config="x: 1\n", **kwargs)
    weights[0][:] = -1  # the trainer goes on changing its weights: the checkpoint holds the step's


def test_fsyncs_run_off_the_trainers_thread_and_every_save_lands(tmp_path, monkeypatch):
    synced_on: list[str] = []
    fsync = files._fsync

    def recording(path):
        synced_on.append(threading.current_thread().name)
        fsync(path)

    monkeypatch.setattr(files, "_fsync", recording)
    writer = checkpoint.Writer()
    for epoch in (1, 2, 3):
        _save(writer, tmp_path, epoch, float(epoch), keep_last=2)
    writer.wait()
    assert synced_on and set(synced_on) == {"tfkv-checkpoint"}
    assert [p.name for p in checkpoint.all_in(tmp_path)] == ["epoch-0002", "epoch-0003"]
    assert writer.last == tmp_path / "checkpoints" / "epoch-0003"
    assert checkpoint.load(writer.last).weights[0][0, 0] == 3.0


def test_a_save_in_the_foreground_is_in_place_when_it_returns(tmp_path):
    writer = checkpoint.Writer()
    _save(writer, tmp_path, 1, 1.0, background=False)
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "epoch-0001"
    assert checkpoint.load(checkpoint.latest(tmp_path)).weights[0][0, 0] == 1.0


def test_a_failed_background_save_is_raised_by_the_next_save_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    writer = checkpoint.Writer()
    _save(writer, tmp_path, 1, 1.0)
    writer.wait()

    def full(path):  # a full disk, which this machine cannot be made to have for one test
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(files, "_fsync", full)
    _save(writer, tmp_path, 2, 2.0)
    with pytest.raises(OutputError, match="checkpoint epoch-0002: cannot write .*No space left on device"):
        _save(writer, tmp_path, 3, 3.0)  # raised before anything of save 3 is written
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch-0001"]  # no temporary left
    writer.wait()  # the failure was raised once
