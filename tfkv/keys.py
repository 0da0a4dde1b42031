"""The job's CURVE keypair: made fresh, handed over privately, read back and checked.

Base module (no tfkv runtime import): the launcher makes the keys and hands them to the roles; the
parameter-server runtime (tfkv.ps.security) reads them from its environment and sets up its sockets.

    TFKV_CURVE_PUBLIC, TFKV_CURVE_SECRET   the keypair, Z85 text (40 characters each), in the
                                           process's environment (never on a command line)
    TFKV_CURVE_KEYFILE=path                or a file with the two lines "public=...",
                                           "secret=...", readable only by its owner (mode 0600;
                                           anything looser is refused)
    TFKV_SECURE=0                          plain TCP, no keys: only for a trusted single machine

`python -m tfkv.keys KEYFILE` writes fresh keys for a job started by hand.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import zmq

from tfkv.errors import TfkvError

log = logging.getLogger("tfkv.ps")

PUBLIC, SECRET, KEYFILE, SECURE = "TFKV_CURVE_PUBLIC", "TFKV_CURVE_SECRET", "TFKV_CURVE_KEYFILE", "TFKV_SECURE"
SECRET_NAMES = (PUBLIC, SECRET)  # never on a command line, never in a record

INSECURE_WARNING = ("tfkv: this job runs WITHOUT authentication or encryption (cluster.secure=false / "
                    "TFKV_SECURE=0): anyone who can reach its ports can read and change the model; "
                    "use it only on a trusted single machine")
NO_KEYS_WARNING = ("tfkv: no job keys (TFKV_CURVE_PUBLIC/TFKV_CURVE_SECRET or TFKV_CURVE_KEYFILE) in the "
                   "environment: this manually launched job runs WITHOUT authentication or encryption; "
                   "make keys with `python -m tfkv.keys KEYFILE` and set TFKV_CURVE_KEYFILE")


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


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        log.warning(text)
        if not logging.getLogger().handlers:
            print(text, file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    """python -m tfkv.keys KEYFILE: fresh keys for a manual launch."""
    if len(argv) != 1:
        sys.exit("usage: python -m tfkv.keys KEYFILE  (then export TFKV_CURVE_KEYFILE=KEYFILE "
                 "on every node of the job)")
    print(f"wrote {write_keyfile(Path(argv[0]), new_keys())} (mode 600); copy it privately to every "
          f"node and set {KEYFILE} there")


if __name__ == "__main__":
    main(sys.argv[1:])
