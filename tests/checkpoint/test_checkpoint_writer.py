"""checkpoint.Writer: a checkpoint of exactly the step it was taken at, made durable off the
trainer's thread, one in flight at a time, its failure raised on the trainer's thread."""

import errno
import os
import signal
import threading
import time

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


# -- Ctrl-C while a checkpoint is written (tfkv.checkpoint.interrupt) ------------------------------

def _interrupting(times: int, then_sleep: float = 0.0):
    """A write_optimizer that presses Ctrl-C `times` (SIGINT to this process, as a terminal sends
    it) in the middle of the checkpoint's files, then goes on writing."""
    def write(path):
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + then_sleep
        while time.monotonic() < deadline:  # a slow disk
            time.sleep(0.01)
        np.savez(path, m=np.zeros(3, np.float32))
    return write


def test_ctrl_c_while_a_checkpoint_is_written_publishes_it_then_stops(tmp_path, caplog):
    writer = checkpoint.Writer()
    _save(writer, tmp_path, 1, 1.0)
    with pytest.raises(KeyboardInterrupt):
        writer.save(tmp_path, 2, [np.full((2, 3), 2.0, np.float32)], ["w"], _interrupting(1), [], config="x: 1\n")
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "epoch-0002"  # in place, checksummed
    assert checkpoint.load(tmp_path / "checkpoints" / "epoch-0002").weights[0][0, 0] == 2.0
    assert "Ctrl-C again stops at once" in caplog.text
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is Python's again
    writer.wait()


def test_a_second_ctrl_c_stops_at_once_without_the_checkpoint(tmp_path):
    writer = checkpoint.Writer()
    _save(writer, tmp_path, 1, 1.0)
    with pytest.raises(KeyboardInterrupt):
        writer.save(tmp_path, 2, [np.full((2, 3), 2.0, np.float32)], ["w"], _interrupting(2), [], config="x: 1\n")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["epoch-0001"]  # the previous one, valid
    assert checkpoint.load(checkpoint.latest(tmp_path)).weights[0][0, 0] == 1.0


def test_a_checkpoint_not_written_within_the_grace_after_ctrl_c_is_given_up(tmp_path):
    writer = checkpoint.Writer(grace=0.3)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        writer.save(tmp_path, 1, [np.ones((2, 3), np.float32)], ["w"], _interrupting(1, then_sleep=30), [],
                    config="x: 1\n")
    assert time.monotonic() - start < 10
    assert not list((tmp_path / "checkpoints").iterdir())  # nothing half-written left
