"""The wire codec: frames to bytes and bytes to frames, without any I/O.

Sans-IO in the style of h11: the caller reads bytes from wherever it likes and
feeds them to a :class:`FrameDecoder`, which hands back every complete
:class:`Frame`; the caller writes the bytes that :func:`encode_frame` /
:func:`frame` return.  Nothing here touches a socket, a clock or a thread, so the
asyncio server, the blocking client and the tests share one implementation.

The format is drawn byte by byte, with test vectors, in ``docs/protocol.md``.
In short, a frame is a 16-byte header, all integers big-endian::

    0          4                 8        9           10         12           16
    | magic u32 | body length u32 | type u8 | version u8 | status u16 | msg id u32 | body

and a body is the fields of its type (:data:`SCHEMAS`) one after the other.

Every malformed input raises :class:`shmq.errors.ProtocolError`, whose ``code``
says which way it is malformed (BAD_MAGIC, VERSION_MISMATCH, INVALID_TYPE,
PAYLOAD_TOO_LARGE, else PROTOCOL_ERROR).  Bad *arguments* to the encoders (a
missing field, an int out of range, a batch over ``options.MAX_BATCH``) raise
``ValueError``: they are the caller's bug, not the peer's.

The codec is three modules, each importing only the ones before it: the message
catalogue (:class:`T`, :data:`SCHEMAS`) in ``protocol.schemas``, the body encoders and
decoders generated from it in ``protocol.bodies``, and the frames (the header, the decoder,
the hot single-message builders) here.  Import every name from here.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from shmq import options
from shmq.errors import ProtocolError, ShmqError, Status, error_for
from shmq.protocol.bodies import (
    Columns,
    body_parts,
    decode_body,
    decode_joined,
    encode_body,
    malformed,
    records_columns,
    records_field,
)
from shmq.protocol.schemas import SCHEMAS, TYPES, T

__all__ = [
    "HEADER_SIZE", "HEARTBEAT_FRAME", "MAGIC", "SCHEMAS", "VERSION", "Columns", "Frame", "FrameDecoder", "T",
    "consume_frame", "decode_body", "decode_deliver", "decode_joined", "deliver_frame", "encode_body",
    "encode_frame", "error_of", "frame", "produce_frame", "produce_ok_frame", "records_columns",
    "records_field", "settle_frame",
]

MAGIC = 0xDEADBEEF
VERSION = 1
HEADER_SIZE = 16
WAIT_FOREVER = 0xFFFFFFFF  # a timeout_ms that waits for ever (0: does not wait)
NO_REPLY_ID = 0xFFFFFFFF  # the message id of every ACK_NO_REPLY / ACK_BATCH_NO_REPLY / ACK_RANGE_NO_REPLY

_HEADER = struct.Struct(">IIBBHI")
assert _HEADER.size == HEADER_SIZE
_MAGIC_BYTES = MAGIC.to_bytes(4, "big")


class Frame(NamedTuple):  # immutable, and 3x quicker to make than a frozen dataclass (one per frame)
    """One frame: ``type`` (a :class:`T` when decoded), the requester's ``msg_id``,
    ``status`` (0 in requests and successful responses) and the raw ``body``
    (decode it with :func:`decode_body`)."""

    type: int
    msg_id: int
    status: int = 0
    body: bytes = b""


# --------------------------------------------------------------------------- frames


class FrameDecoder:
    """Bytes in, frames out.  ``feed()`` whatever arrived; it returns every frame
    completed so far and keeps the rest for the next call.

    The header is checked as soon as it is whole (the magic even sooner, byte by
    byte), so an oversized frame is refused before any of its body is buffered.
    After an error the decoder is poisoned: every later ``feed()`` raises the same
    error.  Frames completed in the same ``feed()`` call as the error are dropped
    with the connection (a protocol error ends it).
    """

    __slots__ = ("max_frame", "_buf", "_error")

    def __init__(self, max_frame: int = options.MAX_FRAME) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._error: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held, waiting for the rest of a frame."""
        return len(self._buf)

    def _fail(self, message: str, code: Status) -> ProtocolError:
        self._error = err = ProtocolError(message, code)
        self._buf = bytearray()
        return err

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise self._error
        buf = self._buf
        if not buf and (data.__class__ is bytes or (data.__class__ is memoryview
                                                    and data.nbytes == len(data))):
            # nothing held (the usual case): read the frames straight from ``data``
            # (bytes, or a flat memoryview of bytes) and keep only an incomplete tail
            pos, frames = self._frames(data, None if data.__class__ is bytes else data)  # type: ignore
            if pos < len(data):
                buf += memoryview(data)[pos:]
            return frames
        buf += data
        with memoryview(buf) as view:  # released before the buffer is resized below
            pos, frames = self._frames(buf, view)
        if pos:
            del buf[:pos]  # once per feed; CPython just moves the start of the array
        return frames

    def _frames(self, buf: bytes | bytearray | memoryview,
                view: memoryview | None) -> tuple[int, list[Frame]]:
        """The whole frames at the start of ``buf``, and where the first incomplete one starts.
        ``view``: a memoryview of ``buf`` to copy bodies from (None: ``buf`` is bytes,
        sliced as is)."""
        end = len(buf)
        pos = 0
        frames: list[Frame] = []
        unpack_header = _HEADER.unpack_from
        types = TYPES
        max_frame = self.max_frame
        while True:
            avail = end - pos
            if avail < HEADER_SIZE:
                if avail:  # refuse garbage early, not only once 16 bytes of it came
                    k = avail if avail < 4 else 4
                    if buf[pos:pos + k] != _MAGIC_BYTES[:k]:
                        raise self._fail(f"bad magic 0x{bytes(buf[pos:pos + k]).hex()}",
                                         Status.BAD_MAGIC)
                break
            magic, length, type_, version, status, msg_id = unpack_header(buf, pos)
            if magic != MAGIC:
                raise self._fail(f"bad magic 0x{magic:08x} (want 0x{MAGIC:08X})", Status.BAD_MAGIC)
            if version != VERSION:
                raise self._fail(f"protocol version {version} (this side speaks {VERSION})",
                                 Status.VERSION_MISMATCH)
            t = types.get(type_)
            if t is None:
                raise self._fail(f"unknown message type 0x{type_:02x}", Status.INVALID_TYPE)
            if length > max_frame:
                raise self._fail(f"frame body of {length} bytes is over the limit of {max_frame}",
                                 Status.PAYLOAD_TOO_LARGE)
            stop = pos + HEADER_SIZE + length
            if stop > end:
                break
            body = buf[pos + HEADER_SIZE:stop] if view is None else bytes(view[pos + HEADER_SIZE:stop])
            frames.append(Frame(t, msg_id, status, body))  # type: ignore[arg-type]
            pos = stop
        return pos, frames


def encode_frame(type: int, msg_id: int, body: bytes = b"", status: int = 0) -> bytes:
    """The bytes of one frame: header + ``body`` (already encoded)."""
    if type not in TYPES:
        raise ValueError(f"unknown message type {type!r}")
    try:
        return _HEADER.pack(MAGIC, len(body), type, VERSION, status, msg_id) + body
    except struct.error as e:
        raise ValueError(f"bad frame header (msg_id {msg_id!r}, status {status!r}): {e}") from None


HEARTBEAT_FRAME = encode_frame(T.HEARTBEAT, 0)  # either end sends it each heartbeat interval; never answered


def frame(type: int, msg_id: int, status: int = 0, **fields: Any) -> bytes:
    """``encode_frame(type, msg_id, encode_body(type, **fields), status)``, with one copy
    of the payload fewer."""
    parts = body_parts(type, fields)
    try:
        header = _HEADER.pack(MAGIC, sum(map(len, parts)), type, VERSION, status, msg_id)
    except struct.error as e:
        raise ValueError(f"bad frame header (msg_id {msg_id!r}, status {status!r}): {e}") from None
    return b"".join((header, *parts))


# The frames of one message at a time -- produce, consume, deliver, ack -- with their
# fields in positional arguments and the names already in UTF-8, in one struct call each:
# the hot path of both ends (the tests check every one against frame() / decode_body()).
_PRODUCE_OK = struct.Struct(">IIBBHIQ")
_DELIVER_HEAD = struct.Struct(">IIBBHIQHQI")  # header, offset, deliveries, timestamp_ns, meta length
_DELIVER_FIXED = _DELIVER_HEAD.size - HEADER_SIZE
_DELIVER_BODY = struct.Struct(">QHQI")
_NAMED = struct.Struct(">IIBBHIH")  # header, the length of the first name
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U32_U32 = struct.Struct(">II")
_U64_U16 = struct.Struct(">QH")


def _hot(build: Callable[..., bytes]) -> Callable[..., bytes]:
    def checked(*args: Any) -> bytes:
        try:
            return build(*args)
        except (struct.error, OverflowError) as e:  # an int out of range, a name over 65535 bytes
            raise ValueError(f"bad frame field: {e}") from None
    checked.__doc__ = build.__doc__
    checked.__name__ = build.__name__
    return checked


@_hot
def produce_frame(msg_id: int, queue: bytes, timeout_ms: int, payload: bytes) -> bytes:
    """``frame(T.PRODUCE, msg_id, queue=..., timeout_ms=..., payload=...)``; ``queue`` in UTF-8."""
    n = len(queue)
    return b"".join((_NAMED.pack(MAGIC, n + 6 + len(payload), T.PRODUCE, VERSION, 0, msg_id, n), queue,
                     _U32.pack(timeout_ms), payload))


@_hot
def consume_frame(msg_id: int, queue: bytes, group: bytes, timeout_ms: int, visibility_ms: int,
                  status: int = 0, tail: bytes = b"") -> bytes:
    """``frame(T.CONSUME, msg_id, queue=..., group=..., timeout_ms=..., visibility_ms=...)``;
    ``status`` a flag, and ``tail`` the bytes it adds after the fields (``shmq.protocol.consume_ack``)."""
    n = len(queue)
    return b"".join((_NAMED.pack(MAGIC, n + len(group) + 12 + len(tail), T.CONSUME, VERSION, status, msg_id,
                                 n), queue, _U16.pack(len(group)), group,
                     _U32_U32.pack(timeout_ms, visibility_ms), tail))


@_hot
def settle_frame(type: int, msg_id: int, queue: bytes, group: bytes, offset: int, deliveries: int) -> bytes:
    """An ACK or ACK_NO_REPLY frame (``type``): queue, group, offset, deliveries."""
    if type not in (T.ACK, T.ACK_NO_REPLY):
        raise ValueError(f"settle_frame writes ACK or ACK_NO_REPLY, not {type!r}")
    n = len(queue)
    return b"".join((_NAMED.pack(MAGIC, n + len(group) + 14, type, VERSION, 0, msg_id, n), queue,
                     _U16.pack(len(group)), group, _U64_U16.pack(offset, deliveries)))


def error_of(f: Frame) -> ShmqError:
    """The typed error an ERROR frame carries."""
    return error_for(f.status, decode_body(T.ERROR, f.body)["message"])


def decode_deliver(body: bytes) -> tuple[int, int, int, bytes, bytes]:
    """A DELIVER body as (offset, deliveries, timestamp_ns, meta, payload); as
    ``decode_body(T.DELIVER, body)`` (the same ProtocolError when malformed), as a tuple."""
    if len(body) < _DELIVER_FIXED:
        raise malformed(f"truncated meta of the DELIVER body ({len(body)} bytes)")
    offset, deliveries, ts, n = _DELIVER_BODY.unpack_from(body)
    end = _DELIVER_FIXED + n
    if end > len(body):
        raise malformed("truncated meta of the DELIVER body")
    return offset, deliveries, ts, body[_DELIVER_FIXED:end], body[end:]


def produce_ok_frame(msg_id: int, offset: int) -> bytes:
    """``frame(T.PRODUCE_OK, msg_id, offset=offset)``, in one struct call."""
    return _PRODUCE_OK.pack(MAGIC, 8, T.PRODUCE_OK, VERSION, 0, msg_id, offset)


def deliver_frame(msg_id: int, offset: int, deliveries: int, timestamp_ns: int, meta: bytes,
                  payload: bytes) -> bytes:
    """``frame(T.DELIVER, msg_id, offset=..., ...)``, in one struct call and one join."""
    n = len(meta)
    return b"".join((_DELIVER_HEAD.pack(MAGIC, _DELIVER_FIXED + n + len(payload), T.DELIVER, VERSION, 0,
                                        msg_id, offset, deliveries, timestamp_ns, n), meta, payload))
