"""One role on its host over ssh: the remote command that starts it (cd, its environment exported
and quoted, the wrapper), the channel it runs in, and the kill of its process group.

Each role runs under a small Python wrapper (WRAPPER, `python -c`, no tfkv needed on the host)
that makes it a process group leader, prints the group id (a marker line the launcher strips)
and reports how the role ended (so a role killed by a signal is named as such). A remote process
without a pty outlives its closed ssh channel, so the wrapper watches its stdin (the channel):
at EOF (the launcher died, the connection dropped) it kills its own group.

The job's CURVE keys are never in the command, which `ps` on the host would show while the
shell runs: they go as one JSON line on the channel's stdin (TFKV_SECRETS_ON_STDIN=1 tells the
wrapper to read it) into the role's environment only.
"""

from __future__ import annotations

import json
import os
import shlex
import threading
from typing import IO, TYPE_CHECKING, Mapping

from tfkv.launcher.hosts import Host
from tfkv.launcher.plan import Process, forwarded_env
from tfkv.launcher.backends.ssh_connect import CHANNEL_TIMEOUT, EXEC_TIMEOUT, deadline, run
from tfkv.keys import SECRET_NAMES

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

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
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # a TERM, the teardown's HUP or the launcher's
    signal.signal(s, lambda *_: None)  # Ctrl-C (interrupt) to the group is for the role; report how it ends
gone = threading.Event()
def watch():  # stdin is the ssh channel: EOF means the launcher is gone, so goes the job
    while os.read(0, 65536):  # (not sys.stdin: its lock would abort the exit of a busy thread)
        pass
    gone.set()
    os.killpg(group, signal.SIGHUP)
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


def secret_env(p: Process) -> dict[str, str]:
    """The job's keys: sent as a JSON line on the channel's stdin, which the wrapper reads into
    the role's environment; a command line would show them to every user's `ps` on the host."""
    return {k: v for k, v in p.env.items() if k in SECRET_NAMES}


def _remote_env(p: Process, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {**forwarded_env(os.environ if environ is None else environ), **{k: v for k, v in p.env.items() if k not in SECRET_NAMES},
           "PYTHONUNBUFFERED": "1"}
    if secret_env(p):
        env["TFKV_SECRETS_ON_STDIN"] = "1"
    return env


def remote_command(p: Process, cwd: str, python: str, environ: Mapping[str, str] | None = None) -> str:
    """The shell command that runs `p` on its host: cd, export its environment (the plan's and
    what `environ`, the launching shell's, forwards), start the wrapper."""
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in _remote_env(p, environ).items())
    return (f"cd {shlex.quote(cwd)} && export {exports} && "
            f"exec {shlex.quote(python)} -c {shlex.quote(WRAPPER)} {shlex.join(p.argv)} 2>&1")


class RemoteRole:
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
        self.channel = self.conn.transport.open_session(timeout=CHANNEL_TIMEOUT)
        with deadline(self.channel, EXEC_TIMEOUT):  # sshd answers once it started the command
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


INTERRUPT_TIMEOUT = 5  # seconds for the Ctrl-C passed on to a role to start and end, once its channel is open


def interrupt_group(conn: Connection, pgid: int) -> bool:
    """SIGINT to one remote group over its role's own connection (the launcher's first Ctrl-C,
    passed on to worker 0: it finishes the checkpoint it is writing). Whether it was delivered;
    never longer than the connection's deadlines and INTERRUPT_TIMEOUT (a host cut off answers
    False, and the teardown follows at once)."""
    if not conn.is_connected:
        return False
    try:
        return run(conn, f"kill -INT -{pgid}", INTERRUPT_TIMEOUT).exited == 0
    except Exception:  # noqa: BLE001 - an unreachable host: the teardown says so
        return False


STOP_TIMEOUT = 15  # seconds for the teardown's command on a host to start and end, once its channel is open
GONE = "its ssh connection is gone"


def stop_groups(conn: Connection, running: list[int], every: list[int]) -> str | None:
    """HUP the groups still running (supervisor.STOP: a role takes TERM for a preemption), give
    them up to 3 s, then KILL every group of the job on this host (also whatever a finished role
    left behind in its group). None, or why the host could not be reached: its connection is gone
    (never opened again here: a host cut off would hold the teardown for a connect timeout), or
    a step of the command ran past its deadline (tfkv.launcher.backends.ssh_connect)."""
    if not every:
        return None
    if not conn.is_connected:
        return GONE
    term = " ".join(f"-{g}" for g in running)
    script = (f"alive() {{ for g in {term}; do kill -0 $g 2>/dev/null && return 0; done; return 1; }}; "
              f"kill -HUP {term} 2>/dev/null; kill -CONT {term} 2>/dev/null; i=0; while [ $i -lt 30 ] && alive; do sleep 0.1; i=$((i+1)); done; "
              if running else "")
    script += f"kill -KILL {' '.join(f'-{g}' for g in every)} 2>/dev/null; true"
    try:
        run(conn, script, STOP_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - an unreachable host: closing the channel makes its wrappers do it
        if not conn.is_connected:  # it died while we waited (the kernel gave up on it: ssh_connect)
            return GONE
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return None
