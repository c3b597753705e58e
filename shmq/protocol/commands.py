"""Every client command written once, for both TCP clients (``shmq.client.tcp``, ``shmq.client.aio``).

A command is a :class:`~shmq.protocol.connection.Request` -- the frame to send (an encoder and its
arguments, the message id left to the connection) and the function that makes its answer
the result -- or a :class:`Batch` of them, whose results one function combines.  The
argument checks happen here, when the command is made, so a bad argument raises the same
error in either client, before anything is sent.  Each client runs a command one way:
the blocking one sends it and parses the answer when its reader files it, the asyncio
one awaits it::

    TcpQueue.stats()    -> broker._execute(stats(q))        -> the dict
    AsyncQueue.stats()  -> await broker._execute(stats(q))  -> the dict

A queue handle given to a command (``q``) has ``name``, ``name_bytes`` (the name in UTF-8),
``broker`` (its broker) and ``message_class`` (the Message class its messages are made of).  The
``ctx`` of a request answered with leases (CONSUME, CONSUME_BATCH) is ``(q, group)``: it
says whose leases an answer nobody took gives back (:func:`unclaimed`).

The one-message requests -- put, get, ack -- use the codec's one-struct-call encoders
(``produce_frame``, ``consume_frame``, ``settle_frame``) and build no dict.

Every duration a command is given in seconds (a timeout, a visibility timeout, a nack's
delay) becomes the wire's ms in one place, :func:`seconds_to_ms`: a bad one -- negative,
NaN, infinite, too large, not a number -- is the same :class:`~shmq.errors.InvalidArgument`,
with the same message, in either client.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from shmq import accel, options
from shmq import headers as _headers
from shmq.api import (
    BrokerInfo,
    Headers,
    Message,
    Payload,
    QueueConfig,
    QueueInfo,
    RecordColumns,
    as_bytes,
    check_priority,
    check_read,
    delay_ms,
    own_leases,
    ttl_ms,
)
from shmq.errors import AuthError, InvalidArgument, ShmqError, StaleAck
from shmq.joined import Joined
from shmq.names import check_new_queue_name
from shmq.protocol.bodies import records_arrays
from shmq.protocol.codec import (
    NO_REPLY_ID,
    WAIT_FOREVER,
    Columns,
    Frame,
    T,
    consume_frame,
    decode_body,
    decode_deliver,
    encode_body,
    encode_frame,
    error_of,
    frame,
    produce_frame,
    records_columns,
    settle_frame,
)
from shmq.protocol.connection import Request
from shmq.protocol.consume_ack import ACK_FLAG, acking_batch_frame, lease_suffix, settles_suffix
from shmq.protocol.produce import batch_payloads, joined_frame, joined_request, prefixed, produce_request
from shmq.settle import Settle

R = TypeVar("R")
M = TypeVar("M", bound=Message, covariant=True)


class Handle(Protocol[M]):
    """A queue handle of either client, as the commands see it: its messages are ``M``s."""

    @property
    def name(self) -> str: ...

    @property
    def name_bytes(self) -> bytes: ...  # the name in UTF-8

    @property
    def broker(self) -> Any: ...  # the broker (shmq.api.own_leases tells connections apart by it)

    @property
    def message_class(self) -> type[M]: ...  # what its messages are made of


class Batch(NamedTuple, Generic[R]):
    """A command of several frames: ``nowait`` (unwaited requests, message id NO_REPLY_ID,
    answered only when they fail) are sent first, then ``requests``, pipelined; the result
    is ``combine(their results, in order)``, which may raise."""

    nowait: list[bytes]
    requests: list[Request[Any]]
    combine: Callable[[list[Any]], R]


Command = Request[R] | Batch[R]


# ---------------------------------------------------------------- arguments
def seconds_to_ms(seconds: float, what: str, most: float | None = None) -> int:
    """``seconds`` in whole ms (truncated), for the argument ``what``: a number (not a bool, nor
    a string) from 0 to ``most`` seconds; ``most`` None: any finite number, a wait longer than
    the wire carries cut to the longest it does (``WAIT_FOREVER`` - 1 ms).  Anything else --
    negative, NaN, infinite, past ``most``, not a number -- is :class:`InvalidArgument`.  The one
    conversion of every client command (:func:`timeout_ms`, :func:`visibility_ms`,
    :func:`nack_delay_ms`), so that both clients refuse a bad one alike."""
    cls = seconds.__class__
    if cls is not float and cls is not int:  # (the usual two skip this: the hot path)
        number = None
        if not isinstance(seconds, (bool, str, bytes, bytearray)):  # (float() would take a str)
            try:
                number = float(seconds)  # numpy's, Decimal, Fraction, ...
            except (TypeError, ValueError):
                pass
        if number is None:
            raise InvalidArgument(f"{what} must be a number of seconds, not {cls.__name__}")
        seconds = number
    if most is None:
        if not 0 <= seconds < math.inf:
            raise InvalidArgument(f"{what} must be a finite number of seconds >= 0, not {seconds!r}")
        return min(int(seconds * 1000), WAIT_FOREVER - 1)
    if not 0 <= seconds <= most:
        raise InvalidArgument(f"{what} must be between 0 and {most:g} seconds, not {seconds!r}")
    return int(seconds * 1000)


def timeout_ms(block: bool, timeout: float | None) -> int:
    """The ``timeout_ms`` of a request that may wait: 0 when it may not (``block`` False: the
    timeout is not looked at), ``WAIT_FOREVER`` for no timeout (None)."""
    if not block:
        return 0
    if timeout is None:
        return WAIT_FOREVER
    return seconds_to_ms(timeout, "timeout")


def visibility_ms(seconds: float | None) -> int:
    """The ``visibility_ms`` of a lease: 0 for the queue's own (None), else at least 1, at most
    ``options.MAX_VISIBILITY_TIMEOUT`` seconds."""
    return 0 if seconds is None else max(1, seconds_to_ms(seconds, "visibility_timeout",
                                                          options.MAX_VISIBILITY_TIMEOUT))


def nack_delay_ms(seconds: float) -> int:
    """The ``delay_ms`` of a NACK: at most ``options.MAX_VISIBILITY_TIMEOUT`` seconds."""
    return seconds_to_ms(seconds, "delay", options.MAX_VISIBILITY_TIMEOUT)


# ---------------------------------------------------------------- acks
def ack_nowait_frame(queue: bytes, msg: Message) -> bytes:
    """The ACK_NO_REPLY frame of ``msg.ack(wait=False)``; ``queue`` in UTF-8."""
    group = msg.group
    if group is None:
        raise StaleAck(f"message {msg.offset} was read, not leased: it cannot be settled")
    return settle_frame(T.ACK_NO_REPLY, NO_REPLY_ID, queue, str.encode(group), msg.offset, msg.deliveries)


def ack_batch_nowait_frames(queue: str, msgs: list[Message]) -> list[bytes]:
    """The frames of ``ack_many(msgs, wait=False)``: ``batch_acks``' requests as their NO_REPLY kinds."""
    return [frame(NO_REPLY_KIND[kind], NO_REPLY_ID, queue=queue, **fields)
            for kind, fields in batch_acks(msgs)]


NO_REPLY_KIND = {T.ACK_BATCH: T.ACK_BATCH_NO_REPLY, T.ACK_RANGE: T.ACK_RANGE_NO_REPLY}


def batch_acks(msgs: list[Message]) -> list[tuple[T, dict[str, Any]]]:
    """The requests that ack ``msgs``, as (type, fields but the queue).
    One ACK_RANGE when they are one run: one group, consecutive offsets in order, one
    delivery count (what one push or one get_many of new messages brings), so the frame
    is the same few bytes however many they are; otherwise one ACK_BATCH per group."""
    n = len(msgs)
    if n > 1:
        first, dc, group = msgs[0].offset, msgs[0].deliveries, msgs[0].group
        if (msgs[-1].offset == first + n - 1 and list(map(_offset_of, msgs)) == list(range(first, first + n))
                and list(map(_dc_of, msgs)).count(dc) == n and list(map(_group_of, msgs)).count(group) == n):
            return [(T.ACK_RANGE, {"group": group or "", "first": first, "count": n, "deliveries": dc})]
    return [(T.ACK_BATCH, {"group": group, "settles": settles}) for group, settles in settles_by_group(msgs)]


def settles_by_group(msgs: list[Message]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(group, [(offset, deliveries), ...]) of each group of ``msgs``, for ACK_BATCH."""
    groups = set(map(_group_of, msgs))
    if len(groups) == 1:  # the usual case: one get_many's messages, at C speed
        return [(groups.pop() or "", list(map(_settle_of, msgs)))]
    by_group: dict[str, list[tuple[int, int]]] = {}
    for m in msgs:
        by_group.setdefault(m.group or "", []).append((m.offset, m.deliveries))
    return list(by_group.items())


# a Message's fields (its properties' getters), at C speed over many
_group_of = itemgetter(2)  # Message.group
_offset_of = itemgetter(3)  # Message.offset
_dc_of = itemgetter(4)  # Message.deliveries
_settle_of = itemgetter(3, 4)  # (offset, deliveries)


# ---------------------------------------------------------------- answers
def _fields(f: Frame, reply: T) -> dict[str, Any]:
    """The fields of answer ``f``, expected of type ``reply``; an ERROR raises its typed error."""
    if f.type != reply:
        if f.type == T.ERROR:
            raise error_of(f)
        raise ShmqError(f"unexpected reply type 0x{f.type:02x} (expected {reply.name})")
    return decode_body(reply, f.body)


def _pick(f: Frame, ctx: tuple[T, str | None]) -> Any:
    """``ctx`` = (the answer's type, the field that is the result, or None for no result)."""
    reply, result = ctx
    if f.type != reply:
        _fields(f, reply)  # raises
    fields = decode_body(reply, f.body)
    return None if result is None else fields[result]


def _ignore(f: Frame, ctx: Any) -> None:
    """An answer of no interest, an error included (a give-back NACK's: a stale one is fine)."""


def _fields_frame(msg_id: int, type_: int, fields: dict[str, Any]) -> bytes:
    return frame(type_, msg_id, **fields)


def _produce_frame(msg_id: int, type_: int, fields: dict[str, Any], status: int, ms: int = 0,
                   tms: int = 0, prio: int = 0) -> bytes:
    """A PRODUCE* frame with its flags: header blocks (``status``), a delay (``ms``), a TTL
    (``tms``) and a priority (``prio``): their flags and prefixes, ``producing.prefixed``."""
    if not ms and not tms and not prio:
        return frame(type_, msg_id, status, **fields)
    status, body = prefixed(status, encode_body(type_, **fields), ms, tms, prio)
    return encode_frame(type_, msg_id, body, status)


def call(type_: T, reply: T, result: str | None = None, /, **fields: Any) -> Request[Any]:
    """A request of ``type_`` with ``fields``, answered by ``reply``, whose field ``result``
    is the result (None: there is none)."""
    return Request(_fields_frame, (type_, fields), _pick, (reply, result))


def _messages(q: Handle[M], gi: int, group: str | None, columns: Columns) -> list[M]:
    """``q``'s messages of records in columns (offsets, deliveries, timestamps, metas,
    payloads: ``codec.records_columns``); ``gi`` -1 for read ones (not leases), else 0.
    Made at C speed: a tuple per message, no Python call."""
    o, dc, ts, m, p = columns
    fields = zip(repeat(q), repeat(gi), repeat(group), o, dc, p, m, ts)
    return list(map(tuple.__new__, repeat(q.message_class), fields))


_wire_records = accel.ext.wire_records if accel.ext is not None else None


def _answer_messages(q: Handle[M], gi: int, group: str | None, f: Frame, reply: T) -> list[M]:
    """``_messages`` of ``_records(f, reply)``; made in one compiled pass (``wire_records``,
    shmq/_speedups_wire.c) where it can, else by the twin (which raises for a malformed
    body and an ERROR)."""
    if f.type == reply and _wire_records is not None:
        out: list[M] = []
        if _wire_records(out, q.message_class, (q, gi, group), f.body, options.MAX_BATCH) is not None:
            return out
    return _messages(q, gi, group, _records(f, reply))


def pushed_messages(q: Handle[M], group: str, f: Frame) -> list[M]:
    """The messages of a pushed DELIVER or DELIVER_BATCH frame (an ERROR raises)."""
    if f.type == T.DELIVER_BATCH:
        return _answer_messages(q, 0, group, f, T.DELIVER_BATCH)
    return _messages(q, 0, group, pushed_records(f))


def _records(f: Frame, reply: T) -> Columns:
    """The records of answer ``f`` (a DELIVER_BATCH or READ_OK: ``reply``) in columns; an
    ERROR raises its typed error."""
    if f.type != reply:
        _fields(f, reply)  # raises
    return records_columns(reply, f.body)


def pushed_records(f: Frame) -> Columns:
    """The records of a DELIVER or DELIVER_BATCH frame in columns (offsets, deliveries,
    timestamps, metas, payloads); an ERROR raises its typed error."""
    if f.type == T.DELIVER_BATCH:
        return records_columns(T.DELIVER_BATCH, f.body)
    if f.type == T.DELIVER:
        return tuple([x] for x in decode_deliver(f.body))  # type: ignore[return-value]
    if f.type == T.ERROR:
        raise error_of(f)
    raise ShmqError(f"unexpected frame type 0x{f.type:02x} on a subscription")


LEASES = (T.DELIVER, T.DELIVER_BATCH)  # the answers that lease messages


# ---------------------------------------------------------------- the broker's commands
def handshake(token: str, client: str, affinity: str, heartbeat: float = 0.0
              ) -> Request[tuple[int, str, float]]:
    """The first request, proposing ``heartbeat`` seconds between heartbeats (0: none):
    its result is (the worker serving the connection, the broker's name, the heartbeat
    interval agreed)."""
    if not 0 <= heartbeat <= 3600:
        raise InvalidArgument(f"heartbeat must be in [0, 3600] seconds (0: none), not {heartbeat!r}")
    return Request(_fields_frame, (T.HANDSHAKE, {"token": token, "client": client, "affinity": affinity,
                                                 "heartbeat_ms": round(heartbeat * 1000)}), _handshaken)


def _handshaken(f: Frame, _: Any) -> tuple[int, str, float]:
    if f.type == T.HANDSHAKE_NACK:
        raise AuthError(decode_body(T.HANDSHAKE_NACK, f.body)["reason"])
    info = _fields(f, T.HANDSHAKE_ACK)
    return info["worker"], info["server"], info["heartbeat_ms"] / 1000


def disconnect() -> Request[None]:
    """The broker gives the connection's leases back, answers, and closes it."""
    return call(T.DISCONNECT, T.DISCONNECT_OK)


def create_queue(name: str, limits: dict[str, Any]) -> Request[None]:
    check_new_queue_name(name, dead_letter=bool(limits.get("dead_letter")))
    return call(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue=name, config=limits)


def list_queues() -> Request[list[QueueInfo]]:
    return Request(_fields_frame, (T.LIST_QUEUES, {}), _queue_infos)


def _queue_infos(f: Frame, _: Any) -> list[QueueInfo]:
    known = QueueConfig.__dataclass_fields__  # (settings a newer broker adds are left out)
    return [QueueInfo(d["name"], d["is_dlq"],
                      QueueConfig(**{k: v for k, v in d["config"].items() if k in known}))
            for d in _fields(f, T.LIST_QUEUES_OK)["queues"]]


def delete_queue(name: str) -> Request[None]:
    return call(T.DELETE_QUEUE, T.DELETE_QUEUE_OK, queue=name)


def promote(force: bool = False) -> Request[int]:
    """Make a standby the primary (``shmq promote``): its new epoch."""
    return call(T.PROMOTE, T.PROMOTE_OK, "epoch", force=int(force))


def info() -> Request[BrokerInfo]:
    """The broker's version, owner, uptime, workers and connections per worker."""
    return Request(_fields_frame, (T.INFO, {}), _broker_info)


def _broker_info(f: Frame, _: Any) -> BrokerInfo:
    about = _fields(f, T.INFO_OK)["info"]
    if not isinstance(about, dict):
        raise ShmqError(f"INFO_OK carries {type(about).__name__}, not an object")
    return BrokerInfo.of(about)


# ---------------------------------------------------------------- a queue's commands
_OFFSET = (T.PRODUCE_OK, "offset")
_ACKED = (T.ACK_OK, None)


def put(q: Handle[Any], payload: Payload, block: bool, timeout: float | None,
        headers: Headers | None = None, delay: float | None = None, ttl: float | None = None,
        priority: int = 0) -> Request[int]:
    """One message; the result is its offset.  With headers, a delay, a TTL or a priority: a
    flagged PRODUCE (``producing``)."""
    if type(payload) is not bytes:
        payload = bytes(as_bytes(payload))
    meta = _headers.encode(headers) if headers is not None else b""
    ms = delay_ms(delay) if delay is not None else 0
    tms = ttl_ms(ttl, ms) if ttl is not None else 0
    if priority:
        check_priority(priority, options.MAX_PRIORITIES, q.name)  # (the broker checks the queue's levels)
    if not (meta or ms or tms or priority):
        return Request(produce_frame, (q.name_bytes, timeout_ms(block, timeout), payload), _pick, _OFFSET)
    fields = {"queue": q.name, "timeout_ms": timeout_ms(block, timeout),
              "payload": meta + payload if meta else payload}
    return Request(_produce_frame, (T.PRODUCE, fields, _headers.FLAG if meta else 0, ms, tms, priority),
                   _pick, _OFFSET)


def put_many(q: Handle[Any], payloads: Sequence[Payload], block: bool, timeout: float | None,
             producer: str | None, seq: int | None, headers: Sequence[Headers | None] | None = None,
             delay: float | None = None, ttl: float | None = None, priority: int = 0) -> Command[list[int]]:
    """A batch, atomically (at most once per (producer, seq)); the result is their offsets."""
    ms = delay_ms(delay)
    tms = ttl_ms(ttl, ms)
    if priority:
        check_priority(priority, options.MAX_PRIORITIES, q.name)
    req = produce_request(q.name, payloads, timeout_ms(block, timeout), producer, seq, headers)
    if req is None:
        return Batch([], [], _no_offsets)
    return Request(_produce_frame, (*req, ms, tms, priority), _offsets)


def _offsets(f: Frame, _: Any) -> list[int]:
    r = _fields(f, T.PRODUCE_BATCH_OK)
    return list(range(r["first"], r["first"] + r["count"]))


def _no_offsets(results: list[Any]) -> list[int]:
    return []


def get(q: Handle[M], group: str, block: bool, timeout: float | None,
        visibility_timeout: float | None, ack: Message | None = None) -> Request[M]:
    """Lease one message; with ``ack`` (a lease that ``consuming.rides`` with it), ack that
    first, in the same request."""
    args: tuple[Any, ...] = (q.name_bytes, str.encode(group), timeout_ms(block, timeout),
                             visibility_ms(visibility_timeout))
    if ack is not None:
        args += (ACK_FLAG, lease_suffix(ack.offset, ack.deliveries))
    return Request(consume_frame, args, _delivered, (q, group))


def _delivered(f: Frame, ctx: tuple[Handle[M], str]) -> M:
    if f.type != T.DELIVER:
        _fields(f, T.DELIVER)  # raises
    q, group = ctx
    o, dc, ts, m, p = decode_deliver(f.body)
    return tuple.__new__(q.message_class, (q, 0, group, o, dc, p, m, ts))  # type: ignore[no-any-return]


def get_many(q: Handle[M], max_messages: int, group: str, block: bool, timeout: float | None,
             visibility_timeout: float | None, acks: Sequence[Message] = ()) -> Request[list[M]]:
    """Lease up to ``max_messages`` (at most MAX_BATCH) messages; with ``acks`` (leases that
    ``consuming.rides`` with it), ack those first, in the same request."""
    if max_messages < 1:
        raise InvalidArgument("max_messages must be >= 1")
    fields = {"queue": q.name, "group": group, "max": min(max_messages, options.MAX_BATCH),
              "timeout_ms": timeout_ms(block, timeout), "visibility_ms": visibility_ms(visibility_timeout)}
    if acks:
        return Request(acking_batch_frame, (fields, settles_suffix(list(map(_settle_of, acks)))),
                       _delivered_batch, (q, group))
    return Request(_fields_frame, (T.CONSUME_BATCH, fields), _delivered_batch, (q, group))


def _delivered_batch(f: Frame, ctx: tuple[Handle[M], str]) -> list[M]:
    return _answer_messages(ctx[0], 0, ctx[1], f, T.DELIVER_BATCH)


def read(q: Handle[M], offset: int, max_messages: int) -> Request[list[M]]:
    """Messages from ``offset`` on, not leased."""
    return Request(_fields_frame, (T.READ, {"queue": q.name, "offset": offset, "max": max_messages}),
                   _read, q)


def _read(f: Frame, q: Handle[M]) -> list[M]:
    return _answer_messages(q, -1, None, f, T.READ_OK)


def read_columns(q: Handle[Any], offset: int, max_messages: int) -> Request[RecordColumns]:
    """``read`` as columns (``Queue.read_columns``): a READ (at most ``options.MAX_BATCH``)
    whose READ_OK's columns become arrays and its bytes a view, with no object per record."""
    check_read(offset, max_messages)
    return Request(_fields_frame, (T.READ, {"queue": q.name, "offset": offset,
                                            "max": min(max_messages, options.MAX_BATCH)}), _read_columns)


def _read_columns(f: Frame, _: Any) -> RecordColumns:
    if f.type != T.READ_OK:
        _fields(f, T.READ_OK)  # raises
    return RecordColumns(*records_arrays(f.body))


def put_joined(q: Handle[Any], batch: Joined, block: bool, timeout: float | None, producer: str | None,
               seq: int | None, priority: int = 0) -> Request[int]:
    """``Queue.put_joined``: one PRODUCE_BATCH (PRODUCE_IDEMPOTENT with ``producer``) made of
    the lengths and the bytes (``produce.joined_request``), with its priority prefix when it
    has one; the result is the first offset."""
    type_, body = joined_request(q.name, batch, timeout_ms(block, timeout), producer, seq)
    if not priority:
        return Request(joined_frame, (type_, body), _pick, (T.PRODUCE_BATCH_OK, "first"))
    check_priority(priority, options.MAX_PRIORITIES, q.name)
    status, body = prefixed(0, body, 0, 0, priority)
    return Request(joined_frame, (type_, body, status), _pick, (T.PRODUCE_BATCH_OK, "first"))


def _ack_frame(msg_id: int, queue: bytes, group: bytes, offset: int, deliveries: int) -> bytes:
    return settle_frame(T.ACK, msg_id, queue, group, offset, deliveries)


def settle(q: Handle[Any], msg: Message, action: Settle, arg: float | None) -> Request[None]:
    """Settle one lease: ack, nack (``arg``: the delay), touch (``arg``: the visibility
    timeout) or dead-letter."""
    group = msg.group
    if group is None:
        raise StaleAck(f"message {msg.offset} was read, not leased: it cannot be settled")
    if action == Settle.ACK:
        return Request(_ack_frame, (q.name_bytes, str.encode(group), msg.offset, msg.deliveries), _pick,
                       _ACKED)
    lease = {"queue": q.name, "group": group, "offset": msg.offset, "deliveries": msg.deliveries}
    if action == Settle.NACK:
        return call(T.NACK, T.NACK_OK, delay_ms=nack_delay_ms(arg or 0.0), **lease)
    if action == Settle.TOUCH:
        return call(T.TOUCH, T.TOUCH_OK, visibility_ms=visibility_ms(arg), **lease)
    return call(T.DEAD_LETTER, T.DEAD_LETTER_OK, **lease)


def ack_many(q: Handle[Any], messages: Iterable[Message], wait: bool) -> Batch[None]:
    """Ack many leases: one ACK_RANGE when they are one run, else one ACK_BATCH per group
    (``batch_acks``), pipelined; ``wait=False``: their NO_REPLY kinds.  Raises StaleAck,
    with ``.stale`` the offsets, if some were stale (the others are applied); a message
    of another queue is stale here at once (``shmq.api.own_leases``)."""
    msgs, stale, total = own_leases(q, messages)
    combine = partial(_raise_stale, stale, total)
    if not wait:
        return Batch(ack_batch_nowait_frames(q.name, msgs), [], combine)
    return Batch([], [call(kind, T.ACK_BATCH_OK, "stale", queue=q.name, **fields)
                      for kind, fields in batch_acks(msgs)], combine)


def _raise_stale(stale: list[int], total: int, results: list[list[int]]) -> None:
    stale = stale + [off for r in results for off in r]
    if stale:
        raise StaleAck.of_batch(stale, total)


def purge(q: Handle[Any]) -> Request[int]:
    return call(T.PURGE, T.PURGE_OK, "purged", queue=q.name)


def stats(q: Handle[Any]) -> Request[dict[str, Any]]:
    return call(T.STATS, T.STATS_OK, "stats", queue=q.name)


# ---------------------------------------------------------------- push mode
def unsubscribe(sub_id: int) -> Request[None]:
    return call(T.UNSUBSCRIBE, T.UNSUBSCRIBE_OK, subscription=sub_id)


def give_back(queue: str, group: str, leases: Iterable[Sequence[int]]) -> Batch[None]:
    """NACKs (no delay) of leases, as (offset, deliveries), received and never handed out;
    a stale one is ignored."""
    return Batch([], [Request(_fields_frame, (T.NACK, {"queue": queue, "group": group, "offset": o,
                                                       "deliveries": dc, "delay_ms": 0}), _ignore)
                      for o, dc, *_ in leases], _no_result)


def _no_result(results: list[Any]) -> None:
    return None


def unclaimed(request: Request[Any], f: Frame) -> Batch[None]:
    """What gives back the leases of ``f``, the answer to ``request`` that nobody took (its
    caller was cancelled): nothing unless it leased messages."""
    if f.type not in LEASES:
        return Batch([], [], _no_result)
    q, group = request.ctx
    return give_back(q.name, group, zip(*pushed_records(f)[:2], strict=True))


__all__ = ["LEASES", "Batch", "Command", "Handle", "ack_batch_nowait_frames", "ack_many", "ack_nowait_frame",
           "batch_acks", "batch_payloads", "call", "create_queue", "nack_delay_ms",
           "delete_queue", "disconnect", "get", "get_many", "give_back", "handshake", "info",
           "list_queues", "produce_request", "purge", "pushed_messages", "pushed_records", "put",
           "put_joined", "put_many", "read", "read_columns", "seconds_to_ms", "settle",
           "settles_by_group", "stats", "timeout_ms", "unclaimed",
           "unsubscribe", "visibility_ms"]
