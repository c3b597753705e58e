"""The source side of the shmq Spark data source: offset ranges read into Arrow batches.

A batch read (:class:`BatchReader`) is a snapshot of the retained offsets; a streaming
read (:class:`StreamReader`) owns a consumer group that retains every message until
Spark commits the micro-batch, so a replayed range yields the same rows.  The read tasks
(:class:`OffsetRange`, planned by :func:`split`) read with ``Queue.read``, never leasing.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from shmq.api import Broker, Message, Queue
from shmq.errors import ConnectionLost, GroupExists, GroupNotFound, InvalidArgument
from shmq.seektime import to_ns
from shmq.spark.arrow import to_batch
from shmq.spark.options import DataLost, ReadOptions, broker_for
from shmq.spark.records import from_messages, read_span

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A read task covers at most this many offsets (more: more tasks).  Each task costs a fixed
# 60-70 ms of a core on the 2-core test VM (a Python task, a connection): 1M-row micro-batches
# read 1.4x as fast in 2 tasks as in 10 of 100,000.  Parallelism comes from minPartitions.
PARTITION_OFFSETS = 1_000_000

SCHEMA = StructType([
    StructField("queue", StringType(), False),
    StructField("offset", LongType(), False),
    StructField("payload", BinaryType(), False),
    StructField("timestamp", TimestampType(), False),
    StructField("delivery_count", IntegerType(), False),
    StructField("headers", MapType(StringType(), BinaryType(), False), False),  # empty: none
])


class OffsetRange(InputPartition):
    """One read task: offsets ``[start, end)`` of ``queue``."""

    def __init__(self, queue: str, start: int, end: int) -> None:
        self.queue = queue
        self.start = start
        self.end = end

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OffsetRange) and (self.queue, self.start, self.end) == (
            other.queue, other.start, other.end)

    def __hash__(self) -> int:
        return hash((self.queue, self.start, self.end))


def split(queue: str, start: int, end: int, min_partitions: int) -> list[OffsetRange]:
    """The read tasks of a range: a pure function of its arguments, so a replay plans the same tasks."""
    n = end - start
    if n <= 0:
        return []
    parts = min(n, max(min_partitions, math.ceil(n / PARTITION_OFFSETS)))
    bounds = [start + n * i // parts for i in range(parts + 1)]
    return [OffsetRange(queue, bounds[i], bounds[i + 1]) for i in range(parts)]


def to_arrow(queue: str, msgs: list[Message]) -> pa.RecordBatch:
    """The rows of messages already read (``read_range`` reads columns, not messages)."""
    return to_batch(queue, from_messages(msgs))


def read_range(o: ReadOptions, part: OffsetRange) -> Iterator[pa.RecordBatch]:
    """The rows of ``[part.start, part.end)``, in offset order, read without leasing them.

    The connection opens here, in the task.  A gap (offsets freed before they were read) raises
    ``DataLost`` unless failOnDataLoss is false, when the missing offsets are skipped."""
    b = broker_for(o.url, o.token)
    try:
        q = b.queue(part.queue)
        off, end = part.start, part.end
        # a read stops short of a frame (or MAX_READ_BYTES): the next goes on from where it stopped
        for r in read_span(q, off, end):
            first = int(r.offsets[0]) if len(r) else end
            if first != off:
                if o.fail_on_data_loss:
                    raise DataLost(f"offsets {off}..{min(first, end) - 1} of queue {part.queue!r} are no "
                                   "longer retained (committed by the query's group by someone else, the "
                                   "group deleted, or the queue purged/re-created); set failOnDataLoss "
                                   "to false to skip them")
                r = r.head(int(np.searchsorted(r.offsets, end)))
                if not len(r):
                    return
            yield to_batch(part.queue, r)
            off = int(r.offsets[-1]) + 1
    finally:
        b.close()


def timestamp_start(ms: int) -> datetime:
    """startingTimestamp (ms since the epoch) as the exact time ``create_group`` and ``seek`` take."""
    return _EPOCH + timedelta(milliseconds=ms)


def offset_at(q: Queue, ts_ns: int, first: int, nxt: int) -> int:
    """The first offset of [first, nxt) whose message was produced at or after ``ts_ns``, else
    ``nxt``: the broker's binary search (``Groups.offset_at``) done with reads, for a batch
    read, which owns no group.  A tombstone (timestamp 0) counts as the message after it."""

    def stamp(o: int) -> int | None:  # the first real timestamp at or after o, below nxt
        while o < nxt:
            msgs = [m for m in q.read(o, min(64, nxt - o)) if m.offset < nxt]
            for m in msgs:
                if m.timestamp_ns:
                    return int(m.timestamp_ns)
            if not msgs:
                return None
            o = msgs[-1].offset + 1
        return None

    lo, hi = first, nxt
    while lo < hi:
        mid = (lo + hi) // 2
        t = stamp(mid)
        if t is None or t >= ts_ns:
            hi = mid
        else:
            lo = mid + 1
    while lo < nxt and (got := q.read(lo, 1)) and not got[0].timestamp_ns:
        lo = got[0].offset + 1  # past tombstones
    return lo


def check_schema(schema: StructType) -> None:
    if schema is not None and [(f.name, f.dataType) for f in schema.fields] != [
            (f.name, f.dataType) for f in SCHEMA.fields]:
        raise InvalidArgument(f"the shmq source has a fixed schema ({SCHEMA.simpleString()}); "
                              f"do not pass another one ({schema.simpleString()})")


class BatchReader(DataSourceReader):
    """``spark.read.format("shmq")``: a snapshot of the retained offsets, read without leasing."""

    def __init__(self, opts: ReadOptions) -> None:
        self.o = opts

    def partitions(self) -> list[OffsetRange]:
        o = self.o
        with broker_for(o.url, o.token) as b:
            q = b.queue(o.queue)
            st = q.stats()
            first, nxt = st["first_offset"], st["next_offset"]
            start = first if o.starting == "earliest" else nxt if o.starting == "latest" else int(o.starting)
            if o.starting_timestamp is not None:
                start = offset_at(q, to_ns(timestamp_start(o.starting_timestamp)), first, nxt)
        end = nxt if o.ending == "latest" else int(o.ending)
        if start > nxt or end > nxt:
            raise InvalidArgument(f"offsets {start}..{end} of queue {o.queue!r} are past its next "
                                  f"offset {nxt}")
        if end < start:
            raise InvalidArgument(f"endingOffsets {end} is before startingOffsets {start}")
        if start < first:
            if o.fail_on_data_loss:
                raise DataLost(f"startingOffsets {start} of queue {o.queue!r}: the oldest retained offset is "
                               f"{first}; set failOnDataLoss to false to start there")
            start = min(first, end)
        return split(o.queue, start, end, o.min_partitions) or [OffsetRange(o.queue, start, start)]

    def read(self, partition: OffsetRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        return read_range(self.o, partition)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("shmq")``.  The driver-side methods keep one broker handle
    (dropped when pickled); ``read()`` runs in the tasks and opens its own."""

    def __init__(self, opts: ReadOptions) -> None:
        self.o = opts
        self._target: int | None = None  # Trigger.AvailableNow: do not read past this offset
        self._broker: Broker | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_broker"] = None
        return state

    def _call(self, fn: Any) -> Any:
        """Run ``fn(queue)`` on the driver's handle; reconnect once if the connection was lost."""
        for attempt in (0, 1):
            if self._broker is None:
                self._broker = broker_for(self.o.url, self.o.token)
            try:
                return fn(self._broker.queue(self.o.queue))
            except ConnectionLost:
                self._broker = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _offset(self, offset: Mapping[str, Any]) -> int:
        try:
            return int(offset[self.o.queue])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(f"offset {offset!r} does not name queue {self.o.queue!r}: the checkpoint "
                                  "belongs to a query on another queue") from None

    def _rejoin(self, q: Queue, at: int) -> None:
        """Re-create the query's group (someone deleted it) so that it retains ``at`` onward."""
        try:
            q.create_group(self.o.group, "earliest")
        except GroupExists:
            pass
        q.commit(self.o.group, at)

    # ------------------------------------------------------------ offsets
    def initialOffset(self) -> dict[str, int]:
        """Where the query starts: the floor of its group.  startingOffsets places a group when
        it is created; a group that exists already resumes where it last committed.  So the
        answer is stable, as it must be: Spark asks again when it replays a first batch that
        did not complete, and a later "latest" would give that batch another range."""
        o = self.o

        def start(q: Queue) -> int:
            st = q.stats()
            if o.group not in st["groups"]:
                self._create_group(q, st["first_offset"], st["next_offset"])
                st = q.stats()
            return int(st["groups"][o.group]["floor"])

        return {o.queue: self._call(start)}

    def _create_group(self, q: Queue, first: int, nxt: int) -> None:
        """Create the query's group at startingOffsets (or startingTimestamp)."""
        o = self.o
        if o.starting_timestamp is not None:
            try:
                q.create_group(o.group, start=timestamp_start(o.starting_timestamp))
            except GroupExists:
                pass
            return
        if o.starting in ("earliest", "latest"):
            try:
                q.create_group(o.group, str(o.starting))
            except GroupExists:
                pass
            return
        at = int(o.starting)
        if at > nxt:
            raise InvalidArgument(f"startingOffsets {at} is past the next offset {nxt} of queue {o.queue!r}")
        if at < first and o.fail_on_data_loss:
            raise DataLost(f"startingOffsets {at}: queue {o.queue!r} no longer retains offsets below "
                           f"{first}; set failOnDataLoss to false to start there")
        self._rejoin(q, at)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        o = self.o
        s = self._offset(start)

        def latest(q: Queue) -> int:
            st = q.stats()
            first, nxt = st["first_offset"], st["next_offset"]
            if o.group not in st["groups"]:
                self._rejoin(q, s)
            if s > nxt:
                raise DataLost(f"the query is at offset {s} but queue {o.queue!r} ends at {nxt}: was the "
                               "queue deleted and re-created? Start the query with a new checkpoint")
            if s < first and o.fail_on_data_loss:
                raise DataLost(f"offsets {s}..{first - 1} of queue {o.queue!r} were freed before the query "
                               f"read them (group {o.group!r} committed or deleted by someone else?)")
            return int(nxt)

        end = self._call(latest)
        if self._target is not None:
            end = min(end, self._target)
        if isinstance(limit, ReadMaxRows):
            end = min(end, s + limit.max_rows)
        elif isinstance(limit, ReadMinRows) and end - s < limit.min_rows:
            end = s
        return {o.queue: max(end, s)}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.o.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.o.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._call(lambda q: int(q.stats()["next_offset"]))

    def reportLatestOffset(self) -> dict[str, int]:
        return {self.o.queue: self._call(lambda q: int(q.stats()["next_offset"]))}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[OffsetRange]:
        return split(self.o.queue, self._offset(start), self._offset(end), self.o.min_partitions)

    def read(self, partition: OffsetRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        return read_range(self.o, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Acknowledge everything below ``end`` for the query's group.  Spark calls this late
        (when it plans the next batch) and sometimes twice: a commit never moves the group back."""
        e = self._offset(end)

        def commit(q: Queue) -> None:
            try:
                q.commit(self.o.group, e)
            except GroupNotFound:
                self._rejoin(q, e)

        self._call(commit)

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.close()
            self._broker = None
