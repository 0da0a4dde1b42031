"""`--launcher mpi`: the whole job as one `mpirun` (Open MPI), as MXNet's launch.py does.

Every MPI rank runs the role helper (`python -m tfkv.launcher.role`), which maps its rank
(OMPI_COMM_WORLD_RANK) to the plan: rank 0 the scheduler, ranks 1..S the servers, the rest the
workers. The plan's placement is kept exactly: mpirun gets one application context
(`-np k --host H:k ... : ...`) per run of consecutive processes on the same host, in plan order, so
rank i lands on plan[i].host and rank 0, the scheduler, on the first host of the hosts file, whose
address every role already has in DMLC_PS_ROOT_URI. Without a hosts file every rank runs on this
machine (127.0.0.1), as a bare `mpirun` would. Each context gets the job's variables with `-x`
(mpirun passes a context's -x only to that context), including the launcher's TFKV_*/DMLC_*/...
variables. The helpers prefix their roles' output, so mpirun's stdout is already the merged log.

Teardown: mpirun runs in its own process group. It does not abort the job when a rank exits
non-zero (`--mca orte_abort_on_non_zero_status 0`): the other roles notice and report it, and the
launcher ends the job as the local one does (tfkv.launcher.supervisor), so that a role killed by
mpirun's abort before it could report is not taken for one that hung. mpirun kills every rank
when it gets SIGTERM, which the launcher sends then and on Ctrl-C; the group is killed after a
grace period. Open MPI puts every rank in its
own process group; the helper passes signals on to its role and dies with orted/mpirun.

The mpi backend does not copy the working tree: hosts must see the same paths (a shared file
system), as with MXNet's launcher. Site-specific flags: cluster.mpirun_args (TFKV_MPIRUN_ARGS).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Mapping

from tfkv.config.cluster import RemoteCluster, knob
from tfkv.errors import ConfigError
from tfkv.launcher import role
from tfkv.launcher.backends import batch
from tfkv.launcher.base import Backend, Job, Program, Result
from tfkv.launcher.hosts import Host
from tfkv.launcher.process import status_text
from tfkv.launcher.plan import Process, forwarded_env
from tfkv.launcher.record import local_versions
from tfkv.launcher.request import Command, Request

TEARDOWN = 10.0  # seconds mpirun gets to kill its ranks after SIGTERM
PREFLIGHT_TIMEOUT = 60  # seconds for one process on every host (ssh logins included)


def _rsh_args(hosts: list[Host]) -> list[str]:
    """ssh options for the hosts file's user@host:port: Open MPI takes one set for every host."""
    ports = {h.port for h in hosts}
    users = {h.user for h in hosts}
    if len(ports) > 1 or len(users) > 1:
        raise ConfigError("the mpi launcher needs the same ssh user and port on every host "
                          f"(hosts file has users {sorted(map(str, users))}, ports {sorted(map(str, ports))}); "
                          "put them in ~/.ssh/config and list bare host names")
    args = []
    (port,), (user,) = ports or {None}, users or {None}
    if port:
        args += ["-p", str(port)]
    if user:
        args += ["-l", user]
    return ["--mca", "plm_rsh_args", " ".join(args)] if args else []


def _contexts(plan: list[Process]) -> list[tuple[int, str, list[Process]]]:
    """Runs of consecutive processes on one host: (first rank, host, processes)."""
    runs: list[tuple[int, str, list[Process]]] = []
    for rank, p in enumerate(plan):
        if runs and runs[-1][1] == p.host:
            runs[-1][2].append(p)
        else:
            runs.append((rank, p.host, [p]))
    return runs


def mpirun_argv(job: Job, mpirun: str = "mpirun", environ: Mapping[str, str] | None = None,
                mpirun_args: str = "") -> list[str]:
    """The one mpirun command line that runs the whole plan (`mpirun_args`: cluster.mpirun_args)."""
    if job.sync_dst_dir:
        raise ConfigError("the mpi launcher does not copy the working tree (--sync-dst-dir is for --launcher ssh); "
                          "use a file system every host shares")
    argv = [mpirun]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")  # Open MPI refuses root otherwise
    # One slot per role is the plan's business, not the host's core count; the roles bind nothing.
    argv += ["--oversubscribe", "--bind-to", "none", "--mca", "orte_abort_on_non_zero_status", "0",
             "--wdir", str(job.workdir), *_rsh_args(job.hosts)]
    argv += shlex.split(mpirun_args)
    exports = {**forwarded_env(os.environ if environ is None else environ), **role.common_env(job.plan)}
    for i, (first, host, procs) in enumerate(_contexts(job.plan)):
        if i:
            argv.append(":")
        argv += ["-np", str(len(procs)), "--host", f"{host}:{len(procs)}"]
        for k, v in exports.items():
            argv += ["-x", f"{k}={v}"]
        argv += role.helper_argv(job.python, procs, first=first, rank_var="OMPI_COMM_WORLD_RANK")
    return argv


def _why(text: str) -> str:
    """The telling line of a failed mpirun: what a rank wrote to stderr, else mpirun's last words
    (not the dashes of its message boxes)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().strip("-")]
    ranks = [ln.split("<stderr>:", 1)[1].strip() for ln in lines if "<stderr>:" in ln]
    ranks = [ln for ln in ranks if ln]
    return (ranks or lines or ["no output"])[-1]



@dataclass
class MPICluster(RemoteCluster):
    """cluster=mpi's settings: those of launchers that reach other hosts, and mpirun's own flags."""

    mpirun_args: str = knob("cluster.mpirun_args")


class MPILauncher(Backend):
    """The job as one mpirun; the MPI rank decides the role."""

    name = "mpi"
    config = MPICluster
    places_roles = True
    # By name, as a user types it: Open MPI run by an absolute path acts as if given --prefix and
    # puts that prefix's bin first on the ranks' PATH, which changes which python3 they run.
    programs = (Program("mpirun", "install Open MPI (apt-get install openmpi-bin) or load your MPI module"),)

    def preflight(self, job: Job) -> dict[str, dict[str, str]]:
        """mpirun is here, the hosts file suits it, and every host runs tfkv: their versions."""
        mpirun = self.need()
        mpirun_argv(job, mpirun, mpirun_args=self.settings.mpirun_args)  # the hosts file and options are usable
        versions = {"localhost": local_versions()}
        hosts = list(dict.fromkeys(p.host for p in job.plan))
        # One rank per host prints its versions: also proves mpirun reaches every host.
        argv = [mpirun, *(["--allow-run-as-root"] if os.geteuid() == 0 else []), "--oversubscribe",
                "--tag-output", *_rsh_args(job.hosts), *shlex.split(self.settings.mpirun_args)]
        for i, host in enumerate(hosts):
            argv += ([":"] if i else []) + ["-np", "1", "--host", host, job.python, "-m", "tfkv.launcher.record"]
        # SIGTERM, not SIGKILL, on timeout: mpirun then ends the ssh sessions it started (each in a
        # process group of its own) instead of leaving them behind.
        # Without the launcher's own SSH_CONNECTION (its user's login): ranks mpirun starts on this
        # machine inherit its environment and would report the address that login came in on;
        # only a rank reached through an ssh session of its own may report one (record.ssh_address).
        env = {k: v for k, v in os.environ.items() if k != "SSH_CONNECTION"}
        proc = batch.start(argv, env=env, cwd=str(job.workdir))
        try:
            stdout_b, stderr_b = proc.communicate(timeout=PREFLIGHT_TIMEOUT)
        except subprocess.TimeoutExpired:
            batch.stop(proc, grace=TEARDOWN)
            raise ConfigError(f"mpirun could not start a process on {', '.join(hosts)} within {PREFLIGHT_TIMEOUT} s; "
                              "check that every host is reachable by ssh without a password") from None
        stdout, stderr = stdout_b.decode(errors="replace"), stderr_b.decode(errors="replace")
        found = {}
        # mpirun tags every chunk a rank writes, so the newline may come as a chunk of its own.
        for m in re.finditer(r"\[\d+,(\d+)\]<stdout>:(\{[^{}]*\})", stdout):
            found[hosts[int(m[1])]] = json.loads(m[2])
        if proc.returncode != 0 or len(found) != len(hosts):
            missing = [h for h in hosts if h not in found]
            raise ConfigError(f"mpirun could not run {job.python} -m tfkv.launcher.record on {', '.join(missing)} "
                              f"({status_text(proc.returncode)}: {_why(stdout + stderr)}); install "
                              "tfkv there or fix the hosts file")
        for host, v in found.items():  # a rank mpirun started over ssh knows the address it was reached at
            address = v.pop("address", None)
            if address:
                job.addresses[host] = address
        versions.update(found)
        return versions

    def request(self, job: Job, files: Path | None = None, name: str = "tfkv",
                environ: Mapping[str, str] | None = None) -> Request:
        """One mpirun, here, that runs the whole plan (`mpirun_argv`)."""
        argv = mpirun_argv(job, self.programs[0].name, environ, self.settings.mpirun_args)
        return Request([Command("mpirun", argv, {"PYTHONUNBUFFERED": "1"}, cwd=str(job.workdir))])

    def launch(self, job: Job, out: IO[str]) -> Result:
        self.need()
        mpirun = self.request(job).command("mpirun")
        output = batch.Output(out, [p.name for p in job.plan])
        proc = batch.start(mpirun.argv, env=mpirun.environ(os.environ), cwd=mpirun.cwd)
        output.pump(proc.stdout)  # the helpers' prefixed lines
        output.pump(proc.stderr, "[mpirun] ")  # mpirun's own messages
        # mpirun waits for every rank; the launcher ends the job once a failure's grace is over.
        failure = batch.supervise(proc, output, TEARDOWN, ends_itself=False)
        rc = proc.returncode
        failure = failure or output.cause() or (f"mpirun {status_text(rc)}" if rc else None)
        return Result(0 if failure is None else (rc if rc and rc > 0 else 1), failure)
