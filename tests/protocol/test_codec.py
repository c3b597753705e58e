"""The wire codec (shmq/protocol/codec.py) against its reference, docs/protocol.md.

No sockets: bytes in, frames out.  The hex test vectors are parsed out of the doc,
so the doc and the codec cannot drift apart silently.
"""

from __future__ import annotations

import random
import re
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmq import options
from shmq.errors import ProtocolError, Status
from shmq.protocol.codec import (
    HEADER_SIZE,
    MAGIC,
    SCHEMAS,
    VERSION,
    Frame,
    FrameDecoder,
    T,
    consume_frame,
    decode_body,
    decode_deliver,
    decode_joined,
    deliver_frame,
    encode_body,
    encode_frame,
    frame,
    produce_frame,
    produce_ok_frame,
    records_field,
    settle_frame,
)
from tests.support.paths import PROTOCOL_DOC

DOC = PROTOCOL_DOC
TS = 1_700_000_000_000_000_000
HEADER = struct.Struct(">IIBBHI")


def header(length: int, type_: int, msg_id: int = 1, status: int = 0, magic: int = MAGIC,
           version: int = VERSION) -> bytes:
    return HEADER.pack(magic, length, type_, version, status, msg_id)


def doc_vectors() -> dict[str, bytes]:
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"^vector ([a-z_]+):(.*)$", text, re.M)
    out = {name: bytes.fromhex(re.sub(r"[\s|]", "", rest)) for name, rest in found}
    assert len(out) == len(found), "a vector name appears twice in the doc"
    return out


# name: (type, msg_id, status, fields), as the doc's table describes them
VECTORS: dict[str, tuple[T, int, int, dict[str, Any]]] = {
    "handshake": (T.HANDSHAKE, 1, 0, {"token": "", "client": "cli", "affinity": "rpc", "heartbeat_ms": 5000}),
    "heartbeat": (T.HEARTBEAT, 0, 0, {}),
    "produce": (T.PRODUCE, 7, 0, {"queue": "orders", "timeout_ms": 0, "payload": b"hi"}),
    "produce_ok": (T.PRODUCE_OK, 7, 0, {"offset": 42}),
    "consume": (T.CONSUME, 8, 0, {"queue": "orders", "group": "default", "timeout_ms": 1000,
                                  "visibility_ms": 0}),
    "deliver": (T.DELIVER, 8, 0, {"offset": 42, "deliveries": 1, "timestamp_ns": TS, "meta": b"",
                                  "payload": b"hi"}),
    "ack": (T.ACK, 9, 0, {"queue": "orders", "group": "default", "offset": 42, "deliveries": 1}),
    "produce_batch": (T.PRODUCE_BATCH, 10, 0, {"queue": "q", "timeout_ms": 0, "payloads": [b"a", b"bc"]}),
    "deliver_batch": (T.DELIVER_BATCH, 11, 0, {"records": [(1, 1, TS, b"", b"a"),
                                                           (2, 2, TS + 1, b"m", b"bc")]}),
    "ack_batch": (T.ACK_BATCH, 12, 0, {"queue": "q", "group": "default", "settles": [(1, 1), (2, 3)]}),
    "error": (T.ERROR, 13, int(Status.QUEUE_NOT_FOUND), {"message": "no queue named 'x'"}),
    "produce_idempotent": (T.PRODUCE_IDEMPOTENT, 14, 0, {"queue": "q", "producer": "p1", "seq": 7,
                                                         "timeout_ms": 0, "payloads": [b"a"]}),
    "ack_no_reply": (T.ACK_NO_REPLY, 0xFFFFFFFF, 0, {"queue": "orders", "group": "default", "offset": 42,
                                                     "deliveries": 1}),
    "ack_batch_no_reply": (T.ACK_BATCH_NO_REPLY, 0xFFFFFFFF, 0, {"queue": "q", "group": "default",
                                                                 "settles": [(1, 1), (2, 3)]}),
    "ack_range": (T.ACK_RANGE, 15, 0, {"queue": "q", "group": "default", "first": 1, "count": 100,
                                       "deliveries": 1}),
    "ack_range_no_reply": (T.ACK_RANGE_NO_REPLY, 0xFFFFFFFF, 0, {"queue": "q", "group": "default", "first": 1,
                                                                 "count": 100, "deliveries": 1}),
    "info": (T.INFO, 16, 0, {}),
    "info_ok": (T.INFO_OK, 16, 0, {"info": {"workers": 2, "connections": [1, 0]}}),
    "group_seek": (T.GROUP_SEEK, 17, 0, {"queue": "orders", "group": "audit", "timestamp_ns": TS,
                                         "create": 0}),
    "group_seek_ok": (T.GROUP_SEEK_OK, 17, 0, {"offset": 42}),
    # headers (shmq.headers): the block of {"k": "v"} is 01 0001 0001 6b 0001 76
    "produce_headers": (T.PRODUCE, 17, 1, {"queue": "orders", "timeout_ms": 0,
                                           "payload": bytes.fromhex("0100010001 6b 0001 76") + b"hi"}),
    "produce_batch_headers": (T.PRODUCE_BATCH, 18, 1, {"queue": "q", "timeout_ms": 0, "payloads": [
        b"\x00a", bytes.fromhex("0100010001 6b 0001 76") + b"bc"]}),
    "deliver_headers": (T.DELIVER, 19, 0, {"offset": 42, "deliveries": 1, "timestamp_ns": TS,
                                           "meta": bytes.fromhex("0100010001 6b 0001 76"), "payload": b"hi"}),
}

# Sample values per field kind: "full" exercises every byte, "min" the empty and zero cases.
FULL: dict[str, Any] = {
    "u8": 0xA5, "u16": 0xBEEF, "u32": 0xDEADBEEF, "u64": 0x0102030405060708,
    "str": "qu\u00e9ue-\u540d", "blob": b"\x00meta\xff", "rest": b"pay\x00load\xff",
    "json": {"a": [1, 2.5, None, True, "\u00e9"], "b": {}},
    "blobs": [b"", b"a", b"bc" * 100],
    "settles": [(0, 0), (2**64 - 1, 65535), (5, 2)],
    "offsets": [0, 1, 2**64 - 1],
    "records": [(1, 1, TS, b"", b"x"), (2**64 - 1, 65535, 0, b"mmm", b""), (3, 2, TS, b"k", b"\x00" * 300)],
}
MIN: dict[str, Any] = {
    "u8": 0, "u16": 0, "u32": 0, "u64": 0, "str": "", "blob": b"", "rest": b"", "json": None,
    "blobs": [], "settles": [], "offsets": [], "records": [],
}


def sample(t: T, values: dict[str, Any] = FULL) -> dict[str, Any]:
    return {name: values[kind] for name, kind in SCHEMAS[t]}


def sample_frame(t: T, msg_id: int = 5) -> bytes:
    return frame(t, msg_id, **sample(t))


def ends_with_rest(t: T) -> bool:
    return bool(SCHEMAS[t]) and SCHEMAS[t][-1][1] == "rest"


@contextmanager
def raises_code(code: Status) -> Iterator[None]:
    """Like pytest.raises(ProtocolError), and the error's code must be ``code``."""
    with pytest.raises(ProtocolError) as info:
        yield
    assert info.value.code == code, (info.value.code, str(info.value))


# --------------------------------------------------------------------------- the doc


def test_doc_vectors_are_all_there() -> None:
    assert set(doc_vectors()) == set(VECTORS)


@pytest.mark.parametrize("name", sorted(VECTORS))
def test_doc_vector(name: str) -> None:
    wire = doc_vectors()[name]
    t, msg_id, status, fields = VECTORS[name]
    assert frame(t, msg_id, status, **fields) == wire
    assert encode_frame(t, msg_id, encode_body(t, **fields), status) == wire
    frames = FrameDecoder().feed(wire)
    assert frames == [Frame(t, msg_id, status, wire[HEADER_SIZE:])]
    assert decode_body(frames[0].type, frames[0].body) == fields


def test_doc_draws_every_type_with_its_fields() -> None:
    text = DOC.read_text(encoding="utf-8")
    for t in T:
        m = re.search(rf"^### 0x{int(t):02X} {t.name}\n\n(.*)$", text, re.M)
        assert m, f"{t.name} has no section in {DOC.name}"
        drawn = re.findall(r"`(\w+)` (\w+)", m.group(1))
        assert tuple(drawn) == SCHEMAS[t], t.name
        if not SCHEMAS[t]:
            assert "no body" in m.group(1)


def test_doc_status_table_matches_errors() -> None:
    text = DOC.read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| (\d+) \| ([A-Z_]+) \|", text, re.M))
    assert {int(k): v for k, v in rows.items()} == {int(s): s.name for s in Status}


# --------------------------------------------------------------------------- round trips


def test_schemas_cover_every_type() -> None:
    assert set(SCHEMAS) == set(T)


@pytest.mark.parametrize("values", [FULL, MIN], ids=["full", "min"])
@pytest.mark.parametrize("t", list(T), ids=lambda t: t.name)
def test_round_trip(t: T, values: dict[str, Any]) -> None:
    fields = sample(t, values)
    body = encode_body(t, **fields)
    assert decode_body(t, body) == fields
    wire = frame(t, 0xFFFFFFFF, 65535, **fields)
    assert wire == encode_frame(t, 0xFFFFFFFF, body, 65535)
    assert wire[:HEADER_SIZE] == header(len(body), t, 0xFFFFFFFF, 65535)
    (f,) = FrameDecoder().feed(wire)
    assert f == Frame(t, 0xFFFFFFFF, 65535, body)
    assert type(f.type) is T and type(f.body) is bytes
    assert decode_body(f.type, f.body) == fields


def test_encode_accepts_bytes_likes_and_iterables() -> None:
    payloads = (p for p in [bytearray(b"a"), b"b"])
    body = encode_body(T.PRODUCE_BATCH, queue="q", timeout_ms=1, payloads=payloads)
    assert decode_body(T.PRODUCE_BATCH, body)["payloads"] == [b"a", b"b"]
    wire = frame(T.DELIVER, 3, offset=1, deliveries=1, timestamp_ns=2, meta=memoryview(b"m"),
                 payload=memoryview(b"xyz"))
    d = decode_body(T.DELIVER, FrameDecoder().feed(wire)[0].body)
    assert (d["meta"], d["payload"]) == (b"m", b"xyz")
    assert decode_body(T.PRODUCE, bytearray(encode_body(T.PRODUCE, queue="q", timeout_ms=0, payload=b"p")))[
        "payload"] == b"p"


def test_frame_is_frozen() -> None:
    f = Frame(T.ACK, 1)
    assert (f.status, f.body) == (0, b"")
    with pytest.raises(AttributeError):
        f.msg_id = 2  # type: ignore[misc]


# --------------------------------------------------------------------------- the decoder, h11 style

STREAM_TYPES = list(T)


def all_frames() -> tuple[bytes, list[Frame]]:
    wire = b"".join(sample_frame(t, i) for i, t in enumerate(STREAM_TYPES))
    frames = [Frame(t, i, 0, encode_body(t, **sample(t))) for i, t in enumerate(STREAM_TYPES)]
    return wire, frames


@pytest.mark.parametrize("t", list(T), ids=lambda t: t.name)
def test_feed_whole_and_bytewise(t: T) -> None:
    wire = sample_frame(t)
    expect = Frame(t, 5, 0, wire[HEADER_SIZE:])
    d = FrameDecoder()
    assert d.feed(wire) == [expect]
    assert d.buffered == 0
    d = FrameDecoder()
    for i in range(len(wire) - 1):
        assert d.feed(wire[i:i + 1]) == []
        assert d.buffered == i + 1
    assert d.feed(wire[-1:]) == [expect]
    assert d.buffered == 0


@pytest.mark.parametrize("t", list(T), ids=lambda t: t.name)
def test_feed_with_trailing_data(t: T) -> None:
    wire, nxt = sample_frame(t, 1), sample_frame(T.PRODUCE_OK, 2)
    d = FrameDecoder()
    assert [f.msg_id for f in d.feed(wire + nxt)] == [1, 2]
    assert d.buffered == 0
    for cut in (1, HEADER_SIZE - 1, HEADER_SIZE, len(nxt) - 1):
        d = FrameDecoder()
        assert [f.msg_id for f in d.feed(wire + nxt[:cut])] == [1]
        assert d.buffered == cut
        assert [f.msg_id for f in d.feed(nxt[cut:])] == [2]
        assert d.buffered == 0


@pytest.mark.parametrize("seed", range(20))
def test_feed_random_chunks(seed: int) -> None:
    wire, frames = all_frames()
    rng = random.Random(seed)
    d = FrameDecoder()
    got: list[Frame] = []
    pos = 0
    while pos < len(wire):
        n = rng.choice([1, 2, 3, 15, 16, 17, rng.randrange(1, 600)])
        chunk = wire[pos:pos + n]
        got += d.feed(rng.choice([bytes, bytearray, memoryview])(chunk))
        pos += n
        assert d.buffered == len(wire[:pos]) - sum(HEADER_SIZE + len(f.body) for f in got)
    assert got == frames
    assert d.buffered == 0


def test_feed_many_frames_at_once() -> None:
    one = frame(T.ACK, 0, queue="orders", group="default", offset=1, deliveries=1)
    n = 20_000
    got = FrameDecoder().feed(one * n + one[:3])
    assert len(got) == n and got[-1] == got[0]


def test_feed_large_frame_in_chunks() -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    wire = frame(T.PRODUCE, 1, queue="q", timeout_ms=0, payload=payload) + frame(T.ACK_OK, 2)
    d = FrameDecoder()
    got: list[Frame] = []
    for i in range(0, len(wire), 65536):
        got += d.feed(wire[i:i + 65536])
    assert [f.msg_id for f in got] == [1, 2]
    assert decode_body(T.PRODUCE, got[0].body)["payload"] == payload


def test_feed_empty() -> None:
    d = FrameDecoder()
    assert d.feed(b"") == []
    assert d.buffered == 0


def test_body_of_exactly_max_frame_is_accepted() -> None:
    d = FrameDecoder(max_frame=100)
    assert d.max_frame == 100
    wire = frame(T.PRODUCE, 1, queue="q", timeout_ms=0, payload=b"x" * (100 - 7))
    assert len(wire) == HEADER_SIZE + 100
    assert len(d.feed(wire)) == 1


# --------------------------------------------------------------------------- malformed frames


def test_bad_magic() -> None:
    with raises_code(Status.BAD_MAGIC):
        FrameDecoder().feed(header(0, T.ACK_OK, magic=0xDEADBEEE))


def test_bad_magic_is_refused_before_a_whole_header() -> None:
    d = FrameDecoder()
    assert d.feed(b"\xde\xad") == []  # a good start so far
    with raises_code(Status.BAD_MAGIC):
        d.feed(b"\xbf")
    with raises_code(Status.BAD_MAGIC):
        FrameDecoder().feed(b"GET / HTTP/1.1\r\n\r\n")
    with raises_code(Status.BAD_MAGIC):
        FrameDecoder().feed(b"G")


def test_bad_magic_after_a_good_frame() -> None:
    d = FrameDecoder()
    assert len(d.feed(frame(T.ACK_OK, 1))) == 1
    with raises_code(Status.BAD_MAGIC):
        d.feed(b"\x00" * HEADER_SIZE)


@pytest.mark.parametrize("version", [0, 2, 255])
def test_wrong_version(version: int) -> None:
    with raises_code(Status.VERSION_MISMATCH):
        FrameDecoder().feed(header(0, T.ACK_OK, version=version))


def test_unknown_types() -> None:
    known = {int(t) for t in T}
    for code in range(256):
        if code not in known:
            with raises_code(Status.INVALID_TYPE):
                FrameDecoder().feed(header(0, code))


@pytest.mark.parametrize("max_frame", [0, 100, options.MAX_FRAME])
def test_oversized_frame_refused_from_its_header(max_frame: int) -> None:
    d = FrameDecoder(max_frame) if max_frame != options.MAX_FRAME else FrameDecoder()
    with raises_code(Status.PAYLOAD_TOO_LARGE):
        d.feed(header(max_frame + 1, T.PRODUCE))  # the header only: no body sent at all
    assert d.buffered == 0


def test_huge_length_refused() -> None:
    with raises_code(Status.PAYLOAD_TOO_LARGE):
        FrameDecoder().feed(header(0xFFFFFFFF, T.PRODUCE) + b"x")


def test_header_checks_in_order() -> None:
    with raises_code(Status.BAD_MAGIC):
        FrameDecoder().feed(header(1 << 30, 0x03, magic=1, version=9))
    with raises_code(Status.VERSION_MISMATCH):
        FrameDecoder().feed(header(1 << 30, 0x03, version=9))
    with raises_code(Status.INVALID_TYPE):
        FrameDecoder().feed(header(1 << 30, 0x03))


def test_poisoned_after_an_error() -> None:
    d = FrameDecoder()
    with raises_code(Status.VERSION_MISMATCH):
        d.feed(header(0, T.ACK_OK, version=2))
    errors = []
    for data in (frame(T.ACK_OK, 1), b"", b"\xde"):
        with pytest.raises(ProtocolError) as info:
            d.feed(data)
        errors.append(info.value)
    assert all(e is errors[0] for e in errors)
    assert errors[0].code == Status.VERSION_MISMATCH
    assert d.buffered == 0


# --------------------------------------------------------------------------- malformed bodies


def test_decode_body_unknown_type() -> None:
    with raises_code(Status.INVALID_TYPE):
        decode_body(0x03, b"")


@pytest.mark.parametrize("t", list(T), ids=lambda t: t.name)
def test_truncated_body(t: T) -> None:
    body = encode_body(t, **sample(t))
    fields = sample(t)
    # a cut inside a rest field is just a shorter payload
    stop = len(body) - len(fields[SCHEMAS[t][-1][0]]) if ends_with_rest(t) else len(body)
    for k in range(stop):
        with raises_code(Status.PROTOCOL_ERROR):
            decode_body(t, body[:k])


@pytest.mark.parametrize("t", [t for t in T if not ends_with_rest(t)], ids=lambda t: t.name)
def test_trailing_bytes_in_body(t: T) -> None:
    for values in (FULL, MIN):
        body = encode_body(t, **sample(t, values))
        for extra in (b"\x00", b"\xff" * 9):
            with raises_code(Status.PROTOCOL_ERROR):
                decode_body(t, body + extra)


@pytest.mark.parametrize("t", [T.PRODUCE_BATCH, T.PRODUCE_IDEMPOTENT], ids=lambda t: t.name)
def test_a_joined_decode_is_the_decode_and_fails_as_it_fails(t: T) -> None:
    """``decode_joined`` (the broker's PRODUCE_BATCH without headers): the same fields, the
    payloads as their lengths and one view of their bytes; every malformed body refused
    with the same code, cut anywhere, with bytes past its end or over MAX_BATCH."""
    for values in (FULL, MIN):
        body = encode_body(t, **sample(t, values))
        plain, joined = decode_body(t, body), decode_joined(t, body)
        assert joined["payloads"].payloads() == plain.pop("payloads")
        assert joined.pop("payloads").lens == [len(p) for p in sample(t, values)["payloads"]]
        assert joined == plain
        for k in range(len(body)):
            with raises_code(Status.PROTOCOL_ERROR):
                decode_joined(t, body[:k])
        with raises_code(Status.PROTOCOL_ERROR):
            decode_joined(t, body + b"\x00")
    none = encode_body(t, **{**sample(t), "payloads": []})  # ends with the count, 0: made one over
    big = none[:-4] + (options.MAX_BATCH + 1).to_bytes(4, "big") + bytes(4 * (options.MAX_BATCH + 1))
    with raises_code(Status.PROTOCOL_ERROR):
        decode_body(t, big)
    with raises_code(Status.PROTOCOL_ERROR):
        decode_joined(t, big)
    with pytest.raises(ValueError):
        decode_joined(T.PRODUCE, encode_body(T.PRODUCE, queue="q", timeout_ms=0, payload=b""))


def test_rest_takes_trailing_bytes() -> None:
    body = encode_body(T.PRODUCE, queue="q", timeout_ms=0, payload=b"")
    assert decode_body(T.PRODUCE, body + b"\x00")["payload"] == b"\x00"


@pytest.mark.parametrize("bad", [b"\xff", b"\xc3", b"\xed\xa0\x80", b"ok\x80"])
def test_bad_utf8_in_str(bad: bytes) -> None:
    body = struct.pack(">H", len(bad)) + bad + struct.pack(">H", 3) + b"cli"
    with raises_code(Status.PROTOCOL_ERROR):
        decode_body(T.HANDSHAKE, body)
    with raises_code(Status.PROTOCOL_ERROR):
        decode_body(T.ERROR, struct.pack(">H", len(bad)) + bad)


@pytest.mark.parametrize("text", [b"", b"{", b"{'a': 1}", b"nul", b"[1,]", b"\xff", b"\xef\xbb\xbf{}",
                                  b"1 2", b"[" * 100_000 + b"]" * 100_000])
def test_bad_json(text: bytes) -> None:
    body = struct.pack(">H", 1) + b"q" + struct.pack(">I", len(text)) + text
    with raises_code(Status.PROTOCOL_ERROR):
        decode_body(T.CREATE_QUEUE, body)


def test_any_json_value() -> None:
    for value in (None, 1, -2.5, "s", [1, [2]], {"k": {"v": [True, False]}}):
        assert decode_body(T.STATS_OK, encode_body(T.STATS_OK, stats=value)) == {"stats": value}


LIST_TYPES = [(t, name, kind) for t in T for name, kind in SCHEMAS[t] if kind in
              ("blobs", "settles", "offsets", "records")]


@pytest.mark.parametrize("t,name,kind", LIST_TYPES, ids=lambda x: getattr(x, "name", str(x)))
def test_counts_over_max_batch(t: T, name: str, kind: str) -> None:
    fields = sample(t, MIN)
    body = encode_body(t, **fields)
    assert body.endswith(b"\x00\x00\x00\x00")  # the empty list's count is last
    over = body[:-4] + struct.pack(">I", options.MAX_BATCH + 1)
    with raises_code(Status.PROTOCOL_ERROR):
        decode_body(t, over)
    with raises_code(Status.PROTOCOL_ERROR):
        decode_body(t, body[:-4] + b"\xff\xff\xff\xff")
    item = FULL[kind][0]
    fields[name] = [item] * options.MAX_BATCH
    assert len(decode_body(t, encode_body(t, **fields))[name]) == options.MAX_BATCH
    fields[name] = [item] * (options.MAX_BATCH + 1)
    with pytest.raises(ValueError, match="batch"):
        encode_body(t, **fields)


def test_count_larger_than_body() -> None:
    for t, _, _ in LIST_TYPES:
        body = encode_body(t, **sample(t, MIN))
        with raises_code(Status.PROTOCOL_ERROR):
            decode_body(t, body[:-4] + struct.pack(">I", 3))


# --------------------------------------------------------------------------- encoder arguments


def test_encode_missing_and_extra_fields() -> None:
    with pytest.raises(ValueError, match="missing"):
        encode_body(T.PRODUCE, queue="q", timeout_ms=0)
    with pytest.raises(ValueError, match="unexpected"):
        encode_body(T.PRODUCE_OK, offset=1, extra=2)
    with pytest.raises(ValueError):
        encode_body(T.ACK_OK, offset=1)
    with pytest.raises(ValueError):
        frame(T.CONSUME, 1, queue="q")


@pytest.mark.parametrize("fields", [
    {"offset": -1}, {"offset": 2**64},
])
def test_encode_int_out_of_range(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        encode_body(T.PRODUCE_OK, **fields)


@pytest.mark.parametrize("meta,payload", [(b"", b""), (b"", b"hi"), (b"\x00m", b"p" * 300)])
def test_hot_answers_are_the_schema_encoding(meta: bytes, payload: bytes) -> None:
    assert produce_ok_frame(7, 2**64 - 1) == frame(T.PRODUCE_OK, 7, offset=2**64 - 1)
    assert deliver_frame(0xFFFFFFFF, 42, 65535, TS, meta, payload) == frame(
        T.DELIVER, 0xFFFFFFFF, offset=42, deliveries=65535, timestamp_ns=TS, meta=meta, payload=payload)


def test_records_field_from_columns_is_the_records_encoding() -> None:
    recs = FULL["records"]
    offs, dcs, stamps, metas, pays = (list(c) for c in zip(*recs, strict=True))
    mlens, plens = [len(m) for m in metas], [len(p) for p in pays]
    data = b"".join(m + p for m, p in zip(metas, pays, strict=True))
    field = records_field(offs, dcs, stamps, mlens, plens, data)
    assert field == encode_body(T.DELIVER_BATCH, records=recs)
    assert decode_body(T.READ_OK, field)["records"] == recs
    with pytest.raises(ValueError, match="add up"):
        records_field(offs, dcs, stamps, mlens, plens, data + b"x")
    with pytest.raises(ValueError, match="length"):
        records_field(offs[:1], dcs, stamps, mlens, plens, data)
    with pytest.raises(ValueError):
        records_field([2**64], [1], [0], [0], [0], b"")
    with pytest.raises(ValueError, match="batch"):
        n = options.MAX_BATCH + 1
        records_field([0] * n, [1] * n, [0] * n, [0] * n, [0] * n, b"")


def test_encode_bad_values() -> None:
    with pytest.raises(ValueError):
        encode_body(T.ERROR, message="x" * 65536)
    assert decode_body(T.ERROR, encode_body(T.ERROR, message="x" * 65535))["message"] == "x" * 65535
    with pytest.raises(ValueError):
        encode_body(T.GROUP_JOIN, queue="q", group="g", start=256)
    with pytest.raises(ValueError):
        encode_body(T.ACK_BATCH, queue="q", group="g", settles=[(1, 65536)])
    with pytest.raises(ValueError):
        encode_body(T.ACK_BATCH_OK, stale=[-1])
    with pytest.raises(ValueError):
        encode_body(0x03)
    with pytest.raises((TypeError, ValueError)):
        encode_body(T.ERROR, message=b"bytes")


def test_encode_frame_bad_header() -> None:
    with pytest.raises(ValueError):
        encode_frame(0x03, 1)
    with pytest.raises(ValueError):
        encode_frame(T.ACK_OK, 2**32)
    with pytest.raises(ValueError):
        encode_frame(T.ACK_OK, 1, b"", 65536)
    with pytest.raises(ValueError):
        frame(T.ACK_OK, -1)


# --------------------------------------------------------------------------- property tests

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def feed_all(chunks: list[bytes], max_frame: int = 4096) -> None:
    """Feed; every frame that comes out is decoded.  Only ProtocolError may escape."""
    d = FrameDecoder(max_frame)
    try:
        for c in chunks:
            for f in d.feed(c):
                assert isinstance(f.type, T) and len(f.body) <= max_frame
                try:
                    decode_body(f.type, f.body)
                except ProtocolError as e:
                    assert e.code == Status.PROTOCOL_ERROR
    except ProtocolError as e:
        assert e.code in (Status.BAD_MAGIC, Status.VERSION_MISMATCH, Status.INVALID_TYPE,
                          Status.PAYLOAD_TOO_LARGE)
        with pytest.raises(ProtocolError):
            d.feed(b"")


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=8))
def test_fuzz_random_bytes(chunks: list[bytes]) -> None:
    feed_all(chunks)


@FUZZ
@given(st.sampled_from(list(T)), st.integers(0, 300), st.binary(max_size=300), st.integers(0, 3))
def test_fuzz_valid_header_random_body(t: T, length: int, body: bytes, version_delta: int) -> None:
    feed_all([header(length, t, version=VERSION if version_delta else 2) + body])


BASE = [sample_frame(t, i) for i, t in enumerate(T)] + [sample_frame(t, 9, ) for t in
                                                        (T.DELIVER_BATCH, T.ACK_BATCH, T.PRODUCE_BATCH)]


@FUZZ
@given(st.data())
def test_fuzz_mutated_frames(data: st.DataObject) -> None:
    wire = bytearray(b"".join(data.draw(st.lists(st.sampled_from(BASE), min_size=1, max_size=3))))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        i = data.draw(st.integers(0, len(wire) - 1)) if wire else 0
        if op == "flip" and wire:
            wire[i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and wire:
            wire[i] = data.draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            wire[i:i] = data.draw(st.binary(min_size=1, max_size=4))
        elif wire:
            del wire[i:i + data.draw(st.integers(1, 4))]
    cut = data.draw(st.integers(0, len(wire)))
    feed_all([bytes(wire[:cut]), bytes(wire[cut:])])


@FUZZ
@given(st.sampled_from(list(T)), st.binary(max_size=200))
def test_fuzz_decode_body(t: T, body: bytes) -> None:
    try:
        decode_body(t, body)
    except ProtocolError as e:
        assert e.code == Status.PROTOCOL_ERROR


@FUZZ
@given(st.data())
def test_fuzz_decode_mutated_body(data: st.DataObject) -> None:
    t = data.draw(st.sampled_from(list(T)))
    body = bytearray(encode_body(t, **sample(t)))
    if body:
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    try:
        decode_body(t, bytes(body))
    except ProtocolError as e:
        assert e.code == Status.PROTOCOL_ERROR


U = {"u8": 8, "u16": 16, "u32": 32, "u64": 64}
BLOB = st.binary(max_size=20)
KIND: dict[str, st.SearchStrategy[Any]] = {
    **{k: st.integers(0, 2**bits - 1) for k, bits in U.items()},
    "str": st.text(max_size=20),
    "blob": BLOB,
    "rest": BLOB,
    "json": st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=8),
    "blobs": st.lists(BLOB, max_size=5),
    "settles": st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 65535)), max_size=5),
    "offsets": st.lists(st.integers(0, 2**64 - 1), max_size=5),
    "records": st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 65535), st.integers(0, 2**64 - 1),
                                  BLOB, BLOB), max_size=5),
}


@FUZZ
@given(st.data())
def test_fuzz_round_trip(data: st.DataObject) -> None:
    t = data.draw(st.sampled_from(list(T)))
    fields = {name: data.draw(KIND[kind], label=name) for name, kind in SCHEMAS[t]}
    msg_id, status = data.draw(st.integers(0, 2**32 - 1)), data.draw(st.integers(0, 65535))
    wire = frame(t, msg_id, status, **fields)
    (f,) = FrameDecoder().feed(wire)
    assert (f.type, f.msg_id, f.status) == (t, msg_id, status)
    assert decode_body(t, f.body) == fields


# ---------------------------------------------------------------- the one-message hot path
NAME = st.text(max_size=20)


@FUZZ
@given(msg_id=st.integers(0, 2**32 - 1), queue=NAME, group=NAME, a=st.integers(0, 2**32 - 1),
       b=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**64 - 1), dc=st.integers(0, 65535),
       ts=st.integers(0, 2**64 - 1), meta=BLOB, payload=BLOB)
def test_one_message_frames_are_the_schema_encoding(msg_id: int, queue: str, group: str, a: int, b: int,
                                                    offset: int, dc: int, ts: int, meta: bytes,
                                                    payload: bytes) -> None:
    q, g = queue.encode(), group.encode()
    assert produce_frame(msg_id, q, a, payload) == frame(T.PRODUCE, msg_id, queue=queue, timeout_ms=a,
                                                         payload=payload)
    assert consume_frame(msg_id, q, g, a, b) == frame(T.CONSUME, msg_id, queue=queue, group=group,
                                                      timeout_ms=a, visibility_ms=b)
    for t in (T.ACK, T.ACK_NO_REPLY):
        assert settle_frame(t, msg_id, q, g, offset, dc) == frame(t, msg_id, queue=queue, group=group,
                                                                  offset=offset, deliveries=dc)
    body = frame(T.DELIVER, msg_id, offset=offset, deliveries=dc, timestamp_ns=ts, meta=meta,
                 payload=payload)[HEADER_SIZE:]
    assert decode_deliver(body) == tuple(decode_body(T.DELIVER, body).values())
    for cut in range(len(body) - len(payload)):  # truncated before the payload: malformed both ways
        with raises_code(Status.PROTOCOL_ERROR):
            decode_body(T.DELIVER, body[:cut])
        with raises_code(Status.PROTOCOL_ERROR):
            decode_deliver(body[:cut])


def test_one_message_frames_refuse_what_frame_refuses() -> None:
    with pytest.raises(ValueError):
        produce_frame(2**32, b"q", 0, b"")
    with pytest.raises(ValueError):
        consume_frame(1, b"q" * 65536, b"g", 0, 0)
    with pytest.raises(ValueError):
        settle_frame(T.ACK, 1, b"q", b"g", 2**64, 1)
    with pytest.raises(ValueError):
        settle_frame(T.NACK, 1, b"q", b"g", 1, 1)  # a NACK has a delay: not this layout


def test_header_vectors_are_what_the_clients_send_and_the_broker_reads() -> None:
    from shmq import headers
    from shmq.protocol.commands import put
    from shmq.protocol.produce import produce_request

    block = headers.encode({"k": "v"})
    wire = doc_vectors()
    _, msg_id, status, fields = VECTORS["produce_headers"]
    assert status == headers.FLAG and fields["payload"] == block + b"hi"

    class Q:
        name, name_bytes = "orders", b"orders"

    req = put(Q(), b"hi", False, None, {"k": "v"})  # type: ignore[arg-type]
    assert req.encode(17, *req.args) == wire["produce_headers"]
    t, f, st = produce_request("q", [b"a", b"bc"], 0, None, None, [None, {"k": "v"}])  # type: ignore[misc]
    assert frame(t, 18, st, **f) == wire["produce_batch_headers"]
    assert headers.split_many(decode_body(T.PRODUCE_BATCH, wire["produce_batch_headers"][16:])["payloads"]
                              ) == ([b"", block], [b"a", b"bc"])
    assert dict(headers.decode(decode_body(T.DELIVER, wire["deliver_headers"][16:])["meta"])) == {"k": b"v"}


def test_delayed_produce_frame_is_the_documented_bytes() -> None:
    from shmq.errors import InvalidArgument
    from shmq.protocol.commands import put
    from shmq.protocol.produce import DELAY_FLAG, split_prefixes

    class Q:
        name, name_bytes = "orders", b"orders"

    wire = put(Q(), b"hi", False, None, None, 1.5)  # type: ignore[arg-type]
    raw = wire.encode(20, *wire.args)
    assert raw == bytes.fromhex("deadbeef 00000012 21 01 0002 00000014 000005dc "
                                "0006 6f7264657273 00000000 6869")
    f = FrameDecoder().feed(raw)[0]
    assert f.status == DELAY_FLAG
    ms, tms, body = split_prefixes(f.status, f.body)
    assert (ms, tms) == (1500, 0)
    assert decode_body(T.PRODUCE, body) == {"queue": "orders", "timeout_ms": 0, "payload": b"hi"}
    with pytest.raises(InvalidArgument):
        split_prefixes(DELAY_FLAG, bytes.fromhex("ffffffff") + body)
