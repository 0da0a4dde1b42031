"""`--launcher ssh`: every role started over ssh, as MXNet's launch.py does, and always torn down.

A host is reached exactly as `ssh HOST` would reach it: the ssh config (~/.ssh/config) gives its
HostName, User, Port, IdentityFile, ProxyJump...; a hosts-file `user@host:port` wins over it.
Fabric (paramiko) runs the commands, real `rsync` over `ssh` copies the working directory. No
password is ever asked for: keys or an agent only, as with ssh's BatchMode; and host keys are
checked as ssh checks them (the config's known_hosts files and StrictHostKeyChecking), where
Fabric alone would accept any host.

    TFKV_SSH_CONFIG=path   use this ssh config file instead of ~/.ssh/config (for Fabric, and
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
pty outlives its closed ssh channel (shared/clusters.md):
1. a role fails: the others get GRACE to exit on their own, then every remote group still there
   gets `kill -TERM -PGID`, then `kill -KILL -PGID`, over another channel of the same connection
   (also at a normal end, for whatever a role left behind in its group); Ctrl-C does it at once;
2. the launcher dies or its connection drops: the wrapper sees its stdin (the channel) close
   and kills its own group.

Environment of a role: the plan's variables, PYTHONUNBUFFERED=1, and the launching shell's
variables that every backend forwards (tfkv.launcher.plan.forwarded_env: TFKV_*, DMLC_*, PS_*,
MXNET_*, the thread settings MXNet's ssh tracker passes on, ...; never those the plan decides),
exported in the remote command; the remote login shell gives the rest. The job's CURVE keys (TFKV_CURVE_PUBLIC/SECRET) are never in the command, which
`ps` on the host would show while the shell runs: they go as one JSON line on the channel's stdin
(TFKV_SECRETS_ON_STDIN=1 tells the wrapper to read it) into the role's environment only.
Processes on the launching machine reached through ssh (127.0.0.1) are remote processes like any other.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from tfkv.errors import ConfigError
from tfkv.launcher import signals
from tfkv.launcher.base import Job, Result
from tfkv.launcher.hosts import Host
from tfkv.launcher.process import done_waiting, first_cause
from tfkv.launcher.plan import Process, forwarded_env
from tfkv.launcher.record import EXCLUDE
from tfkv.ps.security import SECRET_NAMES

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

log = logging.getLogger("tfkv")

CONNECT_TIMEOUT = 10  # seconds, unless the ssh config sets ConnectTimeout
RSYNC_IDLE_TIMEOUT = 120  # seconds without a byte moved before rsync gives up
PER_CONNECTION = 8  # roles per connection: sshd's MaxSessions is 10, one is kept for the teardown
LOST = 255  # a role whose connection dropped before it reported, as ssh itself says
MARK = "\x1etfkv-ssh "  # starts the wrapper's own lines (ASCII record separator: not in real output)

# Runs as `python -c WRAPPER argv...` on the host; Python only, no tfkv needed.
WRAPPER = r"""
import json, os, signal, subprocess, sys, threading, time
if os.environ.pop("TFKV_SECRETS_ON_STDIN", "") == "1":  # the job's keys: first line of the channel
    line = b""
    while not line.endswith(b"\n"):
        byte = os.read(0, 1)
        if not byte:
            break
        line += byte
    os.environ.update(json.loads(line or b"{}"))
if os.getpgid(0) != os.getpid():
    os.setsid()  # sshd already makes the remote command a group leader; elsewhere, become one
group = os.getpid()
print("\x1etfkv-ssh pgid", group, flush=True)
signal.signal(signal.SIGTERM, lambda *_: None)  # a TERM to the group is for the role; report it
gone = threading.Event()
def watch():  # stdin is the ssh channel: EOF means the launcher is gone, so goes the job
    while os.read(0, 65536):  # (not sys.stdin: its lock would abort the exit of a busy thread)
        pass
    gone.set()
    os.killpg(group, signal.SIGTERM)
    time.sleep(2)
    os.killpg(group, signal.SIGKILL)
threading.Thread(target=watch, daemon=True).start()
try:
    code = subprocess.call(sys.argv[1:], stdin=subprocess.DEVNULL)
except OSError as e:
    print(sys.argv[1] + ": " + str(e.strerror or e), flush=True)
    code = 127
if gone.is_set():
    os.killpg(group, signal.SIGKILL)
try:
    print("\x1etfkv-ssh exit", code, flush=True)
except OSError:
    pass
os._exit(code if code >= 0 else 128 - code)
"""


def ssh_config_path() -> str | None:
    """The ssh config file named by TFKV_SSH_CONFIG; None: ssh's own (~/.ssh/config)."""
    path = os.environ.get("TFKV_SSH_CONFIG")
    if path and not Path(path).expanduser().is_file():
        raise ConfigError(f"TFKV_SSH_CONFIG={path} is not a file; point it at an ssh config file or unset it")
    return str(Path(path).expanduser()) if path else None


def _config_name() -> str:
    return ssh_config_path() or "~/.ssh/config"


def connect(host: Host) -> Connection:
    """An open Fabric connection to `host`, set up as `ssh host` would be; never prompts."""
    from fabric import Config, Connection

    overrides = {"timeouts": {"connect": CONNECT_TIMEOUT}}  # the ssh config's ConnectTimeout wins
    path = ssh_config_path()
    config = Config(runtime_ssh_path=path, overrides=overrides) if path else Config(overrides=overrides)
    # IdentityFile etc. come from the ssh config; keys from the agent and ~/.ssh as ssh would try
    # them, unless the config says IdentitiesOnly and names the keys.
    entry = config.base_ssh_config.lookup(host.name)
    only = entry.get("identitiesonly") == "yes" and "identityfile" in entry
    conn = Connection(host.name, user=host.user, port=host.port, config=config,
                      connect_kwargs={"allow_agent": not only, "look_for_keys": not only})
    _check_host_keys(conn.client, entry)
    conn.open()
    conn.transport.set_keepalive(10)  # notice a host that went away
    return conn


def _check_host_keys(client: Any, entry: dict[str, Any]) -> None:
    """Host keys as OpenSSH checks them in BatchMode (rsync's ssh does): the known_hosts files
    the ssh config names (default ~/.ssh/known_hosts, /etc/ssh/ssh_known_hosts); a host not in
    them is refused, unless StrictHostKeyChecking is no, off or accept-new (then its key is
    accepted for this connection and not saved). Fabric's own default accepts any host."""
    import paramiko

    files = []
    for option, default in (("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2"),
                            ("globalknownhostsfile", "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2")):
        value = entry.get(option, default)
        files += value.split() if isinstance(value, str) else list(value)
    known = client.get_host_keys()
    for name in files:
        path = Path(name).expanduser()
        if path.is_file():
            try:
                known.load(str(path))
            except (OSError, paramiko.SSHException, ValueError) as e:
                log.warning("ssh: skipping unreadable known_hosts file %s (%s)", path, e)
    strict = str(entry.get("stricthostkeychecking", "ask")).lower()
    accept = strict in ("no", "off", "accept-new")
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if accept else paramiko.RejectPolicy())


def _connect_problem(host: Host, e: Exception) -> str:
    """One line: why `host` cannot be reached, and what to do."""
    import socket

    import paramiko

    if isinstance(e, paramiko.AuthenticationException) or "No authentication methods" in str(e):
        return (f"{host}: ssh refused the key ({e}); add your key to {host.name}'s authorized_keys or set "
                f"IdentityFile in {_config_name()}")
    if isinstance(e, socket.gaierror):
        return (f"{host}: unknown host ({e.strerror}); fix the name in the hosts file or give it a HostName "
                f"in {_config_name()}")
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"{host}: no ssh server answers there ({e.strerror or e}); start sshd on it or fix the port"
    if isinstance(e, (TimeoutError, socket.timeout)):
        return f"{host}: no answer within {CONNECT_TIMEOUT} s; check that the host is up and reachable"
    if isinstance(e, paramiko.BadHostKeyException):
        return f"{host}: its host key changed; if that is expected, run ssh-keygen -R {host.name}"
    if isinstance(e, paramiko.SSHException) and "not found in known_hosts" in str(e):
        return (f"{host}: its host key is not in known_hosts; run `ssh {host.name}` once to check and accept it, "
                f"or set StrictHostKeyChecking for it in {_config_name()}")
    return f"{host}: cannot connect ({type(e).__name__}: {e}); check that `ssh {host}` works"


def ssh_command(host: Host) -> list[str]:
    """`ssh` as rsync should run it: the same config, never a prompt; the alias is given apart."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}"]
    if ssh_config_path():
        cmd += ["-F", ssh_config_path()]
    if host.port:
        cmd += ["-p", str(host.port)]
    if host.user:
        cmd += ["-l", host.user]
    return cmd


def rsync(src: str, dst: str, host: Host, mirror: bool = False) -> str | None:
    """Run rsync over ssh (src or dst is `HOST:path`); None, or rsync's last words on failure.
    `mirror`: make dst like src (--delete), leaving out run outputs, .git and caches (EXCLUDE)."""
    extra = ["--delete", *[f"--exclude={d}/" for d in EXCLUDE]] if mirror else []
    # --timeout: a link that goes silent ends the copy instead of hanging the launch (or its teardown)
    cmd = ["rsync", "-az", f"--timeout={RSYNC_IDLE_TIMEOUT}", *extra, "-e", shlex.join(ssh_command(host)), src, dst]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "rsync is not installed on this machine; apt-get install rsync"
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    return None if r.returncode == 0 else (lines[-1] if lines else f"rsync exited with status {r.returncode}")


def _remote(host: Host, path: str) -> str:
    return f"[{host.name}]:{path}" if ":" in host.name else f"{host.name}:{path}"


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else ""


def _check_host(host: Host, job: Job, rsync_lock: threading.Lock) -> dict[str, Any] | str:
    """The pre-flight of one host: its versions, or one line saying what is wrong."""
    try:
        conn = connect(host)
    except Exception as e:  # noqa: BLE001 - every way of failing to connect becomes one line
        return _connect_problem(host, e)
    try:
        cwd = job.sync_dst_dir or str(job.workdir)
        if job.sync_dst_dir:
            dst = shlex.quote(job.sync_dst_dir)
            r = conn.run(f"mkdir -p {dst} && test -w {dst}", hide=True, warn=True, in_stream=False)
            if r.exited != 0:
                why = _last_line(r.stderr) or "no write permission"
                return f"{host}: {job.sync_dst_dir} is not writable ({why}); pick another --sync-dst-dir"
            with rsync_lock:  # hosts may share a filesystem: two rsyncs into one directory collide
                log.info("rsync %s/ -> %s", job.workdir, _remote(host, job.sync_dst_dir))
                problem = rsync(f"{job.workdir}/", _remote(host, job.sync_dst_dir.rstrip("/") + "/"), host, True)
            if problem:
                return (f"{host}: rsync of {job.workdir} to {job.sync_dst_dir} failed ({problem}); check that "
                        f"`ssh {host}` works without a prompt and that rsync is installed there")
        python = shlex.quote(job.python)
        r = conn.run(f"cd {shlex.quote(cwd)} 2>/dev/null || exit 97; exec {python} -m tfkv.launcher.record",
                     hide=True, warn=True, in_stream=False)
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


def secret_env(p: Process) -> dict[str, str]:
    """The job's keys: sent as a JSON line on the channel's stdin, which the wrapper reads into
    the role's environment; a command line would show them to every user's `ps` on the host."""
    return {k: v for k, v in p.env.items() if k in SECRET_NAMES}


def _remote_env(p: Process) -> dict[str, str]:
    env = {**forwarded_env(os.environ), **{k: v for k, v in p.env.items() if k not in SECRET_NAMES},
           "PYTHONUNBUFFERED": "1"}
    if secret_env(p):
        env["TFKV_SECRETS_ON_STDIN"] = "1"
    return env


def remote_command(p: Process, cwd: str, python: str) -> str:
    """The shell command that runs `p` on its host: cd, export its environment, start the wrapper."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in _remote_env(p).items())
    return (f"cd {shlex.quote(cwd)} && export {exports} && "
            f"exec {shlex.quote(python)} -c {shlex.quote(WRAPPER)} {shlex.join(p.argv)} 2>&1")


class _Role:
    """One planned process on its host: the channel it runs in, its group, how it ended."""

    def __init__(self, process: Process, host: Host, conn: Connection):
        self.process, self.host, self.conn = process, host, conn
        self.name = process.name
        self.pgid: int | None = None
        self.code: int | None = None  # its exit status once it ended (negative: killed by that signal)
        self.ended = threading.Event()
        self.channel: paramiko.Channel | None = None
        self.thread: threading.Thread | None = None

    def start(self, command: str, out: IO[str], lock: threading.Lock) -> None:
        self.channel = self.conn.transport.open_session(timeout=CONNECT_TIMEOUT)
        self.channel.exec_command(command)  # stdin stays open: its EOF tells the wrapper we are gone
        secrets = secret_env(self.process)
        if secrets:
            self.channel.sendall(json.dumps(secrets).encode() + b"\n")
        self.thread = threading.Thread(target=self._pump, args=(out, lock), daemon=True)
        self.thread.start()

    def _pump(self, out: IO[str], lock: threading.Lock) -> None:
        reported = None
        try:
            for raw in self.channel.makefile("rb"):
                line, _, mark = raw.decode(errors="replace").rstrip("\r\n").partition(MARK)
                if mark:  # the wrapper's own line, maybe after a role's last unterminated line
                    kind, value = mark.split()
                    self.pgid = int(value) if kind == "pgid" else self.pgid
                    reported = int(value) if kind == "exit" else reported
                if line or not mark:
                    with lock:
                        out.write(f"[{self.name}] {line}\n")
                        out.flush()
            status = self.channel.recv_exit_status()
        except Exception:  # noqa: BLE001 - the connection broke: the role's end is unknown
            status = -1
        self.code = reported if reported is not None else (status if status >= 0 else LOST)
        self.ended.set()


def _stop_groups(conn: Connection, running: list[int], every: list[int]) -> None:
    """TERM the groups still running, give them up to 3 s, then KILL every group of the job on
    this host (also whatever a finished role left behind in its group)."""
    if not every:
        return
    term = " ".join(f"-{g}" for g in running)
    script = (f"alive() {{ for g in {term}; do kill -0 $g 2>/dev/null && return 0; done; return 1; }}; "
              f"kill -TERM {term} 2>/dev/null; i=0; while [ $i -lt 30 ] && alive; do sleep 0.1; i=$((i+1)); done; "
              if running else "")
    script += f"kill -KILL {' '.join(f'-{g}' for g in every)} 2>/dev/null; true"
    try:
        conn.run(script, hide=True, warn=True, in_stream=False, timeout=15)
    except Exception:  # noqa: BLE001 - an unreachable host: closing the channel makes its wrappers do it
        pass


class SSHLauncher:
    """Every role over ssh on the hosts of the hosts file (MXNet's `--launcher ssh`)."""

    name = "ssh"

    def preflight(self, job: Job) -> dict[str, dict[str, Any]]:
        """Check (and sync) every host; their versions, or a ConfigError with a line per bad host."""
        hosts = list(dict.fromkeys(job.hosts))
        if not hosts:
            raise ConfigError("the ssh launcher needs hosts: -H hosts / cluster.hostfile=hosts")
        ssh_config_path()  # a wrong TFKV_SSH_CONFIG is one error, not one per host
        lock = threading.Lock()
        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            results = list(pool.map(lambda h: _check_host(h, job, lock), hosts))
        problems = [r for r in results if isinstance(r, str)]
        if problems:
            raise ConfigError("\n".join(problems))
        for h, v in zip(hosts, results):
            address = v.pop("address", None)
            if address:
                job.addresses.setdefault(h.name, address)
        return {str(h): v for h, v in zip(hosts, results)}

    def launch(self, job: Job, out: IO[str]) -> Result:
        import paramiko

        lock = threading.Lock()
        by_name = {h.name: h for h in reversed(job.hosts)}  # the first line of a name wins
        cwd = job.sync_dst_dir or str(job.workdir)
        roles: list[_Role] = []
        conns: list[Connection] = []
        first_conn: dict[str, Connection] = {}
        failure: str | None = "the launcher stopped"  # until the job says otherwise
        try:
            # One connection per host and per PER_CONNECTION of its roles, opened side by side.
            groups: list[tuple[Host, list[Process]]] = []
            for name in dict.fromkeys(p.host for p in job.plan):
                mine = [p for p in job.plan if p.host == name]
                host = by_name.get(name, Host(name))
                groups += [(host, mine[i:i + PER_CONNECTION]) for i in range(0, len(mine), PER_CONNECTION)]
            with ThreadPoolExecutor(max_workers=min(16, len(groups))) as pool:
                opened = list(pool.map(lambda g: _try(connect, g[0]), groups))
            conns = [c for c in opened if not isinstance(c, Exception)]
            bad = [(g[0], c) for g, c in zip(groups, opened) if isinstance(c, Exception)]
            if bad:
                failure = _connect_problem(*bad[0])
                return Result(1, failure)
            where = {}
            for (host, procs), conn in zip(groups, opened):
                first_conn.setdefault(host.name, conn)
                where.update({id(p): (host, conn) for p in procs})
            for p in job.plan:  # in plan order: the scheduler first
                roles.append(_Role(p, *where[id(p)]))
                try:
                    roles[-1].start(remote_command(p, cwd, job.python), out, lock)
                except (OSError, EOFError, paramiko.SSHException) as e:
                    failure = f"{p.name} could not start ({type(e).__name__}: {e})"
                    return Result(1, failure)
            failure = self._wait(roles)
        except KeyboardInterrupt as e:
            failure = signals.failure(e)
        finally:
            with signals.shielded():
                self._teardown(roles, first_conn)
                if failure is None:
                    failure = self._copy_back(job, first_conn)
                for c in conns:
                    c.close()  # any wrapper we could not reach sees EOF and kills its own group
                for r in roles:
                    if r.thread:
                        r.thread.join(timeout=5)
        return Result(0 if failure is None else 1, failure)

    @staticmethod
    def _wait(roles: list[_Role]) -> str | None:
        """Until every role ended, or process.done_waiting after the first failure; what failed first."""
        failed: list[tuple[str, int]] = []  # in the order seen
        failed_at = None
        while not all(r.ended.is_set() for r in roles):
            for r in roles:
                if r.ended.is_set() and r.code != 0 and all(r.name != f[0] for f in failed):
                    failed.append((r.name, r.code))
                    failed_at = failed_at or time.monotonic()
            if done_waiting(failed, failed_at, time.monotonic()):
                break
            time.sleep(0.05)
        failed += [(r.name, r.code) for r in roles
                   if r.ended.is_set() and r.code != 0 and all(r.name != f[0] for f in failed)]
        return first_cause(failed, [r.name for r in roles if not r.ended.is_set()])

    @staticmethod
    def _teardown(roles: list[_Role], first_conn: dict[str, Connection]) -> None:
        """Kill every remote group of the job, host by host in parallel."""
        jobs = []
        for name, conn in first_conn.items():
            mine = [r for r in roles if r.host.name == name and r.pgid is not None]
            running = [r.pgid for r in mine if not r.ended.is_set()]
            jobs.append((conn, running, [r.pgid for r in mine]))
        if jobs:
            with ThreadPoolExecutor(max_workers=min(16, len(jobs))) as pool:
                list(pool.map(lambda j: _stop_groups(*j), jobs))

    @staticmethod
    def _copy_back(job: Job, conns: dict[str, Connection]) -> str | None:
        """Worker 0's run directory, from its host into run_dir, when the tree was synced and
        the workers wrote there (tfkv-run's workers do; a tfkv-launch command may not)."""
        if not job.run_dir or not job.remote_run_dir or job.remote_run_dir == str(job.run_dir):
            return None
        worker0 = next((p for p in job.plan if p.role == "worker" and p.rank == 0), None)
        if worker0 is None or worker0.host not in conns:
            return None
        host = next((h for h in job.hosts if h.name == worker0.host), Host(worker0.host))
        try:
            there = conns[worker0.host].run(f"test -d {shlex.quote(job.remote_run_dir)}", hide=True, warn=True,
                                            in_stream=False, timeout=30).exited == 0
        except Exception as e:  # noqa: BLE001 - one line for the result
            return f"copying the run directory back from {host} failed ({type(e).__name__}: {e})"
        if not there:
            return None
        Path(job.run_dir).mkdir(parents=True, exist_ok=True)
        problem = rsync(_remote(host, job.remote_run_dir.rstrip("/") + "/"), f"{job.run_dir}/", host)
        return f"copying {_remote(host, job.remote_run_dir)} back failed ({problem})" if problem else None


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - returned, reported by the caller
        return e
