"""The queues as the broker's processes use them: never blocking, marks as values.

``shmq serve``'s workers and its journal writer call only what is here (and
``shmq.core.durability``, ``shmq.core.doorbell``, ``shmq.core.readings``: the server's
interface to the core, held by ``tests/test_layering.py``), never a private attribute of a
``shmq`` object.  The registry (for the broker lock, ``shmq.server.brokerlock``) and the
journal's restore (``restore_fill``) are reached through here too.  Two
differences from the public :class:`~shmq.core.queue.ShmQueue` API shape it:

* **Nothing blocks.**  A worker runs an event loop: a put into a full queue
  raises :class:`~shmq.errors.Full` and a poll of an empty one returns ``[]``,
  and the worker parks the request (``shmq.server.parking``).
* **Durable marks are return values.**  On an ``always`` queue a put or a settle
  is confirmed once the journal has it.  Where ``ShmQueue`` would wait, these
  methods return the :class:`~shmq.core.durability.Mark` to wait for (None when there
  is nothing to wait for), and the worker holds its reply until the mark is
  reached (``shmq.server.marks``).

Leases are named as the worker keeps them: (group reference, offset, deliveries),
the reference being ``layout.group_ref`` (group index and serial, so that a lease
of a deleted group is stale even when a group of that name is made again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

from shmq import crashpoints, options
from shmq.api import BrokerInfo, Message, Payload, QueueConfig, QueueInfo, check_priority, check_producer
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.durability import Durability, Mark, Marks
from shmq.core.groups import NACK, OK, TO_DLQ, DeadItem
from shmq.core.handle import _ms
from shmq.core.priority import SHIFT, PriorityQueue, level_of
from shmq.core.queue import ShmQueue
from shmq.core.rawread import read_field
from shmq.core.readings import QueueReading, read_queue
from shmq.core.registry import Registry
from shmq.core.restore import restore_fill
from shmq.core.ring import Ring, producer_key
from shmq.core.segment import registry_name, shm_path
from shmq.errors import Empty, GroupExists, GroupNotFound, InvalidArgument, QueueNotFound, ShmqError, StaleAck
from shmq.headers import Block as HeaderBlock
from shmq.joined import Joined
from shmq.joined import nbytes as batch_bytes
from shmq.settle import Settle

__all__ = ["Block", "Marks", "Registry", "ServerBroker", "ServerPriorityQueue", "ServerQueue",
           "registry_path", "restore_fill"]

Block = tuple[int, list[int], list[int], bytes]  # first offset, timestamps, payload lengths, payloads


def _lease(q: ShmQueue, ref: int, offset: int, deliveries: int) -> Message:
    """A lease as a Message to settle (settling needs no payload)."""
    return tuple.__new__(Message, (q, ref, None, offset, deliveries, b"", b"", 0))



def registry_path(instance: str) -> str:
    """The file of ``instance``'s registry segment in /dev/shm (the broker lock's file)."""
    return shm_path(registry_name(instance))

class ServerQueue:
    """One queue, for a broker process (one per ``ShmQueue`` handle: ``ServerBroker.queue``)."""

    __slots__ = ("_q", "words", "_mm", "name", "queue_id", "durability", "_journaled")

    def __init__(self, q: ShmQueue) -> None:
        self._q = q
        self.words = q.words
        self._mm = q._mm
        self.name = q.name
        self.queue_id: int = q.ring.queue_id
        self.durability: Durability = q.durability
        self._journaled = q._durable

    def __repr__(self) -> str:
        return f"ServerQueue({self.name!r})"

    @property
    def handle(self) -> ShmQueue:
        """The public handle (what a test or a tool would use directly)."""
        return self._q

    @property
    def is_dlq(self) -> bool:
        return self._q.is_dlq

    @property
    def config(self) -> QueueConfig:
        return self._q.config

    @property
    def deleted(self) -> bool:
        return bool(self.words[L.Q_STATE] != L.QS_ACTIVE)

    # ------------------------------------------------------------ produce
    def put(self, payload: Payload, meta: bytes = b"", delay_ms: int = 0, ttl_ms: int = 0, priority: int = 0
            ) -> tuple[int, Mark | None]:
        """Store one message now (``meta``: its header block, checked; ``delay_ms``: when it
        is due; ``ttl_ms``: its own TTL, checked; ``priority``: 0, this is no priority queue):
        (its offset, the mark confirming it).  :class:`Full` when there is no room now."""
        if priority:
            check_priority(priority, 0, self.name)
        if delay_ms or ttl_ms:
            offs, mark = self.put_many([payload], metas=[meta] if meta else None, delay_ms=delay_ms,
                                       ttl_ms=ttl_ms)
            return offs[0], mark
        # (the writer is poked there; a checked block goes through as it is: HeaderBlock)
        hb = HeaderBlock(meta) if meta else None
        off = self._q.put(payload, block=False, wait_durable=False, headers=hb)  # type: ignore[arg-type]
        return off, self.durability.put_mark(off + 1, poke=False) if self._journaled else None

    def put_many(self, payloads: Sequence[Payload], producer: str | None = None,
                 seq: int | None = None, metas: list[bytes] | None = None, delay_ms: int = 0,
                 ttl_ms: int = 0, priority: int = 0) -> tuple[list[int], Mark | None]:
        """Store a batch now, all or none (an idempotent producer's with ``producer`` and
        ``seq``; ``metas``: their header blocks, checked; ``delay_ms``: when they are due;
        ``ttl_ms``: their own TTL; ``priority``: 0): (the offsets, the mark confirming them)."""
        if priority:
            check_priority(priority, 0, self.name)
        if payloads.__class__ is Joined:  # a PRODUCE_BATCH's plain payloads (decode_joined)
            first = self._q.put_joined(payloads, False, producer=producer, seq=seq,  # type: ignore[arg-type]
                                       wait_durable=False)
            offs = list(range(first, first + len(payloads)))
            return offs, self.durability.put_mark(offs[-1] + 1, poke=False) if self._journaled else None
        if len(payloads) == 1 and metas is None and not delay_ms and not ttl_ms and producer is None \
                and seq is None:
            off, mark = self.put(payloads[0])  # one plain message: put's path costs a third of put_many's
            return [off], mark
        if metas is None and not delay_ms and not ttl_ms:
            offs = self._q.put_many(payloads, block=False, producer=producer, seq=seq, wait_durable=False)
        else:
            key = producer_key(producer) if check_producer(producer, seq) else 0  # type: ignore[arg-type]
            offs = self._q._put_metas(list(payloads), metas, False, None, key, seq, False, delay_ms, ttl_ms)
        mark = self.durability.put_mark(offs[-1] + 1, poke=False) if offs and self._journaled else None
        return offs, mark

    def could_fit(self, payloads: Sequence[Payload], metas: list[bytes] | None = None) -> bool:
        """Would this batch fit the queue when empty?  (If not, waiting cannot help.)"""
        return self._q.ring.fits_empty(batch_bytes(payloads) + sum(map(len, metas or ())), len(payloads))

    # ------------------------------------------------------------ deliver
    def group_ref(self, group: str, create: bool = True) -> int:
        """The reference of a group (created if new and ``create``; else
        :class:`GroupNotFound`)."""
        return self._q._group_ref(group, create)

    def group_live(self, ref: int) -> bool:
        """Is the group ``ref`` names still there (not deleted, maybe made again since)?
        Read without a lock: a hint, exact once the delete is done."""
        return self._q.consumer_groups.live(ref) >= 0

    def group_ref_or_none(self, group: str) -> int:
        """The reference of an existing group, -1 when there is none (its leases are stale)."""
        try:
            return self._q._group_ref(group, create=False)
        except GroupNotFound:
            return -1

    def poll(self, group: str, max_n: int, visibility_timeout: float | None = None,
             max_bytes: int = 0) -> list[Message]:
        """``get_many(max_n, block=False)``, for a server that polls often and finds
        nothing as often: an empty list then, not an exception.  ``max_bytes``: stop
        before the payloads and metadata pass it, one message at least (0: no limit).
        The messages are ``(handle, group reference, group, offset, deliveries, payload,
        meta, timestamp_ns)`` tuples."""
        q = self._q
        one = q._take_one(group) if max_n == 1 and visibility_timeout is None else None
        if one is not None:
            m, gi, now = one
            if m is not None:
                return [m]
            w = self.words
            g = q.ring.groups_w + gi * L.G_WORDS
            ne = w[g + L.G_NEXT_EXPIRY]
            if w[q.consumer_groups.tail_word] <= w[g + L.G_CURSOR] and not w[g + L.G_REDELIVER] and (
                    not ne or now < ne):
                return []  # nothing new, nothing to give back, nothing expired
        try:
            return q._take(group, max_n, False, None, visibility_timeout, max_bytes)
        except Empty:
            return []

    def take_block(self, group: str, max_n: int, visibility_timeout: float | None = None,
                   max_bytes: int = 0) -> Block | None:
        """The batch hot path: up to ``max_n`` new messages of ``group`` leased at once, as
        columns (first offset, timestamps, payload lengths, the payloads back to back;
        see ``Groups.deliver_block``), an empty run when there is nothing to deliver.
        None when the general path is needed: then call :meth:`poll`."""
        q = self._q
        if self.words[L.Q_STATE] != L.QS_ACTIVE:
            q._alive()
        ref = q._group_ref(group)
        att = q._att
        owner = att._slot
        if owner is None:
            owner = att.client_slot()
        vis = q._vis if visibility_timeout is None else _ms(visibility_timeout, "visibility_timeout")
        with q.ring.clock:
            gi = q.consumer_groups.live(ref)
            if gi < 0:  # deleted since we looked: the general path looks again
                return None
            return q.consumer_groups.deliver_block(gi, owner, q._now(), max_n, vis, max_bytes)

    # ------------------------------------------------------------ settle
    def ack(self, ref: int, offset: int, deliveries: int) -> Mark | None:
        """Acknowledge a lease (:class:`StaleAck` when it is not held); the mark confirming it."""
        q = self._q
        q._ack(_lease(q, ref, offset, deliveries), wait_durable=False)  # (the writer is poked there)
        return self.durability.settle_mark(poke=False) if self._journaled else None

    def ack_offsets(self, ref: int, offsets: list[int], deliveries: list[int]
                    ) -> tuple[list[int], Mark | Marks | None]:
        """Acknowledge many leases of one group: (the offsets that were stale, the mark
        confirming the others)."""
        q = self._q
        stale: list[int] = []
        with q.ring.clock:
            freed = q.consumer_groups.ack_offsets(ref, offsets, deliveries, stale)
        q._after_acks(freed, len(offsets), wait_durable=False)  # wakes producers, pokes the writer
        return stale, self.durability.settle_mark(poke=False) if self._journaled else None

    def settle(self, ref: int, offset: int, deliveries: int, action: Settle, arg: float | None
               ) -> Mark | None:
        """nack (``arg``: the delay, s), touch (``arg``: the visibility timeout, s; None: the
        queue's) or dead-letter one lease; the mark confirming it."""
        q = self._q
        return q._settle_unsynced(_lease(q, ref, offset, deliveries), action, arg)

    def give_back(self, ref: int, offsets: list[int], deliveries: list[int]) -> int:
        """Nack (no delay) many leases of one group, as a closed connection's leases are
        given back: the consumer lock taken once per ``options.GIVE_BACK_CHUNK``, one
        wake-up for all; stale ones are skipped.  The number given back (a message past
        ``max_deliveries`` goes to the dead-letter queue, as a nack sends it).  Nobody
        waits for the journal here: the writer is told."""
        q = self._q
        q._alive()
        owner = q._att.client_slot()
        settle = q.consumer_groups.settle
        dead: list[DeadItem] = []
        n = 0
        step = options.GIVE_BACK_CHUNK
        for i in range(0, len(offsets), step):  # others may take the lock in between
            with q.ring.clock:
                now = q._now()
                before = n + len(dead)
                for o, dc in zip(offsets[i:i + step], deliveries[i:i + step], strict=True):
                    result = settle(ref, o, dc, NACK, owner, now)
                    if result == OK:
                        n += 1
                    elif result == TO_DLQ:
                        dead.append((ref & L.GI_MASK, o, dc, "nack"))
                    if crashpoints.active:
                        crashpoints.hit("give_back.chunk")
                self.words[L.Q_LEASES_RETURNED] += n + len(dead) - before
        if self._journaled and (n or dead):
            self.durability.poke()
        if dead:
            q._dead_letter(dead)
        if n:
            q._wake_consumers(n)
        return n + len(dead)

    # ------------------------------------------------------------ groups, replay, stats
    def create_group(self, name: str, start: str = "earliest") -> Mark | Marks | None:
        return self._q._create_group_unsynced(name, start)

    def create_group_at(self, name: str, at_ns: int) -> tuple[int, Mark | Marks | None]:
        """A new group at the first message produced at or after the time (ns since the
        epoch): that offset, and the mark confirming the group."""
        return self._q._create_group_at_unsynced(name, at_ns)

    def delete_group(self, name: str) -> Mark | Marks | None:
        return self._q._delete_group_unsynced(name)

    def commit(self, group: str, offset: int) -> Mark | None:
        return self._q._commit_unsynced(group, offset)

    def seek(self, group: str, at_ns: int) -> tuple[int, Mark | Marks | None]:
        """Move ``group`` to the first message at or after the time (``ShmQueue.seek``):
        its offset, and the mark confirming the move."""
        return self._q._seek_unsynced(group, at_ns)

    def purge(self) -> tuple[int, Mark | Marks | None]:
        return self._q._purge_unsynced()

    def groups(self) -> list[str]:
        return self._q.groups()

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        return self._q.read(offset, max_messages)

    def stats(self) -> dict[str, Any]:
        return self._q.stats()

    def read_field(self, offset: int, max_messages: int, max_bytes: int) -> bytes:
        """Up to ``max_messages`` records from ``offset`` (at most ``max_bytes`` of them) as one
        READ_OK ``records`` field (``shmq.core.rawread.read_field``)."""
        return read_field(self._q, offset, max_messages, max_bytes)

    def reading(self) -> QueueReading:
        """Its figures now, read without a lock (``shmq.core.readings``, for the broker's metrics)."""
        return read_queue(self._q)

    def meta(self) -> dict[str, Any]:
        """What a journal records of its queue, to rebuild it."""
        return {"name": self.name, "is_dlq": self.is_dlq, "config": asdict(self.config),
                "created_ns": self.durability.created_ns}

    # ------------------------------------------------------------ doorbell
    def bell(self, worker: int) -> bool:
        """Is worker ``worker``'s doorbell flag set here (``shmq.core.doorbell``)?"""
        return bool(self._mm[L.Q_BELLS + worker])

    def set_bell(self, worker: int, on: bool) -> None:
        """Set (ring me when a message arrives) or clear worker ``worker``'s flag.  A no-op
        on a queue deleted meanwhile."""
        try:
            self._mm[L.Q_BELLS + worker] = 1 if on else 0
        except ValueError:
            pass  # its mapping is gone (the queue was deleted)


class ServerPriorityQueue(ServerQueue):
    """A priority queue, for a broker process: the :class:`ServerQueue` interface over its
    levels (``shmq.core.priority``).  Offsets name their level in their top bits; a group's
    reference is level 0's, and each level's reference of that group is kept beside it,
    serial and all, so that a lease of a group deleted and made again stays stale on every
    level.  A change made on several levels is confirmed by their marks together (``Marks``)."""

    __slots__ = ("_pq", "levels", "_top_down", "_refs")

    def __init__(self, pq: PriorityQueue) -> None:  # (ServerQueue's fields: level 0's)
        self._pq = pq
        self.levels = [ServerQueue(q) for q in pq.levels]
        base = self.levels[0]
        self._q = pq.base
        self._journaled = base._journaled
        self.words = base.words
        self._mm = base._mm
        self.name = pq.name
        self.queue_id = base.queue_id
        self.durability = base.durability
        self._top_down = list(enumerate(self.levels))[::-1]
        self._refs: dict[int, tuple[str, list[int]]] = {}  # level 0's ref -> (group, every level's ref)

    def __repr__(self) -> str:
        return f"ServerPriorityQueue({self.name!r}, priorities={len(self.levels)})"

    @property
    def handle(self) -> PriorityQueue:  # type: ignore[override]
        return self._pq

    @property
    def is_dlq(self) -> bool:
        return False

    @property
    def config(self) -> QueueConfig:
        return self._pq.config

    @property
    def deleted(self) -> bool:
        return any(q.deleted for q in self.levels)

    def _level(self, priority: int) -> ServerQueue:
        return self.levels[check_priority(priority, len(self.levels), self.name)]

    # ------------------------------------------------------------ produce
    def put(self, payload: Payload, meta: bytes = b"", delay_ms: int = 0, ttl_ms: int = 0, priority: int = 0
            ) -> tuple[int, Mark | None]:
        off, mark = self._level(priority).put(payload, meta, delay_ms, ttl_ms)
        return priority << SHIFT | off, mark

    def put_many(self, payloads: Sequence[Payload], producer: str | None = None,
                 seq: int | None = None, metas: list[bytes] | None = None, delay_ms: int = 0,
                 ttl_ms: int = 0, priority: int = 0) -> tuple[list[int], Mark | None]:
        offs, mark = self._level(priority).put_many(payloads, producer, seq, metas, delay_ms, ttl_ms)
        return ([priority << SHIFT | o for o in offs] if priority else offs), mark

    def could_fit(self, payloads: Sequence[Payload], metas: list[bytes] | None = None) -> bool:
        return self.levels[0].could_fit(payloads, metas)  # (every level has the same limits)

    # ------------------------------------------------------------ deliver
    def _known(self, ref: int, group: str, create: bool) -> int:
        """Keep every level's reference of ``group`` (level 0's: ``ref``); made where missing
        when ``create`` (-1 for a level that lacks it: looked up again when needed)."""
        if ref >= 0:
            known = self._refs.get(ref)
            if known is None or (create and min(known[1]) < 0):
                refs = [ref] + [q.group_ref(group) if create else q.group_ref_or_none(group)
                                for q in self.levels[1:]]
                if known is None and len(self._refs) >= 2 * options.MAX_GROUPS_LIMIT:
                    # the groups deleted since go (their leases are stale anyway); the live ones
                    # stay, at most max_groups of them
                    self._refs = {r: v for r, v in self._refs.items() if self.levels[0].group_live(r)}
                self._refs[ref] = (group, refs)
        return ref

    def group_ref(self, group: str, create: bool = True) -> int:
        return self._known(self.levels[0].group_ref(group, create), group, create)

    def group_live(self, ref: int) -> bool:
        return self.levels[0].group_live(ref)

    def group_ref_or_none(self, group: str) -> int:
        return self._known(self.levels[0].group_ref_or_none(group), group, False)

    def poll(self, group: str, max_n: int, visibility_timeout: float | None = None,
             max_bytes: int = 0) -> list[Message]:
        """``ServerQueue.poll`` level after level, from the highest down, up to ``max_n``
        messages (and ``max_bytes``); the messages carry level 0's group reference and this
        queue's offsets."""
        ref = self.group_ref(group)
        out: list[Message] = []
        budget = max_bytes
        for k, q in self._top_down:
            w = q.words
            if w[L.Q_NEXT_OFFSET] == w[L.Q_FREE_OFFSET] and w[L.Q_STATE] == L.QS_ACTIVE:
                continue  # the level retains nothing
            got = q.poll(group, max_n - len(out), visibility_timeout, budget)
            out += [tuple.__new__(Message, (m[0], ref, m[2], k << SHIFT | m[3], *m[4:])) for m in got]
            if max_bytes and got:
                budget -= sum(len(m[5]) + len(m[6]) for m in got)
                if budget <= 0:
                    break
            if len(out) >= max_n:
                break
        return out

    def take_block(self, group: str, max_n: int, visibility_timeout: float | None = None,
                   max_bytes: int = 0) -> Block | None:
        return None  # (the general path: poll, which looks at the levels in order)

    # ------------------------------------------------------------ settle
    def _route(self, ref: int, offset: int) -> tuple[int, ServerQueue, int, int]:
        """(level, its queue, its reference of the group, the offset there) of a lease; a
        lease of no group this worker gave out here is :class:`StaleAck`."""
        k, off = level_of(offset)
        known = self._refs.get(ref)
        if k < len(self.levels) and known is not None and known[1][k] < 0:  # made there since?
            known[1][k] = self.levels[k].group_ref_or_none(known[0])
        if k >= len(self.levels) or known is None or known[1][k] < 0:
            raise StaleAck(f"message {offset} of {self.name!r} is not leased to this connection")
        return k, self.levels[k], known[1][k], off

    def ack(self, ref: int, offset: int, deliveries: int) -> Mark | None:
        _, q, lref, off = self._route(ref, offset)
        return q.ack(lref, off, deliveries)

    def ack_offsets(self, ref: int, offsets: list[int], deliveries: list[int]
                    ) -> tuple[list[int], Mark | Marks | None]:
        stale: list[int] = []
        marks: list[Mark | Marks | None] = []
        for k, offs, dcs in self._by_level(offsets, deliveries):
            try:
                _, q, lref, _ = self._route(ref, k << SHIFT)
            except StaleAck:
                stale.extend(k << SHIFT | o for o in offs)
                continue
            more, mark = q.ack_offsets(lref, offs, dcs)
            stale.extend(k << SHIFT | o for o in more)
            marks.append(mark)
        return stale, Marks.of(marks)

    @staticmethod
    def _by_level(offsets: list[int], deliveries: list[int]) -> list[tuple[int, list[int], list[int]]]:
        split: dict[int, tuple[list[int], list[int]]] = {}
        for o, dc in zip(offsets, deliveries, strict=True):
            offs, dcs = split.setdefault(o >> SHIFT, ([], []))
            offs.append(o & ((1 << SHIFT) - 1))
            dcs.append(dc)
        return [(k, offs, dcs) for k, (offs, dcs) in sorted(split.items())]

    def settle(self, ref: int, offset: int, deliveries: int, action: Settle, arg: float | None
               ) -> Mark | None:
        _, q, lref, off = self._route(ref, offset)
        return q.settle(lref, off, deliveries, action, arg)

    def give_back(self, ref: int, offsets: list[int], deliveries: list[int]) -> int:
        n = 0
        for k, offs, dcs in self._by_level(offsets, deliveries):
            try:
                _, q, lref, _ = self._route(ref, k << SHIFT)
            except StaleAck:
                continue
            n += q.give_back(lref, offs, dcs)
        return n

    # ------------------------------------------------------------ groups, replay, stats
    def create_group(self, name: str, start: str = "earliest") -> Mark | Marks | None:
        marks: list[Mark | Marks | None] = [self.levels[0].create_group(name, start)]
        for q in self.levels[1:]:
            try:
                marks.append(q.create_group(name, start))
            except GroupExists:
                pass  # (a level made it on a delivery already)
        return Marks.of(marks)

    def create_group_at(self, name: str, at_ns: int) -> tuple[int, Mark | Marks | None]:
        offset, mark = self.levels[0].create_group_at(name, at_ns)
        marks: list[Mark | Marks | None] = [mark]
        for q in self.levels[1:]:
            try:
                marks.append(q.create_group_at(name, at_ns)[1])
            except GroupExists:
                pass
        return offset, Marks.of(marks)

    def delete_group(self, name: str) -> Mark | Marks | None:
        marks: list[Mark | Marks | None] = [self.levels[0].delete_group(name)]
        for q in self.levels[1:]:
            try:
                marks.append(q.delete_group(name))
            except GroupNotFound:
                pass
        return Marks.of(marks)

    def commit(self, group: str, offset: int) -> Mark | None:
        k, off = level_of(offset)
        if offset < 0 or k >= len(self.levels):
            raise InvalidArgument(f"offset {offset} names no level of {self.name!r} "
                                  f"(0..{len(self.levels) - 1})")
        return self.levels[k].commit(group, off)

    def seek(self, group: str, at_ns: int) -> tuple[int, Mark | Marks | None]:
        got = [q.seek(group, at_ns) for q in self.levels]
        return got[0][0], Marks.of([m for _, m in got])

    def purge(self) -> tuple[int, Mark | Marks | None]:
        got = [q.purge() for q in self.levels]
        return sum(n for n, _ in got), Marks.of([m for _, m in got])

    def groups(self) -> list[str]:
        return self.levels[0].groups()

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        return self._pq.read(offset, max_messages)

    def stats(self) -> dict[str, Any]:
        return self._pq.stats()

    def read_field(self, offset: int, max_messages: int, max_bytes: int) -> bytes:
        k, off = level_of(offset)
        if k >= len(self.levels):
            raise InvalidArgument(f"offset {offset} names no level of {self.name!r} "
                                  f"(0..{len(self.levels) - 1})")
        return read_field(self._pq.levels[k], off, max_messages, max_bytes, k << SHIFT)

    def reading(self) -> QueueReading:
        return self.levels[0].reading()

    def meta(self) -> dict[str, Any]:
        return self.levels[0].meta()

    # ------------------------------------------------------------ doorbell
    def bell(self, worker: int) -> bool:
        return self.levels[0].bell(worker)

    def set_bell(self, worker: int, on: bool) -> None:
        self.levels[0].set_bell(worker, on)  # (a put at any level rings level 0's bells)


class ServerBroker:
    """An instance, for a broker process: :class:`ServerQueue` handles, and what the
    supervisor, workers and journal writer do to the instance as a whole."""

    def __init__(self, instance: str, *, clock: Callable[[], float] | None = None) -> None:
        self._b = ShmBroker(instance, clock=clock)  # (a clock: tests drive leases and TTLs)
        self._att = self._b._att
        self.instance = instance
        self.instance_uid: int = self._att.registry.uid
        self._queues: dict[str, ServerQueue] = {}
        self._registry_w = self._att.registry.w
        # queue() answers of this registry generation
        self._known: dict[str, ServerQueue] = {}
        self._known_gen = -1
        self._pruned_gen = -1

    @property
    def broker(self) -> ShmBroker:
        """The public broker handle of this instance."""
        return self._b

    @property
    def registry(self) -> Registry:
        """The instance's registry (its owner, its journal, its clients and queues)."""
        return self._att.registry

    def reap(self) -> int:
        """Give back the leases of every dead process now (a worker died: its connections'
        leases come back at once); the number given back."""
        return self._att.reap(self._att.now_ms(), force=True)

    def maintain(self) -> None:
        """The lease reaper's round: forget deleted queues, give back dead processes'
        leases, expire visibility timeouts, retry orphaned dead-letters, and expire the
        messages whose TTL ran out (``QueueHandle.sweep_ttl``: bounded per group, so a
        queue nobody consumes still expires them)."""
        self.prune()
        self.reap()
        for q in self.queues():
            try:
                q.handle.maintain()
                q.handle.sweep_ttl()
            except ShmqError:
                pass  # deleted meanwhile

    def serve_as(self, worker_id: int) -> None:
        """This process is broker worker ``worker_id``: puts made here do not ring its own
        doorbell (its event loop retries what waits, at once)."""
        self._att.bell_skip = worker_id

    def queue(self, name: str) -> ServerQueue:
        """A queue by name (:class:`QueueNotFound`); cached, and checked against the registry
        generation, so a queue deleted and made again is seen as the new one.  While the
        generation stays, a name answered once is answered again at once (every request
        asks)."""
        gen = self._registry_w[L.R_GENERATION]
        if gen == self._known_gen:
            sq = self._known.get(name)
            if sq is not None:
                return sq
        else:
            self._known, self._known_gen = {}, gen
        q: ShmQueue | PriorityQueue = self._b.queue(name)  # (a priority queue's levels are not found by name)
        sq = self._queues.get(name)
        if sq is None or sq.handle is not q:
            sq = self._queues[name] = (ServerPriorityQueue(q) if isinstance(q, PriorityQueue)
                                       else ServerQueue(q))
        self._known[name] = sq
        return sq

    def queues(self) -> Iterator[ServerQueue]:
        """Every queue of the instance now (those deleted meanwhile are skipped)."""
        for entry in self._att.registry.queues():
            try:
                yield ServerQueue(self._att._open(entry))
            except QueueNotFound:
                continue

    def queues_by_id(self) -> dict[int, ServerQueue]:
        """Every queue now, by queue id."""
        return {q.queue_id: q for q in self.queues()}

    def find(self, name: str) -> ServerQueue | None:
        """A queue by name, None when there is none (or it was deleted meanwhile)."""
        entry = self._att.registry.find(name)
        if entry is None:
            return None
        try:
            return ServerQueue(self._att._open(entry))
        except QueueNotFound:
            return None

    @property
    def generation(self) -> int:
        """Moves whenever a queue is created or deleted."""
        return int(self._att.registry.generation)

    def prune(self) -> None:
        """Let go of the queues deleted since the last call (cheap when none was: every
        broker process calls it on its tick)."""
        gen = self._registry_w[L.R_GENERATION]
        self._att.prune()
        if gen != self._pruned_gen:
            self._pruned_gen = gen
            self._queues = {k: v for k, v in self._queues.items() if not v.deleted}
            self._known = {}

    def set_journal(self, data_dir: str | None) -> None:
        """Announce (or withdraw) the journal writer and its data dir in the registry."""
        self._att.registry.set_journal(data_dir)

    def create_queue(self, name: str, **limits: Any) -> None:
        self._b.create_queue(name, **limits)

    def restore_queue(self, name: str, config: QueueConfig, is_dlq: bool,
                      fill: Callable[[Ring], None]) -> None:
        """Create a queue whose segment ``fill`` writes before it is published (recovery)."""
        self._att.create_queue(name, config, is_dlq=is_dlq, restore=fill)

    def delete_queue(self, name: str) -> None:
        self._b.delete_queue(name)

    def list_queues(self) -> list[QueueInfo]:
        return self._b.list_queues()

    def info(self) -> BrokerInfo:
        """The instance's owner and attached processes (``ShmBroker.info``)."""
        return self._b.info()

    def close(self) -> None:
        """Detach (the instance stays)."""
        self._queues.clear()
        self._known.clear()
        self._b.close()

    def destroy(self) -> None:
        """Remove the instance: every queue, the registry (``ShmBroker.destroy``)."""
        self._queues.clear()
        self._known.clear()
        self._b.destroy()


__all__ = ["Block", "ServerBroker", "ServerQueue"]
