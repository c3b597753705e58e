"""The consumer side of a queue: groups, leases, acknowledgements, redelivery.

``Groups`` is declared here, as ``class Groups(Delivery, Settlement, GroupTable)``: its
state and the group table are ``GroupTable``'s (``group_table``: the group entries, their
references, floors and the free offset), two mixins typed against that class hold the
lease paths (``delivery``: leasing messages to consumers; ``settlement``: acks, nacks,
touches, dead-letters, commits, expiry, dead owners), and this module adds the journal's
snapshot and its restore, seeks, and ``repair``.  Import them from here.

Every method of ``Groups`` is called with the queue's consumer lock held (``Ring.clock``)
and takes the time as ``now`` (monotonic ms), so tests drive the clock.

Each message has one lease word per group (drawn in ``layout``).  A state
change of a message is one store of its lease word; the group fields that
follow from it (cursor, floor, hints, counters) are written after it.

Invariants, for every active group (``shmq.core.check`` verifies them all)::

    free_offset <= floor <= cursor <= next_offset
    every word in [free_offset, floor) is DONE
    no word in [floor, cursor) is NEW; the word at the floor, if below the cursor, is
        not DONE (floors move past DONE words at once)
    every word in [cursor, next_offset) is NEW or DONE (DONE there: settled without a
        delivery, by a commit or as a gap a journal recovery could not fill)
    G_REDELIVER >= the READY words, G_READY_LO <= the lowest, G_NEXT_READY <= the earliest
    G_NEXT_EXPIRY <= every LEASED deadline (0 only when nothing is LEASED)
    free_offset = min(next_offset, durable mark, every active group's floor)

A process killed inside the consumer lock breaks them for a moment (a lease word
stored, the cursor not yet moved; a floor moved, the free offset not yet).  The
robust lock hands the next holder ``EOWNERDEAD``, and it runs ``repair``, which
re-derives every one of them from the lease words.  Outside the lock (between two
holds) the invariants hold, so nothing else ever has to guess.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from shmq import crashpoints
from shmq.core.delivery import Delivery
from shmq.core.group_table import (
    ACK,
    DEAD,
    FREED,
    NACK,
    OK,
    STALE,
    TO_DLQ,
    TOUCH,
    DeadItem,
    GroupTable,
    reopened,
    settled,
)
from shmq.core.layout import (
    DC_MASK,
    DC_SHIFT,
    DEADING,
    DONE,
    G_ACKED,
    G_CREATED_NS,
    G_CURSOR,
    G_DEAD_LETTERED,
    G_DELIVERED,
    G_EXPIRED,
    G_FLOOR,
    G_NACKED,
    G_NAME,
    G_NAME_LEN,
    G_NEXT_EXPIRY,
    G_NEXT_READY,
    G_READY_LO,
    G_REDELIVER,
    G_REDELIVERED,
    G_SEEK_TO,
    G_SERIAL,
    G_STATE,
    G_TTL_EXPIRED,
    G_WORDS,
    GS_ACTIVE,
    GS_FREE,
    LEASED,
    NEW,
    NO_OWNER,
    OWNER_MASK,
    OWNER_SHIFT,
    Q_DELAY_MAX,
    Q_FREE_OFFSET,
    Q_GROUP_GEN,
    Q_NEXT_OFFSET,
    Q_ORPHANS,
    Q_SETTLE_SEQ,
    READY,
    S_GROUPS,
    S_TIMESTAMP,
    STATE_DC_MASK,
    STATE_MASK,
    TIME_MASK,
    TIME_SHIFT,
    WORD,
    lease_word,
)
from shmq.core.ring import Ring
from shmq.core.settlement import Settlement

__all__ = ["ACK", "DEAD", "FREED", "NACK", "OK", "STALE", "TO_DLQ", "TOUCH", "DeadItem", "Groups"]


class Groups(Delivery, Settlement, GroupTable):
    """The consumer side of one queue (see the module docstring), in three parts:

    * ``GroupTable`` (``group_table``), the base: the geometry and every field, the group
      entries (create, delete, references), floors and the free offset, the READY hints,
      stats;
    * ``Delivery`` (``delivery``), a mixin: ``deliver`` and its hot paths ``deliver_one``
      (and ``one_geom``, the compiled twin's geometry) and ``deliver_block``, redelivery,
      TTL expiry, ``sweep``;
    * ``Settlement`` (``settlement``), a mixin: ``ack`` and its batches, ``settle`` (nack,
      touch, dead-letter), give-backs, ``finish_dead``, ``orphan_dead``, ``commit``,
      ``expire``, ``reap_owner``;

    and, here, the journal's ``snapshot`` and the ``restore`` family, ``offset_at`` and
    ``seek``, and ``repair``.  The mixins hold no state of their own and neither inherits
    from the other: each is typed against ``GroupTable`` (``Delivery`` also declares the
    ``expire`` it calls), and every method is looked up on this one class, so the hot
    paths pay nothing for the split."""

    def __init__(self, ring: Ring, wall_ns: Callable[[], int] = time.time_ns) -> None:
        GroupTable.__init__(self, ring, wall_ns)
        # A consumer killed inside the consumer lock left the group table half-updated:
        # the next holder re-derives it from the lease words.
        ring.clock.on_recover = self.repair

    # ------------------------------------------------------------ journal snapshot
    _COUNTERS = (G_ACKED, G_NACKED, G_REDELIVERED, G_DEAD_LETTERED, G_EXPIRED, G_CREATED_NS, G_DELIVERED,
                 G_TTL_EXPIRED)

    def snapshot(self, now: int = 0) -> list[dict[str, Any]]:
        """Every active group's state, for the journal; call under the consumer lock.

        ``words`` holds, for each offset in [floor, cursor), its lease state and
        delivery count (``state | deliveries << 3``); owners and deadlines are not
        kept: after a recovery every lease is given back.  ``backoff``: (offset, ms still
        to wait at ``now``) of the messages given back with a delay (``nack(delay=)``)
        not due yet, which a recovery gives back that late."""
        w = self.w
        out = []
        for gi, name in self.active():
            g = self.gw + gi * G_WORDS
            floor, cursor = w[g + G_FLOOR], w[g + G_CURSOR]
            words: list[int] = []
            backoff: list[tuple[int, int]] = []
            look = bool(now and w[g + G_REDELIVER])  # (nothing given back: nothing to look for)
            o = floor
            while o < cursor:  # one strided run per stretch that does not wrap the slot table
                i0 = o % self.cap
                k = min(cursor - o, self.cap - i0)
                b = self.sl + i0 * self.sw + S_GROUPS + gi
                raw = w[b:b + k * self.sw:self.sw].tolist()
                words.extend(x & STATE_DC_MASK for x in raw)
                if look:
                    backoff += [(o + i, (x >> TIME_SHIFT) - now) for i, x in enumerate(raw)
                                if x & STATE_MASK == READY and x & STATE_DC_MASK != READY
                                and x >> TIME_SHIFT > now]
                o += k
            st = {"name": name, "floor": floor, "cursor": cursor, "words": words,
                  "counters": [w[g + c] for c in self._COUNTERS]}
            if backoff:
                st["backoff"] = backoff
            out.append(st)
        return out

    def delays(self, tail: int, now: int) -> list[tuple[int, int]]:
        """(offset, ms still to wait) of every delayed message below ``tail`` not due at
        ``now`` (READY never delivered, or DONE settled before its time, in some active
        group), for the journal; call under the consumer lock.  Nothing to scan unless
        Q_DELAY_MAX is ahead of ``now``."""
        w = self.w
        if w[Q_DELAY_MAX] <= now:
            return []
        cols = [S_GROUPS + gi for gi, _ in self.active()]
        out = []
        for o in range(w[Q_FREE_OFFSET], tail):
            slot = self.sl + (o % self.cap) * self.sw
            due = max((x >> TIME_SHIFT for c in cols if (x := w[slot + c]) & STATE_DC_MASK in (READY, DONE)),
                      default=0)
            if due > now:
                out.append((o, due - now))
        return out

    def restore_delays(self, delays: list[tuple[int, int]], first: int, tail: int) -> None:
        """Recovery, after ``restore``: each (offset, due in monotonic ms) is delayed again,
        in every group whose word is NEW or READY never delivered (and every free group's);
        a group that settled it undelivered (DONE) keeps the due time (``settled``)."""
        w = self.w
        for o, due in delays:
            if not first <= o < tail:
                continue
            slot = self.sl + (o % self.cap) * self.sw
            for gi in range(self.max_groups):
                b = slot + S_GROUPS + gi
                if w[b] == NEW or w[b] & STATE_DC_MASK == READY:
                    w[b] = READY | ((due & TIME_MASK) << TIME_SHIFT)
                elif w[b] & STATE_MASK == DONE:  # (not due: it was never delivered)
                    w[b] = DONE | ((due & TIME_MASK) << TIME_SHIFT)
            w[Q_DELAY_MAX] = max(w[Q_DELAY_MAX], due)

    def restore_backoffs(self, groups: list[dict[str, Any]], due: Callable[[int], int]) -> None:
        """Recovery, after ``restore``: the messages each group had given back with a delay
        wait for it again (``due``: a snapshot's wall-clock ms to this boot's monotonic
        ms), their delivery counts kept."""
        w = self.w
        for gi, st in enumerate(groups[:self.max_groups]):
            g = self.gw + gi * G_WORDS
            for o, wall_ms in st.get("backoff", ()):
                b = self.sl + (int(o) % self.cap) * self.sw + S_GROUPS + gi
                if w[g + G_FLOOR] <= int(o) < w[g + G_CURSOR] and w[b] & STATE_MASK == READY:
                    at = due(int(wall_ms)) & TIME_MASK
                    w[b] = (w[b] & ~(TIME_MASK << TIME_SHIFT)) | (at << TIME_SHIFT)

    def restore(self, groups: list[dict[str, Any]], first: int, tail: int) -> None:
        """Rebuild the group table from a snapshot (recovery, before the queue is
        published).  Offsets below a group's floor are DONE for it; leased ones come
        back READY with their delivery counts; cursors and floors are clamped into
        [first, tail]."""
        w = self.w
        for gi in range(self.max_groups):
            w[self.gw + gi * G_WORDS + G_STATE] = GS_FREE
        for gi, st in enumerate(groups[:self.max_groups]):
            g = self.gw + gi * G_WORDS
            self.mm[g * WORD:(g + G_WORDS) * WORD] = bytes(G_WORDS * WORD)
            floor = min(max(int(st["floor"]), first), tail)
            cursor = min(max(int(st["cursor"]), floor), tail)
            lw = S_GROUPS + gi
            for o in range(first, floor):
                w[self.sl + (o % self.cap) * self.sw + lw] = DONE
            ready = 0
            words = st["words"]
            base = int(st["floor"])
            for o in range(floor, cursor):
                i = o - base
                word = words[i] if 0 <= i < len(words) else NEW
                state, dc = word & STATE_MASK, (word >> DC_SHIFT) & DC_MASK
                if state == DONE:
                    new = DONE
                else:  # LEASED, READY, DEADING (NEW: a gap): given back, deliverable now
                    new = lease_word(READY, dc, NO_OWNER, 0)
                    ready += 1
                slot = self.sl + (o % self.cap) * self.sw
                if w[slot + S_GROUPS + gi] != DONE:  # a hole (never journaled) stays DONE
                    w[slot + lw] = new
            for c, v in zip(self._COUNTERS, st.get("counters", ()), strict=False):
                w[g + c] = int(v)
            w[g + G_CURSOR] = cursor
            w[g + G_FLOOR] = floor
            w[g + G_REDELIVER] = ready
            w[g + G_READY_LO] = floor
            raw = str(st["name"]).encode()
            w[g + G_NAME_LEN] = len(raw)
            self.mm[(g + G_NAME) * WORD:(g + G_NAME) * WORD + len(raw)] = raw
            w[g + G_STATE] = GS_ACTIVE
        w[Q_GROUP_GEN] += 1
        restored = range(min(len(groups), self.max_groups))
        for gi in restored:
            w[self.gw + gi * G_WORDS + G_SERIAL] = w[Q_GROUP_GEN]
        self._recompute_free()
        for gi in restored:
            self.advance_floor(gi)

    # ------------------------------------------------------------ seek by time
    def offset_at(self, ts_ns: int) -> int:
        """The first retained offset whose producer timestamp is at or after ``ts_ns``: a
        binary search of [free offset, next offset), which assumes the timestamps rise with
        the offsets.  When they do not (two producers' clocks, a clock stepped back), it
        finds *a* boundary: an offset whose record is at or after ``ts_ns`` and whose
        predecessor is before it.  The next offset when every record is older.  Tombstones
        (timestamp 0: offsets a recovery could not fill) count as the record after them,
        and the answer is never one."""
        w = self.w
        lo, hi = w[Q_FREE_OFFSET], w[Q_NEXT_OFFSET]
        tail = hi
        while lo < hi:
            mid = (lo + hi) // 2
            m = mid
            while m < hi and not self._timestamp(m):
                m += 1
            if m == hi or self._timestamp(m) >= ts_ns:
                hi = mid
            else:
                lo = m + 1
        while lo < tail and not self._timestamp(lo):  # the record after the tombstones
            lo += 1
        return int(lo)

    def _timestamp(self, offset: int) -> int:
        return int(self.w[self.sl + (offset % self.cap) * self.sw + S_TIMESTAMP])

    def seek(self, gi: int, to: int, now: int) -> bool:
        """Move the group's position to offset ``to`` (clamped into [free offset, next
        offset]), as Kafka's seek: every message below it is settled for the group (DONE,
        as ``commit``: a lease on one turns stale), and every retained one from it up to
        the cursor is delivered again (READY now: acked, leased -- that lease turns stale --
        or given back; a delayed message settled before it was due waits for its time
        again), except a dead-letter copy in flight and a message that had its
        ``max_deliveries`` already.  True when storage was freed.

        All or nothing across a crash: the target is stored first (G_SEEK_TO), and a
        process killed anywhere after that leaves the seek to ``repair``, which runs it
        again (a seek is idempotent: a second run finds every word already where the
        first put it).  The floor is lowered before any word below it changes, so the
        state a kill leaves is one ``repair`` can read: DONE words above a floor, which it
        steps over, never a delivered-again word below it."""
        w = self.w
        if self.journaled:  # the journal writer snapshots the groups once this moves
            w[Q_SETTLE_SEQ] += 1
        g = self.gw + gi * G_WORDS
        to = min(max(to, w[Q_FREE_OFFSET]), w[Q_NEXT_OFFSET])
        w[g + G_SEEK_TO] = to + 1
        freed = self._move(gi, to, now)
        w[g + G_SEEK_TO] = 0
        return freed

    def _move(self, gi: int, to: int, now: int) -> bool:
        """``seek``'s stores, after its target is recorded."""
        w = self.w
        g = self.gw + gi * G_WORDS
        cur = w[g + G_CURSOR]
        if to >= cur:
            return self.commit(gi, to)
        lw = S_GROUPS + gi
        start = w[g + G_FLOOR]
        if to < start:
            w[g + G_FLOOR] = start = to
        if crashpoints.active:
            crashpoints.hit("seek.floor")
        for o in range(start, cur):
            slot = self.sl + (o % self.cap) * self.sw
            word = w[slot + lw]
            state, dc = word & STATE_MASK, (word >> DC_SHIFT) & DC_MASK
            if state == DEADING:  # a dead-letter copy in flight finishes on its own
                continue
            if o < to:
                w[slot + lw] = settled(word)
            elif state != READY and dc < self.give_up_at and w[slot + S_TIMESTAMP]:  # (0: a tombstone)
                w[slot + lw] = reopened(word, now)
            else:
                continue
            if crashpoints.active:
                crashpoints.hit("seek.word")
        if crashpoints.active:
            crashpoints.hit("seek.words")
        self._exact_hints(gi)
        freed = self.advance_floor(gi)
        return self._recompute_free() or freed

    # ------------------------------------------------------------ repair
    def repair(self) -> None:
        """Re-derive the group table from the lease words; the consumer lock's
        ``on_recover``: its last holder died inside it, at any instruction.

        * A create or delete cut short: FREE groups get serial 0 (their leases are
          stale), and a fresh generation makes every process re-read the active set.
        * A seek cut short (G_SEEK_TO set) is run again, to its end (``seek``).
        * LEASED words past a cursor belong to a delivery that never returned (its
          deliverer died before moving the cursor): NEW again; so do DEADING ones there
          (a TTL expiry whose deliverer died before moving the cursor).  (READY ones there are
          delayed messages, waiting for their time.)
        * The floor moves past DONE words; the hints (G_REDELIVER, G_NEXT_READY,
          G_READY_LO, G_NEXT_EXPIRY) become exact; the free offset is recomputed.
        * A dead-letter orphan (DEADING, no owner) raises Q_ORPHANS, so it is retried."""
        w = self.w
        for gi in range(self.max_groups):  # (a create stores the serial before ACTIVE)
            if w[self.gw + gi * G_WORDS + G_STATE] != GS_ACTIVE:
                w[self.gw + gi * G_WORDS + G_SERIAL] = 0
        w[Q_GROUP_GEN] += 1
        tail = w[Q_NEXT_OFFSET]
        orphans = False
        for gi, _name in self.active():
            g = self.gw + gi * G_WORDS
            if w[g + G_SEEK_TO]:  # (its lease words are READY from time 0: deliverable at once)
                self.seek(gi, w[g + G_SEEK_TO] - 1, 0)
            lw = S_GROUPS + gi
            cur = w[g + G_CURSOR]
            for o in range(cur, tail):
                base = self.sl + (o % self.cap) * self.sw + lw
                if w[base] & STATE_MASK in (LEASED, DEADING):  # (READY there: a delayed message, kept)
                    w[base] = NEW  # (DEADING there: a TTL expiry cut short; it expires again)
            orphans = self._exact_hints(gi) or orphans
            self.advance_floor(gi)
        if orphans:
            w[Q_ORPHANS] = 1
        self._recompute_free()

    def _exact_hints(self, gi: int) -> bool:
        """Make the group's hints exact from its words in [floor, cursor) (a NEW word
        there becomes READY); True when a dead-letter orphan (DEADING, no owner) is there."""
        w = self.w
        g = self.gw + gi * G_WORDS
        lw = S_GROUPS + gi
        cur = w[g + G_CURSOR]
        orphans = False
        ready = 0
        next_ready: int | None = None
        next_expiry: int | None = None
        ready_lo = cur
        for o in range(w[g + G_FLOOR], cur):
            base = self.sl + (o % self.cap) * self.sw + lw
            word = w[base]
            state = word & STATE_MASK
            if state == NEW:  # cannot happen below the cursor: deliverable now
                word = w[base] = READY
                state = READY
            t = word >> TIME_SHIFT
            if state == READY:
                ready += 1
                ready_lo = min(ready_lo, o)
                next_ready = t if next_ready is None else min(next_ready, t)
            elif state == LEASED:
                next_expiry = t if next_expiry is None else min(next_expiry, t)
            elif state == DEADING and (word >> OWNER_SHIFT) & OWNER_MASK == NO_OWNER:
                orphans = True
        w[g + G_REDELIVER] = ready
        w[g + G_NEXT_READY] = next_ready or 0
        w[g + G_READY_LO] = ready_lo
        w[g + G_NEXT_EXPIRY] = max(next_expiry, 1) if next_expiry is not None else 0
        return orphans
