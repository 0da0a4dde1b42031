"""Trials side by side: on one machine with Hydra's joblib launcher (issue 14, point 3), and packed
onto a cluster's hosts with tfkv's own launcher, `hydra/launcher=tfkv` (point 4).

Point 3's mechanism: a job's scheduler port is leased on this machine until the job ends and is
never one the kernel hands out by itself (tfkv.launcher.ports), so two dist_sync trials started at
the same moment get different ports; their CURVE keys are their own already.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from cluster_hosts import netns_hosts, ssh_site  # noqa: F401 - fixtures
from conftest import TAG, Launching, tagged_pids, tfkv_run

from tfkv.launcher.ports import free_port


def _ephemeral() -> range:
    lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(lo, hi + 1)


def _no_leftovers(tag: str, seconds: float = 15) -> list[int]:
    """The tagged processes still alive after up to `seconds` (killed ones take a moment to go)."""
    deadline = time.monotonic() + seconds
    while (left := tagged_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _leased_elsewhere(port: int) -> bool:
    """Whether another tfkv process holds this port's lease (its abstract socket name is taken)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(f"\0tfkv-port-{port}")
        return False
    except OSError:
        return True
    finally:
        s.close()


# -- point 3, fast: the port mechanism ---------------------------------------------------------

def test_a_chosen_port_is_no_ephemeral_port_and_no_other_process_gets_it_until_released():
    mine = free_port()
    # A connect() anywhere on this machine (another job's ZeroMQ connection) takes its local port
    # from the ephemeral range: a port chosen there could be gone before the scheduler binds it.
    assert mine not in _ephemeral()
    # Another process choosing 300 ports at once while this one holds its own never gets it.
    code = ("import json; from tfkv.launcher.ports import free_port; "
            "print(json.dumps([free_port() for _ in range(300)]))")
    theirs = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, timeout=60).stdout)
    assert len(set(theirs)) == 300 and mine not in theirs
    assert not set(theirs) & set(_ephemeral())
    # The lease ends with the job (release_port) or the process.
    from tfkv.launcher.ports import release_port

    assert not _leased_elsewhere(theirs[0])  # that process has exited
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with pytest.raises(OSError):
            s.bind(f"\0tfkv-port-{mine}")
        release_port(mine)
        s.bind(f"\0tfkv-port-{mine}")
    finally:
        s.close()


# -- point 3, slow: two dist_sync trials at once with the real joblib launcher ---------------------

_STAMP = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[tfkv\.ps\]\[INFO\] - scheduler: (cluster complete|every worker finished)")


def _scheduler_span(run_dir: Path) -> tuple[float, float]:
    """When the trial's job had every node (cluster complete) and when its workers were done, from
    its scheduler's lines in the job's log."""
    seen = {what: datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for stamp, what in _STAMP.findall((run_dir / "launch" / "job.log").read_text())}
    return seen["cluster complete"], seen["every worker finished"]


@pytest.mark.slow
def test_two_dist_sync_trials_at_once_under_joblib_are_exact_and_apart(tmp_path):
    """hydra/launcher=joblib n_jobs=2 runs two dist_sync trials (each a scheduler, a server and a
    worker on this machine) at the same time: their schedulers get different ports, neither job
    hears from the other, and each ends with exactly the metrics of the same trial run alone."""
    sweep = ["-m", "kvstore=dist_sync", "cluster=local", "cluster.num_workers=1", "seed=0,1", "deterministic=true",
             "epochs=1", "steps_per_epoch=4", "progress=false"]
    together, alone = tmp_path / "together", tmp_path / "alone"
    tfkv_run(*sweep, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={together}",
             cwd=tmp_path, timeout=400)
    (first, first_end), (second, second_end) = (_scheduler_span(together / n) for n in ("0", "1"))
    assert max(first, second) < min(first_end, second_end), "the two trials' jobs never ran at the same time"
    ports = [{p["env"]["DMLC_PS_ROOT_PORT"] for p in json.loads((together / n / "launch" / "plan.json").read_text())
              ["processes"]} for n in ("0", "1")]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]
    for n in ("0", "1"):
        log = (together / n / "launch" / "job.log").read_text()
        assert "not a member" not in log and "not members" not in log and "refused" not in log, log[-3000:]
        assert re.search(r"cluster complete: server 0@\S+, worker 0@\S+$", log, re.M), log[-3000:]

    tfkv_run(*sweep, f"hydra.sweep.dir={alone}", cwd=tmp_path, timeout=400)  # Hydra's basic launcher: one by one
    keys = ("epoch", "train_loss", "train_accuracy", "test_loss", "test_accuracy")
    for n in ("0", "1"):
        ran = [json.loads((d / n / "metrics.json").read_text()) for d in (together, alone)]
        assert [{k: m[k] for k in keys} for m in ran][0] == {k: ran[1][k] for k in keys}
        assert json.loads((together / n / "trial.json").read_text())["status"] == "ok"
    assert json.loads((together / "0" / "metrics.json").read_text())["test_loss"] != \
        json.loads((together / "1" / "metrics.json").read_text())["test_loss"]  # two different trials


# -- point 4: hydra/launcher=tfkv on the network-namespace hosts over ssh --------------------------

PY = sys.executable  # the namespace hosts share this machine's Python, where tfkv is installed


def _cluster_sweep(work: Path, sweep_dir: Path, *overrides: str) -> list[str]:
    """tfkv-run's arguments for a sweep of dist_sync trials (a scheduler, a server and a worker each)
    packed by the tfkv launcher onto the hosts of work/hosts, over ssh."""
    return ["-m", "hydra/launcher=tfkv", "kvstore=dist_sync", "cluster=ssh", "cluster.hostfile=hosts",
            "cluster.num_workers=1", "cluster.num_servers=1", f"cluster.python={PY}", "progress=false",
            f"hydra.sweep.dir={sweep_dir}", *overrides]


def _trials(sweep_dir: Path, count: int) -> list[dict]:
    return [json.loads((sweep_dir / str(n) / "trial.json").read_text()) for n in range(count)]


def _at_once(trials: list[dict]) -> int:
    """The most trials that ran at the same moment (from their recorded start and end)."""
    events = sorted([(t["started"], 1) for t in trials] + [(t["ended"], -1) for t in trials])
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _hosts_work(tmp_path: Path, hosts: list[str]) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "hosts").write_text("".join(f"{h}\n" for h in hosts))
    return work


def test_more_hosts_per_trial_than_hosts_is_one_line_before_any_trial(tmp_path):
    work = _hosts_work(tmp_path, ["node1", "node2"])
    proc = tfkv_run(*_cluster_sweep(work, tmp_path / "sweep", "hydra.launcher.hosts_per_trial=3", "seed=0,1"),
                    cwd=work, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"tfkv-run: hydra.launcher.hosts_per_trial=3 but {work / 'hosts'} lists 2 host(s); set hosts_per_trial "
        "between 1 and 2, or add hosts"]
    assert not list((tmp_path / "sweep").glob("*/trial.json")) and not (tmp_path / "sweep" / "0").exists()


def test_server_hosts_in_a_packed_sweep_are_one_line_before_any_trial(tmp_path):
    work = _hosts_work(tmp_path, ["node1", "node2 role=server"])
    proc = tfkv_run(*_cluster_sweep(work, tmp_path / "sweep", "seed=0,1"), cwd=work, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"tfkv-run: hydra/launcher=tfkv packs the hosts of {work / 'hosts'} into trials, but node2 is a server host "
        "(role=server, cluster.server_hosts), which a trial's share does not keep; drop the server hosts from the sweep"]
    assert not (tmp_path / "sweep" / "0").exists()


def test_a_trial_that_is_no_distributed_job_on_hosts_is_one_line_before_any_trial(tmp_path):
    work = _hosts_work(tmp_path, ["node1"])
    proc = tfkv_run("-m", "hydra/launcher=tfkv", "hydra.launcher.hostfile=hosts", f"hydra.sweep.dir={tmp_path / 's'}",
                    "kvstore=dist_sync", "cluster=local,ssh", cwd=work, check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "tfkv-run: hydra/launcher=tfkv runs each trial as a distributed job on hosts of its own, but trial #0 "
        "(kvstore=dist_sync cluster=local) has kvstore=dist_sync cluster=local; use kvstore=dist_sync (or another "
        "dist_* type) with cluster=ssh or cluster=mpi"]
    assert not (tmp_path / "s" / "1").exists()


@pytest.mark.slow
def test_four_one_host_trials_on_two_hosts_run_in_two_waves(netns_hosts, ssh_site, tmp_path):
    work = _hosts_work(tmp_path, netns_hosts.names)
    sweep_dir, tag = tmp_path / "sweep", {TAG: f"sweep-{tmp_path.name}-{os.getpid()}"}
    proc = tfkv_run(*_cluster_sweep(work, sweep_dir, "seed=0,1,2,3", "epochs=1", "steps_per_epoch=2"),
                    cwd=work, env={**tag, **ssh_site.env()}, timeout=400, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    trials = _trials(sweep_dir, 4)
    assert [t["status"] for t in trials] == ["ok"] * 4, out[-5000:]
    assert all(len(t["hosts"]) == 1 and t["hosts"][0] in netns_hosts.names for t in trials)
    # The first two at once, one on each host; the third only once one of them had ended.
    assert trials[0]["hosts"] != trials[1]["hosts"]
    assert max(trials[0]["started"], trials[1]["started"]) < min(trials[0]["ended"], trials[1]["ended"])
    assert trials[2]["started"] >= min(trials[0]["ended"], trials[1]["ended"])
    assert _at_once(trials) == 2
    assert "[trial 3] " in proc.stdout and f"@{trials[3]['hosts'][0]}]" in proc.stdout  # its job's lines
    assert (sweep_dir / "sweep.csv").is_file()
    assert not _no_leftovers(tag[TAG]), "processes of the trials left behind"


def _wait_for_text(path: Path, text: str, sweep: Launching) -> None:
    while not (path.is_file() and text in path.read_text(errors="replace")):
        if sweep.proc.poll() is not None or time.monotonic() > sweep.deadline:
            sweep.kill()
            raise AssertionError(f"{text!r} never showed in {path}:\n{sweep.out[-5000:]}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_dead_host_fails_its_trial_and_is_never_used_again(netns_hosts, ssh_site, tmp_path):
    work = _hosts_work(tmp_path, netns_hosts.names)
    sweep_dir, tag = tmp_path / "sweep", {TAG: f"sweep-{tmp_path.name}-{os.getpid()}"}
    # Trial 1 (node2's, the second host) runs long enough to lose its host mid-job; the rest are short.
    sweep = Launching(_cluster_sweep(work, sweep_dir, "epochs=1,40,1,1", "steps_per_epoch=2"), cwd=work,
                      env={**os.environ, **tag, **ssh_site.env()}, timeout=400, program="tfkv-run")
    try:
        _wait_for_text(sweep_dir / "1" / "launch" / "job.log", "cluster complete", sweep)
        for pid in netns_hosts.cluster.hosts[1].pids():  # node2 dies: its sshd, sessions and roles
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended by itself between the listing and the kill
                pass
        code, out = sweep.end(timeout=300)
    finally:
        sweep.kill()
        netns_hosts.cluster.start_sshd(netns_hosts.cluster.hosts[1])  # for the tests after this one
        ssh_site.wait_for(netns_hosts.names[1])
    trials = _trials(sweep_dir, 4)
    assert code == 1 and "tfkv-run: 1 of 4 trials failed" in out, out[-5000:]
    assert [t["status"] for t in trials] == ["ok", "failed", "ok", "ok"], out[-5000:]
    assert trials[1]["hosts"] == ["node2"] and "host node2 does not answer ssh" in trials[1]["reason"]
    # After it, one host is left: the last two trials run there, one after the other.
    assert [t["hosts"] for t in trials[2:]] == [["node1"], ["node1"]]
    assert trials[3]["started"] >= trials[2]["ended"]
    assert "host node2 dropped from the sweep" in out
    assert not _no_leftovers(tag[TAG]), "processes of the trials left behind"


def test_when_no_host_answers_the_trials_left_are_recorded_failed(tmp_path):
    """The only host has no ssh server: the first trial fails on it, the probe drops it, and the
    second trial, with no host to run on, is recorded failed with that reason."""
    host = f"127.0.0.1:{free_port()}"  # free, and leased to this test: nothing listens there
    work = _hosts_work(tmp_path, [host])
    sweep_dir = tmp_path / "sweep"
    proc = tfkv_run(*_cluster_sweep(work, sweep_dir, "seed=0,1"), cwd=work, check=False, timeout=120)
    assert proc.returncode == 1 and "tfkv-run: 2 of 2 trials failed" in proc.stderr, proc.stderr[-3000:]
    first, second = _trials(sweep_dir, 2)
    assert first["status"] == second["status"] == "failed"
    assert f"{host}: no ssh server answers there" in first["reason"], first["reason"]
    assert second["reason"].startswith(f"no host of the sweep is left: {host} does not answer ssh: no ssh server"), \
        second["reason"]
    assert second["hosts"] == [] and not (sweep_dir / "1" / "tfkv.log").exists()  # it never started


@pytest.mark.slow
def test_ctrl_c_stops_the_running_trial_on_its_host_and_starts_no_other(netns_hosts, ssh_site, tmp_path):
    work = _hosts_work(tmp_path, netns_hosts.names[:1])
    sweep_dir, tag = tmp_path / "sweep", {TAG: f"sweep-{tmp_path.name}-{os.getpid()}"}
    sweep = Launching(_cluster_sweep(work, sweep_dir, "epochs=40,1", "steps_per_epoch=2"), cwd=work,
                      env={**os.environ, **tag, **ssh_site.env()}, timeout=300, program="tfkv-run")
    try:
        _wait_for_text(sweep_dir / "0" / "launch" / "job.log", "cluster complete", sweep)
        assert tagged_pids(tag[TAG]), "the trial's job is not running"
        t0 = time.monotonic()
        sweep.proc.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches tfkv-run's group: this process
        code, out = sweep.end(timeout=90)
        took = time.monotonic() - t0
    finally:
        sweep.kill()
    assert code == 130 and "tfkv-run: interrupted" in out, out[-5000:]
    assert took < 30, f"stopping took {took:.1f} s"
    (first,) = _trials(sweep_dir, 1)
    assert first["status"] == "failed" and first["hosts"] == ["node1"], first
    assert not (sweep_dir / "1").exists()  # the second trial never started
    assert not _no_leftovers(tag[TAG]), "processes of the trial left behind"
