"""One GPU per worker, many workers per host: `slots=` in the hosts file, cluster.workers_per_host,
each worker's local rank on every launcher, `devices=[gpu:{local_rank}]` bound through
CUDA_VISIBLE_DEVICES, and servers that see no GPU.

This machine has no GPU: binding is checked by what reaches each real process's environment (the
variable CUDA and TensorFlow read), and memory growth, the one step that needs a GPU TensorFlow
can see, with TensorFlow's GPU list mocked.
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_daemons import slurm  # noqa: F401  (session fixture)
from cluster_hosts import netns_hosts, ssh_site  # noqa: F401  (session fixtures)
from conftest import TAG, tagged_pids, tfkv_run

from tfkv import gpus
from tfkv.config.device_specs import LOCAL_RANK, LOCAL_SIZE
from tfkv.errors import ConfigError
from tfkv.launcher import job as launch_job
from tfkv.launcher import role
from tfkv.launcher.hosts import HostsError, parse_hosts, slots
from tfkv.launcher.backends.mpi import mpirun_argv
from tfkv.launcher.backends.sge import task_script
from tfkv.launcher.backends.yarn import submissions
from tfkv.parallel import binding

PY = sys.executable


def _job(tmp_path: Path, launcher: str, workers: int, servers: int = 1, hosts: str | None = None,
         argv: tuple[str, ...] = ("python3", "train.py"), **opts):
    if hosts is not None:
        (tmp_path / "hosts").write_text(hosts)
    o = launch_job.Options(launcher, workers, servers, str(tmp_path / "hosts") if hosts is not None else None,
                           secure=False, **opts)
    return launch_job.plan_job(o, list(argv), tmp_path, tmp_path / "run")


def _places(job) -> dict[str, tuple[str, str | None, str | None]]:
    """name -> (host, local rank, CUDA_VISIBLE_DEVICES) of every process."""
    return {p.name: (p.host, p.env.get(LOCAL_RANK), p.env.get("CUDA_VISIBLE_DEVICES")) for p in job.plan}


# -- fast: the plan --------------------------------------------------------------------------------

def test_slots_add_up_per_host_and_a_bad_one_is_named():
    hosts = parse_hosts("gpu1 slots=4\nal@gpu2:2222 slots = 2\nal@gpu2:2222\n# a comment\n")
    assert slots(hosts) == {"gpu1": 4, "gpu2": 3}  # a line without slots= is one more
    assert slots(parse_hosts("a\nb\na\n")) is None  # no slots=: the round robin as before
    with pytest.raises(HostsError, match=r"^hosts:2: slots=0 is not a number of workers; write slots=N"):
        parse_hosts("a\nb slots=0\n")


def test_workers_fill_the_slots_in_order_and_know_their_local_rank(tmp_path):
    job = _job(tmp_path, "ssh", 5, 2, "node1 slots=3\nnode2 slots=4\n")
    assert _places(job) == {
        "scheduler @node1": ("node1", None, "-1"), "server 0 @node1": ("node1", None, "-1"),
        "server 1 @node2": ("node2", None, "-1"),
        "worker 0 @node1": ("node1", "0", None), "worker 1 @node1": ("node1", "1", None),
        "worker 2 @node1": ("node1", "2", None), "worker 3 @node2": ("node2", "0", None),
        "worker 4 @node2": ("node2", "1", None)}
    assert [p.env[LOCAL_SIZE] for p in job.plan if p.role == "worker"] == ["3", "3", "3", "2", "2"]
    per_host = _job(tmp_path, "ssh", 4, 1, "node1\nnode2\nnode3\n", workers_per_host=2)
    assert [p.host for p in per_host.plan if p.role == "worker"] == ["node1", "node1", "node2", "node2"]


def test_the_local_launcher_numbers_every_worker_on_this_machine(tmp_path):
    job = _job(tmp_path, "local", 3, 1)
    assert [(p.env.get(LOCAL_RANK), p.env.get(LOCAL_SIZE)) for p in job.plan] == [
        (None, None), (None, None), ("0", "3"), ("1", "3"), ("2", "3")]


@pytest.mark.parametrize("launcher, hosts, opts, message", [
    ("ssh", "node1 slots=4\nnode2 slots=2\n", {},
     r"cluster.num_workers=7 is more than the 6 worker slot\(s\) of hosts file .*/hosts \(node1: 4, node2: 2\)"),
    ("mpi", "node1 slots=4\nnode2 slots=2\n", {"workers_per_host": 3},
     r"cluster.workers_per_host=3 is above the 2 slot\(s\) of host node2 in hosts file .*/hosts"),
    ("local", None, {"workers_per_host": 4},
     r"cluster.num_workers=7 is more than the 4 worker slot\(s\) of this machine \(127.0.0.1, no hosts file\)"),
    ("slurm", None, {"workers_per_host": 4}, r"with --launcher slurm the resource manager picks the nodes"),
    ("ssh", "node1\n", {"workers_per_host": 0}, r"cluster.workers_per_host=0 must be at least 1"),
])
def test_slots_below_the_workers_placed_are_one_line_before_anything_starts(tmp_path, launcher, hosts, opts,
                                                                            message):
    with pytest.raises(ConfigError, match=message) as e:
        _job(tmp_path, launcher, 7, hosts=hosts, **opts)
    assert "\n" not in str(e.value)


def test_mpirun_gives_each_rank_the_plans_local_rank(tmp_path):
    """Open MPI's own OMPI_COMM_WORLD_LOCAL_RANK counts the scheduler and servers on a host too:
    the workers' local rank comes with the plan each context's helper runs."""
    job = _job(tmp_path, "mpi", 4, 1, "node1 slots=2\nnode2 slots=2\n")
    argv = mpirun_argv(job, environ={})
    tables = [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--plan"]
    procs = [(p["name"], {**t["env"], **p["env"]}) for t in tables for p in t["procs"]]
    assert [(name, env.get(LOCAL_RANK), env.get("CUDA_VISIBLE_DEVICES")) for name, env in procs] == [
        ("scheduler @node1", None, "-1"), ("server 0 @node1", None, "-1"),
        ("worker 0 @node1", "0", None), ("worker 1 @node1", "1", None),
        ("worker 2 @node2", "0", None), ("worker 3 @node2", "1", None)]
    assert "--host" in argv and "node1:4" in argv and "node2:2" in argv


def test_the_role_helper_under_srun_finds_each_workers_local_rank(tmp_path):
    """Slurm picks the nodes, so the plan cannot say; the real helper works it out from srun's
    variables (2 nodes of 3 tasks: the scheduler, a server and 4 workers; block distribution)."""
    echo = ("sh", "-c", "echo $DMLC_ROLE ${TFKV_LOCAL_RANK:-none}/${TFKV_LOCAL_SIZE:-none} ${CUDA_VISIBLE_DEVICES:-all}")
    job = _job(tmp_path, "slurm", 4, 1, argv=echo)
    job.plan[0].argv = job.plan[1].argv = list(echo)  # the roles only say what they got
    helper = role.helper_argv(PY, job.plan, rank_var="SLURM_PROCID")
    seen = []
    for rank, local in [(1, 1), (2, 2), (3, 0), (5, 2)]:
        env = {**os.environ, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local),
               "SLURM_STEP_TASKS_PER_NODE": "3(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2"}  # what --gres gives a node
        out = subprocess.run(helper, capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        seen.append(out.stdout.splitlines()[0].split("] ", 1)[1])
    assert seen == ["server none/none -1", "worker 0/1 0,1,2", "worker 0/3 0,1,2", "worker 2/3 0,1,2"]


def test_sge_and_yarn_servers_see_no_gpu_and_workers_no_planned_local_rank(tmp_path):
    """Grid Engine and YARN pick the hosts: the plan gives no local rank (each task's GPUs are the
    resource manager's to give, through CUDA_VISIBLE_DEVICES), and the servers get none."""
    helper = shlex.split(task_script(_job(tmp_path, "sge", 2, 1)).splitlines()[-1])
    table = json.loads(helper[helper.index("--plan") + 1])
    assert [p["env"].get("CUDA_VISIBLE_DEVICES") for p in table["procs"]] == ["-1", None, None]
    assert LOCAL_RANK not in json.dumps(table)
    subs = dict(submissions(_job(tmp_path, "yarn", 2, 2), "ds.jar", "j", environ={}))
    assert "CUDA_VISIBLE_DEVICES=-1" in subs["servers"] and "CUDA_VISIBLE_DEVICES=-1" not in subs["workers"]
    assert not any(LOCAL_RANK in a for a in subs["workers"])


# -- fast: a worker binds itself -------------------------------------------------------------------

def test_a_worker_sees_only_its_own_gpu():
    env = {"TFKV_RANK_HINT": "5", LOCAL_RANK: "1"}
    assert binding.bind(["cpu:0", "gpu:{local_rank}"], env, gpus_here=4) == ["cpu:0", "gpu:0"]
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    env = {"TFKV_RANK_HINT": "5", LOCAL_RANK: "1"}
    assert binding.bind(["gpu:{rank}", "gpu:2"], env, gpus_here=8) == ["gpu:0", "gpu:1"]
    assert env["CUDA_VISIBLE_DEVICES"] == "5,2"
    # A resource manager's (or the user's) choice is kept: indices count within it, as CUDA's do.
    env = {LOCAL_RANK: "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert binding.bind(["gpu:{local_rank}"], env) == ["gpu:0"] and env["CUDA_VISIBLE_DEVICES"] == "5"
    # No placeholder: the devices as written, nothing bound.
    env = {LOCAL_RANK: "1"}
    assert binding.bind(["gpu:0", "gpu:1"], env) == ["gpu:0", "gpu:1"] and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize("env, gpus, message", [
    ({"TFKV_RANK_HINT": "6", LOCAL_RANK: "2"}, 2,
     r"^worker 6 \(local rank 2\) on \S+: devices \['gpu:\{local_rank\}'\] name gpu:2, but the driver shows 2 "
     r"GPU\(s\); run fewer workers"),
    ({LOCAL_RANK: "1", "CUDA_VISIBLE_DEVICES": "3"}, None, r"gpu:1, but CUDA_VISIBLE_DEVICES='3' shows 1 GPU\(s\)"),
    ({LOCAL_RANK: "0", "CUDA_VISIBLE_DEVICES": "-1"}, None, r"gpu:0, but CUDA_VISIBLE_DEVICES='-1' shows 0 GPU\(s\)"),
])
def test_local_rank_beyond_the_hosts_gpus_is_one_line(env, gpus, message):
    with pytest.raises(ConfigError, match=message) as e:
        binding.bind(["gpu:{local_rank}"], env, gpus_here=gpus)
    assert "\n" not in str(e.value)


def test_a_missing_gpu_names_the_worker_and_its_binding(monkeypatch):
    from tfkv.parallel import devices

    monkeypatch.setattr(binding, "bound", None)
    binding.bind(["gpu:{local_rank}"], {"TFKV_RANK_HINT": "3", LOCAL_RANK: "1"}, gpus_here=None)
    with pytest.raises(ConfigError, match=r"devices: gpu:0 does not exist on this machine \(found no GPU\) "
                                          r"\(worker 3 \(local rank 1\) on \S+: devices \['gpu:\{local_rank\}'\] "
                                          r"bound to CUDA_VISIBLE_DEVICES=1\)"):
        devices.setup(["gpu:0"])


def test_workers_grow_gpu_memory_unless_tensorflow_is_told_otherwise(monkeypatch):
    # Mocked: this machine has no GPU, so TensorFlow lists none; the two GPUs below stand in for them.
    import tensorflow as tf

    from tfkv.parallel import devices

    grown = []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: ["GPU0", "GPU1"])
    monkeypatch.setattr(tf.config.experimental, "set_memory_growth", lambda gpu, on: grown.append((gpu, on)))
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH", raising=False)
    devices.grow_gpu_memory()
    assert grown == [("GPU0", True), ("GPU1", True)]
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "false")
    devices.grow_gpu_memory()
    assert len(grown) == 2


@pytest.mark.parametrize("args, line", [
    (['devices=["gpu:{foo}"]'], "devices: 'gpu:{foo}' names {foo}; a device index may be a number, {rank} (the "
                                "worker's rank in the job) or {local_rank} (its index among the workers on its host)"),
    (['devices=["gpu:{local_rank}"]', "placement=auto"],
     "devices=['gpu:{local_rank}'] has a placeholder, which binds each data-parallel worker to its GPU; a model "
     "split over devices (placement) names them: write gpu:N, or placement=null"),
])
def test_a_placeholder_devices_cannot_take_is_one_line(tmp_path, args, line):
    proc = tfkv_run(*args, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "tfkv-run: " + line


def test_tfkv_run_binds_before_tensorflow_and_names_a_missing_gpu(tmp_path):
    """A process of its own (local rank 0) with no GPU visible: one line from the binding, before
    TensorFlow is imported."""
    proc = tfkv_run('devices=["gpu:{local_rank}"]', cwd=tmp_path, check=False, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "(local rank 0) on " + os.uname().nodename + ": devices ['gpu:{local_rank}'] name gpu:0, but "
        "CUDA_VISIBLE_DEVICES='' shows 0 GPU(s); run fewer workers on this host (cluster.workers_per_host, slots= in "
        "the hosts file) or name GPUs that exist")


def test_the_preflight_refuses_a_local_rank_beyond_the_hosts_gpus(tmp_path):
    """cluster=local, 2 workers of gpu:{local_rank} where one GPU is visible: one line naming the
    worker, before any role starts."""
    proc = tfkv_run("kvstore=dist_sync", "cluster=local", 'devices=["gpu:{local_rank}"]', cwd=tmp_path, check=False,
                    env={"CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 2 and "[scheduler]" not in proc.stdout
    assert proc.stderr.strip().splitlines()[-1] == (
        "tfkv-run: worker 1 (local rank 1): devices ['gpu:{local_rank}'] name gpu:1, but the pre-flight on 127.0.0.1 "
        "shows 1 GPU(s); run fewer workers on this host (cluster.workers_per_host, slots= in the hosts file) or name "
        "GPUs that exist")


def test_gpus_are_counted_as_cuda_would_see_them(tmp_path):
    driver = tmp_path / "gpus"  # stands in for /proc/driver/nvidia/gpus, which this machine lacks
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0"):
        (driver / bus).mkdir(parents=True)
    assert gpus.count({}, driver) == 3 and gpus.count({}, tmp_path / "none") is None
    assert [gpus.count({"CUDA_VISIBLE_DEVICES": v}, driver) for v in ("1,2", "", "-1", "0,-1,1")] == [2, 0, 0, 1]


# -- slow: real launchers --------------------------------------------------------------------------

# A real role of the job: once its store is up, every server has registered (the scheduler waits for
# all), so it reads their environments from /proc (the namespace hosts share it), binds itself as
# tfkv-run's workers do, and reports.
GPU_WORKER = """\
import json, os, socket, sys
from pathlib import Path
import tfkv.store
from tfkv.parallel import binding
kv = tfkv.store.create("dist_sync")
others = {}
for proc in Path("/proc").iterdir():
    try:
        env = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\\0") if "=" in v)
        node = (proc / "cmdline").read_bytes().split(b"\\0")[1:3] == [b"-m", b"tfkv.ps.node"]  # not a role helper
    except (OSError, ValueError):
        continue
    if node and env.get("TFKV_TEST_TAG") == os.environ["TFKV_TEST_TAG"]:
        others[env["DMLC_ROLE"] + " " + env["TFKV_RANK_HINT"]] = env.get("CUDA_VISIBLE_DEVICES")
devices = binding.bind(["cpu:0", "gpu:{local_rank}"], gpus_here=int(os.environ["TFKV_LOCAL_SIZE"]))
json.dump({"host": socket.gethostname(), "local": [os.environ["TFKV_LOCAL_RANK"], os.environ["TFKV_LOCAL_SIZE"]],
           "mpi": os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK"), "devices": devices, "visible": os.environ["CUDA_VISIBLE_DEVICES"], "others": others},
          open(sys.argv[1], "w"))
kv.close()
"""


def _run_job(work: Path, *args: str, workers: int, tag: str, env: dict[str, str] | None = None,
             results: Path | None = None, before: tuple[str, ...] = ()) -> list[dict]:
    """tfkv-launch of GPU_WORKER from `work` (after `before`: salloc ...); what each worker
    reported (in `results`, else `work`)."""
    work.mkdir(exist_ok=True)
    (work / "gpu_worker.py").write_text(GPU_WORKER)
    env = {**{k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES" and not k.startswith("SLURM_")},
           **(env or {}), TAG: tag}
    proc = subprocess.run([*before, "tfkv-launch", "-n", str(workers), "--python", PY, "--run-dir",
                           str(work.parent / "rec"), *args, "--", PY, "gpu_worker.py", "w{rank}.json"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not tagged_pids(tag, wait=15)
    return [json.loads(((results or work) / f"w{r}.json").read_text()) for r in range(workers)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "mpi"])
def test_three_workers_on_this_machine_each_bind_their_own_gpu(tmp_path, launcher):
    seen = _run_job(tmp_path / "work", "-s", "1", "--launcher", launcher, "--workers-per-host", "3", workers=3,
                    tag=f"gpu-{launcher}-{tmp_path.name}")
    assert [(w["local"], w["devices"], w["visible"]) for w in seen] == [
        (["0", "3"], ["cpu:0", "gpu:0"], "0"), (["1", "3"], ["cpu:0", "gpu:0"], "1"),
        (["2", "3"], ["cpu:0", "gpu:0"], "2")]
    assert seen[0]["others"] == {"scheduler 0": "-1", "server 0": "-1"}  # no GPU for the servers
    if launcher == "mpi":  # Open MPI's own local rank counts the scheduler and the server too
        assert [w["mpi"] for w in seen] == ["2", "3", "4"]


@pytest.mark.slow
def test_slots_over_ssh_two_hosts_two_workers_each(netns_hosts, ssh_site, tmp_path):  # noqa: F811
    work, dst = tmp_path / "work", tmp_path / "dst"
    work.mkdir()
    (work / "hosts").write_text("".join(f"{h} slots=2\n" for h in netns_hosts.names))
    seen = _run_job(work, "-s", "2", "-H", "hosts", "--launcher", "ssh", "--sync-dst-dir", str(dst), workers=4,
                    tag=f"gpu-ssh-{tmp_path.name}-{os.getpid()}", env=ssh_site.env(), results=dst)
    assert [(w["host"], w["local"], w["visible"]) for w in seen] == [
        ("node1", ["0", "2"], "0"), ("node1", ["1", "2"], "1"), ("node2", ["0", "2"], "0"), ("node2", ["1", "2"], "1")]
    assert seen[3]["others"] == {"scheduler 0": "-1", "server 0": "-1", "server 1": "-1"}


@pytest.mark.slow
def test_each_worker_of_a_tfkv_run_job_under_slurm_names_the_gpu_it_lacks(slurm, tmp_path):  # noqa: F811
    """Under srun the plan has no local ranks, so the pre-flight cannot check: each worker
    (python -m tfkv.worker) stops at its binding, before TensorFlow, with its own line."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_CONF": str(slurm.conf),
           "CUDA_VISIBLE_DEVICES": "", TAG: f"gpu-run-{tmp_path.name}"}
    proc = subprocess.run(["timeout", "170", "salloc", "-n", "4", "tfkv-run", "kvstore=dist_sync", "cluster=slurm",
                           'devices=["gpu:{local_rank}"]', "progress=false", f"cluster.python={PY}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    # The first worker to stop fails the step, and srun may kill the other before it prints: at
    # least one says it, each naming its own rank and GPU.
    lines = [f"[worker {rank}] tfkv-run: worker {rank} (local rank {rank}) on {os.uname().nodename}: devices "
             f"['gpu:{{local_rank}}'] name gpu:{rank}, but CUDA_VISIBLE_DEVICES='' shows 0 GPU(s)" for rank in (0, 1)]
    assert any(line in proc.stdout for line in lines), proc.stdout[-2000:]
    assert "the dist_sync job failed: worker" in proc.stderr, proc.stderr[-2000:]
    assert not tagged_pids(env[TAG], wait=15)

@pytest.mark.slow
def test_under_real_slurm_the_helper_gives_each_worker_its_local_rank(slurm, tmp_path):  # noqa: F811
    """One node, 4 tasks (scheduler, server, 2 workers): srun's SLURM_LOCALID counts all four, the
    workers' local ranks are 0 and 1."""
    seen = _run_job(tmp_path / "work", "-s", "1", "--launcher", "slurm", workers=2, tag=f"gpu-slurm-{tmp_path.name}",
                    env={"SLURM_CONF": str(slurm.conf)}, before=("timeout", "170", "salloc", "-n", "4"))
    assert [(w["local"], w["visible"]) for w in seen] == [(["0", "2"], "0"), (["1", "2"], "1")]
    assert seen[0]["others"] == {"scheduler 0": "-1", "server 0": "-1"}
