"""ZeroMQ CURVE on every socket of a job: authentication and encryption with the job's keys.

One keypair per job, made fresh by the launcher (`new_keys`). Every process of the job gets it
privately, never on a command line:

    TFKV_CURVE_PUBLIC, TFKV_CURVE_SECRET   the keypair, Z85 text (40 characters each), in the
                                           process's environment (local launcher, test helper;
                                           the ssh launcher sends them over the ssh channel's
                                           stdin and its wrapper puts them in the role's env)
    TFKV_CURVE_KEYFILE=path                or a file with the two lines "public=...",
                                           "secret=...", readable only by its owner (mode 0600;
                                           anything looser is refused)
    TFKV_SECURE=0                          plain TCP, no keys: only for a trusted single machine

Listening sockets (scheduler, servers) are CURVE servers with the job's secret key, and a ZAP
handler in the process lets in only clients that present the job's public key: a peer without
the keys fails the handshake inside libzmq and none of its bytes reaches tfkv code. Connecting
sockets (scheduler links, workers) are CURVE clients of the same keypair.

No keys and no TFKV_SECURE=0 (a job started by hand with MXNet's DMLC_* variables only): plain
TCP with a warning, as MXNet users expect. TFKV_SECURE=1 without keys is an error.

What a connection can cost a node before it authenticates is bounded on every socket, secure
or not: no frame over protocol.MAX_FRAME (1 MiB) is accepted (libzmq's ZMQ_MAXMSGSIZE holds for
the handshake's frames too; a stranger announcing CURVE and a 1 GiB frame is cut off after
1 MiB), and a handshake not finished within HANDSHAKE_SECONDS is dropped.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import zmq

from tfkv.errors import TfkvError
from tfkv.ps.protocol import MAX_FRAME

log = logging.getLogger("tfkv.ps")

PUBLIC, SECRET, KEYFILE, SECURE = "TFKV_CURVE_PUBLIC", "TFKV_CURVE_SECRET", "TFKV_CURVE_KEYFILE", "TFKV_SECURE"
SECRET_NAMES = (PUBLIC, SECRET)  # never on a command line, never in a record

HANDSHAKE_SECONDS = 10  # a CURVE handshake takes milliseconds; a stalled one holds its buffers

INSECURE_WARNING = ("tfkv: this job runs WITHOUT authentication or encryption (cluster.secure=false / "
                    "TFKV_SECURE=0): anyone who can reach its ports can read and change the model; "
                    "use it only on a trusted single machine")
NO_KEYS_WARNING = ("tfkv: no job keys (TFKV_CURVE_PUBLIC/TFKV_CURVE_SECRET or TFKV_CURVE_KEYFILE) in the "
                   "environment: this manually launched job runs WITHOUT authentication or encryption; "
                   "make keys with `python -m tfkv.ps.security KEYFILE` and set TFKV_CURVE_KEYFILE")


class SecurityError(TfkvError, ValueError):
    """Keys are missing, malformed or exposed; the message says which and what to do."""


@dataclass(frozen=True)
class Keys:
    public: bytes  # Z85, 40 bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"Keys(public={self.public.decode()!r})"


def new_keys() -> Keys:
    if not zmq.has("curve"):
        raise SecurityError("this libzmq has no CURVE support; install pyzmq with libsodium or set "
                            "cluster.secure=false on a trusted single machine")
    public, secret = zmq.curve_keypair()
    return Keys(public, secret)


def keys_env(keys: Keys) -> dict[str, str]:
    return {PUBLIC: keys.public.decode(), SECRET: keys.secret.decode()}


def write_keyfile(path: Path, keys: Keys) -> Path:
    """Write the keypair to `path`, readable only by the user (created 0600, never wider)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"public={keys.public.decode()}\nsecret={keys.secret.decode()}\n".encode())
    finally:
        os.close(fd)
    return path


def read_keyfile(path: str) -> Keys:
    try:
        st = os.stat(path)
        text = Path(path).read_text()
    except OSError as e:
        raise SecurityError(f"{KEYFILE}={path}: cannot read it ({e.strerror})") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(f"{KEYFILE}={path} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                            f"chmod 600 {path}")
    fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return _check(fields.get("public", ""), fields.get("secret", ""), KEYFILE)


def _check(public: str, secret: str, where: str) -> Keys:
    public, secret = public.strip(), secret.strip()
    for name, value in (("public", public), ("secret", secret)):
        if len(value) != 40:
            raise SecurityError(f"{where}: the {name} key must be 40 characters of Z85 text")
    try:
        derived = zmq.curve_public(secret.encode())
    except (zmq.ZMQError, ValueError):
        raise SecurityError(f"{where}: the secret key is not Z85 text") from None
    if derived != public.encode():
        raise SecurityError(f"{where}: the public key does not belong to the secret key")
    return Keys(public.encode(), secret.encode())


def keys_from_env(env: Mapping[str, str]) -> Keys | None:
    """The job's keys as the environment gives them; None (with a warning): plain TCP."""
    flag = env.get(SECURE, "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        _warn_once(INSECURE_WARNING)
        return None
    keys = None
    if env.get(PUBLIC) or env.get(SECRET):
        keys = _check(env.get(PUBLIC, ""), env.get(SECRET, ""), f"{PUBLIC}/{SECRET}")
    elif env.get(KEYFILE):
        keys = read_keyfile(env[KEYFILE])
    if keys is None:
        if flag in ("1", "true", "yes", "on"):
            raise SecurityError(f"{SECURE}=1 but no job keys: set {PUBLIC} and {SECRET}, or {KEYFILE}")
        _warn_once(NO_KEYS_WARNING)
    return keys


_warned: set[str] = set()
_auth_lock = threading.Lock()
_authenticators: dict[int, object] = {}


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning(text)
        if not logging.getLogger().handlers:
            import sys

            print(text, file=sys.stderr, flush=True)


class _AllowJobKey:
    """ZAP credentials check: only the job's public key gets in."""

    def __init__(self, public: bytes):
        self.public = public  # Z85, as pyzmq hands the client's key to the callback

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == "tfkv" and key == self.public


def _start_authenticator(ctx: zmq.Context, keys: Keys) -> None:
    """One ZAP handler per context (so per process), started before the first bind."""
    with _auth_lock:
        if id(ctx) in _authenticators:
            return
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx, log=logging.getLogger("tfkv.zap"))
        auth.start()
        auth.configure_curve_callback(domain="tfkv", credentials_provider=_AllowJobKey(keys.public))
        _authenticators[id(ctx)] = auth


def _bound(sock: zmq.Socket) -> None:
    """Cap what a peer can make this socket buffer (per frame, the handshake's included) and how
    long it may take to authenticate."""
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_SECONDS * 1000)


def server_socket(sock: zmq.Socket, keys: Keys | None) -> None:
    """Make a listening socket a CURVE server that admits the job's key only (before bind); with
    or without keys, bound what an unauthenticated peer can make it buffer."""
    _bound(sock)
    if keys is None:
        return
    _start_authenticator(sock.context, keys)
    sock.setsockopt(zmq.ZAP_DOMAIN, b"tfkv")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def client_socket(sock: zmq.Socket, keys: Keys | None) -> None:
    """Make a connecting socket a CURVE client of the job (before connect), its frames bounded
    as a server's."""
    _bound(sock)
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


if __name__ == "__main__":  # python -m tfkv.ps.security KEYFILE: fresh keys for a manual launch
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m tfkv.ps.security KEYFILE  (then export TFKV_CURVE_KEYFILE=KEYFILE "
                 "on every node of the job)")
    print(f"wrote {write_keyfile(Path(sys.argv[1]), new_keys())} (mode 600); copy it privately to every "
          f"node and set {KEYFILE} there")
