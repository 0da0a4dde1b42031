"""The launcher's shared parts: hosts file, placement, the job record, tfkv-launch, local backend."""

import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO, TAG, Launching, tagged_pids

from tfkv.launcher.hosts import Host, HostsError, parse_hosts
from tfkv.launcher.plan import make_plan


def test_hosts_file_forms_and_comments():
    hosts = parse_hosts("# cluster\nnode1\nnode2:2222  # ssh port\nalice@10.0.0.3\nbob@node4:22\n\n[::1]:2200\n")
    assert hosts == [Host("node1"), Host("node2", port=2222), Host("10.0.0.3", user="alice"),
                     Host("node4", user="bob", port=22), Host("::1", port=2200)]
    assert parse_hosts("node1\nnode2\nnode1\n") == [Host("node1"), Host("node2"), Host("node1")]  # more there


@pytest.mark.parametrize("text,message", [
    ("node1\nnode 2\n", "hosts:2: 'node 2' is not a host"),
    ("node1:99999\n", "hosts:1: port 99999 is out of range"),
    ("# nothing\n", "no hosts in the file"),
    ("a@b@c\n", "hosts:1:"),
    ("localhost:2201\nnode1\nlocalhost:2202\n", r"hosts:3: localhost:2202 and localhost:2201 \(line 1\) are one host name"),
])
def test_bad_hosts_lines_are_named(text, message):
    with pytest.raises(HostsError, match=message):
        parse_hosts(text)


def test_placement_cycles_through_the_hosts_as_mxnet_does():
    plan = make_plan(3, 3, ["w"], ["n"], ["h1", "h2", "h3", "h4", "h5"], "h1", 9000)
    where = {p.name: p.host for p in plan}
    assert where["scheduler"] == "h1"
    assert [where[f"server {i}"] for i in range(3)] == ["h1", "h2", "h3"]
    assert [where[f"worker {i}"] for i in range(3)] == ["h4", "h5", "h1"]
    env = next(p for p in plan if p.name == "worker 2").env
    assert env["DMLC_ROLE"] == "worker" and env["DMLC_NUM_WORKER"] == "3" and env["DMLC_PS_ROOT_URI"] == "h1"


def test_workers_get_their_index_in_the_command():
    plan = make_plan(2, 1, ["run", "--log", "w{rank}.log"], ["n"], ["h"], "h", 1, show_host=True)
    workers = [p for p in plan if p.role == "worker"]
    assert [p.argv[-1] for p in workers] == ["w0.log", "w1.log"]
    assert workers[1].name == "worker 1 @h"


def _launch(*args, cwd, env=None, timeout=120):
    return subprocess.run(["tfkv-launch", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_tfkv_launch_help_explains_itself(tmp_path):
    out = _launch("-h", cwd=tmp_path).stdout
    for flag in ("-n", "-s", "-H", "--launcher", "--sync-dst-dir", "--interface"):
        assert flag in out
    assert "servers on hosts 1-3, workers on hosts 4, 5 and 1" in out
    # The description is whole sentences (it was cut after "workers running any").
    text = " ".join(out.split())
    assert "Starts a scheduler, servers and workers running any command, through one of the launcher " \
           "backends, and tears the whole job down when one fails." in text
    assert "130 after Ctrl-C and 143 after SIGTERM" in text and "OMP_NUM_THREADS" in text


def test_a_role_that_fails_while_earlier_ones_run_fails_the_job_at_once(tmp_path):
    """The worker (last in the plan) exits 5 while the scheduler (first) still waits for it to
    register: the job fails within the grace period naming the worker, not 120 s later when
    the scheduler gives up on the missing worker and is blamed instead."""
    proc = _launch("-n", "1", "--launcher", "local", "--run-dir", "rec", "--", "sh", "-c", "exit 5",
                   cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert "the job failed: worker 0 exited with status 5" in proc.stderr, proc.stdout + proc.stderr


def test_a_taken_port_is_a_clear_failure_not_a_hang(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = _launch("-n", "1", "--launcher", "local", "--port", str(port), "--run-dir", "rec", "--",
                       sys.executable, "-c", "import tfkv.store; tfkv.store.create('dist_sync').close()",
                       cwd=tmp_path, timeout=60)
    assert proc.returncode == 1
    assert f"scheduler cannot listen on 127.0.0.1:{port}" in proc.stdout
    # the final line says why, from the scheduler's own line (tfkv.launcher.record.said)
    assert f"the job failed: scheduler exited with status 2: scheduler cannot listen on 127.0.0.1:{port}" in proc.stderr


@pytest.mark.parametrize("first, said, status", [(["SIGINT", "SIGINT"], "interrupted (Ctrl-C)", 130),
                                                 (["SIGTERM", "SIGTERM"], "stopped by SIGTERM", 143)])
def test_more_signals_during_the_teardown_change_nothing(tmp_path, first, said, status):
    """A second Ctrl-C (the first reaches worker 0, which this one ignores, and the launcher waits
    for the workers to end) or a second SIGTERM (the first is a preemption, which this command
    ignores) stops the job at once and the launcher exits as a shell reports a process ended by
    that signal (130, 143), as a single run does; a Ctrl-C and a SIGTERM more while the roles are
    being stopped (SIGHUP, which the worker ignores, so the teardown waits before it kills)
    neither cut the teardown short nor print a traceback: one failure line, nothing left."""
    import os
    import signal
    import time

    env = {**os.environ, TAG: f"signals-{tmp_path.name}"}
    role = ('trap "echo got HUP" HUP; trap "echo got TERM" TERM; trap "echo got INT" INT; echo ready; '
            'while :; do sleep 0.1; done')
    launching = Launching(["-n", "1", "--launcher", "local", "--run-dir", "rec", "--", "sh", "-c", role],
                          tmp_path, env, timeout=60)
    launching.wait_for("[worker 0] ready")
    for sig in first:
        launching.proc.send_signal(getattr(signal, sig))
        if sig == "SIGINT" and "got INT" not in launching.out:
            launching.wait_for("[worker 0] got INT")  # passed on to worker 0; the launcher waits
        time.sleep(0.3)
    last = time.monotonic()
    if first[0] == "SIGTERM":  # the preemption's flag, for worker 0 (a tfkv-run worker) to see
        assert (tmp_path / "rec" / ".preempt").read_text().strip() == "SIGTERM"
    launching.wait_for("[worker 0] got HUP")  # the teardown is under way
    assert time.monotonic() - last < 10  # at once, not after the grace a first Ctrl-C or SIGTERM gives
    launching.proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    launching.proc.send_signal(signal.SIGTERM)
    rc, out = launching.end(timeout=30)
    assert rc == status and f"tfkv-launch: the job failed: {said}; record in rec" in out, out
    assert "Traceback" not in out and out.count("the job failed") == 1 and "got TERM" not in out, out
    assert out.count("got INT") == (1 if first[0] == "SIGINT" else 0), out  # only the first is passed on
    assert not tagged_pids(env[TAG], wait=15)


def test_a_first_sigterm_is_a_preemption_and_stops_the_job_after_the_grace():
    """stop_once(preempt=...): the first SIGTERM calls `preempt` and the job goes on; `grace`
    seconds later (a job that did not end by itself) it stops as after SIGTERM (143)."""
    import os
    import signal
    import time

    from tfkv.launcher import signals

    asked = []
    with pytest.raises(signals.Interrupted, match="did not checkpoint and end within 0 s"):
        with signals.stop_once(preempt=lambda: asked.append(time.monotonic()), grace=0.3) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5:
                time.sleep(0.01)
    assert len(asked) == 1 and stop.preempting and stop.status == 143
    assert 0.2 < time.monotonic() - asked[0] < 2
    assert signal.getsignal(signal.SIGTERM) is signal.default_int_handler or \
        signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None)  # put back


@pytest.mark.parametrize("value", ["127.0.0.1", "127.0.0.1:", ":9000", "127.0.0.1:http", "127.0.0.1:70000"])
def test_an_advertise_address_without_a_good_port_is_one_line(tmp_path, value):
    import os

    env = {**os.environ, "DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "TFKV_SECURE": "0", "TFKV_ADVERTISE_ADDRESS": value}
    proc = subprocess.run([sys.executable, "-m", "tfkv.ps.node"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"tfkv: TFKV_ADVERTISE_ADDRESS={value!r} must be host:port"), proc.stderr


# Runs argv under a seccomp filter that refuses prctl(PR_SET_PDEATHSIG) (and, with GET, also
# prctl(PR_GET_PDEATHSIG)) with EPERM (as some sandboxes and non-Linux kernels would), everything
# else allowed: x86_64 only.
NO_PDEATHSIG = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL("libc.so.6", use_errno=True)
prog = [(0x20, 0, 0, 4), (0x15, 0, 5, 0xC000003E),  # arch is x86_64, else allow
        (0x20, 0, 0, 0), (0x15, 0, 3, 157),           # syscall is prctl, else allow
        (0x20, 0, 0, 16), (0x15, 2, 0, 1), (0x15, 1, 0, GET),  # option PR_SET_PDEATHSIG or GET: EPERM
        (0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x00050000 | 1)]
code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Prog(len(prog), ctypes.addressof(code))
assert libc.prctl(38, 1, 0, 0, 0) == 0 and libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0  # NO_NEW_PRIVS, SECCOMP
os.execvp(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="the seccomp filter is x86_64 code")
@pytest.mark.parametrize("refused", ["set only", "set and get"])
def test_a_launcher_that_cannot_set_the_parent_death_signal_says_so_once(tmp_path, refused):
    """A sandbox may refuse setting the signal yet let it be read: the launcher asks by setting."""
    import os

    env = {**os.environ, TAG: f"pdeathsig-{tmp_path.name}"}
    get = "2" if refused == "set and get" else "1"  # PR_GET_PDEATHSIG, or PR_SET_PDEATHSIG again
    proc = subprocess.run([sys.executable, "-c", f"GET = {get}\n" + NO_PDEATHSIG, "tfkv-launch", "-n", "2", "-s", "1", "--launcher",
                           "local", "--run-dir", "rec", "--", sys.executable, str(REPO / "tests" / "workers" / "dist_worker.py"),
                           "updates", "out{rank}.json", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # the job runs, without the safety net
    said = [ln for ln in out.splitlines() if "PR_SET_PDEATHSIG" in ln]
    assert len(said) == 1 and "Operation not permitted" in said[0], out
    assert "the roles it started keep running" in said[0]
    assert not tagged_pids(env[TAG], wait=15)


def test_a_servers_advertised_address_reaches_no_role_from_the_launcher():
    """TFKV_ADVERTISE_ADDRESS is one server's host:port: forwarded, every server of the job would
    register that one address (and the local launcher's roles would inherit it too)."""
    from tfkv.launcher.plan import NOT_FORWARDED, forwarded_env

    environ = {"TFKV_ADVERTISE_ADDRESS": "10.0.0.5:9000", "TFKV_HEARTBEAT_TIMEOUT": "4"}
    assert forwarded_env(environ) == {"TFKV_HEARTBEAT_TIMEOUT": "4"}
    assert "TFKV_ADVERTISE_ADDRESS" in NOT_FORWARDED  # what the local launcher leaves out


def test_the_supervisor_blames_the_first_failure_that_is_not_a_peers_reaction():
    """worker 0 stops because a peer failed (EXIT_PEER_FAILED) before worker 1 fails by itself:
    worker 1 is named; the server still running is torn down (SIGHUP to its group) after GRACE."""
    import time

    from tfkv.errors import EXIT_PEER_FAILED
    from tfkv.launcher import supervisor

    def start(script: str) -> subprocess.Popen:
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    children = {"worker 0": start(f"exit {EXIT_PEER_FAILED}"), "worker 1": start("sleep 0.5; exit 5"),
                "server 0": start("exec sleep 60")}
    ends = supervisor.Ends(list(children))
    t0 = time.monotonic()
    failure = supervisor.supervise(ends, supervisor.poll(children, ends),
                                   lambda: supervisor.stop_groups(list(children.values())))
    assert failure == "worker 1 exited with status 5"
    assert children["server 0"].returncode == -supervisor.STOP
    assert time.monotonic() - t0 < supervisor.GRACE + 3


def test_the_supervisor_blames_a_worker_that_exited_0_while_the_others_stopped_as_its_peers():
    """Issue 40, point 13: worker 0 exits 0 (its script ended, its store closed) and every other
    role then stops as a peer's reaction (status 3): worker 0 left the job early and is named,
    as a failure a restart meets again. A role still running (hung) is blamed before it."""
    from tfkv.errors import EXIT_PEER_FAILED, EXIT_PEER_SILENT
    from tfkv.launcher import supervisor
    from tfkv.launcher.process import repeats

    def start(script: str) -> subprocess.Popen:
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    children = {"scheduler": start(f"sleep 0.4; exit {EXIT_PEER_FAILED}"), "worker 0": start("exit 0"),
                "worker 1": start(f"sleep 0.3; exit {EXIT_PEER_FAILED}")}
    ends = supervisor.Ends(list(children))
    failure = supervisor.supervise(ends, supervisor.poll(children, ends),
                                   lambda: supervisor.stop_groups(list(children.values())))
    assert failure == f"worker 0 {supervisor.LEFT_EARLY}" and repeats(failure)
    assert supervisor.first_cause([("worker 1", EXIT_PEER_FAILED)], ["server 0"], ["worker 0"]).startswith(
        "server 0 stopped answering")
    # every worker finished, and the scheduler: a server that missed its SHUTDOWN is no early leaving
    assert supervisor.first_cause([("server 0", EXIT_PEER_SILENT)], [], ["worker 0", "scheduler"]) == \
        "server 0 exited with status 4"


def test_a_hung_role_that_a_peer_saw_go_silent_is_blamed_once_it_alone_runs_and_torn_down_at_once():
    """Issue 28: a SIGSTOPped role took 13 s to bring its job down: every other role exited as a
    peer's reaction, so the launcher waited HANG_GRACE (for a role only slow to exit), then the
    teardown's SIGHUP waited 3 s on a process that acts on no signal while stopped. Now the role
    that saw the silence exits EXIT_PEER_SILENT, so once the others have stopped the one still
    running is the hung one and is blamed then, and the teardown resumes it (SIGCONT) so that the
    SIGHUP ends it at once."""
    import signal

    from tfkv.errors import EXIT_PEER_FAILED, EXIT_PEER_SILENT
    from tfkv.launcher import supervisor

    def start(script: str) -> subprocess.Popen:
        return subprocess.Popen(["sh", "-c", script], start_new_session=True)

    children = {"scheduler": start(f"sleep 0.2; exit {EXIT_PEER_SILENT}"),
                "worker 0": start(f"sleep 0.5; exit {EXIT_PEER_FAILED}"), "worker 1": start("exec sleep 60")}
    os.kill(children["worker 1"].pid, signal.SIGSTOP)
    ends = supervisor.Ends(list(children))
    failure = supervisor.supervise(ends, supervisor.poll(children, ends),
                                   lambda: supervisor.stop_groups(list(children.values())))
    assert failure.startswith("worker 1 stopped answering"), failure
    assert children["worker 1"].returncode == -supervisor.STOP  # the HUP, not the KILL 3 s later
    silent = [("scheduler", EXIT_PEER_SILENT)]
    assert supervisor.done_waiting(silent, 0.0, 0.1, running=1)  # the silent one alone: at once
    # others still exiting (a loaded machine): they get HANG_GRACE, not blamed for a hang
    assert not supervisor.done_waiting(silent, 0.0, supervisor.HANG_GRACE - 0.1, running=2)
    # a reaction to a role that reported its own failure still waits for it to exit
    assert not supervisor.done_waiting([("worker 0", EXIT_PEER_FAILED)], 0.0, supervisor.GRACE + 0.1, running=1)
