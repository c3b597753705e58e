"""The replication stream's codec (``shmq.protocol.replication``), without I/O: every frame
whole, byte by byte, with trailing data; and what it refuses.  And the standby's check of a
round's journal records (``shmq.journal.check_records``)."""

from __future__ import annotations

import struct

import pytest

from shmq.errors import ProtocolError, Status
from shmq.journal import check_records, encode_messages, encode_state
from shmq.protocol.replication import HEADER_SIZE, MAGIC, K, StreamDecoder, StreamFrame, encode

FRAMES = [
    StreamFrame(K.HELLO, {"token": "t", "epoch": 1, "node": "b:7878",
                          "queues": {"q": {"created_ns": 5, "next": 9}}}),
    StreamFrame(K.WELCOME, {"epoch": 2, "node": "a:7878"}),
    StreamFrame(K.REFUSED, {"code": int(Status.AUTH_FAILED), "message": "wrong token"}),
    StreamFrame(K.QUEUE, {"meta": {"name": "q"}, "full": True, "memory": False, "discard_from": None}),
    StreamFrame(K.ROUND, {"queue": "q", "created_ns": 5, "seq": 3, "next": 11, "last": True, "ack": 1},
                bytes(encode_messages([(9, 1, b"x"), (10, 2, b"yy")]) + encode_state(b"{}"))),
    StreamFrame(K.DROP, {"queue": "q", "created_ns": 5}),
    StreamFrame(K.SYNCED, {}),
    StreamFrame(K.ACK, {"seq": 3}),
    StreamFrame(K.BEAT, {}),
]
WIRE = b"".join(encode(f.kind, f.header, f.body) for f in FRAMES)


def test_every_kind_round_trips_whole() -> None:
    assert StreamDecoder().feed(WIRE) == FRAMES


def test_byte_by_byte_gives_the_same_frames() -> None:
    dec = StreamDecoder()
    got = []
    for i in range(len(WIRE)):
        got += dec.feed(WIRE[i:i + 1])
    assert got == FRAMES
    assert dec.received == len(WIRE)


def test_trailing_data_waits_for_the_rest() -> None:
    one = encode(K.ACK, {"seq": 1})
    dec = StreamDecoder()
    assert dec.feed(one + one[:7]) == [StreamFrame(K.ACK, {"seq": 1})]
    assert dec.feed(one[7:]) == [StreamFrame(K.ACK, {"seq": 1})]


def test_the_header_is_as_drawn() -> None:
    wire = encode(K.ACK, {"seq": 1}, b"zz")
    assert wire[:4] == MAGIC == b"SQR1"
    assert struct.unpack_from("<BBHII", wire, 4) == (int(K.ACK), 0, 0, len(b'{"seq":1}'), 2)
    assert wire[HEADER_SIZE:] == b'{"seq":1}zz'


@pytest.mark.parametrize(("wire", "code", "match"), [
    (b"GET / HTTP/1.1\r\n", Status.PROTOCOL_ERROR, "bad magic"),
    (b"SQ", None, None),  # a prefix of the magic: waits
    (b"SQRX" + bytes(12), Status.PROTOCOL_ERROR, "bad magic"),
    (MAGIC + struct.pack("<BBHII", 99, 0, 0, 2, 0) + b"{}", Status.PROTOCOL_ERROR, "unknown"),
    (MAGIC + struct.pack("<BBHII", int(K.ACK), 1, 0, 2, 0) + b"{}", Status.PROTOCOL_ERROR, "unknown"),
    (MAGIC + struct.pack("<BBHII", int(K.ROUND), 0, 0, 2, 1 << 30), Status.PAYLOAD_TOO_LARGE,
     "over the limit"),
    (MAGIC + struct.pack("<BBHII", int(K.ACK), 0, 0, 3, 0) + b"{x}", Status.PROTOCOL_ERROR, "not JSON"),
    (MAGIC + struct.pack("<BBHII", int(K.ACK), 0, 0, 2, 0) + b"[]", Status.PROTOCOL_ERROR,
     "not a JSON object"),
])
def test_what_it_refuses_and_then_refuses_again(wire: bytes, code: Status | None, match: str | None) -> None:
    dec = StreamDecoder()
    if code is None:
        assert dec.feed(wire) == []
        return
    with pytest.raises(ProtocolError, match=match) as e:
        dec.feed(wire)
    assert e.value.code == code
    with pytest.raises(ProtocolError):  # poisoned: the link ends
        dec.feed(encode(K.BEAT))


def test_an_oversized_frame_is_refused_before_its_body_comes() -> None:
    dec = StreamDecoder(max_frame=100)
    head = MAGIC + struct.pack("<BBHII", int(K.ROUND), 0, 0, 10, 91)
    with pytest.raises(ProtocolError, match="over the limit"):
        dec.feed(head)  # the header alone: nothing of the body was needed


# ---------------------------------------------------------------- a round's records


def test_a_round_is_checked_and_split_into_messages_and_state() -> None:
    msgs = encode_messages([(9, 1, b"x", b"meta"), (10, 2, b"yy")])
    state = encode_state(b'{"groups":[]}')
    rec = check_records(bytes(msgs + state), after=8)
    assert bytes(rec.messages) == bytes(msgs)
    assert rec.offsets == (9, 10)
    assert rec.state == bytes(state) and rec.state_body == b'{"groups":[]}'
    only = check_records(bytes(state))
    assert (bytes(only.messages), only.offsets, only.state_body) == (b"", None, b'{"groups":[]}')


@pytest.mark.parametrize(("make", "match"), [
    (lambda m, s: m + s[:-1], "cut short"),
    (lambda m, s: bytes([m[0] ^ 1]) + m[1:] + s, "checksum"),
    (lambda m, s: m[:30] + bytes([m[30] ^ 1]) + m[31:] + s, "checksum"),
    (lambda m, s: s + m, "where messages, then one state"),
    (lambda m, s: m + s + bytes(8), "less than a record header"),
    (lambda m, s: m + m, "does not follow"),
])
def test_a_bad_round_is_refused_naming_what_is_wrong(make: object, match: str) -> None:
    msgs = bytes(encode_messages([(9, 1, b"x"), (10, 2, b"yy")]))
    state = bytes(encode_state(b"{}"))
    with pytest.raises(ValueError, match=match):
        check_records(make(msgs, state))  # type: ignore[operator]


def test_offsets_must_follow_what_the_journal_holds() -> None:
    msgs = bytes(encode_messages([(9, 1, b"x")]))
    assert check_records(msgs, after=8).offsets == (9, 9)
    with pytest.raises(ValueError, match="does not follow 9"):
        check_records(msgs, after=9)
