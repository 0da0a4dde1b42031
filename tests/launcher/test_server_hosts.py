"""Server hosts (`role=server` in the hosts file, cluster.server_hosts) and pinned CPUs
(cluster.server_cpus, cluster.worker_cpus): the hosts file's syntax, the plan, the refusals (one
line, exit 2, before anything starts, through `tfkv-launch` as a user runs it), and, slow, a real
local job whose roles really run on the CPUs they were given. Each launcher's placement with a
server host is in test_contract.py (the plan for every backend, the golden requests of ssh and
mpi); a job across emulated hosts is in tests/emulate/test_emulated_job.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TAG

from tfkv.errors import ConfigError
from tfkv.launcher import job as launch_job
from tfkv.launcher.hosts import HostsError, parse_hosts
from tfkv.launcher.placement import cpu_set
from tfkv.launcher.ports import release_port


def _plan(tmp_path: Path, hosts: str, launcher: str = "ssh", workers: int = 2, servers: int = 1, **options):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(hosts)
    opts = launch_job.Options(launcher, workers, servers, str(hostfile), **options)
    plan = launch_job.plan_job(opts, ["train"], tmp_path, tmp_path / "run").plan
    release_port(int(plan[0].env["DMLC_PS_ROOT_PORT"]))
    return [(p.role, p.host) for p in plan]


def test_a_hosts_file_line_says_role_server_beside_slots():
    hosts = parse_hosts("gpu1 slots=2\nu@cpu1:2222 role=server  # a CPU machine\ncpu2 role = server\n")
    assert [(h.name, h.slots, h.server) for h in hosts] == [("gpu1", 2, False), ("cpu1", None, True),
                                                           ("cpu2", None, True)]
    assert hosts[1].user == "u" and hosts[1].port == 2222


@pytest.mark.parametrize("text, says", [
    ("a role=gpu\n", "hosts:1: role=gpu is not a role a host takes; write role=server"),
    ("a role=server slots=2\n", "hosts:1: slots=2 counts workers, but role=server takes none"),
    ("a role=server\nb\na\n", "hosts:3: a is a server host (role=server) on one line and a worker host on another (line 1)"),
])
def test_a_bad_role_in_the_hosts_file_is_one_line_naming_it(text, says):
    with pytest.raises(HostsError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        parse_hosts(text)


def test_servers_cycle_over_the_server_hosts_and_workers_fill_the_others(tmp_path):
    got = _plan(tmp_path, "g1 slots=2\nc1 role=server\ng2 slots=2\nc2 role=server\n", workers=3, servers=4)
    assert got == [("scheduler", "c1"), ("server", "c1"), ("server", "c2"), ("server", "c1"), ("server", "c2"),
                   ("worker", "g1"), ("worker", "g1"), ("worker", "g2")]
    # cluster.server_hosts names them instead; workers round robin over the rest from the first
    got = _plan(tmp_path, "g1\ng2\nc1\n", workers=3, servers=1, server_hosts=["c1"])
    assert got == [("scheduler", "c1"), ("server", "c1"), ("worker", "g1"), ("worker", "g2"), ("worker", "g1")]
    # without server hosts: MXNet's placement, as before
    assert _plan(tmp_path, "a\nb\n") == [("scheduler", "a"), ("server", "a"), ("worker", "b"), ("worker", "a")]


@pytest.mark.parametrize("hosts, options, says", [
    ("a\nb role=server\n", {"launcher": "slurm"}, "server hosts (b): the slurm launcher does not place roles on hosts "
                                                 "(the resource manager picks the nodes); server hosts are for "
                                                 "--launcher mpi or ssh"),
    ("a\nb\n", {"server_hosts": ["a", "b"]}, "2 server host(s) but {hostfile} holds only 2 host(s): no host is left "
                                             "for the workers"),
    ("a\nb\n", {"server_hosts": ["c"]}, "cluster.server_hosts: c is not a host of {hostfile} (its hosts: a, b)"),
    ("a\nb\nc\n", {"server_hosts": ["b", "b"]}, "cluster.server_hosts: b is listed twice"),
    ("a\nb role=server\nc role=server\n", {}, "cluster.num_servers=1 is fewer than the 2 server hosts (b, c)"),
    ("a\n", {"server_cpus": "0-3", "worker_cpus": "3-7"}, "cluster.server_cpus=0-3 and cluster.worker_cpus=3-7 share "
                                                          "CPU(s) 3"),
    ("a\n", {"worker_cpus": "0-"}, "cluster.worker_cpus='0-' is not a CPU list"),
])
def test_bad_server_hosts_or_cpus_are_refused_before_anything_starts(tmp_path, hosts, options, says):
    hostfile = tmp_path / "hosts"
    with pytest.raises(ConfigError) as e:
        _plan(tmp_path, hosts, **{"launcher": "ssh", **options})
    assert str(e.value).startswith(says.format(hostfile=hostfile)), str(e.value)


def test_cpu_lists_are_taskset_s():
    assert cpu_set("0-2,8, 10-11", "x") == {0, 1, 2, 8, 10, 11}
    with pytest.raises(ConfigError, match="the range 3-1 runs backwards"):
        cpu_set("3-1", "x")


def _launch(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    exe = shutil.which("tfkv-launch")
    assert exe, "tfkv-launch is not on PATH: install the package first"
    return subprocess.run([exe, *args], cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, says", [
    (["--launcher", "sge", "--server-hosts", "b"], "tfkv-launch: server hosts (b): the sge launcher does not place"),
    (["--server-hosts", "a", "b"], "tfkv-launch: 2 server host(s) but hosts holds only 2 host(s)"),
    (["--worker-cpus", "x"], "tfkv-launch: cluster.worker_cpus='x' is not a CPU list"),
])
def test_tfkv_launch_refuses_in_one_line_with_exit_2(tmp_path, args, says):
    (tmp_path / "hosts").write_text("a\nb\n")
    proc = _launch("-n", "2", "-s", "1", "-H", "hosts", *args, "--dry-run", "--", "python3", "train.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(says) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "dry run" not in proc.stdout


def test_tfkv_launch_dry_run_shows_the_server_host(tmp_path):
    (tmp_path / "hosts").write_text("gpu1\ngpu2\ncpu1 role=server\n")
    proc = _launch("-n", "2", "-s", "1", "-H", "hosts", "--dry-run", "--", "python3", "train.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "cpu1: scheduler, server 0; gpu1: worker 0; gpu2: worker 1; nothing is started" in proc.stdout


# The worker: a real push and pull (so every role is up), then its own CPUs and those of the
# scheduler and servers of its job (the processes of tfkv.ps.node whose environment has its port).
PINNED_WORKER = """\
import json, os, sys
import numpy as np
import tfkv.store
kv = tfkv.store.create("dist_sync")
kv.init("w", np.zeros(3, np.float32))
kv.push("w", np.ones(3, np.float32))
got = kv.pull("w").tolist()
port = os.environ["DMLC_PS_ROOT_PORT"]
nodes = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
    except OSError:
        continue
    if b"tfkv.ps.node" in argv and f"DMLC_PS_ROOT_PORT={port}".encode() in environ:
        role = next(e for e in environ if e.startswith(b"DMLC_ROLE=")).decode().split("=")[1]
        nodes.setdefault(role, []).append(sorted(os.sched_getaffinity(int(pid))))
kv.close()
json.dump({"own": sorted(os.sched_getaffinity(0)), "nodes": nodes, "pulled": got}, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_a_local_job_s_roles_run_on_the_cpus_they_are_given(tmp_path):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs to give the servers and the workers one each")
    server_cpu, worker_cpu = sorted(os.sched_getaffinity(0))[:2]
    (tmp_path / "worker.py").write_text(PINNED_WORKER)
    proc = _launch("-n", "2", "-s", "1", "--launcher", "local", "--server-cpus", str(server_cpu), "--worker-cpus",
                   str(worker_cpu), "--run-dir", "rec", "--", sys.executable, "worker.py", "out{rank}.json",
                   cwd=tmp_path, env={TAG: f"pinned-{tmp_path.name}-{os.getpid()}"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    for rank in (0, 1):
        said = json.loads((tmp_path / f"out{rank}.json").read_text())
        assert said["own"] == [worker_cpu], said
        assert said["nodes"] == {"scheduler": [[server_cpu]], "server": [[server_cpu]]}, said
        assert said["pulled"] == [2.0, 2.0, 2.0]  # both workers' pushes summed: the job really ran


def test_a_cpu_the_host_lacks_is_one_line_after_the_pre_flight_before_any_role_starts(tmp_path):
    beyond = max(os.sched_getaffinity(0)) + 1
    proc = _launch("-n", "1", "-s", "1", "--launcher", "local", "--worker-cpus", str(beyond), "--run-dir", "rec",
                   "--", sys.executable, "-c", "open('started', 'w')", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"tfkv-launch: cluster.worker_cpus={beyond} names CPU(s) {beyond} that worker 0 may "
                                  "not use on 127.0.0.1 (the pre-flight found CPUs ") and proc.stderr.count("\n") == 1
    assert not (tmp_path / "started").exists() and "[scheduler]" not in proc.stdout
