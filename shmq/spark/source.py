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
from shmq.names import level_name, level_of
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
    StructField("priority", IntegerType(), False),  # a priority queue's level; 0 in any other
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


def spans(queue: str, st: Mapping[str, Any]) -> list[tuple[str, int, int, Mapping[str, Any]]]:
    """(offset key, first retained, next, groups) of each log the queue keeps, from its
    ``stats()``: one for a queue without priorities; a priority queue's levels each as its
    offsets name them, under its own key in a streaming offset (``<queue>``,
    ``<queue>.prio1``, ...: docs/spark.md, "Priority queues")."""
    levels = st.get("levels")
    if not levels:
        return [(queue, int(st["first_offset"]), int(st["next_offset"]), st["groups"])]
    return [(level_name(queue, x["priority"]), int(x["first_offset"]), int(x["next_offset"]), x["groups"])
            for x in levels]


def _numbered(o: ReadOptions, what: str) -> InvalidArgument:
    return InvalidArgument(f"queue {o.queue!r} has priorities: its levels have offsets of their own, so "
                           f"{what} cannot be one number; use earliest, latest or startingTimestamp")


class BatchReader(DataSourceReader):
    """``spark.read.format("shmq")``: a snapshot of the retained offsets, read without leasing
    (every level of a priority queue)."""

    def __init__(self, opts: ReadOptions) -> None:
        self.o = opts

    def partitions(self) -> list[OffsetRange]:
        o = self.o
        with broker_for(o.url, o.token) as b:
            q = b.queue(o.queue)
            logs = spans(o.queue, q.stats())
            if len(logs) > 1 and (isinstance(o.starting, int) or isinstance(o.ending, int)):
                raise _numbered(o, "startingOffsets or endingOffsets")
            ranges = [self._range(q, first, nxt) for _, first, nxt, _ in logs]
        parts = [p for start, end in ranges for p in split(o.queue, start, end, o.min_partitions)]
        return parts or [OffsetRange(o.queue, ranges[0][0], ranges[0][0])]

    def _range(self, q: Queue, first: int, nxt: int) -> tuple[int, int]:
        """[start, end) of one log, retained ``[first, nxt)``, as the options say."""
        o = self.o
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
        return start, end

    def read(self, partition: OffsetRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        return read_range(self.o, partition)


class StreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("shmq")``.  The driver-side methods keep one broker handle
    (dropped when pickled); ``read()`` runs in the tasks and opens its own.  An offset is
    ``{"<queue>": n}``; a priority queue's has a key per level (``spans``)."""

    def __init__(self, opts: ReadOptions) -> None:
        self.o = opts
        self._target: dict[str, int] | None = None  # Trigger.AvailableNow: do not read past these
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

    def _offsets(self, offset: Mapping[str, Any]) -> dict[str, int]:
        """A checkpoint's offset: each log's (the queue, or each level of a priority queue)."""
        try:
            out = {str(k): int(v) for k, v in offset.items()}
            ok = self.o.queue in out and all(level_of(k)[0] == self.o.queue for k in out)
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            raise InvalidArgument(f"offset {offset!r} does not name queue {self.o.queue!r}: the checkpoint "
                                  "belongs to a query on another queue")
        return out

    def _rejoin(self, q: Queue, at: Mapping[str, int]) -> None:
        """Re-create the query's group (someone deleted it) so that it retains ``at`` onward."""
        try:
            q.create_group(self.o.group, "earliest")
        except GroupExists:
            pass
        for offset in at.values():
            q.commit(self.o.group, offset)

    # ------------------------------------------------------------ offsets
    def initialOffset(self) -> dict[str, int]:
        """Where the query starts: the floor of its group.  startingOffsets places a group when
        it is created; a group that exists already resumes where it last committed.  So the
        answer is stable, as it must be: Spark asks again when it replays a first batch that
        did not complete, and a later "latest" would give that batch another range."""
        o = self.o

        def start(q: Queue) -> dict[str, int]:
            st = q.stats()
            if o.group not in st["groups"]:
                self._create_group(q, st)
                st = q.stats()
            return {key: int(groups[o.group]["floor"]) if o.group in groups else first
                    for key, first, _, groups in spans(o.queue, st)}

        return dict(self._call(start))

    def _create_group(self, q: Queue, st: Mapping[str, Any]) -> None:
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
        logs = spans(o.queue, st)
        if len(logs) > 1:
            raise _numbered(o, "startingOffsets")
        at, (_, first, nxt, _) = int(o.starting), logs[0]
        if at > nxt:
            raise InvalidArgument(f"startingOffsets {at} is past the next offset {nxt} of queue {o.queue!r}")
        if at < first and o.fail_on_data_loss:
            raise DataLost(f"startingOffsets {at}: queue {o.queue!r} no longer retains offsets below "
                           f"{first}; set failOnDataLoss to false to start there")
        self._rejoin(q, {o.queue: at})

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, int]:
        o = self.o
        s = self._offsets(start)

        def latest(q: Queue) -> dict[str, int]:
            st = q.stats()
            logs = spans(o.queue, st)
            if {key for key, *_ in logs} != set(s):
                raise DataLost(f"the query's offset {s} does not match queue {o.queue!r}'s levels: was the "
                               "queue deleted and re-created? Start the query with a new checkpoint")
            if o.group not in st["groups"]:
                self._rejoin(q, s)
            for key, first, nxt, _ in logs:
                at = s[key]
                if at > nxt:
                    raise DataLost(f"the query is at offset {at} but queue {o.queue!r} ends at {nxt}: was "
                                   "the queue deleted and re-created? Start the query with a new checkpoint")
                if at < first and o.fail_on_data_loss:
                    raise DataLost(f"offsets {at}..{first - 1} of queue {o.queue!r} were freed before the "
                                   f"query read them (group {o.group!r} committed or deleted by someone "
                                   "else?)")
            return {key: nxt for key, _, nxt, _ in logs}

        end: dict[str, int] = self._call(latest)
        if self._target is not None:
            end = {k: min(e, self._target.get(k, e)) for k, e in end.items()}
        if isinstance(limit, ReadMaxRows):
            budget = limit.max_rows
            for k in sorted(end, key=lambda k: -level_of(k)[1]):  # the highest level first
                end[k] = min(end[k], s[k] + max(budget, 0))
                budget -= max(end[k] - s[k], 0)
        elif isinstance(limit, ReadMinRows) and sum(end[k] - s[k] for k in end) < limit.min_rows:
            end = dict(s)
        return {k: max(e, s[k]) for k, e in end.items()}

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.o.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.o.max_per_trigger)

    def _next(self) -> dict[str, int]:
        return dict(self._call(lambda q: {key: nxt for key, _, nxt, _ in spans(self.o.queue, q.stats())}))

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._next()

    def reportLatestOffset(self) -> dict[str, int]:
        return self._next()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[OffsetRange]:
        s, e = self._offsets(start), self._offsets(end)
        return [p for k in sorted(e, key=lambda k: -level_of(k)[1])
                for p in split(self.o.queue, s.get(k, e[k]), e[k], self.o.min_partitions)]

    def read(self, partition: OffsetRange) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        return read_range(self.o, partition)

    def commit(self, end: dict[str, Any]) -> None:
        """Acknowledge everything below ``end`` for the query's group.  Spark calls this late
        (when it plans the next batch) and sometimes twice: a commit never moves the group back."""
        e = self._offsets(end)

        def commit(q: Queue) -> None:
            try:
                for offset in e.values():
                    q.commit(self.o.group, offset)
            except GroupNotFound:
                self._rejoin(q, e)

        self._call(commit)

    def stop(self) -> None:
        if self._broker is not None:
            self._broker.close()
            self._broker = None
