"""The data plane's handshake: how a worker and a server agree on one connection's `Session`
(tfkv.ps.channel), its cipher and its keys.

Keys. Every node of a job holds the job's keypair (tfkv.keys); from its secret comes a
pre-shared key `psk` (HKDF-SHA256). A worker opens each connection with HELLO: a fresh X25519
public key, the time it was made, the ciphers this worker has, and an HMAC of them under the psk.
The server (`Acceptor`) checks the HMAC, that the HELLO is fresh (made within FRESH seconds of
its own clock) and never seen before (a replay cache, as WireGuard's timestamps: a HELLO seen on
the network and sent again gets no answer and costs the server no session), and answers WELCOME:
its own fresh X25519 key, the cipher it chose (AEGIS-128X4 where both ends have it, else
AES-256-GCM), and an HMAC over the whole exchange. Both derive this connection's keys by HKDF over
the X25519 secret and the psk, salted with a hash of the exchange (so of the ciphers offered and
chosen: a man in the middle who strips AEGIS from a HELLO, or changes the choice, fails the HMAC
and would get other keys): one key and one nonce salt per direction. Who lacks the job's key
cannot make a HELLO a server accepts, nor read a WELCOME; recorded traffic stays unreadable if
the job's key leaks later (ephemeral X25519). An X25519 key of small order (whose shared secret
is all zeros) is a refused handshake, as a bad HMAC is.

Reconnects. A session belongs to the connection (the server's ROUTER identity) its HELLO came on,
and ZeroMQ reconnects a dropped TCP connection under a new identity. So a worker's handshake
(`Initiator`) ends only once the server answered a first sealed message (a PING) on it, and a
HELLO unanswered for RETRY seconds (its WELCOME, or the PING's answer, lost with its connection)
is followed by a fresh one: a new X25519 key and time, which the replay cache takes, as it takes
no HELLO twice. A server keeps a session per HELLO welcomed on a connection until the first
sealed message on it says which one the worker took.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tfkv.ps import aead
from tfkv.ps import protocol as P
from tfkv.ps.aead import Cipher
from tfkv.ps.channel import DATA, ENVELOPE, HELLO, MAGIC, VERSION, WELCOME, Into, Refused, Session, envelope, log

_PUBLIC = 32
_MAC = 32
_STAMP = struct.Struct("<q")  # a HELLO's time: nanoseconds since the epoch, by the worker's clock
# How far a HELLO's time may be from the server's clock: a HELLO older than this (or from further
# ahead) gets no answer, and the replay cache remembers HELLOs for this long. Nodes of a cluster
# keep their clocks within milliseconds (NTP); a worker makes a new HELLO before this passes.
FRESH = 120.0
# Connections welcomed that have not yet carried a message (a worker connects to every server,
# then may build its model for a while before its first request): the oldest is forgotten past
# this many, so no sender of HELLOs, even one holding the key, grows a server without bound.
MAX_PENDING = 4096
MAX_SEEN = 1 << 16  # HELLOs the replay cache remembers (32 bytes each): beyond, its floor rises
# A worker sends a fresh HELLO when the last one is this many seconds unanswered (no WELCOME, or
# no answer to the PING that follows it): a connection that dropped took its WELCOME or its PING
# along. The wait doubles up to RETRY_MAX, so a server slow to answer is not asked ever faster.
# A handshake takes milliseconds on an idle server; 2 s leaves a loaded one (CI) time.
RETRY, RETRY_MAX = 2.0, 8.0
MAX_HELLOS = 8  # HELLOs of one handshake (or welcomed on one connection) whose answers are still taken
CONFIRM_SEQ = 0  # the handshake's own PING (a link's requests are numbered from 1: tracker.seqs)


def psk(secret: bytes) -> bytes:
    """The job's pre-shared key for the data plane, from its CURVE secret key."""
    return HKDF(hashes.SHA256(), 32, salt=None, info=b"tfkv data plane v1 psk").derive(secret)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _offer(ciphers: Sequence[type[Cipher]]) -> int:
    """The byte that names a set of ciphers in a HELLO: one bit per cipher (its ID)."""
    return sum(1 << c.ID for c in ciphers)


def _shared(private: X25519PrivateKey, public: bytes) -> bytes:
    """The X25519 secret with a peer's public key; Refused for a key of small order (the all-zero
    key, u = 1, the points of order 8, and those plus p: the secret is then all zeros whatever our
    key, RFC 7748 section 6.1, and `cryptography` raises ValueError), as any handshake not made
    with the job's key."""
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:
        raise Refused("bad handshake", "an X25519 key of small order (its shared secret is all zeros)") from None


def _derive(cipher: type[Cipher], psk_: bytes, shared: bytes, transcript: bytes) -> tuple[bytes, ...]:
    """The connection's keys (worker->server key, salt; server->worker key, salt), bound to the
    whole handshake: both public keys, the HELLO's time, the ciphers offered and the one chosen."""
    k, n = cipher.KEY, cipher.NONCE - 8  # a nonce is the direction's salt and an 8-byte counter
    okm = HKDF(hashes.SHA256(), 2 * (k + n), salt=hashlib.sha256(transcript).digest(),
               info=b"tfkv data plane v4 keys " + cipher.NAME.encode()).derive(shared + psk_)
    return okm[:k], okm[k:k + n], okm[k + n:2 * k + n], okm[2 * k + n:]


_HELLO_SIGNED = _PUBLIC + _STAMP.size + 1  # public key, time, ciphers offered; then the HMAC
_WELCOME_SIGNED = _PUBLIC + 1  # public key, cipher chosen; then the HMAC


def _signed(frames: Sequence[Any], kind: int, size: int, what: str) -> tuple[bytes, bytes]:
    """A handshake message's envelope and the part of its body its HMAC covers; Refused if it
    is not a `kind` of the right size."""
    if envelope(frames)[0] != kind or len(frames[1]) != size + _MAC:
        raise Refused("malformed", f"expected a {what}")
    return bytes(frames[0]), bytes(frames[1])


class Hello:
    """One HELLO of a worker (sent once: a server takes no HELLO twice) and the session its WELCOME opens."""

    def __init__(self, psk_: bytes):
        self._psk = psk_
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        self._ciphers = aead.available()
        head = ENVELOPE.pack(MAGIC, VERSION, HELLO, 1, 0, 0, 0, 0, 0)
        signed = self.public + _STAMP.pack(time.time_ns()) + bytes([_offer(self._ciphers)])
        self.message = [head, signed + _mac(psk_, b"hello", head, signed)]

    def welcome(self, frames: Sequence[Any]) -> Session:
        """The session a WELCOME opens; Refused if it is not the answer to this HELLO."""
        head, body = _signed(frames, WELCOME, _WELCOME_SIGNED, "WELCOME")
        signed, mac = body[:-_MAC], body[-_MAC:]
        transcript = b"".join(self.message) + head + signed
        if not hmac.compare_digest(mac, _mac(self._psk, b"welcome", transcript)):
            raise Refused("bad handshake", "a WELCOME not made with the job's key for this HELLO")
        cipher = next((c for c in self._ciphers if c.ID == signed[_PUBLIC]), None)
        if cipher is None:  # only a member could sign it: a bug or a member gone wrong
            raise Refused("bad handshake", f"a WELCOME choosing cipher {signed[_PUBLIC]}, which this HELLO did not offer")
        shared = _shared(self._private, signed[:_PUBLIC])
        w_key, w_salt, s_key, s_salt = _derive(cipher, self._psk, shared, transcript)
        return Session(cipher, w_key, w_salt, s_key, s_salt)


def _first(candidates: list[Session], frames: Sequence[Any],
           into: Into | None = None) -> tuple[Session, list[np.ndarray] | None]:
    """A connection's first sealed message (or piece of one) opened by whichever of `candidates`
    (newest first) sealed it: that session, and what it opened. Refused (the newest's reason) if
    none did."""
    if len(candidates) > 1:  # a failed try clears what it opened in place: each tries a copy
        frames = [bytes(memoryview(f)) for f in frames]
    refused = None
    for session in reversed(candidates):
        try:
            return session, session.open(frames, into)
        except Refused as e:
            refused = refused or e
    assert refused is not None
    raise refused


class Initiator:
    """A worker's side of the handshake with one server, across reconnects: a fresh HELLO whenever
    the last one is RETRY seconds unanswered (`due`), each WELCOME to one of them answered with a
    sealed PING (sent again with the HELLO), and the session whose PING the server answers this
    connection's (`answer`).

    Why the PING: ZeroMQ reconnects a dropped connection under a new identity, for which the
    server holds no session. A WELCOME lost with its connection leaves the worker without one; a
    connection dropped just after its WELCOME leaves the worker one that the server holds for the
    old connection only. Either way nothing answers, and a fresh HELLO goes on the new connection.
    Nothing but the PING is sealed before the server answered it, so no request is lost."""

    def __init__(self, psk_: bytes, sender: int):
        self._psk, self._sender = psk_, sender
        self._hellos: list[Hello] = []  # sent, newest last
        self._welcomed: list[Session] = []  # their sessions whose PING is unanswered, newest last
        self.session: Session | None = None  # the connection's, once the server answered its PING
        self._due, self._wait = 0.0, RETRY

    def due(self, now: float) -> list[list[Any]]:
        """The messages to send now: none while the last HELLO is not RETRY (doubling) seconds
        unanswered; else a PING again under each session welcomed (the server may hold it and
        only the PING's answer was lost), and a fresh HELLO (the connection may be new)."""
        if self.session is not None or now < self._due:
            return []
        hello = Hello(self._psk)
        self._hellos = [*self._hellos[1 - MAX_HELLOS:], hello]
        self._due, self._wait = now + self._wait, min(2 * self._wait, RETRY_MAX)
        return [piece for session in self._welcomed for piece in self._ping(session)] + [hello.message]

    def _ping(self, session: Session) -> list[list[Any]]:
        return list(session.seal(P.encode(P.Message(P.Type.PING, sender=self._sender, seq=CONFIRM_SEQ))))

    def answer(self, frames: Sequence[Any]) -> list[list[Any]]:
        """Take a message from the server: a WELCOME to one of this side's HELLOs gives the
        messages to send (the PING sealed under its session); the answer to such a PING ends the
        handshake (`session`). Refused if it is neither."""
        kind = envelope(frames)[0]
        if kind == WELCOME:
            session = self._welcome(frames)
            self._welcomed = [*self._welcomed[1 - MAX_HELLOS:], session]
            return self._ping(session)
        if kind != DATA or not self._welcomed:
            raise Refused("malformed", "a HELLO sent to a worker" if kind == HELLO
                          else "a sealed message before any WELCOME")
        session, got = _first(self._welcomed, frames)
        self._welcomed = [session]  # its further pieces, if any
        if got is not None:
            self.session = session
        return []

    def _welcome(self, frames: Sequence[Any]) -> Session:
        """The session a WELCOME opens for one of this side's HELLOs (the newest first); Refused
        with the reason of the HELLO it was made for (its HMAC matched), else as not made for any."""
        refused = None
        for hello in reversed(self._hellos):
            try:
                return hello.welcome(frames)
            except Refused as e:
                if refused is None or "for this HELLO" in str(refused):
                    refused = e
        raise refused or Refused("bad handshake", "a WELCOME before any HELLO")


class Acceptor:
    """A server's side of the handshakes on its socket: which HELLOs get a WELCOME, and each
    connection's (ROUTER identity's) session.

    A HELLO gets an answer only if it is made with the job's key, within FRESH seconds of this
    server's clock, and never welcomed before (on any connection): its X25519 key is remembered
    while its time is fresh (at most MAX_SEEN of them; past that the oldest is forgotten and no
    HELLO made before it is taken). So a HELLO seen on the network and sent again gets nothing
    and costs no session, as WireGuard's initiation timestamps do; a worker whose WELCOME was
    lost sends a fresh HELLO (`Initiator`). Each HELLO welcomed on a connection that has carried
    no message yet keeps its session (up to MAX_HELLOS): the first message says which one the
    worker took, and that one is the connection's. At most MAX_PENDING connections are welcomed
    and not yet established; past that the oldest is forgotten."""

    def __init__(self, psk_: bytes):
        self._psk = psk_
        # Per connection: its session (before its first message: its newest HELLO's).
        self.sessions: dict[bytes, Session] = {}
        self._pending: OrderedDict[bytes, list[Session]] = OrderedDict()  # a session per HELLO welcomed, newest last
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # X25519 key -> time, of HELLOs welcomed
        self._floor = 0  # no HELLO made at or before this time is taken (the cache forgot one so fresh)
        self._full = False  # MAX_PENDING was passed (logged once)

    def hello(self, identity: bytes, frames: Sequence[Any]) -> list[bytes]:
        """The WELCOME to send for a HELLO; Refused (and nothing kept) if it gets none."""
        head, body = _signed(frames, HELLO, _HELLO_SIGNED, "HELLO")
        session = self.sessions.get(identity)
        if session is not None and session.established:
            raise Refused("malformed", "a HELLO on a connection already in use")
        signed, mac = body[:-_MAC], body[-_MAC:]
        if not hmac.compare_digest(mac, _mac(self._psk, b"hello", head, signed)):
            raise Refused("bad handshake", "a HELLO not made with the job's key")
        public, (stamp,), offered = signed[:_PUBLIC], _STAMP.unpack_from(signed, _PUBLIC), signed[-1]
        self._fresh(public, stamp)
        cipher = next((c for c in aead.available() if offered >> c.ID & 1), None)
        if cipher is None:
            raise Refused("bad handshake", f"a HELLO offering no cipher this server has (offered {offered:#x})")
        private = X25519PrivateKey.generate()
        shared = _shared(private, public)
        answer_head = ENVELOPE.pack(MAGIC, VERSION, WELCOME, 1, 0, 0, 0, 0, 0)
        answer_signed = private.public_key().public_bytes_raw() + bytes([cipher.ID])
        transcript = head + body + answer_head + answer_signed
        answer = [answer_head, answer_signed + _mac(self._psk, b"welcome", transcript)]
        w_key, w_salt, s_key, s_salt = _derive(cipher, self._psk, shared, transcript)
        self._remember(public, stamp)
        session = self.sessions[identity] = Session(cipher, s_key, s_salt, w_key, w_salt)
        welcomed = self._pending.pop(identity, [])
        self._pending[identity] = [*welcomed[1 - MAX_HELLOS:], session]
        if len(self._pending) > MAX_PENDING:
            self.forget(next(iter(self._pending)))
            if not self._full:
                self._full = True
                log.warning("more than %d connections were welcomed and sent nothing since: the oldest of them "
                            "are forgotten (a message on one is refused)", MAX_PENDING)
        return answer

    def forget(self, identity: bytes) -> None:
        """Keep nothing for a connection (its peer left before its WELCOME went, or it never spoke)."""
        self.sessions.pop(identity, None)
        self._pending.pop(identity, None)

    def open(self, identity: bytes, frames: Sequence[Any], into: Into | None = None) -> list[np.ndarray] | None:
        """Session.open on this connection's session (its first message: on the session of the
        HELLO that sealed it, which is the connection's from then on); Refused if it has none."""
        welcomed = self._pending.get(identity) if self._pending else None
        if welcomed is None:
            session = self.sessions.get(identity)
            if session is None:
                raise Refused("no session", "a message before any handshake")
            return session.open(frames, into)
        session, got = _first(welcomed, frames, into)
        self.sessions[identity] = session
        if got is None:
            welcomed[:] = [session]  # its further pieces
        else:
            del self._pending[identity]  # established
        return got

    def _fresh(self, public: bytes, stamp: int) -> None:
        off = (time.time_ns() - stamp) / 1e9
        if abs(off) > FRESH:
            raise Refused("stale", f"a HELLO made {off:.0f} s {'before' if off > 0 else 'after'} this server's "
                                   f"clock says: a replay, or clocks more than {FRESH:.0f} s apart (keep the "
                                   "nodes' clocks in step, e.g. with NTP)")
        if stamp <= self._floor or public in self._seen:
            raise Refused("replay", "a HELLO welcomed before")

    def _remember(self, public: bytes, stamp: int) -> None:
        horizon = time.time_ns() - int(FRESH * 1e9)
        seen = self._seen
        while seen and (len(seen) >= MAX_SEEN or next(iter(seen.values())) < horizon):
            _, old = seen.popitem(last=False)
            self._floor = max(self._floor, old)  # (an expired one is refused as stale anyway)
        seen[public] = stamp
