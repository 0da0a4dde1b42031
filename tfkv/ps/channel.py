"""The data plane's encryption: an AEAD on every worker <-> server message, keys per connection.

CURVE (XSalsa20-Poly1305 in libsodium) runs at ~0.6 GB/s on a CPU where AEGIS-128X4 runs at ~33
GB/s with the vector AES instructions (tfkv.ps.aead: libaegis through `aeg`, or AES-256-GCM
through `cryptography` where an end lacks `aeg`; no cipher by hand), so a secure job's pushes and
pulls travel on a plain ZeroMQ socket, every message sealed here. The scheduler's control plane
(small messages) stays on CURVE (tfkv.ps.security). The handshake's primitives (X25519, HKDF,
HMAC) come from `cryptography`.

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

Messages. A protocol message travels as one or more ZeroMQ messages (`Session.seal`): frame 0
an ENVELOPE (magic, version, kind, frame count, which frame, its size, offset, the protocol
message's first counter, this message's counter), then sealed parts: whole frames of up to PIECE
bytes together (up to GROUP bytes), or a run of up to RUN pieces of a larger frame, so that the
receiver opens one run while the sender seals the next. A received part is opened in place,
into the ZeroMQ buffer it arrived in. Each part is sealed with nonce = salt + 8-byte counter and the
envelope as associated data; the counter only grows, by one per part, so no nonce repeats under
a key. The receiver refuses a counter it accepted before or one older than WINDOW behind the
newest (a replay, or a message held back too long), a tampered or truncated part (the tag), a
piece out of order or of another message, parts moved between messages or connections (other
nonce, other key). Nothing is parsed before every tag of a message verifies.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tfkv.errors import TfkvError
from tfkv.ps import aead
from tfkv.ps.aead import Cipher, InvalidTag
from tfkv.ps.protocol import FLAG_DATA, FLAG_META, HEADER, MAGIC as _MAGIC

log = logging.getLogger("tfkv.ps")

_PROTOCOL_MAGIC = HEADER.pack(_MAGIC, *[0] * 8)[:2]  # how a bare protocol header begins

MAGIC = b"TE"
VERSION = 4  # 4: fresh HELLOs, the cipher negotiated (3: AEGIS-128X4 only, 2: AEGIS-128L, 1: AES-256-GCM)
ENVELOPE = struct.Struct("<2sBBIIQQQQ")  # magic version kind nframes frame size offset first counter
HELLO, WELCOME, DATA = 1, 2, 3
TAG = aead.MAX_TAG  # the most bytes a cipher adds to a sealed part
WINDOW = 1 << 14  # counters (pieces) this far behind the newest may still arrive: a message held back
# A protocol frame travels in pieces of at most this many bytes, each its own ZeroMQ message, so
# that the receiver opens one while the sender seals the next. Each ZeroMQ message costs thread
# wakeups (the app's, libzmq's I/O thread's, pyzmq's garbage collector's) that outweigh the
# overlap: 1 MiB push+pull secure on 2 cores took 1.2 ms of CPU per process per iteration in
# pieces of 256 KiB, 0.74 ms whole (64 KiB: 2.2 ms). A piece is at most 1 MiB so that a sealed
# one (plus TAG) stays under protocol.MAX_FRAME, the cap of a socket strangers can reach.
PIECE = 1 << 20
# Whole frames (of at most PIECE bytes) travel together up to this many bytes: a 1 MiB PUSHPULL
# and its header are one message (each frame is still sealed on its own,
# so no frame on the wire passes the cap).
GROUP = 2 * PIECE
# A frame over PIECE bytes goes in runs of this many pieces per ZeroMQ message (each piece its own
# sealed frame under the cap): a 16 MiB weight in 4 messages, not 16, still pipelined.
RUN = 4
MAX_PIECE_FRAME = 1 << 30  # no frame announced larger than this is assembled (protocol frames are ~1 MiB)
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


def envelope(frames: Sequence[Any]) -> tuple[int, ...]:
    """(kind, nframes, frame, size, offset, first, counter) of a received message; Refused if it
    is not one of ours: frame 0 an envelope, then exactly one sealed piece."""
    if not frames:
        raise Refused("not tfkv", "empty message")
    head = memoryview(frames[0])
    if bytes(head[:2]) == _PROTOCOL_MAGIC:
        raise Refused("not tfkv", "a tfkv message without the channel's envelope: a peer of an older tfkv "
                                  "or one started with TFKV_SECURE=0")
    if len(head) != ENVELOPE.size or bytes(head[:2]) != MAGIC:
        raise Refused("not tfkv", "not a message of tfkv's data plane (plain TCP or another program)")
    magic, version, *fields = ENVELOPE.unpack(head)
    if version != VERSION:
        raise Refused("not tfkv", f"envelope version {version}, this node speaks {VERSION}")
    if fields[0] not in (HELLO, WELCOME, DATA) or len(frames) < 2 or (fields[0] != DATA and len(frames) != 2):
        raise Refused("malformed", f"kind {fields[0]} in {len(frames)} frames")
    return tuple(fields)


# Where a payload's plaintext goes: (its message's opened header, the frame's index, its size) ->
# a writable buffer of bytes of exactly that size, or None for the channel's own (Session.open).
Into = Callable[[memoryview, int, int], Any]


class _Partial:
    """A protocol message whose pieces are arriving: where the next one must go."""

    def __init__(self, nframes: int, first: int):
        self.frames: list[np.ndarray] = []
        self.nframes, self.first, self.next = nframes, first, first
        self.frame, self.offset = 0, 0  # where the next piece belongs
        # The protocol messages the frames make (read from each header's flags as protocol.split
        # reads them): where the next header is, and the current one's payload frame, if any.
        self.head_at, self.head, self.payload_at = 0, None, -1

    def opened(self, frame: int, plain: Any) -> None:
        """Frame `frame` is open: if it is a protocol header, note where its message's payload is."""
        if frame != self.head_at:
            return
        flags = plain[4] if len(plain) == HEADER.size else 0  # a bad header: decode refuses the message
        count = 1 + bool(flags & FLAG_META) + bool(flags & FLAG_DATA)
        self.head, self.head_at = plain, frame + count
        self.payload_at = frame + count - 1 if flags & FLAG_DATA else -1


class Session:
    """One connection's keys and counters, once the handshake is over."""

    def __init__(self, cipher: type[Cipher], send_key: bytes, send_salt: bytes, recv_key: bytes, recv_salt: bytes):
        self.cipher = cipher
        self._tag = cipher.TAG
        self._send, self._send_salt = cipher(send_key), send_salt
        self._recv, self._recv_salt = cipher(recv_key), recv_salt
        self._counter = 0  # the next counter this side seals with
        self._newest = -1  # the newest counter accepted
        self._recent: set[int] = set()  # counters accepted within WINDOW of the newest
        self._partial: _Partial | None = None
        self.established = False  # a DATA message was accepted (the handshake cannot restart)

    def seal(self, frames: Sequence[Any]) -> Iterator[list[Any]]:
        """The ZeroMQ messages that carry a protocol message, each sealed as it is asked for: send
        each at once, so the peer opens a piece while this side seals the next (the two processes'
        cores work side by side instead of taking turns). Frames of up to
        PIECE bytes travel together in one message (up to GROUP bytes); a larger frame in pieces of
        its own."""
        first = self._counter
        group: list[memoryview] = []  # whole frames waiting to go together
        start = grouped = 0  # the group's first frame, its bytes
        for f, frame in enumerate(frames):
            data = memoryview(frame).cast("B")
            # A group goes before a frame that would take it past GROUP, and before any frame in
            # pieces (the receiver takes frames in order).
            if group and (grouped + len(data) > GROUP or len(data) > PIECE):
                yield self._sealed(len(frames), start, len(group[0]), 0, first, group)
                group, grouped = [], 0
            if len(data) <= PIECE:
                if not group:
                    start = f
                group.append(data)
                grouped += len(data)
                continue
            for run in range(0, len(data), RUN * PIECE):
                yield self._sealed(len(frames), f, len(data), run, first,
                                   [data[o:o + PIECE] for o in range(run, min(run + RUN * PIECE, len(data)), PIECE)])
        if group:
            yield self._sealed(len(frames), start, len(group[0]), 0, first, group)

    def _sealed(self, nframes: int, frame: int, size: int, offset: int, first: int,
                parts: list[memoryview]) -> list[Any]:
        counter = self._counter
        self._counter += len(parts)  # one nonce per part
        head = ENVELOPE.pack(MAGIC, VERSION, DATA, nframes, frame, size, offset, first, counter)
        # numpy's empty, not bytearray: a piece is over glibc's mmap threshold, and bytearray's
        # fresh zeroed mapping per piece cost 4x the cipher (0.47 against 0.11 ms per MiB).
        out: list[Any] = [head]
        for i, part in enumerate(parts):
            sealed = np.empty(len(part) + self._tag, np.uint8)
            self._send.seal_into(self._send_salt + (counter + i).to_bytes(8, "little"), part, head, sealed)
            out.append(sealed)
        return out

    def open(self, frames: Sequence[Any], into: Into | None = None) -> list[np.ndarray] | None:
        """One received ZeroMQ message (whole frames, or a run of pieces of a larger one): the
        protocol frames once their message is whole, None until then; Refused (and the message it
        belonged to dropped) if it fails any check.

        `into(head, frame, size)`, asked once for each frame that is a protocol message's payload
        as it begins to arrive, with that message's header (`head`, already opened; which frames
        are headers and payloads is read from the headers' flags as protocol.split reads them),
        may name where the payload's plaintext goes: a writable buffer of bytes of exactly `size`
        (a worker's pull lands in its destination array, saving the copy from a received buffer
        into it). A part that fails authentication leaves that buffer zeroed (tfkv.ps.aead clears
        what it opened)."""
        kind, nframes, f, size, offset, first, counter = envelope(frames)
        if kind != DATA:
            raise Refused("malformed", f"a handshake message (kind {kind}) on an open connection")
        if counter <= self._newest - WINDOW or counter in self._recent:
            raise Refused("replay", f"counter {counter} was accepted before or is too old")
        parts = [memoryview(p) for p in frames[1:]]
        part = self._partial
        if first == counter:  # a message begins (one left unfinished was lost on the way)
            part = _Partial(nframes, first)
        self._partial = None  # until these parts are in place
        if part is None or (first, counter, nframes, f, offset) != (part.first, part.next, part.nframes,
                                                                     part.frame, part.offset):
            raise Refused("out of order", f"piece {counter} of the message from {first} is not the one expected")
        sizes = [len(p) - self._tag for p in parts]
        pieces = size > PIECE  # a run of pieces of frame f; else whole frames from f on
        end = offset + sum(sizes)
        if (min(sizes) < 0 or f >= nframes or size > MAX_PIECE_FRAME
                or (pieces and (offset % PIECE or end > size or any(n != PIECE for n in sizes[:-1])
                                or (sizes[-1] != PIECE and end != size) or not sizes[-1]))
                or (not pieces and (offset or sizes[0] != size or f + len(parts) > nframes
                                    or max(sizes) > PIECE))):
            raise Refused("malformed", f"{len(parts)} part(s) at {offset} of frame {f} ({size} bytes, "
                                       f"{nframes} frames)")
        aad = memoryview(frames[0])
        if pieces and offset == 0:
            part.frames.append(self._destination(into, part, f, size) or np.empty(size, np.uint8))
        for i, sealed in enumerate(parts):
            if pieces:
                at = offset + i * PIECE
                out = memoryview(part.frames[f])[at:at + sizes[i]]
            else:
                # Opened in place when the received frame is writable (a zmq.Frame): the payload
                # then views the received buffer, as on a plain socket, with no allocation and
                # half the memory touched. Both ciphers open in place; the tag is checked
                # over what they read, so a bad tag still raises (tests/ps/test_channel).
                out = self._destination(into, part, f + i, sizes[i]) or (
                    sealed[:sizes[i]] if not sealed.readonly else memoryview(np.empty(sizes[i], np.uint8)))
                part.frames.append(out)
            try:
                self._recv.open_into(self._recv_salt + (counter + i).to_bytes(8, "little"), sealed, aad, out)
            except InvalidTag:
                raise Refused("bad tag", f"part {i + 1} of piece {counter - first} of a message fails "
                                         "authentication") from None
            if not pieces:
                part.opened(f + i, out)
        self._accepted(counter)
        part.next = counter + len(parts)
        if not pieces:
            part.frame, part.offset = f + len(parts), 0
        elif end < size:
            part.offset = end
        else:
            part.frame, part.offset = f + 1, 0
        if part.frame < nframes:
            self._partial = part
            return None
        self.established = True
        return part.frames

    @staticmethod
    def _destination(into: Into | None, part: _Partial, frame: int, size: int) -> memoryview | None:
        if into is None or frame != part.payload_at:
            return None
        dest = into(part.head, frame, size)
        if dest is None:
            return None
        view = memoryview(dest)
        if view.nbytes != size or view.readonly or view.format != "B":
            raise ValueError(f"into() gave {view.nbytes} bytes{' read-only' if view.readonly else ''} "
                             f"({view.format!r}) for a frame of {size}")
        return view

    def _accepted(self, counter: int) -> None:
        self._recent.add(counter)
        if counter > self._newest:
            self._newest = counter
            if len(self._recent) > 2 * WINDOW:  # forget what fell out of the window (amortised)
                self._recent = {c for c in self._recent if c > self._newest - WINDOW}


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
    """A worker's side of the handshake for one connection (resend `message` until welcomed; a
    new Hello once this one is `stale`)."""

    def __init__(self, psk_: bytes):
        self._psk = psk_
        self._private = X25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()
        self._ciphers = aead.available()
        self.made = time.monotonic()
        head = ENVELOPE.pack(MAGIC, VERSION, HELLO, 1, 0, 0, 0, 0, 0)
        signed = self.public + _STAMP.pack(time.time_ns()) + bytes([_offer(self._ciphers)])
        self.message = [head, signed + _mac(psk_, b"hello", head, signed)]

    def stale(self) -> bool:
        """Whether a server may soon find this HELLO too old (FRESH): send a new one instead."""
        return time.monotonic() - self.made > FRESH / 2

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


class Acceptor:
    """A server's side of the handshakes on its socket: which HELLOs get a WELCOME, and each
    connection's (ROUTER identity's) session.

    A HELLO gets an answer only if it is made with the job's key, within FRESH seconds of this
    server's clock, and never welcomed before (on any connection): its X25519 key is remembered
    while its time is fresh (at most MAX_SEEN of them; past that the oldest is forgotten and no
    HELLO made before it is taken). So a HELLO seen on the network and sent again gets nothing
    and costs no session, as WireGuard's initiation timestamps do. A HELLO sent again on its own
    connection (its WELCOME was lost) gets the same WELCOME again. At most MAX_PENDING
    connections are welcomed and not yet established; past that the oldest is forgotten."""

    def __init__(self, psk_: bytes):
        self._psk = psk_
        self.sessions: dict[bytes, Session] = {}
        self._pending: OrderedDict[bytes, tuple[bytes, list[bytes]]] = OrderedDict()  # its HELLO, our WELCOME
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # X25519 key -> time, of HELLOs welcomed
        self._floor = 0  # no HELLO made at or before this time is taken (the cache forgot one so fresh)
        self._full = False  # MAX_PENDING was passed (logged once)

    def hello(self, identity: bytes, frames: Sequence[Any]) -> list[bytes]:
        """The WELCOME to send for a HELLO; Refused (and nothing kept) if it gets none."""
        head, body = _signed(frames, HELLO, _HELLO_SIGNED, "HELLO")
        pending = self._pending.get(identity)
        if pending is not None and pending[0] == body:  # resent: our WELCOME was lost
            return pending[1]
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
        self.sessions[identity] = Session(cipher, s_key, s_salt, w_key, w_salt)
        self._pending[identity] = (body, answer)
        self._pending.move_to_end(identity)
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
        """Session.open on this connection's session; Refused if it has none."""
        session = self.sessions.get(identity)
        if session is None:
            raise Refused("no session", "a message before any handshake")
        got = session.open(frames, into)
        if got is not None and self._pending:
            self._pending.pop(identity, None)  # established
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
