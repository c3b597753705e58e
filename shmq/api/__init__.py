"""The interface every transport implements: Broker, Queue, Message.

``shm://`` (``shmq.core.colocated``) implements it over shared memory; ``tcp://``
implements the same methods over the wire protocol.  Tests run one suite
against both.
"""

from __future__ import annotations

import inspect
import json
import re
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from operator import itemgetter
from types import FunctionType
from typing import Any, TypeVar

from shmq import headers as _headers
from shmq import options
from shmq.api import reply as _reply
from shmq.api.publisher import Publisher
from shmq.errors import InvalidArgument, QueueExists, QueueNotFound
from shmq.joined import Joined
from shmq.seektime import Start, When
from shmq.settle import Settle

Payload = bytes | bytearray | memoryview | str
Headers = Mapping[str, str | bytes]  # a message's headers, as put takes them (shmq.headers)
_C = TypeVar("_C")


def as_bytes(payload: Payload) -> bytes | bytearray | memoryview:
    """A payload as bytes-like (a str is UTF-8 encoded); ``InvalidArgument`` otherwise."""
    if isinstance(payload, str):
        return payload.encode()
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return payload
    raise InvalidArgument(f"payload must be bytes-like or str, not {type(payload).__name__}")


def check_producer(producer: str | None, seq: int | None) -> bool:
    """Check an idempotent producer's (id, sequence); True when the put is idempotent."""
    if producer is None and seq is None:
        return False
    if not isinstance(producer, str) or not 1 <= len(producer) <= options.PRODUCER_ID_MAX:
        raise InvalidArgument(f"producer must be a string of 1-{options.PRODUCER_ID_MAX} chars "
                              "(and goes with seq)")
    if type(seq) is not int or not 1 <= seq < 1 << 63:
        raise InvalidArgument("seq must be an int in 1 .. 2**63-1 (and goes with producer)")
    return True


def delay_ms(delay: float | None) -> int:
    """A put's ``delay`` (seconds) in whole ms; 0 for none.  A negative, NaN or too large
    one (past ``options.MAX_DELAY``) is :class:`InvalidArgument`."""
    if delay is None:
        return 0
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not 0 <= delay <= options.MAX_DELAY:
        raise InvalidArgument(f"delay must be a number of seconds in [0, {options.MAX_DELAY:g}]")
    return round(delay * 1000)


def ttl_ms(ttl: float | None, delay: int = 0) -> int:
    """A put's own ``ttl`` (seconds) in whole ms, at least 1; 0 for none.  Not a number, not
    above 0, past ``options.MAX_MESSAGE_TTL``, or not longer than the put's ``delay`` (in
    ms: the message would expire before it is due) is :class:`InvalidArgument`."""
    if ttl is None:
        return 0
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= options.MAX_MESSAGE_TTL:
        raise InvalidArgument(f"ttl must be a number of seconds in (0, {options.MAX_MESSAGE_TTL:g}]")
    ms = max(1, round(ttl * 1000))
    if ms <= delay:
        raise InvalidArgument(f"ttl ({ms} ms) must be longer than the delay ({delay} ms): the message "
                              "would expire before it is due")
    return ms


def check_priority(priority: object, levels: int, name: str) -> int:
    """A put's priority for a queue of ``levels`` priority levels (0 for a plain queue): an
    int in 0 .. levels-1, else ``InvalidArgument``."""
    if priority.__class__ is not int or not 0 <= priority < max(levels, 1):  # type: ignore[operator]
        if levels < 2 and priority.__class__ is int:
            raise InvalidArgument(f"queue {name!r} has no priorities (create it with priorities=N): "
                                  f"priority must be 0, not {priority!r}")
        raise InvalidArgument(f"priority must be an int in 0..{max(levels, 1) - 1} for queue {name!r}, "
                              f"not {priority!r}")
    return priority  # type: ignore[return-value]


@dataclass(frozen=True)
class QueueConfig:
    """The limits a queue is created with (``create_queue`` keyword arguments)."""

    capacity: int = options.DEFAULT_CAPACITY
    max_bytes: int = options.DEFAULT_MAX_BYTES
    max_message_size: int = options.DEFAULT_MAX_MESSAGE_SIZE
    visibility_timeout: float = options.DEFAULT_VISIBILITY_TIMEOUT
    max_deliveries: int = options.DEFAULT_MAX_DELIVERIES
    max_groups: int = options.DEFAULT_MAX_GROUPS
    durability: str = options.DEFAULT_DURABILITY
    message_ttl: float = 0.0  # seconds a message may wait for its first delivery to a group (0: forever)
    expired_to_dlq: bool = True  # an expired message is dead-lettered (reason "ttl_expired"); False: dropped
    replication: str = ""  # to a standby: "sync", "async", or "": the broker's --replication
    priorities: int = 0  # levels of priority, 2..MAX_PRIORITIES (0 or 1: none): put(priority=0..N-1)


@dataclass(frozen=True)
class QueueInfo:
    name: str
    is_dlq: bool
    config: QueueConfig


@dataclass(frozen=True)
class BrokerInfo:
    """What ``broker.info()`` says about the broker (an INFO request over the wire).

    ``pid`` and ``uptime`` are the instance's owner's: ``shmq serve``'s supervisor when a
    broker serves it, else the process that created it; None when that process is gone.
    ``clients`` are the pids in the instance's client table: the live processes that
    have leased or maintained a queue there (consumers over ``shm://``, a broker's
    workers and supervisor); a process that only produces has none.  ``workers``,
    ``connections`` (served by each
    worker now) and ``worker`` (the one that answered) are None over ``shm://``: there is
    no worker pool there.  ``replies_dropped``: the replies dropped in the instance so far,
    by reason (``late``, ``gone``, ``full``: ``shmq.api.reply``); None from an older broker."""

    version: str
    instance: str
    pid: int | None
    uptime: float | None  # seconds
    clients: list[int]
    workers: int | None = None
    connections: list[int] | None = None
    worker: int | None = None
    replies_dropped: dict[str, int] | None = None  # by reason, the instance's (``shmq.api.reply``)
    # replication (``shmq serve --replica-of``): ``role`` ("primary"/"standby"), ``epoch``, ``port``
    # (the primary's replication port), ``standbys`` (each with its lag) or ``primary`` (a
    # standby's, with ``lag_*`` and ``caught_up``); None over shm://
    replication: dict[str, Any] | None = None

    @classmethod
    def of(cls, d: dict[str, Any]) -> BrokerInfo:
        """From an INFO_OK's object (fields a newer broker adds are left out)."""
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class Origin:
    """Where a dead-lettered message came from."""

    queue: str
    offset: int
    group: str
    reason: str
    deliveries: int


class Message(tuple):  # type: ignore[type-arg]
    """One delivered (or read) message.

    ``ack()``, ``nack(delay)``, ``touch()`` and ``dead_letter()`` settle the
    delivery.  They are valid while this delivery's lease is held, and raise
    ``StaleAck`` once it is not (settled already, or it expired and the message
    was taken back).  A message from ``read()`` is not a lease.

    A tuple underneath, so that building one costs little on the hot path:
    ``(queue handle, group index, group, offset, deliveries, payload, meta, timestamp_ns)``.
    """

    __slots__ = ()

    queue_handle = property(itemgetter(0), doc="the queue handle it was delivered (or read) through")
    group_ref = property(itemgetter(1), doc="its group as the transport that leased it knows it "
                                             "(negative: read, not leased)")
    group = property(itemgetter(2), doc="the group it was delivered to (None for read())")
    offset = property(itemgetter(3), doc="the message's 64-bit offset in its queue")
    deliveries = property(itemgetter(4), doc="1 on first delivery, +1 on each redelivery")
    payload = property(itemgetter(5), doc="bytes")
    meta = property(itemgetter(6), doc="metadata bytes: the header block, then a dead letter's origin")
    timestamp_ns = property(itemgetter(7), doc="producer's wall clock, ns since the epoch")

    @property
    def queue(self) -> str:
        """The name of the queue it was delivered (or read) from."""
        return str(self.queue_handle.name)

    @property
    def priority(self) -> int:
        """Its priority in a priority queue (``create_queue(priorities=N)``: the level its
        offset names), 0 in any other queue."""
        return int(self[3] >> options.PRIORITY_SHIFT)

    @property
    def timestamp(self) -> float:
        """Producer's wall-clock time, seconds since the epoch."""
        return self.timestamp_ns / 1e9

    @property
    def redelivered(self) -> bool:
        """True when it was delivered before (to this group): ``deliveries > 1``."""
        return self.deliveries > 1

    @property
    def text(self) -> str:
        """The payload decoded as UTF-8 (``UnicodeDecodeError`` when it is not)."""
        return bytes(self.payload).decode()

    @property
    def headers(self) -> Mapping[str, bytes]:
        """The message's headers, read-only: ``str`` keys, ``bytes`` values (empty: none)."""
        dec = _headers.decode_c  # headers.decode's compiled part, called here at once
        if dec is not None:
            h = dec(self.meta, _headers.EMPTY)
            if h is not None:
                return h  # type: ignore[no-any-return]
        return _headers.decode(self.meta)

    @property
    def origin(self) -> Origin | None:
        """For a message in a dead-letter queue: where it came from."""
        meta = self.meta
        if meta and meta[0] == _headers.TAG:
            meta = meta[len(_headers.block_of(meta)):]
        if not meta:
            return None
        d = json.loads(meta)
        return Origin(d["queue"], d["offset"], d["group"], d["reason"], d["deliveries"])

    def ack(self, wait: bool = True) -> None:
        """Acknowledge: the message is done with.  ``wait=False`` returns without waiting
        for the broker's answer (over TCP: no round trip; the broker applies acks in
        order, before anything this connection sends next; the frame leaves with the
        connection's next request, its close, or within about 200 ms) or for the journal (an
        ``always`` queue); a stale ack may then go unreported (over TCP it is kept in
        ``broker.nowait_errors``), and an ack lost with the connection means the message
        is delivered again: at-least-once either way."""
        if wait:
            self[0]._ack(self)  # (self.queue_handle, indexed: the hot path of a co-located consumer)
        else:
            self[0]._ack_nowait(self)

    def nack(self, delay: float = 0.0) -> None:
        """Give the message back; it is delivered again after ``delay`` seconds (at once by
        default), its ``deliveries`` one more; once it has had the queue's ``max_deliveries``
        it goes to the dead-letter queue instead.  ``StaleAck`` once the lease is not held."""
        self.queue_handle._settle(self, Settle.NACK, delay)

    def touch(self, visibility_timeout: float | None = None) -> None:
        """Extend the lease by the visibility timeout (or the given seconds) from now.
        ``StaleAck`` once the lease is not held."""
        self.queue_handle._settle(self, Settle.TOUCH, visibility_timeout)

    def dead_letter(self) -> None:
        """Send the message to the dead-letter queue (``<queue>.dlq``) now.  ``StaleAck`` once
        the lease is not held; ``InvalidArgument`` for a message of a dead-letter queue."""
        self.queue_handle._settle(self, Settle.DEAD, 0.0)

    def reply(self, payload: Payload, headers: Headers | None = None) -> bool:
        """Answer a request (``Broker.request``): put ``payload`` to its ``reply-to`` queue
        with its ``correlation-id``, without waiting.  False when the reply was dropped (the
        requester is gone, or its reply queue is full; counted in ``shmq.api.reply.stats()``).
        ``InvalidArgument`` (nothing sent) for a message that is no request.  This does not
        settle the request: ack it as any message."""
        name, h = _reply.reply_target(self.meta, headers)
        return _reply.send_reply(self.queue_handle, name, payload, h)

    def __repr__(self) -> str:
        return (f"Message(queue={self.queue!r}, offset={self.offset}, group={self.group!r}, "
                f"deliveries={self.deliveries}, payload={bytes(self.payload[:32])!r})")

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


_handle_of = itemgetter(0)  # Message.queue_handle, at C speed


def own_leases(q: Any, messages: Iterable[Message]) -> tuple[list[Message], list[int], int]:
    """Split ``ack_many``'s messages (every client): those ``q`` may settle, the offsets
    of the others (stale here, known at once and never applied: a lease is known by
    queue, group, offset and delivery count, so another queue's could match one of
    ``q``'s), and how many there were.  ``q`` settles what was delivered through it, or
    through another handle of the same queue on the same connection (``broker``: a TCP client
    makes a handle per ``broker.queue`` call; a shared-memory handle has no ``broker``, and
    its attachment keeps one handle per queue, so there it is ``q`` alone)."""
    msgs = list(messages)
    handles = set(map(_handle_of, msgs))  # the usual case: one, q itself, checked at C speed
    if handles <= {q}:
        return msgs, [], len(msgs)
    conn = getattr(q, "broker", None)
    mine = {h for h in handles if h is q or (conn is not None and getattr(h, "broker", None) is conn
                                             and h.name == q.name)}
    return ([m for m in msgs if m.queue_handle in mine],
            [m.offset for m in msgs if m.queue_handle not in mine], len(msgs))


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """Retained records of one queue as columns (``Queue.read_columns``): no object per record.

    ``offsets``: ascending, possibly with gaps (a ``range`` where they are consecutive, else
    an ``array("Q")``); ``stamps``: each producer's wall clock, ns since the epoch
    (``array("Q")``); ``meta_lens`` and ``payload_lens``: ``array("I")``; ``data``: each
    record's metadata (``Message.meta``: its header block, then a dead letter's origin) and
    then its payload, back to back.  The arrays are in native byte order, so numpy can see
    them without a copy (``numpy.frombuffer``)."""

    offsets: Sequence[int]
    stamps: array[int]
    meta_lens: array[int]
    payload_lens: array[int]
    data: bytes | bytearray | memoryview

    def __len__(self) -> int:
        return len(self.payload_lens)

    @classmethod
    def empty(cls, at: int = 0) -> RecordColumns:
        """No records (a read from ``at`` found none)."""
        return cls(range(at, at), array("Q"), array("I"), array("I"), b"")

    @classmethod
    def of(cls, msgs: Sequence[Message]) -> RecordColumns:
        """The records of messages already read (one object each: the slow path)."""
        metas = [m.meta or b"" for m in msgs]
        payloads = [m.payload for m in msgs]
        return cls(array("Q", [m.offset for m in msgs]), array("Q", [m.timestamp_ns for m in msgs]),
                   array("I", map(len, metas)), array("I", map(len, payloads)),
                   b"".join([x for pair in zip(metas, payloads, strict=True) for x in pair]))


def check_read(offset: int, max_messages: int) -> None:
    """A read's range: ``InvalidArgument`` unless ``offset >= 0`` and ``max_messages >= 1``."""
    if max_messages < 1 or offset < 0:
        raise InvalidArgument("offset must be >= 0 and max_messages >= 1")


def check_joined(batch: Joined) -> None:
    """A joined batch (``Queue.put_joined``): ``InvalidArgument`` when it is empty or its
    lengths do not add up to its bytes."""
    if not len(batch) or sum(batch.lens) != len(batch.data):
        raise InvalidArgument(f"{len(batch.data)} bytes for {len(batch)} payloads of {sum(batch.lens)}")


def shares_docs(iface: type) -> Callable[[type[_C]], type[_C]]:
    """A class decorator, so that ``help(q.put)`` explains the call on every client: each
    public method of the class with no docstring of its own takes the one of ``iface``'s
    method of that name (the asyncio clients, which do not derive from the interface; a
    mixin, whose methods ``inspect.getdoc`` looks up in its own bases only); one whose
    docstring starts by naming it on a queue or broker class (````Queue.put``: retried ...``,
    ````AsyncQueue.get``: ...``) is a note on that call, and gets the interface's after it."""
    def share(cls: type[_C]) -> type[_C]:
        for name, f in vars(cls).items():
            theirs = getattr(getattr(iface, name, None), "__doc__", None)
            if name.startswith("_") or not isinstance(f, FunctionType) or not theirs:
                continue
            mine = f.__doc__
            if not mine:
                f.__doc__ = theirs
            elif re.match(rf"``(shmq\.)?\w*{iface.__name__}\.{name}``", mine):
                f.__doc__ = f"{inspect.cleandoc(mine)}\n\n{inspect.cleandoc(theirs)}"
        return cls
    return share


def group_as_block(call: str, block: object) -> TypeError:
    """The error of a ``get`` or ``get_many`` given a group name where ``block`` goes (the
    order before ``block`` and ``timeout`` came first, as in ``queue.Queue.get``)."""
    fix = f"get(group={block!r})" if call == "get" else f"get_many(max_messages, group={block!r})"
    return TypeError(f"{call}(): group is keyword-only (block and timeout come first, as in "
                     f"queue.Queue.get): use {fix}")


class Queue(ABC):
    """A queue of a broker (``broker.create_queue`` or ``broker.queue``): the same methods on
    every transport (``shm://``, ``tcp://``, a fail-over list; ``shmq.aio``'s are awaitable).

    Producing: ``put``, ``put_many``, ``put_nowait``.  Consuming, in consumer groups (the
    default group, ``options.DEFAULT_GROUP``, always exists): ``get``, ``get_many``,
    ``get_nowait`` lease messages, which are then settled (``Message.ack`` and its kin,
    ``ack_many``).  Replay: ``read``.  Groups: ``create_group``, ``seek``, ``commit``,
    ``delete_group``, ``groups``.  ``get``'s ``block`` and ``timeout`` come first, as in
    ``queue.Queue``; the group is a keyword: ``q.get(False)``, ``q.get(timeout=1.0,
    group="billing")``.

    Errors are :class:`shmq.ShmqError` subclasses: ``Full`` and ``Empty`` are also
    ``queue.Full`` and ``queue.Empty``.  Every method may raise ``QueueNotFound`` once the
    queue was deleted, and over TCP ``ConnectionLost`` (``NotPrimary`` from a standby)."""

    name: str

    @abstractmethod
    def put(self, payload: Payload, block: bool = True, timeout: float | None = None, *,
            headers: Headers | None = None, delay: float | None = None, ttl: float | None = None,
            priority: int = 0) -> int:
        """Append one message; its offset in the queue (64-bit, from 0, one per message).

        ``payload``: bytes-like, or a ``str`` (stored UTF-8 encoded).  When the queue is full
        (its ``capacity`` messages or ``max_bytes`` bytes retained), wait for room: for ever
        (``block=True``, ``timeout=None``), at most ``timeout`` seconds, or not at all
        (``block=False``, as ``put_nowait``).  ``headers``: a mapping of ``str`` to ``str``
        or bytes (``shmq.headers``).  ``delay``: seconds before any group may have it (stored
        now; messages put later may be delivered first).  ``ttl``: seconds from now within
        which a group must get it, else it expires for that group, as with the queue's
        ``message_ttl`` (the shorter of the two counts); longer than ``delay``.  ``priority``:
        in a queue made with ``priorities=N``, 0 (the lowest, the default) .. N-1: the highest
        priority ready is delivered first, FIFO within one; its offset then names the level
        in its top bits (``Message.priority``).  Any other queue takes only 0.

        Raises ``Full`` (no room in time), ``MessageTooLarge`` (payload and headers above
        the queue's ``max_message_size``), ``InvalidArgument`` (a bad payload type, timeout,
        delay, ttl or headers), ``StorageError`` (a durable queue's journal cannot be
        written), ``QueueNotFound``."""

    @abstractmethod
    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None, headers: Sequence[Headers | None] | None = None,
                 delay: float | None = None, ttl: float | None = None, priority: int = 0) -> list[int]:
        """Append a batch atomically (all or none, in order); their offsets.

        ``block`` and ``timeout``: as ``put``'s, waiting for room for the whole batch.  With
        ``producer`` (an id of 1-``options.PRODUCER_ID_MAX`` chars) and ``seq`` (1 up), at
        most once per (producer, seq): a sequence not above the last one that producer wrote
        raises ``Duplicate`` and writes nothing.  ``headers``: one mapping (or None) per
        payload.  ``delay``, ``ttl``, ``priority``: as for ``put``, for each.

        Raises ``Full`` (no room in time, or a batch that can never fit), ``Duplicate``,
        ``MessageTooLarge``, ``InvalidArgument``, ``StorageError``, ``QueueNotFound``."""

    def put_nowait(self, payload: Payload, *, headers: Headers | None = None, delay: float | None = None,
                   ttl: float | None = None, priority: int = 0) -> int:
        """``put(payload, block=False, ...)``, as ``queue.Queue.put_nowait``: append one message
        if there is room now; its offset.  Raises ``Full`` at once when there is none, and
        otherwise what ``put`` raises."""
        return self.put(payload, False, headers=headers, delay=delay, ttl=ttl, priority=priority)

    @abstractmethod
    def get(self, block: bool = True, timeout: float | None = None, *, group: str = options.DEFAULT_GROUP,
            visibility_timeout: float | None = None, ack: Message | None = None) -> Message:
        """Lease one message of ``group`` (the default group unless named; a group named for
        the first time is created, at the earliest retained message): a :class:`Message`,
        delivered to no other consumer of the group until it is settled
        (``msg.ack()``, ``nack``, ``dead_letter``) or its lease expires after
        ``visibility_timeout`` seconds (default: the queue's), when it is delivered again.

        When there is none, wait: for ever (``block=True``, ``timeout=None``), at most
        ``timeout`` seconds, or not at all (``block=False``, as ``get_nowait``), as
        ``queue.Queue.get``.  ``group`` is keyword-only: ``get("billing")`` is a TypeError
        (``get(group="billing")``).  ``ack``: a message to acknowledge first, as
        ``ack.ack()`` would (``StaleAck``, and nothing got, when its lease is not held);
        over TCP a lease of this queue and group goes in the same request, so a consumer
        that acks each message before the next costs one round trip per message, not two.

        Raises ``Empty`` (nothing in time), ``StaleAck`` (``ack``), ``InvalidArgument`` (a
        negative timeout, a visibility timeout out of range), ``InvalidName`` (the group's),
        ``LimitExceeded`` (a new group past the queue's ``max_groups``), ``QueueNotFound``."""

    @abstractmethod
    def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                 group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                 ack: Iterable[Message] = ()) -> list[Message]:
        """Lease up to ``max_messages`` messages of ``group`` at once (at least one; fewer
        when fewer are ready, over TCP at most ``options.MAX_BATCH``): ``get``'s, waiting
        as ``block`` and ``timeout`` say for the first one only.  ``group`` is keyword-only.
        ``ack``: messages to acknowledge first, as ``ack_many(ack)`` would (``StaleAck`` and
        nothing got when some were stale; the others are applied); over TCP in the same
        request, as ``get``'s.

        Raises ``Empty``, ``StaleAck``, ``InvalidArgument`` (``max_messages`` below 1, a bad
        timeout), ``InvalidName``, ``LimitExceeded``, ``QueueNotFound``."""

    def get_nowait(self, *, group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                   ack: Message | None = None) -> Message:
        """``get(block=False, ...)``, as ``queue.Queue.get_nowait``: lease a message of
        ``group`` that is ready now.  Raises ``Empty`` at once when there is none, and
        otherwise what ``get`` raises."""
        return self.get(False, group=group, visibility_timeout=visibility_timeout, ack=ack)

    @abstractmethod
    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        """Acknowledge many messages at once.  Raises ``StaleAck`` (``.stale``: their
        offsets) if some leases were no longer held; the others are applied.
        ``wait=False``: as ``Message.ack(wait=False)``, for the whole batch (over TCP one
        ACK_BATCH_NO_REPLY frame that rides with the next request; stale ones are reported
        in ``broker.nowait_errors``, not raised).  A message delivered from another queue
        is stale here, raised at once on every transport: it never settles this queue's
        delivery of the same offset."""

    @abstractmethod
    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        """Replay: up to ``max_messages`` retained messages from ``max(offset, the first
        retained)`` on, in order, without leasing them (no group sees a difference; they
        cannot be settled).  An empty list past the last one.  Raises ``InvalidArgument``
        (``offset`` below 0, ``max_messages`` below 1), ``QueueNotFound``."""

    def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        """``read`` as columns (:class:`RecordColumns`), with no object per record: the
        retained records from ``max(offset, first retained)`` on, not leased.  At most
        ``max_messages``, and fewer where one answer would grow too big (over TCP a frame and
        ``options.MAX_BATCH``, co-located 64 MiB), but at least one when one is retained there.
        This default makes them of ``read``'s messages; the transports read columns."""
        check_read(offset, max_messages)
        return RecordColumns.of(self.read(offset, min(max_messages, options.MAX_BATCH)))

    def iter_columns(self, start: int, end: int) -> Iterator[RecordColumns]:
        """The retained records of ``[start, end)``, as ``read_columns`` gives them one read
        at a time (a gap shows as a first offset past where that read began; the last read
        may go past ``end`` after one), until a read gives nothing, which is given too, or
        reaches ``end``.  Over TCP the next read is asked before this one's answer is used."""
        while start < end:
            c = self.read_columns(start, end - start)
            yield c
            if not len(c):
                return
            start = c.offsets[-1] + 1

    def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                   producer: str | None = None, seq: int | None = None, priority: int = 0) -> int:
        """``put_many`` of payloads given back to back (``shmq.joined.Joined``: their lengths
        and their bytes), atomically and, with ``producer`` and ``seq``, at most once per
        (producer, seq), at ``priority`` (as ``put``'s); its first offset.  The errors of ``put_many``, and
        ``InvalidArgument`` for an empty batch or lengths that do not add up to the bytes.
        This default puts ``batch.payloads()``; the transports put the bytes as they are."""
        check_joined(batch)
        return self.put_many(batch.payloads(), block, timeout, producer=producer, seq=seq,
                             priority=priority)[0]

    @abstractmethod
    def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        """Create consumer group ``name``: it gets every message from ``start`` on, each
        once, independently of the queue's other groups.  ``start``: ``"earliest"`` (the
        default: the earliest message the queue retains, so the messages already there are
        delivered too), ``"latest"`` (only the messages produced from now on), or a time
        (seconds since the epoch, or a datetime with a timezone: the first retained message
        produced at or after it).

        Raises ``GroupExists`` (a ``QueueExists``) when the queue has a group of that name,
        unless ``exist_ok=True``: then the group is left as it is (its position and leases
        unchanged; ``start`` is not applied).  Also ``InvalidName``, ``InvalidArgument``
        (a bad ``start``), ``LimitExceeded`` (the queue's ``max_groups``), ``QueueNotFound``."""

    @abstractmethod
    def seek(self, group: str, when: When) -> int:
        """Move ``group`` to the first retained message produced at or after ``when``
        (seconds since the epoch, or a datetime with a timezone); that offset.  Below it
        every message is settled for the group (as ``commit``); from it on the retained ones
        are delivered again (docs/operations.md, "Seek by time").  Raises
        ``GroupNotFound``, ``InvalidArgument``, ``QueueNotFound``."""

    @abstractmethod
    def delete_group(self, name: str) -> None:
        """Delete consumer group ``name``: its leases turn stale, and the messages only it
        still held are freed.  Raises ``GroupNotFound``, ``InvalidArgument`` (the default
        group cannot be deleted), ``QueueNotFound``."""

    @abstractmethod
    def groups(self) -> list[str]:
        """The names of the queue's consumer groups (the default group among them).
        Raises ``QueueNotFound``."""

    @abstractmethod
    def commit(self, group: str, offset: int) -> None:
        """Settle every message of ``group`` below ``offset``, whatever its state (a
        consumer-managed position, as Kafka's commit: a lease on one of them turns stale);
        the group goes on from ``offset``.  Raises ``GroupNotFound``, ``InvalidArgument``
        (a negative offset), ``QueueNotFound``."""

    @abstractmethod
    def purge(self) -> int:
        """Drop every retained message, for every group (their leases turn stale); the
        number dropped.  Raises ``QueueNotFound``."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """The queue's numbers, as a dict: ``retained``, ``bytes_used``, ``capacity``,
        ``max_bytes``, ``first_offset``, ``next_offset``, ``fill`` (0 to 1), ``config``, and
        under ``groups`` each group's (``depth``, ``ready``, ``in_flight``, ``cursor``,
        ``acked``, ...); ``shmq stats`` prints them.  Raises ``QueueNotFound``."""

    @abstractmethod
    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None: ...

    @abstractmethod
    def _reply_queue(self, name: str) -> Queue:
        """A handle of reply queue ``name`` on this one's broker (``Message.reply``)."""

    def _ack(self, msg: Message) -> None:
        self._settle(msg, Settle.ACK, 0.0)

    def _ack_nowait(self, msg: Message) -> None:
        self._ack(msg)

    def _reply_dropped(self, what: str) -> None:  # noqa: B027 (a hook: nothing to do by default)
        """A reply dropped through this handle (``shmq.api.reply``): a co-located queue counts
        it in its instance's registry; over TCP the worker counts its own."""

    def publisher(self, window: int = options.DEFAULT_PUBLISH_WINDOW, block: bool = True,
                  timeout: float | None = None) -> Publisher:
        """A producer that does not wait for each put's confirmation: see :class:`Publisher`."""
        return Publisher(self, window, block, timeout)

    @abstractmethod
    def _publish(self, payload: Payload, block: bool, timeout: float | None, headers: Headers | None = None,
                 delay: float | None = None, ttl: float | None = None) -> Any:
        """Start one put and return a token for :meth:`_confirm` (a Publisher's half of put)."""

    @abstractmethod
    def _confirm(self, token: Any) -> int:
        """Wait until the put behind ``token`` is confirmed as ``put()`` would confirm it;
        return its offset or raise what ``put()`` would have raised."""

    @abstractmethod
    def _publish_many(self, payloads: Sequence[Payload], block: bool, timeout: float | None,
                      headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                      ttl: float | None = None) -> Any:
        """Start one put_many of a batch that is not empty; a token for :meth:`_confirm_many`."""

    @abstractmethod
    def _confirm_many(self, token: Any) -> list[int]:
        """:meth:`_confirm` of a batch: its offsets, or what ``put_many()`` would have raised."""


class Broker(ABC):
    """A broker handle (``shmq.connect(url)``): makes, finds and deletes queues.  Close it
    when done (``close()``, or ``with shmq.connect(...) as broker:``).  Errors are
    :class:`shmq.ShmqError` subclasses; over TCP any call may raise ``ConnectionLost``."""

    url: str

    @abstractmethod
    def create_queue(self, name: str, **limits: Any) -> Queue:
        """Create queue ``name``; a :class:`Queue` handle on it.  ``limits``: the fields of
        :class:`QueueConfig` (``capacity``, ``max_bytes``, ``max_message_size``,
        ``visibility_timeout``, ``max_deliveries``, ``max_groups``, ``durability``,
        ``message_ttl``, ``expired_to_dlq``, ``replication``), each checked against its
        limit in ``shmq.options``.  Over ``shm://`` the queue's shared memory is allocated
        at once (``max_bytes`` and its slots, in /dev/shm) and stays until the queue or the
        instance is deleted.

        Raises ``QueueExists``, ``InvalidName``, ``InvalidArgument`` (an unknown or out of
        range limit), ``LimitExceeded`` (the instance's queues)."""

    @abstractmethod
    def queue(self, name: str) -> Queue:
        """A handle on existing queue ``name``.  Raises ``QueueNotFound`` (the asyncio
        client's, made without a round trip, raises it on first use), ``InvalidName``."""

    @abstractmethod
    def list_queues(self) -> list[QueueInfo]:
        """Every queue of the broker, dead-letter queues too, as :class:`QueueInfo` (name,
        ``is_dlq``, config), by name."""

    @abstractmethod
    def delete_queue(self, name: str) -> None:
        """Delete queue ``name`` and its messages (and its journal); handles on it raise
        ``QueueNotFound`` from then on, and consumers waiting in it wake with that error.
        Raises ``QueueNotFound``, ``InvalidName``."""

    @abstractmethod
    def info(self) -> BrokerInfo:
        """What the broker says about itself: a :class:`BrokerInfo` (version, instance,
        owner pid and uptime, attached clients, workers, replication)."""

    @abstractmethod
    def close(self) -> None:
        """Let go of this handle: over TCP the broker gives this connection's leases back;
        over ``shm://`` the process detaches (the instance and its queues stay: see
        ``shmq.connect``).  Closing twice does nothing."""

    def _reply_dropped(self, what: str) -> None:  # noqa: B027 (a hook: nothing to do by default)
        """A reply dropped by this broker handle's requester: as ``Queue._reply_dropped``."""

    def request(self, queue: str, payload: Payload, timeout: float = options.DEFAULT_REQUEST_TIMEOUT, *,
                headers: Headers | None = None) -> Message:
        """Put ``payload`` to ``queue`` as a request and wait up to ``timeout`` seconds for its
        reply (``Message.reply``), which is returned (it needs no ack: the requester acks
        it); ``Timeout`` when none came in time (a later one is dropped).  Adds the headers
        ``reply-to`` (this handle's reply queue, made on the first request) and
        ``correlation-id``.  Threads may share a broker's requests (``shmq.api.reply``)."""
        r: Message = _reply.requester_of(self).request(queue, payload, timeout, headers)
        return r

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def ensure_queue(broker: Broker, name: str, limits: dict[str, Any], wait: float = 5.0) -> Queue:
    """A handle on queue ``name``, made with ``limits`` unless it exists (the kombu transport's
    and the Dramatiq broker's queues).  Another process making it at the same moment gets
    ``QueueExists`` while the queue may not be found yet (the broker has it registered, not
    yet ready): such a queue is looked for again for up to ``wait`` seconds."""
    try:
        return broker.create_queue(name, **limits)
    except QueueExists:
        pass
    deadline = time.monotonic() + wait
    while True:
        try:
            return broker.queue(name)
        except QueueNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.002)
