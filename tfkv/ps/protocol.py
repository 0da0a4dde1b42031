"""The parameter server's wire format: ZeroMQ multipart messages with a fixed binary header.

    frame 0   header, 28 bytes, little-endian (HEADER below)
    frame 1   JSON object, only if FLAG_META is set (control messages; at most MAX_META bytes)
    frame 2   row ids, only if FLAG_ROWS is set: int64 little-endian, the global rows of a row-sparse
              key a request names (INIT, PUSH, PULL, GET_STATE, SET_STATE; possibly none: a
              synchronous job's empty push); its payload holds one row of values per id, in order
    frame 3   payload, only if FLAG_DATA is set: one frame, sent from the numpy buffer without
              a copy and received without a copy (the array views the received frame). dtype
              FLOAT32: `count` float32 values (count*4 bytes); FLOAT16 and BFLOAT16: `count`
              half-precision values (count*2 bytes: a half key's push, pull and init; see
              tfkv.ps.dtypes); TWOBIT: `count` values 2-bit compressed (tfkv.ps.compression),
              ceil(count/16) uint32 words, so a push of n gradients is 16x smaller on the wire

Frames present follow one another in this order (`frames_of` counts them from the flags; the
payload is always the last). A ZeroMQ message may carry several protocol messages back to back (`split`): a node sends what it
has ready for one peer together. A payload is one frame however large (a worker cuts a key's
part into messages of at most TFKV_CHUNK_BYTES, 16 MiB): version 1 cut it into frames of 1 MiB,
which both ends joined with a copy into a fresh array. What a peer can make a node buffer is bounded per socket instead
(ZMQ_MAXMSGSIZE, `max_frame`): MAX_FRAME (1 MiB + 4 KiB) on every socket whose peers may not be
of the job, i.e. the scheduler's CURVE sockets (libzmq applies the cap to the frames of a
CURVE handshake too) and a secure job's data plane, where every frame on the wire is a sealed
piece of at most tfkv.ps.channel.PIECE bytes, checked before anything is parsed; only a plain
job's data plane (TFKV_SECURE=0, no authentication at all: whoever connects may push) takes
frames up to TFKV_MAX_MESSAGE_BYTES, the largest payload a server accepts anyway.

Nothing received is unpickled or evaluated: the header is unpacked with `struct`, metadata is
parsed by `json` and checked against its message type's schema (`tfkv.ps.schema`), payloads
are viewed by `numpy.frombuffer`. Every field is checked; a message that does not fit raises
`ProtocolError` and the receiver answers with an error or drops it. A node of another protocol
version (1: payloads in 1 MiB frames; 2: no rows frame) is refused by name.
This module imports neither TensorFlow nor anything heavy.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from tfkv.errors import TfkvError
from tfkv.ps import dtypes, schema
from tfkv.ps.compression import words

MAGIC = 0x4B54  # "TK"
VERSION = 3  # 3: a rows frame (FLAG_ROWS); 2: a payload is one frame (1: cut into frames of 1 MiB)
HEADER = struct.Struct("<HBBBBHIQQ")  # magic version type flags dtype sender seq key count
# The largest frame a socket accepts when its peers are not known to be of the job (ZMQ_MAXMSGSIZE,
# see the docstring and `max_frame`): 1 MiB and room for what wraps a frame. CURVE's MESSAGE command
# adds about 40 bytes that libzmq counts against the cap (a frame of exactly the cap got its sender
# disconnected and the message lost in every secure job), the data plane's tag 32 (tfkv.ps.channel).
MAX_FRAME = (1 << 20) + 4096
MAX_META = 1 << 20  # metadata is one frame: encode refuses more, decode too
SEQ_MASK = 0xFFFFFFFF  # a header's seq field: 32 bits (a worker's numbers wrap with it)


def max_frame(secure: bool, max_message_bytes: int) -> int:
    """The frame cap (ZMQ_MAXMSGSIZE) of a data-plane socket: MAX_FRAME in a secure job (every
    frame on the wire is a sealed piece, tfkv.ps.channel), the largest payload a server accepts
    in a plain one, whose payloads travel as one frame each."""
    return MAX_FRAME if secure else max(MAX_FRAME, max_message_bytes)


FLAG_META = 1
FLAG_DATA = 2
FLAG_REPLY = 4
FLAG_ACK = 8  # the sender wants an ACK for a PUSH (under PS_RESEND); errors are always answered
FLAG_ROWS = 16  # a rows frame (int64 row ids) before the payload: a row-sparse key's request
ROW_ID = np.dtype("<i8")
ROWS_TYPES = frozenset(("INIT", "PUSH", "PULL", "GET_STATE", "SET_STATE"))  # requests that may name rows


def frames_of(flags: int) -> int:
    """How many frames a protocol message of these header flags has: the header, then metadata,
    rows and payload where flagged (split, decode and tfkv.ps.channel count with this)."""
    return 1 + bool(flags & FLAG_META) + bool(flags & FLAG_ROWS) + bool(flags & FLAG_DATA)


class DType(enum.IntEnum):
    NONE = 0
    FLOAT32 = 1
    TWOBIT = 2  # 16 values per uint32 word; the receiver decodes with its compression threshold
    FLOAT16 = 3  # IEEE half, 2 bytes per value
    BFLOAT16 = 4  # bfloat16 (ml_dtypes), 2 bytes per value


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
    LEFT = 9  # scheduler -> servers, meta: id, node: a worker finished, so a round it owes never closes
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
    PUSHPULL = 29  # meta: keys; data: their pushes end to end; reply data: their values end to end.
    # Without meta: the header's key pushed, then pulled (answered as its PULL)
    ACK = 30
    ERROR = 31  # meta: message
    # meta: rank, what. With data: worker `rank`'s error feedback of the key part ("residual" or
    # "velocity"), kept by the server for worker 0's checkpoint; without: asks for it (reply data)
    FEEDBACK = 32


_TYPES = {int(t): t for t in Type}  # decode's lookups: dicts, not Enum calls (every message)
_NAMES = {t: t.name for t in Type}
_DTYPES = {int(DType.FLOAT32): (DType.FLOAT32, dtypes.FLOAT32), int(DType.TWOBIT): (DType.TWOBIT, np.dtype(np.uint32)),
           int(DType.FLOAT16): (DType.FLOAT16, dtypes.FLOAT16),
           int(DType.BFLOAT16): (DType.BFLOAT16, dtypes.BFLOAT16)}
# A half-precision array is sent as it is, with its dtype's code; any other is sent as float32.
_HALF_CODES = {dtypes.FLOAT16: DType.FLOAT16, dtypes.BFLOAT16: DType.BFLOAT16}
DTYPE_CODES = {dtypes.FLOAT32: int(DType.FLOAT32), **{k: int(v) for k, v in _HALF_CODES.items()}}  # an array's code
_FLAGS = FLAG_META | FLAG_DATA | FLAG_REPLY | FLAG_ACK | FLAG_ROWS


class ProtocolError(TfkvError, ValueError):
    """A message that is not valid tfkv protocol; the text says what is wrong."""


@dataclass
class Message:
    type: Type
    sender: int = 0
    seq: int = 0
    key: int = 0
    meta: dict[str, Any] | None = None
    data: np.ndarray | None = None  # float32 or half, 1-D; uint32 words when dtype is TWOBIT
    dtype: DType = DType.FLOAT32  # of `data` (encode takes a half array's own: FLOAT16, BFLOAT16)
    count: int = 0  # TWOBIT only: how many values the words represent
    reply: bool = False
    want_ack: bool = True
    rows: np.ndarray | None = None  # int64 row ids of a row-sparse key (FLAG_ROWS); None: a dense request


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
    if msg.rows is not None:
        flags |= FLAG_ROWS
        frames.append(memoryview(np.ascontiguousarray(msg.rows, dtype=ROW_ID).reshape(-1)).cast("B"))
    count, dtype = 0, DType.NONE
    if msg.data is not None:
        flags |= FLAG_DATA
        if msg.dtype == DType.TWOBIT:
            data = np.ascontiguousarray(msg.data, dtype=np.uint32).reshape(-1)
            if data.size != words(msg.count):
                raise ValueError(f"{data.size} words cannot hold {msg.count} 2-bit values")
            count, dtype = msg.count, DType.TWOBIT
        else:
            dtype = _HALF_CODES.get(msg.data.dtype, DType.FLOAT32)
            data = np.ascontiguousarray(msg.data, dtype=_DTYPES[dtype][1]).reshape(-1)
            count = data.size
        # bfloat16 has no buffer-protocol format: its bytes go as uint16 (a view, no copy).
        frames.append(_received_frame(data) or memoryview(data if dtype != DType.BFLOAT16 else data.view(np.uint16))
                      .cast("B"))
    frames[0] = HEADER.pack(MAGIC, VERSION, int(msg.type), flags, int(dtype), msg.sender,
                            msg.seq & SEQ_MASK, msg.key, count)
    return frames


def _received_frame(data: np.ndarray) -> Any:
    """The received zmq.Frame that `data` views whole, if any (a server's reply of a pushed value):
    sent as it is, which shares its buffer with libzmq by a reference count, where sending the
    array zero-copy goes through pyzmq's garbage-collector thread (a wakeup and the GIL per frame)."""
    base = data.base
    while type(base) is np.ndarray:  # a view of a view (encode's reshape)
        base = base.base
    # Contiguous and as long as the whole buffer: it starts where the buffer does.
    if type(base) is memoryview and base.nbytes == data.nbytes and data.flags.c_contiguous:
        frame = base.obj
        # A zmq.Frame (this module does not import zmq) of exactly these bytes: a secure job's
        # payload is opened in place and views its sealed frame less the tag (tfkv.ps.channel).
        if hasattr(frame, "buffer") and len(frame) == data.nbytes:
            return frame
    return None


def split(frames: Sequence[Any]) -> list[Sequence[Any]]:
    """The protocol messages one ZeroMQ message carries, each as its frames: a node sends the
    messages it has ready for one peer together (a batch: one send, one wakeup of each thread on
    the way, one seal), each message still whole, header first. Only the frame counts are read
    here (`frames_of` the header's flags); `decode` checks each message. Frames that do not cut
    into messages end in a last short slice, which decode refuses."""
    out, i, n = [], 0, len(frames)
    while i < n:
        head = memoryview(frames[i])
        size = frames_of(head[4] if len(head) == HEADER.size else 0)
        out.append(frames[i:i + size])
        i += size
    return out


def decode(frames: Sequence[Any], max_count: int | None = None) -> Message:
    """Parse received frames (bytes or zmq.Frame); raises ProtocolError on anything off."""
    if not frames:
        raise ProtocolError("empty message")
    # memoryview() takes bytes and zmq.Frame alike; zmq.Frame.buffer, as this used, makes a weak
    # reference beside its memoryview on every first look (and hasattr() looked once more).
    head = memoryview(frames[0])
    if len(head) != HEADER.size:
        raise ProtocolError(f"header is {len(head)} bytes, expected {HEADER.size}")
    magic, version, type_, flags, dtype, sender, seq, key, count = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic 0x{magic:04x}: not a tfkv message")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this node speaks {VERSION}: every node of a job must "
                            "run the same tfkv release")
    kind = _TYPES.get(type_)
    if kind is None:
        raise ProtocolError(f"unknown message type {type_}")
    if flags & ~_FLAGS:
        raise ProtocolError(f"unknown flags 0x{flags:02x}")
    nbytes = _payload_bytes(kind, flags, dtype, count, max_count)
    expected = frames_of(flags)
    if len(frames) != expected:
        raise ProtocolError(f"{kind.name}: {len(frames)} frames, flags and count say {expected}")
    msg = Message(kind, sender, seq, key, reply=bool(flags & FLAG_REPLY), want_ack=bool(flags & FLAG_ACK))
    i = 1
    if flags & FLAG_META:
        msg.meta = _meta(kind, memoryview(frames[i]))
        if dtype == DType.TWOBIT and kind == Type.PUSHPULL and "keys" in msg.meta:
            raise ProtocolError(f"{kind.name}: 2-bit payloads are only for PUSH, a one-key PUSHPULL and a PULL's "
                                "reply")  # a fused one's values are float32 slices
        i += 1
    if flags & FLAG_ROWS:
        msg.rows = _rows(kind, memoryview(frames[i]), flags, count, max_count)
        i += 1
    if flags & FLAG_DATA:
        raw = memoryview(frames[i])
        if len(raw) != nbytes:
            what = (f"{count} 2-bit values ({nbytes} bytes)" if dtype == DType.TWOBIT
                    else f"{count} {_DTYPES[dtype][1].name}")
            raise ProtocolError(f"{kind.name}: payload is {len(raw)} bytes, header says {what}")
        msg.dtype, array_type = _DTYPES[dtype]
        msg.data = np.frombuffer(raw, array_type)  # the received buffer itself: no copy
        msg.count = count
    try:
        schema.check(_NAMES[kind], msg.reply, msg.meta, msg.data is not None)
    except schema.SchemaError as e:
        raise ProtocolError(f"{kind.name}: {e}") from None
    except Exception as e:  # a check's own failure: still this message's fault, never the node's end
        raise ProtocolError(f"{kind.name}: metadata refused ({type(e).__name__}: {e})") from None
    return msg


def _payload_bytes(kind: Type, flags: int, dtype: int, count: int, max_count: int | None) -> int:
    """The payload's size in bytes as the header describes it (0 without one), after checking that
    the header's dtype, count and row ids fit the message's type and the limit."""
    nbytes = 0
    if flags & FLAG_DATA:
        if dtype not in _DTYPES:
            raise ProtocolError(f"{kind.name}: dtype code {dtype} is not supported (float32, float16, bfloat16, "
                                "2-bit)")
        itemsize = _DTYPES[dtype][1].itemsize
        # For TWOBIT, count is the number of values represented: the limit bounds what decoding
        # them will allocate, not only the bytes received. max_count counts float32 values: a
        # half payload may hold twice as many (the same bytes).
        if max_count is not None and count > (max_count * 2 if itemsize == 2 else max_count):
            raise ProtocolError(f"{kind.name}: {count} elements exceed the limit of {max_count}")
        # a PUSH, a one-key PUSHPULL (its meta, if any, says what its pull holds; a fused one,
        # whose meta lists "keys", is refused in decode), a PULL's reply (both_ways)
        reply = bool(flags & FLAG_REPLY)
        twobit_ok = kind == Type.PULL if reply else kind in (Type.PUSH, Type.PUSHPULL)
        if dtype == DType.TWOBIT and not twobit_ok:
            raise ProtocolError(f"{kind.name}: 2-bit payloads are only for PUSH, a one-key PUSHPULL and a PULL's "
                                "reply")
        one_key_pushpull = kind == Type.PUSHPULL and not flags & FLAG_META  # a PUSH and its PULL
        if itemsize == 2 and kind not in (Type.INIT, Type.PUSH, Type.PULL) and not one_key_pushpull:
            raise ProtocolError(f"{kind.name}: half-precision payloads are only for INIT, PUSH, PULL and a one-key "
                                "PUSHPULL")
        nbytes = words(count) * 4 if dtype == DType.TWOBIT else count * itemsize
    elif count or dtype:
        raise ProtocolError(f"{kind.name}: count/dtype set without a payload")
    if flags & FLAG_ROWS:
        if kind.name not in ROWS_TYPES or flags & FLAG_REPLY:
            raise ProtocolError(f"{kind.name}: row ids are only for INIT, PUSH, PULL, GET_STATE and SET_STATE requests")
        if flags & FLAG_DATA and dtype not in (DType.FLOAT32, DType.FLOAT16):
            raise ProtocolError(f"{kind.name}: the rows of a row-sparse key are float32 or float16")
    return nbytes


def _meta(kind: Type, raw: memoryview) -> dict:
    """A metadata frame as the JSON object it must be, within MAX_META bytes."""
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
    return meta


def _rows(kind: Type, raw: memoryview, flags: int, count: int, max_count: int | None) -> np.ndarray:
    """A rows frame as its int64 ids (the received buffer), whole ids within the limit that the
    payload's values divide into."""
    if len(raw) % ROW_ID.itemsize:
        raise ProtocolError(f"{kind.name}: a rows frame of {len(raw)} bytes is not a whole number of int64 ids")
    nrows = len(raw) // ROW_ID.itemsize
    if max_count is not None and nrows > max_count:
        raise ProtocolError(f"{kind.name}: {nrows} row ids exceed the limit of {max_count}")
    if flags & FLAG_DATA and (count % nrows if nrows else count):
        raise ProtocolError(f"{kind.name}: {count} values cannot be {nrows} rows of one width")
    return np.frombuffer(raw, ROW_ID)  # checked against the key's rows by the server


def _no_constant(name: str) -> None:
    # Python's json takes NaN and Infinity, which are not JSON and would reach arithmetic.
    raise ValueError(f"{name} is not a JSON number")


def error(to: Message, text: str, sender: int = 0, left: str | None = None) -> Message:
    """The ERROR answering `to`. Every ERROR a node sends is made here: its text is cut to what
    the ERROR schema admits, so that no explanation is itself refused as malformed. `left`: the
    worker that left the job, when that is why `to` can never be answered (a peer's fault, not
    the asker's)."""
    if len(text) > schema.MAX_ERROR_TEXT:
        text = text[:schema.MAX_ERROR_TEXT - 3] + "..."
    meta = {"message": text} if left is None else {"message": text, "left": left}
    return Message(Type.ERROR, sender=sender, seq=to.seq, key=to.key, meta=meta, reply=True)


def refusal(frames: Sequence[Any], text: str) -> Message:
    """The ERROR answering received frames that did not decode (`text`: the ProtocolError's),
    with their sequence number and key when the header can be read, so the sender can tell
    which of its requests was refused."""
    seq = key = 0
    head = memoryview(frames[0]) if frames else b""
    if len(head) == HEADER.size:
        seq, key = HEADER.unpack(head)[6:8]
    return error(Message(Type.ERROR, seq=seq, key=key), text)


def ack(to: Message, sender: int = 0, **meta: Any) -> Message:
    return Message(Type.ACK, sender=sender, seq=to.seq, key=to.key, meta=meta or None, reply=True)
