"""Real resource managers on this machine for the batch launcher tests: Slurm (munged, slurmctld,
slurmd on 127.0.0.1) and a single-node Son of Grid Engine cell (sge_qmaster, sge_execd).

Both fixtures are session-scoped (Grid Engine takes
~10 s to come up), start the daemons themselves and stop them by PID at the end; a daemon that was
already running before the session (say, munged) is used and left alone. Every wait is bounded.
The packages come from .ci/run (openmpi-bin, slurmctld slurmd slurm-client munge, gridengine-*).
Import the fixtures into a test module: `from cluster_daemons import slurm, sge  # noqa: F401`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import need_root


def _need(binaries: list[str], packages: str) -> None:
    missing = [b for b in binaries if not shutil.which(b) and not Path(b).exists()]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: apt-get install {packages} (see .ci/run)")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _read_pid(path: Path, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pid = int(path.read_text().split()[0])
            if _alive(pid):
                return pid
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no live daemon wrote its pid to {path} within {timeout} s")


def stop_pids(pids: list[int], timeout: float = 20) -> None:
    """SIGTERM each daemon, wait for them to exit, SIGKILL what is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _wait(what: str, check, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-2000:] if log and log.exists() else ""
    raise AssertionError(f"{what} not ready within {timeout} s\n{tail}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


# -- Slurm ----------------------------------------------------------------------------------------

@dataclass
class Slurm:
    conf: Path  # a private slurm.conf: pass SLURM_CONF to every client
    dir: Path
    pids: list[int] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}


def _munged() -> int | None:
    """Start munged unless one already answers; its PID when we started it."""
    pidfile = Path("/run/munge/munged.pid")
    try:
        if _alive(int(pidfile.read_text().split()[0])):
            return None
    except (OSError, ValueError, IndexError):
        pass
    subprocess.run(["install", "-d", "-o", "munge", "-g", "munge", "-m", "0755", "/run/munge"], check=True, timeout=30)
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True, timeout=30)
    return _read_pid(pidfile)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """Slurm 22.05 with one node (this host, 127.0.0.1), private config, state and ports."""
    need_root("Slurm")
    _need(["/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "srun", "sbatch", "salloc"],
          "slurmctld slurmd slurm-client munge")
    d = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "log"):
        (d / sub).mkdir()
    host = socket.gethostname().split(".")[0]  # slurmctld only runs where SlurmctldHost names this host
    conf = d / "slurm.conf"
    conf.write_text(f"""\
ClusterName=tfkvtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=2
# 8 CPUs on a 2-core box: a job's scheduler, servers and workers mostly wait on each other.
SlurmdParameters=config_overrides
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    cluster = Slurm(conf, d)
    env = cluster.env
    started: list[int] = []
    munged = None
    try:
        munged = _munged()
        subprocess.run(["/usr/sbin/slurmctld"], env=env, check=True, timeout=30)
        started.append(_read_pid(d / "slurmctld.pid"))
        subprocess.run(["/usr/sbin/slurmd"], env=env, check=True, timeout=30)
        started.append(_read_pid(d / "slurmd.pid"))

        def idle() -> bool:
            try:
                return subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True,
                                      timeout=5).stdout.strip() == "idle"
            except subprocess.TimeoutExpired:
                return False

        _wait("the Slurm node", idle, 60, d / "log" / "slurmctld.log")
        cluster.pids = started
        yield cluster
    finally:
        stop_pids(started)
        if munged:
            stop_pids([munged])


# -- Son of Grid Engine ---------------------------------------------------------------------------

SGE_ROOT = Path("/var/lib/gridengine")
QMASTER_PID = Path("/var/spool/gridengine/qmaster/qmaster.pid")
EXECD_PID = Path("/var/run/gridengine/execd.pid")


@dataclass
class SGE:
    env: dict[str, str]  # SGE_ROOT, SGE_CELL for every client
    dir: Path
    host: str


def _qconf(env: dict[str, str], *args: str, editor_sed: str | None = None, tmp: Path | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """qconf; edits that open $EDITOR go through a sed script instead."""
    run_env = dict(env)
    if editor_sed is not None:
        assert tmp is not None
        script = tmp / "editor.sh"
        script.write_text(f"#!/bin/sh\nsed -i {editor_sed} \"$1\"\n")
        script.chmod(0o755)
        run_env["EDITOR"] = str(script)
    proc = subprocess.run(["qconf", *args], env=run_env, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"qconf {' '.join(args)}: {proc.stderr or proc.stdout}")
    return proc


@pytest.fixture(scope="session")
def sge(tmp_path_factory):
    """A single-node Grid Engine cell "default" on this host, set up idempotently: act_qmaster,
    host_aliases, root jobs (min_uid 0), a 1 s scheduler, no load thresholds, PE smp, 16 slots."""
    need_root("Grid Engine")
    _need(["/usr/sbin/sge_qmaster", "/usr/sbin/sge_execd", "qsub", "qconf", "qstat", "qdel"],
          "gridengine-master gridengine-exec gridengine-client (debconf: gridengine-common "
          "shared/gridenginemaster string $(hostname))")
    d = tmp_path_factory.mktemp("sge")
    host = socket.gethostname()
    env = {**os.environ, "SGE_ROOT": str(SGE_ROOT), "SGE_CELL": "default"}
    common = SGE_ROOT / "default" / "common"
    if not (common / "bootstrap").exists():
        pytest.fail(f"{common}/bootstrap missing: the gridengine-master postinst did not set up the cell; "
                    "reinstall with the debconf preseed of .ci/run")
    (common / "act_qmaster").write_text(host + "\n")  # empty without the debconf preseed
    # /etc/hosts maps this host to 127.0.0.1, whose reverse name is "localhost"; qmaster refuses
    # clients whose names differ unless they are aliases.
    (common / "host_aliases").write_text(f"{host} localhost\n")
    Path("/var/run/gridengine").mkdir(parents=True, exist_ok=True)
    shutil.chown("/var/run/gridengine", "sgeadmin", "sgeadmin")
    started: list[int] = []

    def running(pidfile: Path) -> bool:
        try:
            return _alive(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            return False

    try:
        if not running(QMASTER_PID):
            subprocess.run(["/usr/sbin/sge_qmaster"], env=env, check=True, timeout=60)
            started.append(_read_pid(QMASTER_PID))
        _wait("sge_qmaster", lambda: subprocess.run(["qstat"], env=env, capture_output=True,
                                                     timeout=10).returncode == 0, 60)
        _qconf(env, "-mconf", editor_sed="-e 's/^min_uid .*/min_uid 0/' -e 's/^min_gid .*/min_gid 0/'", tmp=d)
        _qconf(env, "-msconf", editor_sed="-e 's/^schedule_interval .*/schedule_interval 0:0:1/' "
                                          "-e 's/^flush_submit_sec .*/flush_submit_sec 1/' "
                                          "-e 's/^flush_finish_sec .*/flush_finish_sec 1/'", tmp=d)
        if host not in _qconf(env, "-ss", check=False).stdout.split():
            _qconf(env, "-as", host)
        exechost = d / "exechost.txt"
        exechost.write_text(f"hostname {host}\nload_scaling NONE\ncomplex_values NONE\nuser_lists NONE\n"
                            "xuser_lists NONE\nprojects NONE\nxprojects NONE\nusage_scaling NONE\n"
                            "report_variables NONE\n")
        known = _qconf(env, "-sel", check=False).stdout.split()
        _qconf(env, "-Me" if host in known else "-Ae", str(exechost))
        pe = d / "pe.txt"
        pe.write_text("pe_name smp\nslots 999\nuser_lists NONE\nxuser_lists NONE\nstart_proc_args NONE\n"
                      "stop_proc_args NONE\nallocation_rule $pe_slots\ncontrol_slaves TRUE\n"
                      "job_is_first_task FALSE\nurgency_slots min\naccounting_summary FALSE\nqsort_args NONE\n")
        _qconf(env, "-Mp" if "smp" in _qconf(env, "-spl", check=False).stdout.split() else "-Ap", str(pe))
        # load_thresholds NONE: a busy 2-core box otherwise puts the queue in alarm and jobs never
        # start; 16 slots: every role of a job is a task, and they mostly wait on each other.
        queue_sed = (f"-e 's/^hostlist .*/hostlist {host}/' -e 's/^slots .*/slots 16/' "
                     "-e 's/^pe_list .*/pe_list smp/' -e 's#^shell .*#shell /bin/bash#' "
                     "-e 's/^load_thresholds .*/load_thresholds NONE/'")
        if "all.q" in _qconf(env, "-sql", check=False).stdout.split():
            _qconf(env, "-mq", "all.q", editor_sed=queue_sed, tmp=d)
        else:
            _qconf(env, "-aq", "all.q", editor_sed=queue_sed, tmp=d)
        if not running(EXECD_PID):
            # An execd stopped just before (the previous test's) may still hold its port for a few
            # seconds: it then exits 100, "can't bind socket". Tried again until the port is free.
            for attempt in range(30):
                execd = subprocess.run(["/usr/sbin/sge_execd"], env={**env, "SGE_EXECD_PIDFILE": str(EXECD_PID)},
                                       capture_output=True, text=True, timeout=60)
                if execd.returncode == 0 or "can't bind socket" not in execd.stderr + execd.stdout or attempt == 29:
                    break
                time.sleep(3)
            if execd.returncode != 0:
                raise RuntimeError(f"sge_execd exited {execd.returncode}: {(execd.stderr or execd.stdout)[-1000:]}")
            started.append(_read_pid(EXECD_PID))

        def queue_up() -> bool:
            out = subprocess.run(["qstat", "-f"], env=env, capture_output=True, text=True, timeout=10).stdout
            # "all.q@vm  BIP  0/0/16  0.50  lx-amd64" with no state letters after the arch: usable.
            return any(line.startswith(f"all.q@{host}") and line.split()[-1].startswith("lx-")
                       for line in out.splitlines())

        _wait("the all.q queue", queue_up, 60)
        yield SGE(env, d, host)
    finally:
        # The qmaster shuts down in a controlled way that takes ~5-8 s.
        stop_pids(started, timeout=30)
