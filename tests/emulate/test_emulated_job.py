"""A real `tfkv-run cluster=ssh` job on an emulated cluster, exactly as docs/guides/emulated-cluster.md tells it:
`TFKV_SSH_CONFIG=D/ssh_config tfkv-run ... cluster=ssh cluster.hostfile=D/hosts`."""

from __future__ import annotations

import json
import os
import sys

import pytest
from conftest import TAG, need_root, tagged_pids, tfkv_run

from tfkv.emulate import Cluster, HostSpec


@pytest.mark.slow
def test_tfkv_run_cluster_ssh_on_two_emulated_hosts(tmp_path):
    need_root("an emulated cluster")
    work = tmp_path / "work"
    work.mkdir()
    tag = {TAG: f"emulated-{tmp_path.name}-{os.getpid()}"}
    specs = [HostSpec("node1", cpus=0.8, link="1gbit"), HostSpec("node2", cpus=0.8, link="1gbit")]
    with Cluster.up(specs, tmp_path / "cl") as cluster:
        hosts = cluster.write_hosts(cluster.state_dir / "hosts")
        # The hosts share this filesystem, so no sync is needed; cluster.python: this very Python.
        proc = tfkv_run("+experiment=digits_mlp", "kvstore=dist_sync", "cluster=ssh", f"cluster.hostfile={hosts}",
                        "cluster.num_workers=2", "cluster.num_servers=2", f"cluster.python={sys.executable}",
                        "epochs=1", "progress=false", cwd=work, env={**cluster.env(), **tag}, timeout=500, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-5000:]
        (metrics,) = work.glob("outputs/*/*/metrics.json")
        assert json.loads(metrics.read_text())["epoch"] == 1
        plan = json.loads((metrics.parent / "launch" / "plan.json").read_text())["processes"]
        node1 = cluster.host("node1")
        assert {p["host"] for p in plan} == {"node1", "node2"}
        assert {p["env"]["DMLC_PS_ROOT_URI"] for p in plan} == {node1.address}  # the scheduler, on node1's link
        assert "[worker 1 @node2]" in out and "[worker 0 @node1]" in out
        versions = json.loads((metrics.parent / "launch" / "versions.json").read_text())
        assert set(versions) >= {"node1", "node2"}, versions
        assert not tagged_pids(tag[TAG], wait=10), "processes of the job left behind"
