"""The data plane's ciphers, sealing and opening in place: AEGIS-128X4 (libaegis, through the
optional `aeg` package) where both ends of a connection have it, else AES-256-GCM (OpenSSL,
through `cryptography`, which every node has). The handshake (tfkv.ps.channel) picks one.

Why AEGIS-128X4 first: it is the AEGIS-128L construction run on four AES lanes side by side
(IETF CFRG draft-irtf-cfrg-aegis-aead, the "X4" member of the family; CAESAR picked AEGIS-128L
for high performance), so a CPU with vector AES instructions (VAES, AVX-512 or AVX2) seals four
blocks per instruction: about what copying the frame once costs, twice AEGIS-128L's speed and
three times AES-256-GCM's where we measured (benchmarks/results/design_figures.md). On a CPU with
only AES-NI, libaegis runs the four lanes on 128-bit instructions (not measured here).

Why AES-256-GCM as the other: `aeg` has wheels for Linux x86_64, macOS arm64 and Windows only
(elsewhere pip builds it with the Zig compiler), while `cryptography` has wheels everywhere and
OpenSSL runs GCM on the AES and carry-less multiply instructions of x86 (AES-NI, PCLMULQDQ) and
ARMv8 alike. `aeg` is imported only when a secure connection's handshake asks what this node has
(`available`): a plain job, or a node without it, never loads it.

A cipher's calls get buffers (numpy arrays, received ZeroMQ frames) as they are, none copied:
`aeg` through cffi (which releases the GIL), `cryptography` through its `*_into` calls.
"""

from __future__ import annotations

import functools
from typing import Any

from cryptography.exceptions import InvalidTag as _GcmInvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tfkv.errors import TfkvError


class InvalidTag(TfkvError, ValueError):
    """A part failed authentication: tampered, truncated, or sealed under another key or nonce."""


class Cipher:
    """One direction's key of one of the data plane's ciphers: `seal_into` and `open_into` work on
    any buffers (their bytes), none copied; a buffer of the wrong size or a nonce of another
    length is a ValueError before the cipher runs. ID is the cipher's bit in the handshake."""

    ID: int
    NAME: str
    KEY: int  # bytes
    NONCE: int  # bytes
    TAG: int  # bytes a sealed part is longer than its plaintext

    def __init__(self, key: bytes):
        if len(key) != self.KEY:
            raise ValueError(f"an {self.NAME} key is {self.KEY} bytes, not {len(key)}")

    def seal_into(self, nonce: bytes, data: Any, aad: Any, out: Any) -> None:
        """`out` (writable, data's bytes + TAG) gets `data` sealed under `nonce` with `aad`."""
        raise NotImplementedError

    def open_into(self, nonce: bytes, sealed: Any, aad: Any, out: Any) -> None:
        """`out` (writable, sealed's bytes - TAG; may be `sealed` itself, opened in place) gets the
        plaintext; InvalidTag if the part does not authenticate (`out` is then zeroed, never left
        holding unauthenticated plaintext)."""
        raise NotImplementedError

    def _sizes(self, nonce: bytes, otherwise: str) -> str:
        return f"a nonce is {self.NONCE} bytes, not {len(nonce)}" if len(nonce) != self.NONCE else otherwise


class Aegis128X4(Cipher):
    """AEGIS-128X4 from libaegis (`aeg`): 128-bit key, 128-bit nonce, 256-bit tag."""

    ID, NAME, KEY, NONCE, TAG = 1, "AEGIS-128X4", 16, 16, 32

    def __init__(self, key: bytes):
        super().__init__(key)
        self._key = bytes(key)
        self._aegis = _aegis()

    def seal_into(self, nonce: bytes, data: Any, aad: Any, out: Any) -> None:
        out = _writable(out)
        try:
            self._aegis.encrypt(self._key, nonce, data, aad, maclen=self.TAG, into=out)
        except TypeError as e:  # aeg's word for a size it refused: nothing was written
            raise ValueError(self._sizes(nonce, f"the sealed part's buffer is too small ({e})")) from None

    def open_into(self, nonce: bytes, sealed: Any, aad: Any, out: Any) -> None:
        if memoryview(sealed).nbytes < self.TAG:
            raise InvalidTag("a part shorter than its tag")
        out = _writable(out)
        try:
            self._aegis.decrypt(self._key, nonce, sealed, aad, maclen=self.TAG, into=out)
        except TypeError as e:
            raise ValueError(self._sizes(nonce, f"the plaintext's buffer is too small ({e})")) from None
        except ValueError:  # aeg: "authentication failed" (libaegis zeroed what it opened)
            raise InvalidTag("a part failed authentication") from None


class AesGcm256(Cipher):
    """AES-256-GCM from OpenSSL (`cryptography`): 256-bit key, 96-bit nonce, 128-bit tag."""

    ID, NAME, KEY, NONCE, TAG = 2, "AES-256-GCM", 32, 12, 16

    def __init__(self, key: bytes):
        super().__init__(key)
        self._gcm = AESGCM(bytes(key))

    def seal_into(self, nonce: bytes, data: Any, aad: Any, out: Any) -> None:
        out, data = _writable(out), memoryview(data).cast("B")  # cryptography takes bytes, not floats
        if out.nbytes != data.nbytes + self.TAG or len(nonce) != self.NONCE:
            raise ValueError(self._sizes(nonce, f"the sealed part's buffer is {out.nbytes} bytes, not "
                                                f"{data.nbytes + self.TAG}"))
        self._gcm.encrypt_into(nonce, data, aad, out)

    def open_into(self, nonce: bytes, sealed: Any, aad: Any, out: Any) -> None:
        size = memoryview(sealed).nbytes - self.TAG
        if size < 0:
            raise InvalidTag("a part shorter than its tag")
        out = _writable(out)
        if out.nbytes != size or len(nonce) != self.NONCE:
            raise ValueError(self._sizes(nonce, f"the plaintext's buffer is {out.nbytes} bytes, not {size}"))
        try:
            self._gcm.decrypt_into(nonce, sealed, aad, out)
        except _GcmInvalidTag:
            # OpenSSL has written the plaintext before it checked the tag: clear it.
            out[:] = bytes(size)
            raise InvalidTag("a part failed authentication") from None


def _aegis() -> Any:
    from aeg import aegis128x4  # optional (tfkv[aegis]): see `available`

    return aegis128x4


@functools.cache
def available() -> tuple[type[Cipher], ...]:
    """The ciphers this process can use, best first: AEGIS-128X4 when `aeg` imports, and
    AES-256-GCM always. Asked by the first secure handshake, so a plain job never imports `aeg`."""
    try:
        _aegis()
    except (ImportError, OSError):  # not installed, or its library does not load here
        return (AesGcm256,)
    return (Aegis128X4, AesGcm256)


CIPHERS = {c.ID: c for c in (Aegis128X4, AesGcm256)}  # every cipher a peer may name, by handshake bit
MAX_TAG = max(c.TAG for c in CIPHERS.values())


def _writable(out: Any) -> memoryview:
    # A C library gets a pointer whether or not the buffer may be written: refuse a read-only one here.
    view = memoryview(out)
    if view.readonly:
        raise ValueError("the output buffer is read-only")
    return view.cast("B")
