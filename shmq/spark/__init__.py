"""shmq as a PySpark data source: streaming and batch, source and sink (Python Data Source API).

    import shmq.spark
    shmq.spark.register(spark)                      # the format is then called "shmq"
    events = (spark.readStream.format("shmq").option("url", "tcp://127.0.0.1:7878")
              .option("queue", "events").load())    # queue, offset, payload, timestamp,
                                                    # delivery_count, headers
    (events.selectExpr("upper(cast(payload as string)) as payload")
           .writeStream.format("shmq").option("queue", "out")
           .option("checkpointLocation", "/tmp/ck").start())

A streaming read is exactly-once.  A micro-batch is an offset range ``[start, end)`` of one
queue; the query owns a consumer group (option ``group``) that retains every message until
Spark commits the batch, so the same range always yields the same rows, and ``commit(end)``
acknowledges through ``end`` (late or twice is harmless: a commit never moves back).  The
sink writes through shmq's idempotent producers, one per (query, partition), with sequence
numbers from (batch id, chunk), so a replayed batch or a retried task writes nothing twice.

Only this module imports pyspark (``import shmq`` does not), with the two it is split into:
``spark.source`` (the readers) and ``spark.sink`` (the writers); ``spark.options`` holds
the options both check; ``spark.workers`` checks the Python of Spark's workers.  Every name
is importable from here.  Every option is documented in ``docs/spark.md``.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from shmq.errors import InvalidArgument
from shmq.spark import workers
from shmq.spark.arrow import ARROW_SCHEMA
from shmq.spark.options import (
    DEFAULT_GROUP,
    DEFAULT_SINK_BATCH,
    DEFAULT_URL,
    DEFAULT_WRITE_TIMEOUT,
    MAX_MIN_PARTITIONS,
    DataLost,
    ReadOptions,
    WriteOptions,
    read_options,
    write_options,
)
from shmq.spark.sink import (
    SEQS_PER_BATCH,
    SINK_BATCH_BYTES,
    BatchWriter,
    StreamWriter,
    Written,
    headers_column,
    payload_column,
    priority_column,
    write_partition,
)
from shmq.spark.source import (
    PARTITION_OFFSETS,
    SCHEMA,
    BatchReader,
    OffsetRange,
    StreamReader,
    check_schema,
    read_range,
    split,
    to_arrow,
)

FORMAT = "shmq"


def register(spark: Any) -> None:
    """Register the data source with a SparkSession under the name ``shmq``; its reads
    default ``minPartitions`` to the session's parallelism (``local[N]``: N), so a range
    is read by as many tasks in parallel as Spark has cores.  First, in local mode, the
    Python that Spark's workers will run must import shmq and pyarrow (``spark.workers``):
    when nobody chose it, they run the driver's Python instead; else ``InvalidArgument``."""
    workers.check(spark)
    spark.dataSource.register(source_for(default_parallelism(spark)))


def default_parallelism(spark: Any) -> int:
    """Spark's default parallelism (its cores), clamped to minPartitions' range; 1 when the
    session does not say (Spark Connect has no SparkContext)."""
    try:
        n = int(spark.sparkContext.defaultParallelism)
    except Exception:  # noqa: BLE001 (no SparkContext here: one task per range, as unregistered)
        return 1
    return max(1, min(n, MAX_MIN_PARTITIONS))


def source_for(min_partitions: int) -> type[ShmqDataSource]:
    """``ShmqDataSource`` with reads' default minPartitions set.  A class made here is
    pickled by value when Spark ships it to its Python workers, the default with it."""

    class ShmqSource(ShmqDataSource):
        DEFAULT_MIN_PARTITIONS = min_partitions

    return ShmqSource


# =============================================================== the data source
class ShmqDataSource(DataSource):
    """The ``shmq`` format.  Options: docs/spark.md."""

    DEFAULT_MIN_PARTITIONS = 1  # reads' minPartitions when the option is not given (see source_for)

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return SCHEMA

    def reader(self, schema: StructType) -> BatchReader:
        check_schema(schema)
        return BatchReader(read_options(self.options, False, self.DEFAULT_MIN_PARTITIONS))

    def streamReader(self, schema: StructType) -> StreamReader:
        check_schema(schema)
        return StreamReader(read_options(self.options, True, self.DEFAULT_MIN_PARTITIONS))

    def writer(self, schema: StructType, overwrite: bool) -> BatchWriter:
        if overwrite:
            raise InvalidArgument("a queue cannot be overwritten: write with mode('append')")
        return BatchWriter(write_options(self.options), payload_column(schema), headers_column(schema),
                           priority_column(schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> StreamWriter:
        # overwrite is Spark's "complete" output mode: each batch appends the whole result again.
        return StreamWriter(write_options(self.options), payload_column(schema), headers_column(schema),
                            priority_column(schema))


__all__ = ["ARROW_SCHEMA", "DEFAULT_GROUP", "DEFAULT_SINK_BATCH", "DEFAULT_URL", "DEFAULT_WRITE_TIMEOUT",
           "DataLost", "FORMAT", "PARTITION_OFFSETS", "SCHEMA", "SEQS_PER_BATCH", "SINK_BATCH_BYTES",
           "BatchReader", "BatchWriter", "OffsetRange", "ReadOptions", "ShmqDataSource", "StreamReader",
           "StreamWriter", "WriteOptions", "Written", "default_parallelism", "headers_column",
           "payload_column", "priority_column", "read_options", "read_range", "register", "source_for",
           "split", "to_arrow", "write_options", "write_partition"]
