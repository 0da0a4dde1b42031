"""A real `tfkv-run cluster=ssh` job on an emulated cluster, exactly as docs/guides/emulated-cluster.md tells it:
`TFKV_SSH_CONFIG=D/ssh_config tfkv-run ... cluster=ssh cluster.hostfile=D/hosts`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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


@pytest.mark.slow
@pytest.mark.parametrize("cut_host", ["node2", "node1"])
def test_a_host_cut_off_mid_job_is_named_and_the_launcher_ends_within_the_heartbeat_timeout_and_15_s(tmp_path,
                                                                                                       cut_host):
    """Issue 40, point 12: a host's link is cut (its veth set down) while the job runs: node2, with
    a server and a worker, or node1, the scheduler's host. The roles that can still talk find the
    silence within the heartbeat timeout and every role stops (the cut host's on their own: they
    lose the scheduler, or are it), but `tfkv-launch` (ssh) printed no final line for up to an hour: the
    teardown of node2 opened a channel on its dead connection and waited paramiko's channel
    timeout (3600 s). Now every ssh step has a deadline and the hosts are torn down side by side:
    the launcher exits 1 within heartbeat timeout + 15 s of the cut, naming the host, and leaves no
    role running on either host."""
    need_root("an emulated cluster")
    from tfkv.emulate import net

    work = tmp_path / "work"
    work.mkdir()
    tag = {TAG: f"cut-{tmp_path.name}-{os.getpid()}"}
    heartbeat_timeout = 4.0
    worker = Path(__file__).parents[1] / "workers" / "fault_worker.py"
    with Cluster.up([HostSpec("node1"), HostSpec("node2")], tmp_path / "cl") as cluster:
        hosts = cluster.write_hosts(cluster.state_dir / "hosts")
        launcher = subprocess.Popen(
            ["tfkv-launch", "-n", "2", "-s", "2", "-H", str(hosts), "--launcher", "ssh", "--python", sys.executable,
             "--heartbeat-timeout", str(heartbeat_timeout), "--run-dir", "rec", "--",
             sys.executable, str(worker), "out{rank}.json", "600"],
            cwd=work, env={**os.environ, **cluster.env(), **tag}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(launcher.stdout), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 180
            while not all((work / f"out{r}.json").exists() for r in (0, 1)):  # both workers push and pull
                assert launcher.poll() is None and time.monotonic() < deadline, "".join(output)[-5000:]
                time.sleep(0.2)
            time.sleep(1.0)
            veth = net.veth_name(cluster.record["k"], cluster.hosts.index(cluster.host(cut_host)))
            subprocess.run(["ip", "link", "set", veth, "down"], check=True)
            cut = time.monotonic()
            try:
                launcher.wait(timeout=heartbeat_timeout + 60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"no final line {heartbeat_timeout + 60:.0f} s after {cut_host} was cut off:\n"
                            + "".join(output)[-5000:])
            took = time.monotonic() - cut
            reader.join(timeout=10)
            text = "".join(output)
            (line,) = [ln for ln in text.splitlines() if ln.startswith("tfkv-launch:")]
            assert launcher.returncode == 1, text[-5000:]
            assert took <= heartbeat_timeout + 15, f"{took:.1f} s after the cut:\n{text[-5000:]}"
            assert f"@{cut_host}" in line and f"{cut_host} did not answer over ssh" in line, line
            assert not tagged_pids(tag[TAG], wait=10), "processes of the job left behind"
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()


# A worker that says on which host it runs (the UTS namespace's hostname is its host's name),
# then pushes and pulls for real (tests/workers/dist_worker.py's `updates`).
HOST_WORKER = """\
import os, socket, sys
open(f"host{sys.argv[1]}.txt", "w").write(socket.gethostname())
os.execv(sys.executable, [sys.executable, sys.argv[2], "updates", f"out{sys.argv[1]}.json", "5"])
"""


@pytest.mark.slow
def test_servers_run_on_the_server_host_and_workers_on_the_others(tmp_path):
    """BytePS's placement on three emulated hosts: node3 says role=server in the hosts file, so
    the scheduler and both servers run there (they listen on node3's own address, which only its
    network namespace has) and the two workers on node1 and node2 (their hostname); the job's
    result is exact."""
    need_root("an emulated cluster")
    work = tmp_path / "work"
    work.mkdir()
    (work / "where.py").write_text(HOST_WORKER)
    worker = Path(__file__).parents[1] / "workers" / "dist_worker.py"
    tag = {TAG: f"servers-{tmp_path.name}-{os.getpid()}"}
    with Cluster.up([HostSpec(f"node{i}") for i in (1, 2, 3)], tmp_path / "cl") as cluster:
        hosts = cluster.write_hosts(cluster.state_dir / "hosts", servers=["node3"])
        proc = subprocess.run(
            ["tfkv-launch", "-n", "2", "-s", "2", "-H", str(hosts), "--launcher", "ssh", "--python", sys.executable,
             "--verbose", "1", "--run-dir", "rec", "--", sys.executable, "where.py", "{rank}", str(worker)],
            cwd=work, env={**os.environ, **cluster.env(), **tag}, capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-5000:]
        assert "node3: scheduler, server 0, server 1; node1: worker 0; node2: worker 1" in out, out[-3000:]
        node3 = cluster.host("node3").address
        for server in (0, 1):
            assert any(ln.startswith(f"[server {server} @node3]") and f"listening on {node3}:" in ln
                       for ln in out.splitlines()), out[-3000:]
        assert [(work / f"host{r}.txt").read_text() for r in (0, 1)] == ["node1", "node2"]
        for r in (0, 1):  # SGD lr=1 from 100, worker r pushes r+1 each of 5 steps
            assert json.loads((work / f"out{r}.json").read_text())["final"] == [85.0] * 4
        assert not tagged_pids(tag[TAG], wait=10), "processes of the job left behind"
