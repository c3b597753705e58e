"""Python data sources that move no data, for ``bench_spark.py``: Spark's own ceiling for any
source or sink written with PySpark's Python Data Source API.

``shmq-null`` (read) has the shmq source's schema and answers every range with the same
prebuilt Arrow batches (100-byte payloads, made once per Python worker by ``spark.arrow``):
what Spark spends per row of that schema when reading costs nothing.  ``shmq-null``
(write) counts the rows of its Arrow batches and writes them nowhere.  The benchmark
ships this module to Spark's Python workers by value (``cloudpickle``), as it is not
installed there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from shmq.spark import SCHEMA
from shmq.spark.arrow import to_batch
from shmq.spark.records import Records

ROWS_PER_BATCH = 10_000  # rows per Arrow batch, as the shmq source over TCP
_made: dict[int, pa.RecordBatch] = {}


def rows(n: int) -> pa.RecordBatch:
    """``n`` rows of the shmq source's schema, made once per worker."""
    if n not in _made:
        lens = np.full(n, 100, np.int64)
        _made[n] = to_batch("null", Records(np.arange(n, dtype=np.int64), np.full(n, 1 << 60, np.int64),
                                            np.zeros(n, np.int64), lens, b"x" * (100 * n)))
    return _made[n]


class Range(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


class NullReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets 0 .. ``total``, ``rows`` per micro-batch, two read tasks each."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.rows, self.total = int(options["rows"]), int(options["total"])

    def initialOffset(self) -> dict[str, int]:
        return {"null": 0}

    def latestOffset(self, start: dict[str, int], limit: Any) -> dict[str, int]:
        return {"null": min(start["null"] + self.rows, self.total)}

    def prepareForTriggerAvailableNow(self) -> None:
        """Every offset is there from the start."""

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        s, e = start["null"], end["null"]
        return [Range(s, (s + e) // 2), Range((s + e) // 2, e)]

    def read(self, partition: Range) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        for off in range(partition.start, partition.end, ROWS_PER_BATCH):
            yield rows(min(ROWS_PER_BATCH, partition.end - off))

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to acknowledge."""


class NullWriter(DataSourceStreamArrowWriter):
    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing was written."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing was written."""


class NullDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "shmq-null"

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> NullReader:
        return NullReader(self.options)

    def streamWriter(self, schema: StructType, overwrite: bool) -> NullWriter:
        return NullWriter()
