"""``Queue.read_columns``, ``Queue.iter_columns`` and ``Queue.put_joined``: each transport's
fast path (a co-located queue's segment copied out by ``rawread``, a TCP READ_OK's columns seen
as arrays, a joined produce made of the lengths and the bytes) gives exactly what the
interface's defaults, built on ``read`` and ``put_many``, give: every record's offset,
timestamp, metadata (headers, a dead letter's origin) and payload; the same ranges (empty,
past the end, from offsets already freed), the same errors."""

from __future__ import annotations

import asyncio
import inspect
import struct
import time
from array import array
from typing import Any

import pytest

import shmq
from shmq import options
from shmq.api import Queue, RecordColumns
from shmq.client import aio
from shmq.client.aio import AsyncQueue
from shmq.client.tcp import TcpQueue
from shmq.core.queue import ShmQueue
from shmq.joined import Joined
from shmq.protocol.bodies import records_arrays
from tests.support.server import Server

Row = tuple[int, int, bytes, bytes]  # offset, timestamp_ns, meta, payload


def rows(c: RecordColumns) -> list[Row]:
    """Every record of ``c``, checking that its lengths cover its bytes exactly."""
    assert len(c.offsets) == len(c.stamps) == len(c.meta_lens) == len(c.payload_lens) == len(c)
    assert (c.stamps.typecode, c.meta_lens.typecode, c.payload_lens.typecode) == ("Q", "I", "I")
    assert isinstance(c.offsets, range) or c.offsets.typecode == "Q"  # type: ignore[attr-defined]
    data = bytes(c.data)
    out, at = [], 0
    for o, ts, ml, pl in zip(c.offsets, c.stamps, c.meta_lens, c.payload_lens, strict=True):
        out.append((o, ts, data[at:at + ml], data[at + ml:at + ml + pl]))
        at += ml + pl
    assert at == len(data)
    return out


def read_rows(q: Any, offset: int, n: int) -> list[Row]:
    return [(m.offset, m.timestamp_ns, bytes(m.meta), bytes(m.payload)) for m in q.read(offset, n)]


def same_read(q: Queue, offset: int, n: int) -> list[Row]:
    """The fast read and the default one agree with each other and with ``read``; the rows."""
    fast, default = q.read_columns(offset, n), Queue.read_columns(q, offset, n)
    assert rows(fast) == rows(default) == read_rows(q, offset, n)
    return rows(fast)


def span(q: Queue, start: int, end: int, default: bool = False) -> list[list[Row]]:
    got = Queue.iter_columns(q, start, end) if default else q.iter_columns(start, end)
    return [rows(c) for c in got]


def fill(b: shmq.Broker, name: str) -> tuple[Queue, int, int]:
    """A queue with freed offsets below its first retained one (acked, dead-lettered), headers
    on some records, empty payloads, and a dead-letter queue holding one copy; (q, first, next)."""
    q = b.create_queue(name, max_deliveries=1, capacity=256, max_bytes=1 << 16)
    q.put_many([b"gone%d" % i for i in range(10)])
    q.commit("default", 10)  # acked: freed
    q.put(b"poison", headers={"why": "test"})
    q.get(timeout=5).nack()  # max_deliveries 1: dead-lettered, so offset 10 is freed too
    q.put_many([bytes([i % 251]) * (i % 13) for i in range(40)],
               headers=[{"i": str(i), "b": bytes([i])} if i % 3 == 0 else None for i in range(40)])
    q.put_many([b"", b"x", b""])
    first = q.stats()["first_offset"]
    assert first == 11
    return q, first, 54


def test_reads_as_columns_are_the_defaults_reads(broker: shmq.Broker) -> None:
    q, first, nxt = fill(broker, "cols")
    whole = same_read(q, 0, 1000)  # from 0: the freed offsets are skipped
    assert [r[0] for r in whole] == list(range(first, nxt))
    assert [r[3] for r in whole[-3:]] == [b"", b"x", b""]
    assert dict(q.read(first, 1)[0].headers) == {"i": b"0", "b": b"\x00"}
    for offset, n in ((first, 1), (first + 5, 7), (nxt - 1, 10), (3, 2), (nxt - 3, 3)):
        assert len(same_read(q, offset, n)) == min(n, nxt - max(offset, first))
    for offset in (nxt, nxt + 100):  # past the end: nothing, from where it was asked
        assert same_read(q, offset, 5) == []
    dlq = broker.queue("cols.dlq")
    (dead,) = same_read(dlq, 0, 10)
    assert dead[3] == b"poison" and dlq.read(0)[0].origin.offset == 10  # type: ignore[union-attr]
    for bad in ((0, 0), (-1, 5)):
        for read in (q.read_columns, lambda o, n: Queue.read_columns(q, o, n)):
            with pytest.raises(shmq.InvalidArgument):
                read(*bad)


def read_loop(q: Queue, start: int, end: int) -> list[list[Row]]:
    """What ``iter_columns`` gives, read with ``read``."""
    out = []
    while start < end:
        out.append(read_rows(q, start, end - start))
        if not out[-1]:
            break
        start = out[-1][-1][0] + 1
    return out


def test_a_span_is_the_defaults_span(broker: shmq.Broker) -> None:
    q, first, nxt = fill(broker, "span")
    cases = {(0, 100): [list(range(first, nxt)), []],  # from freed offsets, up to the end
             (0, 5): [list(range(first, first + 5))],  # the gap shows: the read starts past 0
             (first, nxt): [list(range(first, nxt))], (first + 3, first + 4): [[first + 3]],
             (nxt - 2, nxt + 50): [[nxt - 2, nxt - 1], []], (nxt, nxt + 5): [[]],
             (20, 20): [], (30, 25): []}  # empty ranges: nothing read
    for (start, end), offsets in cases.items():
        got = span(q, start, end)
        assert got == span(q, start, end, default=True) == read_loop(q, start, end)
        assert [[r[0] for r in part] for part in got] == offsets
    assert q.read(first, 1)[0].offset == first  # the connection serves the next request


def test_a_span_past_one_answer_asks_ahead_and_agrees(broker: shmq.Broker) -> None:
    """Answers that stop short (over TCP a frame holds 16 MiB: 1 MiB records) and ones that
    are full (``MAX_BATCH``): the read asked ahead is asked again, or used."""
    q = broker.create_queue("big", capacity=1 << 15, max_bytes=64 << 20, max_message_size=1 << 20)
    for k in range(0, 12_000, 4000):
        q.put_many([bytes([i % 251]) * (i % 7) for i in range(k, k + 4000)])
    for k in range(0, 20, 5):
        q.put_many([bytes([i]) * (1 << 20) for i in range(k, k + 5)])
    for start, end in ((0, 12_020), (11_990, 12_020), (5, 10_006)):
        fast, default = span(q, start, end), span(q, start, end, default=True)
        assert [r for p in fast for r in p] == [r for p in default for r in p]
        assert [r[0] for p in fast for r in p] == list(range(start, end))


def test_a_joined_put_is_the_defaults_put(broker: shmq.Broker) -> None:
    fast, default = broker.create_queue("jfast"), broker.create_queue("jdefault")
    puts = [(fast.put_joined, "fast"), (lambda *a, **kw: Queue.put_joined(default, *a, **kw), "default")]
    batches = [[b"a", b"", b"ccc"], [bytes([i % 251]) * (i % 11) for i in range(500)], [b""], [b"z" * 5000]]
    for i, ps in enumerate(batches):
        joined = Joined([len(p) for p in ps], memoryview(b"".join(ps)) if i % 2 else b"".join(ps))
        firsts = [put(joined, producer="p", seq=i + 1) if i != 2 else put(joined, timeout=5)
                  for put, _ in puts]  # the third batch from no idempotent producer
        assert firsts[0] == firsts[1] == sum(map(len, batches[:i]))
    for put, _ in puts:
        with pytest.raises(shmq.Duplicate):
            put(Joined([1], b"x"), producer="p", seq=2)
        for bad in (Joined([], b""), Joined([3, 3], b"12345"), Joined([2], b"1")):
            with pytest.raises(shmq.InvalidArgument):
                put(bad, producer="p", seq=9)
        with pytest.raises(shmq.InvalidArgument):
            put(Joined([1], b"x"), producer="", seq=9)
    got = [q.read(0, 1000) for q in (fast, default)]
    assert [[(m.offset, bytes(m.payload), bytes(m.meta), dict(m.headers)) for m in g] for g in got] == [
        [(o, p, b"", {}) for o, p in enumerate(p for ps in batches for p in ps)]] * 2
    for g in got:  # one timestamp per batch, as put_many stamps it
        at = 0
        for ps in batches:
            assert len({m.timestamp_ns for m in g[at:at + len(ps)]}) == 1
            at += len(ps)
        assert 0 < g[0].timestamp_ns <= g[-1].timestamp_ns <= time.time_ns()


def test_a_joined_put_over_tcp_has_put_manys_batch_limit(server: Server) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue("jlimit")
        try:
            n = options.MAX_BATCH + 1
            for put in (q.put_joined, lambda j: Queue.put_joined(q, j)):
                with pytest.raises(shmq.LimitExceeded):
                    put(Joined([1] * n, b"x" * n))
            assert q.read(0, 10) == []
        finally:
            b.delete_queue("jlimit")


def test_the_asyncio_queue_reads_and_puts_as_the_blocking_one(server: Server) -> None:
    async def main() -> tuple[list[Row], list[list[Row]], int]:
        async with await aio.connect(server.url) as b:
            q = await b.create_queue("acols")
            first = await q.put_joined(Joined([1, 0, 2], b"abb"), producer="a", seq=1)
            await q.put_many([b"h"], headers=[{"k": "v"}])
            one = rows(await q.read_columns(0, 10))
            parts = [rows(c) async for c in q.iter_columns(1, 10)]
            await b.delete_queue("acols")
            return one, parts, first

    one, parts, first = asyncio.run(asyncio.wait_for(main(), 30))
    assert first == 0 and [(o, m, p) for o, _, m, p in one] == [
        (0, b"", b"a"), (1, b"", b""), (2, b"", b"bb"), (3, one[3][2], b"h")]
    assert one[3][2] and parts == [one[1:], []]


@pytest.mark.parametrize("name", ["read_columns", "iter_columns", "put_joined"])
def test_every_queue_has_the_interfaces_signature(name: str) -> None:
    want = list(inspect.signature(getattr(Queue, name)).parameters.values())
    for cls in (ShmQueue, TcpQueue, AsyncQueue):
        got = list(inspect.signature(getattr(cls, name)).parameters.values())
        assert [(p.name, p.kind, p.default) for p in got[:len(want)]] == [
            (p.name, p.kind, p.default) for p in want], cls
    assert inspect.isasyncgenfunction(AsyncQueue.iter_columns)
    assert name == "iter_columns" or inspect.iscoroutinefunction(getattr(AsyncQueue, name))


def test_a_records_body_is_checked() -> None:
    good = struct.pack(">I", 1) + struct.pack(">QHQII", 7, 0, 123, 1, 2) + b"mpp"
    offsets, stamps, mlens, plens, data = records_arrays(good)
    assert (offsets, stamps, mlens, plens, bytes(data)) == (
        array("Q", [7]), array("Q", [123]), array("I", [1]), array("I", [2]), b"mpp")
    assert rows(RecordColumns(offsets, stamps, mlens, plens, data)) == [(7, 123, b"m", b"pp")]
    for bad in (b"", b"\x00\x00", good[:-1], good + b"x", struct.pack(">I", 2) + good[4:],
                struct.pack(">I", 10_001)):
        with pytest.raises(shmq.ProtocolError):
            records_arrays(bad)
