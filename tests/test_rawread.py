"""``rawread.read_columns``: a range of records as columns, checked against ``ShmQueue.read``
(the reference), directly and through the broker's READ, which answers with it."""

from __future__ import annotations

import shmq
from shmq.rawread import Columns, read_columns
from shmq.shm import ShmBroker

from .conftest import Server


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


def test_columns_are_what_read_returns_across_both_wraps(instance: str) -> None:
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
    finally:
        b.destroy()


def test_the_brokers_read_answers_with_columns(server: Server) -> None:
    """READ over TCP against the co-located reference: metadata, the byte ring's wrap (a
    reply cut to a frame: tests/test_server.py)."""
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
