"""The launcher contract: what every backend registered in tfkv.launcher.base.REGISTRY must do,
run for real against each backend this machine can run, through `tfkv-launch` as a user runs it.

1. success: every role exits 0, the job's results are exact, the run record is written;
2. a failing role is named: `the job failed: worker 1 exited with status 5`, exit status 1;
3. Ctrl-C: exit status 130, `the job failed: interrupted (Ctrl-C)`, the job is gone (also from the
   resource manager's queue);
4. nothing is left behind: no process carrying the test's tag (TFKV_TEST_TAG, which every backend
   passes on to the roles) survives any of the above.

5. the backend is what it declares (tfkv.launcher.base.Traits): the shared core plans its job,
   hands it the job's keys and checks its options by the traits alone, and constructs it with its
   declared settings (test_a_backend_is_planned_as_its_traits_declare, every registered backend,
   without running anything).
6. what it runs is what it says: its request (tfkv.launcher.request: every command, with its
   environment, and every script, as `tfkv-launch --dry-run` prints it) for one fixed small job
   is its golden file, tests/launcher/golden/<backend>.txt, with this interpreter's path and
   root's mpirun flag normalised (test_a_backend_s_request_is_its_golden_file, every backend of
   tfkv's, without running anything). After a change to what a backend runs, regenerate them with
   `UPDATE_GOLDEN=1 pytest tests/launcher/test_contract.py -k golden` and review the diff.

A new backend gets the suite by adding one entry to BACKENDS (how to launch with it here, which
session fixtures it needs), or to NOT_RUNNABLE with the reason; test_every_backend_is_covered
fails until it has one. Backend-specific behaviour (mpirun rank placement, Slurm inside an
allocation, ssh sync and aliases, ...) stays in the backends' own test files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
from cluster_daemons import sge, slurm  # noqa: F401  (session fixtures, taken by name below)
from cluster_hosts import loopback_host, ssh_site  # noqa: F401  (session fixtures, taken by name below)
from conftest import REPO, SHARED_HOSTS, TAG, Launching, tagged_pids

from tfkv import keys
from tfkv.config.device_specs import LOCAL_RANK
from tfkv.errors import ConfigError
from tfkv.launcher import base, spares
from tfkv.launcher import job as launch_job
from tfkv.launcher.ports import release_port

WORKER = str(REPO / "tests" / "workers" / "dist_worker.py")
WORKERS, SERVERS, STEPS = 2, 1, 5
# A worker that joins the job and then, if its rank is argv[1], fails; the others keep working
# until the job tears them down. "working <tag>" shows that the test's tag reached the roles, so
# that the scan for leftovers is worth something.
FAILING_WORKER = """\
import os, sys, time
import numpy as np
import tfkv.store
kv = tfkv.store.create("dist_sync")
kv.init(0, np.zeros(3, np.float32))
if kv.rank == int(sys.argv[1]):
    print("failing on purpose", flush=True)
    sys.exit(5)
print("working", os.environ.get("TFKV_TEST_TAG"), flush=True)
deadline = time.time() + 120
while time.time() < deadline:
    kv.push(0, np.ones(3, np.float32))
    kv.pull(0)
    time.sleep(0.05)
"""


@dataclass
class Backend:
    name: str
    fixtures: tuple[str, ...] = ()  # session fixtures it needs: they put the test on the shared-hosts worker
    hosts: str | None = None  # a hosts file's text, when the backend runs with one
    env: Callable[[dict[str, Any]], dict[str, str]] = lambda fx: {}  # from the fixtures' values
    roles_report: bool = False  # the role helper's `tfkv-role: NAME exited with status N` lines
    gone: Callable[[dict[str, str]], None] = lambda env: None  # the resource manager forgot the job
    checks: Callable[[Path, str], None] = lambda cwd, out: None  # backend-specific, after a success
    slow: bool = True

    @property
    def suffix(self) -> str:
        """How the plan names roles: `worker 1 @127.0.0.1` where the backend places them on hosts."""
        return " @127.0.0.1" if self.hosts and base.traits(self.name).places_roles else ""


def _squeue_forgets(env: dict[str, str]) -> None:
    queue = subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True, timeout=30).stdout
    assert "tfkv-slurm" not in queue, queue


def _sge_forgets(env: dict[str, str], within: float = 60.0) -> None:
    """qstat no longer lists the job: qdel is accepted at once, but the qmaster drops a job it
    was still transferring ('t') to its execd only when the execd answers, seconds later under load."""
    deadline = time.monotonic() + within
    while True:
        listed = subprocess.run(["qstat"], env=env, capture_output=True, text=True, timeout=30).stdout
        if "tfkv-sge" not in listed or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "tfkv-sge" not in listed, listed


def _mpi_checks(cwd: Path, out: str) -> None:
    """Launched from an ssh login (SSH_CONNECTION set to an address this machine does not have):
    ranks mpirun starts here are not reached over ssh, so the scheduler stays on 127.0.0.1; the
    versions were checked through mpirun."""
    plan = json.loads((cwd / "rec" / "launch" / "plan.json").read_text())
    assert {p["env"]["DMLC_PS_ROOT_URI"] for p in plan["processes"]} == {"127.0.0.1"}, plan
    versions = json.loads((cwd / "rec" / "launch" / "versions.json").read_text())
    assert versions["127.0.0.1"]["tfkv"] == versions["localhost"]["tfkv"]


def _slurm_checks(cwd: Path, out: str) -> None:
    """Outside an allocation: one batch job running one srun of every task, its USR1 (Slurm's
    warning ahead of a preemption) the run directory's preemption flag."""
    script = (cwd / "rec" / "launch" / "slurm" / "job.sh").read_text()
    assert f"\nsrun -n {WORKERS + SERVERS + 1} --kill-on-bad-exit=1" in script
    assert f"trap 'echo SIGUSR1 > {cwd / 'rec' / '.preempt'}' USR1" in script
    assert f"-m tfkv.launcher.requeue {cwd / 'rec'}; then exec sleep 600; fi" in script


def _sge_checks(cwd: Path, out: str) -> None:
    """One array job of every role but the scheduler (run here), each task's log streamed back."""
    assert len(list((cwd / "rec" / "launch" / "sge").glob("task-*.log"))) == WORKERS + SERVERS


def _sge_env(fx: dict[str, Any]) -> dict[str, str]:
    return {k: fx["sge"].env[k] for k in ("SGE_ROOT", "SGE_CELL")}


BACKENDS = [
    Backend("local", slow=False),
    Backend("ssh", ("loopback_host", "ssh_site"), hosts="127.0.0.1\n", env=lambda fx: fx["ssh_site"].env()),
    Backend("mpi", hosts="127.0.0.1\n", env=lambda fx: {"SSH_CONNECTION": "192.0.2.1 50000 192.0.2.7 22"},
            roles_report=True, checks=_mpi_checks),
    Backend("slurm", ("slurm",), env=lambda fx: {"SLURM_CONF": str(fx["slurm"].conf)}, roles_report=True,
            gone=_squeue_forgets, checks=_slurm_checks),
    Backend("sge", ("sge",), env=_sge_env, roles_report=True, gone=_sge_forgets, checks=_sge_checks),
]
NOT_RUNNABLE = {
    # Hadoop YARN is not installable on this machine (no Debian package, no registry but pip's and
    # apt's): test_launcher_batch checks its exact submission commands against a stand-in client.
    "yarn": "Hadoop YARN cannot run on this machine",
}


def _params() -> list:
    marks = lambda b: ([pytest.mark.slow] if b.slow else []) + (  # noqa: E731
        [pytest.mark.xdist_group(SHARED_HOSTS)] if b.fixtures else [])
    return [pytest.param(b, id=b.name, marks=marks(b)) for b in BACKENDS]


@dataclass
class Job:
    backend: Backend
    cwd: Path
    env: dict[str, str]
    tag: str
    names: list[str] = field(default_factory=list)

    def args(self, *worker: str) -> list[str]:
        hosts = ["-H", "hosts"] if self.backend.hosts else []
        return ["-n", str(WORKERS), "-s", str(SERVERS), *hosts, "--launcher", self.backend.name, "--run-dir", "rec",
                "--python", sys.executable, "--", sys.executable, *worker]

    def run(self, *worker: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tfkv-launch", *self.args(*worker)], cwd=self.cwd, env=self.env, capture_output=True,
                              text=True, timeout=180)

    def nothing_left(self) -> None:
        assert not tagged_pids(self.tag, wait=15), "processes of the job left behind"
        self.backend.gone(self.env)


@pytest.fixture
def job(request, tmp_path) -> Job:
    backend: Backend = request.param
    fx = {name: request.getfixturevalue(name) for name in backend.fixtures}
    tag = f"contract-{backend.name}-{tmp_path.name}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not inside an allocation
    env = {**env, TAG: tag, **backend.env(fx)}
    if backend.hosts:
        (tmp_path / "hosts").write_text(backend.hosts)
    (tmp_path / "fail.py").write_text(FAILING_WORKER)
    names = ["scheduler", *[f"server {i}" for i in range(SERVERS)], *[f"worker {i}" for i in range(WORKERS)]]
    return Job(backend, tmp_path, env, tag, [n + backend.suffix for n in names])


def test_every_backend_is_covered():
    """Every registered backend runs the contract here, or says why it cannot."""
    covered = {b.name for b in BACKENDS} | set(NOT_RUNNABLE)
    assert set(base.REGISTRY.names()) - {"none"} <= covered, "add the new backend to BACKENDS (or NOT_RUNNABLE)"


def _planned(tmp_path: Path, name: str, hosts: str | None = "node1\nnode2\n", **options: Any) -> list:
    """The plan the shared core makes for launcher `name` (its port given back at once)."""
    hostfile = None
    if hosts is not None:
        hostfile = tmp_path / f"hosts-{len(list(tmp_path.glob('hosts-*')))}"
        hostfile.write_text(hosts)
    opts = launch_job.Options(name, 2, 1, str(hostfile) if hostfile else None, **options)
    plan = launch_job.plan_job(opts, ["train"], tmp_path, tmp_path / "run").plan
    release_port(int(plan[0].env["DMLC_PS_ROOT_PORT"]))
    return plan


@pytest.mark.parametrize("name", sorted(set(base.REGISTRY.names()) - {"none"}))
def test_a_backend_is_planned_as_its_traits_declare(name, tmp_path):
    """What the shared core does with a backend follows what its class declares, never its name."""
    traits, cls = base.traits(name), base.backend_class(name)
    plan = _planned(tmp_path, name)
    workers = [p for p in plan if p.role == "worker"]
    # places roles: the plan names each role's hosts-file host, and spare hosts are taken
    assert all(p.name.endswith(f" @{p.host}") == traits.places_roles for p in plan), [p.name for p in plan]
    if traits.places_roles:
        assert spares.check(name, str(tmp_path / "hosts-0"), ["node3"])[0].name == "node3"
    else:
        with pytest.raises(ConfigError, match="does not place roles on hosts"):
            spares.check(name, str(tmp_path / "hosts-0"), ["node3"])
    # places roles: server hosts (role=server, cluster.server_hosts) take the scheduler and the
    # servers, the other hosts the workers; a launcher that cannot place roles refuses them
    for hosts, named in (("node1\nnode2\nnode3 role=server\n", None), ("node1\nnode2\nnode3\n", ["node3"])):
        if traits.places_roles:
            split = _planned(tmp_path, name, hosts, server_hosts=named)
            assert [(p.role, p.host) for p in split] == [("scheduler", "node3"), ("server", "node3"),
                                                        ("worker", "node1"), ("worker", "node2")]
            assert {p.env["DMLC_PS_ROOT_URI"] for p in split} == {"node3"}
        else:
            with pytest.raises(ConfigError, match=f"server hosts \\(node3\\): the {name} launcher does not place"):
                _planned(tmp_path, name, hosts, server_hosts=named)
    # knows local ranks: the plan tells each worker its index on its host
    assert all((LOCAL_RANK in p.env) == traits.local_ranks for p in workers)
    # secrets by environment: the keys in every role's environment, else a key file only
    assert all((keys.SECRET in p.env, keys.KEYFILE in p.env) == (traits.secrets_by_env, not traits.secrets_by_env)
               for p in plan)
    # runs here: this interpreter, the scheduler on cluster.host
    assert (plan[0].argv[0] == sys.executable and plan[0].env["DMLC_PS_ROOT_URI"] == "127.0.0.1") == traits.runs_here
    # chooses nodes: a hosts file's slots (or workers_per_host) are refused
    if traits.chooses_nodes:
        with pytest.raises(ConfigError, match="the resource manager picks the nodes"):
            _planned(tmp_path, name, "node1 slots=2\n")
    else:
        assert [p.host for p in _planned(tmp_path, name, "node1 slots=2\n") if p.role == "worker"] == ["node1"] * 2
    # needs a hosts file: none is one line
    if traits.needs_hostfile:
        with pytest.raises(ConfigError, match="needs a hosts file"):
            _planned(tmp_path, name, hosts=None)
    else:
        assert len(_planned(tmp_path, name, hosts=None)) == 4
    # its settings: an instance of the schema it declares, the one the config's check reads for it
    assert isinstance(launch_job.backend(launch_job.Options(name, 2, 1)).settings, cls.config)
    from tfkv.check import cluster_schema

    assert cluster_schema(name) is cls.config


GOLDEN = Path(__file__).parent / "golden"


def golden_request(name: str, hostfile: Path, **options: Any) -> str:
    """Launcher `name`'s request for a fixed job (2 workers, 1 server, port 9000, a fixed working
    and run directory; ssh and mpi on the hosts of `hostfile`, ssh syncing the tree), from an
    empty launching environment, as its golden file holds it."""
    from tfkv import knobs

    places = base.traits(name).places_roles
    opts = launch_job.Options(name, 2, 1, str(hostfile) if places else None,
                              "/remote/job" if name == "ssh" else None, port=9000, dry_run=True, **options)
    job = launch_job.plan_job(opts, ["python3", "train.py", "--rank={rank}"], Path("/work/job"),
                              Path("/work/job/run"), values=knobs.resolve({}, {}))
    backend = launch_job.backend(opts, knobs.resolve({}, {}))
    text = backend.request(job, Path("/work/job/run/launch") / name, f"tfkv-{name}-golden", environ={}).text()
    return text.replace(sys.executable, "<python>").replace("--allow-run-as-root ", "")


@pytest.mark.parametrize("name", base.REGISTRY.own())
def test_a_backend_s_request_is_its_golden_file(name, tmp_path):
    """Every command (argv, environment, where it runs) and script a backend's launch would start
    for one fixed job, as `tfkv-launch --dry-run` prints them; a change shows as a diff to review."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\nnode2\n")
    text = golden_request(name, hostfile)
    # the job's keys never show: where a command's environment has them, as a stand-in
    assert all(ln.endswith("='<secret>'") for ln in text.splitlines() if "TFKV_CURVE_SECRET=" in ln)
    golden = GOLDEN / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{name}'s request changed; see the module's docstring (item 6)"


@pytest.mark.parametrize("name", [n for n in base.REGISTRY.own() if base.traits(n).places_roles])
def test_server_hosts_and_pinned_cpus_are_in_a_placing_backend_s_request(name, tmp_path):
    """With a server host (role=server) and pinned CPUs, the scheduler and the server run on the
    server host under `taskset -c 0`, the workers on the worker hosts under `taskset -c 1-3`: the
    golden file <backend>-server-hosts.txt."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1\nnode2\nnode3 role=server\n")
    text = golden_request(name, hostfile, server_cpus="0", worker_cpus="1-3")
    golden = GOLDEN / f"{name}-server-hosts.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{name}'s request changed; see the module's docstring (item 6)"


@pytest.mark.parametrize("job", _params(), indirect=True)
def test_success_every_role_exits_0_and_the_results_are_exact(job):
    proc = job.run(WORKER, "updates", "out{rank}.json", str(STEPS))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    # dist_worker.py `updates`: SGD lr=1 from 100, every worker r pushes r+1 each step.
    expected = 100.0 - STEPS * sum(r + 1 for r in range(WORKERS))
    for r in range(WORKERS):
        assert json.loads((job.cwd / f"out{r}.json").read_text())["final"] == [expected] * 4
    if job.backend.roles_report:
        for name in job.names:
            assert f"[{name}] tfkv-role: {name} exited with status 0" in proc.stdout, out[-5000:]
    launch = job.cwd / "rec" / "launch"  # the record
    assert [p["name"] for p in json.loads((launch / "plan.json").read_text())["processes"]] == job.names
    assert all(v["tfkv"] for v in json.loads((launch / "versions.json").read_text()).values())
    assert f"[{job.names[0]}] " in (launch / "job.log").read_text()  # the scheduler's output
    assert f"tfkv-launch -n {WORKERS} -s {SERVERS}" in (launch / "rerun.sh").read_text()
    job.backend.checks(job.cwd, out)
    job.nothing_left()


@pytest.mark.parametrize("job", _params(), indirect=True)
def test_a_failing_role_is_named(job):
    proc = job.run("fail.py", "1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-5000:]
    assert f"the job failed: worker 1{job.backend.suffix} exited with status 5" in proc.stderr, out[-5000:]
    assert f"[worker 1{job.backend.suffix}] failing on purpose" in proc.stdout
    job.nothing_left()


@pytest.mark.parametrize("job", _params(), indirect=True)
def test_ctrl_c_ends_the_job_with_130(job):
    """SIGINT to the launcher, as a terminal sends it to the foreground process."""
    launching = Launching(job.args("fail.py", "-1"), job.cwd, job.env)
    launching.wait_for(f"working {job.tag}")
    launching.proc.send_signal(signal.SIGINT)
    rc, out = launching.end()
    assert rc == 130 and "the job failed: interrupted (Ctrl-C)" in out, out[-5000:]
    job.nothing_left()
