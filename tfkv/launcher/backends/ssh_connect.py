"""ssh connections for the ssh launcher (and the sweeps' host checks): a host reached exactly as
`ssh HOST` would reach it, by Fabric or by `ssh` itself (for rsync).

The ssh config (~/.ssh/config, or the file cluster.ssh_config / TFKV_SSH_CONFIG names, passed
in as `ssh_config`: the launcher's settings) gives a host's HostName, User,
Port, IdentityFile, ProxyJump...; a hosts-file `user@host:port` wins over it. Fabric (paramiko)
makes the connection; no password is ever asked for (keys or an agent only, as with ssh's
BatchMode), and host keys are checked as OpenSSH checks them, where Fabric alone would accept any
host. Every way of failing to connect becomes one line naming the host and the fix.

Every step has a deadline, so that a host cut off from the network (or powered off) never holds
the launcher: the TCP connect (ConnectTimeout), the server's banner and the login (paramiko's
banner and auth timeouts), a channel's opening (its channel timeout: paramiko's default is an
hour, and Fabric's own command timeout starts only once the channel is open and the command
started), a command's start and end (`run`: paramiko's exec_command and exit status wait without
one), and a connection that stops answering: keepalives every ServerAliveInterval seconds,
and the kernel drops a connection whose data has gone unacknowledged for ServerAliveInterval x
ServerAliveCountMax seconds (TCP_USER_TIMEOUT), OpenSSH's rule for a dead server. Its transport
then closes, which ends every wait on it: a command's start, its output, its exit status.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple

from tfkv.errors import ConfigError
from tfkv.launcher.hosts import Host

if TYPE_CHECKING:
    import paramiko
    from fabric import Connection

log = logging.getLogger("tfkv")

CONNECT_TIMEOUT = 10  # seconds, unless the ssh config sets ConnectTimeout
BANNER_TIMEOUT = 15  # seconds for the server's banner once connected (paramiko's default)
AUTH_TIMEOUT = 30  # seconds for the login (paramiko's default)
# Seconds to open a channel on a connection (paramiko's default: an hour): sshd answers at once
# when it can; the teardown of a host that stopped answering ends after it (heartbeat timeout +
# the supervisor's HANG_GRACE + this: within the heartbeat timeout and 15 s, whatever ServerAliveInterval says).
CHANNEL_TIMEOUT = 5
EXEC_TIMEOUT = 10  # seconds for sshd to start a command on an open channel (it forks: a busy host is slow)
# OpenSSH's ServerAliveInterval and ServerAliveCountMax, unless the ssh config sets them: a
# connection silent for 2 x 4 s is dead (a role's heartbeat timeout is 4 s: the job is stopped by then).
ALIVE_INTERVAL = 2
ALIVE_COUNT = 4


def ssh_config_path(path: str | None) -> str | None:
    """The ssh config file `path` (cluster.ssh_config, TFKV_SSH_CONFIG) names, checked; None: ssh's
    own (~/.ssh/config)."""
    if path and not Path(path).expanduser().is_file():
        raise ConfigError(f"TFKV_SSH_CONFIG={path} is not a file; point it at an ssh config file or unset it")
    return str(Path(path).expanduser()) if path else None


def config_name(ssh_config: str | None) -> str:
    return ssh_config_path(ssh_config) or "~/.ssh/config"


def connect(host: Host, ssh_config: str | None = None) -> Connection:
    """An open Fabric connection to `host`, set up as `ssh host` would be; never prompts."""
    from fabric import Config, Connection

    overrides = {"timeouts": {"connect": CONNECT_TIMEOUT}}  # the ssh config's ConnectTimeout wins
    path = ssh_config_path(ssh_config)
    config = Config(runtime_ssh_path=path, overrides=overrides) if path else Config(overrides=overrides)
    # IdentityFile etc. come from the ssh config; keys from the agent and ~/.ssh as ssh would try
    # them, unless the config says IdentitiesOnly and names the keys.
    entry = config.base_ssh_config.lookup(host.name)
    only = entry.get("identitiesonly") == "yes" and "identityfile" in entry
    conn = Connection(host.name, user=host.user, port=host.port, config=config,
                      connect_kwargs={"allow_agent": not only, "look_for_keys": not only,
                                      "banner_timeout": BANNER_TIMEOUT, "auth_timeout": AUTH_TIMEOUT,
                                      "channel_timeout": CHANNEL_TIMEOUT})
    _check_host_keys(conn.client, entry)
    conn.open()
    _keep_alive(conn)
    return conn


def dead_after(entry: dict[str, Any]) -> tuple[int, int]:
    """(ServerAliveInterval, seconds of silence after which the connection is dead), as the ssh
    config `entry` sets them or ALIVE_INTERVAL, ALIVE_COUNT; never off (0): the launcher needs
    every connection to end when its host is gone."""
    interval = int(entry.get("serveraliveinterval", 0)) or ALIVE_INTERVAL
    return interval, interval * max(1, int(entry.get("serveralivecountmax", ALIVE_COUNT)))


def _keep_alive(conn: Connection) -> None:
    """Keepalives on the connection (paramiko's, every ServerAliveInterval of its host's ssh config
    entry), and TCP_USER_TIMEOUT on its socket: data unacknowledged that long and the kernel drops
    the connection, which closes the transport (its thread sees the error). Also on a ProxyJump's
    own connection, whose channel carries this one."""
    import socket

    from fabric import Connection

    interval, dead = dead_after(conn.ssh_config)
    conn.transport.set_keepalive(interval)
    sock = conn.transport.sock
    if isinstance(sock, socket.socket) and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, dead * 1000)
    if isinstance(conn.gateway, Connection) and conn.gateway.is_connected:
        _keep_alive(conn.gateway)


class Ran(NamedTuple):
    """How a command ended (the fields Fabric's Result has)."""

    exited: int
    stdout: str
    stderr: str


def run(conn: Connection, command: str, timeout: float) -> Ran:
    """Run `command` on the connection's host, no input, its output kept, every step within a
    deadline: the channel opens within CHANNEL_TIMEOUT, the command starts and ends within
    `timeout` seconds, or the channel is closed, which ends paramiko's waits (exec_command and
    recv_exit_status have no timeout of their own; Fabric's run(timeout=) starts its clock only
    once the command started). Raises TimeoutError past the deadline, paramiko's errors for a
    connection that broke (an inactive one: SSHException, at once)."""
    chan = conn.transport.open_session(timeout=CHANNEL_TIMEOUT)
    try:
        with deadline(chan, timeout):
            chan.exec_command(command)
            chan.shutdown_write()  # no input
            # stdout, then stderr: paramiko buffers each apart; these commands say a few lines
            out = chan.makefile("rb").read().decode(errors="replace")
            err = chan.makefile_stderr("rb").read().decode(errors="replace")
            status = chan.recv_exit_status()
    finally:
        chan.close()
    return Ran(status, out, err)


@contextlib.contextmanager
def deadline(chan: paramiko.Channel, seconds: float) -> Iterator[None]:
    """Close `chan` if the block is still in it after `seconds`, which ends any wait on the
    channel in it (paramiko's exec_command, reads, exit status); the block then raises
    TimeoutError, whatever the closed channel made it raise or return."""
    late = threading.Event()

    def expire() -> None:
        late.set()
        chan.close()

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    except Exception:
        if late.is_set():
            raise TimeoutError(f"no end within {seconds:.0f} s") from None
        raise
    finally:
        timer.cancel()
    if late.is_set():
        raise TimeoutError(f"no end within {seconds:.0f} s")


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


def connect_problem(host: Host, e: Exception, ssh_config: str | None = None) -> str:
    """One line: why `host` cannot be reached, and what to do."""
    import socket

    import paramiko

    if isinstance(e, paramiko.AuthenticationException) or "No authentication methods" in str(e):
        return (f"{host}: ssh refused the key ({e}); add your key to {host.name}'s authorized_keys or set "
                f"IdentityFile in {config_name(ssh_config)}")
    if isinstance(e, socket.gaierror):
        return (f"{host}: unknown host ({e.strerror}); fix the name in the hosts file or give it a HostName "
                f"in {config_name(ssh_config)}")
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"{host}: no ssh server answers there ({e.strerror or e}); start sshd on it or fix the port"
    if isinstance(e, (TimeoutError, socket.timeout)):
        return f"{host}: no answer within {CONNECT_TIMEOUT} s; check that the host is up and reachable"
    if isinstance(e, paramiko.BadHostKeyException):
        return f"{host}: its host key changed; if that is expected, run ssh-keygen -R {host.name}"
    if isinstance(e, paramiko.SSHException) and "not found in known_hosts" in str(e):
        return (f"{host}: its host key is not in known_hosts; run `ssh {host.name}` once to check and accept it, "
                f"or set StrictHostKeyChecking for it in {config_name(ssh_config)}")
    return f"{host}: cannot connect ({type(e).__name__}: {e}); check that `ssh {host}` works"


def ssh_command(host: Host, ssh_config: str | None = None) -> list[str]:
    """`ssh` as rsync should run it: the same config, never a prompt; the alias is given apart."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}"]
    if ssh_config:
        cmd += ["-F", ssh_config_path(ssh_config)]
    if host.port:
        cmd += ["-p", str(host.port)]
    if host.user:
        cmd += ["-l", host.user]
    return cmd
