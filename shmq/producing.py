"""The produce requests of the TCP clients' batch commands (``shmq.commands``), headers included.

A put with a delay has ``DELAY_FLAG`` in its status and its body starts with the
delay in ms (u32), before the body it would have without.

A batch with headers goes as a PRODUCE_BATCH or PRODUCE_IDEMPOTENT whose status field
has ``headers.FLAG``: each payload is then sent after its header block (or 0x00 when
that message has none); a batch without headers is sent exactly as before.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from . import headers as _headers
from . import options
from .api import Headers, Payload, as_bytes, check_producer
from .codec import T
from .errors import InvalidArgument, LimitExceeded

DELAY_FLAG = 0x0002  # the status field of a PRODUCE* request: the body starts with delay_ms u32
_DELAY = struct.Struct(">I")  # big-endian, as every integer of the protocol


def delayed(status: int, body: bytes, delay_ms: int) -> tuple[int, bytes]:
    """(status, body) of a PRODUCE* request: with a delay, the flag and the u32 prefix."""
    if not delay_ms:
        return status, body
    return status | DELAY_FLAG, _DELAY.pack(delay_ms) + body


def split_delay(body: bytes | bytearray | memoryview) -> tuple[int, bytes | bytearray | memoryview]:
    """(delay_ms, the rest) of a PRODUCE* body whose status has DELAY_FLAG; a delay past
    ``options.MAX_DELAY`` is :class:`InvalidArgument`."""
    if len(body) < _DELAY.size:
        raise InvalidArgument("a delayed produce's body is shorter than its delay_ms")
    (ms,) = _DELAY.unpack_from(body)
    if ms > options.MAX_DELAY * 1000:
        raise InvalidArgument(f"delay_ms {ms} is past the maximum {options.MAX_DELAY * 1000:.0f}")
    return ms, body[_DELAY.size:]


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
    fields: dict[str, Any] = {"queue": queue, "timeout_ms": timeout_ms, "payloads": items}
    if producer is None and seq is None:
        return T.PRODUCE_BATCH, fields, status
    check_producer(producer, seq)
    return T.PRODUCE_IDEMPOTENT, {**fields, "producer": producer, "seq": seq}, status
