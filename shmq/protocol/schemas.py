"""The message catalogue of the wire protocol: every message type and the fields of its body.

:class:`T` names the types (the ``type`` byte of a frame header) and :data:`SCHEMAS` lists
each type's body fields in wire order, with their kinds; ``docs/protocol.md`` draws the
same table, and ``tests/protocol/test_codec.py`` checks the two against each other.  Nothing here
encodes anything: ``protocol.bodies`` compiles these schemas into body encoders and decoders,
and ``codec`` puts bodies into frames.  Import the names from ``shmq.protocol.codec``.
"""

from __future__ import annotations

from enum import IntEnum


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
    INFO = 0x77
    INFO_OK = 0x78
    GROUP_SEEK = 0x79
    GROUP_SEEK_OK = 0x7A
    SUBSCRIBE = 0x81
    SUBSCRIBE_OK = 0x82
    CREDIT = 0x83
    UNSUBSCRIBE = 0x85
    UNSUBSCRIBE_OK = 0x86
    HEARTBEAT = 0x91
    PROMOTE = 0x93
    PROMOTE_OK = 0x94
    ERROR = 0xFE


Schema = tuple[tuple[str, str], ...]

_QG: Schema = (("queue", "str"), ("group", "str"))
_EMPTY: Schema = ()

#: The body of every type: (field name, field kind) in wire order.  The kinds are
#: u8/u16/u32/u64, str (u16 length + UTF-8), blob (u32 length + bytes), rest (the
#: remaining bytes; last field only), json (u32 length + UTF-8 JSON), blobs,
#: settles, offsets and records (u32 count + that many items).
SCHEMAS: dict[T, Schema] = {
    T.HANDSHAKE: (("token", "str"), ("client", "str"), ("affinity", "str"), ("heartbeat_ms", "u32")),
    T.HANDSHAKE_ACK: (("worker", "u16"), ("max_frame", "u32"), ("server", "str"), ("heartbeat_ms", "u32")),
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
    T.INFO: _EMPTY,
    T.INFO_OK: (("info", "json"),),
    T.GROUP_SEEK: _QG + (("timestamp_ns", "u64"), ("create", "u8")),
    T.GROUP_SEEK_OK: (("offset", "u64"),),
    T.SUBSCRIBE: _QG + (("credit", "u32"), ("visibility_ms", "u32")),
    T.SUBSCRIBE_OK: _EMPTY,
    T.CREDIT: (("subscription", "u32"), ("credit", "u32")),
    T.UNSUBSCRIBE: (("subscription", "u32"),),
    T.UNSUBSCRIBE_OK: _EMPTY,
    T.HEARTBEAT: _EMPTY,
    T.PROMOTE: (("force", "u8"),),
    T.PROMOTE_OK: (("epoch", "u64"),),
    T.ERROR: (("message", "str"),),
}
assert set(SCHEMAS) == set(T)

#: the types by their wire code
TYPES: dict[int, T] = {int(t): t for t in T}
