"""``wire_records`` (shmq/_speedups_wire.c): a consumer's messages made in one compiled pass
from a DELIVER_BATCH or READ_OK body are exactly the ones its pure-Python twin makes
(``commands._messages`` of ``records_columns``), and a body the twin refuses is left to the
twin whole (nothing appended), so the same ProtocolError is raised either way."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmq
from shmq import options
from shmq.errors import ProtocolError
from shmq.protocol import commands
from shmq.protocol.codec import FrameDecoder, T, frame, records_columns
from tests.support.fakes import FakeHandle

U64 = st.integers(0, (1 << 64) - 1)
record = st.tuples(U64, st.integers(0, (1 << 16) - 1), U64, st.binary(max_size=12), st.binary(max_size=40))
RECS = [(10, 1, 6, b"\x01meta", b"p"), (11, 2, 7, b"", b"qq"), (12, 3, 8, b"m", b"")]  # with header blocks


def ext() -> ModuleType:
    return importlib.import_module("shmq._speedups")


def body_of(type_: T, records: list[tuple[Any, ...]]) -> bytes:
    return frame(type_, 1, records=records)[16:]


def twin(q: FakeHandle, gi: int, group: str | None, type_: T, body: bytes) -> list[Any]:
    return commands._messages(q, gi, group, records_columns(type_, body))  # type: ignore[arg-type]


def compiled(q: FakeHandle, gi: int, group: str | None, body: Any) -> tuple[Any, list[Any]]:
    out: list[Any] = []
    return ext().wire_records(out, q.message_class, (q, gi, group), body, options.MAX_BATCH), out


def same(a: list[Any], b: list[Any]) -> bool:
    return [(type(m), tuple(m)) for m in a] == [(type(m), tuple(m)) for m in b]


@settings(max_examples=200, deadline=None)
@given(st.lists(record, max_size=30), st.sampled_from([T.DELIVER_BATCH, T.READ_OK]))
def test_compiled_messages_are_the_twins(records: list[tuple[Any, ...]], type_: T) -> None:
    q = FakeHandle()
    body = body_of(type_, records)
    gi, group = (0, "g") if type_ == T.DELIVER_BATCH else (-1, None)
    n, got = compiled(q, gi, group, body)
    assert n == len(records)
    want = twin(q, gi, group, type_, body)
    assert same(got, want)
    assert [(m.offset, m.deliveries, m.payload, m[6], m[7]) for m in got] == \
        [(o, dc, p, meta, ts) for o, dc, ts, meta, p in records]
    assert compiled(q, gi, group, memoryview(body))[0] == n  # as a read hands it over
    assert compiled(q, gi, group, bytearray(body))[0] == n


def test_every_cut_and_every_trailing_byte_is_left_to_the_twin() -> None:
    """Byte by byte: every prefix of a body (and the body with bytes after it) is refused
    by both; the whole body is read by both."""
    q = FakeHandle()
    body = body_of(T.DELIVER_BATCH, RECS)
    for bad in [body[:cut] for cut in range(len(body))] + [body + b"x", body + b"\x00" * 9]:
        n, out = compiled(q, 0, "g", bad)
        assert (n, out) == (None, [])
        with pytest.raises(ProtocolError):
            twin(q, 0, "g", T.DELIVER_BATCH, bad)
    assert compiled(q, 0, "g", body)[0] == 3


def test_more_records_than_the_limit_are_left_to_the_twin() -> None:
    q = FakeHandle()
    body = body_of(T.READ_OK, [(i, 0, 0, b"", b"") for i in range(5)])
    out: list[Any] = []
    assert ext().wire_records(out, shmq.Message, (q, -1, None), body, 4) is None and out == []
    assert ext().wire_records(out, shmq.Message, (q, -1, None), body, 5) == 5 and len(out) == 5
    huge = (options.MAX_BATCH + 1).to_bytes(4, "big") + body[4:]
    assert compiled(q, -1, None, huge)[0] is None
    with pytest.raises(ProtocolError):
        twin(q, -1, None, T.READ_OK, huge)


def test_compiled_wire_records_checks_its_arguments() -> None:
    w = ext().wire_records
    body = body_of(T.READ_OK, [])
    with pytest.raises(TypeError):
        w([], shmq.Message, (None,), body)  # too few
    with pytest.raises(TypeError):
        w((), shmq.Message, (None,), body, 10)  # out not a list
    with pytest.raises(TypeError):
        w([], dict, (None,), body, 10)  # not a tuple type
    with pytest.raises(TypeError):
        w([], shmq.Message, [None], body, 10)  # prefix not a tuple
    with pytest.raises(TypeError):
        w([], shmq.Message, (None,), "text", 10)  # no buffer
    one = body_of(T.READ_OK, [(1, 0, 0, b"", b"x")])
    for bad in (-1, -(1 << 62)):  # (as an unsigned count, any number of records would pass)
        with pytest.raises(ValueError, match="max_records"):
            w([], shmq.Message, (None,), one, bad)
    assert w([], shmq.Message, (None,), body, 10) == 0


@pytest.fixture(params=["compiled", "pure"])
def which(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(commands, "_wire_records", ext().wire_records if request.param == "compiled"
                        else None)
    yield request.param


def test_a_get_many_a_read_and_a_push_make_the_same_messages_on_both(which: str) -> None:
    q: Any = FakeHandle()
    recs = RECS
    get = commands.get_many(q, 3, "g", True, None, None)
    got = get.parse(next(iter(FrameDecoder().feed(frame(T.DELIVER_BATCH, 1, records=recs)))), get.ctx)
    assert [tuple(m) for m in got] == [(q, 0, "g", o, dc, p, m, ts) for o, dc, ts, m, p in recs]
    read = commands.read(q, 10, 3)
    got = read.parse(next(iter(FrameDecoder().feed(frame(T.READ_OK, 1, records=recs)))), read.ctx)
    assert [tuple(m) for m in got] == [(q, -1, None, o, dc, p, m, ts) for o, dc, ts, m, p in recs]
    pushed = commands.pushed_messages(q, "g", next(iter(FrameDecoder().feed(
        frame(T.DELIVER_BATCH, 1, records=recs)))))
    assert [tuple(m) for m in pushed] == [(q, 0, "g", o, dc, p, m, ts) for o, dc, ts, m, p in recs]
    err = frame(T.ERROR, 1, message="nope")
    with pytest.raises(shmq.ShmqError):
        get.parse(next(iter(FrameDecoder().feed(err))), get.ctx)
    bad = frame(T.DELIVER_BATCH, 1, records=recs)
    bad = bad[:16] + b"\xff" + bad[17:]  # a count far past the records that follow
    with pytest.raises(ProtocolError):
        get.parse(next(iter(FrameDecoder().feed(bad))), get.ctx)
