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

Body encoders and decoders are generated once, at import, from the schemas:
runs of fixed-width integers (and the length prefix that follows them) become
one precompiled ``struct.Struct``, so a hot body such as DELIVER is one
``unpack_from`` plus two slices.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from collections.abc import Callable
from enum import IntEnum
from itertools import accumulate
from typing import Any, NamedTuple

from . import options
from .errors import ProtocolError, ShmqError, Status, error_for

__all__ = [
    "HEADER_SIZE", "MAGIC", "SCHEMAS", "VERSION", "Frame", "FrameDecoder", "T",
    "consume_frame", "decode_body", "decode_deliver", "deliver_frame", "encode_body", "encode_frame",
    "error_of", "frame", "produce_frame", "produce_ok_frame", "records_field", "settle_frame",
]

MAGIC = 0xDEADBEEF
VERSION = 1
HEADER_SIZE = 16
WAIT_FOREVER = 0xFFFFFFFF  # a timeout_ms that waits for ever (0: does not wait)
NO_REPLY_ID = 0xFFFFFFFF  # the message id of every ACK_NO_REPLY / ACK_BATCH_NO_REPLY / ACK_RANGE_NO_REPLY

_HEADER = struct.Struct(">IIBBHI")
assert _HEADER.size == HEADER_SIZE
_MAGIC_BYTES = MAGIC.to_bytes(4, "big")


class T(IntEnum):
    """Message types.  0x01-0x52 and 0xFE are DMS's; the rest are shmq's own."""

    HANDSHAKE = 0x01
    HANDSHAKE_ACK = 0x02
    HANDSHAKE_NACK = 0x04
    CREATE_QUEUE = 0x11
    CREATE_QUEUE_OK = 0x12
    DELETE_QUEUE = 0x13
    DELETE_QUEUE_OK = 0x14
    LIST_QUEUES = 0x15
    LIST_QUEUES_OK = 0x16
    PRODUCE = 0x21
    PRODUCE_OK = 0x22
    PRODUCE_BATCH = 0x23
    PRODUCE_BATCH_OK = 0x24
    PRODUCE_IDEMPOTENT = 0x25
    CONSUME = 0x31
    DELIVER = 0x34
    CONSUME_BATCH = 0x35
    DELIVER_BATCH = 0x36
    ACK = 0x41
    ACK_OK = 0x42
    NACK = 0x43
    NACK_OK = 0x44
    ACK_BATCH = 0x45
    ACK_BATCH_OK = 0x46
    TOUCH = 0x47
    TOUCH_OK = 0x48
    DEAD_LETTER = 0x49
    DEAD_LETTER_OK = 0x4A
    ACK_NO_REPLY = 0x4B
    ACK_BATCH_NO_REPLY = 0x4C
    ACK_RANGE = 0x4D
    ACK_RANGE_NO_REPLY = 0x4E
    DISCONNECT = 0x51
    DISCONNECT_OK = 0x52
    GROUP_JOIN = 0x61
    GROUP_JOIN_OK = 0x62
    GROUP_COMMIT = 0x63
    GROUP_COMMIT_OK = 0x64
    GROUP_DELETE = 0x65
    GROUP_DELETE_OK = 0x66
    GROUP_LIST = 0x67
    GROUP_LIST_OK = 0x68
    READ = 0x71
    READ_OK = 0x72
    STATS = 0x73
    STATS_OK = 0x74
    PURGE = 0x75
    PURGE_OK = 0x76
    SUBSCRIBE = 0x81
    SUBSCRIBE_OK = 0x82
    CREDIT = 0x83
    UNSUBSCRIBE = 0x85
    UNSUBSCRIBE_OK = 0x86
    ERROR = 0xFE


Schema = tuple[tuple[str, str], ...]

_QG: Schema = (("queue", "str"), ("group", "str"))
_EMPTY: Schema = ()

#: The body of every type: (field name, field kind) in wire order.  The kinds are
#: u8/u16/u32/u64, str (u16 length + UTF-8), blob (u32 length + bytes), rest (the
#: remaining bytes; last field only), json (u32 length + UTF-8 JSON), blobs,
#: settles, offsets and records (u32 count + that many items).
SCHEMAS: dict[T, Schema] = {
    T.HANDSHAKE: (("token", "str"), ("client", "str"), ("affinity", "str")),
    T.HANDSHAKE_ACK: (("worker", "u16"), ("max_frame", "u32"), ("server", "str")),
    T.HANDSHAKE_NACK: (("reason", "str"),),
    T.CREATE_QUEUE: (("queue", "str"), ("config", "json")),
    T.CREATE_QUEUE_OK: _EMPTY,
    T.DELETE_QUEUE: (("queue", "str"),),
    T.DELETE_QUEUE_OK: _EMPTY,
    T.LIST_QUEUES: _EMPTY,
    T.LIST_QUEUES_OK: (("queues", "json"),),
    T.PRODUCE: (("queue", "str"), ("timeout_ms", "u32"), ("payload", "rest")),
    T.PRODUCE_OK: (("offset", "u64"),),
    T.PRODUCE_BATCH: (("queue", "str"), ("timeout_ms", "u32"), ("payloads", "blobs")),
    T.PRODUCE_BATCH_OK: (("first", "u64"), ("count", "u32")),
    T.PRODUCE_IDEMPOTENT: (("queue", "str"), ("producer", "str"), ("seq", "u64"), ("timeout_ms", "u32"),
                           ("payloads", "blobs")),
    T.CONSUME: _QG + (("timeout_ms", "u32"), ("visibility_ms", "u32")),
    T.DELIVER: (("offset", "u64"), ("deliveries", "u16"), ("timestamp_ns", "u64"), ("meta", "blob"),
                ("payload", "rest")),
    T.CONSUME_BATCH: _QG + (("max", "u32"), ("timeout_ms", "u32"), ("visibility_ms", "u32")),
    T.DELIVER_BATCH: (("records", "records"),),
    T.ACK: _QG + (("offset", "u64"), ("deliveries", "u16")),
    T.ACK_OK: _EMPTY,
    T.NACK: _QG + (("offset", "u64"), ("deliveries", "u16"), ("delay_ms", "u32")),
    T.NACK_OK: _EMPTY,
    T.ACK_BATCH: _QG + (("settles", "settles"),),
    T.ACK_BATCH_OK: (("stale", "offsets"),),
    T.TOUCH: _QG + (("offset", "u64"), ("deliveries", "u16"), ("visibility_ms", "u32")),
    T.TOUCH_OK: _EMPTY,
    T.DEAD_LETTER: _QG + (("offset", "u64"), ("deliveries", "u16")),
    T.DEAD_LETTER_OK: _EMPTY,
    T.ACK_NO_REPLY: _QG + (("offset", "u64"), ("deliveries", "u16")),
    T.ACK_BATCH_NO_REPLY: _QG + (("settles", "settles"),),
    T.ACK_RANGE: _QG + (("first", "u64"), ("count", "u32"), ("deliveries", "u16")),
    T.ACK_RANGE_NO_REPLY: _QG + (("first", "u64"), ("count", "u32"), ("deliveries", "u16")),
    T.DISCONNECT: _EMPTY,
    T.DISCONNECT_OK: _EMPTY,
    T.GROUP_JOIN: _QG + (("start", "u8"),),
    T.GROUP_JOIN_OK: _EMPTY,
    T.GROUP_COMMIT: _QG + (("offset", "u64"),),
    T.GROUP_COMMIT_OK: _EMPTY,
    T.GROUP_DELETE: _QG,
    T.GROUP_DELETE_OK: _EMPTY,
    T.GROUP_LIST: (("queue", "str"),),
    T.GROUP_LIST_OK: (("groups", "json"),),
    T.READ: (("queue", "str"), ("offset", "u64"), ("max", "u32")),
    T.READ_OK: (("records", "records"),),
    T.STATS: (("queue", "str"),),
    T.STATS_OK: (("stats", "json"),),
    T.PURGE: (("queue", "str"),),
    T.PURGE_OK: (("purged", "u64"),),
    T.SUBSCRIBE: _QG + (("credit", "u32"), ("visibility_ms", "u32")),
    T.SUBSCRIBE_OK: _EMPTY,
    T.CREDIT: (("subscription", "u32"), ("credit", "u32")),
    T.UNSUBSCRIBE: (("subscription", "u32"),),
    T.UNSUBSCRIBE_OK: _EMPTY,
    T.ERROR: (("message", "str"),),
}
assert set(SCHEMAS) == set(T)

_TYPES: dict[int, T] = {int(t): t for t in T}


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
        types = _TYPES
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
    if type not in _TYPES:
        raise ValueError(f"unknown message type {type!r}")
    try:
        return _HEADER.pack(MAGIC, len(body), type, VERSION, status, msg_id) + body
    except struct.error as e:
        raise ValueError(f"bad frame header (msg_id {msg_id!r}, status {status!r}): {e}") from None


# --------------------------------------------------------------------------- bodies


def _count(value: Any) -> int:
    n = len(value)
    if n > options.MAX_BATCH:
        raise ValueError(f"{n} items in one batch (the limit is {options.MAX_BATCH})")
    return n


def _seq(value: Any) -> Any:
    return value if type(value) in (list, tuple) else list(value)


_U32 = struct.Struct(">I")
_BIG = sys.byteorder == "big"
for _code, _size in (("H", 2), ("I", 4), ("Q", 8)):
    assert array(_code).itemsize == _size, _code  # the columns below rely on it
del _code, _size

# The list kinds are columnar (drawn in docs/protocol.md): a count, then each fixed-width
# field of every item as one big-endian column, then the variable bytes of every item
# back to back.  So a batch is encoded and decoded with a few array operations, not
# one struct call per item.


def _column(code: str, values: Any) -> bytes:
    """One big-endian column of ints (OverflowError when one is out of range)."""
    col = array(code, values)
    if not _BIG:
        col.byteswap()
    return col.tobytes()


def _ints(code: str, raw: bytes) -> array[int]:
    col = array(code)
    col.frombytes(raw)
    if not _BIG:
        col.byteswap()
    return col


def _slices(body: bytes, lens: Any, pos: int, n: int, what: str) -> tuple[list[bytes], int]:
    """The byte strings of ``lens`` back to back from ``pos``, and where they end."""
    ends = list(accumulate(lens, initial=pos))
    if ends[-1] > n:
        raise _bad(f"truncated {what}")
    return [body[a:b] for a, b in zip(ends, ends[1:], strict=False)], ends[-1]


def _enc_blobs(items: Any) -> bytes:
    return _column("I", [len(p) for p in items]) + b"".join(items)


def _dec_blobs(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[bytes], int]:
    end = pos + 4 * ln
    if end > n:
        raise _bad(f"truncated {what}")
    return _slices(body, _ints("I", body[pos:end]), end, n, what)


def _enc_settles(items: Any) -> bytes:
    return _column("Q", [o for o, _ in items]) + _column("H", [d for _, d in items])


def _dec_settles(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[tuple[int, int]], int]:
    mid, end = pos + 8 * ln, pos + 10 * ln
    if end > n:
        raise _bad(f"truncated {what}")
    return list(zip(_ints("Q", body[pos:mid]), _ints("H", body[mid:end]), strict=True)), end


def _enc_offsets(items: Any) -> bytes:
    return _column("Q", items)


def _dec_offsets(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[int], int]:
    end = pos + 8 * ln
    if end > n:
        raise _bad(f"truncated {what}")
    return _ints("Q", body[pos:end]).tolist(), end


def _enc_records(items: Any) -> bytes:
    if not items:
        return b""
    offsets, deliveries, stamps, metas, payloads = zip(*items, strict=True)
    mlens = [len(m) for m in metas]
    data = (b"".join([x for m, p in zip(metas, payloads, strict=True) for x in (m, p)]) if any(mlens)
            else b"".join(payloads))
    return _records_columns(offsets, deliveries, stamps, mlens, [len(p) for p in payloads], data)


def _records_columns(offsets: Any, deliveries: Any, stamps: Any, meta_lens: Any, payload_lens: Any,
                     data: bytes) -> bytes:
    return b"".join((_column("Q", offsets), _column("H", deliveries), _column("Q", stamps),
                     _column("I", meta_lens), _column("I", payload_lens), data))


def records_field(offsets: Any, deliveries: Any, stamps: Any, meta_lens: Any, payload_lens: Any,
                  data: bytes) -> bytes:
    """A whole ``records`` field (count, columns, bytes) straight from its columns, with
    every record's meta and payload already back to back in ``data``.  DELIVER_BATCH
    and READ_OK bodies are this field alone: the server's batch path sends it as is."""
    n = _count(payload_lens)
    if not len(offsets) == len(deliveries) == len(stamps) == len(meta_lens) == n:
        raise ValueError("the columns of a records field differ in length")
    if sum(meta_lens) + sum(payload_lens) != len(data):
        raise ValueError("the records' lengths do not add up to their bytes")
    try:
        return _U32.pack(n) + _records_columns(offsets, deliveries, stamps, meta_lens, payload_lens, data)
    except OverflowError as e:
        raise ValueError(f"bad records field: {e}") from None


def _dec_records(body: bytes, pos: int, n: int, ln: int, what: str) -> tuple[list[Any], int]:
    a, b, c, d, e = (pos + 8 * ln, pos + 10 * ln, pos + 18 * ln, pos + 22 * ln, pos + 26 * ln)
    if e > n:
        raise _bad(f"truncated {what}")
    mlens, plens = _ints("I", body[c:d]), _ints("I", body[d:e])
    if any(mlens):  # meta and payload of each record, one after the other
        both, end = _slices(body, [x for pair in zip(mlens, plens, strict=True) for x in pair], e, n, what)
        metas, payloads = both[0::2], both[1::2]
    else:
        payloads, end = _slices(body, plens, e, n, what)
        metas = [b""] * ln
    return list(zip(_ints("Q", body[pos:a]), _ints("H", body[a:b]), _ints("Q", body[b:c]),
                    metas, payloads, strict=True)), end


def _json_dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _bad(what: str) -> ProtocolError:
    return ProtocolError(what, Status.PROTOCOL_ERROR)


_INT = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}
_PREFIXED = {"str": "H", "blob": "I", "json": "I", "blobs": "I", "settles": "I", "offsets": "I",
             "records": "I"}
_KINDS = set(_INT) | set(_PREFIXED) | {"rest"}

# The generated functions see only these names (and their own structs).
_GLOBALS: dict[str, Any] = {
    "_bad": _bad, "_count": _count, "_seq": _seq, "_options": options,
    "_str_encode": str.encode, "_json_dumps": _json_dumps, "_json_loads": json.loads,
    **{f"_{d}_{k}": globals()[f"_{d}_{k}"] for d in ("enc", "dec")
       for k in ("blobs", "settles", "offsets", "records")},
}


def _compile(t: T, schema: Schema) -> tuple[Callable[[dict[str, Any]], tuple[Any, ...]],
                                            Callable[[bytes], dict[str, Any]]]:
    """Generate the encoder (fields -> tuple of byte parts) and the decoder
    (body -> fields) of one schema.  A run of ints, with the length or count
    prefix that follows it, is one precompiled Struct."""
    names = [n for n, _ in schema]
    kinds = [k for _, k in schema]
    assert all(k in _KINDS for k in kinds), schema
    assert "rest" not in kinds[:-1], schema
    ns = dict(_GLOBALS)
    structs: list[struct.Struct] = []

    def struct_name(fmt: str) -> str:
        structs.append(struct.Struct(">" + fmt))
        ns[f"_s{len(structs) - 1}"] = structs[-1]
        return f"_s{len(structs) - 1}"

    # ---- encoder: parts of the body, joined by the caller
    enc: list[str] = []
    parts: list[str] = []
    fmt = ""
    args: list[str] = []

    def enc_flush() -> None:
        nonlocal fmt, args
        if fmt:
            parts.append(f"{struct_name(fmt)}.pack({', '.join(args)})")
            fmt, args = "", []

    for i, (name, kind) in enumerate(schema):
        v = f"v{i}"
        if kind in _INT:
            fmt += _INT[kind]
            args.append(f"f[{name!r}]")
            continue
        if kind == "rest":
            enc_flush()
            parts.append(f"f[{name!r}]")
            continue
        if kind == "str":
            enc.append(f"{v} = _str_encode(f[{name!r}])")
            length, data = f"len({v})", v
        elif kind == "json":
            enc.append(f"{v} = _json_dumps(f[{name!r}])")
            length, data = f"len({v})", v
        elif kind == "blob":
            enc.append(f"{v} = f[{name!r}]")
            length, data = f"len({v})", v
        else:  # a list
            enc.append(f"{v} = _seq(f[{name!r}])")
            length, data = f"_count({v})", f"_enc_{kind}({v})"
        fmt += _PREFIXED[kind]
        args.append(length)
        enc_flush()
        parts.append(data)
    enc_flush()
    enc_src = "def _enc(f):\n" + "".join(f"    {line}\n" for line in enc)
    enc_src += f"    return ({''.join(p + ', ' for p in parts)})\n"

    # ---- decoder
    dec: list[str] = []
    fmt = ""
    targets: list[str] = []
    fixed = all(k in _INT for k in kinds)

    def dec_flush() -> None:
        nonlocal fmt, targets
        if fmt:
            s = struct_name(fmt)
            dec.append(f"{''.join(x + ', ' for x in targets)}= {s}.unpack_from(body, pos)")
            dec.append(f"pos += {structs[-1].size}")
            fmt, targets = "", []

    def take(var: str, ln: str, what: str) -> None:  # var = body[pos:pos+ln], checked
        dec.append(f"end = pos + {ln}")
        dec.append(f"if end > n: raise _bad('truncated {what} of the {t.name} body')")
        dec.append(f"{var} = body[pos:end]")
        dec.append("pos = end")

    if fixed and kinds:
        s = struct_name("".join(_INT[k] for k in kinds))
        dec.append(f"if len(body) != {structs[-1].size}:")
        dec.append(f"    raise _bad(f'the {t.name} body is {structs[-1].size} bytes, not {{len(body)}}')")
        dec.append(f"{''.join(f'x{i}, ' for i in range(len(kinds)))}= {s}.unpack(body)")
    elif kinds:
        dec.append("n = len(body)")
        dec.append("pos = 0")
        for i, (name, kind) in enumerate(schema):
            v = f"x{i}"
            if kind in _INT:
                fmt += _INT[kind]
                targets.append(v)
                continue
            if kind == "rest":
                dec_flush()
                dec.append(f"{v} = body[pos:]")
                dec.append("pos = n")
                continue
            fmt += _PREFIXED[kind]
            targets.append("ln")
            dec_flush()
            if kind in ("str", "blob", "json"):
                take(v, "ln", name)
                if kind == "str":
                    dec.append(f"{v} = {v}.decode()")
                elif kind == "json":
                    dec.append(f"{v} = _json_loads({v}.decode())")
                continue
            dec.append("if ln > _options.MAX_BATCH:")
            dec.append(f"    raise _bad(f'{{ln}} {name} in the {t.name} body (the limit is "
                       f"{{_options.MAX_BATCH}})')")
            dec.append(f"{v}, pos = _dec_{kind}(body, pos, n, ln, '{name} of the {t.name} body')")
        dec_flush()
        if kinds[-1] != "rest":
            dec.append(f"if pos != n: raise _bad(f'{{n - pos}} bytes past the end of the {t.name} body')")
    else:
        dec.append(f"if body: raise _bad(f'the {t.name} body is empty, not {{len(body)}} bytes')")
    fields = ", ".join(f"{n!r}: x{i}" for i, n in enumerate(names))
    dec.append(f"return {{{fields}}}")
    dec_src = "def _dec(body):\n" + "".join(f"    {line}\n" for line in dec)

    exec(compile(enc_src, f"<shmq.codec encoder of {t.name}>", "exec"), ns)
    exec(compile(dec_src, f"<shmq.codec decoder of {t.name}>", "exec"), ns)
    return ns["_enc"], ns["_dec"]


_ENCODERS: dict[int, Callable[[dict[str, Any]], tuple[Any, ...]]] = {}
_DECODERS: dict[int, Callable[[bytes], dict[str, Any]]] = {}
_NAMES: dict[int, frozenset[str]] = {}
for _t, _schema in SCHEMAS.items():
    _ENCODERS[_t], _DECODERS[_t] = _compile(_t, _schema)
    _NAMES[_t] = frozenset(n for n, _ in _schema)
del _t, _schema


def _body_parts(type: int, fields: dict[str, Any]) -> tuple[Any, ...]:
    enc = _ENCODERS.get(type)
    if enc is None:
        raise ValueError(f"unknown message type {type!r}")
    if fields.keys() != _NAMES[type]:
        want, got = _NAMES[type], set(fields)
        raise ValueError(f"{_TYPES[type].name} fields: missing {sorted(want - got)}, "
                         f"unexpected {sorted(got - want)}")
    try:
        return enc(fields)
    except (struct.error, OverflowError) as e:  # an int out of range, a str over 65535 bytes, ...
        raise ValueError(f"bad {_TYPES[type].name} field: {e}") from None


def encode_body(type: int, **fields: Any) -> bytes:
    """The body of a ``type`` frame from its fields (all of them, by name; see
    :data:`SCHEMAS`).  A missing, unexpected or out-of-range field is a
    ``ValueError``."""
    return b"".join(_body_parts(type, fields))


def decode_body(type: int, body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The fields of a ``type`` body, by name.  Any malformed body (truncated,
    trailing bytes, bad UTF-8 or JSON, a count over ``options.MAX_BATCH``) raises
    ProtocolError(PROTOCOL_ERROR); an unknown type, ProtocolError(INVALID_TYPE)."""
    dec = _DECODERS.get(type)
    if dec is None:
        raise ProtocolError(f"unknown message type {type!r}", Status.INVALID_TYPE)
    if body.__class__ is not bytes:
        body = bytes(body)
    try:
        return dec(body)
    except ProtocolError:
        raise
    except (struct.error, ValueError, RecursionError) as e:  # ValueError: bad UTF-8 or JSON
        raise ProtocolError(f"malformed {_TYPES[type].name} body: {e}", Status.PROTOCOL_ERROR) from None


def frame(type: int, msg_id: int, status: int = 0, **fields: Any) -> bytes:
    """``encode_frame(type, msg_id, encode_body(type, **fields), status)``, with one copy
    of the payload fewer."""
    parts = _body_parts(type, fields)
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
def consume_frame(msg_id: int, queue: bytes, group: bytes, timeout_ms: int, visibility_ms: int) -> bytes:
    """``frame(T.CONSUME, msg_id, queue=..., group=..., timeout_ms=..., visibility_ms=...)``."""
    n = len(queue)
    return b"".join((_NAMED.pack(MAGIC, n + len(group) + 12, T.CONSUME, VERSION, 0, msg_id, n), queue,
                     _U16.pack(len(group)), group, _U32_U32.pack(timeout_ms, visibility_ms)))


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
        raise _bad(f"truncated meta of the DELIVER body ({len(body)} bytes)")
    offset, deliveries, ts, n = _DELIVER_BODY.unpack_from(body)
    end = _DELIVER_FIXED + n
    if end > len(body):
        raise _bad("truncated meta of the DELIVER body")
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
