"""The wire format: exact round trips, zero-copy payloads, and refusal of anything malformed."""

import json
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfkv.ps import protocol as P


def test_round_trip_with_meta_and_data():
    data = np.arange(10, dtype=np.float32)
    meta = {"names": ["mean", "var"], "count": 2}
    msg = P.Message(P.Type.SET_STATE, sender=3, seq=77, key=2**40 + 5, meta=meta, data=data)
    frames = P.encode(msg)
    assert len(frames) == 3 and len(frames[0]) == P.HEADER.size == 28
    back = P.decode([bytes(f) for f in frames])
    assert (back.type, back.sender, back.seq, back.key, back.meta) == (P.Type.SET_STATE, 3, 77, 2**40 + 5, meta)
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
    ([_header(), b"\0" * 8, b"extra"], "3 frames, flags and count say 2"),
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
    # A one-key PUSHPULL is a PUSH and its PULL: its push may be compressed; a fused one's may not.
    one = P.decode([_header(type=int(P.Type.PUSHPULL), dtype=int(P.DType.TWOBIT), count=16), b"\0" * 4])
    assert one.dtype == P.DType.TWOBIT and one.count == 16 and one.meta is None
    fused = _header(type=int(P.Type.PUSHPULL), flags=P.FLAG_DATA | P.FLAG_META, dtype=int(P.DType.TWOBIT), count=16)
    with pytest.raises(P.ProtocolError, match="only for PUSH, a one-key PUSHPULL and a PULL's reply"):
        P.decode([fused, b'{"keys":[1]}', b"\0" * 4])
    # both_ways: a one-key PUSHPULL says which copy its pull holds; a PULL's reply may be 2-bit, a PULL not
    holding = P.decode([fused, b'{"holds":3}', b"\0" * 4])
    assert holding.meta == {"holds": 3} and holding.dtype == P.DType.TWOBIT
    reply = _header(type=int(P.Type.PULL), flags=P.FLAG_DATA | P.FLAG_REPLY, dtype=int(P.DType.TWOBIT), count=16)
    assert P.decode([reply, b"\0" * 4]).count == 16
    with pytest.raises(P.ProtocolError, match="only for PUSH"):
        P.decode([_header(type=int(P.Type.PULL), dtype=int(P.DType.TWOBIT), count=16), b"\0" * 4])


def test_encode_refuses_words_that_do_not_match_the_count():
    with pytest.raises(ValueError):
        P.encode(P.Message(P.Type.PUSH, data=np.zeros(2, np.uint32), dtype=P.DType.TWOBIT, count=40))


# -- control messages: one schema for every message's metadata -------------------------------------

def _control(type_, meta, reply=False, data=None):
    """A message as a peer would send it, its metadata written as raw JSON text when a str."""
    frames = [bytes(f) for f in P.encode(P.Message(type_, sender=1, seq=5, meta={}, data=data, reply=reply))]
    frames[1] = meta.encode() if isinstance(meta, str) else json.dumps(meta).encode()
    return frames


SGD = {"name": "sgd", "momentum": 0.0, "wd": 0.0,
       "schedule": {"name": "constant", "lr": 0.1, "factor": 0.1, "milestones": [], "total": 1, "warmup": 0}}
ADAM = {**SGD, "name": "adam", "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}
del ADAM["momentum"]


def _opt(base=SGD, schedule=None, **fields):
    return {"optimizer": {**base, **fields, "schedule": {**base["schedule"], **(schedule or {})}}}


@pytest.mark.parametrize("type_,meta,message", [
    # what the issue found crashing a server, a scheduler, or making weights NaN
    (P.Type.SET_COMPRESSION, {"type": "2bit", "threshold": None}, "threshold"),
    (P.Type.SET_COMPRESSION, {"type": "2bit", "threshold": [1]}, "threshold"),
    (P.Type.SET_OPTIMIZER, _opt(momentum="x"), "momentum"),
    (P.Type.SET_OPTIMIZER, _opt(ADAM, beta1="x"), "beta1"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"name": "step", "milestones": 5}), "milestones"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"lr": None}), "lr"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"name": "cosine", "total": 0}), "total"),
    (P.Type.CONFIGURE, {"sync": None}, "sync"),
    (P.Type.REGISTER, {"role": [], "host": "h", "port": 1, "pid": 1, "hostname": "h"}, "role"),
    (P.Type.REGISTER, {"role": {}, "host": "h", "port": 1, "pid": 1, "hostname": "h"}, "role"),
    (P.Type.REGISTER, '{"role":"worker","host":"h","port":1,"pid":1e400,"hostname":"h"}', "pid"),
    # and their neighbours
    (P.Type.SET_COMPRESSION, {"type": 5, "threshold": 0.5}, "type"),
    (P.Type.SET_COMPRESSION, {"type": "2bit", "threshold": "0.5"}, "threshold"),
    (P.Type.SET_OPTIMIZER, {"optimizer": "sgd"}, "optimizer"),
    (P.Type.SET_OPTIMIZER, {}, "optimizer"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"name": "warp"}), "warp"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"warmup": 1.5}), "warmup"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"milestones": [1, "2"]}), "milestones"),
    (P.Type.SET_OPTIMIZER, _opt(ADAM, beta1=1.0), "beta1"),
    (P.Type.SET_OPTIMIZER, _opt(ADAM, epsilon=0.0), "epsilon"),
    (P.Type.SET_OPTIMIZER, _opt(momentum=True), "momentum"),
    (P.Type.SET_OPTIMIZER, _opt(teleport=1), "teleport"),
    (P.Type.SET_OPTIMIZER, _opt(name="lbfgs"), "lbfgs"),
    (P.Type.CONFIGURE, {"sync": 1}, "sync"),
    (P.Type.CONFIGURE, {}, "sync"),
    (P.Type.CONFIGURE, {"sync": True, "extra": 1}, "extra"),
    (P.Type.SET_STATE, {"names": "momentum", "count": 1}, "names"),
    (P.Type.SET_STATE, {"names": [], "count": -1}, "count"),
    (P.Type.SET_STATE, {"names": [], "count": 2**70}, "count"),
    (P.Type.REGISTER, {"role": "scheduler", "host": "h", "port": 1, "pid": 1, "hostname": "h"}, "role"),
    (P.Type.REGISTER, {"role": "worker", "host": "h", "port": 70000, "pid": 1, "hostname": "h"}, "port"),
    (P.Type.REGISTER, {"role": "worker", "host": "h", "port": 1, "pid": 1.5, "hostname": "h"}, "pid"),
    (P.Type.REGISTER, {"role": "worker", "host": "h", "port": 1, "pid": 1, "hostname": "h",
                       "rank_hint": "0"}, "rank_hint"),
    (P.Type.FAILED, {"reason": ["x"]}, "reason"),
    (P.Type.PULL, {"anything": 1}, "PULL"),
    (P.Type.HEARTBEAT, {}, "HEARTBEAT"),
    # integers too large for float64 (math.isfinite raised OverflowError, past the handlers' catch)
    (P.Type.SET_COMPRESSION, {"type": "2bit", "threshold": 10**400}, "threshold"),
    (P.Type.SET_OPTIMIZER, _opt(momentum=10**400), "momentum"),
    (P.Type.SET_OPTIMIZER, _opt(ADAM, beta1=-10**400), "beta1"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"lr": 10**400}), "lr"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"name": "step", "milestones": [10**400]}), "milestones"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"name": "cosine", "total": 10**400}), "total"),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"warmup": 2**53}), "warmup"),
    (P.Type.SET_STATE, {"names": [], "count": 2**53}, "count"),
])
def test_every_control_message_is_checked_against_its_schema(type_, meta, message):
    with pytest.raises(P.ProtocolError, match=message):
        P.decode(_control(type_, meta), max_count=10**6)


@pytest.mark.parametrize("bad,where", [(True, "keys[2]"), (2.0, "keys[2]"), (-1, "keys[2]"), (2**62, "keys[2]"),
                                       ("3", "keys[2]")])
def test_a_fused_requests_keys_are_checked_at_once_and_the_bad_one_named(bad, where):
    from tfkv.ps import schema

    check = schema.SCHEMAS[("PUSHPULL", False)].meta
    check({"keys": list(range(4000))}, "")  # ints in bounds: one pass over the list
    with pytest.raises(schema.SchemaError, match=rf"^{re.escape(where)}={re.escape(repr(bad))} must be an integer"):
        check({"keys": [0, 1, bad, 3]}, "")


def test_any_failure_of_a_schema_check_is_a_protocol_error(monkeypatch):
    """Belt and braces: whatever a check raises (a builder's bug included), decode raises
    ProtocolError, the one error a node catches and answers; a node never dies on a message."""
    from tfkv.ps import schema

    def broken(value, where):
        raise ZeroDivisionError("a bug in a check")

    monkeypatch.setitem(schema.SCHEMAS, ("CONFIGURE", False), schema.Schema(broken))
    with pytest.raises(P.ProtocolError, match="CONFIGURE.*ZeroDivisionError"):
        P.decode(_control(P.Type.CONFIGURE, {"sync": True}))


def test_a_reply_is_checked_against_the_reply_schema():
    with pytest.raises(P.ProtocolError, match="message"):
        P.decode(_control(P.Type.ERROR, {"message": 5}, reply=True))
    with pytest.raises(P.ProtocolError, match="count"):
        P.decode(_control(P.Type.GET_STATE, {"names": [], "count": None}, reply=True, data=np.zeros(0, np.float32)))
    assert P.decode(_control(P.Type.ERROR, {"message": "no"}, reply=True)).meta == {"message": "no"}


@pytest.mark.parametrize("type_,meta,data", [
    (P.Type.CONFIGURE, {"sync": False}, None),
    (P.Type.SET_COMPRESSION, {"type": "2bit", "threshold": 0.5}, None),
    (P.Type.SET_COMPRESSION, {"type": "2bit", "threshold": 1}, None),
    (P.Type.SET_OPTIMIZER, _opt(momentum=0.9), None),
    (P.Type.SET_OPTIMIZER, _opt(ADAM, schedule={"name": "cosine", "total": 100, "warmup": 3}), None),
    (P.Type.SET_OPTIMIZER, _opt(schedule={"name": "step", "milestones": [10, 20]}), None),
    (P.Type.SET_STATE, {"names": ["momentum"], "count": 3}, np.zeros(4, np.float32)),
    (P.Type.REGISTER, {"role": "server", "host": "10.0.0.1", "port": 9000, "pid": 12, "hostname": "n1",
                       "rank_hint": None}, None),
    (P.Type.FAILED, {"reason": "out of memory"}, None),
])
def test_what_the_nodes_send_is_accepted(type_, meta, data):
    assert P.decode(_control(type_, meta, data=data), max_count=10**6).meta == meta


def test_every_optimizer_the_store_sends_passes_its_own_schema():
    from tfkv import optim

    for opt in (optim.SGD(), optim.Adam(), optim.SGD(schedule=optim.Schedule("step", 0.2, 0.5, [3, 9], 1, 2)),
                optim.SGD(schedule=optim.Schedule(name="cosine", lr=0.1, total=4, warmup=2), momentum=0.5)):
        meta = {"optimizer": optim.to_dict(opt)}
        assert optim.from_dict(P.decode(_control(P.Type.SET_OPTIMIZER, meta)).meta["optimizer"]) == opt


@pytest.mark.parametrize("text", [
    '{"a":' + "1" * 5000 + "}",  # int() refuses over 4300 digits with a plain ValueError
    '{"a":NaN}', '{"a":-Infinity}',
    "[" * 100_000 + "]" * 100_000,
])
def test_any_json_the_decoder_refuses_is_a_protocol_error(text):
    with pytest.raises(P.ProtocolError, match="not JSON|nested"):
        P.decode(_control(P.Type.CONFIGURE, text))


@pytest.mark.parametrize("kwargs,message", [
    (dict(schedule={"lr": None}), "lr"),
    (dict(schedule={"name": "cosine", "total": 0}), "total"),
    (dict(schedule={"lr": float("nan")}), "lr"),
    (dict(momentum="x"), "momentum"),
    (dict(momentum=10**400), "momentum"),
    (dict(schedule={"name": "step", "milestones": [10**400]}), "milestones"),
    (dict(schedule={"name": "cosine", "total": 10**400}), "total"),
])
def test_the_optimizer_refuses_settings_that_break_the_update(kwargs, message):
    """One rule wherever an optimizer is made: from the wire (from_dict) or in code."""
    from tfkv import optim

    with pytest.raises(ValueError, match=message):
        optim.from_dict(_opt(**kwargs)["optimizer"])
    schedule = kwargs.pop("schedule", {})
    with pytest.raises(ValueError, match=message):
        optim.SGD(schedule=optim.Schedule(**schedule), **kwargs)


# -- a payload is one frame, however large, received without a copy ----------------------------------

@pytest.mark.parametrize("n", [0, 1, (1 << 18) + 1, 5 << 20])
def test_a_payload_is_one_frame_sent_and_received_without_a_copy(n):
    """Version 1 cut a payload into frames of 1 MiB, which both ends joined with a copy into a
    fresh array (16 MiB: two 16 MiB copies and allocations per push+pull)."""
    data = np.arange(n, dtype=np.float32)
    frames = P.encode(P.Message(P.Type.PUSH, key=1, data=data))
    assert len(frames) == 2 and np.shares_memory(np.frombuffer(frames[1], np.uint8), data) == bool(n)
    received = [bytearray(bytes(f)) for f in frames]
    back = P.decode(received, max_count=n)
    assert np.shares_memory(back.data, np.frombuffer(received[1], np.uint8)) == bool(n)
    np.testing.assert_array_equal(back.data, data)


def test_several_messages_travel_in_one_zeromq_message_and_split_back():
    push = P.encode(P.Message(P.Type.PUSH, sender=9, seq=1, key=3, data=np.arange(5, dtype=np.float32)))
    pull = P.encode(P.Message(P.Type.PULL, sender=9, seq=2, key=3))
    meta = P.encode(P.Message(P.Type.SET_STATE, sender=9, seq=3, key=3, meta={"names": [], "count": 1},
                              data=np.ones(2, np.float32)))
    batch = [bytes(f) for f in push + pull + meta]
    got = [P.decode(m) for m in P.split(batch)]
    assert [(m.type, m.seq) for m in got] == [(P.Type.PUSH, 1), (P.Type.PULL, 2), (P.Type.SET_STATE, 3)]
    np.testing.assert_array_equal(got[0].data, np.arange(5, dtype=np.float32))
    # A batch cut short: the whole messages before the cut still split; the last slice is refused.
    *whole, short = P.split(batch[:-1])
    assert [P.decode(m).seq for m in whole] == [1, 2]
    with pytest.raises(P.ProtocolError, match="frames, flags and count say 3"):
        P.decode(short)


def test_a_node_of_protocol_version_1_is_refused_by_name():
    v1 = P.HEADER.pack(P.MAGIC, 1, int(P.Type.PUSH), P.FLAG_DATA, int(P.DType.FLOAT32), 1, 1, 0, 1 << 18)
    with pytest.raises(P.ProtocolError, match="protocol version 1, this node speaks 3: every node of a job"):
        P.decode([v1, b"\0" * (1 << 20)])


def test_a_received_frame_is_sent_back_as_it_is():
    """A server's reply of a pushed value sends the received zmq.Frame itself (a reference count
    in libzmq), not the array viewing it (pyzmq's zero-copy send of an array wakes its garbage
    collector thread per frame); any other array, or part of a frame, goes as a view of its bytes."""
    zmq = pytest.importorskip("zmq")
    frame = zmq.Frame(np.arange(8, dtype=np.float32).tobytes())
    head = P.HEADER.pack(P.MAGIC, P.VERSION, int(P.Type.PUSH), P.FLAG_DATA, int(P.DType.FLOAT32), 1, 1, 0, 8)
    pushed = P.decode([head, frame])
    assert P.encode(P.Message(P.Type.PULL, data=pushed.data, reply=True))[1] is frame
    for other in (pushed.data[:4], pushed.data[::-1], np.arange(8, dtype=np.float32)):
        sent = P.encode(P.Message(P.Type.PULL, data=other, reply=True))[1]
        assert isinstance(sent, memoryview) and bytes(sent) == other.tobytes()


@pytest.mark.parametrize("secure,cap", [(True, P.MAX_FRAME), (False, 16 << 30)])
def test_only_a_plain_data_plane_takes_frames_over_the_cap(secure, cap):
    """A secure job's data plane carries sealed pieces of at most channel.PIECE bytes, checked before
    anything is parsed: its frames stay under MAX_FRAME. A plain job's payload is one frame, up to
    the largest message a server accepts (whoever can connect to a plain job may push anyway)."""
    from tfkv.ps import channel

    assert channel.PIECE + channel.TAG < P.MAX_FRAME
    assert P.max_frame(secure, 16 << 30) == cap
    assert P.max_frame(False, 1000) == P.MAX_FRAME


# -- what a node says when it refuses, and how much metadata one frame carries ----------------------

def test_the_refusal_of_any_malformed_request_is_an_error_its_sender_can_read():
    """A refusal's text can be any length (an unknown-field list names every field): the ERROR is
    cut to what the ERROR schema admits, keeps the request's sequence number, and decodes at the
    receiver (a longer one was refused there, and the worker reported 'the reply was lost')."""
    many = {f"field_{i:05d}_{'x' * 20}": 1 for i in range(2000)}
    frames = _control(P.Type.SET_OPTIMIZER, {"optimizer": {**SGD, **many}})
    with pytest.raises(P.ProtocolError) as refused:
        P.decode(frames)
    assert len(str(refused.value)) > 10_000
    for error in (P.refusal(frames, str(refused.value)), P.error(P.Message(P.Type.PING, seq=5), "x" * 50_000)):
        back = P.decode([bytes(f) for f in P.encode(error)])
        assert back.type == P.Type.ERROR and back.reply and back.seq == 5
        assert back.meta["message"].startswith(str(error.meta["message"])[:40])
    assert P.refusal([b"garbage"], "bad").seq == 0  # no readable header: no sequence number


def test_metadata_fits_one_frame_with_room_for_curve():
    """A frame of MAX_FRAME is disconnected under CURVE (its ~40 bytes count against the cap):
    metadata is held to 1 MiB, refused by encode, not lost on the wire."""
    assert P.MAX_META < P.MAX_FRAME
    fits = {"reason": "x" * (P.MAX_META - len('{"reason":""}'))}
    assert len(bytes(P.encode(P.Message(P.Type.FAILED, meta=fits))[1])) == P.MAX_META
    with pytest.raises(ValueError, match="metadata"):
        P.encode(P.Message(P.Type.FAILED, meta={"reason": fits["reason"] + "x"}))
    with pytest.raises(P.ProtocolError, match="metadata of"):
        P.decode([_header(flags=P.FLAG_META, count=0, dtype=0), b" " * (P.MAX_META + 1)])


def test_the_server_sends_full_payload_frames_without_a_copy():
    """The server copies reply frames below its copy threshold: a reply of 1 MiB (a 512 x 512
    weight) must take the zero-copy path."""
    from tfkv.ps.transport import server

    assert server.COPY_THRESHOLD < 1 << 20


HALVES = [(P.DType.FLOAT16, np.float16), (P.DType.BFLOAT16, ml_dtypes.bfloat16)]


@pytest.mark.parametrize("code,dtype", HALVES)
def test_half_precision_travels_in_its_dtype_at_two_bytes_a_value(code, dtype):
    data = (np.arange(1000) % 64 - 32).astype(dtype)  # integers: exact in both
    frames = P.encode(P.Message(P.Type.PUSH, key=5, data=data))
    assert P.HEADER.unpack(bytes(frames[0]))[4] == int(code)
    assert memoryview(frames[1]).nbytes == 2 * data.size  # half of float32's 4000 bytes
    assert np.shares_memory(np.frombuffer(frames[1], np.uint16), data.view(np.uint16))  # sent without a copy
    back = P.decode([bytes(f) for f in frames])
    assert back.data.dtype == np.dtype(dtype) and back.dtype == code
    np.testing.assert_array_equal(back.data.view(np.uint16), data.view(np.uint16))
    # Other dtypes still go as float32 (as before): only a half array keeps its own.
    assert P.HEADER.unpack(bytes(P.encode(P.Message(P.Type.PUSH, data=np.ones(3)))[0]))[4] == int(P.DType.FLOAT32)


@pytest.mark.parametrize("code,dtype", HALVES)
def test_malformed_half_precision_frames_are_refused(code, dtype):
    with pytest.raises(P.ProtocolError, match=f"payload is 7 bytes, header says 4 {np.dtype(dtype).name}"):
        P.decode([_header(dtype=int(code), count=4), b"\0" * 7])
    for type_, flags, meta in ((P.Type.SET_STATE, P.FLAG_META, [b'{"names":[],"count":0}']),
                               (P.Type.GET_STATE, 0, []), (P.Type.PUSHPULL, P.FLAG_META, [b'{"keys":[1]}'])):
        with pytest.raises(P.ProtocolError, match="half-precision payloads are only for INIT, PUSH, PULL and a one-key "
                                                  "PUSHPULL"):
            P.decode([_header(type=int(type_), flags=P.FLAG_DATA | flags, dtype=int(code), count=4), *meta,
                      b"\0" * 8])
    # A one-key PUSHPULL (no key list) carries its key's dtype, as a PUSH does.
    one = P.decode([_header(type=int(P.Type.PUSHPULL), flags=P.FLAG_DATA, dtype=int(code), count=4), b"\0" * 8])
    assert one.meta is None and one.data.dtype == dtype and one.data.size == 4
    # The limit counts float32 values: a half payload may hold twice as many (the same bytes).
    assert P.decode([_header(dtype=int(code), count=8), b"\0" * 16], max_count=4).data.size == 8
    with pytest.raises(P.ProtocolError, match="exceed the limit"):
        P.decode([_header(dtype=int(code), count=9), b"\0" * 18], max_count=4)
