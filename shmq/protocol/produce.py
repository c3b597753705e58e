"""The produce requests of the TCP clients' batch commands (``shmq.protocol.commands``), headers included.

A put with a delay has ``DELAY_FLAG`` in its status and its body starts with the
delay in ms (u32), before the body it would have without.  A put with a TTL of its own
has ``TTL_FLAG`` and a ``ttl_ms`` u64 prefix, after the delay's when both are there.  A put
at a priority above 0 (a priority queue's) has ``PRIORITY_FLAG`` and a ``priority`` u8
prefix before both.

A batch with headers goes as a PRODUCE_BATCH or PRODUCE_IDEMPOTENT whose status field
has ``headers.FLAG``: each payload is then sent after its header block (or 0x00 when
that message has none); a batch without headers is sent exactly as before.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from typing import Any

from shmq import headers as _headers
from shmq import options
from shmq.api import Headers, Payload, as_bytes, check_joined, check_producer
from shmq.errors import InvalidArgument, LimitExceeded
from shmq.joined import Joined
from shmq.protocol.codec import T, encode_body, encode_frame

DELAY_FLAG = 0x0002  # the status field of a PRODUCE* request: the body starts with delay_ms u32
TTL_FLAG = 0x0004  # ... then (after delay_ms, if any) with ttl_ms u64
PRIORITY_FLAG = 0x0008  # ... and, before both, with priority u8 (1 .. options.MAX_PRIORITIES - 1)
PREFIX_FLAGS = DELAY_FLAG | TTL_FLAG | PRIORITY_FLAG
_DELAY = struct.Struct(">I")  # big-endian, as every integer of the protocol
_TTL = struct.Struct(">Q")  # (a year of ms does not fit 32 bits)


def prefixed(status: int, body: bytes, delay_ms: int, ttl_ms: int = 0, priority: int = 0
             ) -> tuple[int, bytes]:
    """(status, body) of a PRODUCE* request: with a delay, a TTL and a priority, their flags
    and prefixes."""
    if delay_ms:
        status |= DELAY_FLAG
        body = _DELAY.pack(delay_ms) + (_TTL.pack(ttl_ms) if ttl_ms else b"") + body
    elif ttl_ms:
        body = _TTL.pack(ttl_ms) + body
    if ttl_ms:
        status |= TTL_FLAG
    if priority:
        status |= PRIORITY_FLAG
        body = bytes((priority,)) + body
    return status, body


def split_priority(status: int, body: bytes | bytearray | memoryview
                   ) -> tuple[int, bytes | bytearray | memoryview]:
    """(priority, the rest) of a PRODUCE* body: 0 and the body as it is without
    ``PRIORITY_FLAG``.  A priority of 0 or past ``options.MAX_PRIORITIES - 1`` under the flag
    is :class:`InvalidArgument` (the queue checks it against its own levels)."""
    if not status & PRIORITY_FLAG:
        return 0, body
    if not body or not 0 < body[0] < options.MAX_PRIORITIES:
        raise InvalidArgument("a produce's priority prefix is missing, 0, or past "
                              f"{options.MAX_PRIORITIES - 1}")
    return body[0], body[1:]


def split_prefixes(status: int, body: bytes | bytearray | memoryview
                   ) -> tuple[int, int, bytes | bytearray | memoryview]:
    """(delay_ms, ttl_ms, the rest) of a PRODUCE* body whose status has DELAY_FLAG or
    TTL_FLAG (0 for the one it lacks).  A delay past ``options.MAX_DELAY``, a TTL of 0, past
    ``options.MAX_MESSAGE_TTL`` or not longer than the delay is :class:`InvalidArgument`."""
    need = (_DELAY.size if status & DELAY_FLAG else 0) + (_TTL.size if status & TTL_FLAG else 0)
    if len(body) < need:
        raise InvalidArgument("a produce's body is shorter than its delay_ms / ttl_ms prefix")
    ms = tms = 0
    if status & DELAY_FLAG:
        (ms,) = _DELAY.unpack_from(body)
        if ms > options.MAX_DELAY * 1000:
            raise InvalidArgument(f"delay_ms {ms} is past the maximum {options.MAX_DELAY * 1000:.0f}")
    if status & TTL_FLAG:
        (tms,) = _TTL.unpack_from(body, need - _TTL.size)
        if not 0 < tms <= options.MAX_MESSAGE_TTL * 1000:
            raise InvalidArgument(f"ttl_ms {tms} is not in 1 .. {options.MAX_MESSAGE_TTL * 1000:.0f}")
        if tms <= ms:
            raise InvalidArgument(f"ttl_ms {tms} is not longer than delay_ms {ms}: the message would "
                                  "expire before it is due")
    return ms, tms, body[need:]


def batch_payloads(payloads: Sequence[Payload]) -> list[bytes]:
    """The payloads of one PRODUCE_BATCH frame, checked against MAX_BATCH."""
    items: list[bytes]
    if set(map(type, payloads)) == {bytes}:  # the usual case, checked at C speed
        items = list(payloads)  # type: ignore[arg-type]
    else:
        items = [bytes(as_bytes(p)) for p in payloads]
    if len(items) > options.MAX_BATCH:
        raise LimitExceeded(f"{len(items)} messages in one batch; the limit over TCP is "
                            f"{options.MAX_BATCH}")
    return items


def produce_request(queue: str, payloads: Sequence[Payload], timeout_ms: int, producer: str | None,
                    seq: int | None, headers: Sequence[Headers | None] | None = None
                    ) -> tuple[T, dict[str, Any], int] | None:
    """The frame type, fields and status (``headers.FLAG`` or 0) of a batch produce; None
    for no payloads.  Every argument is checked before anything is sent."""
    items = batch_payloads(payloads)
    metas = _headers.encode_many(headers, len(items)) if headers is not None else None
    if not items:
        return None
    status = 0
    if metas is not None:
        items = [_headers.flagged(m, p) for m, p in zip(metas, items, strict=True)]
        status = _headers.FLAG
    return (*_batch(queue, timeout_ms, items, producer, seq), status)


def _batch(queue: str, timeout_ms: int, payloads: list[Any], producer: str | None, seq: int | None
           ) -> tuple[T, dict[str, Any]]:
    """A batch produce's frame type and fields: PRODUCE_IDEMPOTENT with a producer (checked),
    else PRODUCE_BATCH."""
    fields: dict[str, Any] = {"queue": queue, "timeout_ms": timeout_ms, "payloads": payloads}
    if producer is None and seq is None:
        return T.PRODUCE_BATCH, fields
    check_producer(producer, seq)
    return T.PRODUCE_IDEMPOTENT, {**fields, "producer": producer, "seq": seq}


_COUNT = struct.Struct(">I")


def joined_request(queue: str, batch: Joined, timeout_ms: int, producer: str | None,
                   seq: int | None) -> tuple[T, bytes]:
    """The frame type and body of a batch produce of payloads given back to back
    (``Queue.put_joined``): the ``payloads`` field made of the lengths, as one column, and
    the bytes as they are, with no object per payload; the frame a ``produce_request`` of
    the same payloads makes, checked as that is and as ``check_joined``."""
    check_joined(batch)
    n = len(batch)
    if n > options.MAX_BATCH:
        raise LimitExceeded(f"{n} messages in one batch; the limit over TCP is {options.MAX_BATCH}")
    type_, fields = _batch(queue, timeout_ms, [], producer, seq)
    head = encode_body(type_, **fields)
    assert head.endswith(bytes(4)), "the payloads are the body's last field"  # their count, 0
    try:
        lens = array("I", batch.lens)
    except OverflowError:
        raise InvalidArgument("a payload length is negative or too large") from None
    if sys.byteorder == "little":
        lens.byteswap()
    return type_, b"".join((head[:-4], _COUNT.pack(n), lens, batch.data))


def joined_frame(msg_id: int, type_: int, body: bytes, status: int = 0) -> bytes:
    """The frame of a ``joined_request`` (a request's encoder: the message id first);
    ``status``: its flags, when ``prefixed`` gave it a priority."""
    return encode_frame(type_, msg_id, body, status)
