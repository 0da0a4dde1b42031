"""Trials side by side: on one machine with Hydra's joblib launcher (issue 14, point 3), and packed
onto a cluster's hosts with tfkv's own launcher, `hydra/launcher=tfkv` (point 4).

Point 3's mechanism: a job's scheduler port is leased on this machine until the job ends and is
never one the kernel hands out by itself (tfkv.launcher.ports), so two dist_sync trials started at
the same moment get different ports; their CURVE keys are their own already.
"""

import json
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from cluster_hosts import netns_hosts, ssh_site  # noqa: F401 - fixtures
from conftest import TAG, tagged_pids, tfkv_run

from tfkv.launcher.plan import free_port


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
    code = ("import json; from tfkv.launcher.plan import free_port; "
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
