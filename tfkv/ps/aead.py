"""The data plane's cipher: AEGIS-128L (libsodium, through PyNaCl), sealing and opening in place.

Why AEGIS-128L and not AES-256-GCM: both run on the CPU's AES instructions, but on the machines we
measured AEGIS-128L (an AES-round-based AEAD, CAESAR's pick for high performance, IETF CFRG
draft-irtf-cfrg-aegis-aead) seals a 1 MiB frame at ~16.8 GB/s where OpenSSL's AES-256-GCM
(`cryptography` 48) reaches ~10 and libsodium's own AES-256-GCM ~3.5; and libsodium's call
releases the GIL (cffi), where `cryptography`'s AEAD holds it, so the other threads of a worker
(the scheduler link, pyzmq's garbage collector) run meanwhile and two threads seal at ~31 GB/s.
128-bit key, 128-bit nonce, 256-bit tag.

Why `nacl._sodium`: PyNaCl's public functions (`nacl.bindings.crypto_aead_aegis128l_encrypt`)
take and return `bytes`, i.e. two copies of every payload, which cost more than the cipher. The
same libsodium functions are called here through PyNaCl's cffi module with buffers (numpy arrays,
received ZeroMQ frames) passed as they are. `nacl.bindings` is imported first: it runs
`sodium_init()`, which picks the AES-NI implementation (without it libsodium's portable code
runs at 0.05 GB/s; `tests/ps/test_channel.py` checks the speed class).
"""

from __future__ import annotations

from typing import Any

import nacl.bindings  # noqa: F401 - sodium_init(): libsodium picks its AES-NI code (see the docstring)
from nacl._sodium import ffi, lib

from tfkv.errors import TfkvError

KEY = 16  # bytes
NONCE = 16
TAG = 32  # bytes a sealed part is longer than its plaintext


class InvalidTag(TfkvError, ValueError):
    """A part failed authentication: tampered, truncated, or sealed under another key or nonce."""


class Aead:
    """One direction's key: `seal_into` and `open_into` work on any buffers (their bytes), none
    copied; sizes and the nonce's length are checked, since libsodium only gets pointers."""

    def __init__(self, key: bytes):
        if len(key) != KEY:
            raise ValueError(f"an AEGIS-128L key is {KEY} bytes, not {len(key)}")
        self._key = bytes(key)

    def seal_into(self, nonce: bytes, data: Any, aad: Any, out: Any) -> None:
        """`out` (writable, at least data's bytes + TAG) gets `data` sealed under `nonce` with `aad`."""
        data, aad, out = ffi.from_buffer(data), ffi.from_buffer(aad), ffi.from_buffer(out, require_writable=True)
        _check(nonce, len(out) >= len(data) + TAG, "the sealed part's buffer is too small")  # libsodium writes blind
        lib.crypto_aead_aegis128l_encrypt(out, ffi.NULL, data, len(data), aad, len(aad), ffi.NULL, nonce, self._key)

    def open_into(self, nonce: bytes, sealed: Any, aad: Any, out: Any) -> None:
        """`out` (writable, at least sealed's bytes - TAG; may be `sealed` itself: libsodium opens in
        place) gets the plaintext; InvalidTag if the part does not authenticate."""
        sealed, aad, out = ffi.from_buffer(sealed), ffi.from_buffer(aad), ffi.from_buffer(out, require_writable=True)
        if len(sealed) < TAG:
            raise InvalidTag("a part shorter than its tag")
        _check(nonce, len(out) >= len(sealed) - TAG, "the plaintext's buffer is too small")
        if lib.crypto_aead_aegis128l_decrypt(out, ffi.NULL, ffi.NULL, sealed, len(sealed), aad, len(aad), nonce,
                                             self._key) != 0:
            raise InvalidTag("a part failed authentication")


def _check(nonce: bytes, fits: bool, what: str) -> None:
    # cffi passes pointers: a short nonce or buffer would be read or written past its end.
    if not fits:
        raise ValueError(what)
    if len(nonce) != NONCE:
        raise ValueError(f"a nonce is {NONCE} bytes, not {len(nonce)}")
