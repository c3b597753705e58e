"""The sink side of the shmq Spark data source: partitions written through idempotent producers.

Each task writes its partition in chunks, each one ``put_many`` of an idempotent producer
named for (job or query, partition) with a sequence number from (batch id, chunk): a
retried task or a replayed micro-batch finds its chunks written (``Duplicate``) and
skips them, so nothing is written twice.  A ``headers`` column (map<string,binary> or
map<string,string>) goes with each row as its message's headers, in the same put_many, and
an integer ``priority`` column with each row as its priority (a priority queue's level).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import (
    BinaryType,
    ByteType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
)

from shmq import options
from shmq.api import Headers, Queue
from shmq.errors import Duplicate, InvalidArgument, LimitExceeded
from shmq.spark.arrow import Payloads, has_headers
from shmq.spark.options import WriteOptions, broker_for
from shmq.spark.records import put_records

SINK_BATCH_BYTES = 4 << 20  # payload bytes per put_many at most (well under the TCP frame limit)
SEQS_PER_BATCH = 1 << 24  # sink sequence numbers per (micro-batch, partition): seq = batch * this + chunk + 1


@dataclass
class Written(WriterCommitMessage):
    """What one sink task did."""

    partition: int
    written: int  # messages this attempt wrote
    skipped: int  # messages an earlier attempt had written already (their chunks were duplicates)


def payload_column(schema: StructType) -> int:
    """Index of the ``payload`` column (binary or string) the sink writes."""
    for i, f in enumerate(schema.fields):
        if f.name == "payload":
            if not isinstance(f.dataType, (BinaryType, StringType)):
                raise InvalidArgument(f"the sink writes column 'payload' as binary or string, not "
                                      f"{f.dataType.simpleString()}: cast it first")
            return i
    raise InvalidArgument(f"the sink needs a 'payload' column (binary or string); the columns are "
                          f"{schema.fieldNames()}")


def headers_column(schema: StructType) -> int | None:
    """Index of the ``headers`` column (map<string,binary> or map<string,string>) the sink
    writes, None when the DataFrame has none."""
    for i, f in enumerate(schema.fields):
        if f.name == "headers":
            t = f.dataType
            if not (isinstance(t, MapType) and isinstance(t.keyType, StringType)
                    and isinstance(t.valueType, (BinaryType, StringType))):
                raise InvalidArgument(f"the sink writes column 'headers' as map<string,binary> or "
                                      f"map<string,string>, not {t.simpleString()}: cast, rename or drop it")
            return i
    return None


def priority_column(schema: StructType) -> int | None:
    """Index of the ``priority`` column (an integer: each row's priority in a priority queue,
    0 .. N-1; null: 0) the sink writes, None when the DataFrame has none."""
    for i, f in enumerate(schema.fields):
        if f.name == "priority":
            if not isinstance(f.dataType, (ByteType, ShortType, IntegerType, LongType)):
                raise InvalidArgument(f"the sink writes column 'priority' as an integer, not "
                                      f"{f.dataType.simpleString()}: cast, rename or drop it")
            return i
    return None


def _row_headers(entries: list[tuple[str, bytes | str | None]] | None) -> dict[str, bytes | str] | None:
    """One row's headers as put takes them: a null map, or a null value, is no header."""
    if not entries:
        return None
    return {k: v for k, v in entries if v is not None} or None


def _header_size(h: Headers | None) -> int:
    """About the bytes a row's headers add to its message (their encoded block)."""
    return sum(len(k) + len(v) + 4 for k, v in h.items()) + 3 if h else 0


class _Chunks:
    """A partition's rows cut into chunks of at most ``limit`` rows and ``max_bytes`` bytes
    (a larger row alone), across Arrow batches; each chunk one idempotent put, ``seq0 + chunk + 1``
    (a chunk of rows of several priorities: one put per priority, with that sequence, in each
    level of the priority queue: each level keeps its own producers' sequences)."""

    def __init__(self, q: Queue, producer: str, seq0: int, timeout: float, limit: int,
                 max_bytes: int) -> None:
        self.q, self.producer, self.seq0, self.timeout = q, producer, seq0, timeout
        self.limit, self.max_bytes = limit, max_bytes
        self.written = self.skipped = self.number = 0
        self.pieces: list[_Piece] = []  # rows [a, b) of a batch
        self.rows = self.size = 0

    def add(self, p: Payloads, hs: list[Headers | None] | None, ps: np.ndarray | None = None) -> None:
        """The rows of one batch: ``hs``, each row's headers, or None when none has any; ``ps``,
        each row's priority, or None when every one is 0."""
        n = len(p.offsets) - 1
        sizes = p.lens(0, n)
        if hs is not None:
            sizes = sizes + np.array([_header_size(h) for h in hs], np.int64)
        ends = np.cumsum(sizes)
        i = 0
        while i < n:
            before = int(ends[i - 1]) if i else 0
            fit = int(np.searchsorted(ends, before + self.max_bytes - self.size, "right"))
            j = min(n, i + self.limit - self.rows, fit)
            if j <= i:  # the next row does not fit
                if self.rows:
                    self.flush()
                    continue
                j = i + 1  # a row larger than max_bytes goes alone
            self.pieces.append(_Piece(p, i, j, hs[i:j] if hs is not None else None,
                                      ps[i:j] if ps is not None else None))
            self.rows += j - i
            self.size += int(ends[j - 1]) - before
            i = j
            if i < n:
                self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        if self.number + 1 >= SEQS_PER_BATCH:
            raise LimitExceeded(f"a sink partition wrote {self.number} chunks in one batch (limit "
                                f"{SEQS_PER_BATCH - 1}); repartition into more partitions")
        seq = self.seq0 + self.number + 1
        prios = None
        if any(x.ps is not None for x in self.pieces):
            prios = np.concatenate([x.ps if x.ps is not None else np.zeros(x.b - x.a, np.int64)
                                    for x in self.pieces])
        if (prios is not None and prios.any()) or any(x.hs is not None for x in self.pieces):
            payloads, metas = self._rows()  # headers or priorities: one bytes object per row
            for pr in sorted(set(prios.tolist()), reverse=True) if prios is not None else [0]:
                rows = np.flatnonzero(prios == pr).tolist() if prios is not None else range(self.rows)
                hs = [metas[r] for r in rows]
                self._put(len(rows), self.q.put_many, [payloads[r] for r in rows], timeout=self.timeout,
                          producer=self.producer, seq=seq,
                          headers=hs if any(h is not None for h in hs) else None, priority=int(pr))
        else:
            lens = np.concatenate([x.p.lens(x.a, x.b) for x in self.pieces])
            data = np.concatenate([x.p.bytes_of(x.a, x.b) for x in self.pieces])
            self._put(self.rows, put_records, self.q, lens, data, self.producer, seq, self.timeout)
        self.number += 1
        self.pieces = []
        self.rows = self.size = 0

    def _rows(self) -> tuple[list[bytes], list[Headers | None]]:
        """The chunk's rows as payloads, one bytes object each, and their headers."""
        payloads: list[bytes] = []
        metas: list[Headers | None] = []
        for x in self.pieces:
            whole, o = x.p.bytes_of(x.a, x.b).tobytes(), x.p.offsets[x.a:x.b + 1] - x.p.offsets[x.a]
            payloads += [whole[i:j] for i, j in zip(o[:-1].tolist(), o[1:].tolist(), strict=True)]
            metas += x.hs if x.hs is not None else [None] * (x.b - x.a)
        return payloads, metas

    def _put(self, n: int, put: Any, *args: Any, **kwargs: Any) -> None:
        """One idempotent put of ``n`` rows, ``put(*args, **kwargs)``: written, or skipped when
        an earlier attempt wrote it."""
        try:
            put(*args, **kwargs)
            self.written += n
        except Duplicate:
            self.skipped += n


class _Piece(NamedTuple):
    """Rows ``[a, b)`` of a batch's payloads, with their headers and priorities (None: none)."""

    p: Payloads
    a: int
    b: int
    hs: list[Headers | None] | None
    ps: np.ndarray | None


def write_partition(q: Queue, batches: Iterable[pa.RecordBatch], column: int, producer: str, seq0: int,
                    batch_size: int, timeout: float, headers: int | None = None,
                    priority: int | None = None) -> tuple[int, int]:
    """Write one partition's payloads in chunks, each one idempotent put with sequence
    ``seq0 + chunk + 1``; ``headers``, ``priority``: the index of the headers column, of the
    priority column (None: none).  A chunk an
    earlier attempt wrote raises Duplicate and is skipped, so a retried task resumes after the last
    chunk its predecessor wrote: exactly once as long as the partition's rows come in the same
    order.  A chunk without headers goes as its Arrow buffers (``spark.records.put_records``).
    Returns (written, skipped)."""
    config = q.stats()["config"]
    chunks = _Chunks(q, producer, seq0, timeout, max(1, min(batch_size, config["capacity"] // 2)),
                     max(1, min(SINK_BATCH_BYTES, config["max_bytes"] // 2)))
    for rb in batches:
        col = rb.column(column)
        if col.null_count:
            raise InvalidArgument(f"{col.null_count} row(s) have a null payload: the sink writes non-null "
                                  "payloads only (filter or coalesce them first)")
        hs: list[Headers | None] | None = None
        if headers is not None and has_headers(rb.column(headers)):
            hs = [_row_headers(e) for e in rb.column(headers).to_pylist()]
        ps: np.ndarray | None = None
        if priority is not None:
            pcol = rb.column(priority)
            ps = pcol.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
            if not ps.any():
                ps = None
        chunks.add(Payloads.of(col), hs, ps)
    chunks.flush()
    return chunks.written, chunks.skipped


def _task() -> Any:
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        raise RuntimeError("the shmq sink's write() runs inside a Spark task")
    return tc


def _producer_limit(partition: int) -> None:
    if partition >= options.MAX_PRODUCERS:
        raise LimitExceeded(f"sink partition {partition}: a queue remembers {options.MAX_PRODUCERS} "
                            "idempotent producers and the sink uses one per partition; coalesce to fewer "
                            "partitions before writing")


class BatchWriter(DataSourceArrowWriter):
    """``df.write.format("shmq")``: each task writes its partition; a retried task writes
    nothing twice (one producer per (job, partition))."""

    def __init__(self, opts: WriteOptions, column: int, headers: int | None = None,
                 priority: int | None = None) -> None:
        self.o = opts
        self.column = column
        self.headers = headers
        self.priority = priority
        self.job = uuid.uuid4().hex  # made on the driver, the same in every task of this job

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        pid = _task().partitionId()
        _producer_limit(pid)
        with broker_for(self.o.url, self.o.token) as b:
            w, s = write_partition(b.queue(self.o.queue), iterator, self.column,
                                   f"spark-job:{self.job}:{pid}", 0, self.o.batch_size, self.o.write_timeout,
                                   self.headers, self.priority)
        return Written(pid, w, s)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("shmq")``: idempotent per (checkpoint, batch id).  The producer is
    (query id, partition): the query id is kept in the checkpoint, so it survives restarts."""

    def __init__(self, opts: WriteOptions, column: int, headers: int | None = None,
                 priority: int | None = None) -> None:
        self.o = opts
        self.column = column
        self.headers = headers
        self.priority = priority

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        tc = _task()
        pid = tc.partitionId()
        _producer_limit(pid)
        query = tc.getLocalProperty("sql.streaming.queryId")
        batch = tc.getLocalProperty("streaming.sql.batchId")
        if not query or batch is None:
            raise RuntimeError("the streaming sink found no query id / batch id in the task's properties")
        with broker_for(self.o.url, self.o.token) as b:
            w, s = write_partition(b.queue(self.o.queue), iterator, self.column, f"spark:{query}:{pid}",
                                   int(batch) * SEQS_PER_BATCH, self.o.batch_size, self.o.write_timeout,
                                   self.headers, self.priority)
        return Written(pid, w, s)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: the messages are in the queue once the tasks return."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: what the failed batch wrote stays, and its replay skips it."""
