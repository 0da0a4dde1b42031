"""tfkv.emulate for real: namespaces, veths, tc tbf, cgroups and sshds on this machine (root).

Refusals need no namespaces and run by default; the rest make hosts and are slow. A host's CPU
budget is checked by the CPU time a busy loop gets (/proc/<pid>/stat), a link's rate by a plain
TCP transfer between two hosts, and every teardown by looking for what the cluster's record names.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import need_root

from tfkv.emulate import Cluster, HostSpec, Refused
from tfkv.emulate.spec import CGROUP_CPU, check

HERE = Path(__file__).parent
EMULATE = [sys.executable, "-m", "tfkv.emulate.cli"]  # the tfkv-emulate console script's main()
ENV = {**os.environ, "PYTHONPATH": str(HERE.parents[1])}  # child Pythons import this tree's tfkv
NETNS_DIR = Path("/run/netns")  # where `ip netns add` names a namespace


def _machine() -> tuple[list, list[str], list[str]]:
    """Links, namespaces and cpu cgroups here: to show a refusal made nothing. Read without `ip`
    (iproute2 is no pip package: the refusals run in the fast suite, on a machine without it)."""
    netns = sorted(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else []  # what `ip netns list` reads
    return sorted(socket.if_nameindex()), netns, sorted(os.listdir(CGROUP_CPU)) if CGROUP_CPU.is_dir() else []


def _leftovers(record: dict) -> list[str]:
    """What of a cluster's record still exists: links, namespaces, cgroups, processes."""
    prefix, state = record["prefix"], record.get("state_dir", "")
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.split("\n")
    names = {line.split(":")[1].strip().split("@")[0] for line in links if line}
    names |= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
    left = [n for n in names if n == f"{prefix}br" or n.startswith((f"{prefix}h", f"{prefix}v"))]
    left += [g for g in os.listdir(CGROUP_CPU) if g.startswith(f"{prefix}-")]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if state and state in cmdline and int(pid) != os.getpid():
            left.append(f"process {pid}: {cmdline}")
    return left


def _record(state_dir: Path) -> dict:
    return {**json.loads((state_dir / "cluster.json").read_text()), "state_dir": str(state_dir)}


# -- refusals: one line, before anything is made -------------------------------------------------

@pytest.mark.parametrize("specs,kw,said", [
    ([HostSpec("node1")], {"euid": 1000}, "an emulated cluster needs root"),
    ([HostSpec("node1", cpus=1.5), HostSpec("node2", cpus=1.5)], {"cpu_count": 2},
     "the hosts' cpus add up to 3 cores and this machine has 2"),
    ([HostSpec("node1", cpus=0)], {}, "host node1: cpus=0 is not a CPU budget"),
    ([HostSpec("node1", cpus=-1)], {}, "host node1: cpus=-1 is not a CPU budget"),
    ([HostSpec("node1", link="fast")], {}, "host node1: link_in='fast' is not a rate tc reads"),
    ([HostSpec("node1", link_out="10gbits")], {}, "host node1: link_out='10gbits' is not a rate tc reads"),
    ([HostSpec(f"node{i}") for i in range(65)], {}, "65 hosts asked for, at most 64"),
    ([HostSpec("node1"), HostSpec("node1")], {}, "host name 'node1' is given twice"),
    ([HostSpec("Node_1")], {}, "host name 'Node_1' is not a hostname"),
    ([HostSpec("node1", cpus=0.5)], {"cgroup_root": Path("/nonexistent")}, "no cgroup v1 cpu controller at"),
])
def test_what_this_machine_cannot_hold_is_refused_in_one_line(specs, kw, said):
    with pytest.raises(Refused) as e:
        check(specs, **{"euid": 0, **kw})
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("args,said", [
    # one core more than this machine has, whatever it has
    (["--hosts", "2", "--cpus", f"{(os.cpu_count() + 1) / 2:g}"],
     f"the hosts' cpus add up to {os.cpu_count() + 1} cores and this machine has {os.cpu_count()}"),
    (["--hosts", "2", "--cpus", "0"], "host node1: cpus=0.0 is not a CPU budget"),
    (["--hosts", "2", "--link", "1gigabit"], "host node1: link_in='1gigabit' is not a rate tc reads"),
    (["--hosts", "2", "--cpus-each", "0.2"], "--cpus-each names 1 budgets for 2 hosts"),
])
def test_the_cli_refuses_in_one_line_with_status_2_and_makes_nothing(tmp_path, args, said):
    need_root("tfkv-emulate's refusals after its first, that it needs root")
    before = _machine()
    proc = subprocess.run([*EMULATE, "up", *args, "--dir", str(tmp_path / "cl")], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"tfkv-emulate: {said}") and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "cl").exists() and _machine() == before


@pytest.mark.parametrize("command", ["up", "down"])
@pytest.mark.parametrize("under", ["", "sub"])
def test_a_dir_that_is_a_file_is_refused_in_one_line_with_status_2(tmp_path, command, under):
    """--dir naming an existing file (or a path inside one): what, where and how, not `[Errno 17]`."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    before = _machine()
    target = afile / under if under else afile
    args = ["--hosts", "1"] if command == "up" else []
    proc = subprocess.run([*EMULATE, command, *args, "--dir", str(target)], capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 2, proc.stderr
    where = f"--dir {target}" if not under else f"--dir {target}: {afile}"
    assert proc.stderr == (f"tfkv-emulate: {where} is a file, not a directory; name a directory for the cluster's "
                           "state (keys, ssh config, hosts file; `up` makes it where it does not exist)\n")
    assert afile.read_text() == "mine" and _machine() == before


def test_the_cli_refuses_a_user_who_is_not_root(tmp_path):
    need_root("running tfkv-emulate as another user (setpriv)")
    tmp_path.chmod(0o777)
    before = _machine()
    proc = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", *EMULATE, "up",
                           "--hosts", "2", "--dir", str(tmp_path / "cl")], capture_output=True, text=True, env=ENV,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "tfkv-emulate: an emulated cluster needs root (network namespaces, tc, cgroups): run it as root\n"
    assert not (tmp_path / "cl").exists() and _machine() == before


# -- hosts ---------------------------------------------------------------------------------------

def _ssh(cluster: Cluster, host: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-F", str(cluster.ssh_config), "-o", "BatchMode=yes", host, command],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.slow
def test_two_hosts_have_their_names_and_reach_each_other_by_name_over_ssh(tmp_path):
    need_root("an emulated cluster")
    with Cluster.up([HostSpec("node1"), HostSpec("node2")], tmp_path / "cl") as cluster:
        node1, node2 = cluster.hosts
        assert node1.address != node2.address and node1.address.rsplit(".", 1)[0] == node2.address.rsplit(".", 1)[0]
        assert node1.run(["hostname"], capture_output=True, text=True).stdout == "node1\n"
        for here, there in (("node1", "node2"), ("node2", "node1")):
            r = _ssh(cluster, here, f"hostname; ssh -F {cluster.ssh_config} -o BatchMode=yes {there} hostname; "
                                    f"getent hosts {there}")
            address = cluster.host(there).address
            assert r.returncode == 0 and r.stdout.split("\n")[:2] == [here, there], r.stderr
            assert r.stdout.split("\n")[2].split() == [address, there]
        hosts = cluster.write_hosts(tmp_path / "hosts", slots=2)
        assert hosts.read_text() == "node1 slots=2\nnode2 slots=2\n"
        assert cluster.env() == {"TFKV_SSH_CONFIG": str(cluster.ssh_config)}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.slow
def test_a_hosts_cpu_budget_holds_for_what_it_starts_and_what_ssh_starts(tmp_path):
    need_root("an emulated cluster")
    with Cluster.up([HostSpec("slow", cpus=0.25), HostSpec("free")], tmp_path / "cl") as cluster:
        slow, free = cluster.hosts
        assert free.cgroup is None and slow.cgroup == CGROUP_CPU / f"{cluster.record['prefix']}-slow"
        busy = slow.popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.5)  # past Python's start
            cpu0, t0 = _cpu_seconds(busy.pid), time.monotonic()
            time.sleep(2)
            share = (_cpu_seconds(busy.pid) - cpu0) / (time.monotonic() - t0)
            assert busy.pid in [int(p) for p in (slow.cgroup / "cgroup.procs").read_text().split()]
        finally:
            busy.kill()
            busy.wait()
        assert 0.15 < share < 0.35, f"a busy loop on a 0.25-core host got {share:.2f} core"
        r = _ssh(cluster, "slow", "cat /proc/self/cgroup")
        assert f"cpu:/{slow.cgroup.name}\n" in r.stdout, r.stdout + r.stderr
        assert "cpu:/\n" in _ssh(cluster, "free", "cat /proc/self/cgroup").stdout


def _bits_per_second(sender, receiver, port: int = 5001, seconds: float = 2) -> float:
    """A TCP transfer from one host to another, as the receiver measured it."""
    script = str(HERE.parent / "workers" / "throughput.py")
    recv = receiver.popen([sys.executable, script, "recv", receiver.address, str(port)], stdout=subprocess.PIPE,
                          text=True)
    try:
        assert recv.stdout.readline() == "listening\n"
        sender.run([sys.executable, script, "send", receiver.address, str(port), str(seconds)], check=True,
                   timeout=60)
        return float(recv.stdout.readline())
    finally:
        recv.kill()
        recv.wait()


@pytest.mark.slow
def test_a_links_rate_holds_in_each_direction(tmp_path):
    need_root("an emulated cluster")
    specs = [HostSpec("a", link="100mbit"), HostSpec("b"), HostSpec("c"), HostSpec("d", link_in="20mbit",
                                                                                    link_out="80mbit")]
    with Cluster.up(specs, tmp_path / "cl") as cluster:
        a, b, c, d = cluster.hosts
        pairs = {"a->b": (a, b), "b->a": (b, a), "b->c": (b, c), "b->d": (b, d), "d->b": (d, b)}
        # The best of two transfers: a busy machine (the other xdist worker) can only slow one
        # below the link's rate, never lift it above, so the upper bounds still check the limit.
        measured = {k: max(_bits_per_second(*pair) for _ in range(2)) for k, pair in pairs.items()}
    mbit = {k: round(v / 1e6, 1) for k, v in measured.items()}
    assert 80 < mbit["a->b"] < 120 and 80 < mbit["b->a"] < 120, mbit  # a's 100mbit, either way
    assert mbit["b->c"] > 5 * 100, mbit  # unlimited: veths and a bridge at memory speed
    assert 16 < mbit["b->d"] < 24 and 64 < mbit["d->b"] < 96, mbit  # d: 20mbit in, 80mbit out


# -- down ----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_down_leaves_nothing_and_a_second_down_finds_nothing(tmp_path):
    need_root("an emulated cluster")
    state = tmp_path / "cl"
    cluster = Cluster.up([HostSpec("node1", cpus=0.2, link="1gbit"), HostSpec("node2", cpus=0.2)], state)
    record = _record(state)
    sleeper = cluster.hosts[0].popen(["sleep", "600"])  # a process left on a host
    session = subprocess.Popen(["ssh", "-F", str(cluster.ssh_config), "node2", "sleep 600"])  # and one over ssh
    time.sleep(1)
    assert len(_leftovers(record)) >= 2 + 2 + 2 + 1 + 2  # 2 netns, 2 veths, 2 cgroups, a bridge, 2 sshds
    gone = cluster.down()
    session.wait(timeout=10)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert gone[1:] == [f"veth {record['prefix']}v0", f"netns {record['prefix']}h0", f"cgroup {CGROUP_CPU}/"
                        f"{record['prefix']}-node1", f"veth {record['prefix']}v1", f"netns {record['prefix']}h1",
                        f"cgroup {CGROUP_CPU}/{record['prefix']}-node2", f"bridge {record['prefix']}br"], gone
    assert int(gone[0].split()[0]) >= 3  # the two sshds, the sleeper (and the ssh session's processes)
    assert _leftovers(record) == [] and not state.exists()
    assert cluster.down() == [] and Cluster.down_all(state) == []


def _child(code: str, state: Path, *args: str) -> subprocess.Popen:
    """A Python process that brings a cluster up and says 'up' when it is."""
    proc = subprocess.Popen([sys.executable, "-c", code, str(state), *args], stdout=subprocess.PIPE, text=True,
                            env=ENV, start_new_session=True)
    assert proc.stdout.readline().strip().endswith("up"), proc.communicate(timeout=30)
    return proc


UP_AND_WAIT = """
import sys, time
from tfkv.emulate import Cluster, HostSpec
specs = [HostSpec("node1", cpus=0.2, link="1gbit"), HostSpec("node2")]
if sys.argv[2:] == ["with"]:
    with Cluster.up(specs, sys.argv[1]) as cluster:
        cluster.hosts[0].popen(["sleep", "600"])
        print("up", flush=True)
        time.sleep(600)
else:
    cluster = Cluster.up(specs, sys.argv[1])
    cluster.hosts[0].popen(["sleep", "600"])
    print("up", flush=True)
    time.sleep(600)
"""


@pytest.mark.slow
def test_after_a_crash_tfkv_emulate_down_cleans_up_everything(tmp_path):
    need_root("an emulated cluster")
    state = tmp_path / "cl"
    maker = _child(UP_AND_WAIT, state)
    record = _record(state)
    maker.kill()  # SIGKILL: no teardown of its own
    maker.wait(timeout=10)
    assert _leftovers(record), "the crash left nothing to clean: the test shows nothing"
    proc = subprocess.run([*EMULATE, "down", "--dir", str(state)], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("down: ") and "bridge" in proc.stdout, proc.stderr
    assert _leftovers(record) == []
    proc = subprocess.run([*EMULATE, "down", "--dir", str(state)], capture_output=True, text=True, env=ENV, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"nothing left to take down in {state}\n"


@pytest.mark.slow
@pytest.mark.parametrize("how,signum", [("with", signal.SIGINT), ("with", signal.SIGTERM), ("cli", signal.SIGINT),
                                        ("cli", signal.SIGTERM)])
def test_ctrl_c_or_sigterm_tears_down(tmp_path, how, signum):
    need_root("an emulated cluster")
    state = tmp_path / "cl"
    if how == "with":
        maker = _child(UP_AND_WAIT, state, "with")
    else:
        maker = subprocess.Popen([*EMULATE, "up", "--hosts", "2", "--cpus", "0.2", "--link", "1gbit", "--dir",
                                  str(state), "--wait"], stdout=subprocess.PIPE, text=True, env=ENV)
        while (line := maker.stdout.readline()) != "up until Ctrl-C\n":
            assert line, f"tfkv-emulate up --wait ended before it was up: {maker.wait(timeout=30)}"
    record = _record(state)
    assert _leftovers(record)
    maker.send_signal(signum)
    maker.wait(timeout=30)
    assert _leftovers(record) == [] and not (state / "cluster.json").exists()


@pytest.mark.slow
def test_cli_up_prints_how_to_use_it_and_down_takes_it_down(tmp_path):
    need_root("an emulated cluster")
    state = tmp_path / "cl"
    proc = subprocess.run([*EMULATE, "up", "--hosts", "3", "--cpus-each", "0.4,0.4,0.2", "--link-in", "10gbit",
                           "--link-out", "1gbit", "--dir", str(state)], capture_output=True, text=True, env=ENV,
                          timeout=60)
    try:
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert [line.split()[0] for line in lines[:3]] == ["node1", "node2", "node3"]
        assert lines[2].endswith("cpus=0.2 in=10gbit out=1gbit")
        assert f"ssh config: {state / 'ssh_config'}" in proc.stdout and f"hosts file: {state / 'hosts'}" in proc.stdout
        assert (state / "hosts").read_text() == "node1 slots=1\nnode2 slots=1\nnode3 slots=1\n"
        assert f"TFKV_SSH_CONFIG={state / 'ssh_config'} tfkv-run kvstore=dist_sync cluster=ssh" in proc.stdout
    finally:
        down = subprocess.run([*EMULATE, "down", "--dir", str(state)], capture_output=True, text=True, env=ENV,
                              timeout=60)
    assert down.returncode == 0 and "bridge" in down.stdout
