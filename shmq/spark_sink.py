"""The sink side of the shmq Spark data source: partitions written through idempotent producers.

Each task writes its partition in chunks, each one ``put_many`` of an idempotent producer
named for (job or query, partition) with a sequence number from (batch id, chunk): a
retried task or a replayed micro-batch finds its chunks written (``Duplicate``) and
skips them, so nothing is written twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from . import options
from .api import Queue
from .errors import Duplicate, InvalidArgument, LimitExceeded
from .spark_options import WriteOptions, broker_for

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


def write_partition(q: Queue, batches: Iterable[pa.RecordBatch], column: int, producer: str, seq0: int,
                    batch_size: int, timeout: float) -> tuple[int, int]:
    """Write one partition's payloads in chunks, each one idempotent put_many with sequence
    ``seq0 + chunk + 1``.  A chunk an earlier attempt wrote raises Duplicate and is skipped, so a
    retried task resumes after the last chunk its predecessor wrote: exactly once as long as the
    partition's rows come in the same order.  Returns (written, skipped)."""
    config = q.stats()["config"]
    limit = max(1, min(batch_size, config["capacity"] // 2))
    max_bytes = max(1, min(SINK_BATCH_BYTES, config["max_bytes"] // 2))
    written = skipped = chunk_no = 0
    chunk: list[bytes] = []
    size = 0

    def flush() -> None:
        nonlocal written, skipped, chunk_no, chunk, size
        if chunk_no + 1 >= SEQS_PER_BATCH:
            raise LimitExceeded(f"a sink partition wrote {chunk_no} chunks in one batch (limit "
                                f"{SEQS_PER_BATCH - 1}); repartition into more partitions")
        try:
            q.put_many(chunk, timeout=timeout, producer=producer, seq=seq0 + chunk_no + 1)
            written += len(chunk)
        except Duplicate:
            skipped += len(chunk)
        chunk_no += 1
        chunk = []
        size = 0

    for rb in batches:
        col = rb.column(column)
        if col.null_count:
            raise InvalidArgument(f"{col.null_count} row(s) have a null payload: the sink writes non-null "
                                  "payloads only (filter or coalesce them first)")
        for p in col.to_pylist():
            if type(p) is str:
                p = p.encode()
            if chunk and (len(chunk) >= limit or size + len(p) > max_bytes):
                flush()
            chunk.append(p)
            size += len(p)
    if chunk:
        flush()
    return written, skipped


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

    def __init__(self, opts: WriteOptions, column: int) -> None:
        self.o = opts
        self.column = column
        self.job = uuid.uuid4().hex  # made on the driver, the same in every task of this job

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Written:
        pid = _task().partitionId()
        _producer_limit(pid)
        with broker_for(self.o.url, self.o.token) as b:
            w, s = write_partition(b.queue(self.o.queue), iterator, self.column,
                                   f"spark-job:{self.job}:{pid}", 0, self.o.batch_size, self.o.write_timeout)
        return Written(pid, w, s)


class StreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("shmq")``: idempotent per (checkpoint, batch id).  The producer is
    (query id, partition): the query id is kept in the checkpoint, so it survives restarts."""

    def __init__(self, opts: WriteOptions, column: int) -> None:
        self.o = opts
        self.column = column

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
                                   int(batch) * SEQS_PER_BATCH, self.o.batch_size, self.o.write_timeout)
        return Written(pid, w, s)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: the messages are in the queue once the tasks return."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: what the failed batch wrote stays, and its replay skips it."""
