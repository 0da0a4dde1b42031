"""Shared set-up: quiet TensorFlow, and the host CPU split into logical devices before first use."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # TensorFlow fixes its devices at first use, so split the CPU before any test touches it.
    from tfkv.parallel import devices

    devices.setup(["cpu:0"])


# Tests that take the hosts' fixtures (the Slurm and Grid Engine cells, the loopback sshd and the
# network namespaces numbered by what is free when they start) share machine-wide daemons: under
# pytest-xdist (`--dist loadgroup`) they all run in one worker, one after another, never beside
# each other; every other test runs in either worker.
HOST_FIXTURES = {"ssh_site", "netns_hosts", "loopback_host", "slurm", "sge"}
SHARED_HOSTS = "shared_hosts"  # their xdist group; a test that takes them by name (getfixturevalue) is marked with it


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the marker into the node's group
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HOST_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group(SHARED_HOSTS))


@pytest.fixture(scope="session")
def tf_devices():
    """Eight logical CPU devices (what tfkv.parallel.devices.setup makes), as TensorFlow names."""
    from tfkv.parallel import devices

    return devices.setup([f"cpu:{i}" for i in range(8)])


def tfkv_run(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run the installed `tfkv-run` console script as a user would."""
    exe = shutil.which("tfkv-run")
    assert exe, "tfkv-run is not on PATH: install the package first (pip install '.[cpu,test]')"
    proc = subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"tfkv-run {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def python(script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


class Launching:
    """tfkv-launch (or `program`) running in the background, its output (stdout and stderr merged)
    read as it comes, for tests that signal it mid-job as a terminal or a batch system would."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 120,
                 program: str = "tfkv-launch"):
        import threading

        self.proc = subprocess.Popen([program, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()
        self.deadline = time.monotonic() + timeout

    @property
    def out(self) -> str:
        return "".join(list(self.lines))

    def wait_for(self, text: str) -> None:
        while not any(text in line for line in list(self.lines)):
            if self.proc.poll() is not None or time.monotonic() > self.deadline:
                self.kill()
                raise AssertionError(f"{text!r} never showed:\n{self.out}")
            time.sleep(0.05)

    def end(self, timeout: float = 90) -> tuple[int, str]:
        """Its exit status and whole output, once it ended (killed if it does not)."""
        try:
            self.proc.wait(timeout=timeout)
            self.reader.join(timeout=10)
        finally:
            self.kill()
        return self.proc.returncode, self.out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def need_root(what: str) -> None:
    """Skip a test that needs root (network namespaces, daemons under their own system users) when
    a developer runs the suite as another user; CI runs as root, where a missing root is a failure,
    never a silent skip."""
    if os.geteuid() == 0:
        return
    reason = f"{what} needs root here (network namespaces, daemons under their system users, root jobs)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}, and CI must run them: run .ci/run as root")
    pytest.skip(reason)


# -- parameter-server clusters made of real processes -------------------------------------------

TAG = "TFKV_TEST_TAG"


class Pids(list):
    """Live PIDs that, when an assertion shows them, say what each process is (its parent and
    command line, read when shown), so a leftover in a CI log names its owner."""

    def __repr__(self) -> str:
        def what(pid: int) -> str:
            try:
                ppid = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[1]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"{pid} (parent {ppid}): {cmd.strip()[:200]}"
            except OSError:
                return f"{pid} (gone)"
        return "[" + "; ".join(what(p) for p in self) + "]"


def tagged_pids(tag: str, wait: float = 0) -> list[int]:
    """PIDs of live processes whose environment carries this test's tag; with `wait`, polled for up
    to that many seconds until there are none (processes a launcher has just SIGKILLed are gone
    only once the kernel has run them, which takes a moment on a loaded machine: an orphan stays)."""
    deadline = time.monotonic() + wait
    found = _tagged(tag)
    while found and time.monotonic() < deadline:
        time.sleep(0.1)
        found = _tagged(tag)
    return found


def _tagged(tag: str) -> list[int]:
    found = Pids()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if f"{TAG}={tag}".encode() in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":  # zombies are already dead
                            found.append(int(entry))
        except OSError:
            continue
    return found


class Cluster:
    """Scheduler, servers and workers started by hand with DMLC_* variables, as the MXNet guide's
    manual launch does, with a fresh job keypair in every process's environment (CURVE), unless
    the test passes TFKV_SECURE="0". Output of each process goes to a file in the test's directory."""

    def __init__(self, tmp_path: Path, num_servers: int, num_workers: int, env: dict | None = None):
        from tfkv.launcher.ports import free_port
        from tfkv import keys as job_keys

        self.dir = tmp_path
        self.tag = f"{tmp_path.name}-{os.getpid()}"
        self.env = {**os.environ, TAG: self.tag, "PYTHONUNBUFFERED": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                    "DMLC_PS_ROOT_PORT": str(free_port()), "DMLC_NUM_SERVER": str(num_servers),
                    "DMLC_NUM_WORKER": str(num_workers), "TFKV_HEARTBEAT_TIMEOUT": "8", **(env or {})}
        self.keys = None
        if self.env.get(job_keys.SECURE) != "0":
            self.keys = job_keys.new_keys()
            self.env.update(job_keys.keys_env(self.keys))
        self.procs: dict[str, subprocess.Popen] = {}
        self.num_servers, self.num_workers = num_servers, num_workers

    def start(self, name: str, role: str, argv: list[str], **env: str) -> subprocess.Popen:
        log = open(self.dir / f"{name.replace(' ', '-')}.log", "wb")
        proc = subprocess.Popen(argv, env={**self.env, "DMLC_ROLE": role, **env}, stdout=log,
                                stderr=subprocess.STDOUT, cwd=self.dir, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_servers(self, argv: list[str] | None = None) -> None:
        argv = argv or [sys.executable, "-m", "tfkv.ps.node"]
        self.start("scheduler", "scheduler", argv)
        for i in range(self.num_servers):
            self.start(f"server {i}", "server", argv, TFKV_RANK_HINT=str(i))

    def start_workers(self, scenario: str, *args: str, **env: str) -> list[Path]:
        outs = []
        for i in range(self.num_workers):
            out = self.dir / f"worker{i}.json"
            self.start(f"worker {i}", "worker", [sys.executable, str(REPO / "tests" / "workers" / "dist_worker.py"),
                                                   scenario, str(out), *args], TFKV_RANK_HINT=str(i), **env)
            outs.append(out)
        return outs

    def wait(self, timeout: float = 120) -> dict[str, int]:
        """Every process's exit status once all ended (tfkv.launcher.supervisor sees them end)."""
        from tfkv.launcher import supervisor

        ends = supervisor.Ends(list(self.procs))
        over = supervisor.poll(self.procs, ends)
        deadline = time.monotonic() + timeout
        while not over():
            if time.monotonic() > deadline:
                late = ends.running()
                raise AssertionError(f"{' and '.join(late)} still running after {timeout} s:\n{self.output(late[0])}")
            time.sleep(0.05)
        return {name: ends.codes[name] for name in self.procs}

    def output(self, name: str) -> str:
        return (self.dir / f"{name.replace(' ', '-')}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {n}\n{self.output(n)[-3000:]}" for n in self.procs)

    def listening(self, name: str, timeout: float = 60) -> tuple[str, int]:
        """(host, port) a node's log says it listens on, once it does."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = re.search(r"listening on ([\d.]+):(\d+)", self.output(name))
            if m:
                return m.group(1), int(m.group(2))
            time.sleep(0.1)
        raise AssertionError(f"{name} never listened:\n{self.outputs()}")

    def kill_all(self) -> None:
        from tfkv.launcher import supervisor

        supervisor.stop_groups(list(self.procs.values()), grace=0)


@pytest.fixture
def cluster(tmp_path):
    """Make clusters; at the end assert that none of their processes is left on the machine."""
    made: list[Cluster] = []

    def make(num_servers: int = 1, num_workers: int = 2, **env: str) -> Cluster:
        c = Cluster(tmp_path, num_servers, num_workers, env)
        made.append(c)
        return c

    yield make
    leftovers = {c.tag: tagged_pids(c.tag) for c in made}
    for c in made:
        c.kill_all()
    assert not any(leftovers.values()), f"processes left behind: {leftovers}"


def expected(steps: int, nkeys: int, workers: int) -> list[list[float]]:
    """int_sgd's final values: 1000 minus every push, each counted once (lr=1)."""
    out = []
    for k in range(nkeys):
        v = 1000.0 - sum((r + 1) * (s % 5 + 1) + k % 3 for r in range(workers) for s in range(steps))
        out.append([v, v])
    return out


def role_pid(tag, role, rank):
    """The pid of the process of a tfkv-launch job running `role` `rank` (from its environment)."""
    for pid in tagged_pids(tag):
        try:
            env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
        except OSError:
            continue
        if env.get("DMLC_ROLE") == role and env.get("TFKV_RANK_HINT") == str(rank):
            return pid
    raise AssertionError(f"no {role} {rank} among {tagged_pids(tag)}")
