"""Readings: a queue's figures as its shared memory holds them now, read without a lock.

The broker's metrics (``shmq.server.collector``) read every queue at each scrape.
A reading takes neither of the queue's locks, so a scrape never waits for a
producer or a consumer and never makes one wait: each figure is one aligned
8-byte word read as it stands (``shmq.core.layout``: single stores, never torn), and
two figures of one reading may be a moment apart (a counter read just before
another moved).  Nothing is written.

Where the words are (``shmq.core.layout`` draws the whole segment)::

    queue header   Q_NEXT_OFFSET  ─ produced; depth = Q_NEXT_OFFSET − Q_FREE_OFFSET
                   Q_FREE_OFFSET  ─ first retained offset
                   Q_TAIL_BYTES   ─ bytes used = Q_TAIL_BYTES − S_BYTEPOS of the slot at Q_FREE_OFFSET
                   Q_DURABLE_OFFSET ─ journaled queues: durable lag = Q_NEXT_OFFSET − it
                   Q_JOURNAL_ERRNO, Q_PLOCK_RECOVERIES + Q_CLOCK_RECOVERIES,
                   Q_LEASES_REAPED, Q_LEASES_RETURNED
    group entry g  G_FLOOR        ─ lag = Q_NEXT_OFFSET − G_FLOOR; oldest unacked: S_TIMESTAMP at G_FLOOR
                   G_CURSOR       ─ in flight: LEASED lease words of g in [G_FLOOR, G_CURSOR)
                   G_DELIVERED + G_REDELIVERED = delivered; G_ACKED, G_NACKED, G_EXPIRED, G_DEAD_LETTERED

A slot read while its offset is being freed and reused shows another offset in
``S_OFFSET``: such a read is taken again (bytes used) or left out (the oldest age).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shmq import options
from shmq.core import layout as L

if TYPE_CHECKING:
    from shmq.core.queue import ShmQueue

_TRIES = 3  # reads of a slot that is being reused meanwhile, before it counts as gone


@dataclass(frozen=True, slots=True)
class GroupReading:
    name: str
    lag: int  # messages produced that this group has not acknowledged (in flight included)
    in_flight: int  # leased now
    oldest_ns: int  # producer timestamp (ns since the epoch) of its oldest unacknowledged; 0: none
    delivered: int  # deliveries, first and repeated
    redelivered: int
    acked: int
    nacked: int
    expired: int
    dead_lettered: int
    ttl_expired: int  # never delivered within the queue's message_ttl (dead-lettered or dropped)


@dataclass(frozen=True, slots=True)
class QueueReading:
    name: str
    is_dlq: bool
    durability: str
    depth: int  # messages retained (some group has not acknowledged them)
    bytes_used: int
    capacity: int
    max_bytes: int
    produced: int
    durable_lag: int | None  # journaled queues: produced, not yet journaled; None: memory only
    journal_errno: int  # 0: the journal writes fine (or memory only)
    lock_recoveries: int
    leases_reaped: int
    leases_returned: int
    groups: tuple[GroupReading, ...]


def read_queue(q: ShmQueue) -> QueueReading:
    """Every figure of ``q`` now, without taking a lock."""
    ring = q.ring
    w = ring.w
    nxt = w[L.Q_NEXT_OFFSET]
    free = w[L.Q_FREE_OFFSET]
    used = 0
    for _ in range(_TRIES):
        free, nxt, tail_bytes = w[L.Q_FREE_OFFSET], w[L.Q_NEXT_OFFSET], w[L.Q_TAIL_BYTES]
        if nxt <= free:
            break
        base = ring.slot_base(free)
        pos = w[base + L.S_BYTEPOS]
        if w[base + L.S_OFFSET] == free and w[L.Q_FREE_OFFSET] == free:
            used = max(0, tail_bytes - pos)
            break
    durability = options.DURABILITY_MODES[ring.durability]
    journaled = ring.durability != 0
    return QueueReading(
        name=q.name, is_dlq=q.is_dlq, durability=durability, depth=max(0, nxt - free), bytes_used=used,
        capacity=ring.capacity, max_bytes=ring.size, produced=nxt,
        durable_lag=max(0, nxt - w[L.Q_DURABLE_OFFSET]) if journaled else None,
        journal_errno=w[L.Q_JOURNAL_ERRNO],
        lock_recoveries=w[L.Q_PLOCK_RECOVERIES] + w[L.Q_CLOCK_RECOVERIES],
        leases_reaped=w[L.Q_LEASES_REAPED], leases_returned=w[L.Q_LEASES_RETURNED],
        groups=tuple(_read_group(q, gi, name, nxt) for gi, name in q.consumer_groups.active()))


def _read_group(q: ShmQueue, gi: int, name: str, produced: int) -> GroupReading:
    ring = q.ring
    w = ring.w
    g = ring.groups_w + gi * L.G_WORDS
    floor, cursor = w[g + L.G_FLOOR], w[g + L.G_CURSOR]
    cap, sw = ring.capacity, ring.slot_words
    in_flight = 0
    o = floor
    while o < cursor:  # one strided read per stretch that does not wrap the slot table
        i0 = o % cap
        k = min(cursor - o, cap - i0)
        b = ring.slots_w + i0 * sw + L.S_GROUPS + gi
        in_flight += sum(1 for x in w[b:b + k * sw:sw].tolist() if x & L.STATE_MASK == L.LEASED)
        o += k
    oldest = 0
    if floor < produced:
        base = ring.slot_base(floor)
        ts = w[base + L.S_TIMESTAMP]
        if w[base + L.S_OFFSET] == floor and w[g + L.G_FLOOR] == floor:
            oldest = ts
    return GroupReading(
        name=name, lag=max(0, produced - floor), in_flight=in_flight, oldest_ns=oldest,
        delivered=w[g + L.G_DELIVERED] + w[g + L.G_REDELIVERED], redelivered=w[g + L.G_REDELIVERED],
        acked=w[g + L.G_ACKED], nacked=w[g + L.G_NACKED], expired=w[g + L.G_EXPIRED],
        dead_lettered=w[g + L.G_DEAD_LETTERED], ttl_expired=w[g + L.G_TTL_EXPIRED])


__all__ = ["GroupReading", "QueueReading", "read_queue"]
