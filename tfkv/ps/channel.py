"""The data plane's encryption: AES-256-GCM on every worker <-> server message, keys per connection.

CURVE (XSalsa20-Poly1305 in libsodium) runs at ~0.6 GB/s on a CPU where AES-GCM through OpenSSL
runs at ~3.8 GB/s with the AES instructions, so a secure job's pushes and pulls travel on a plain
ZeroMQ socket, every message sealed here with the `cryptography` package's AESGCM (no cipher by
hand). The scheduler's control plane (small messages) stays on CURVE (tfkv.ps.security).

Keys. Every node of a job holds the job's keypair (tfkv.keys); from its secret comes a
pre-shared key `psk` (HKDF-SHA256). A worker opens each connection with HELLO: a fresh X25519
public key and an HMAC of it under the psk. The server checks the HMAC, answers WELCOME (its own
fresh X25519 key, HMAC over both), and both derive this connection's keys by HKDF over the
X25519 secret and the psk, salted with both public keys: one AES-256 key and one 4-byte nonce
salt per direction. Who lacks the job's key cannot make a HELLO a server accepts, nor read a
WELCOME; recorded traffic stays unreadable if the job's key leaks later (ephemeral X25519).

Messages. Frame 0 is an ENVELOPE (magic, version, kind, frame count, counter); each later frame is
one of the protocol's frames sealed with nonce = salt + (counter + i) and the envelope as
associated data. The sender's counter only grows, by one per frame, so no nonce repeats under
a key; the receiver refuses a counter it accepted before or one older than WINDOW behind the
newest (a replay, or a frame held back too long), a tampered or truncated message (the tag),
frames moved between messages or connections (other nonce, other key). Nothing is parsed
before every tag of a message verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tfkv.errors import TfkvError
from tfkv.ps.protocol import HEADER, MAGIC as _MAGIC

_PROTOCOL_MAGIC = HEADER.pack(_MAGIC, *[0] * 8)[:2]  # how a bare protocol header begins

MAGIC = b"TE"
VERSION = 1
ENVELOPE = struct.Struct("<2sBBIQ")  # magic version kind nframes counter
HELLO, WELCOME, DATA = 1, 2, 3
TAG = 16  # bytes AES-GCM adds to each frame
WINDOW = 1 << 14  # counters (frames) this far behind the newest may still arrive: a message held back
_PUBLIC = 32
_MAC = 32


class Refused(TfkvError, ValueError):
    """A message this channel does not accept; the text says why (for the log and the counts)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason  # a short name to count by: "not tfkv", "bad tag", "replay", ...


def psk(secret: bytes) -> bytes:
    """The job's pre-shared key for the data plane, from its CURVE secret key."""
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"tfkv data plane v1 psk").derive(secret)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def envelope(frames: Sequence[Any]) -> tuple[int, int, int]:
    """(kind, nframes, counter) of a received message; Refused if frame 0 is no envelope of ours."""
    if not frames:
        raise Refused("not tfkv", "empty message")
    head = _buffer(frames[0])
    if bytes(head[:2]) == _PROTOCOL_MAGIC:
        raise Refused("not tfkv", "a tfkv message without the channel's envelope: a peer of an older tfkv "
                                  "or one started with TFKV_SECURE=0")
    if len(head) != ENVELOPE.size or bytes(head[:2]) != MAGIC:
        raise Refused("not tfkv", "not a message of tfkv's data plane (plain TCP or another program)")
    magic, version, kind, nframes, counter = ENVELOPE.unpack(head)
    if version != VERSION:
        raise Refused("not tfkv", f"envelope version {version}, this node speaks {VERSION}")
    if kind not in (HELLO, WELCOME, DATA) or nframes != len(frames) - 1:
        raise Refused("malformed", f"kind {kind}, {nframes} frames announced, {len(frames) - 1} sent")
    return kind, nframes, counter


class Session:
    """One connection's keys and counters, once the handshake is over."""

    def __init__(self, send_key: bytes, send_salt: bytes, recv_key: bytes, recv_salt: bytes):
        self._send, self._send_salt = AESGCM(send_key), send_salt
        self._recv, self._recv_salt = AESGCM(recv_key), recv_salt
        self._counter = 0  # the next counter this side seals with
        self._newest = -1  # the newest counter accepted
        self._recent: set[int] = set()  # counters accepted within WINDOW of the newest
        self.established = False  # a DATA message was accepted (the handshake cannot restart)

    def seal(self, frames: Sequence[Any]) -> list[Any]:
        """The frames to send for a protocol message: envelope, then each frame sealed."""
        counter = self._counter
        self._counter += len(frames)
        head = ENVELOPE.pack(MAGIC, VERSION, DATA, len(frames), counter)
        out: list[Any] = [head]
        for i, frame in enumerate(frames):
            data = _buffer(frame)
            sealed = bytearray(len(data) + TAG)
            self._send.encrypt_into(self._send_salt + (counter + i).to_bytes(8, "little"), data, head, sealed)
            out.append(sealed)
        return out

    def open(self, frames: Sequence[Any]) -> list[bytearray]:
        """The protocol frames of a received DATA message, every tag verified; Refused otherwise."""
        kind, nframes, counter = envelope(frames)
        if kind != DATA:
            raise Refused("malformed", f"a handshake message (kind {kind}) on an open connection")
        if counter <= self._newest - WINDOW or counter in self._recent:
            raise Refused("replay", f"counter {counter} was accepted before or is too old")
        head = bytes(_buffer(frames[0]))
        out = []
        for i in range(nframes):
            data = _buffer(frames[1 + i])
            if len(data) < TAG:
                raise Refused("bad tag", f"frame {i + 1} is shorter than its tag")
            plain = bytearray(len(data) - TAG)
            try:
                self._recv.decrypt_into(self._recv_salt + (counter + i).to_bytes(8, "little"), data, head, plain)
            except InvalidTag:
                raise Refused("bad tag", f"frame {i + 1} of {nframes} fails authentication") from None
            out.append(plain)
        self._recent.add(counter)
        if counter > self._newest:
            self._newest = counter
            if len(self._recent) > 2 * WINDOW:  # forget what fell out of the window (amortised)
                self._recent = {c for c in self._recent if c > self._newest - WINDOW}
        self.established = True
        return out


def _derive(psk_: bytes, shared: bytes, worker_public: bytes, server_public: bytes) -> tuple[bytes, ...]:
    okm = HKDF(hashes.SHA256(), 72, salt=worker_public + server_public,
               info=b"tfkv data plane v1 keys").derive(shared + psk_)
    return okm[0:32], okm[32:36], okm[36:68], okm[68:72]  # worker->server key, salt; server->worker


class Hello:
    """A worker's side of the handshake for one connection (resend `message` until welcomed)."""

    def __init__(self, psk_: bytes):
        self._psk = psk_
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        head = ENVELOPE.pack(MAGIC, VERSION, HELLO, 1, 0)
        self.message = [head, self.public + _mac(psk_, b"hello", head, self.public)]

    def welcome(self, frames: Sequence[Any]) -> Session:
        """The session a WELCOME opens; Refused if it is not the answer to this HELLO."""
        kind, _, _ = envelope(frames)
        body = bytes(_buffer(frames[1]))
        if kind != WELCOME or len(body) != _PUBLIC + _MAC:
            raise Refused("malformed", "expected a WELCOME")
        server_public, mac = body[:_PUBLIC], body[_PUBLIC:]
        if not hmac.compare_digest(mac, _mac(self._psk, b"welcome", self.public, server_public)):
            raise Refused("bad handshake", "a WELCOME not made with the job's key for this HELLO")
        shared = self._private.exchange(X25519PublicKey.from_public_bytes(server_public))
        w_key, w_salt, s_key, s_salt = _derive(self._psk, shared, self.public, server_public)
        return Session(w_key, w_salt, s_key, s_salt)


def welcome(psk_: bytes, frames: Sequence[Any]) -> tuple[Session, list[bytes]]:
    """A server's answer to a HELLO: the connection's session and the WELCOME to send; Refused
    if the HELLO was not made with the job's key."""
    kind, _, _ = envelope(frames)
    body = bytes(_buffer(frames[1]))
    if kind != HELLO or len(body) != _PUBLIC + _MAC:
        raise Refused("malformed", "expected a HELLO")
    worker_public, mac = body[:_PUBLIC], body[_PUBLIC:]
    if not hmac.compare_digest(mac, _mac(psk_, b"hello", bytes(_buffer(frames[0])), worker_public)):
        raise Refused("bad handshake", "a HELLO not made with the job's key")
    private = X25519PrivateKey.generate()
    server_public = private.public_key().public_bytes_raw()
    shared = private.exchange(X25519PublicKey.from_public_bytes(worker_public))
    w_key, w_salt, s_key, s_salt = _derive(psk_, shared, worker_public, server_public)
    answer = [ENVELOPE.pack(MAGIC, VERSION, WELCOME, 1, 0),
              server_public + _mac(psk_, b"welcome", worker_public, server_public)]
    return Session(s_key, s_salt, w_key, w_salt), answer
