"""``rawread.read_columns``: a range of records as columns, checked against ``ShmQueue.read``
(the reference), directly and through the broker's READ, which answers with it
(``read_field``), on the compiled copy (``shmq._speedups.read_run``) and its pure twin."""

from __future__ import annotations

import importlib
from collections.abc import Iterator

import pytest

import shmq
from shmq.core import layout as L
from shmq.core import rawread
from shmq.core.colocated import ShmBroker
from shmq.core.rawread import Columns, read_columns, read_field
from shmq.protocol.bodies import records_field
from tests.support.server import Server


@pytest.fixture(params=["compiled", "pure"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    ext = importlib.import_module("shmq._speedups")
    monkeypatch.setattr(rawread, "_read_c", ext.read_run if request.param == "compiled" else None)
    yield request.param


def rows(c: Columns) -> list[tuple[int, int, bytes, bytes]]:
    """(offset, timestamp_ns, meta, payload) of each record of ``c``."""
    out, at = [], 0
    for i, (ts, ml, pl) in enumerate(zip(c.stamps, c.meta_lens, c.payload_lens, strict=True)):
        out.append((c.first + i, ts, c.data[at:at + ml], c.data[at + ml:at + ml + pl]))
        at += ml + pl
    assert at == len(c.data)
    return out


def reference(q: shmq.Queue, start: int, n: int) -> list[tuple[int, int, bytes, bytes]]:
    return [(m.offset, m.timestamp_ns, bytes(m.meta), bytes(m.payload)) for m in q.read(start, n)]


def churn(q: shmq.Queue, laps: int) -> int:
    """Put and free 40 messages of 50 bytes ``laps`` times (the offsets go round); the next offset."""
    n = 0
    for _ in range(laps):
        q.put_many([bytes([i % 256]) * 50 for i in range(n, n + 40)])
        n += 40
        q.commit("default", n)
    return n


def test_columns_are_what_read_returns_across_both_wraps(impl: str, instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("wrap", capacity=64, max_bytes=4096)
        n = churn(q, 5)
        q.put_many([f"{i}".encode() * (i % 9 + 1) for i in range(n, n + 60)],
                   headers=[{"h": b"x"} if i % 4 == 0 else None for i in range(60)])
        first = q.stats()["first_offset"]
        assert first % 64 > 4  # the 60 retained slots wrap around the end of the table
        c = read_columns(q, 0, 1000, 1 << 20)  # 0 is long gone: from the first retained on
        assert c.first == first and len(c) == 60 and rows(c) == reference(q, first, 100)
        for start, k in ((first + 3, 5), (first + 59, 10), (first + 60, 10)):
            assert rows(read_columns(q, start, k, 1 << 20)) == reference(q, start, k)
        small = read_columns(q, first, 1000, 40)  # stops short of 40 bytes...
        assert 1 <= len(small) < 60 and rows(small) == reference(q, first, len(small))
        assert len(read_columns(q, first, 1000, 1)) == 1  # ... but gives at least one record
        cases = ((0, 1000, 1 << 20), (first + 59, 10, 1 << 20), (first, 1000, 40), (first, 9, 1))
        for start, k, most in cases:
            c = read_columns(q, start, k, most)
            assert read_field(q, start, k, most) == records_field(
                range(c.first, c.first + len(c)), [0] * len(c), c.stamps, c.meta_lens, c.payload_lens, c.data)
        assert read_field(q, first + 60, 5, 1 << 20) == bytes(4)  # nothing there: a count of 0
    finally:
        b.destroy()


def test_the_compiled_copy_refuses_a_slot_that_reaches_past_the_ring(instance: str) -> None:
    ext = importlib.import_module("shmq._speedups")
    b = ShmBroker(instance)
    try:
        q = b.create_queue("bad", capacity=8, max_bytes=4096)
        q.put_many([b"a" * 10, b"b" * 10])
        r = q.ring
        geom = (r.mm, r.slots_w, r.capacity, r.slot_words, r.data_off, r.size)
        assert ext.read_run(*geom, 0, 2, 1 << 20, 0)[3] == b"a" * 10 + b"b" * 10
        with pytest.raises(ValueError, match="geometry past the end"):
            ext.read_run(r.mm, r.slots_w, 1 << 30, r.slot_words, r.data_off, r.size, 0, 2, 1 << 20, 0)
        with pytest.raises(ValueError, match="bad geometry"):
            ext.read_run(*geom, 0, 0, 1 << 20, 1)
        lens_word = r.slots_w + 1 * r.slot_words + L.S_LENS
        good = r.w[lens_word]
        r.w[lens_word] = r.size  # offset 1's record claims the whole byte ring
        try:
            with pytest.raises(ValueError, match="offset 1 reaches past the byte ring"):
                ext.read_run(*geom, 0, 2, 1 << 30, 1)
        finally:
            r.w[lens_word] = good
    finally:
        b.destroy()


def test_the_brokers_read_answers_with_columns(server: Server) -> None:
    """READ over TCP against the co-located reference: metadata, the byte ring's wrap (a
    reply cut to a frame: tests/server/test_server.py)."""
    ref = ShmBroker(server.instance)
    try:
        with shmq.connect(server.url) as b:
            q = b.create_queue("tcpread", capacity=128, max_bytes=8192)
            local = ref.queue("tcpread")
            n = churn(q, 7)
            q.put_many([bytes([i]) * (i % 70) for i in range(90)],
                       headers=[{"k": str(i)} if i % 7 == 0 else None for i in range(90)])
            first = local.stats()["first_offset"]
            for start, k in ((0, 1000), (first, 90), (first + 10, 1), (n + 89, 5), (n + 90, 5)):
                got = [(m.offset, m.timestamp_ns, bytes(m.meta), bytes(m.payload), m.deliveries)
                       for m in q.read(start, k)]
                assert got == [(*r, 0) for r in reference(local, start, k)]
    finally:
        ref.close()
