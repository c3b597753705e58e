"""How a lease ends: acks, nacks, touches, dead-letters, commits, expiry, a dead owner's leases.

``Settlement`` is a mixin of ``shmq.core.groups.Groups``, declared there with ``Delivery``
and their base ``GroupTable``, whose state and methods it uses (it is typed against that
class).  Every method here is called with the consumer lock held, keeps the invariants in
``shmq.core.groups``'s docstring, and changes a message's state with one store of its
lease word (``layout``), writing the group fields that follow from it after that store.
A lease is settled only while it is held: the group is the one that delivered it (its
serial matches) and the word is LEASED with the same delivery count; anything else is
STALE.  A lease given back (nack, expiry, a dead owner) becomes READY again, or DEADING
once it has had ``max_deliveries``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from shmq import crashpoints
from shmq.accel import ext
from shmq.core.group_table import FREED, NACK, OK, STALE, TO_DLQ, TOUCH, DeadItem, GroupTable, settled
from shmq.core.layout import (
    DC_MASK,
    DC_SHIFT,
    DEADING,
    DONE,
    G_ACKED,
    G_CURSOR,
    G_DEAD_LETTERED,
    G_EXPIRED,
    G_FLOOR,
    G_NACKED,
    G_NEXT_EXPIRY,
    G_SERIAL,
    G_WORDS,
    GI_BITS,
    GI_MASK,
    LEASED,
    NO_OWNER,
    OWNER_MASK,
    OWNER_SHIFT,
    Q_NEXT_OFFSET,
    Q_ORPHANS,
    Q_SETTLE_SEQ,
    READY,
    S_GROUPS,
    STATE_DC_MASK,
    STATE_MASK,
    TIME_SHIFT,
    UNTIMED_MASK,
)

_settle_c = None if ext is None else ext.settle_range  # settle_range's compiled twin (shmq.accel)


def settle_range(w: Any, sl: int, cap: int, sw: int, lw: int, start: int, end: int) -> int:
    """A commit's stores: lease word ``lw`` of the slots of offsets start .. end - 1 becomes
    DONE whatever its state (a delayed one keeps its due time), except a DEADING one, whose
    dead-letter copy in flight finishes on its own.  One store per word, in offset order.
    Returns how many DEADING words it left."""
    left = 0
    for o in range(start, end):
        base = sl + (o % cap) * sw + lw
        x = w[base]
        if not x:  # NEW
            w[base] = DONE
        elif x & STATE_MASK != DEADING:
            w[base] = settled(x)
        else:
            left += 1
            continue
        if crashpoints.active:
            crashpoints.hit("commit.word")
    return left
_ref_of, _offset_of, _deliveries_of = itemgetter(1), itemgetter(3), itemgetter(4)  # of a delivery

if TYPE_CHECKING:
    _Table = GroupTable  # the state and methods of ``Groups`` this mixin uses
else:
    _Table = object


class Settlement(_Table):
    """Settling leases and giving them back: a mixin of ``Groups``, on its ``GroupTable``."""

    # ------------------------------------------------------------ settling
    def settle(self, ref: int, offset: int, dc: int, action: int, owner: int, now: int,
               arg_ms: int = 0) -> int:
        """Nack / touch / dead-letter one delivery of the group ``ref`` names (acks go
        through ``ack``).  Returns OK, STALE or TO_DLQ.

        Valid only while the delivery's lease is held: the group is the one that
        delivered it, and the lease word is LEASED with the same delivery count.
        TO_DLQ: the word is now DEADING (owned by ``owner``); the caller copies the
        record to the dead-letter queue and then calls ``finish_dead``.
        """
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[Q_SETTLE_SEQ] += 1
        gi = self.live(ref)
        if gi < 0:
            return STALE
        w = self.w
        base = self.sl + (offset % self.cap) * self.sw
        lw = base + S_GROUPS + gi
        word = w[lw]
        g = self.gw + gi * G_WORDS
        if (word & STATE_DC_MASK != LEASED | (dc << DC_SHIFT) or w[base] != offset
                or offset >= w[Q_NEXT_OFFSET] or offset < w[g + G_FLOOR]):
            return STALE  # not LEASED, another delivery, or not this group's (below its floor)
        if action == TOUCH:  # the new deadline may come before every other: lower the bound
            deadline = now + arg_ms
            w[lw] = (word & UNTIMED_MASK) | (deadline << TIME_SHIFT)
            if crashpoints.active:
                crashpoints.hit("touch.extended")
            if deadline < w[g + G_NEXT_EXPIRY]:
                w[g + G_NEXT_EXPIRY] = deadline
            return OK
        if action == NACK:
            w[g + G_NACKED] += 1
            return self._give_back(gi, lw, word, owner, now + arg_ms)
        w[lw] = DEADING | (dc << DC_SHIFT) | (owner << OWNER_SHIFT)  # DEAD
        if crashpoints.active:
            crashpoints.hit("dead.marked")
        return TO_DLQ

    def ack(self, ref: int, offset: int, dc: int) -> int:
        """settle(ACK) and advance_floor in one step (the hot path): STALE, OK or FREED."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[Q_SETTLE_SEQ] += 1
        w = self.w
        gi = ref & GI_MASK
        g = self.gw + gi * G_WORDS
        if w[g + G_SERIAL] != ref >> GI_BITS:  # the group is gone
            return STALE
        sl, cap, sw = self.sl, self.cap, self.sw
        base = sl + (offset % cap) * sw
        lw = S_GROUPS + gi
        word = w[base + lw]
        if (word & STATE_DC_MASK != LEASED | (dc << DC_SHIFT) or w[base] != offset
                or offset >= w[Q_NEXT_OFFSET] or offset < w[g + G_FLOOR]):
            return STALE  # (below the floor: a word left by an old group at this index)
        w[base + lw] = DONE | (dc << DC_SHIFT)
        if crashpoints.active:
            crashpoints.hit("ack.done")
        w[g + G_ACKED] += 1
        return FREED if self.advance_floor(gi) else OK

    def ack_batch(self, deliveries: Sequence[Sequence[Any]], stale: list[int]) -> bool:
        """ACK many deliveries, each a sequence whose items 1, 3, 4 are (group reference,
        offset, deliveries) -- the API's Message is one.  Offsets of stale ones go to ``stale``.
        True when queue storage was freed."""
        refs = set(map(_ref_of, deliveries))  # the usual batch: one group's, at C speed
        if len(refs) == 1 and min(refs) >= 0:
            return self.ack_offsets(refs.pop(), list(map(_offset_of, deliveries)),
                                    list(map(_deliveries_of, deliveries)), stale)
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for d in deliveries:
            if d[1] < 0:
                stale.append(d[3])
                continue
            offs, dcs = by_group.setdefault(d[1], ([], []))
            offs.append(d[3])
            dcs.append(d[4])
        freed = False
        for ref, (offs, dcs) in by_group.items():
            freed = self.ack_offsets(ref, offs, dcs, stale) or freed
        return freed

    def ack_offsets(self, ref: int, offsets: list[int], dcs: list[int], stale: list[int]) -> bool:
        """ACK the deliveries (offsets[i], dcs[i]) of the group ``ref`` names; offsets that
        are not leased with that delivery count go to ``stale`` (all of them when the
        group is gone).  True when storage was freed."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[Q_SETTLE_SEQ] += 1
        gi = self.live(ref)
        if gi < 0:
            stale.extend(offsets)
            return False
        w = self.w
        sl, cap, sw = self.sl, self.cap, self.sw
        tail = w[Q_NEXT_OFFSET]
        g = self.gw + gi * G_WORDS
        floor = w[g + G_FLOOR]
        n = len(offsets)
        if n > 1:  # the common case: consecutive offsets, no wrap -> strided slices
            o0 = offsets[0]
            i0 = o0 % cap
            if i0 + n <= cap and max(offsets) < tail and min(offsets) >= floor:
                b0 = sl + i0 * sw
                end = b0 + n * sw
                lw = b0 + S_GROUPS + gi
                dc = dcs[0]
                leased = LEASED | (dc << DC_SHIFT)  # with this delivery count
                # a run leased together has one lease word: compare the few distinct ones
                if (dcs.count(dc) == n and w[b0:end:sw].tolist() == offsets
                        and all(x & STATE_DC_MASK == leased for x in set(w[lw:end:sw]))):
                    w[lw:end:sw] = array("Q", [leased | DONE]) * n  # LEASED (1) -> DONE (3)
                    if crashpoints.active:
                        crashpoints.hit("ack_range.done")
                    w[g + G_ACKED] += n
                    # the floor may jump over the whole run: every word of it is DONE now
                    return self.advance_floor(gi, o0 + n if o0 <= w[g + G_FLOOR] else 0)
        acked = 0
        for offset, dc in zip(offsets, dcs, strict=True):
            base = sl + (offset % cap) * sw
            lw = base + S_GROUPS + gi
            if (w[lw] & STATE_DC_MASK != LEASED | (dc << DC_SHIFT) or w[base] != offset or offset >= tail
                    or offset < floor):
                stale.append(offset)
                continue
            w[lw] = DONE | (dc << DC_SHIFT)
            acked += 1
            if crashpoints.active:
                crashpoints.hit("ack_batch.partial")
        if not acked:
            return False
        w[g + G_ACKED] += acked
        return self.advance_floor(gi)

    def _give_back(self, gi: int, lw: int, word: int, owner: int, ready_at: int) -> int:
        """A LEASED word returns to the group, or heads for the dead-letter queue.

        The hints are raised before the word is stored, so a crash in between
        leaves them too high (a wasted scan), never too low (a stranded message).
        """
        w = self.w
        dc = (word >> DC_SHIFT) & DC_MASK
        if dc >= self.give_up_at:
            w[lw] = DEADING | (dc << DC_SHIFT) | (owner << OWNER_SHIFT)
            return TO_DLQ
        self._ready_hint(self.gw + gi * G_WORDS, w[lw - S_GROUPS - gi], ready_at)  # (S_OFFSET of the slot)
        if crashpoints.active:
            crashpoints.hit("nack.hints")
        w[lw] = READY | (dc << DC_SHIFT) | (ready_at << TIME_SHIFT)
        return OK

    def finish_dead(self, gi: int, offset: int, dc: int) -> bool:
        """A DEADING message reached the dead-letter queue: mark it DONE.  True if storage freed."""
        w = self.w
        base = self.sl + (offset % self.cap) * self.sw
        lw = base + S_GROUPS + gi
        if w[base] != offset or w[lw] & STATE_MASK != DEADING or (w[lw] >> DC_SHIFT) & DC_MASK != dc:
            return False
        w[lw] = DONE | (dc << DC_SHIFT)
        g = self.gw + gi * G_WORDS
        w[g + G_DEAD_LETTERED] += 1
        return offset == w[g + G_FLOOR] and self.advance_floor(gi)

    def orphan_dead(self, gi: int, offset: int, dc: int) -> None:
        """Give up a DEADING word we could not copy now: anyone's next reap retries it
        (``Q_ORPHANS`` is raised first, so no orphan is ever left without the flag)."""
        w = self.w
        base = self.sl + (offset % self.cap) * self.sw
        lw = base + S_GROUPS + gi
        if w[base] == offset and w[lw] & STATE_MASK == DEADING:
            w[Q_ORPHANS] = 1
            if crashpoints.active:
                crashpoints.hit("dlq.orphaned")
            w[lw] = DEADING | (dc << DC_SHIFT) | (NO_OWNER << OWNER_SHIFT)

    def commit(self, gi: int, offset: int) -> bool:
        """Settle everything of this group below ``offset`` (a consumer-managed position, as
        Kafka's commit): those messages become DONE whatever their state (a lease on one of
        them turns stale), and the cursor moves past them.  True when storage was freed."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[Q_SETTLE_SEQ] += 1
        w = self.w
        g = self.gw + gi * G_WORDS
        end = min(offset, w[Q_NEXT_OFFSET])
        lw = S_GROUPS + gi
        if _settle_c is not None:
            left = _settle_c(self.mm, self.sl, self.cap, self.sw, lw, w[g + G_FLOOR], end)
        else:
            left = settle_range(w, self.sl, self.cap, self.sw, lw, w[g + G_FLOOR], end)
        if crashpoints.active:
            crashpoints.hit("commit.words")
        if w[g + G_CURSOR] < end:
            w[g + G_CURSOR] = end
        return self.advance_floor(gi, 0 if left else end)

    # ------------------------------------------------------------ reaping
    def expire(self, gi: int, now: int, owner: int, dead: list[DeadItem]) -> int:
        """Return this group's expired leases; the number returned."""
        w = self.w
        g = self.gw + gi * G_WORDS
        lw = S_GROUPS + gi
        o, end = w[g + G_FLOOR], w[g + G_CURSOR]
        next_expiry = 0
        n = 0
        while o < end:
            base = self.sl + (o % self.cap) * self.sw + lw
            word = w[base]
            if word & STATE_MASK == LEASED:
                t = word >> TIME_SHIFT
                if t <= now:
                    if self._give_back(gi, base, word, owner, now) == TO_DLQ:
                        dead.append((gi, o, (word >> DC_SHIFT) & DC_MASK, "expired"))
                    n += 1
                    if crashpoints.active:
                        crashpoints.hit("expire.given_back")
                elif not next_expiry or t < next_expiry:
                    next_expiry = t
            o += 1
        w[g + G_NEXT_EXPIRY] = next_expiry
        w[g + G_EXPIRED] += n
        return n

    def reap_owner(self, dead_client: int, owner: int, now: int, dead: list[DeadItem]) -> int:
        """Return every lease of a dead client (and retry its unfinished dead-letters).
        Leases live in [floor, cursor): the words past the cursor are NEW.  With
        ``dead_client`` NO_OWNER: retry the orphaned dead-letter copies."""
        w = self.w
        n = 0
        why = ("orphaned: its dead-letter queue was full" if dead_client == NO_OWNER
               else "owner died while dead-lettering")
        for gi, _name in self.active():
            g = self.gw + gi * G_WORDS
            lw = S_GROUPS + gi
            for o in range(w[g + G_FLOOR], w[g + G_CURSOR]):
                base = self.sl + (o % self.cap) * self.sw + lw
                word = w[base]
                state = word & STATE_MASK
                if (word >> OWNER_SHIFT) & OWNER_MASK != dead_client:
                    continue
                if state == LEASED:
                    if self._give_back(gi, base, word, owner, now) == TO_DLQ:
                        dead.append((gi, o, (word >> DC_SHIFT) & DC_MASK, "owner died"))
                    n += 1
                    if crashpoints.active:
                        crashpoints.hit("reap.partial")
                elif state == DEADING:
                    w[base] = (word & ~(OWNER_MASK << OWNER_SHIFT)) | (owner << OWNER_SHIFT)
                    dead.append((gi, o, (word >> DC_SHIFT) & DC_MASK, why))
        return n
