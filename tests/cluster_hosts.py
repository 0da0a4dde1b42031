"""Real ssh "hosts" for the cluster tests: an sshd on 127.0.0.1 and network-namespace hosts.

- `ssh_site`: throwaway keys and an ssh config file of our own (never ~/.ssh): every host alias
  the fixtures make is a `Host` block in it. Point the launcher at it with
  `ssh_site.env()` (TFKV_SSH_CONFIG), and plain ssh/rsync with `-F ssh_site.config`.
- `loopback_host`: an sshd on 127.0.0.1 on a free port, as aliases `local` and `127.0.0.1` (a
  hosts file can then name it by address, which its roles can resolve); alias `badkey` reaches
  the same sshd with a key it does not accept.
- `netns_hosts`: two hosts `node1`, `node2` of an emulated cluster (tfkv.emulate: network
  namespaces on a bridge of their own, 10.2xx.N.0/24), each with its own sshd on port 22, its
  own hostname and an /etc/hosts that names both (so DMLC_PS_ROOT_URI=node1 resolves on them).
  Each also has an ssh alias no host can resolve (`far1` -> node1's address, `far2`), as a
  `Host far1 / HostName 10.x` block of a real ~/.ssh/config: only ssh knows where it is.
  They share this machine's filesystem, PID numbers and Python, so tfkv imports there, and
  /proc here shows their processes.

Everything is session-scoped and stopped at the end: the loopback sshd by PID, the namespace
hosts by the cluster's own teardown. Import the fixtures into a test module: `from cluster_hosts import netns_hosts, ...`.
Skipped only where this machine cannot do it (not root, no `ip`, namespaces refused); a missing
openssh-server/rsync is an error: `.ci/run` installs them.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import need_root

from tfkv.emulate import Cluster, HostSpec, Refused
from tfkv.launcher.plan import Process
from tfkv.launcher.backends.ssh_remote import remote_command

SSHD = "/usr/sbin/sshd"  # sshd re-executes itself, so it must be started by absolute path


def _need(*programs: str) -> None:
    missing = [p for p in programs if not (shutil.which(p) or Path(p).is_file())]
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: apt-get install openssh-server openssh-client rsync "
                    "(as .ci/run does)")


def _run(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (PID 1 here reaps daemons slowly)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _stop_pid(pid_file: Path) -> None:
    """SIGTERM the daemon whose pid file this is and wait (a little) until it is gone."""
    try:
        pid = int(pid_file.read_text())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(50):
        if _gone(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class SSHSite:
    """Keys and an ssh config file that the launcher, ssh and rsync all use."""

    dir: Path
    client_key: Path  # authorized on every sshd made here
    other_key: Path  # authorized nowhere
    user: str = field(default_factory=getpass.getuser)

    @property
    def config(self) -> Path:
        return self.dir / "ssh_config"

    def env(self) -> dict[str, str]:
        return {"TFKV_SSH_CONFIG": str(self.config)}

    def add_host(self, alias: str, hostname: str, port: int, key: Path | None = None) -> None:
        with open(self.config, "a") as f:
            f.write(f"Host {alias}\n  HostName {hostname}\n  Port {port}\n  User {self.user}\n"
                    f"  IdentityFile {key or self.client_key}\n")

    def sshd_config(self, name: str, address: str, port: int) -> Path:
        """An sshd config: key-only, our keys under /tmp (StrictModes no), no PAM."""
        path = self.dir / f"sshd_{name}.config"
        path.write_text(f"Port {port}\nListenAddress {address}\nHostKey {self.dir / 'host_key'}\n"
                        f"PidFile {self.dir / f'sshd_{name}.pid'}\nAuthorizedKeysFile {self.dir / 'authorized_keys'}\n"
                        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                        "PermitRootLogin prohibit-password\nStrictModes no\nSubsystem sftp internal-sftp\n")
        return path

    def ssh(self, alias: str, command: str, timeout: float = 20) -> subprocess.CompletedProcess:
        return _run("ssh", "-F", str(self.config), "-o", "BatchMode=yes", alias, command, timeout=timeout)

    def wait_for(self, alias: str, seconds: float = 10) -> None:
        deadline = time.monotonic() + seconds
        while True:
            r = self.ssh(alias, "true", timeout=seconds)
            if r.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd for {alias} does not answer: {r.stderr.strip()}")
            time.sleep(0.1)


@pytest.fixture(scope="session")
def ssh_site(tmp_path_factory) -> SSHSite:
    _need("ssh", "ssh-keygen", "rsync", SSHD)
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # a root sshd refuses to start without it
    d = tmp_path_factory.mktemp("ssh")
    for key in ("host_key", "client_key", "other_key"):
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)).check_returncode()
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    (d / "authorized_keys").chmod(0o600)
    # Defaults for every alias; each alias names its own IdentityFile (IdentityFile adds up, so
    # it cannot go under Host *: `badkey` would then also offer the good key).
    (d / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                  "  LogLevel ERROR\n  IdentitiesOnly yes\n  ConnectTimeout 5\n")
    return SSHSite(d, d / "client_key", d / "other_key")


@dataclass
class LoopbackHost:
    alias: str  # "local"
    port: int
    refused_alias: str  # "badkey": same sshd, a key it refuses


@pytest.fixture(scope="session")
def loopback_host(ssh_site: SSHSite):
    from tfkv.launcher.ports import free_port

    port = free_port("127.0.0.1")
    config = ssh_site.sshd_config("loopback", "127.0.0.1", port)
    _run(SSHD, "-f", str(config), "-E", str(ssh_site.dir / "sshd_loopback.log")).check_returncode()
    try:
        ssh_site.add_host("local", "127.0.0.1", port)
        ssh_site.add_host("127.0.0.1", "127.0.0.1", port)
        ssh_site.add_host("badkey", "127.0.0.1", port, key=ssh_site.other_key)
        ssh_site.wait_for("local")
        yield LoopbackHost("local", port, "badkey")
    finally:
        _stop_pid(ssh_site.dir / "sshd_loopback.pid")


@dataclass
class NetnsHosts:
    names: list[str]  # ssh aliases, also each host's hostname: ["node1", "node2"]
    addresses: dict[str, str]  # alias -> 10.2xx.N.x
    aliases: list[str]  # ["far1", "far2"]: ssh aliases of the same hosts that no /etc/hosts names
    cluster: Cluster  # what made them (tfkv.emulate): host.pids(), cluster.start_sshd(host)

    @property
    def namespaces(self) -> list[str]:
        return [h.namespace for h in self.cluster.hosts]


@pytest.fixture(scope="session")
def netns_hosts(ssh_site: SSHSite):
    """Two hosts of tfkv.emulate (unlimited CPU and links) whose sshds take ssh_site's client key."""
    need_root("network-namespace hosts (ip netns add)")
    try:
        cluster = Cluster.up([HostSpec("node1"), HostSpec("node2")], ssh_site.dir / "cluster",
                             client_key=ssh_site.client_key)
    except Refused as e:
        pytest.fail(str(e))
    try:
        hosts = NetnsHosts([h.name for h in cluster.hosts], {h.name: h.address for h in cluster.hosts},
                           [f"far{i + 1}" for i in range(len(cluster.hosts))], cluster)
        for host, alias in zip(cluster.hosts, hosts.aliases):
            ssh_site.add_host(host.name, host.address, 22)
            ssh_site.add_host(alias, host.address, 22)
        for name in hosts.names:
            ssh_site.wait_for(name)
        yield hosts
    finally:
        cluster.down()


def start_remote_command(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """What sshd does with the command: hand it to a shell in a new session, stdin the channel."""
    p = Process("worker 0", "worker", 0, "here", argv, env)
    return subprocess.Popen(["sh", "-c", remote_command(p, str(cwd), sys.executable)], stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, text=True, start_new_session=True)


def run_remote_command(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.Popen, str]:
    """Run it to its end with the channel open (closing stdin would end the job); its output."""
    proc = start_remote_command(argv, env, cwd)
    try:
        out = proc.stdout.read()
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.stdin.close()
    return proc, out
