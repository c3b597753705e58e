"""Records of a queue range as columns, for the Spark source: no Python object per record.

:class:`Records` holds a run of retained records as numpy columns (offsets, producer
timestamps, metadata and payload lengths) and one byte buffer with every record's
metadata and payload back to back, as a READ_OK frame carries them.  :func:`read_records`
fills one from a co-located queue's segment (``rawread``: the slots and the bytes copied
out under the consumer lock), from a TCP broker's READ_OK frame
(``np.frombuffer`` over its columns) or, for any other handle, from ``Queue.read``'s
messages.  ``spark_arrow`` turns one into an Arrow batch.  Like ``Queue.read`` it never
leases: a read gives the records from ``max(offset, first retained)`` on.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmq import options
from shmq.api import Message, Queue, check_producer
from shmq.client.tcp import TcpQueue
from shmq.core.queue import ShmQueue
from shmq.core.rawread import read_columns
from shmq.errors import InvalidArgument, LimitExceeded
from shmq.joined import Joined
from shmq.protocol.bodies import encode_body, malformed
from shmq.protocol.codec import Frame, T, encode_frame
from shmq.protocol.commands import _fields, _fields_frame, _pick, _timeout_ms
from shmq.protocol.connection import Request

MAX_READ_BYTES = 64 << 20  # bytes of records one read from a segment copies at most (>= 1 record)
_U32 = struct.Struct(">I")
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


def read_records(q: Queue, offset: int, max_messages: int) -> Records:
    """The retained records from ``offset`` on (at most ``max_messages``; fewer when they would
    exceed a frame, or ``MAX_READ_BYTES`` from a segment): as ``q.read`` but as columns."""
    if max_messages < 1 or offset < 0:
        raise InvalidArgument("offset must be >= 0 and max_messages >= 1")
    if isinstance(q, ShmQueue):
        return from_segment(q, offset, max_messages, MAX_READ_BYTES)
    if isinstance(q, TcpQueue):
        req = Request(_fields_frame, (T.READ, {"queue": q.name, "offset": offset,
                                               "max": min(max_messages, options.MAX_BATCH)}), _read_ok)
        return q._b._execute(req)  # type: ignore[no-any-return]
    return from_messages(q.read(offset, min(max_messages, options.MAX_BATCH)))


def read_span(q: Queue, offset: int, end: int) -> Iterator[Records]:
    """The retained records of ``[offset, end)``, as ``read_records`` gives them one read at a
    time (a gap shows as a first offset past where the read began), until a read gives
    nothing or reaches ``end``.  Over TCP the next READ is sent before this one's answer is
    used (one round trip ahead): it asks from where a full answer would stop, and is read
    again from the right offset when the answer stopped short."""
    if not isinstance(q, TcpQueue):
        while offset < end:
            r = read_records(q, offset, end - offset)
            yield r
            if not len(r):
                return
            offset = int(r.offsets[-1]) + 1
        return
    b = q._b

    def ask(at: int) -> tuple[int, Any]:
        n = min(end - at, options.MAX_BATCH)
        return at + n, b._begin(Request(_fields_frame, (T.READ, {"queue": q.name, "offset": at, "max": n}),
                                        _read_ok))

    asked, ahead = ask(offset), None
    while True:
        full_end, box = asked
        if ahead is None and full_end < end:
            ahead = ask(full_end)
        r = _read_ok(b._wait(box), None)
        yield r
        if not len(r) or (offset := int(r.offsets[-1]) + 1) >= end:
            break
        if ahead is not None and offset == full_end:
            asked, ahead = ahead, None
            continue
        if ahead is not None:  # this answer stopped short: the one asked ahead starts too far
            b._wait(ahead[1])
            ahead = None
        asked = ask(offset)
    if ahead is not None:
        b._wait(ahead[1])  # not needed, but the connection's next answer: read it off


def from_messages(msgs: list[Message]) -> Records:
    """Records of messages already read (one Python object each: the slow path)."""
    metas = [m[6] or b"" for m in msgs]
    payloads = [m[5] for m in msgs]
    data = b"".join(x for pair in zip(metas, payloads, strict=True) for x in pair)
    return Records(np.array([m[3] for m in msgs], _I64), np.array([m[7] for m in msgs], _I64),
                   np.array([len(x) for x in metas], _I64), np.array([len(x) for x in payloads], _I64), data)


# ---------------------------------------------------------------- a TCP broker's READ_OK
def _read_ok(f: Frame, _: Any) -> Records:
    if f.type != T.READ_OK:
        _fields(f, T.READ_OK)  # raises the typed error of an ERROR, or says what came instead
    return from_records_field(f.body)


def from_records_field(body: bytes | bytearray | memoryview) -> Records:
    """The records of a ``records`` field (a READ_OK or DELIVER_BATCH body: a count, five
    big-endian columns, then the bytes; ``docs/protocol.md``), without copying the bytes."""
    size = len(body)
    if size < 4:
        raise malformed("truncated records")
    (n,) = _U32.unpack_from(body)
    b, c, d, e = 4 + 10 * n, 4 + 18 * n, 4 + 22 * n, 4 + 26 * n  # deliveries (0 for a read) from 4 + 8n
    if e > size:
        raise malformed("truncated records")
    mlens = np.frombuffer(body, ">u4", n, c).astype(_I64)
    plens = np.frombuffer(body, ">u4", n, d).astype(_I64)
    if int(mlens.sum() + plens.sum()) != size - e:
        raise malformed("the records' lengths do not add up to their bytes")
    offsets = np.frombuffer(body, ">u8", n, 4).astype(_I64)
    return Records(offsets, np.frombuffer(body, ">u8", n, b).astype(_I64), mlens, plens, memoryview(body)[e:])


# ---------------------------------------------------------------- a co-located queue's segment
def from_segment(q: ShmQueue, offset: int, max_messages: int, max_bytes: int) -> Records:
    """The records of ``[max(offset, first retained), ...)`` straight from the segment
    (``rawread``), its columns seen by numpy without a copy."""
    c = read_columns(q, offset, max_messages, max_bytes)
    offsets = np.arange(c.first, c.first + len(c), dtype=_I64)
    return Records(offsets, np.frombuffer(c.stamps, np.uint64).astype(_I64),
                   np.frombuffer(c.meta_lens, np.uint32).astype(_I64),
                   np.frombuffer(c.payload_lens, np.uint32).astype(_I64), c.data)


# ---------------------------------------------------------------- the sink's puts
def put_records(q: Queue, payload_lens: np.ndarray, data: np.ndarray, producer: str,
                seq: int, timeout: float) -> int:
    """Put payloads given as their lengths and their bytes back to back, atomically and at
    most once per (``producer``, ``seq``), as ``put_many(..., producer=, seq=)``: over TCP
    one PRODUCE_IDEMPOTENT frame made from the columns, elsewhere ``put_many``.  Returns how
    many were put; raises ``Duplicate`` when that sequence was written already."""
    check_producer(producer, seq)
    n = len(payload_lens)
    if not 1 <= n <= options.MAX_BATCH:
        raise LimitExceeded(f"{n} messages in one batch: 1 to {options.MAX_BATCH}")
    if isinstance(q, TcpQueue):
        head = encode_body(T.PRODUCE_IDEMPOTENT, queue=q.name, producer=producer, seq=seq,
                           timeout_ms=_timeout_ms(True, timeout), payloads=[])
        assert head.endswith(bytes(4)), "the payloads are the body's last field"  # their count, 0
        body = b"".join((head[:-4], _U32.pack(n), payload_lens.astype(">u4").tobytes(), data.data))
        return q._b._execute(Request(_produce_frame, (body,), _pick,  # type: ignore[no-any-return]
                                     (T.PRODUCE_BATCH_OK, "count")))
    batch = Joined(payload_lens.tolist(), data.data)
    if isinstance(q, ShmQueue):
        q.put_joined(batch, timeout=timeout, producer=producer, seq=seq)
    else:
        q.put_many(batch.payloads(), timeout=timeout, producer=producer, seq=seq)
    return n


def _produce_frame(msg_id: int, body: bytes) -> bytes:
    return encode_frame(T.PRODUCE_IDEMPOTENT, msg_id, body)
