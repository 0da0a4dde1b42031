"""The wire format: exact round trips, zero-copy payloads, and refusal of anything malformed."""

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfkv.store import protocol as P


def test_round_trip_with_meta_and_data():
    data = np.arange(10, dtype=np.float32)
    msg = P.Message(P.Type.PUSH, sender=3, seq=77, key=2**40 + 5, meta={"a": [1, 2]}, data=data)
    frames = P.encode(msg)
    assert len(frames) == 3 and len(frames[0]) == P.HEADER.size == 28
    back = P.decode([bytes(f) for f in frames])
    assert (back.type, back.sender, back.seq, back.key, back.meta) == (P.Type.PUSH, 3, 77, 2**40 + 5, {"a": [1, 2]})
    np.testing.assert_array_equal(back.data, data)


def test_payload_is_sent_and_received_without_copies():
    data = np.ones(1000, np.float32)
    frames = P.encode(P.Message(P.Type.PUSH, data=data))
    assert np.shares_memory(np.frombuffer(frames[1], np.float32), data)
    received = bytearray(bytes(frames[0])), bytearray(bytes(frames[1]))
    back = P.decode(list(received))
    assert np.shares_memory(back.data, np.frombuffer(received[1], np.float32))


def _header(**kw):
    fields = dict(magic=P.MAGIC, version=P.VERSION, type=int(P.Type.PUSH), flags=P.FLAG_DATA,
                  dtype=int(P.DType.FLOAT32), sender=1, seq=1, key=0, count=2)
    fields.update(kw)
    return P.HEADER.pack(*fields.values())


@pytest.mark.parametrize("frames,message", [
    ([], "empty message"),
    ([b"short"], "header is 5 bytes"),
    ([_header(magic=1), b"\0" * 8], "bad magic"),
    ([_header(version=9), b"\0" * 8], "protocol version 9"),
    ([_header(type=200), b"\0" * 8], "unknown message type 200"),
    ([_header(flags=64), b"\0" * 8], "unknown flags"),
    ([_header(), b"\0" * 8, b"extra"], "3 frames, flags say 2"),
    ([_header(), b"\0" * 7], "payload is 7 bytes, header says 2"),
    ([_header(dtype=7), b"\0" * 8], "dtype code 7"),
    ([_header(count=10**12), b"\0" * 8], "exceed the limit"),
    ([_header(flags=P.FLAG_META, count=0, dtype=0), b"{nope"], "not JSON"),
    ([_header(flags=P.FLAG_META, count=0, dtype=0), b"[1]"], "must be a JSON object"),
    ([_header(flags=0), ], "count/dtype set without a payload"),
])
def test_malformed_messages_are_refused(frames, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.decode(frames, max_count=10**6)


def test_pickles_are_just_bytes():
    import pickle

    evil = pickle.dumps({"x": 1})
    with pytest.raises(P.ProtocolError):
        P.decode([_header(flags=P.FLAG_META, count=0, dtype=0), evil])


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_random_frames_never_raise_anything_but_protocol_errors(frames):
    try:
        P.decode(frames, max_count=1 << 20)
    except P.ProtocolError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=P.HEADER.size, max_size=P.HEADER.size), st.binary(max_size=64))
def test_random_headers_with_a_payload(header, payload):
    try:
        msg = P.decode([header, payload], max_count=1 << 20)
    except P.ProtocolError:
        return
    assert msg.data is None or msg.data.nbytes == len(payload)
    json.dumps(msg.meta)  # whatever parsed is plain JSON data


# -- 2-bit compressed payloads -------------------------------------------------------------------

def test_two_bit_round_trip_keeps_count_and_words():
    words = np.array([0x12345678, 0x1], np.uint32)  # 17 values: 16 in the first word, 1 in the second
    msg = P.Message(P.Type.PUSH, key=4, data=words, dtype=P.DType.TWOBIT, count=17)
    frames = P.encode(msg)
    assert len(bytes(frames[-1])) == 8
    back = P.decode([bytes(f) for f in frames], max_count=100)
    assert (back.dtype, back.count) == (P.DType.TWOBIT, 17)
    np.testing.assert_array_equal(back.data, words)


@pytest.mark.parametrize("count,nbytes", [(17, 4), (17, 12), (16, 8), (1, 0), (0, 4)])
def test_two_bit_payload_of_the_wrong_length_is_refused(count, nbytes):
    header = _header(dtype=int(P.DType.TWOBIT), count=count)
    with pytest.raises(P.ProtocolError, match="2-bit values"):
        P.decode([header, b"\0" * nbytes], max_count=10**6)


def test_two_bit_count_is_bounded_by_the_values_it_decodes_to():
    # 64 bytes would decode to 256 float32: the limit applies to the decoded size.
    with pytest.raises(P.ProtocolError, match="exceed the limit"):
        P.decode([_header(dtype=int(P.DType.TWOBIT), count=256), b"\0" * 64], max_count=255)


def test_two_bit_only_for_pushes():
    header = _header(type=int(P.Type.INIT), dtype=int(P.DType.TWOBIT), count=16)
    with pytest.raises(P.ProtocolError, match="only for PUSH"):
        P.decode([header, b"\0" * 4])


def test_encode_refuses_words_that_do_not_match_the_count():
    with pytest.raises(ValueError):
        P.encode(P.Message(P.Type.PUSH, data=np.zeros(2, np.uint32), dtype=P.DType.TWOBIT, count=40))
