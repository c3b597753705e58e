"""shmq.spark without Spark: the source's rows (to_arrow, read_range) and the sink's chunking
(write_partition), headers included, called directly (tests/spark/test_spark.py runs them on Spark)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

import shmq
from shmq import spark as ss
from shmq.core.colocated import ShmBroker

pytestmark = pytest.mark.spark  # imports pyspark


def payloads(n: int) -> list[bytes]:
    return [f"m{i}".encode() for i in range(n)]


def _arrow(values: list[bytes]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array(values, pa.binary())], names=["payload"])


def _with_headers(values: list[Any], headers: list[Any], value_type: pa.DataType = pa.binary()
                  ) -> pa.RecordBatch:
    """A batch of (id, payload, headers): the payload is column 1, the headers column 2."""
    return pa.RecordBatch.from_arrays(
        [pa.array(range(len(values)), pa.int64()), pa.array(values),
         pa.array(headers, pa.map_(pa.string(), value_type))], names=["id", "payload", "headers"])


def test_sink_chunks_resume_after_a_partial_write(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("out")
        rows = payloads(100)

        def dies_after(n: int) -> Iterator[pa.RecordBatch]:
            for i in range(0, 100, 7):  # batches that do not line up with the chunks
                if i >= n:
                    raise RuntimeError("task killed")
                yield _arrow(rows[i:i + 7])

        with pytest.raises(RuntimeError, match="task killed"):
            ss.write_partition(q, dies_after(56), 0, "p", 0, 10, 5.0)
        assert [bytes(m.payload) for m in q.read(0, 200)] == rows[:50]  # five whole chunks
        assert ss.write_partition(q, dies_after(1000), 0, "p", 0, 10, 5.0) == (50, 50)  # the retry
        assert ss.write_partition(q, [_arrow(rows)], 0, "p", 0, 10, 5.0) == (0, 100)  # a replay
        assert [bytes(m.payload) for m in q.read(0, 200)] == rows  # each once, in order
        nxt = ss.SEQS_PER_BATCH  # the next micro-batch's sequence numbers are all higher
        assert ss.write_partition(q, [_arrow(rows[:3])], 0, "p", nxt, 10, 5.0) == (3, 0)
        strings = pa.RecordBatch.from_arrays([pa.array(["a", None])], names=["payload"])
        with pytest.raises(shmq.InvalidArgument, match="null payload"):
            ss.write_partition(q, [strings], 0, "p2", 0, 10, 5.0)
    finally:
        b.destroy()


def test_source_rows_carry_headers_and_an_empty_map_without(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("work", max_deliveries=1)
        q.put(b"plain")
        q.put(b"one", headers={"k": "v"})
        q.put_many([b"two", b"none", b"bin"], headers=[{"b": b"\x00\xff", "a": ""}, None, {"z": b"\x80"}])
        m = q.get(timeout=1)
        assert m.payload == b"plain"
        m.nack()  # max_deliveries 1: dead-lettered, without headers
        m = q.get(timeout=1)
        assert m.payload == b"one"
        m.nack()  # dead-lettered with its headers; the origin the DLQ adds is not one of them
        o = ss.read_options({"url": f"shm://{instance}", "queue": "work"}, streaming=False)
        (rb,) = list(ss.read_range(o, ss.OffsetRange("work", 2, 5)))  # 0 and 1 left for the DLQ
        assert rb.schema == ss.ARROW_SCHEMA and rb.schema.names[-2:] == ["headers", "priority"]
        assert rb.column("headers").null_count == 0
        assert rb.column("headers").to_pylist() == [[("b", b"\x00\xff"), ("a", b"")], [], [("z", b"\x80")]]
        assert rb.column("payload").to_pylist() == [b"two", b"none", b"bin"]
        dlq = ss.read_options({"url": f"shm://{instance}", "queue": "work.dlq"}, streaming=False)
        (rb,) = list(ss.read_range(dlq, ss.OffsetRange("work.dlq", 0, 2)))
        assert rb.column("payload").to_pylist() == [b"plain", b"one"]
        assert rb.column("headers").to_pylist() == [[], [("k", b"v")]]
        assert rb.column("delivery_count").to_pylist() == [1, 1]
        assert ss.to_arrow("work", []).num_rows == 0
    finally:
        b.destroy()


def test_sink_writes_the_headers_column(broker: shmq.Broker) -> None:
    q = broker.create_queue("hsink")
    n = 25
    values = [f"p{i}".encode() for i in range(n)]
    heads: list[Any] = [None if i % 5 == 0 else [] if i % 5 == 1 else
                        [("i", str(i).encode()), ("raw", bytes([i, 0, 255]))] if i % 5 == 2 else
                        [("drop", None)] if i % 5 == 3 else [("keep", b"x"), ("null", None)]
                        for i in range(n)]

    def expected(i: int) -> dict[str, bytes]:
        return [{}, {}, {"i": str(i).encode(), "raw": bytes([i, 0, 255])}, {}, {"keep": b"x"}][i % 5]

    batches = [_with_headers(values[i:i + 7], heads[i:i + 7]) for i in range(0, n, 7)]  # not chunk-aligned
    assert ss.write_partition(q, batches, 1, "hp", 0, 10, 5.0, headers=2) == (n, 0)
    assert ss.write_partition(q, batches, 1, "hp", 0, 10, 5.0, headers=2) == (0, n)  # a replay
    got = q.read(0, 100)
    assert [bytes(m.payload) for m in got] == values
    assert [dict(m.headers) for m in got] == [expected(i) for i in range(n)]
    text = _with_headers([b"s0", b"s1"], [[("t", "é")], None], pa.string())  # map<string,string>
    assert ss.write_partition(q, [text], 1, "hp", ss.SEQS_PER_BATCH, 10, 5.0, headers=2) == (2, 0)
    assert [dict(m.headers) for m in q.read(n, 10)] == [{"t": "é".encode()}, {}]
    too_many = _with_headers([b"x"], [[(f"k{i}", b"") for i in range(shmq.options.MAX_HEADERS + 1)]])
    with pytest.raises(shmq.LimitExceeded):  # the whole chunk is refused, the task fails
        ss.write_partition(q, [too_many], 1, "hp2", 0, 10, 5.0, headers=2)
    assert q.stats()["next_offset"] == n + 2


def test_headers_column_is_found_and_checked() -> None:
    from pyspark.sql.types import BinaryType, LongType, MapType, StringType, StructField, StructType

    def schema(t: Any) -> StructType:
        return StructType([StructField("payload", BinaryType()), StructField("headers", t)])

    assert ss.headers_column(StructType([StructField("payload", BinaryType())])) is None
    assert ss.headers_column(schema(MapType(StringType(), BinaryType()))) == 1
    assert ss.headers_column(schema(MapType(StringType(), StringType(), False))) == 1
    assert ss.headers_column(ss.SCHEMA) == 5  # the source's rows go back into a queue as they are
    for bad in (StringType(), MapType(StringType(), LongType()), MapType(LongType(), BinaryType())):
        with pytest.raises(shmq.InvalidArgument, match="map<string,binary> or map<string,string>"):
            ss.headers_column(schema(bad))
