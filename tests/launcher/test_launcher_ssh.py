"""`--launcher ssh` for real: sshd on 127.0.0.1 and on network-namespace hosts (tests/cluster_hosts.py),
Fabric, rsync, and a job of real scheduler, server and worker processes. After each job, no
process of it may be left on any host: every process carries the test's tag (TFKV_* variables of
the launching shell travel to the roles), and the namespace hosts share /proc with us.

The fast tests need no sshd: placement, and the remote command run by a local `sh`.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_hosts import loopback_host, netns_hosts, run_remote_command, ssh_site, start_remote_command  # noqa: F401
from conftest import REPO, TAG, tagged_pids, tfkv_run

from tfkv.errors import ConfigError
from tfkv.launcher import job as launch_job
from tfkv.launcher.backends.ssh_remote import MARK

PY = sys.executable  # the "remote" hosts share this machine's Python, where tfkv is installed


def _tag(tmp_path: Path) -> dict[str, str]:
    return {TAG: f"ssh-{tmp_path.name}-{os.getpid()}"}


def _no_leftovers(tag: str, seconds: float = 10) -> list[int]:
    """The tagged processes still alive after up to `seconds` (killed ones take a moment to go)."""
    deadline = time.monotonic() + seconds
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _workdir(tmp_path: Path, hosts: list[str]) -> Path:
    """A small working directory to sync: the worker script, a data file, things never synced."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(REPO / "tests" / "workers" / "dist_worker.py", work)
    (work / "data.txt").write_text("data\n")
    (work / "gone.txt").write_text("deleted locally before the second sync\n")
    for skipped in ("outputs/old", ".git/x", "__pycache__/y"):
        (work / skipped).parent.mkdir(parents=True, exist_ok=True)
        (work / skipped).write_text("never synced\n")
    (work / "hosts").write_text("".join(f"{h}\n" for h in hosts))
    return work


def _launch(*args: str, cwd: Path, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    exe = shutil.which("tfkv-launch")
    assert exe, "tfkv-launch is not on PATH: install the package first (pip install '.[cpu,test]')"
    return subprocess.run(["timeout", "-s", "INT", "-k", "10", str(timeout), exe, *args], cwd=cwd,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout + 20)


# -- fast: no sshd --------------------------------------------------------------------------------

def test_hosts_file_placement_five_hosts_three_workers(tmp_path):
    (tmp_path / "hosts").write_text("h1\nh2\nh3\nh4\nh5\n")
    opts = launch_job.Options("ssh", 3, 3, str(tmp_path / "hosts"), "/tmp/job")
    job = launch_job.plan_job(opts, ["python3", "train.py"], tmp_path, tmp_path / "outputs" / "run")
    where = {p.name: p.host for p in job.plan}
    assert where == {"scheduler @h1": "h1", "server 0 @h1": "h1", "server 1 @h2": "h2", "server 2 @h3": "h3",
                     "worker 0 @h4": "h4", "worker 1 @h5": "h5", "worker 2 @h1": "h1"}
    assert job.remote_run_dir == "/tmp/job/outputs/run"  # the workers write under the synced tree


def test_remote_command_quotes_env_and_argv_and_reports_the_group(tmp_path):
    odd = "a 'b' \"c\" $HOME `x` ;|&"
    proc, out = run_remote_command(
        [PY, "-c", "import os, sys; print(os.environ['ODD'], sys.argv[1], os.getcwd())", odd], {"ODD": odd}, tmp_path)
    lines = out.split("\n")  # not splitlines(): it also splits at the marker's \x1e
    assert lines[0].startswith(MARK + "pgid ") and int(lines[0].split()[-1]) == proc.pid  # its own group
    assert lines[1] == f"{odd} {odd} {tmp_path}"
    assert lines[2] == MARK + "exit 0" and proc.returncode == 0


def test_remote_command_names_the_signal_that_killed_the_role(tmp_path):
    proc, out = run_remote_command(["sh", "-c", "printf 'no newline'; kill -9 $$"], {}, tmp_path)
    assert out.split("\n")[-2] == f"no newline{MARK}exit -9"
    assert proc.returncode == 128 + 9


def test_remote_command_kills_its_group_when_the_channel_closes(tmp_path):
    tag = _tag(tmp_path)
    proc = start_remote_command(["sh", "-c", "sleep 60 & sleep 60; echo never"], tag, tmp_path)
    assert proc.stdout.readline().startswith(MARK + "pgid")
    deadline = time.monotonic() + 10
    while len(tagged_pids(tag[TAG])) < 4 and time.monotonic() < deadline:  # wrapper, sh, 2 sleeps
        time.sleep(0.05)
    assert len(tagged_pids(tag[TAG])) == 4
    proc.stdin.close()  # what the channel's end looks like to the remote command
    proc.wait(timeout=10)
    assert not _no_leftovers(tag[TAG], 5)


def test_a_connection_is_dead_after_ssh_configs_server_alive_settings_never_off():
    """Issue 40, point 12: the silence after which an ssh connection counts as dead (and the
    kernel drops it, TCP_USER_TIMEOUT) follows ServerAliveInterval x ServerAliveCountMax, as ssh
    does; 0, ssh's "off", is not taken: a host cut off would then hold the launcher."""
    from tfkv.launcher.backends.ssh_connect import ALIVE_COUNT, ALIVE_INTERVAL, dead_after

    assert dead_after({}) == (ALIVE_INTERVAL, ALIVE_INTERVAL * ALIVE_COUNT)
    assert dead_after({"serveraliveinterval": "5", "serveralivecountmax": "2"}) == (5, 10)
    assert dead_after({"serveraliveinterval": "0"}) == (ALIVE_INTERVAL, ALIVE_INTERVAL * ALIVE_COUNT)


# -- slow: real sshd ------------------------------------------------------------------------------

@pytest.mark.slow
def test_launch_over_ssh_syncs_runs_and_records(netns_hosts, ssh_site, tmp_path, monkeypatch):
    work = _workdir(tmp_path, netns_hosts.names)
    dst, run, env = tmp_path / "dst", tmp_path / "run", {**_tag(tmp_path), **ssh_site.env()}
    t0 = time.monotonic()
    proc = _launch("-n", "2", "-s", "2", "-H", "hosts", "--launcher", "ssh", "--sync-dst-dir", str(dst),
                   "--python", PY, "--verbose", "1", "--run-dir", str(run), "--",
                   PY, "dist_worker.py", "updates", "out{rank}.json", "5", cwd=work, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert ("tfkv: ssh job, 2 server(s), 2 worker(s) - node1: scheduler, server 0, worker 0; "
            "node2: server 1, worker 1") in out
    for prefix in ("[scheduler @node1]", "[server 0 @node1]", "[server 1 @node2]", "[worker 0 @node1]",
                   "[worker 1 @node2]"):
        assert prefix in out
    assert MARK not in out  # the wrapper's marker lines are stripped
    # The job really ran: both workers saw every push of both (SGD lr=1: 100 - 5 * (1 + 2)).
    for rank in (0, 1):
        assert json.loads((dst / f"out{rank}.json").read_text())["final"] == [85.0] * 4
    # The record.
    launch = run / "launch"
    plan = json.loads((launch / "plan.json").read_text())
    assert {p["name"]: p["host"] for p in plan["processes"]}["worker 1 @node2"] == "node2"
    assert (launch / "hosts").read_text() == "node1\nnode2\n"
    tree = json.loads((launch / "tree.json").read_text())["files"]
    assert "dist_worker.py" in tree and "outputs/old" not in tree
    versions = json.loads((launch / "versions.json").read_text())
    assert {h: v["hostname"] for h, v in versions.items()} == {"node1": "node1", "node2": "node2"}
    assert "[worker 1 @node2]" in (launch / "job.log").read_text()
    # rsync: the tree is there, outputs/.git/caches are not.
    assert (dst / "dist_worker.py").read_bytes() == (work / "dist_worker.py").read_bytes()
    assert (dst / "gone.txt").is_file()
    assert not any((dst / d).exists() for d in (".git", "__pycache__", "outputs/old"))
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"
    first = time.monotonic() - t0

    # A second sync sends only what changed: untouched files keep their inode (rsync writes a
    # changed file anew and renames it into place), a file deleted here goes there too.
    inodes = {f: (dst / f).stat().st_ino for f in ("dist_worker.py", "data.txt")}
    (work / "data.txt").write_text("changed data\n")
    (work / "gone.txt").unlink()
    monkeypatch.setenv("TFKV_SSH_CONFIG", str(ssh_site.config))
    opts = launch_job.Options("ssh", 2, 2, str(work / "hosts"), str(dst), python=PY)
    job = launch_job.plan_job(opts, [PY, "dist_worker.py"], work, run)
    assert set(launch_job.backend(opts).preflight(job)) == {"node1", "node2"}
    assert (dst / "dist_worker.py").stat().st_ino == inodes["dist_worker.py"]
    assert (dst / "data.txt").stat().st_ino != inodes["data.txt"]
    assert (dst / "data.txt").read_text() == "changed data\n"
    assert not (dst / "gone.txt").exists()
    # The destination mirrors the working directory: what the job wrote there outside outputs/
    # (excluded, so kept) goes too.
    assert not (dst / "out0.json").exists()
    print(f"first launch {first:.1f} s")


@pytest.mark.slow
def test_a_killed_remote_worker_fails_the_job_and_nothing_is_left(netns_hosts, ssh_site, tmp_path):
    work = _workdir(tmp_path, netns_hosts.names)
    dst, env = tmp_path / "dst", {**_tag(tmp_path), **ssh_site.env()}
    exe = shutil.which("tfkv-launch")
    launcher = subprocess.Popen(
        ["timeout", "-k", "10", "150", exe, "-n", "2", "-s", "2", "-H", "hosts", "--launcher", "ssh",
         "--sync-dst-dir", str(dst), "--python", PY, "--heartbeat-timeout", "2", "--run-dir", str(tmp_path / "run"),
         "--", PY, "dist_worker.py", "hang", "out{rank}.json", "120"],
        cwd=work, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pid = _wait_for_pid(dst / "out1.json", launcher)
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2] == b"hang"
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # worker 1, on node2 (same PID numbers as here)
        out, _ = launcher.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 1, out[-5000:]
    assert "tfkv-launch: the job failed: worker 1 @node2 was killed by SIGKILL" in out, out[-5000:]
    assert took < 20, f"teardown took {took:.1f} s"
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"


@pytest.mark.slow
def test_a_killed_launcher_leaves_nothing_on_the_hosts(netns_hosts, ssh_site, tmp_path):
    """The launcher itself SIGKILLed: no teardown of its own runs, the wrappers see their channel
    close and end their groups."""
    work = _workdir(tmp_path, netns_hosts.names)
    dst, env = tmp_path / "dst", {**_tag(tmp_path), **ssh_site.env()}
    launcher = subprocess.Popen(
        [shutil.which("tfkv-launch"), "-n", "2", "-s", "1", "-H", "hosts", "--launcher", "ssh",
         "--sync-dst-dir", str(dst), "--python", PY, "--run-dir", str(tmp_path / "run"),
         "--", PY, "dist_worker.py", "hang", "out{rank}.json", "120"],
        cwd=work, env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_pid(dst / "out1.json", launcher)
        _wait_for_pid(dst / "out0.json", launcher)
    finally:
        launcher.kill()
        launcher.wait()
    assert not _no_leftovers(env[TAG], 15), "processes of the job left behind"


@pytest.mark.slow
def test_teardown_terminates_the_others_over_ssh_while_still_listening(netns_hosts, ssh_site, tmp_path):
    """Roles that would never end by themselves: the launcher's own HUP (its teardown's signal;
    TERM would be a preemption) reaches them while their channels are open (the line they print
    on HUP comes back), not only the wrappers' fallback."""
    work = _workdir(tmp_path, netns_hosts.names)
    env = {**_tag(tmp_path), **ssh_site.env()}
    role = ('trap "echo got HUP; exit 129" HUP; if [ "$TFKV_RANK_HINT" = 1 ]; then sleep 1; exit 7; fi; '
            "while :; do sleep 0.1; done")
    t0 = time.monotonic()
    proc = _launch("-n", "2", "-s", "1", "-H", "hosts", "--launcher", "ssh", "--sync-dst-dir", str(tmp_path / "dst"),
                   "--python", PY, "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", role, cwd=work, env=env,
                   timeout=60)
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    # -s 1: worker 0 on node2, worker 1 on node1
    assert proc.returncode == 1 and "the job failed: worker 1 @node1 exited with status 7" in out, out[-3000:]
    assert "[worker 0 @node2] got HUP" in out, out[-3000:]
    assert took < 30, f"took {took:.1f} s"
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"


@pytest.mark.slow
def test_ctrl_c_reaches_worker_0_over_ssh_once_and_the_teardown_waits_for_it(loopback_host, ssh_site, tmp_path):
    """Issue 40, point 14: a terminal's Ctrl-C to `tfkv-launch --launcher ssh` is passed on as
    SIGINT to worker 0's remote group only, once, over its connection; the teardown waits until
    worker 0 ended (it finishes what it is doing: here a line 2 s after the INT), then ends the
    rest; status 130, nothing left."""
    work = _workdir(tmp_path, ["local"])
    env = {**_tag(tmp_path), **ssh_site.env()}
    role = ('if [ "$TFKV_RANK_HINT" = 0 ]; then trap "echo got INT; sleep 2; echo finished; exit 130" INT; '
            'else trap "echo got INT" INT; fi; echo $$ > ready$TFKV_RANK_HINT; while :; do sleep 0.1; done')
    launcher = subprocess.Popen(
        [shutil.which("tfkv-launch"), "-n", "2", "-s", "1", "-H", "hosts", "--launcher", "ssh", "--python", PY,
         "--run-dir", str(tmp_path / "run"), "--", "sh", "-c", role],
        cwd=work, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ((work / "ready0").is_file() and (work / "ready1").is_file()):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
            time.sleep(0.1)
        time.sleep(1)  # the wrappers' group ids are back
        os.killpg(launcher.pid, signal.SIGINT)  # Ctrl-C at the terminal
        out, _ = launcher.communicate(timeout=90)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, out[-3000:]
    assert out.count("got INT") == 1 and "[worker 0 @local] got INT" in out, out[-3000:]
    assert "[worker 0 @local] finished" in out, out[-3000:]  # not torn down under it
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"


def _descendants(pid: int) -> list[int]:
    children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()]
    return children + [d for c in children for d in _descendants(c)]


@pytest.mark.slow
def test_a_ctrl_c_for_a_host_that_stopped_answering_is_given_up_within_its_deadlines(loopback_host, ssh_site):
    """Issue 40, point 14: the Ctrl-C passed on to worker 0 over ssh never holds the launcher's
    teardown: a host whose sshd stopped answering (frozen with SIGSTOP) is given up within the
    channel's and the command's deadlines, and not counted as reached (so nothing waits for it);
    a host that answers delivers it."""
    from tfkv.launcher.backends.ssh_connect import CHANNEL_TIMEOUT, connect, run
    from tfkv.launcher.backends.ssh_remote import INTERRUPT_TIMEOUT, interrupt_group
    from tfkv.launcher.hosts import Host

    conn = connect(Host(loopback_host.alias), str(ssh_site.config))
    groups = [subprocess.Popen(["sleep", "60"], start_new_session=True) for _ in range(2)]
    try:
        assert interrupt_group(conn, groups[0].pid)
        assert groups[0].wait(timeout=10) == -signal.SIGINT
        assert run(conn, "true", 20).exited == 0
        frozen = _descendants(int((ssh_site.dir / "sshd_loopback.pid").read_text()))  # this connection's sshd
        assert frozen
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert not interrupt_group(conn, groups[1].pid)
            took = time.monotonic() - t0
            assert groups[1].poll() is None
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        assert took < CHANNEL_TIMEOUT + INTERRUPT_TIMEOUT + 2, f"took {took:.1f} s"
    finally:
        for g in groups:
            g.kill()
            g.wait()
        conn.close()


def _wait_for_pid(path: Path, launcher: subprocess.Popen, seconds: float = 90) -> int:
    """The pid a `hang` worker wrote once it joined the job."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if launcher.poll() is not None:
            out = launcher.stdout.read() if launcher.stdout else ""
            raise AssertionError(f"the launcher ended early:\n{out[-3000:]}")
        try:
            return json.loads(path.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            time.sleep(0.2)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.slow
def test_preflight_one_line_per_bad_host_and_nothing_starts(loopback_host, ssh_site, tmp_path):
    work = _workdir(tmp_path, ["local", "badkey", "nosuchhost.invalid"])
    run, env = tmp_path / "run", {**_tag(tmp_path), **ssh_site.env()}
    proc = _launch("-n", "2", "-H", "hosts", "--launcher", "ssh", "--python", PY, "--run-dir", str(run), "--",
                   PY, "dist_worker.py", "updates", "out{rank}.json", "1", cwd=work, env=env, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("tfkv-launch: badkey: ssh refused the key")
    assert "add your key to badkey's authorized_keys or set IdentityFile in" in lines[0]
    assert lines[1].startswith("nosuchhost.invalid: unknown host")
    assert "[scheduler" not in proc.stdout and not (run / "launch" / "plan.json").exists()  # nothing started
    assert not tagged_pids(env[TAG], wait=15)


@pytest.mark.slow
def test_preflight_names_unwritable_dir_missing_tfkv_and_missing_python(loopback_host, ssh_site, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("TFKV_SSH_CONFIG", str(ssh_site.config))
    work = _workdir(tmp_path, ["local"])
    (tmp_path / "a-file").write_text("")
    no_site = tmp_path / "python-without-tfkv"  # -S: no site-packages, so no tfkv
    no_site.write_text(f"#!/bin/sh\nexec {PY} -S \"$@\"\n")
    no_site.chmod(0o755)

    def problem(dst: str | None, python: str = PY) -> str:
        opts = launch_job.Options("ssh", 1, 1, str(work / "hosts"), dst, python=python)
        job = launch_job.plan_job(opts, [PY, "dist_worker.py"], work, tmp_path / "run")
        with pytest.raises(ConfigError) as e:
            launch_job.backend(opts).preflight(job)
        assert len(str(e.value).splitlines()) == 1
        return str(e.value)

    bad = tmp_path / "a-file" / "job"
    assert problem(str(bad)).startswith(f"local: {bad} is not writable (")
    assert problem(str(bad)).endswith("; pick another --sync-dst-dir")
    assert problem(str(tmp_path / "dst"), str(no_site)) == (
        f"local: tfkv is not importable with {no_site} after the rsync; install it there (pip install tfkv) "
        "or include it in the synced directory")
    assert "local: /nonexistent/python3 is not found there" in problem(None, "/nonexistent/python3")
    monkeypatch.setenv("TFKV_SSH_CONFIG", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="TFKV_SSH_CONFIG=.* is not a file"):
        opts = launch_job.Options("ssh", 1, 1, str(work / "hosts"))
        launch_job.backend(opts).preflight(launch_job.plan_job(opts, [PY], work, tmp_path / "run"))


@pytest.mark.slow
def test_preflight_checks_host_keys_as_ssh_does(loopback_host, ssh_site, tmp_path, monkeypatch):
    """A host whose key is not in the config's known_hosts is refused in one line (Fabric alone
    would accept it); once its key is there, the same host passes."""
    known = tmp_path / "known_hosts"
    known.write_text("")
    config = tmp_path / "ssh_config"
    config.write_text(f"Host strict\n  HostName 127.0.0.1\n  Port {loopback_host.port}\n  User {ssh_site.user}\n"
                      f"  IdentityFile {ssh_site.client_key}\n  IdentitiesOnly yes\n  StrictHostKeyChecking yes\n"
                      f"  UserKnownHostsFile {known}\n  GlobalKnownHostsFile /dev/null\n  ConnectTimeout 5\n")
    monkeypatch.setenv("TFKV_SSH_CONFIG", str(config))
    work = _workdir(tmp_path, ["strict"])
    opts = launch_job.Options("ssh", 1, 1, str(work / "hosts"), python=PY)
    job = launch_job.plan_job(opts, [PY, "dist_worker.py"], work, tmp_path / "run")
    launcher = launch_job.backend(opts)  # its settings: TFKV_SSH_CONFIG's ssh config
    with pytest.raises(ConfigError) as e:
        launcher.preflight(job)
    assert str(e.value) == ("strict: its host key is not in known_hosts; run `ssh strict` once to check and accept "
                            f"it, or set StrictHostKeyChecking for it in {config}")
    host_key = (ssh_site.dir / "host_key.pub").read_text().split()
    known.write_text(f"[127.0.0.1]:{loopback_host.port} {host_key[0]} {host_key[1]}\n")
    launcher.preflight(job)  # raises on any problem


@pytest.mark.slow
def test_tfkv_run_cluster_ssh_end_to_end(netns_hosts, ssh_site, tmp_path):
    work = _workdir(tmp_path, netns_hosts.names)
    dst, env = tmp_path / "dst", {**_tag(tmp_path), **ssh_site.env()}
    # conf/cluster/ssh.yaml, once there, is the group for it; the schema field works either way.
    cluster = "cluster=ssh" if (REPO / "conf" / "cluster" / "ssh.yaml").is_file() else "cluster.launcher=ssh"
    proc = tfkv_run("kvstore=dist_sync", cluster, "cluster.hostfile=hosts", "cluster.num_workers=2",
                    "cluster.num_servers=2", f"cluster.sync_dst_dir={dst}", f"cluster.python={PY}", "epochs=1",
                    "progress=false", cwd=work, env=env, timeout=400, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "[worker 1 @node2]" in out
    (metrics,) = work.glob("outputs/*/*/metrics.json")  # copied back from worker 0's host
    assert json.loads(metrics.read_text())["epoch"] == 1
    assert (metrics.parent / "launch" / "plan.json").is_file()
    assert list(dst.glob("outputs/*/*/metrics.json"))  # where the workers wrote it
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"


def _alias_job(hosts: list[str], tmp_path: Path, env: dict[str, str], **kw: str) -> tuple[str, dict]:
    """A job on hosts named by ssh aliases only ssh can resolve: its output and its plan.json."""
    work = _workdir(tmp_path, hosts)
    run = tmp_path / "run"
    args = ["-n", "2", "-s", "1", "-H", "hosts", "--launcher", "ssh", "--python", PY, "--run-dir", str(run)]
    if kw.get("sync"):
        args += ["--sync-dst-dir", str(tmp_path / "dst")]
    proc = _launch(*args, "--", PY, "dist_worker.py", "updates", "out{rank}.json", "3", cwd=work, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    outputs = tmp_path / "dst" if kw.get("sync") else work
    for rank in (0, 1):  # SGD lr=1 from 100: 3 steps of pushes 1 and 2
        assert json.loads((outputs / f"out{rank}.json").read_text())["final"] == [91.0] * 4
    return out, json.loads((run / "launch" / "plan.json").read_text())


@pytest.mark.slow
def test_an_ssh_alias_for_127_0_0_1_is_never_bound(loopback_host, ssh_site, tmp_path):
    """`local` is a Host block of the ssh config (HostName 127.0.0.1, its own Port): no resolver
    knows the name, so the scheduler must bind, and every role reach it at, the address the host
    told us over ssh."""
    env = {**_tag(tmp_path), **ssh_site.env()}
    out, plan = _alias_job(["local"], tmp_path, env)
    assert "cannot listen" not in out
    assert {p["env"]["DMLC_PS_ROOT_URI"] for p in plan["processes"]} == {"127.0.0.1"}
    assert {p["host"] for p in plan["processes"]} == {"local"}  # named as the user named it
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"


@pytest.mark.slow
def test_ssh_aliases_of_network_namespace_hosts(netns_hosts, ssh_site, tmp_path):
    """`far1`/`far2` are ssh aliases of the two namespace hosts that neither host can resolve:
    the scheduler binds node1's real address and the roles on far2 connect to it."""
    env = {**_tag(tmp_path), **ssh_site.env()}
    out, plan = _alias_job(netns_hosts.aliases, tmp_path, env, sync=True)
    where = {p["name"]: p["host"] for p in plan["processes"]}
    assert where == {"scheduler @far1": "far1", "server 0 @far1": "far1", "worker 0 @far2": "far2",
                     "worker 1 @far1": "far1"}
    assert {p["env"]["DMLC_PS_ROOT_URI"] for p in plan["processes"]} == {netns_hosts.addresses["node1"]}
    assert "cannot listen" not in out  # and worker 0, on far2, pushed and pulled (checked in _alias_job)
    assert not _no_leftovers(env[TAG]), "processes of the job left behind"


ENV_WORKER = """\
import json, os, sys
import tfkv.store
kv = tfkv.store.create("dist_sync")  # a real role of the job: it registers, then reports
json.dump(dict(os.environ), open(sys.argv[1], "w"))
kv.close()
"""
# The launching shell's variables the test sets: forwarded ones reach every role, the plan's own
# (which role, where the scheduler is) never come from the launcher, on either backend.
FORWARDED = {"TFKV_TEST_VAR": "t", "DMLC_TEST_VAR": "d", "PS_TEST_VAR": "p", "MXNET_TEST_VAR": "m",
             "OMP_NUM_THREADS": "1", "KMP_AFFINITY": "granularity=fine", "LD_LIBRARY_PATH": "/nonexistent/lib",
             "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": "/nonexistent/py"}
NOT_FORWARDED = {"TFKV_ROLE": "server", "TFKV_RANK_HINT": "7", "TFKV_SCHEDULER_HOST": "nowhere.invalid",
                 "TFKV_NUM_WORKER": "9", "TFKV_CURVE_KEYFILE": "/nonexistent/key", "TFKV_CONFIG": "another job's"}


@pytest.mark.slow
def test_the_same_variables_reach_the_roles_under_local_and_ssh(loopback_host, ssh_site, tmp_path):
    seen = {}
    for launcher in ("local", "ssh"):
        work = tmp_path / launcher
        work.mkdir()
        (work / "env_worker.py").write_text(ENV_WORKER)
        (work / "hosts").write_text("local\n")
        env = {**_tag(tmp_path), **ssh_site.env(), **FORWARDED, **NOT_FORWARDED}
        args = ["-n", "2", "-s", "1", "--launcher", launcher, "--python", PY, "--run-dir", str(work / "run")]
        proc = _launch(*args, *(["-H", "hosts"] if launcher == "ssh" else []), "--", PY, "env_worker.py",
                       "env{rank}.json", cwd=work, env=env, timeout=120)
        assert proc.returncode == 0, (launcher, (proc.stdout + proc.stderr)[-3000:])
        seen[launcher] = [json.loads((work / f"env{rank}.json").read_text()) for rank in (0, 1)]
        assert not _no_leftovers(env[TAG]), "processes of the job left behind"
    for launcher, roles in seen.items():
        for rank, role_env in enumerate(roles):
            assert {k: role_env.get(k) for k in FORWARDED} == FORWARDED, launcher
            assert role_env["DMLC_ROLE"] == "worker" and role_env["TFKV_RANK_HINT"] == str(rank), launcher
            assert not {k for k in NOT_FORWARDED if k != "TFKV_RANK_HINT"} & set(role_env), launcher
            assert role_env["DMLC_NUM_WORKER"] == "2" and role_env["TFKV_RUN_DIR"].endswith("run"), launcher


@pytest.mark.slow
def test_a_remote_command_has_one_deadline_for_its_start_and_end_and_the_connection_a_dead_time(
        loopback_host, ssh_site):
    """Issue 40, point 12: every ssh step the launcher takes has a deadline. A command (the
    pre-flight's, the teardown's) that does not end in time is cut, its channel closed, and said
    in one line (Fabric's own timeout starts only once the command started); the connection
    carries the ssh config's ServerAlive settings down to the kernel (TCP_USER_TIMEOUT), which
    drops it when the host stops answering."""
    import socket

    from tfkv.launcher.backends.ssh_connect import connect, dead_after, run
    from tfkv.launcher.hosts import Host

    conn = connect(Host(loopback_host.alias), str(ssh_site.config))
    try:
        assert run(conn, "echo out; echo err >&2; exit 3", 20) == (3, "out\n", "err\n")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="no end within 1 s"):
            run(conn, "sleep 8", 1)
        assert time.monotonic() - t0 < 5
        assert run(conn, "true", 20).exited == 0  # the connection serves on
        _, dead = dead_after({})
        sock = conn.transport.sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == dead * 1000
    finally:
        conn.close()
