"""The replication stream between a primary and a standby, without any I/O.

A standby (``shmq serve --replica-of URL``) opens a TCP connection to its primary's
replication port (``broker.info().replication["port"]``; TLS when the primary's port
speaks it) and the two exchange *frames*, all integers little-endian::

    0       4      5       6          8             12            16
    | magic | kind | flags | reserved | header length | body length | header (JSON) | body

The header is a JSON object (what the kind says, below), the body raw bytes: a ROUND's
body is journal records exactly as ``shmq.journal.files`` encodes them (each with its own
CRCs), so what the standby writes is checked byte for byte on the way in.

==========  ===========  ====================================================================
kind        direction    header (body)
==========  ===========  ====================================================================
HELLO       standby ->   ``token``, ``epoch``, ``node`` (its name), ``queues``: {name:
                         {``created_ns``, ``next``}}: what its journals hold
WELCOME     <- primary   ``epoch``, ``node``, ``forks``: {name: offset}: where a queue's history
                         parted from the standby's (records from there on are discarded)
REFUSED     <- primary   ``code`` (a ``shmq.errors.Status``), ``message``; the link is closed
QUEUE       <- primary   ``meta`` (the journal's meta.json: name, config, created_ns, is_dlq),
                         ``full``: the standby drops what it holds of that name first
ROUND       <- primary   ``queue``, ``created_ns``, ``seq`` (the round's number in this link),
                         ``next``, ``last`` (the round's final frame), ``ack`` (1: a `sync`
                         queue's round, which waits for the ACK) (journal records)
DROP        <- primary   ``queue``, ``created_ns``: the queue was deleted
SYNCED      <- primary   {}: the catch-up is over; what follows is live
ACK         standby ->   ``seq``: every ROUND up to it is fsynced in the standby's journals
                         (at once after a round with ``ack``; else within
                         ``REPLICATION_ACK_INTERVAL``, so that rounds share an fsync)
BEAT        both         {}: nothing else to say (a link silent for
                         ``REPLICATION_DEAD_AFTER`` is closed)
==========  ===========  ====================================================================

:class:`StreamDecoder` is bytes in, frames out (as ``codec.FrameDecoder``); it refuses a
bad magic, an unknown kind, a frame over ``max_frame`` (before reading its body) and a
header that is not a JSON object, with :class:`~shmq.errors.ProtocolError`.
"""

from __future__ import annotations

import enum
import json
import struct
from typing import Any, NamedTuple

from shmq import options
from shmq.errors import ProtocolError, Status

MAGIC = b"SQR1"
_HEAD = struct.Struct("<4sBBHII")
HEADER_SIZE = _HEAD.size  # 16


class K(enum.IntEnum):
    """The kinds of frame (the table in the module docstring)."""

    HELLO = 1
    WELCOME = 2
    REFUSED = 3
    QUEUE = 4
    ROUND = 5
    DROP = 6
    SYNCED = 7
    ACK = 8
    BEAT = 9


_KINDS = frozenset(int(k) for k in K)


class StreamFrame(NamedTuple):
    kind: K
    header: dict[str, Any]
    body: bytes = b""


def encode(kind: K, header: dict[str, Any] | None = None,
           body: bytes | bytearray | memoryview = b"") -> bytes:
    """One frame.  ``ValueError`` for a header that is not JSON-serialisable."""
    head = json.dumps(header or {}, separators=(",", ":"), allow_nan=False).encode()
    return _HEAD.pack(MAGIC, int(kind), 0, 0, len(head), len(body)) + head + bytes(body)


class StreamDecoder:
    """Bytes in, frames out.  After an error every later ``feed()`` raises it again."""

    def __init__(self, max_frame: int = options.REPLICATION_MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._error: ProtocolError | None = None
        self.received = 0  # bytes fed so far

    def feed(self, data: bytes | bytearray | memoryview) -> list[StreamFrame]:
        if self._error is not None:
            raise self._error
        self.received += len(data)
        buf = self._buf
        buf += data
        out: list[StreamFrame] = []
        pos = 0
        while True:
            if len(buf) - pos < HEADER_SIZE:
                if buf[pos:] and not MAGIC.startswith(bytes(buf[pos:pos + 4])):
                    raise self._fail("bad magic: not a shmq replication stream")
                break
            magic, kind, flags, reserved, hlen, blen = _HEAD.unpack_from(buf, pos)
            if magic != MAGIC:
                raise self._fail("bad magic: not a shmq replication stream")
            if kind not in _KINDS or flags or reserved:
                raise self._fail(f"unknown replication frame kind {kind} (flags {flags}, "
                                 f"reserved {reserved})")
            if hlen + blen > self.max_frame:
                raise self._fail(f"a replication frame of {hlen + blen} bytes is over the limit "
                                 f"({self.max_frame})", Status.PAYLOAD_TOO_LARGE)
            end = pos + HEADER_SIZE + hlen + blen
            if len(buf) < end:
                break
            start = pos + HEADER_SIZE
            try:
                header = json.loads(bytes(buf[start:start + hlen]))
            except ValueError as e:
                raise self._fail(f"a replication frame's header is not JSON: {e}") from None
            if not isinstance(header, dict):
                raise self._fail("a replication frame's header is not a JSON object")
            out.append(StreamFrame(K(kind), header, bytes(buf[start + hlen:end])))
            pos = end
        if pos:
            del buf[:pos]
        return out

    def _fail(self, message: str, code: Status = Status.PROTOCOL_ERROR) -> ProtocolError:
        self._error = ProtocolError(message, code)
        self._buf = bytearray()
        return self._error


__all__ = ["HEADER_SIZE", "MAGIC", "K", "StreamDecoder", "StreamFrame", "encode"]
