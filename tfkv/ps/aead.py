"""The data plane's cipher: AEGIS-128X4 (libaegis, through the `aeg` package), sealing and opening in place.

Why AEGIS-128X4: it is the AEGIS-128L construction run on four AES lanes side by side
(IETF CFRG draft-irtf-cfrg-aegis-aead, the "X4" member of the family; CAESAR picked AEGIS-128L
for high performance), so a CPU with vector AES instructions (VAES, AVX-512 or AVX2) seals four
blocks per instruction. On the machine we measured it seals a 1 MiB frame at ~33-36 GB/s and
opens it at ~32, where AEGIS-128L (libsodium) reached ~15-17 and OpenSSL's AES-256-GCM
(`cryptography` 48) ~10: about what copying the frame once costs (memcpy of 1 MiB in cache ~40
GB/s there; above the caches both run at memory speed, ~17-20 GB/s).
On a CPU with only AES-NI, libaegis runs the four lanes on 128-bit instructions (not measured
here). libaegis picks its implementation from the CPU's flags when `aeg` is imported.
128-bit key, 128-bit nonce, 256-bit tag.

`aeg`'s calls go through cffi, which releases the GIL, so the other threads of a worker (the
scheduler link, pyzmq's garbage collector) run while a frame is sealed; buffers (numpy arrays,
received ZeroMQ frames) are passed as they are, none copied, and `aeg` checks their sizes
before libaegis gets the pointers.
"""

from __future__ import annotations

from typing import Any

from aeg import aegis128x4 as _cipher

from tfkv.errors import TfkvError

NAME = _cipher.NAME  # "AEGIS-128X4"
KEY = _cipher.KEYBYTES  # 16 bytes
NONCE = _cipher.NONCEBYTES  # 16
TAG = _cipher.MACBYTES_LONG  # 32 bytes a sealed part is longer than its plaintext


class InvalidTag(TfkvError, ValueError):
    """A part failed authentication: tampered, truncated, or sealed under another key or nonce."""


class Aead:
    """One direction's key: `seal_into` and `open_into` work on any buffers (their bytes), none
    copied; a buffer too small or a nonce of another length is a ValueError before libaegis runs."""

    def __init__(self, key: bytes):
        if len(key) != KEY:
            raise ValueError(f"an {NAME} key is {KEY} bytes, not {len(key)}")
        self._key = bytes(key)

    def seal_into(self, nonce: bytes, data: Any, aad: Any, out: Any) -> None:
        """`out` (writable, at least data's bytes + TAG) gets `data` sealed under `nonce` with `aad`."""
        out = _writable(out)
        try:
            _cipher.encrypt(self._key, nonce, data, aad, maclen=TAG, into=out)
        except TypeError as e:  # aeg's word for a size it refused: nothing was written
            raise ValueError(_sizes(nonce, f"the sealed part's buffer is too small ({e})")) from None

    def open_into(self, nonce: bytes, sealed: Any, aad: Any, out: Any) -> None:
        """`out` (writable, at least sealed's bytes - TAG; may be `sealed` itself: libaegis opens in
        place) gets the plaintext; InvalidTag if the part does not authenticate (`out` is then
        zeroed by libaegis, never left holding unauthenticated plaintext)."""
        if memoryview(sealed).nbytes < TAG:
            raise InvalidTag("a part shorter than its tag")
        out = _writable(out)
        try:
            _cipher.decrypt(self._key, nonce, sealed, aad, maclen=TAG, into=out)
        except TypeError as e:
            raise ValueError(_sizes(nonce, f"the plaintext's buffer is too small ({e})")) from None
        except ValueError:  # aeg: "authentication failed"
            raise InvalidTag("a part failed authentication") from None


def _writable(out: Any) -> memoryview:
    # cffi hands libaegis a pointer whether or not the buffer may be written: refuse a read-only one here.
    view = memoryview(out)
    if view.readonly:
        raise ValueError("the output buffer is read-only")
    return view


def _sizes(nonce: bytes, otherwise: str) -> str:
    return f"a nonce is {NONCE} bytes, not {len(nonce)}" if len(nonce) != NONCE else otherwise
