"""Rebuilding a queue's segment from its journal, before the queue is published.

The journal writer's recovery (``shmq.server.journaler.recover``) reads what a
journal holds and makes the queue again with ``ServerBroker.restore_queue``,
passing :func:`restore_fill` (its data bound with ``functools.partial``): it
fills the new segment while nobody else can see it, so no lock is needed.
"""

from __future__ import annotations

import time
from typing import Any

from shmq.core import layout as L
from shmq.core.groups import Groups
from shmq.core.ring import Ring
from shmq.errors import InstanceError


def restore_fill(records: dict[int, tuple[int, bytes, bytes]], groups: list[dict[str, Any]],
                 producers: list[tuple[int, int]], first: int, tail: int, created_ns: int,
                 ring: Ring, delays: list[tuple[int, int]] | None = None,
                 expires: dict[int, int] | None = None) -> None:
    """Write ``records`` ({offset: (timestamp_ns, payload, metadata)}) at their offsets, with
    ``first`` the first retained offset and ``tail`` the next one; restore the
    groups as journaled (without any, the default group starts at ``first``) and
    the idempotent producers' sequences; mark everything below ``tail`` durable.
    ``delays``: (offset, wall-clock ms when due) of the delayed messages (the journal's
    state), delayed again on this boot's monotonic clock.  ``expires``: {offset: wall-clock
    ns when it expires} of the messages put with their own TTL."""
    w = ring.w
    fill_records(ring, records, first, tail, expires)
    now, wall = time.monotonic_ns() // 1_000_000, time.time_ns() // 1_000_000

    def due(wall_ms: int) -> int:  # a snapshot's wall-clock due time, on this boot's monotonic clock
        return now + max(wall_ms - wall, 1)

    table = Groups(ring)
    if groups:
        table.restore(groups, first, tail)
        table.restore_backoffs(groups, due)  # nacks' delays
    else:
        g = ring.groups_w
        w[g + L.G_CURSOR] = w[g + L.G_FLOOR] = first
    if delays:  # (offset, wall-clock ms when due)
        table.restore_delays([(o, due(at)) for o, at in delays if o in records], first, tail)
    ring.restore_producers(producers, tail)
    w[L.Q_CREATED_NS] = created_ns
    w[L.Q_DURABLE_OFFSET] = tail
    w[L.Q_DURABLE_SETTLE] = 0


def fill_records(ring: Ring, records: dict[int, tuple[int, bytes, bytes]], first: int, tail: int,
                 expires: dict[int, int] | None = None) -> None:
    """Fill a new, unpublished segment (recovery): ``records`` maps offset to
    (timestamp_ns, payload, metadata); every offset of [first, tail) not in it becomes a
    tombstone, empty and DONE for every group (lost in a crash window, or never
    handed out), so offsets keep their meaning and are never reused.  ``expires``:
    {offset: S_EXPIRES} of the messages put with their own TTL."""
    w = ring.w
    size, cap = ring.size, ring.capacity
    if tail - first > cap:
        raise InstanceError(f"cannot restore {tail - first} offsets into capacity {cap}")
    done_all = bytes(L.WORD) + b"".join(L.DONE.to_bytes(L.WORD, "little") for _ in range(ring.max_groups))
    expires = expires or {}
    mm = ring.mm
    p = 0
    for o in range(first, tail):
        base = ring.slots_w + (o % cap) * ring.slot_words
        rec = records.get(o)
        b = (base + L.S_EXPIRES) * L.WORD
        if rec is None:
            mm[base * L.WORD:b] = L.SLOT_HEAD.pack(o, p, 0, 0)
            mm[b:b + len(done_all)] = done_all
            continue
        ts, payload, meta = rec
        n = len(payload) + len(meta)
        phys = p % size
        if phys + n > size:
            p += size - phys
        if p + n > size:
            raise InstanceError(f"cannot restore {p + n} bytes into max_bytes {size}")
        start = ring.data_off + p % size
        mm[start:start + n] = meta + payload
        mm[base * L.WORD:b] = L.SLOT_HEAD.pack(o, p, len(payload) | (len(meta) << L.LEN_META_SHIFT), ts)
        mm[b:b + len(ring._zero_leases)] = ring._zero_leases
        if o in expires:
            w[base + L.S_EXPIRES] = expires[o]
            w[L.Q_EXPIRES_MAX] = max(w[L.Q_EXPIRES_MAX], expires[o])
        p += n
    w[L.Q_TAIL_BYTES] = p
    w[L.Q_FREE_OFFSET] = first
    w[L.Q_NEXT_OFFSET] = tail
