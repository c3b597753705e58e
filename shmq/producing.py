"""The produce requests of the TCP clients' batch commands (``shmq.commands``), headers included.

A batch with headers goes as a PRODUCE_BATCH or PRODUCE_IDEMPOTENT whose status field
has ``headers.FLAG``: each payload is then sent after its header block (or 0x00 when
that message has none); a batch without headers is sent exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import headers as _headers
from . import options
from .api import Headers, Payload, as_bytes, check_producer
from .codec import T
from .errors import LimitExceeded


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
