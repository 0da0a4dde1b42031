"""A user's own project: `tfkv-run --config-dir conf +experiment=mine` from a directory holding
their conf/ and their package, on one machine and as a distributed job. Every role of a launched
job runs the config the launcher composed and recorded (config_resolved.yaml), never one
recomposed from the overrides (which would lose --config-dir and hydra.searchpath)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import TAG, tagged_pids, tfkv_run

DIST = ("kvstore=dist_sync", "cluster=local", "cluster.num_workers=2", "cluster.num_servers=1",
        "epochs=1", "progress=false")


def _project(tmp_path: Path) -> Path:
    """A --config-dir whose experiment uses only tfkv's own groups: a distinctive width that
    only this file sets, so the workers' model shows which config they ran."""
    work = tmp_path / "work"
    (work / "conf" / "experiment").mkdir(parents=True)
    (work / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mlp\n  - override /dataset: digits\n"
        "model:\n  hidden: [24]\nbatch_size: 32\nseed: 7\n")
    return work


def _run_dir(work: Path) -> Path:
    (metrics,) = work.glob("outputs/*/*/metrics.json")
    return metrics.parent


@pytest.mark.slow
def test_config_dir_experiment_reaches_every_worker(tmp_path):
    """The failing case of issue 13: workers recomposed `+experiment=mine` without --config-dir."""
    work = _project(tmp_path)
    env = {TAG: f"own-{tmp_path.name}"}
    proc = tfkv_run("--config-dir", "conf", "+experiment=mine", *DIST, cwd=work, env=env, check=False,
                    timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    run = _run_dir(work)
    recorded = yaml.safe_load((run / "config_resolved.yaml").read_text())
    assert recorded["model"]["hidden"] == [24] and recorded["seed"] == 7
    assert json.loads((run / "metrics.json").read_text())["epoch"] == 1
    # Each worker says which config it ran: the digest of the recorded one.
    from tfkv.worker import digest

    want = digest(recorded)
    for rank in (0, 1):
        said = re.findall(r"config sha256 ([0-9a-f]{64})", (run / f"worker{rank}.log").read_text())
        assert said == [want], f"worker {rank}: {said} != {want}"
    assert not tagged_pids(env[TAG])
