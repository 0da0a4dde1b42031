"""`--launcher ssh`: every role started over ssh, as MXNet's launch.py does, and always torn down.

A host is reached exactly as `ssh HOST` would reach it: the ssh config (~/.ssh/config) gives its
HostName, User, Port, IdentityFile, ProxyJump...; a hosts-file `user@host:port` wins over it.
Fabric (paramiko) runs the commands, real `rsync` over `ssh` copies the working directory. No
password is ever asked for: keys or an agent only, as with ssh's BatchMode; and host keys are
checked as ssh checks them (the config's known_hosts files and StrictHostKeyChecking), where
Fabric alone would accept any host.

    cluster.ssh_config (TFKV_SSH_CONFIG=path)   use this ssh config file instead of ~/.ssh/config (for Fabric, and
                           `ssh -F path` for rsync): a cluster's settings kept apart, or tests.

Pre-flight, for every distinct host, before anything starts: connect; with --sync-dst-dir, check
the directory is writable and `rsync -az --delete` the working directory to it (run outputs,
.git and caches stay home; a later run sends only what changed); then run
`<python> -m tfkv.launcher.record` there, which proves tfkv imports and reports the versions.
Each failing host is one line naming the host and the fix; nothing starts unless all pass.

Launch: one connection per host (another per 8 processes: sshd allows 10 sessions on one
connection by default). Each role runs under a small Python wrapper that makes it a process
group leader, prints the group id (a marker line the launcher strips) and reports how the role
ended (so a role killed by a signal is named as such). Output lines come back prefixed with the
process name, `[worker 1 @node2] ...`. Teardown, in layers, because a remote process without a
pty outlives its closed ssh channel:
1. a role fails: the others get the supervisor's GRACE to exit on their own (tfkv.launcher.supervisor
   waits, names the first failure, runs the teardown), then every remote group still there
   gets `kill -TERM -PGID`, then `kill -KILL -PGID`, over another channel of the same connection
   (also at a normal end, for whatever a role left behind in its group); Ctrl-C does it at once;
2. the launcher dies or its connection drops: the wrapper sees its stdin (the channel) close
   and kills its own group.
The first Ctrl-C is passed on first: SIGINT to worker 0's group over its own connection (within
a few seconds, or not at all for a host that does not answer), so that it finishes the checkpoint
it is writing; the teardown follows once it ended (tfkv.launcher.supervisor.finish_workers).
Every ssh step has a deadline (ssh_connect: connect, banner, login, channel open, a connection
that stops answering; a command's own timeout here and in ssh_remote), and the hosts are torn
down side by side: a host cut off from the network holds neither the others' teardown nor the
final line, which names it (its roles stop by themselves: they lose the scheduler).

Environment of a role: the plan's variables, PYTHONUNBUFFERED=1, and the launching shell's
variables that every backend forwards (tfkv.launcher.plan.forwarded_env: TFKV_*, DMLC_*, PS_*,
MXNET_*, the thread settings MXNet's ssh tracker passes on, ...; never those the plan decides),
exported in the remote command; the remote login shell gives the rest. The job's CURVE keys (TFKV_CURVE_PUBLIC/SECRET) are never in the command, which
`ps` on the host would show while the shell runs: they go as one JSON line on the channel's stdin
(TFKV_SECRETS_ON_STDIN=1 tells the wrapper to read it) into the role's environment only.
Processes on the launching machine reached through ssh (127.0.0.1) are remote processes like any other.

This module is the backend and its pre-flight; ssh_connect makes the connections (ssh config,
host keys, one-line reasons), ssh_sync runs rsync there and back, ssh_remote builds a role's
remote command and wrapper and holds its channel.
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Mapping, Optional

from tfkv.config.cluster import RemoteCluster, knob, setting
from tfkv.errors import ConfigError
from tfkv.launcher import signals, supervisor
from tfkv.launcher.base import Backend, Job, Result
from tfkv.launcher.hosts import Host
from tfkv.launcher.plan import Process
from tfkv.launcher.request import Command, Request
from tfkv.launcher.backends.ssh_connect import connect, connect_problem, run, ssh_config_path
from tfkv.launcher.backends.ssh_remote import RemoteRole, interrupt_group, remote_command, stop_groups
from tfkv.launcher.backends import ssh_sync
from tfkv.launcher.backends.ssh_sync import RSYNC, SSH, copy_back, remote_spec, run_rsync, sync_argv

if TYPE_CHECKING:
    from fabric import Connection

log = logging.getLogger("tfkv")

PER_CONNECTION = 8  # roles per connection: sshd's MaxSessions is 10, one is kept for the teardown
CHECK_TIMEOUT = 120  # seconds for a pre-flight command on a host (importing tfkv on a busy one)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def check_host(host: Host, job: Job, rsync_lock: threading.Lock,
               ssh_config: str | None = None) -> dict[str, Any] | str:
    """The pre-flight of one host: its versions, or one line saying what is wrong."""
    try:
        conn = connect(host, ssh_config)
    except Exception as e:  # noqa: BLE001 - every way of failing to connect becomes one line
        return connect_problem(host, e, ssh_config)
    try:
        cwd = job.sync_dst_dir or str(job.workdir)
        if job.sync_dst_dir:
            dst = shlex.quote(job.sync_dst_dir)
            r = run(conn, f"mkdir -p {dst} && test -w {dst}", CHECK_TIMEOUT)
            if r.exited != 0:
                why = _last_line(r.stderr) or "no write permission"
                return f"{host}: {job.sync_dst_dir} is not writable ({why}); pick another --sync-dst-dir"
            with rsync_lock:  # hosts may share a filesystem: two rsyncs into one directory collide
                log.info("rsync %s/ -> %s", job.workdir, remote_spec(host, job.sync_dst_dir))
                problem = run_rsync(sync_argv(job, host, ssh_config))
            if problem:
                return (f"{host}: rsync of {job.workdir} to {job.sync_dst_dir} failed ({problem}); check that "
                        f"`ssh {host}` works without a prompt and that rsync is installed there")
        python = shlex.quote(job.python)
        r = run(conn, f"cd {shlex.quote(cwd)} 2>/dev/null || exit 97; exec {python} -m tfkv.launcher.record",
                CHECK_TIMEOUT)
        where = "after the rsync" if job.sync_dst_dir else f"in {cwd}"
        if r.exited == 97:
            return (f"{host}: {cwd} does not exist there; pass --sync-dst-dir to copy the working directory, "
                    "or share it (NFS) at the same path")
        if r.exited == 127:
            return f"{host}: {job.python} is not found there; install Python 3 or pass --python (cluster.python)"
        if "No module named" in r.stderr and "tfkv" in r.stderr:
            return (f"{host}: tfkv is not importable with {job.python} {where}; install it there "
                    "(pip install tfkv) or include it in the synced directory")
        if r.exited != 0:
            return f"{host}: {job.python} -m tfkv.launcher.record failed ({_last_line(r.stderr)})"
        return json.loads(_last_line(r.stdout))
    except Exception as e:  # noqa: BLE001 - a connection that breaks half-way is one line too
        return f"{host}: ssh failed during the checks ({type(e).__name__}: {e}); check that `ssh {host}` works"
    finally:
        conn.close()



@dataclass
class SSHCluster(RemoteCluster):
    """cluster=ssh's settings: those of launchers that reach other hosts, the tree's copy and the ssh config."""

    sync_dst_dir: Optional[str] = setting(None, "rsync the current directory to this path on every host first")
    ssh_config: Optional[str] = knob("cluster.ssh_config")


class SSHLauncher(Backend):
    """Every role over ssh on the hosts of the hosts file (MXNet's `--launcher ssh`)."""

    name = "ssh"
    config = SSHCluster
    places_roles = True
    needs_hostfile = True
    secrets_by_env = True  # sent over the channel's stdin into the role's environment, never a command line
    programs = (SSH, RSYNC)

    def preflight(self, job: Job) -> dict[str, dict[str, Any]]:
        """Check (and sync) every host; their versions, or a ConfigError with a line per bad host."""
        hosts = list(dict.fromkeys(job.hosts))
        if not hosts:
            raise ConfigError("the ssh launcher needs hosts: -H hosts / cluster.hostfile=hosts")
        ssh_config = ssh_config_path(self.settings.ssh_config)  # a wrong one is one error, not one per host
        lock = threading.Lock()
        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            results = list(pool.map(lambda h: check_host(h, job, lock, ssh_config), hosts))
        problems = [r for r in results if isinstance(r, str)]
        if problems:
            raise ConfigError("\n".join(problems))
        for h, v in zip(hosts, results):
            address = v.pop("address", None)
            if address:
                job.addresses.setdefault(h.name, address)
        return {str(h): v for h, v in zip(hosts, results)}

    def request(self, job: Job, files: Path | None = None, name: str = "tfkv",
                environ: Mapping[str, str] | None = None) -> Request:
        """The pre-flight's rsync of the tree to every host (with --sync-dst-dir); each role's
        command, which its host's login shell runs (the job's keys go on the channel's stdin, never
        in it); worker 0's run directory copied back at the end (ssh_sync.commands)."""
        there, back = ssh_sync.commands(job, ssh_config_path(self.settings.ssh_config))
        cwd = job.sync_dst_dir or str(job.workdir)
        roles = [Command(p.name, ["sh", "-c", remote_command(p, cwd, job.python, environ)], host=p.host)
                 for p in job.plan]
        return Request(there + roles + back)

    def launch(self, job: Job, out: IO[str]) -> Result:
        import paramiko

        lock = threading.Lock()
        ssh_config = ssh_config_path(self.settings.ssh_config)
        commands = {c.name: c.argv[2] for c in self.request(job).commands if c.host}
        by_name = {h.name: h for h in reversed(job.hosts)}  # the first line of a name wins
        roles: list[RemoteRole] = []
        conns: list[Connection] = []
        first_conn: dict[str, Connection] = {}
        ends = supervisor.Ends([p.name for p in job.plan])
        unreached: dict[str, str] = {}  # host -> why the teardown could not reach it

        def start() -> str | None:
            # One connection per host and per PER_CONNECTION of its roles, opened side by side.
            groups: list[tuple[Host, list[Process]]] = []
            for name in dict.fromkeys(p.host for p in job.plan):
                mine = [p for p in job.plan if p.host == name]
                host = by_name.get(name, Host(name))
                groups += [(host, mine[i:i + PER_CONNECTION]) for i in range(0, len(mine), PER_CONNECTION)]
            with ThreadPoolExecutor(max_workers=min(16, len(groups))) as pool:
                opened = list(pool.map(lambda g: _try(connect, g[0], ssh_config), groups))
            conns.extend(c for c in opened if not isinstance(c, Exception))
            bad = [(g[0], c) for g, c in zip(groups, opened) if isinstance(c, Exception)]
            if bad:
                return connect_problem(*bad[0], ssh_config)
            where = {}
            for (host, procs), conn in zip(groups, opened):
                first_conn.setdefault(host.name, conn)
                where.update({id(p): (host, conn) for p in procs})
            for p in job.plan:  # in plan order: the scheduler first
                roles.append(RemoteRole(p, *where[id(p)]))
                try:
                    roles[-1].start(commands[p.name], out, lock)
                except (OSError, EOFError, paramiko.SSHException) as e:
                    return f"{p.name} could not start ({type(e).__name__}: {e})"
            return None

        def over() -> bool:
            for r in roles:
                if r.ended.is_set():
                    ends.ended(r.name, r.code)
            return all(r.ended.is_set() for r in roles)

        def interrupt() -> list[str]:
            # Ctrl-C to worker 0's group, the one that writes checkpoints (as the local launcher
            # does): it finishes the one in progress, then the teardown ends the rest.
            return [r.name for r in roles
                    if r.process.role == "worker" and r.process.rank == 0 and r.pgid is not None
                    and not r.ended.is_set() and interrupt_group(r.conn, r.pgid)]

        try:
            failure = supervisor.supervise(ends, over, lambda: unreached.update(self._teardown(roles, first_conn)),
                                           start=start, interrupt=interrupt)
            if failure and unreached:
                failure += "".join(f"; {host} did not answer over ssh ({why}): is it down or cut off from the "
                                   "network?" for host, why in unreached.items())
            if failure is None:
                with signals.shielded():
                    failure = copy_back(job, first_conn, ssh_config)
        finally:
            with signals.shielded():
                for c in conns:
                    c.close()  # any wrapper we could not reach sees EOF and kills its own group
                for r in roles:
                    if r.thread:
                        r.thread.join(timeout=5)
        return Result(supervisor.returncode(failure), failure)

    @staticmethod
    def _teardown(roles: list[RemoteRole], first_conn: dict[str, Connection]) -> dict[str, str]:
        """Kill every remote group of the job, host by host in parallel, each within the deadlines
        of its connection (a host cut off holds none of the others); the hosts it could not
        reach, with why."""
        jobs = []
        for name, conn in first_conn.items():
            mine = [r for r in roles if r.host.name == name and r.pgid is not None]
            running = [r.pgid for r in mine if not r.ended.is_set()]
            jobs.append((name, conn, running, [r.pgid for r in mine]))
        if not jobs:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
            problems = list(pool.map(lambda j: stop_groups(*j[1:]), jobs))
        return {j[0]: why for j, why in zip(jobs, problems) if why}


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - returned, reported by the caller
        return e
