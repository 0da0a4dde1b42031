"""An sshd on every host, and the keys and ssh config to reach them.

Each host's sshd is started on that host (its namespaces and cgroup: Host.command), listening on
its address, port 22, key-only: everything started over ssh runs within the host's CPU budget and
behind its link. Host key, client key and authorized_keys live in the cluster's state directory
(StrictModes no, as they are not under a home); a given client key replaces the generated one.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from tfkv.emulate.host import Host
from tfkv.emulate.spec import SSHD


def keys(state_dir: Path, client_key: Path | None) -> Path:
    """A host key, the client key (generated unless given) and authorized_keys accepting it; the client key."""
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # a root sshd refuses to start without it
    for name in ("host_key", "client_key") if client_key is None else ("host_key",):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(state_dir / name)],
                       check=True, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    client_key = client_key or state_dir / "client_key"
    authorized = state_dir / "authorized_keys"
    shutil.copyfile(f"{client_key}.pub", authorized)
    authorized.chmod(0o600)
    return client_key


def config(state_dir: Path, host: Host) -> Path:
    """The sshd config of one host: its address, port 22, key-only, no PAM."""
    path = state_dir / f"sshd_{host.name}.config"
    path.write_text(f"Port 22\nListenAddress {host.address}\nHostKey {state_dir / 'host_key'}\n"
                    f"PidFile {pid_file(state_dir, host)}\nAuthorizedKeysFile {state_dir / 'authorized_keys'}\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                    "PermitRootLogin prohibit-password\nStrictModes no\nSubsystem sftp internal-sftp\n")
    return path


def pid_file(state_dir: Path, host: Host) -> Path:
    return state_dir / f"sshd_{host.name}.pid"


def start(state_dir: Path, host: Host, seconds: float = 10) -> None:
    """Start the host's sshd on the host and wait until it accepts connections."""
    log = state_dir / f"sshd_{host.name}.log"
    r = host.run([SSHD, "-f", str(state_dir / f"sshd_{host.name}.config"), "-E", str(log)],
                 capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"sshd on {host.name} did not start: {r.stderr.strip()} (see {log})")
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host.address, 22), timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on {host.name} does not answer on {host.address}:22: {e} (see {log})") from e
            time.sleep(0.05)


def client_config(path: Path, hosts: list[Host], client_key: Path, user: str | None = None) -> Path:
    """An ssh config (ssh -F) with a Host block per host: key-only, no host key check."""
    user = user or getpass.getuser()
    path.write_text("".join(
        f"Host {h.name}\n  HostName {h.address}\n  Port 22\n  User {user}\n  IdentityFile {client_key}\n"
        "  IdentitiesOnly yes\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
        "  ConnectTimeout 5\n" for h in hosts))
    return path
