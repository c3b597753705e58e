"""The Spark source's and sink's columnar paths without Spark: records read as columns from a
segment and from a READ_OK frame (``spark_records``), Arrow batches built from them and payloads
taken from Arrow buffers (``spark_arrow``), and the sink's chunks put from those buffers."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import shmq
from shmq import spark as ss
from shmq.api import RecordColumns
from shmq.core.colocated import ShmBroker
from shmq.spark import records as sr
from shmq.spark import sink as spark_sink
from shmq.spark.arrow import Payloads, has_headers, to_batch

pytestmark = pytest.mark.spark  # imports pyspark


def as_rows(r: sr.Records) -> list[tuple[int, int, bytes, bytes]]:
    """(offset, timestamp_ns, meta, payload) of each record of ``r``."""
    data = bytes(r.data)
    out, at = [], 0
    for o, ts, ml, pl in zip(r.offsets.tolist(), r.stamps.tolist(), r.meta_lens.tolist(),
                             r.payload_lens.tolist(), strict=True):
        out.append((o, ts, data[at:at + ml], data[at + ml:at + ml + pl]))
        at += ml + pl
    assert at == len(data)
    return out


def as_read(msgs: list[shmq.Message]) -> list[tuple[int, int, bytes, bytes]]:
    return [(m.offset, m.timestamp_ns, bytes(m.meta), bytes(m.payload)) for m in msgs]


def test_records_read_as_columns_are_what_read_returns(broker: shmq.Broker) -> None:
    """Over both transports, with headers on some records and varied sizes (tests/core/test_rawread.py
    checks both against the co-located ``read``, the rings' wrap included)."""
    q = broker.create_queue("cols")
    payloads = [bytes([i % 251]) * (i % 37) for i in range(300)]
    q.put_many(payloads[:100])
    q.put_many(payloads[100:200], headers=[{"i": str(i)} if i % 3 == 0 else None for i in range(100)])
    q.put_many(payloads[200:])
    for start, n in ((0, 300), (0, 1), (95, 20), (150, 1000), (299, 5)):
        assert as_rows(sr.read_records(q, start, n)) == as_read(q.read(start, n))
    assert len(sr.read_records(q, 300, 10)) == 0  # nothing there yet
    with pytest.raises(shmq.InvalidArgument):
        sr.read_records(q, 0, 0)


def test_a_span_is_read_whole_in_order_with_the_next_read_asked_ahead(broker: shmq.Broker) -> None:
    """``read_span`` over both transports: every record once, in order, as ``read`` gives
    them, with answers that stop short (20 MiB in 1 MiB records pass a TCP frame, so a
    READ asked ahead from where a full answer would stop is asked again), ranges that
    end inside the records and past them; the connection serves the next request."""
    q = broker.create_queue("span", capacity=1 << 15, max_bytes=64 << 20, max_message_size=1 << 20)
    for k in range(0, 12_000, 4000):
        q.put_many([bytes([i % 251]) * (i % 50) for i in range(k, k + 4000)])
    for k in range(0, 20, 5):
        q.put_many([bytes([i]) * (1 << 20) for i in range(k, k + 5)])
    q.put_many([b"tail%d" % i for i in range(30)])
    for start, end in ((0, 12_050), (5, 12_010), (2_500, 22_500), (11_990, 12_040), (12_049, 12_100),
                       (12_050, 12_060)):
        got = [row for r in sr.read_span(q, start, end) for row in as_rows(r)]
        want = [(m.offset, m.timestamp_ns, bytes(m.meta), bytes(m.payload))
                for o in range(start, min(end, 12_050)) for m in q.read(o, 1)]
        assert [g[0] for g in got] == list(range(start, min(end, 12_050)))
        assert got == want
        assert q.read(12_049, 1)[0].payload == b"tail29"  # no answer left over on the connection


def test_columns_of_either_kind_become_the_same_int64_records() -> None:
    """A co-located read's offsets are a range, a TCP one's an array (its records field is
    checked in tests/client/test_api_columns.py): numpy sees either, as int64."""
    stamps, mlens, plens = array("Q", [5, 6]), array("I", [1, 0]), array("I", [2, 3])
    for offsets in (range(7, 9), array("Q", [7, 8])):
        r = sr.of_columns(RecordColumns(offsets, stamps, mlens, plens, b"mppqqq"))
        assert as_rows(r) == [(7, 5, b"m", b"pp"), (8, 6, b"", b"qqq")]
        assert {c.dtype for c in (r.offsets, r.stamps, r.meta_lens, r.payload_lens)} == {np.dtype(np.int64)}
    assert len(sr.of_columns(RecordColumns.empty(4))) == 0


def test_batches_of_records_without_and_with_metadata(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("arrow", max_deliveries=1)
        q.put_many([b"a", b"", b"ccc"])
        rb = to_batch("arrow", sr.read_records(q, 0, 10))
        assert rb.schema == ss.ARROW_SCHEMA
        assert rb.column("queue").to_pylist() == ["arrow"] * 3
        assert rb.column("offset").to_pylist() == [0, 1, 2]
        assert rb.column("payload").to_pylist() == [b"a", b"", b"ccc"]
        assert rb.column("headers").to_pylist() == [[], [], []] and rb.column("headers").null_count == 0
        assert rb.column("delivery_count").to_pylist() == [1, 1, 1]
        stamps = [m.timestamp_ns // 1000 for m in q.read(0, 3)]
        assert [t.value for t in rb.column("timestamp")] == stamps
        q.commit("default", 3)
        q.put(b"dead", headers={"k": "v"})
        q.get(timeout=1).nack()  # max_deliveries 1: dead-lettered
        dlq = b.queue("arrow.dlq")
        q.put(b"plain")
        rows = to_batch("arrow.dlq", sr.read_records(dlq, 0, 10))
        assert rows.column("payload").to_pylist() == [b"dead"]
        assert rows.column("headers").to_pylist() == [[("k", b"v")]]
        assert rows.column("delivery_count").to_pylist() == [1]
        assert to_batch("arrow", sr.empty()).num_rows == 0
    finally:
        b.destroy()


@pytest.mark.parametrize("type_", [pa.binary(), pa.string(), pa.large_binary(), pa.large_string(),
                                   pa.binary_view(), pa.string_view()])
def test_payloads_of_any_binary_column_and_slice(type_: pa.DataType) -> None:
    values = ["", "a", "bé", "ccc", "", "dddd"]
    binary = pa.types.is_binary(type_) or pa.types.is_large_binary(type_) or pa.types.is_binary_view(type_)
    col = pa.array([v.encode() if binary else v for v in values], type_)
    for part in (col, col.slice(2), col.slice(1, 3), col.slice(6)):
        p = Payloads.of(part)
        got = [p.bytes_of(i, i + 1).tobytes() for i in range(len(part))]
        assert got == [v.encode() for v in values[part.offset:part.offset + len(part)]]
        assert p.lens(0, len(part)).tolist() == [len(g) for g in got]


def test_has_headers_looks_at_this_slice_only() -> None:
    t = pa.map_(pa.string(), pa.binary())
    col = pa.array([[("a", b"x")], None, [], [("b", None)], [("c", b"")]], t)
    assert has_headers(col) and has_headers(col.slice(4))
    assert not has_headers(col.slice(1, 3))  # a null map, an empty one, a null value
    assert not has_headers(pa.array([], t))


def test_put_records_is_idempotent_and_exact(broker: shmq.Broker) -> None:
    q = broker.create_queue("putcols")
    values = [b"x" * (i % 5) for i in range(50)]
    lens = np.array([len(v) for v in values], np.int64)
    data = np.frombuffer(b"".join(values), np.uint8)
    assert sr.put_records(q, lens, data, "prod", 1, 5.0) == 50
    with pytest.raises(shmq.Duplicate):
        sr.put_records(q, lens, data, "prod", 1, 5.0)
    assert [bytes(m.payload) for m in q.read(0, 100)] == values
    with pytest.raises(shmq.LimitExceeded):
        sr.put_records(q, np.zeros(0, np.int64), data[:0], "prod", 2, 5.0)
    with pytest.raises(shmq.InvalidArgument):
        sr.put_records(q, lens, data, "", 2, 5.0)


def test_sink_chunks_by_bytes_and_rows_and_resumes_the_same(instance: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks (rows and bytes; a row over the byte limit alone) do not depend on how the rows
    are cut into Arrow batches, so a retry with other batches skips exactly what was written."""
    b = ShmBroker(instance)
    try:
        monkeypatch.setattr(spark_sink, "SINK_BATCH_BYTES", 1 << 15)  # chunks of at most 32 KiB
        q = b.create_queue("chunks")
        sizes = [100, 20_000, 20_000, 5, 40_000, 7, 7, 7, 30_000, 1]
        rows = [bytes([i]) * s for i, s in enumerate(sizes)]
        col = pa.array(rows, pa.binary())

        def batches(step: int, die_at: int = 99) -> Iterator[pa.RecordBatch]:
            for i in range(0, len(rows), step):
                if i >= die_at:
                    raise RuntimeError("task killed")
                yield pa.RecordBatch.from_arrays([col.slice(i, step)], names=["payload"])

        # chunks: [100, 20000] [20000, 5] [40000] [7, 7, 7] [30000, 1] (3 rows at most)
        with pytest.raises(RuntimeError):
            ss.write_partition(q, batches(1, die_at=6), 0, "p", 0, 3, 5.0)
        assert [len(m.payload) for m in q.read(0, 20)] == sizes[:5]  # three whole chunks
        assert ss.write_partition(q, batches(4), 0, "p", 0, 3, 5.0) == (5, 5)
        assert ss.write_partition(q, batches(10), 0, "p", 0, 3, 5.0) == (0, 10)
        assert [bytes(m.payload) for m in q.read(0, 20)] == rows
    finally:
        b.destroy()


def test_sink_over_tcp_writes_string_payloads_and_headers(server: Any) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue("tcpsink")
        rb = pa.RecordBatch.from_arrays([pa.array(["é", "b", ""]), pa.array([[("k", b"v")], [], None],
                                         pa.map_(pa.string(), pa.binary()))], names=["payload", "headers"])
        assert ss.write_partition(q, [rb.slice(0, 1), rb.slice(1)], 0, "t", 0, 10, 5.0, headers=1) == (3, 0)
        plain = pa.RecordBatch.from_arrays([pa.array(["x", "yz"])], names=["payload"])
        assert ss.write_partition(q, [plain], 0, "t", 10, 10, 5.0) == (2, 0)
        got = q.read(0, 10)
        assert [bytes(m.payload) for m in got] == ["é".encode(), b"b", b"", b"x", b"yz"]
        assert [dict(m.headers) for m in got] == [{"k": b"v"}, {}, {}, {}, {}]
