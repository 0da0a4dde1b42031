"""What the handshake tests forge and hide: data-plane HELLOs and WELCOMEs made with the job's key
(as a member, or one who stole the key, could) around a chosen X25519 key, cipher or time; the
X25519 keys of small order; and a node without the `aeg` package."""

import hashlib
import hmac
import time
from pathlib import Path

from tfkv.ps import channel

_P = 2**255 - 19
# The u-coordinates of small order on Curve25519 (the blocklist of libsodium and of
# cr.yp.to/ecdh.html): 0, 1, the two points of order 8, p - 1, p, p + 1. Each also with the top
# bit set, which X25519 ignores (RFC 7748 5): 14 keys whose shared secret is all zeros.
_SMALL = [0, 1, 325606250916557431795983626356110631294008115727848805560023387167927233504,
          39382357235489614581723060781553021112529911719440698176882885853963445705823, _P - 1, _P, _P + 1]
SMALL_ORDER = [u.to_bytes(32, "little") for u in _SMALL] + [
    (u | 1 << 255).to_bytes(32, "little") for u in _SMALL]


def _mac(psk: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(psk, label + b"".join(parts), hashlib.sha256).digest()


def hello(psk: bytes, public: bytes, stamp_ns: int | None = None, offered: int = 0b110) -> list[bytes]:
    """A HELLO made with the job's key around `public` (offered: a bit per cipher ID)."""
    head = channel.ENVELOPE.pack(channel.MAGIC, channel.VERSION, channel.HELLO, 1, 0, 0, 0, 0, 0)
    stamp = time.time_ns() if stamp_ns is None else stamp_ns
    signed = public + stamp.to_bytes(8, "little", signed=True) + bytes([offered])
    return [head, signed + _mac(psk, b"hello", head, signed)]


def welcome(psk: bytes, hello_message: list[bytes], public: bytes, cipher_id: int) -> list[bytes]:
    """A WELCOME made with the job's key for `hello_message`, around `public`, choosing `cipher_id`."""
    head = channel.ENVELOPE.pack(channel.MAGIC, channel.VERSION, channel.WELCOME, 1, 0, 0, 0, 0, 0)
    signed = public + bytes([cipher_id])
    return [head, signed + _mac(psk, b"welcome", b"".join(hello_message), head, signed)]


def without_aeg(where: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes `import aeg` fail as on a machine without the
    package (and leaves a line in `where`/aeg-imports.log each time something tries)."""
    shadow = where / "no-aeg"
    (shadow / "aeg").mkdir(parents=True, exist_ok=True)
    (shadow / "aeg" / "__init__.py").write_text(
        "import os, sys\n"
        f"with open({str(where / 'aeg-imports.log')!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()} {sys.argv}\\n')\n"
        "raise ImportError('No module named aeg (hidden by tests/handshakes.py)')\n")
    return shadow
