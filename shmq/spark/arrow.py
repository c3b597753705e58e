"""Arrow batches of the shmq Spark data source, column by column: no Python object per row.

:func:`to_batch` makes the source's RecordBatch (:data:`ARROW_SCHEMA`) of
:class:`~shmq.spark.records.Records`: the payloads are one buffer plus offsets, the
offsets and timestamps int64 arrays, ``queue`` one value repeated.  Only the records
that have metadata (headers, a dead letter's origin) are looked at one by one, for their
``headers`` and ``delivery_count``.  :class:`Payloads` is the sink's side: a payload
column's lengths and bytes, straight from its Arrow buffers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from shmq import headers as _headers
from shmq import options
from shmq.api import Message
from shmq.spark.records import Records

ARROW_SCHEMA = pa.schema([
    pa.field("queue", pa.string(), False),
    pa.field("offset", pa.int64(), False),
    pa.field("payload", pa.binary(), False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), False),
    pa.field("delivery_count", pa.int32(), False),
    pa.field("headers", pa.map_(pa.string(), pa.field("value", pa.binary(), False)), False),
    pa.field("priority", pa.int32(), False),
])
_HEADERS_TYPE = ARROW_SCHEMA.field("headers").type
_ENTRY = pa.struct([_HEADERS_TYPE.key_field, _HEADERS_TYPE.item_field])
_TIMESTAMP = ARROW_SCHEMA.field("timestamp").type
_I32 = np.dtype(np.int32)


# Every array here is made with ``Array.from_buffers``: ``pa.array`` (of a list or of numpy)
# imports pandas, a second or so in each new Python worker of Spark that does not otherwise.
def _fixed(type_: pa.DataType, values: np.ndarray) -> pa.Array:
    """An array of fixed-width ``values`` (contiguous, of the type's width)."""
    return pa.Array.from_buffers(type_, len(values), [None, pa.py_buffer(values)])


def _offsets32(lens: np.ndarray) -> pa.Buffer:
    """The int32 offsets buffer of variable-length values of ``lens``."""
    out = np.zeros(len(lens) + 1, _I32)
    np.cumsum(lens, out=out[1:])
    return pa.py_buffer(out)


def _binary(lens: np.ndarray, data: Any, type_: pa.DataType = pa.binary()) -> pa.Array:
    return pa.Array.from_buffers(type_, len(lens), [None, _offsets32(lens), pa.py_buffer(data)])


def _delivery_count(meta: bytes) -> int:
    """The deliveries a dead letter had in its origin group (``Message.origin``), else 1."""
    try:
        origin = tuple.__new__(Message, (None, -1, None, 0, 0, b"", meta, 0)).origin
    except (ValueError, KeyError, TypeError):
        return 1
    return origin.deliveries if origin is not None else 1


def _with_metadata(n: int, rows: np.ndarray, metas: list[bytes]) -> tuple[np.ndarray, pa.MapArray]:
    """``delivery_count`` and ``headers`` when the records ``rows`` (of ``n``) have metadata."""
    counts = np.ones(n, _I32)
    per_row = np.zeros(n, _I32)
    keys: list[str] = []
    values: list[bytes] = []
    for i, meta in zip(rows.tolist(), metas, strict=True):
        counts[i] = _delivery_count(meta)
        if meta[0] == _headers.TAG:
            h = _headers.decode(meta)
            keys += h.keys()
            values += h.values()
            per_row[i] = len(h)
    return counts, _map(per_row, pa.array(keys, pa.string()), pa.array(values, pa.binary()))


def _map(per_row: np.ndarray, keys: pa.Array, values: pa.Array) -> pa.Array:
    """The ``headers`` column: ``per_row[i]`` entries for row ``i``, from ``keys`` / ``values``."""
    entries = pa.Array.from_buffers(_ENTRY, len(keys), [None], children=[keys, values])
    return pa.Array.from_buffers(_HEADERS_TYPE, len(per_row), [None, _offsets32(per_row)], children=[entries])


def to_batch(queue: str, r: Records) -> pa.RecordBatch:
    """The source's rows of ``r``."""
    n = len(r)
    data = np.frombuffer(r.data, np.uint8)
    if r.meta_lens.any():
        both = np.empty(2 * n, np.int64)  # each record's metadata, then its payload
        both[0::2], both[1::2] = r.meta_lens, r.payload_lens
        is_payload = np.repeat(np.tile(np.array([False, True]), n), both)
        payloads = data[is_payload]
        meta_bytes = data[~is_payload].tobytes()
        rows = np.flatnonzero(r.meta_lens)
        ends = np.cumsum(r.meta_lens[rows]).tolist()
        metas = [meta_bytes[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        counts, heads = _with_metadata(n, rows, metas)
    else:
        payloads = data
        counts = np.ones(n, _I32)
        none = np.zeros(0, np.int64)
        heads = _map(np.zeros(n, _I32), _binary(none, b"", pa.string()), _binary(none, b""))
    name = queue.encode()
    return pa.RecordBatch.from_arrays([
        _binary(np.full(n, len(name), _I32), name * n, pa.string()),
        _fixed(pa.int64(), r.offsets),
        _binary(r.payload_lens, payloads),
        _fixed(_TIMESTAMP, r.stamps // 1000),
        _fixed(pa.int32(), counts),
        heads,
        _fixed(pa.int32(), (np.asarray(r.offsets, np.int64) >> options.PRIORITY_SHIFT).astype(_I32)),
    ], schema=ARROW_SCHEMA)


# ---------------------------------------------------------------- the sink's payloads
class Payloads(NamedTuple):
    """Rows of a payload column (binary or string, either offset width) without copying:
    ``offsets`` (n + 1, int64, into ``data``) and the bytes."""

    offsets: np.ndarray
    data: np.ndarray

    @classmethod
    def of(cls, col: pa.Array) -> Payloads:
        t = col.type
        large = pa.types.is_large_binary(t) or pa.types.is_large_string(t)
        if not (large or pa.types.is_binary(t) or pa.types.is_string(t)):  # a view type: other buffers
            col, large = col.cast(pa.large_binary()), True
        bufs = col.buffers()
        width = np.dtype(np.int64 if large else np.int32)
        n = len(col)
        offsets = (np.frombuffer(bufs[1], width, n + 1, col.offset * width.itemsize).astype(np.int64)
                   if bufs[1] is not None else np.zeros(n + 1, np.int64))
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        return cls(offsets, data)

    def lens(self, a: int, b: int) -> np.ndarray:
        return np.diff(self.offsets[a:b + 1])

    def bytes_of(self, a: int, b: int) -> np.ndarray:
        return self.data[self.offsets[a]:self.offsets[b]]


def has_headers(col: pa.Array) -> bool:
    """Might a row of a headers column (a map) have a header, an entry with a value?  (A null
    map's entries, which Arrow allows, may make it say yes for none: the caller then looks.)"""
    if len(col) == 0:
        return False
    offsets = col.offsets  # of this slice, into all of the column's entries
    lo, hi = offsets[0].as_py(), offsets[-1].as_py()
    values = col.items.slice(lo, hi - lo)
    return bool(values.null_count < len(values))
