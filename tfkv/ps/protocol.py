"""The parameter server's wire format: ZeroMQ multipart messages with a fixed binary header.

    frame 0   header, 28 bytes, little-endian (HEADER below)
    frame 1   JSON object, only if FLAG_META is set (control messages; at most MAX_META bytes,
              FRAME_BYTES like a payload frame)
    frame 2+  payload, only if FLAG_DATA is set, cut into frames of FRAME_BYTES (the last one
              shorter; always at least one frame); sent from numpy buffers without copies, and
              received without copies when it fits one frame. dtype FLOAT32: `count` float32
              values (count*4 bytes); dtype TWOBIT: `count` values 2-bit compressed
              (tfkv.ps.compression), ceil(count/16) uint32 words, so a push of n gradients
              is 16x smaller on the wire

No frame is larger than MAX_FRAME, and every socket refuses larger ones (ZMQ_MAXMSGSIZE, set
by tfkv.ps.security): libzmq applies that cap per frame and also to the frames of a CURVE
handshake, so a peer that has not authenticated can make a node buffer at most MAX_FRAME
bytes, while a large chunk travels as several frames of one message.

Nothing received is unpickled or evaluated: the header is unpacked with `struct`, metadata is
parsed by `json` and checked against its message type's schema (`tfkv.ps.schema`), payloads
are viewed by `numpy.frombuffer`. Every field is checked; a message that does not fit raises
`ProtocolError` and the receiver answers with an error or drops it.
This module imports neither TensorFlow nor anything heavy.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tfkv.errors import TfkvError
from tfkv.ps import schema
from tfkv.ps.compression import words

MAGIC = 0x4B54  # "TK"
VERSION = 1
HEADER = struct.Struct("<HBBBBHIQQ")  # magic version type flags dtype sender seq key count
# What a node puts in one frame: 1 MiB, so that an array of 1 MiB (a 512 x 512 float32 weight)
# travels as one frame and is received without a copy on either side (at 1 MiB - 4 KiB it was
# two frames, joined by a copy on the server and again on the worker).
FRAME_BYTES = 1 << 20
# The largest frame a socket accepts (ZMQ_MAXMSGSIZE): FRAME_BYTES and room for what wraps a
# frame. CURVE's MESSAGE command adds about 40 bytes that libzmq counts against the cap (a frame
# of exactly the cap got its sender disconnected and the message lost in every secure job), the
# data plane's AES-GCM 16 (tfkv.ps.channel).
MAX_FRAME = FRAME_BYTES + 4096
MAX_META = FRAME_BYTES  # metadata is one frame: encode refuses more, decode too

FLAG_META = 1
FLAG_DATA = 2
FLAG_REPLY = 4
FLAG_ACK = 8  # the sender wants an ACK for a PUSH (under PS_RESEND); errors are always answered


class DType(enum.IntEnum):
    NONE = 0
    FLOAT32 = 1
    TWOBIT = 2  # 16 values per uint32 word; the receiver decodes with its compression threshold


class Type(enum.IntEnum):
    # node <-> scheduler
    REGISTER = 1  # meta: role, host, port, rank_hint, pid, hostname
    ADDRESS_BOOK = 2  # meta: id, role, rank, nodes
    HEARTBEAT = 3
    BARRIER = 4
    BARRIER_DONE = 5
    DONE = 6  # a worker finished cleanly
    SHUTDOWN = 7
    FAILED = 8  # meta: node, reason; every receiver exits non-zero
    # worker <-> server
    CONFIGURE = 20  # meta: sync
    SET_OPTIMIZER = 21  # meta: optimizer dict (tfkv.optim.to_dict)
    INIT = 22  # data: initial value of this server's part of `key`
    PUSH = 23  # data: gradient part
    PULL = 24  # reply data: value part
    GET_STATE = 25  # reply meta: names, count; data: the states, concatenated
    SET_STATE = 26
    PING = 27  # answered with ACK once every earlier request on the connection is applied
    SET_COMPRESSION = 28  # meta: {"type": "2bit", "threshold": t}, how TWOBIT pushes decode
    ACK = 30
    ERROR = 31  # meta: message


class ProtocolError(TfkvError, ValueError):
    """A message that is not valid tfkv protocol; the text says what is wrong."""


@dataclass
class Message:
    type: Type
    sender: int = 0
    seq: int = 0
    key: int = 0
    meta: dict[str, Any] | None = None
    data: np.ndarray | None = None  # float32, 1-D; uint32 words when dtype is TWOBIT
    dtype: DType = DType.FLOAT32  # of `data`
    count: int = 0  # TWOBIT only: how many values the words represent
    reply: bool = False
    want_ack: bool = True
    frames: list[Any] = field(default_factory=list, repr=False)  # the received buffers `data` views, if any


def encode(msg: Message) -> list[Any]:
    """Frames for `socket.send_multipart(frames, copy=False)`; the payload is not copied."""
    flags = (FLAG_REPLY if msg.reply else 0) | (FLAG_ACK if msg.want_ack else 0)
    frames: list[Any] = [b""]
    if msg.meta is not None:
        flags |= FLAG_META
        meta = json.dumps(msg.meta, separators=(",", ":")).encode()
        if len(meta) > MAX_META:  # refused here, by name, rather than disconnected on the wire
            raise ValueError(f"{msg.type.name}: metadata of {len(meta)} bytes exceeds {MAX_META}")
        frames.append(meta)
    count, dtype = 0, DType.NONE
    if msg.data is not None:
        flags |= FLAG_DATA
        if msg.dtype == DType.TWOBIT:
            data = np.ascontiguousarray(msg.data, dtype=np.uint32).reshape(-1)
            if data.size != words(msg.count):
                raise ValueError(f"{data.size} words cannot hold {msg.count} 2-bit values")
            count, dtype = msg.count, DType.TWOBIT
        else:
            data = np.ascontiguousarray(msg.data, dtype=np.float32).reshape(-1)
            count, dtype = data.size, DType.FLOAT32
        raw = memoryview(data).cast("B")
        frames.extend(raw[i:i + FRAME_BYTES] for i in range(0, max(len(raw), 1), FRAME_BYTES))
    frames[0] = HEADER.pack(MAGIC, VERSION, int(msg.type), flags, int(dtype), msg.sender,
                            msg.seq & 0xFFFFFFFF, msg.key, count)
    return frames


def _buffer(frame: Any) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def decode(frames: Sequence[Any], max_count: int | None = None) -> Message:
    """Parse received frames (bytes or zmq.Frame); raises ProtocolError on anything off."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buffer(frames[0])
    if len(head) != HEADER.size:
        raise ProtocolError(f"header is {len(head)} bytes, expected {HEADER.size}")
    magic, version, type_, flags, dtype, sender, seq, key, count = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:04x}: not a tfkv message")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this node speaks {VERSION}")
    try:
        kind = Type(type_)
    except ValueError:
        raise ProtocolError(f"unknown message type {type_}") from None
    if flags & ~(FLAG_META | FLAG_DATA | FLAG_REPLY | FLAG_ACK):
        raise ProtocolError(f"unknown flags 0x{flags:02x}")
    nbytes = 0
    if flags & FLAG_DATA:
        if dtype not in (DType.FLOAT32, DType.TWOBIT):
            raise ProtocolError(f"{kind.name}: dtype code {dtype} is not supported (float32, 2-bit)")
        # For TWOBIT, count is the number of values represented: the limit bounds what decoding
        # them will allocate, not only the bytes received.
        if max_count is not None and count > max_count:
            raise ProtocolError(f"{kind.name}: {count} elements exceed the limit of {max_count}")
        if dtype == DType.TWOBIT and kind != Type.PUSH:
            raise ProtocolError(f"{kind.name}: 2-bit payloads are only for PUSH")
        nbytes = words(count) * 4 if dtype == DType.TWOBIT else count * 4
    elif count or dtype:
        raise ProtocolError(f"{kind.name}: count/dtype set without a payload")
    npayload = max(1, -(-nbytes // FRAME_BYTES)) if flags & FLAG_DATA else 0
    expected = 1 + bool(flags & FLAG_META) + npayload
    if len(frames) != expected:
        raise ProtocolError(f"{kind.name}: {len(frames)} frames, flags and count say {expected}")
    msg = Message(kind, sender, seq, key, reply=bool(flags & FLAG_REPLY), want_ack=bool(flags & FLAG_ACK))
    i = 1
    if flags & FLAG_META:
        raw = _buffer(frames[i])
        if len(raw) > MAX_META:
            raise ProtocolError(f"{kind.name}: metadata of {len(raw)} bytes exceeds {MAX_META}")
        try:
            meta = json.loads(bytes(raw), parse_constant=_no_constant)
        except RecursionError:
            raise ProtocolError(f"{kind.name}: metadata is nested too deeply") from None
        except ValueError as e:  # JSONDecodeError, bad UTF-8, an int of over 4300 digits, NaN
            raise ProtocolError(f"{kind.name}: metadata is not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise ProtocolError(f"{kind.name}: metadata must be a JSON object")
        msg.meta = meta
        i += 1
    if flags & FLAG_DATA:
        parts = [_buffer(f) for f in frames[i:]]
        sizes = [len(p) for p in parts]
        if sum(sizes) != nbytes or any(n != FRAME_BYTES for n in sizes[:-1]):
            what = f"{count} 2-bit values ({nbytes} bytes)" if dtype == DType.TWOBIT else f"{count} float32"
            split = f" in frames of {sizes[:3]}{'...' if len(sizes) > 3 else ''}" if len(sizes) > 1 else ""
            raise ProtocolError(f"{kind.name}: payload is {sum(sizes)} bytes{split}, header says {what}")
        if len(parts) == 1:
            raw: Any = parts[0]  # the received buffer itself: no copy
            msg.frames = list(frames)
        else:  # one copy, into one array (numpy needs the payload contiguous); the frames are let go
            raw = np.empty(nbytes, np.uint8)
            for j, part in enumerate(parts):
                raw[j * FRAME_BYTES:j * FRAME_BYTES + len(part)] = np.frombuffer(part, np.uint8)
        msg.data = np.frombuffer(raw, dtype=np.uint32 if dtype == DType.TWOBIT else np.float32)
        msg.dtype, msg.count = DType(dtype), count
    try:
        schema.check(kind.name, msg.reply, msg.meta, msg.data is not None)
    except schema.SchemaError as e:
        raise ProtocolError(f"{kind.name}: {e}") from None
    except Exception as e:  # a check's own failure: still this message's fault, never the node's end
        raise ProtocolError(f"{kind.name}: metadata refused ({type(e).__name__}: {e})") from None
    return msg


def _no_constant(name: str) -> None:
    # Python's json takes NaN and Infinity, which are not JSON and would reach arithmetic.
    raise ValueError(f"{name} is not a JSON number")


def error(to: Message, text: str, sender: int = 0) -> Message:
    """The ERROR answering `to`. Every ERROR a node sends is made here: its text is cut to what
    the ERROR schema admits, so that no explanation is itself refused as malformed."""
    if len(text) > schema.MAX_ERROR_TEXT:
        text = text[:schema.MAX_ERROR_TEXT - 3] + "..."
    return Message(Type.ERROR, sender=sender, seq=to.seq, key=to.key, meta={"message": text}, reply=True)


def refusal(frames: Sequence[Any], text: str) -> Message:
    """The ERROR answering received frames that did not decode (`text`: the ProtocolError's),
    with their sequence number and key when the header can be read, so the sender can tell
    which of its requests was refused."""
    seq = key = 0
    head = _buffer(frames[0]) if frames else b""
    if len(head) == HEADER.size:
        seq, key = HEADER.unpack(head)[6:8]
    return error(Message(Type.ERROR, seq=seq, key=key), text)


def ack(to: Message, sender: int = 0, **meta: Any) -> Message:
    return Message(Type.ACK, sender=sender, seq=to.seq, key=to.key, meta=meta or None, reply=True)
