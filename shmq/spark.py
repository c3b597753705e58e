"""shmq as a PySpark data source: streaming and batch, source and sink (Python Data Source API).

    import shmq.spark
    shmq.spark.register(spark)                      # the format is then called "shmq"
    events = (spark.readStream.format("shmq").option("url", "tcp://127.0.0.1:7878")
              .option("queue", "events").load())    # queue, offset, payload, timestamp, delivery_count
    (events.selectExpr("upper(cast(payload as string)) as payload")
           .writeStream.format("shmq").option("queue", "out")
           .option("checkpointLocation", "/tmp/ck").start())

A streaming read is exactly-once.  A micro-batch is an offset range ``[start, end)`` of one
queue; the query owns a consumer group (option ``group``) that retains every message until
Spark commits the batch, so the same range always yields the same rows, and ``commit(end)``
acknowledges through ``end`` (late or twice is harmless: a commit never moves back).  The
sink writes through shmq's idempotent producers, one per (query, partition), with sequence
numbers from (batch id, chunk), so a replayed batch or a retried task writes nothing twice.

Only this module imports pyspark (``import shmq`` does not).  Every option is documented in
``docs/spark.md``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import socket
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
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
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from . import connect, options
from .api import Broker, Message, Queue
from .errors import (
    ConnectionLost,
    Duplicate,
    GroupNotFound,
    InstanceError,
    InvalidArgument,
    LimitExceeded,
    QueueExists,
    ShmqError,
)
from .segment import registry_name, shm_path

FORMAT = "shmq"
DEFAULT_URL = options.DEFAULT_URL
DEFAULT_GROUP = "spark"  # the consumer group a streaming query owns, unless option "group" names one
PARTITION_OFFSETS = 100_000  # a read task covers at most this many offsets (more: more partitions)
DEFAULT_SINK_BATCH = 1_000  # messages per put_many of the sink (option "batchSize", <= MAX_BATCH)
SINK_BATCH_BYTES = 4 << 20  # payload bytes per put_many at most (well under the TCP frame limit)
DEFAULT_WRITE_TIMEOUT = 60.0  # s a sink task waits for room in a full queue (option "writeTimeout")
SEQS_PER_BATCH = 1 << 24  # sink sequence numbers per (micro-batch, partition): seq = batch * this + chunk + 1

SCHEMA = StructType([
    StructField("queue", StringType(), False),
    StructField("offset", LongType(), False),
    StructField("payload", BinaryType(), False),
    StructField("timestamp", TimestampType(), False),
    StructField("delivery_count", IntegerType(), False),
])
ARROW_SCHEMA = pa.schema([
    pa.field("queue", pa.string(), False),
    pa.field("offset", pa.int64(), False),
    pa.field("payload", pa.binary(), False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), False),
    pa.field("delivery_count", pa.int32(), False),
])

_NAMES = ["url", "token", "queue", "group", "startingOffsets", "endingOffsets", "maxOffsetsPerTrigger",
          "minPartitions", "failOnDataLoss", "batchSize", "writeTimeout"]
_READ_OPTIONS = {n.lower() for n in _NAMES[:9]}
_WRITE_OPTIONS = {"url", "token", "queue", "batchsize", "writetimeout"}


class DataLost(ShmqError):
    """Offsets a query still had to read are no longer retained (or the queue was re-created)."""


def register(spark: Any) -> None:
    """Register the data source with a SparkSession under the name ``shmq``."""
    spark.dataSource.register(ShmqDataSource)


# =============================================================== options
@dataclass(frozen=True)
class ReadOptions:
    url: str
    token: str | None
    queue: str
    group: str
    starting: str | int  # "earliest", "latest" or an offset
    ending: str | int
    max_per_trigger: int | None
    min_partitions: int
    fail_on_data_loss: bool


@dataclass(frozen=True)
class WriteOptions:
    url: str
    token: str | None
    queue: str
    batch_size: int
    write_timeout: float


def _lower(opts: Mapping[str, str], allowed: set[str]) -> dict[str, str]:
    """The options with lower-case names.  An unknown name close to one of ours is a typo and an
    error; other unknown names are ignored, since Spark adds its own (checkpointLocation, queryName)."""
    out = {str(k).lower(): v for k, v in opts.items()}
    names = {n.lower(): n for n in _NAMES}
    for key in out:
        if key in allowed:
            continue
        close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.8)
        if close:
            hint = (f"did you mean {names[close[0]]!r}?" if close[0] in allowed
                    else f"{names[close[0]]!r} is not an option of this direction (docs/spark.md)")
            raise InvalidArgument(f"unknown shmq option {key!r}: {hint}")
    return out


def _int(o: dict[str, str], key: str, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = o.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"option {name} must be an integer, not {raw!r}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"option {name} must be between {low} and {high}, not {value}")
    return value


def _offset_spec(raw: str | None, name: str, queue: str, default: str) -> str | int:
    """``earliest`` / ``latest`` / a JSON offset ``{"<queue>": n}`` (-2: earliest, -1: latest, as Kafka)."""
    if raw is None:
        return default
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return text.lower()
    try:
        spec = json.loads(text)
    except ValueError:
        spec = None
    if not isinstance(spec, dict) or set(spec) != {queue} or type(spec[queue]) is not int:
        raise InvalidArgument(f"option {name} must be 'earliest', 'latest' or a JSON offset such as "
                              f'{{"{queue}": 42}} (naming this query\'s queue), not {raw!r}')
    n = spec[queue]
    if n == -2:
        return "earliest"
    if n == -1:
        return "latest"
    if n < 0:
        raise InvalidArgument(f"option {name}: offset {n} is negative (-2 means earliest, -1 latest)")
    return int(n)


def _common(o: dict[str, str]) -> tuple[str, str | None, str]:
    url = o.get("url", DEFAULT_URL)
    if not url.startswith(("tcp://", "shm://")):
        raise InvalidArgument(f"option url must be tcp://HOST:PORT or shm://INSTANCE, not {url!r}")
    queue = o.get("queue")
    if not queue:
        raise InvalidArgument("option queue is required: .option('queue', 'events')")
    return url, o.get("token"), queue


def read_options(opts: Mapping[str, str], streaming: bool) -> ReadOptions:
    """Check a read's options (case-insensitive, as Spark passes them)."""
    o = _lower(opts, _READ_OPTIONS)
    url, token, queue = _common(o)
    if streaming and "endingoffsets" in o:
        raise InvalidArgument("option endingOffsets is for batch reads only")
    if not streaming and "maxoffsetspertrigger" in o:
        raise InvalidArgument("option maxOffsetsPerTrigger is for streaming reads only")
    starting = _offset_spec(o.get("startingoffsets"), "startingOffsets", queue,
                            "latest" if streaming else "earliest")
    ending = _offset_spec(o.get("endingoffsets"), "endingOffsets", queue, "latest")
    if ending == "earliest":
        raise InvalidArgument("option endingOffsets cannot be 'earliest'")
    flag = o.get("failondataloss", "true").lower()
    if flag not in ("true", "false"):
        raise InvalidArgument(f"option failOnDataLoss must be true or false, not {o['failondataloss']!r}")
    max_per_trigger = _int(o, "maxoffsetspertrigger", "maxOffsetsPerTrigger", None, 1, (1 << 63) - 1)
    min_partitions = _int(o, "minpartitions", "minPartitions", 1, 1, 10_000)
    assert min_partitions is not None
    return ReadOptions(url, token, queue, o.get("group", DEFAULT_GROUP), starting, ending,
                       max_per_trigger, min_partitions, flag == "true")


def write_options(opts: Mapping[str, str]) -> WriteOptions:
    o = _lower(opts, _WRITE_OPTIONS)
    url, token, queue = _common(o)
    batch = _int(o, "batchsize", "batchSize", DEFAULT_SINK_BATCH, 1, options.MAX_BATCH)
    assert batch is not None
    raw = o.get("writetimeout")
    try:
        timeout = DEFAULT_WRITE_TIMEOUT if raw is None else float(raw)
    except ValueError:
        raise InvalidArgument(f"option writeTimeout must be a number of seconds, not {raw!r}") from None
    if not 0 < timeout <= options.MAX_VISIBILITY_TIMEOUT:
        raise InvalidArgument(f"option writeTimeout must be in (0, {options.MAX_VISIBILITY_TIMEOUT}] s")
    return WriteOptions(url, token, queue, batch, timeout)


def _connect(url: str, token: str | None) -> Broker:
    """A broker handle.  ``shm://`` must name an instance that exists on this host (attaching
    would otherwise create an empty one, here, on an executor that is not the broker's host)."""
    if url.startswith("shm://"):
        instance = url[len("shm://"):] or options.DEFAULT_INSTANCE
        if not os.path.exists(shm_path(registry_name(instance))):
            raise InstanceError(f"no shmq instance {instance!r} on this host ({socket.gethostname()}): "
                                "shm:// works where the broker runs; use tcp://HOST:PORT elsewhere")
    return connect(url, token=token)


# =============================================================== reading
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


def _delivery_count(m: Message) -> int:
    """1 for an ordinary queue (the source never leases, so nothing is redelivered to it); for a
    dead-letter queue, the deliveries the message had in its origin group before it died."""
    if not m[6]:
        return 1
    try:
        origin = m.origin
    except (ValueError, KeyError, TypeError):
        return 1
    return origin.deliveries if origin is not None else 1


def to_arrow(queue: str, msgs: list[Message]) -> pa.RecordBatch:
    n = len(msgs)
    return pa.RecordBatch.from_arrays([
        pa.array([queue] * n, pa.string()),
        pa.array([m[3] for m in msgs], pa.int64()),
        pa.array([m[5] if type(m[5]) is bytes else bytes(m[5]) for m in msgs], pa.binary()),
        pa.array([m[7] // 1000 for m in msgs], pa.timestamp("us", tz="UTC")),
        pa.array([_delivery_count(m) for m in msgs], pa.int32()),
    ], schema=ARROW_SCHEMA)


def read_range(o: ReadOptions, part: OffsetRange) -> Iterator[pa.RecordBatch]:
    """The rows of ``[part.start, part.end)``, in offset order, read without leasing them.

    The connection opens here, in the task.  A gap (offsets freed before they were read) raises
    ``DataLost`` unless failOnDataLoss is false, when the missing offsets are skipped."""
    b = _connect(o.url, o.token)
    try:
        q = b.queue(part.queue)
        off, end = part.start, part.end
        while off < end:
            # the broker caps a reply to one frame (large messages): we go on from where it stopped
            msgs = q.read(off, min(options.MAX_BATCH, end - off))
            first = msgs[0].offset if msgs else end
            if first != off:
                if o.fail_on_data_loss:
                    raise DataLost(f"offsets {off}..{min(first, end) - 1} of queue {part.queue!r} are no "
                                   "longer retained (committed by the query's group by someone else, the "
                                   "group deleted, or the queue purged/re-created); set failOnDataLoss "
                                   "to false to skip them")
                msgs = [m for m in msgs if m.offset < end]
                if not msgs:
                    return
            yield to_arrow(part.queue, msgs)
            off = msgs[-1].offset + 1
    finally:
        b.close()


def _check_schema(schema: StructType) -> None:
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
        with _connect(o.url, o.token) as b:
            st = b.queue(o.queue).stats()
        first, nxt = st["first_offset"], st["next_offset"]
        start = first if o.starting == "earliest" else nxt if o.starting == "latest" else int(o.starting)
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
                self._broker = _connect(self.o.url, self.o.token)
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
        except QueueExists:
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
        """Create the query's group at startingOffsets."""
        o = self.o
        if o.starting in ("earliest", "latest"):
            try:
                q.create_group(o.group, str(o.starting))
            except QueueExists:
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


# =============================================================== writing
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
        with _connect(self.o.url, self.o.token) as b:
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
        with _connect(self.o.url, self.o.token) as b:
            w, s = write_partition(b.queue(self.o.queue), iterator, self.column, f"spark:{query}:{pid}",
                                   int(batch) * SEQS_PER_BATCH, self.o.batch_size, self.o.write_timeout)
        return Written(pid, w, s)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: the messages are in the queue once the tasks return."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: what the failed batch wrote stays, and its replay skips it."""


# =============================================================== the data source
class ShmqDataSource(DataSource):
    """The ``shmq`` format.  Options: docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> BatchReader:
        _check_schema(schema)
        return BatchReader(read_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> StreamReader:
        _check_schema(schema)
        return StreamReader(read_options(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        if overwrite:
            raise InvalidArgument("a queue cannot be overwritten: write with mode('append')")
        return BatchWriter(write_options(self.options), payload_column(schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamWriter:
        # overwrite is Spark's "complete" output mode: each batch appends the whole result again.
        return StreamWriter(write_options(self.options), payload_column(schema))


__all__ = ["ARROW_SCHEMA", "DataLost", "FORMAT", "SCHEMA", "BatchReader", "BatchWriter", "OffsetRange",
           "ReadOptions", "ShmqDataSource", "StreamReader", "StreamWriter", "WriteOptions", "Written",
           "read_options", "read_range", "register", "split", "write_options", "write_partition"]
