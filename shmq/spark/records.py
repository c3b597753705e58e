"""Records of a queue range as numpy columns, for the Spark source: no Python object per record.

:class:`Records` holds a run of retained records as numpy columns (offsets, producer
timestamps, metadata and payload lengths) and one byte buffer with every record's
metadata and payload back to back.  It is made from what a queue's ``read_columns`` and
``iter_columns`` give (``shmq.api.RecordColumns``: arrays numpy sees without a copy), which
every transport reads its own fast way: a co-located queue copies its segment's slots and
bytes out, a TCP one sees a READ_OK frame's columns.  ``spark.arrow`` turns one into an Arrow
batch.  Like ``Queue.read`` it never leases: a read gives the records from
``max(offset, first retained)`` on.  The sink puts its chunks with ``Queue.put_joined``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from shmq import options
from shmq.api import Message, Queue, RecordColumns, check_producer
from shmq.errors import LimitExceeded
from shmq.joined import Joined

_I64 = np.dtype(np.int64)


@dataclass(frozen=True, slots=True)
class Records:
    """Consecutive retained records (ascending offsets, possibly with gaps): columns of int64,
    and ``data``, each record's metadata then its payload, back to back."""

    offsets: np.ndarray
    stamps: np.ndarray  # ns since the epoch, the producer's wall clock
    meta_lens: np.ndarray
    payload_lens: np.ndarray
    data: bytes | bytearray | memoryview

    def __len__(self) -> int:
        return len(self.offsets)

    def head(self, n: int) -> Records:
        """The first ``n`` records."""
        if n >= len(self.offsets):
            return self
        nbytes = int(self.meta_lens[:n].sum() + self.payload_lens[:n].sum())
        return Records(self.offsets[:n], self.stamps[:n], self.meta_lens[:n], self.payload_lens[:n],
                       memoryview(self.data)[:nbytes])


def empty() -> Records:
    none = np.zeros(0, _I64)
    return Records(none, none, none, none, b"")


def of_columns(c: RecordColumns) -> Records:
    """A queue's columns seen by numpy: the 64-bit columns without a copy (offsets and
    timestamps stay below 2**63), the 32-bit lengths widened to int64."""
    if not len(c):
        return empty()
    offs = c.offsets
    offsets = (np.arange(offs.start, offs.stop, offs.step, dtype=_I64) if isinstance(offs, range)
               else np.frombuffer(offs, _I64))  # type: ignore[call-overload]
    return Records(offsets, np.frombuffer(c.stamps, _I64), np.frombuffer(c.meta_lens, np.uint32).astype(_I64),
                   np.frombuffer(c.payload_lens, np.uint32).astype(_I64), c.data)


def read_records(q: Queue, offset: int, max_messages: int) -> Records:
    """The retained records from ``offset`` on (at most ``max_messages``; fewer where one read
    would grow too big: ``Queue.read_columns``), as ``q.read`` gives them but as columns."""
    return of_columns(q.read_columns(offset, max_messages))


def read_span(q: Queue, offset: int, end: int) -> Iterator[Records]:
    """The retained records of ``[offset, end)``, as ``read_records`` gives them one read at a
    time (a gap shows as a first offset past where the read began), until a read gives
    nothing or reaches ``end`` (``Queue.iter_columns``: over TCP one round trip ahead)."""
    for c in q.iter_columns(offset, end):
        yield of_columns(c)


def from_messages(msgs: list[Message]) -> Records:
    """Records of messages already read (one Python object each: the slow path)."""
    return of_columns(RecordColumns.of(msgs))


# ---------------------------------------------------------------- the sink's puts
def put_records(q: Queue, payload_lens: np.ndarray, data: np.ndarray, producer: str,
                seq: int, timeout: float, priority: int = 0) -> int:
    """Put payloads given as their lengths and their bytes back to back, atomically and at
    most once per (``producer``, ``seq``), as ``put_many(..., producer=, seq=)`` would
    (``Queue.put_joined``: over TCP one frame made of the columns, co-located one copy into
    the ring).  Returns how many were put; raises ``Duplicate`` when that sequence was
    written already."""
    check_producer(producer, seq)
    n = len(payload_lens)
    if not 1 <= n <= options.MAX_BATCH:
        raise LimitExceeded(f"{n} messages in one batch: 1 to {options.MAX_BATCH}")
    q.put_joined(Joined(payload_lens.tolist(), data.data), timeout=timeout, producer=producer, seq=seq,
                 priority=priority)
    return n
