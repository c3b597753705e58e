"""Rebuilding a queue's segment from its journal, before the queue is published.

The journal writer's recovery (``shmq.server.journaler.recover``) reads what a
journal holds and makes the queue again with ``ServerBroker.restore_queue``,
passing :func:`restore_fill` (its data bound with ``functools.partial``): it
fills the new segment while nobody else can see it, so no lock is needed.
"""

from __future__ import annotations

import time
from typing import Any

from . import layout as L
from .group import Groups
from .ring import Ring


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
    ring.restore(records, first, tail, expires)
    if groups:
        Groups(ring).restore(groups, first, tail)
    else:
        g = ring.groups_w
        w[g + L.G_CURSOR] = w[g + L.G_FLOOR] = first
    if delays:  # (offset, wall-clock ms when due): due on this boot's monotonic clock
        now, wall = time.monotonic_ns() // 1_000_000, time.time_ns() // 1_000_000
        Groups(ring).restore_delays([(o, now + max(due - wall, 1)) for o, due in delays if o in records],
                                    first, tail)
    ring.restore_producers(producers, tail)
    w[L.Q_CREATED_NS] = created_ns
    w[L.Q_DURABLE_OFFSET] = tail
    w[L.Q_DURABLE_SETTLE] = 0
