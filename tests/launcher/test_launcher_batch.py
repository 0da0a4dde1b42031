"""What is particular to each batch launcher backend: mpi (real mpirun), slurm (real
slurmctld/slurmd/munged), sge and yarn (the exact submission: Hadoop YARN is not installable on
this machine, see the YARN tests). What every backend must do (success, a failing role named,
Ctrl-C, nothing left behind) is tests/launcher/test_contract.py.

Every job carries a tag in its environment (TFKV_TEST_TAG, passed on by mpirun -x, srun
--export=ALL and qsub -V like the launcher's other TFKV_* variables); after each job the test
scans /proc for it, so a process left behind fails the test.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_daemons import slurm  # noqa: F401  (session fixtures)
from cluster_hosts import netns_hosts, ssh_site  # noqa: F401  (session fixtures)
from conftest import REPO, TAG, Launching, role_pid, tagged_pids

from tfkv.errors import ConfigError
from tfkv.launcher import base, role
from tfkv.launcher.backends import batch
from tfkv.launcher.hosts import Host
from tfkv.launcher.plan import make_plan

WORKER = str(REPO / "tests" / "workers" / "dist_worker.py")


def _env(tag: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # not inside an allocation
    return {**env, TAG: tag, **extra}


def _tfkv_launch(*args: str, cwd: Path, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["tfkv-launch", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _nothing_left(tag: str, within: float = 5.0) -> None:
    """No process of the job is alive (dying roles get `within` seconds to be reaped)."""
    deadline = time.monotonic() + within
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged_pids(tag)
    details = []
    for pid in left:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]
        except OSError:
            continue
        details.append(f"{pid}: {cmdline.decode(errors='replace')}")
    assert not left, f"processes left behind: {details}"


def _updates_ok(d: Path, workers: int, steps: int) -> None:
    """dist_worker.py `updates`: SGD lr=1 from 100, every worker r pushes r+1 each step."""
    expected = 100.0 - steps * sum(r + 1 for r in range(workers))
    for r in range(workers):
        assert json.loads((d / f"out{r}.json").read_text())["final"] == [expected] * 4


def _plan(workers: int = 2, servers: int = 1, hosts=("127.0.0.1",), argv=("python3", "w.py", "out{rank}.json"),
          node=("python3", "-m", "tfkv.ps.node")):
    return make_plan(workers, servers, list(argv), list(node), list(hosts), hosts[0],
                     9100, {"TFKV_HEARTBEAT_TIMEOUT": "4"}, show_host=len(hosts) > 1)


# -- the role helper -------------------------------------------------------------------------------

def _helper(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfkv.launcher.role", *args], capture_output=True, text=True,
                          timeout=60, env={**{k: v for k, v in os.environ.items()
                                              if k not in ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "SGE_TASK_ID")},
                                           **env})


def test_the_helper_maps_each_schedulers_rank_to_the_plans_role():
    echo = ("sh", "-c", "echo $DMLC_ROLE $TFKV_RANK_HINT $DMLC_PS_ROOT_PORT out{rank}")
    argv = role.helper_argv(sys.executable, _plan(argv=echo, node=echo))[3:]
    for var, value, want in [("OMPI_COMM_WORLD_RANK", "0", "[scheduler] scheduler 0 9100 out{rank}"),
                             ("SLURM_PROCID", "3", "[worker 1] worker 1 9100 out1"),
                             ("SGE_TASK_ID", "2", "[server 0] server 0 9100 out{rank}")]:  # SGE counts from 1
        proc = _helper({var: value}, "--rank-var", var, *argv)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0] == want
    proc = _helper({"OMPI_COMM_WORLD_RANK": "4"}, *argv)
    assert proc.returncode == 2 and "rank 4 has no role: this job has 4 process(es)" in proc.stderr


def test_the_helper_reports_the_roles_end_and_passes_its_status_on():
    plan = _plan(workers=1, argv=("sh", "-c", "echo out; echo err >&2; exit 7"))
    proc = _helper({"SLURM_PROCID": "2"}, *role.helper_argv(sys.executable, plan)[3:])
    assert proc.returncode == 7
    assert proc.stdout.splitlines() == ["[worker 0] out", "[worker 0] err",
                                        "[worker 0] tfkv-role: worker 0 exited with status 7"]
    # Grid Engine would rerun a task that exits 99 and hold one that exits 100.
    plan = _plan(workers=1, argv=("sh", "-c", "exit 100"))
    proc = _helper({"SGE_TASK_ID": "2"}, "--rank-var", "SGE_TASK_ID", *role.helper_argv(sys.executable, plan[1:])[3:])
    assert proc.returncode == 1 and "exited with status 100" in proc.stdout


def test_the_helper_by_hand_takes_the_workers_command_after_dashes():
    env = {"DMLC_NUM_SERVER": "2", "DMLC_NUM_WORKER": "2", "DMLC_PS_ROOT_URI": "127.0.0.1",
           "DMLC_PS_ROOT_PORT": "9", "SLURM_PROCID": "4"}
    proc = _helper(env, "--", "sh", "-c", "echo $DMLC_ROLE $TFKV_RANK_HINT {rank}")
    assert proc.stdout.splitlines()[0] == "[worker 1] worker 1 1"


def test_output_names_the_first_real_failure():
    out = io.StringIO()
    o = batch.Output(out)
    for line in ["[worker 0] tfkv-role: worker 0 exited with status 3",  # stopped because a peer failed
                 "[worker 1 @h] tfkv-role: worker 1 @h exited with status 5",
                 "[server 0] tfkv-role: server 0 was killed by SIGTERM", "[worker 2] hello"]:
        o.line(line)
    assert o.cause() == "worker 1 @h exited with status 5"
    assert o.ends.codes == {"worker 0": 3, "worker 1 @h": 5, "server 0": -15}


# -- mpi -------------------------------------------------------------------------------------------

def test_mpirun_places_every_rank_on_its_planned_host_in_rank_order():
    from tfkv.launcher.backends.mpi import mpirun_argv

    plan = _plan(workers=3, servers=2, hosts=("h1", "h2"))  # scheduler h1; servers h1, h2; workers h1, h2, h1
    job = base.Job(plan=plan, hosts=[Host("h1"), Host("h2")], workdir=Path("/work"))
    argv = mpirun_argv(job, environ={"TFKV_TEST_TAG": "x", "HOME": "/root"})
    contexts: list[list[str]] = [[]]
    for a in argv:
        contexts.append([]) if a == ":" else contexts[-1].append(a)
    assert [c[c.index("--host") + 1] for c in contexts] == ["h1:2", "h2:1", "h1:1", "h2:1", "h1:1"]
    assert "--oversubscribe" in argv and "orte_abort_on_non_zero_status" in argv
    assert argv[argv.index("--wdir") + 1] == "/work"
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    first = contexts[0]
    for var in ("DMLC_PS_ROOT_URI=h1", "DMLC_NUM_SERVER=2", "DMLC_NUM_WORKER=3", "TFKV_TEST_TAG=x"):
        assert first[first.index(var) - 1] == "-x"
    assert "HOME=/root" not in first
    # Each context's helper gets the processes of its ranks, starting at its first rank.
    tables = [json.loads(c[c.index("--plan") + 1]) for c in contexts]
    assert [t["first"] for t in tables] == [0, 2, 3, 4, 5]
    assert [p["name"] for p in tables[0]["procs"]] == ["scheduler @h1", "server 0 @h1"]


def test_mpirun_takes_one_ssh_user_and_port_for_all_hosts():
    from tfkv.launcher.backends.mpi import mpirun_argv

    job = base.Job(plan=_plan(hosts=("a", "b")), hosts=[Host("a", "u", 2222), Host("b", "u", 2222)])
    argv = mpirun_argv(job, environ={})
    assert argv[argv.index("plm_rsh_args") + 1] == "-p 2222 -l u"
    job.hosts = [Host("a", port=22), Host("b", port=2222)]
    with pytest.raises(ConfigError, match="same ssh user and port on every host"):
        mpirun_argv(job, environ={})


@pytest.mark.parametrize("name,binary", [("mpi", "mpirun"), ("slurm", "srun"), ("sge", "qsub"), ("yarn", "yarn")])
def test_a_missing_resource_manager_is_a_one_line_config_error(name, binary, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    job = base.Job(plan=_plan(), hosts=[Host("127.0.0.1")], workdir=tmp_path)
    with pytest.raises(ConfigError) as e:
        base.create(name).preflight(job)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{binary} is not on PATH; install")


@pytest.mark.slow
def test_cluster_mpi_as_shipped_runs_on_this_machine(tmp_path):
    """conf/cluster/mpi.yaml has no hosts file: like a bare `mpirun`, the job runs here."""
    tag = f"mpi-shipped-{tmp_path.name}"
    proc = subprocess.run(["tfkv-run", "kvstore=dist_sync", "cluster=mpi", "epochs=1", "progress=false"],
                          cwd=tmp_path, env=_env(tag), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    (metrics,) = tmp_path.glob("outputs/*/*/metrics.json")
    assert json.loads(metrics.read_text())["epoch"] == 1
    plan = json.loads((metrics.parent / "launch" / "plan.json").read_text())
    assert plan["launcher"] == "mpi" and {p["host"] for p in plan["processes"]} == {"127.0.0.1"}
    assert "[worker 1] tfkv-role: worker 1 exited with status 0" in proc.stdout
    _nothing_left(tag)


@pytest.mark.slow
def test_a_stopped_worker_under_mpi_is_the_one_blamed(tmp_path):
    """SIGSTOP of a worker under mpi (no hosts file: every rank here): the failure line names the
    worker that stopped answering, not a role that exited because of it, as under local and ssh."""

    tag = f"mpi-stop-{tmp_path.name}"
    env = _env(tag, TFKV_HEARTBEAT_TIMEOUT="4")
    launching = Launching(["-n", "2", "-s", "2", "--launcher", "mpi", "--run-dir", "rec", "--python", sys.executable,
                           "--", sys.executable, str(REPO / "tests" / "workers" / "fault_worker.py"), "w{rank}.json", "120"],
                          tmp_path, env, timeout=120)
    deadline = time.time() + 90
    while not all((tmp_path / f"w{i}.json").exists() for i in range(2)):
        assert time.time() < deadline and launching.proc.poll() is None, launching.out
        time.sleep(0.1)
    time.sleep(0.5)
    os.kill(role_pid(tag, "worker", 1), signal.SIGSTOP)
    rc, out = launching.end(timeout=60)
    assert rc != 0, out
    assert "tfkv-launch: the job failed: worker 1 stopped answering" in out, out[-3000:]
    _nothing_left(tag)


# -- slurm -----------------------------------------------------------------------------------------

def _slurm_args(n: int = 2, s: int = 1) -> list[str]:
    return ["-n", str(n), "-s", str(s), "--launcher", "slurm", "--run-dir", "rec", "--python", sys.executable, "--",
            sys.executable, WORKER, "updates", "out{rank}.json", "5"]


@pytest.mark.slow
def test_slurm_job_inside_an_allocation_runs_one_srun(slurm, tmp_path):  # noqa: F811
    tag = f"slurm-alloc-{tmp_path.name}"
    t0 = time.monotonic()
    # salloc runs the launcher here with SLURM_JOB_ID set: the launcher's srun uses the allocation.
    proc = subprocess.run(["timeout", "170", "salloc", "-n", "4", "tfkv-launch", *_slurm_args()], cwd=tmp_path,
                          env=_env(tag, SLURM_CONF=str(slurm.conf)), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(f"slurm job in salloc: {time.monotonic() - t0:.1f} s")
    _updates_ok(tmp_path, 2, 5)
    assert "salloc: Granted job allocation" in proc.stderr
    assert not (tmp_path / "rec" / "launch" / "slurm").exists()  # no batch job of its own
    assert "[worker 1] tfkv-role: worker 1 exited with status 0" in proc.stdout
    _nothing_left(tag)



# -- yarn ------------------------------------------------------------------------------------------
# Hadoop YARN is not installable on this machine (no Debian package, no internet but the pip and
# apt registries), so these tests check the exact submission commands instead of running them.

def test_yarn_submits_servers_and_workers_as_distributed_shell_applications():
    from tfkv.launcher.backends.yarn import YarnCluster
    from tfkv.launcher.backends.yarn import submissions

    plan = make_plan(3, 2, ["python3", "train.py", "--kv-store", "dist_sync"], ["python3", "-m", "tfkv.ps.node"],
                     ["10.0.0.1"], "10.0.0.1", 9100, {"TFKV_HEARTBEAT_TIMEOUT": "4.0"},
                     local_ranks=False)  # as plan_job makes it: YARN picks the nodes
    job = base.Job(plan=plan, workdir=Path("/work"))
    jar = "/opt/hadoop/share/hadoop/yarn/hadoop-yarn-applications-distributedshell-3.3.6.jar"
    subs = submissions(job, jar, "tfkv-job", YarnCluster(yarn_queue="ml"), environ={"TFKV_TEST_TAG": "t", "HOME": "/r"})
    assert subs == [
        ("servers", ["yarn", "jar", jar, "-jar", jar, "-appname", "tfkv-job-servers", "-num_containers", "2",
                     "-container_memory", "1024", "-container_vcores", "1", "-timeout", "2147483647",
                     "-queue", "ml", "-shell_command", "python3 -m tfkv.ps.node",
                     "-shell_env", "CUDA_VISIBLE_DEVICES=-1", "-shell_env", "DMLC_NUM_SERVER=2", "-shell_env", "DMLC_NUM_WORKER=3",
                     "-shell_env", "DMLC_PS_ROOT_PORT=9100", "-shell_env", "DMLC_PS_ROOT_URI=10.0.0.1",
                     "-shell_env", "DMLC_ROLE=server", "-shell_env", "TFKV_HEARTBEAT_TIMEOUT=4.0",
                     "-shell_env", "TFKV_TEST_TAG=t"]),
        ("workers", ["yarn", "jar", jar, "-jar", jar, "-appname", "tfkv-job-workers", "-num_containers", "3",
                     "-container_memory", "2048", "-container_vcores", "1", "-timeout", "2147483647",
                     "-queue", "ml", "-shell_command", "python3 train.py --kv-store dist_sync",
                     "-shell_env", "DMLC_NUM_SERVER=2", "-shell_env", "DMLC_NUM_WORKER=3",
                     "-shell_env", "DMLC_PS_ROOT_PORT=9100", "-shell_env", "DMLC_PS_ROOT_URI=10.0.0.1",
                     "-shell_env", "DMLC_ROLE=worker", "-shell_env", "TFKV_HEARTBEAT_TIMEOUT=4.0",
                     "-shell_env", "TFKV_TEST_TAG=t"]),
    ]


def test_yarn_gives_workers_with_their_own_command_one_application_each():
    from tfkv.launcher.backends.yarn import submissions

    plan = make_plan(2, 1, ["python3", "train.py", "--log", "w{rank}.log"], ["python3", "-m", "tfkv.ps.node"],
                     ["h"], "h", 9100)
    subs = dict(submissions(base.Job(plan=plan), "ds.jar", "j", environ={}))
    assert list(subs) == ["server0", "worker0", "worker1"]
    w1 = subs["worker1"]
    assert w1[w1.index("-shell_command") + 1] == "python3 train.py --log w1.log"
    assert "TFKV_RANK_HINT=1" in w1 and "DMLC_ROLE=worker" in w1 and w1[w1.index("-num_containers") + 1] == "1"


def test_yarn_refuses_what_its_bash_c_would_mangle():
    from tfkv.launcher.backends.yarn import submissions

    plan = make_plan(1, 1, ["python3", "-c", 'print("$HOME")'], ["python3", "-m", "tfkv.ps.node"], ["h"], "h", 1)
    with pytest.raises(ConfigError, match="must not contain"):
        submissions(base.Job(plan=plan), "ds.jar", environ={})


def test_yarn_without_hadoop_is_a_one_line_config_error(monkeypatch, tmp_path):
    from tfkv.launcher.backends.yarn import find_jar

    with pytest.raises(ConfigError, match=r"no hadoop-yarn-applications-distributedshell-\*\.jar under \$HADOOP_HOME"):
        find_jar({"HADOOP_HOME": str(tmp_path)})


# A stand-in for Hadoop's `yarn` client, only to drive YarnLauncher.launch end to end: it runs each
# application's containers here, with nothing of the client's environment but PATH and HOME plus the
# -shell_env variables, as a NodeManager would, and logs the application id as the real client does.
FAKE_YARN = """\
#!/usr/bin/env python3
import os, subprocess, sys, random
args = sys.argv[1:]
if args[:2] == ["application", "-kill"]:
    open(os.environ["FAKE_YARN_KILLS"], "a").write(args[2] + "\\n"); sys.exit(0)
opt = lambda name: args[args.index(name) + 1]
env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
env.update(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-shell_env")
app = f"application_1700000000000_{random.randint(1, 9999):04d}"
print(f"INFO impl.YarnClientImpl: Submitted application {app}", flush=True)
command, n = opt("-shell_command"), int(opt("-num_containers"))
containers = [subprocess.Popen(["bash", "-c", command], env=env) for _ in range(n)]
sys.exit(0 if all(c.wait() == 0 for c in containers) else 2)
"""


@pytest.mark.slow
def test_yarn_launch_runs_the_job_through_the_yarn_client(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "yarn").write_text(FAKE_YARN)
    (bin_dir / "yarn").chmod(0o755)
    jar = tmp_path / "hadoop" / "share" / "hadoop" / "yarn" / "hadoop-yarn-applications-distributedshell-3.3.6.jar"
    jar.parent.mkdir(parents=True)
    jar.write_text("")
    tag = f"yarn-{tmp_path.name}"
    env = _env(tag, PATH=f"{bin_dir}:{os.environ['PATH']}", HADOOP_HOME=str(tmp_path / "hadoop"),
               FAKE_YARN_KILLS=str(tmp_path / "kills"))
    proc = _tfkv_launch("-n", "2", "-s", "2", "--launcher", "yarn", "--run-dir", "rec", "--python", sys.executable,
                        "--", sys.executable, WORKER, "updates", str(tmp_path / "out{rank}.json"), "5",
                        cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _updates_ok(tmp_path, 2, 5)
    assert "[yarn servers] INFO impl.YarnClientImpl: Submitted application application_" in proc.stdout
    assert not (tmp_path / "kills").exists()  # nothing to kill after a clean end
    _nothing_left(tag)


@pytest.mark.slow
def test_mpi_job_on_hosts_named_by_ssh_aliases(netns_hosts, ssh_site, tmp_path):  # noqa: F811
    """mpirun reaches far1/far2 (ssh aliases of the namespace hosts that no resolver knows) through
    the ssh config; the scheduler listens on the address far1 reported, not on `far1`."""
    (tmp_path / "hosts").write_text("".join(f"{h}\n" for h in netns_hosts.aliases))
    subnet = netns_hosts.addresses["node1"].rsplit(".", 1)[0] + ".0/24"
    tag = f"mpi-alias-{tmp_path.name}"
    mpirun_args = (f"--mca plm_rsh_agent 'ssh -F {ssh_site.config}' --mca oob_tcp_if_include {subnet} "
                   f"--mca btl_tcp_if_include {subnet}")
    proc = _tfkv_launch("-n", "2", "-s", "1", "-H", "hosts", "--launcher", "mpi", "--run-dir", "rec",
                        "--python", sys.executable, "--", sys.executable, WORKER, "updates", "out{rank}.json", "3",
                        cwd=tmp_path, env=_env(tag, TFKV_MPIRUN_ARGS=mpirun_args))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    _updates_ok(tmp_path, 2, 3)
    plan = json.loads((tmp_path / "rec" / "launch" / "plan.json").read_text())
    assert {p["env"]["DMLC_PS_ROOT_URI"] for p in plan["processes"]} == {netns_hosts.addresses["node1"]}
    _nothing_left(tag)


@pytest.mark.slow
def test_mpi_job_with_a_server_host_runs_each_role_on_its_host(netns_hosts, ssh_site, tmp_path):  # noqa: F811
    """far2 says role=server: mpirun starts the scheduler and the server there (the server listens
    on node2's address, which only its namespace has) and the worker on far1 (its hostname)."""
    (tmp_path / "hosts").write_text("far1\nfar2 role=server\n")
    subnet = netns_hosts.addresses["node1"].rsplit(".", 1)[0] + ".0/24"
    tag = f"mpi-server-host-{tmp_path.name}"
    mpirun_args = (f"--mca plm_rsh_agent 'ssh -F {ssh_site.config}' --mca oob_tcp_if_include {subnet} "
                   f"--mca btl_tcp_if_include {subnet}")
    where = ("import os, socket, sys; open('host{rank}.txt', 'w').write(socket.gethostname()); "
             f"os.execv(sys.executable, [sys.executable, {WORKER!r}, 'updates', 'out{{rank}}.json', '3'])")
    proc = _tfkv_launch("-n", "1", "-s", "1", "-H", "hosts", "--launcher", "mpi", "--run-dir", "rec", "--verbose", "1",
                        "--python", sys.executable, "--", sys.executable, "-c", where,
                        cwd=tmp_path, env=_env(tag, TFKV_MPIRUN_ARGS=mpirun_args))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    _updates_ok(tmp_path, 1, 3)
    node2 = netns_hosts.addresses["node2"]
    plan = json.loads((tmp_path / "rec" / "launch" / "plan.json").read_text())
    assert [(p["name"], p["env"]["DMLC_PS_ROOT_URI"]) for p in plan["processes"]] == [
        ("scheduler @far2", node2), ("server 0 @far2", node2), ("worker 0 @far1", node2)]
    assert any(ln.startswith("[server 0 @far2]") and f"listening on {node2}:" in ln for ln in out.splitlines()), out
    assert (tmp_path / "host0.txt").read_text() == "node1"
    _nothing_left(tag)
