"""Message headers: checking them, and their block in a record's metadata and on the wire.

A message's headers are a mapping of ``str`` keys (non-empty) to ``bytes`` values;
``put`` also takes a ``str`` value, stored encoded as UTF-8, and a message read back
always has ``bytes`` (``msg.headers`` is a read-only ``MappingProxyType``, in the
order given).  An empty mapping is no headers: nothing is stored.

The header block (big-endian, as the wire)::

    tag u8 = 0x01 | count u16 | count x (key length u16, key UTF-8, value length u16, value)

A record's metadata (``layout``: ``metadata || payload``) is the header block, if the
message has headers, followed by what the broker adds (a dead letter's origin, JSON,
whose first byte is ``{``).  So a record without headers is byte for byte what it was
before headers existed, and the first byte tells the two apart.  On the wire, DELIVER,
DELIVER_BATCH and READ_OK carry the metadata as it is stored; a PRODUCE,
PRODUCE_BATCH or PRODUCE_IDEMPOTENT with the frame flag :data:`FLAG` in its status
field carries, before each payload, a header block or the single byte 0x00 (none)
(``docs/protocol.md``, "Headers").  Limits: ``options.MAX_HEADERS`` per message,
``options.MAX_HEADERS_BYTES`` for the block; the block counts towards the message's size.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from shmq import options
from shmq.accel import ext
from shmq.errors import InvalidArgument, LimitExceeded

TAG = 0x01  # the first byte of a header block (its version)
NONE = b"\x00"  # a flagged produce's payload without headers starts with this
FLAG = 0x0001  # the status field of a PRODUCE* request: every payload starts with a block or NONE
_HEAD = struct.Struct(">BH")
_U16 = struct.Struct(">H")
EMPTY: Mapping[str, bytes] = MappingProxyType({})
_SHORT = 256
_LENS = [_U16.pack(n) for n in range(_SHORT)]  # the length prefixes of short keys and values, made once
# the compiled twins of encode, _parse and decode (shmq.accel), public for the hot paths that
# call them at once (Message.headers, ShmQueue.put): None where these would raise
encode_c = None if ext is None else ext.encode_headers
parse_c = None if ext is None else ext.parse_headers
decode_c = None if ext is None else ext.decode_headers


class Block(bytes):
    """A header block encoded and checked already (``Block(encode(...))``, or built from
    one by the same rules): passed as ``headers=`` to a put, it is stored as it is
    (``shmq.api.reply`` encodes a requester's constant ``reply-to`` once)."""

    __slots__ = ()


def encode(headers: Mapping[str, str | bytes] | Block | None) -> bytes:
    """The header block of ``headers``; ``b""`` for None or an empty mapping; a
    :class:`Block` as it is.  Raises ``InvalidArgument`` (not a mapping, a key not a
    non-empty ``str``, a value neither ``str`` nor bytes) or ``LimitExceeded`` (over
    ``MAX_HEADERS`` or ``MAX_HEADERS_BYTES``)."""
    if isinstance(headers, Block):
        return headers
    if encode_c is not None:
        block = encode_c(headers, options.MAX_HEADERS, options.MAX_HEADERS_BYTES)
        if block is not None:
            return block  # type: ignore[no-any-return]
    if not headers:
        if headers is None or isinstance(headers, Mapping):
            return b""
        raise InvalidArgument(f"headers must be a mapping, not {type(headers).__name__}")
    if not isinstance(headers, Mapping):
        raise InvalidArgument(f"headers must be a mapping, not {type(headers).__name__}")
    if len(headers) > options.MAX_HEADERS:
        raise LimitExceeded(f"{len(headers)} headers; the limit is {options.MAX_HEADERS} per message")
    parts = [_HEAD.pack(TAG, len(headers))]
    lens = _LENS
    for k, v in headers.items():
        if type(k) is not str or not k:
            raise InvalidArgument(f"a header key must be a non-empty str, not {k!r}")
        if type(v) is str:
            v = v.encode()
        elif type(v) is not bytes:
            if not isinstance(v, bytearray | memoryview):
                raise InvalidArgument(f"the value of header {k!r} must be str or bytes, not "
                                      f"{type(v).__name__}")
            v = bytes(v)
        kb = k.encode()
        if len(kb) >= _SHORT or len(v) >= _SHORT:
            if len(kb) + len(v) > options.MAX_HEADERS_BYTES:
                break  # the size check below says so
            parts += (_U16.pack(len(kb)), kb, _U16.pack(len(v)), v)
        else:
            parts += (lens[len(kb)], kb, lens[len(v)], v)
    block = b"".join(parts)
    if len(block) > options.MAX_HEADERS_BYTES or len(parts) != 1 + 4 * len(headers):
        raise LimitExceeded(f"headers of more than {options.MAX_HEADERS_BYTES} bytes encoded "
                            "(options.MAX_HEADERS_BYTES)")
    return block


def encode_many(headers: Sequence[Mapping[str, str | bytes] | None] | None, n: int) -> list[bytes] | None:
    """The blocks of a batch of ``n`` (one mapping or None per payload); None when no
    message has headers.  Everything is checked before anything is stored."""
    if headers is None:
        return None
    if isinstance(headers, Mapping | str | bytes) or len(headers) != n:
        raise InvalidArgument(f"headers must be a list of one mapping (or None) per payload ({n})")
    metas = [encode(h) for h in headers]
    return metas if any(metas) else None


def _parse(meta: bytes | memoryview) -> tuple[dict[str, bytes], int]:
    """The headers of a block at the start of ``meta``, and the block's length."""
    if parse_c is not None:
        parsed = parse_c(meta)
        if parsed is not None:
            return parsed  # type: ignore[no-any-return]
    meta = bytes(meta)
    try:
        if len(meta) < 3 or meta[0] != TAG:
            raise ValueError(f"tag or count missing ({meta[:3].hex()})")
        count = meta[1] << 8 | meta[2]
        out: dict[str, bytes] = {}
        at = 3
        for _ in range(count):
            n = meta[at] << 8 | meta[at + 1]
            at += 2
            key = meta[at:at + n].decode()
            at += n
            m = meta[at] << 8 | meta[at + 1]
            at += 2
            value = meta[at:at + m]
            at += m
            if not key or at > len(meta):
                raise ValueError("truncated")
            out[key] = value
    except (IndexError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise InvalidArgument(f"malformed header block: {e}") from None
    if len(out) != count:
        raise InvalidArgument("malformed header block: a key repeated")
    return out, at


def decode(meta: bytes | memoryview) -> Mapping[str, bytes]:
    """The headers a record's metadata holds (read-only; empty when none)."""
    if decode_c is not None:
        h = decode_c(meta, EMPTY)
        if h is not None:
            return h  # type: ignore[no-any-return]
    if not meta or meta[0] != TAG:
        return EMPTY
    return MappingProxyType(_parse(meta)[0])


def block_of(meta: bytes | memoryview) -> bytes:
    """The header block at the start of a record's metadata (``b""``: none)."""
    if not meta or meta[0] != TAG:
        return b""
    return bytes(meta[:_parse(meta)[1]])


def split(blob: bytes) -> tuple[bytes, bytes]:
    """(header block, payload) of one payload of a flagged produce, the block checked
    against the limits; ``InvalidArgument`` / ``LimitExceeded`` when it is bad."""
    if blob[:1] == NONE:
        return b"", blob[1:]
    headers, end = _parse(blob)
    if len(headers) > options.MAX_HEADERS:
        raise LimitExceeded(f"{len(headers)} headers; the limit is {options.MAX_HEADERS} per message")
    if end > options.MAX_HEADERS_BYTES:
        raise LimitExceeded(f"headers of {end} bytes encoded; the limit is {options.MAX_HEADERS_BYTES}")
    if not headers:
        raise InvalidArgument("malformed header block: no headers (send 0x00 instead)")
    return blob[:end], blob[end:]


def split_many(blobs: list[bytes]) -> tuple[list[bytes] | None, list[bytes]]:
    """(header blocks, payloads) of a flagged produce's payloads, every block checked
    first; the blocks are None when no message has headers."""
    pairs = [split(b) for b in blobs]
    metas = [m for m, _ in pairs]
    return (metas if any(metas) else None), [p for _, p in pairs]


def flagged(meta: bytes, payload: bytes) -> bytes:
    """One payload of a flagged produce: its header block (or NONE), then the payload."""
    return (meta or NONE) + payload


def as_json(h: Mapping[str, bytes]) -> dict[str, Any]:
    """Headers for JSON output: a value that is UTF-8 text as a string, else ``{"hex": ...}``."""
    out: dict[str, Any] = {}
    for k, v in h.items():
        try:
            out[k] = v.decode()
        except UnicodeDecodeError:
            out[k] = {"hex": v.hex()}
    return out
