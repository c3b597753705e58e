"""A get that acks: the CONSUME frames that carry the ack of what the consumer got before.

``q.get(ack=msg)`` over TCP is one CONSUME whose status has :data:`ACK_FLAG` and whose
body ends, after CONSUME's own fields, with the lease to ack (``offset u64, deliveries
u16``, of the same queue and group); ``q.get_many(n, ack=msgs)`` one CONSUME_BATCH that
ends with a ``settles`` field (count and columns, as ACK_BATCH's).  The broker applies the
ack first, exactly as an ACK or ACK_BATCH, then the get; its answer confirms both, so a
consumer that acks every message and waits for the ack needs one round trip per get, not
two (docs/protocol.md, "0x31 CONSUME").  A frame without the flag is read as before, and
a broker from before the flag refuses one with it (PROTOCOL_ERROR: bytes after the body).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from shmq import options
from shmq.errors import ProtocolError, Status
from shmq.protocol.codec import Frame, T, decode_body, encode_body, encode_frame

ACK_FLAG = 0x0008  # the status field of a CONSUME / CONSUME_BATCH: its body ends with leases to ack first
_LEASE = struct.Struct(">QH")  # CONSUME's suffix: offset, deliveries
_NAMES = b"\x00\x00\x00\x00"  # an empty queue and group: ACK_BATCH's body before its settles


_handle_of, _group_of = itemgetter(0), itemgetter(2)  # Message.queue_handle, Message.group, at C speed


def lease_suffix(offset: int, deliveries: int) -> bytes:
    """CONSUME's suffix: the one lease it acks (``ValueError`` when out of range)."""
    try:
        return _LEASE.pack(offset, deliveries)
    except struct.error as e:
        raise ValueError(f"bad lease to ack: {e}") from None


def settles_suffix(settles: list[tuple[int, int]]) -> bytes:
    """CONSUME_BATCH's suffix: the ``settles`` field of (offset, deliveries) pairs."""
    return encode_body(T.ACK_BATCH, queue="", group="", settles=settles)[len(_NAMES):]


def acking_batch_frame(msg_id: int, fields: dict[str, Any], tail: bytes) -> bytes:
    """A CONSUME_BATCH of ``fields`` that acks first: the flag, and ``tail`` (``settles_suffix``)."""
    return encode_frame(T.CONSUME_BATCH, msg_id, encode_body(T.CONSUME_BATCH, **fields) + tail, ACK_FLAG)


def rides(q: Any, group: str, acks: Sequence[Any]) -> bool:
    """May a get of the TCP queue handle ``q``'s ``group`` carry the acks of the messages
    ``acks``?  Yes when each was delivered to that group through ``q``, or through another
    handle of its queue on the same connection, and they fit one frame; else the caller
    acks them apart (with their own round trip)."""
    if len(acks) > options.MAX_BATCH:
        return False
    if set(map(_handle_of, acks)) == {q} and set(map(_group_of, acks)) == {group}:
        return True  # the usual case (what a get of this handle got), checked at C speed
    conn = q.broker
    for m in acks:
        h = m.queue_handle
        if m.group != group or (h is not q and (getattr(h, "broker", None) is not conn or h.name != q.name)):
            return False
    return True


def _names_end(body: bytes, fixed: int) -> int:
    """Where the fields of a CONSUME* body end: its queue and group (u16-prefixed) and
    ``fixed`` bytes of integers after them."""
    if len(body) < 2:
        raise ProtocolError("truncated queue of a CONSUME body", Status.PROTOCOL_ERROR)
    a = int.from_bytes(body[:2], "big")
    if len(body) < 4 + a:
        raise ProtocolError("truncated group of a CONSUME body", Status.PROTOCOL_ERROR)
    return 4 + a + int.from_bytes(body[2 + a:4 + a], "big") + fixed


def decode_consume(f: Frame) -> dict[str, Any]:
    """The fields of a CONSUME / CONSUME_BATCH request; with :data:`ACK_FLAG`, also
    ``acks``: the (offset, deliveries) leases it acks first.  Malformed: ProtocolError."""
    if not f.status & ACK_FLAG:
        return decode_body(f.type, f.body)
    body = bytes(f.body)
    if f.type == T.CONSUME:
        end = len(body) - _LEASE.size
        if end < 0:
            raise ProtocolError("a CONSUME with the ack flag is shorter than its lease",
                                Status.PROTOCOL_ERROR)
        d = decode_body(T.CONSUME, body[:end])
        d["acks"] = [_LEASE.unpack_from(body, end)]
        return d
    end = _names_end(body, 12)  # max, timeout_ms, visibility_ms
    d = decode_body(T.CONSUME_BATCH, body[:end])
    d["acks"] = decode_body(T.ACK_BATCH, _NAMES + body[end:])["settles"]
    return d


__all__ = ["ACK_FLAG", "acking_batch_frame", "decode_consume", "lease_suffix", "rides", "settles_suffix"]
