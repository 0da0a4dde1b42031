"""The data plane's encryption: an AEAD on every worker <-> server message, keys per connection.

CURVE (XSalsa20-Poly1305 in libsodium) runs at a small fraction of AEGIS-128X4's speed on a CPU
with the vector AES instructions (tfkv.ps.aead: libaegis through `aeg`, or AES-256-GCM through
`cryptography` where an end lacks `aeg`; no cipher by hand; the figures are in
benchmarks/results/design_figures.md), so a secure job's pushes and pulls travel on a plain ZeroMQ
socket, every message sealed here. The scheduler's control plane
(small messages) stays on CURVE (tfkv.ps.security). The handshake's primitives (X25519, HKDF,
HMAC) come from `cryptography`.

Keys: tfkv.ps.handshake (HELLO, WELCOME) gives each connection a `Session` of its own.

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

import logging
import struct
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from tfkv.errors import TfkvError
from tfkv.ps import aead
from tfkv.ps.aead import Cipher, InvalidTag
from tfkv.ps.protocol import FLAG_DATA, HEADER, MAGIC as _MAGIC, frames_of

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
# overlap below 1 MiB (smaller pieces cost more CPU per byte: design_figures.md in
# benchmarks/results). A piece is at most 1 MiB so that a sealed one (plus TAG) stays under
# protocol.MAX_FRAME, the cap of a socket strangers can reach.
PIECE = 1 << 20
# Whole frames (of at most PIECE bytes) travel together up to this many bytes: a 1 MiB PUSHPULL
# and its header are one message (each frame is still sealed on its own,
# so no frame on the wire passes the cap).
GROUP = 2 * PIECE
# A frame over PIECE bytes goes in runs of this many pieces per ZeroMQ message (each piece its own
# sealed frame under the cap): a 16 MiB weight in 4 messages, not 16, still pipelined.
RUN = 4
MAX_PIECE_FRAME = 1 << 30  # no frame announced larger than this is assembled (protocol frames are ~1 MiB)
class Refused(TfkvError, ValueError):
    """A message this channel does not accept; the text says why (for the log and the counts)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}{': ' + detail if detail else ''}")
        self.reason = reason  # a short name to count by: "not tfkv", "bad tag", "replay", ...


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
        count = frames_of(flags)  # the payload, if any, is the message's last frame
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
        # fresh zeroed mapping per piece cost more than the cipher.
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
