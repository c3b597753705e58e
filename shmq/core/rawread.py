"""A range of a co-located queue's records as columns: ``Queue.read`` without a Message per record.

:func:`read_columns` copies a range's slots out of the segment (one or two runs of the
slot table) and its bytes (one run per lap of the byte ring), under the consumer lock,
which keeps them from being freed meanwhile, and splits the slots into ``array``
columns with strided slices: no Python object per record.  The broker answers READ
with it (a READ_OK body is these columns, ``codec.records_field``), and
``ShmQueue.read_columns`` with the same arrays (the Spark source's read).  Like
``Queue.read`` it never leases: it gives the records from ``max(offset, first retained)`` on.
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate

from shmq.accel import ext
from shmq.core.handle import QueueHandle
from shmq.core.layout import Q_FREE_OFFSET, S_BYTEPOS, S_LENS, S_TIMESTAMP, WORD
from shmq.errors import StorageError
from shmq.protocol.bodies import records_field

_LITTLE = sys.byteorder == "little"
_read_c = None if ext is None else ext.read_run  # the compiled twin of the copy below (shmq.accel)


def _native(code: str, raw: bytes) -> array[int]:
    col = array(code)
    col.frombytes(raw)
    return col


@dataclass(frozen=True, slots=True)
class Columns:
    """Records ``first, first + 1, ...``: their producer timestamps (ns), metadata and payload
    lengths, and ``data``, each record's metadata then its payload, back to back."""

    first: int
    stamps: array[int]  # "Q"
    meta_lens: array[int]  # "I"
    payload_lens: array[int]  # "I"
    data: bytes

    def __len__(self) -> int:
        return len(self.payload_lens)


def read_columns(q: QueueHandle, offset: int, max_messages: int, max_bytes: int) -> Columns:
    """Up to ``max_messages`` retained records from ``offset`` on, fewer where their bytes would
    pass ``max_bytes`` (but at least one)."""
    return _read(q, offset, max_messages, max_bytes, False)  # type: ignore[return-value]


def read_field(q: QueueHandle, offset: int, max_messages: int, max_bytes: int, shown: int = 0) -> bytes:
    """``read_columns``'s records as one ``records`` field (a READ_OK body,
    ``protocol.bodies.records_field``): with the accelerator, built under the lock in one pass.
    ``shown``: added to every offset in the field (a priority queue's level, in its top bits)."""
    c = _read(q, offset, max_messages, max_bytes, not shown)
    if isinstance(c, bytes):
        return c
    first = shown | c.first
    return records_field(range(first, first + len(c)), [0] * len(c), c.stamps, c.meta_lens,
                         c.payload_lens, c.data)


def _corrupt(q: QueueHandle, what: str) -> StorageError:
    return StorageError(f"queue {q.name!r} is corrupt: {what} (shmq doctor --check)")


def _read(q: QueueHandle, offset: int, max_messages: int, max_bytes: int, field: bool) -> Columns | bytes:
    """``read_columns``; with ``field``, where the accelerator is built, its records field instead."""
    q._alive()
    ring = q.ring
    w, mm, cap, sw, size = ring.w, ring.mm, ring.capacity, ring.slot_words, ring.size
    with ring.clock:
        start = max(offset, w[Q_FREE_OFFSET])
        n = min(w[q.consumer_groups.tail_word], start + max_messages) - start
        if n <= 0:
            return Columns(start, array("Q"), array("I"), array("I"), b"")
        if _read_c is not None:
            try:
                got = _read_c(mm, ring.slots_w, cap, sw, ring.data_off, size, start, n, max_bytes, field)
            except ValueError as e:  # a corrupt slot: the twin's error
                raise _corrupt(q, str(e)) from None
            if field:
                return got  # type: ignore[no-any-return]
            st, ml, pl, data = got
            return Columns(start, _native("Q", st), _native("I", ml), _native("I", pl), data)
        slots = array("Q")
        base = ring.slots_w * WORD
        i0 = start % cap
        for i, k in ((i0, min(n, cap - i0)), (0, n - (cap - i0))):  # the table may wrap
            if k > 0:
                slots.frombytes(mm[base + i * sw * WORD:base + (i + k) * sw * WORD])
        halves = array("I", slots[S_LENS::sw].tobytes())  # each length word: payload | meta << 32
        plens, mlens = (halves[0::2], halves[1::2]) if _LITTLE else (halves[1::2], halves[0::2])
        if sum(plens) + sum(mlens) > max_bytes:
            n = max(1, bisect_right(list(accumulate(map(int.__add__, plens, mlens))), max_bytes))
            del plens[n:], mlens[n:]
        pos = slots[S_BYTEPOS::sw][:n]
        for r in range(n):  # each record in the byte ring, as the compiled reader checks
            if pos[r] % size + plens[r] + mlens[r] > size:
                raise _corrupt(q, f"the record of offset {start + r} reaches past the byte ring")
        parts = []
        i = 0
        while i < n:  # a lap at a time: records follow one another inside a lap
            j = bisect_left(pos, (pos[i] // size + 1) * size, i, n)
            span = pos[j - 1] + plens[j - 1] + mlens[j - 1] - pos[i]
            if span == sum(plens[i:j]) + sum(mlens[i:j]):
                at = ring.data_off + pos[i] % size
                parts.append(mm[at:at + span])
            else:  # not back to back (no writer leaves gaps, but never assume it): one at a time
                for r in range(i, j):
                    at = ring.data_off + pos[r] % size
                    parts.append(mm[at:at + mlens[r] + plens[r]])
            i = j
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        return Columns(start, slots[S_TIMESTAMP::sw][:n], mlens, plens, data)
