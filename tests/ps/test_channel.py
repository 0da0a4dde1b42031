"""The data plane's AEAD channel, in one process: handshake, sealing, and every refusal.

Tests that take `cipher` run once per cipher: a node without `aeg` is emulated here by replacing
aead.available (what this process has); tests/ps/test_protocol_attacks.py runs real jobs whose
processes lack the package."""

import time

import numpy as np
import pytest

from tfkv import keys as job_keys
from tfkv.ps import aead, channel, handshake
from tfkv.ps import protocol as P


@pytest.fixture(params=["AEGIS-128X4", "AES-256-GCM"])
def cipher(request, monkeypatch):
    if request.param == "AES-256-GCM":
        monkeypatch.setattr(aead, "available", lambda: (aead.AesGcm256,))
    return request.param


def _pair(keys=None):
    keys = keys or job_keys.new_keys()
    hello = handshake.Hello(handshake.psk(keys.secret))
    doors = handshake.Acceptor(handshake.psk(keys.secret))
    answer = doors.hello(b"worker", hello.message)
    return hello.welcome(answer), doors.sessions[b"worker"]


def _through(receiver, pieces):
    """Deliver pieces in order; the protocol frames once the last one is in."""
    got = None
    for piece in pieces:
        assert got is None, "frames returned before the last piece"
        got = receiver.open(piece)
    return got


def _msg(n=1000, seq=1):
    return P.encode(P.Message(P.Type.PUSH, sender=9, seq=seq, key=3, data=np.arange(n, dtype=np.float32)))


def test_a_sealed_message_opens_to_the_same_frames_and_hides_them(cipher):
    worker, server = _pair()
    assert worker.cipher.NAME == server.cipher.NAME == cipher
    data = np.arange(600_000, dtype=np.float32)  # 2.4 MB: in pieces of 1 MiB
    sealed = list(worker.seal(P.encode(P.Message(P.Type.PUSH, sender=9, seq=1, key=3, data=data))))
    pieces = -(-data.nbytes // channel.PIECE)  # the header alone, then the payload in runs of pieces
    assert len(sealed) == 1 + -(-pieces // channel.RUN) and [len(m) - 1 for m in sealed] == [1, pieces]
    assert data[:64].tobytes() not in b"".join(bytes(f) for piece in sealed for f in piece)
    got = P.decode(_through(server, sealed), max_count=10**6)
    assert got.seq == 1 and np.array_equal(got.data, data)
    reply = P.decode(_through(worker, server.seal(P.encode(P.ack(got)))))  # and back
    assert reply.type == P.Type.ACK and reply.seq == 1


def test_a_1_mib_pushpull_travels_as_one_message_its_payload_last():
    """What pushpull sends for a 512 x 512 weight (a one-key PUSHPULL): one ZeroMQ message (each
    extra one costs thread wakeups on both ends), the sealed payload its last frame (a small frame
    behind a large one costs libzmq a write more), opened back to the request."""
    worker, server = _pair()
    data = np.arange(1 << 18, dtype=np.float32)
    sealed = list(worker.seal(P.encode(P.Message(P.Type.PUSHPULL, sender=9, seq=1, key=3, data=data))))
    assert len(sealed) == 1 and all(len(f) <= channel.PIECE + channel.TAG for f in sealed[0][1:])
    assert len(sealed[0][-1]) == data.nbytes + channel.TAG
    (one,) = (P.decode(m, max_count=1 << 18) for m in P.split(_through(server, sealed)))
    assert one.type == P.Type.PUSHPULL and one.meta is None and np.array_equal(one.data, data)


def test_nonces_never_repeat_across_frames_and_messages():
    worker, _ = _pair()
    used = [channel.envelope(m)[-1] + i for seq in range(5) for m in worker.seal(_msg(300_000, seq))
            for i in range(len(m) - 1)]  # one nonce per sealed part
    assert len(used) == 5 * (1 + -(-1_200_000 // channel.PIECE)) and len(used) == len(set(used))  # header + 1.2 MB


def test_a_received_frame_is_opened_in_place_and_a_tampered_one_still_refused():
    """A received zmq.Frame (writable) is decrypted into its own buffer: the payload views it, no
    allocation. In-place decryption must still check the tag: a flipped bit is refused."""
    zmq = pytest.importorskip("zmq")
    worker, server = _pair()
    data = np.arange(200_000, dtype=np.float32)
    sealed = [[zmq.Frame(bytes(f)) for f in piece] for piece in worker.seal(P.encode(
        P.Message(P.Type.PUSH, sender=9, seq=1, key=3, data=data)))]
    got = P.decode(_through(server, sealed), max_count=10**6)
    assert np.array_equal(got.data, data)
    assert np.shares_memory(got.data, np.frombuffer(sealed[-1][-1].buffer, np.uint8))
    # Sent back, the payload is a view of the frame less its tag, so never the frame itself.
    assert bytes(P.encode(P.Message(P.Type.PULL, data=got.data, reply=True))[1]) == data.tobytes()
    tampered = [[zmq.Frame(bytes(f)) for f in piece] for piece in worker.seal(P.encode(
        P.Message(P.Type.PUSH, sender=9, seq=2, key=3, data=data)))]
    raw = bytearray(tampered[-1][-1].bytes)
    raw[1000] ^= 4
    tampered[-1][-1] = zmq.Frame(bytes(raw))
    with pytest.raises(channel.Refused, match="authentication"):
        _through(server, tampered)


@pytest.mark.parametrize("where", ["envelope", "header", "payload", "tag"])
def test_a_flipped_bit_anywhere_is_refused(where, cipher):
    worker, server = _pair()
    sealed = [[bytearray(f) for f in piece] for piece in worker.seal(_msg())]  # small: one message
    assert len(sealed) == 1 and len(sealed[0]) == 3
    piece, frame, at = {"envelope": (0, 0, 40), "header": (0, 1, 3), "payload": (0, 2, 100),
                        "tag": (0, 2, -1)}[where]
    sealed[piece][frame][at] ^= 1
    with pytest.raises(channel.Refused) as e:
        _through(server, sealed)
    assert e.value.reason in ("bad tag", "out of order")
    assert P.decode(_through(server, worker.seal(_msg(seq=2)))).seq == 2  # the connection goes on


def test_a_replayed_message_is_refused_and_a_late_one_within_the_window_is_not():
    worker, server = _pair()
    ping = lambda seq: list(worker.seal(P.encode(P.Message(P.Type.PING, sender=9, seq=seq))))  # noqa: E731
    first, second = ping(1), ping(2)  # one piece each
    _through(server, second)
    assert P.decode(_through(server, first)).seq == 1  # reordered, within the window
    for again in (first, second):
        with pytest.raises(channel.Refused, match="replay"):
            _through(server, again)
    stale = ping(3)
    for _ in range(channel.WINDOW + 1):  # push `stale`'s counter out of the window
        _through(server, worker.seal([b"x"]))
    with pytest.raises(channel.Refused, match="replay"):
        _through(server, stale)


def test_frames_from_another_connection_or_message_are_refused():
    keys = job_keys.new_keys()
    a_worker, a_server = _pair(keys)
    b_worker, b_server = _pair(keys)  # same job, another connection
    with pytest.raises(channel.Refused, match="bad tag"):
        _through(b_server, a_worker.seal(_msg()))
    # 1.2 MB: the header alone, then the payload in pieces of its own
    one, two = list(a_worker.seal(_msg(300_000, seq=1))), list(a_worker.seal(_msg(300_000, seq=2)))
    with pytest.raises(channel.Refused, match="out of order"):
        _through(a_server, [one[0], two[1]])  # a piece of another message
    with pytest.raises(channel.Refused, match="bad tag"):
        _through(a_server, [two[0], [two[1][0], one[1][1]]])  # a payload moved between messages
    with pytest.raises(channel.Refused, match="malformed"):
        a_server.open(one[0][:1])  # a frame dropped


def test_a_stranger_cannot_handshake_nor_pass_for_the_server():
    keys, other = job_keys.new_keys(), job_keys.new_keys()
    doors = handshake.Acceptor(handshake.psk(keys.secret))
    with pytest.raises(channel.Refused, match="bad handshake"):
        doors.hello(b"stranger", handshake.Hello(handshake.psk(other.secret)).message)
    assert not doors.sessions
    hello = handshake.Hello(handshake.psk(keys.secret))
    forged = handshake.Acceptor(handshake.psk(other.secret)).hello(b"w", handshake.Hello(handshake.psk(other.secret)).message)
    with pytest.raises(channel.Refused, match="bad handshake"):
        hello.welcome(forged)
    for junk in ([b"garbage"], P.encode(P.Message(P.Type.PULL, sender=1, seq=1, key=0)), []):
        with pytest.raises(channel.Refused, match="not tfkv"):
            channel.envelope(junk)


def _reply(data, seq=7):
    return P.encode(P.Message(P.Type.PULL, seq=seq, key=3, data=data, reply=True))


@pytest.mark.parametrize("n", [1000, 600_000])  # a whole frame, and one in 1 MiB pieces
def test_a_frame_is_opened_where_into_names_and_the_protocol_frame_views_it(n):
    """A worker's pull lands in its destination: the payload's plaintext is written there by the
    cipher (no received buffer to copy from), and the decoded reply views that memory."""
    worker, server = _pair()
    data = np.arange(n, dtype=np.float32)
    dest = np.zeros(n, np.float32)
    asked = []

    def into(head, frame, size):
        asked.append((P.HEADER.unpack(head)[6], frame, size))
        return dest.view(np.uint8)

    got = None
    for piece in server.seal(_reply(data)):
        got = worker.open(piece, into)
    msg = P.decode(got, max_count=n)
    assert asked == [(7, 1, data.nbytes)]  # once, as the payload begins, with its opened header before it
    assert np.array_equal(dest, data) and np.shares_memory(msg.data, dest)


def test_into_may_decline_and_may_not_name_a_buffer_of_another_size():
    worker, server = _pair()
    data = np.arange(1000, dtype=np.float32)
    msg = P.decode(_through(worker, server.seal(_reply(data))))  # no into: the received buffer
    assert np.array_equal(msg.data, data)
    msg = P.decode(worker.open(next(server.seal(_reply(data))), lambda head, frame, size: None))
    assert np.array_equal(msg.data, data)
    with pytest.raises(ValueError, match="3996 bytes"):
        worker.open(next(server.seal(_reply(data))), lambda head, frame, size: np.zeros(999, np.float32).view(np.uint8))


def test_a_tampered_payload_opened_into_a_destination_is_refused_and_leaves_no_plaintext_there(cipher):
    worker, server = _pair()
    data = np.arange(1000, dtype=np.float32) + 1
    dest = np.full(1000, 5, np.float32)
    sealed = next(server.seal(_reply(data)))
    sealed[-1][100] ^= 1
    with pytest.raises(channel.Refused, match="authentication"):
        worker.open(sealed, lambda head, frame, size: dest.view(np.uint8))
    assert not dest.any()  # zeroed: never unauthenticated bytes (OpenSSL's GCM writes them before the tag check)


def test_each_reply_of_a_batch_is_asked_for_with_its_own_header():
    """Replies to one peer travel together ([header, payload, header, payload] in one message):
    `into` sees each payload's own header, so each lands in its own destination."""
    worker, server = _pair()
    a, b = np.arange(10, dtype=np.float32), np.arange(20, dtype=np.float32) + 100
    dests = {1: np.zeros(10, np.float32), 2: np.zeros(20, np.float32)}

    def into(head, frame, size):
        seq = P.HEADER.unpack(head)[6]
        return dests[seq].view(np.uint8) if dests[seq].nbytes == size else None

    got = worker.open(next(server.seal(_reply(a, seq=1) + _reply(b, seq=2))), into)
    first, second = (P.decode(m) for m in P.split(got))
    assert np.array_equal(dests[1], a) and np.array_equal(dests[2], b)
    assert np.shares_memory(first.data, dests[1]) and np.shares_memory(second.data, dests[2])


def test_into_is_asked_for_payloads_only_with_their_own_headers_whatever_a_payload_looks_like():
    """Which frame is a header is read from the headers' flags (as protocol.split does), never
    guessed from a frame's size: a 28-byte payload that reads as a PULL header of another request
    is not taken for one, so nothing lands in that request's destination."""
    worker, server = _pair()
    lookalike = np.frombuffer(_reply(np.zeros(7, np.float32), seq=2)[0], np.float32)  # 7 floats: 28 bytes
    asked = []

    def into(head, frame, size):
        asked.append((P.HEADER.unpack(head)[6], frame, size))
        return None

    got = worker.open(next(server.seal(_reply(lookalike, seq=1) + _reply(np.arange(7, dtype=np.float32), seq=2))),
                      into)
    assert asked == [(1, 1, 28), (2, 3, 28)]
    first, second = (P.decode(m) for m in P.split(got))
    assert first.data.tobytes() == lookalike.tobytes() and second.seq == 2


# -- the handshake ------------------------------------------------------------------------------


def test_a_hello_seen_before_gets_no_welcome_on_another_connection_and_no_session():
    """A HELLO replayed on fresh connections (by one who saw it and holds no key), or on its own,
    is refused and keeps nothing (a worker whose WELCOME was lost sends a fresh HELLO)."""
    psk = handshake.psk(job_keys.new_keys().secret)
    doors, hello = handshake.Acceptor(psk), handshake.Hello(psk)
    answer = doors.hello(b"worker", hello.message)
    with pytest.raises(channel.Refused, match="replay"):
        doors.hello(b"worker", hello.message)
    for i in range(100):
        with pytest.raises(channel.Refused, match="replay"):
            doors.hello(b"replayer %d" % i, hello.message)
    assert list(doors.sessions) == [b"worker"]
    worker = hello.welcome(answer)
    assert P.decode(doors.open(b"worker", next(worker.seal(_msg())))).seq == 1


def _handshake(doors, side, identity=b"worker", now=0.0):
    """Carry one Initiator's messages to `doors` on connection `identity` (and the answers back),
    from time `now` on, until it has a session; how many HELLOs it took."""
    hellos = 0
    while side.session is None:
        *pings, hello = side.due(now)
        now += handshake.RETRY_MAX
        assert hellos < 3
        hellos += 1
        for sealed in side.answer(doors.hello(identity, hello)):
            got = doors.open(identity, sealed)
            for reply in doors.sessions[identity].seal(P.encode(P.Message(P.Type.PING, seq=P.decode(got).seq,
                                                                          reply=True, meta={"held": 0}))):
                side.answer(reply)
    return hellos


def test_a_worker_confirms_its_session_with_a_ping_and_then_sends_nothing_more_of_the_handshake():
    psk = handshake.psk(job_keys.new_keys().secret)
    doors, side = handshake.Acceptor(psk), handshake.Initiator(psk, sender=9)
    assert _handshake(doors, side) == 1 and doors.sessions[b"worker"].established
    assert side.due(10**6) == []  # done: no HELLO again, whatever the time
    reply = P.decode(side.session.open(next(doors.sessions[b"worker"].seal(_msg()))))
    assert reply.seq == 1 and P.decode(doors.open(b"worker", next(side.session.seal(_msg(seq=2))))).seq == 2


def test_a_welcome_lost_with_its_connection_is_followed_by_a_fresh_hello_on_the_new_one():
    """Issue 40 (11): a connection dropped before its WELCOME arrived. ZeroMQ reconnects under a new
    identity; the HELLO sent again there used to be refused as a replay, and the worker gave up
    after 30 s. Now a fresh HELLO (another X25519 key) goes once the first is RETRY s unanswered;
    the first HELLO replayed is still refused."""
    psk = handshake.psk(job_keys.new_keys().secret)
    doors, side = handshake.Acceptor(psk), handshake.Initiator(psk, sender=9)
    (first,) = side.due(0.0)
    doors.hello(b"lost", first)  # its WELCOME is lost with the connection
    assert side.due(handshake.RETRY / 2) == []  # not yet overdue
    (again,) = side.due(handshake.RETRY)  # no session welcomed: a HELLO alone
    assert again[1][:32] != first[1][:32]  # a fresh X25519 key
    for sealed in side.answer(doors.hello(b"new", again)):
        got = P.decode(doors.open(b"new", sealed))
        assert got.type == P.Type.PING and got.seq == handshake.CONFIRM_SEQ and got.sender == 9
        side.answer(next(doors.sessions[b"new"].seal(P.encode(P.Message(P.Type.PING, seq=0, reply=True,
                                                                          meta={"held": 0})))))
    assert side.session is not None
    assert P.decode(doors.open(b"new", next(side.session.seal(_msg())))).seq == 1
    with pytest.raises(channel.Refused, match="replay"):
        doors.hello(b"replayer", first)


def test_a_connection_dropped_just_after_its_welcome_gets_a_new_handshake():
    """Issue 40 (11): the WELCOME arrived, then the connection dropped: the worker's PING, on the
    new connection, finds no session there (it used to send its requests so and fail after 64 s).
    Unanswered, it is followed by a fresh HELLO on the new connection, whose session then serves."""
    psk = handshake.psk(job_keys.new_keys().secret)
    doors, side = handshake.Acceptor(psk), handshake.Initiator(psk, sender=9)
    (ping,) = side.answer(doors.hello(b"old", *side.due(0.0)))
    with pytest.raises(channel.Refused, match="no session"):
        doors.open(b"new", ping)  # the PING went on the new connection
    assert side.session is None
    assert side.due(handshake.RETRY / 2) == []  # the PING is not overdue yet
    assert _handshake(doors, side, b"new", now=handshake.RETRY) == 1 and doors.sessions[b"new"].established
    assert P.decode(doors.open(b"new", next(side.session.seal(_msg())))).seq == 1
    with pytest.raises(channel.Refused, match="no session"):  # what the old session seals opens nowhere else
        doors.open(b"other", next(doors.sessions[b"old"].seal(_msg())))


def _answer_ping(doors, identity, sealed):
    """The server's answer to a PING sealed on connection `identity`, sealed back."""
    got = P.decode(doors.open(identity, sealed))
    assert got.type == P.Type.PING
    return next(doors.sessions[identity].seal(P.encode(P.Message(P.Type.PING, seq=got.seq, reply=True,
                                                                 meta={"held": 0}))))


def test_a_lost_answer_to_the_ping_is_asked_again_under_the_same_session():
    """A lossy link (a proxy) drops the PING's answer: the server holds the session, established,
    and refuses a HELLO on that connection. The worker's retry PINGs again under the session
    (a new counter: no replay) and takes the answer."""
    psk = handshake.psk(job_keys.new_keys().secret)
    doors, side = handshake.Acceptor(psk), handshake.Initiator(psk, sender=9)
    (ping,) = side.answer(doors.hello(b"w", *side.due(0.0)))
    _answer_ping(doors, b"w", ping)  # lost on the way
    again, hello = side.due(handshake.RETRY)
    side.answer(_answer_ping(doors, b"w", again))
    with pytest.raises(channel.Refused, match="already in use"):
        doors.hello(b"w", hello)
    assert side.session is not None
    assert P.decode(doors.open(b"w", next(side.session.seal(_msg())))).seq == 1


def test_two_hellos_welcomed_on_one_connection_keep_a_session_each_until_the_first_message():
    """A server slow to answer: the worker's fresh HELLO went on the same connection, and both got
    a WELCOME. Whichever session the worker's first message is sealed with is the connection's
    (the later HELLO used to replace the earlier one's session); the other opens nothing there."""
    psk = handshake.psk(job_keys.new_keys().secret)
    for took in (0, 1):
        doors, side = handshake.Acceptor(psk), handshake.Initiator(psk, sender=9)
        welcomes = [doors.hello(b"w", side.due(t)[-1]) for t in (0.0, handshake.RETRY)]
        pings = [side.answer(w)[0] for w in welcomes]
        got = P.decode(doors.open(b"w", pings[took]))
        assert got.type == P.Type.PING and doors.sessions[b"w"].established
        with pytest.raises(channel.Refused):  # the other session's: refused (replay: its counter was taken)
            doors.open(b"w", pings[1 - took])
        side.answer(next(doors.sessions[b"w"].seal(P.encode(P.Message(P.Type.PING, seq=0, reply=True,
                                                                        meta={"held": 0})))))
        assert P.decode(doors.open(b"w", next(side.session.seal(_msg())))).seq == 1


def test_a_worker_refuses_what_is_no_answer_to_its_handshake():
    psk = handshake.psk(job_keys.new_keys().secret)
    side = handshake.Initiator(psk, sender=9)
    other = handshake.Hello(psk)  # a WELCOME made for another HELLO
    assert len(side.due(0.0)) == 1
    with pytest.raises(channel.Refused, match="for this HELLO"):
        side.answer(handshake.Acceptor(psk).hello(b"w", other.message))
    worker, server = _pair()
    with pytest.raises(channel.Refused, match="before any WELCOME"):  # sealed, but under no session of ours
        side.answer(next(server.seal(_msg())))
    assert side.session is None


def test_a_hello_too_old_or_from_the_future_is_refused_naming_the_clock():
    import handshakes

    psk = handshake.psk(job_keys.new_keys().secret)
    doors = handshake.Acceptor(psk)
    public = handshake.Hello(psk).public
    for off in (-handshake.FRESH - 5, handshake.FRESH + 5):
        with pytest.raises(channel.Refused, match=r"s (before|after) this server's clock says.*NTP") as e:
            doors.hello(b"w", handshakes.hello(psk, public, time.time_ns() - int(off * 1e9)))
        assert e.value.reason == "stale"
    doors.hello(b"w", handshakes.hello(psk, public, time.time_ns() - int((handshake.FRESH - 5) * 1e9)))


def test_connections_welcomed_and_silent_are_bounded(monkeypatch):
    monkeypatch.setattr(handshake, "MAX_PENDING", 5)
    psk = handshake.psk(job_keys.new_keys().secret)
    doors = handshake.Acceptor(psk)
    hellos = [handshake.Hello(psk) for _ in range(8)]
    worker = hellos[0].welcome(doors.hello(b"c0", hellos[0].message))
    doors.open(b"c0", next(worker.seal(_msg())))  # established: no longer pending
    for i, h in enumerate(hellos[1:], 1):
        doors.hello(b"c%d" % i, h.message)
    assert sorted(doors.sessions) == [b"c0", b"c3", b"c4", b"c5", b"c6", b"c7"]  # the oldest silent ones forgotten


def test_the_replay_cache_is_bounded_and_forgets_no_replay(monkeypatch):
    monkeypatch.setattr(handshake, "MAX_SEEN", 4)
    psk = handshake.psk(job_keys.new_keys().secret)
    doors = handshake.Acceptor(psk)
    hellos = [handshake.Hello(psk) for _ in range(10)]
    for i, h in enumerate(hellos):
        doors.hello(b"c%d" % i, h.message)
    assert len(doors._seen) <= 4
    for h in hellos:  # forgotten by the cache or not, none is welcomed again
        with pytest.raises(channel.Refused, match="replay"):
            doors.hello(b"again", h.message)


@pytest.mark.parametrize("key", range(14))
def test_a_small_order_key_is_a_bad_handshake_at_either_end(key):
    """A HELLO or a WELCOME made with the job's key around an X25519 key of small order: refused
    as a bad handshake (cryptography's ValueError used to end the server, or the worker)."""
    import handshakes

    psk = handshake.psk(job_keys.new_keys().secret)
    doors = handshake.Acceptor(psk)
    with pytest.raises(channel.Refused, match="small order") as e:
        doors.hello(b"member", handshakes.hello(psk, handshakes.SMALL_ORDER[key]))
    assert e.value.reason == "bad handshake" and not doors.sessions
    hello = handshake.Hello(psk)
    with pytest.raises(channel.Refused, match="small order") as e:
        hello.welcome(handshakes.welcome(psk, hello.message, handshakes.SMALL_ORDER[key], aead.AesGcm256.ID))
    assert e.value.reason == "bad handshake"


def test_the_cipher_is_aegis_where_both_ends_have_it_else_aes_gcm(monkeypatch):
    psk = handshake.psk(job_keys.new_keys().secret)
    both = handshake.Hello(psk)
    assert both.welcome(handshake.Acceptor(psk).hello(b"w", both.message)).cipher is aead.Aegis128X4
    monkeypatch.setattr(aead, "available", lambda: (aead.AesGcm256,))
    worker_without = handshake.Hello(psk)
    monkeypatch.undo()
    session = worker_without.welcome(handshake.Acceptor(psk).hello(b"w", worker_without.message))
    assert session.cipher is aead.AesGcm256
    worker_with = handshake.Hello(psk)
    monkeypatch.setattr(aead, "available", lambda: (aead.AesGcm256,))
    doors = handshake.Acceptor(psk)  # a server without aeg
    worker = worker_with.welcome(doors.hello(b"w", worker_with.message))
    assert worker.cipher is aead.AesGcm256 and doors.sessions[b"w"].cipher is aead.AesGcm256
    assert P.decode(doors.open(b"w", next(worker.seal(_msg())))).seq == 1


def test_a_downgrade_on_the_path_is_refused():
    """One on the path without the key strips AEGIS from a HELLO, or turns a WELCOME's choice to
    AES-256-GCM: the HMAC over the offer and the choice refuses both (and the keys are derived
    from the whole exchange, so agreeing on another cipher would give other keys)."""
    psk = handshake.psk(job_keys.new_keys().secret)
    doors, hello = handshake.Acceptor(psk), handshake.Hello(psk)
    stripped = [hello.message[0], bytearray(hello.message[1])]
    assert stripped[1][handshake._PUBLIC + 8] == 0b110  # AEGIS-128X4 and AES-256-GCM offered
    stripped[1][handshake._PUBLIC + 8] = 1 << aead.AesGcm256.ID
    with pytest.raises(channel.Refused, match="bad handshake"):
        doors.hello(b"w", stripped)
    answer = doors.hello(b"w", hello.message)
    assert answer[1][handshake._PUBLIC] == aead.Aegis128X4.ID
    downgraded = [answer[0], bytearray(answer[1])]
    downgraded[1][handshake._PUBLIC] = aead.AesGcm256.ID
    with pytest.raises(channel.Refused, match="bad handshake"):
        hello.welcome(downgraded)
    assert hello.welcome(answer).cipher is aead.Aegis128X4


def test_the_keys_depend_on_the_cipher_and_on_every_byte_of_the_exchange():
    a = handshake._derive(aead.AesGcm256, b"p" * 32, b"s" * 32, b"transcript")
    assert a != handshake._derive(aead.AesGcm256, b"p" * 32, b"s" * 32, b"transcripT")
    assert a[0][:16] != handshake._derive(aead.Aegis128X4, b"p" * 32, b"s" * 32, b"transcript")[0]
    assert [len(k) for k in a] == [32, 4, 32, 4]  # AES-256 keys, 4-byte salts + 8-byte counters
