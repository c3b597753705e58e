"""The group table of a queue: its entries, group references, floors and the free offset.

``GroupTable`` is the base class of ``shmq.core.groups.Groups`` (which adds the mixins
``Delivery`` and ``Settlement``, typed against this class), whose docstring has the
invariants every method keeps and the rules they all follow (the consumer lock is held,
the time is ``now``).  Here: the queue's geometry, creating and deleting groups, the
references deliveries carry, moving a group's floor past DONE words and the queue's free
offset after it, the READY hints both mixins raise, and a group's counters.

Deliveries name their group by reference (``layout.group_ref``: the index and the
group's serial), and every settle checks the serial first: a group deleted and
created again reuses an index, and a lease of the old group must not settle a
delivery of the new one that happens to have the same offset and delivery count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shmq import crashpoints, options
from shmq.core.layout import (
    DC_MASK,
    DC_SHIFT,
    DONE,
    F_TTL_DROP,
    G_ACKED,
    G_CREATED_NS,
    G_CURSOR,
    G_DEAD_LETTERED,
    G_EXPIRED,
    G_FLOOR,
    G_NACKED,
    G_NAME,
    G_NAME_LEN,
    G_NEXT_READY,
    G_READY_LO,
    G_REDELIVER,
    G_REDELIVERED,
    G_SERIAL,
    G_STATE,
    G_TTL_EXPIRED,
    G_WORDS,
    GI_BITS,
    GI_MASK,
    GS_ACTIVE,
    GS_FREE,
    LEASED,
    NEW,
    Q_DELAY_MAX,
    Q_DURABLE_OFFSET,
    Q_FREE_OFFSET,
    Q_GROUP_GEN,
    Q_NEXT_OFFSET,
    Q_SETTLE_SEQ,
    READY,
    S_GROUPS,
    STATE_DC_MASK,
    STATE_MASK,
    TIME_SHIFT,
    UNTIMED_MASK,
    WORD,
    group_ref,
)
from shmq.core.ring import Ring
from shmq.errors import GroupExists, GroupNotFound, InvalidArgument, LimitExceeded
from shmq.settle import Settle

_ALWAYS = options.DURABILITY_MODES.index("always")

OK = 0
STALE = 1
TO_DLQ = 2
FREED = 3

ACK, NACK, TOUCH, DEAD = Settle  # settle actions, as plain names for the hot paths

# dead-letter work item: (group index, offset, deliveries, reason)
DeadItem = tuple[int, int, int, str]

assert options.MAX_GROUPS_LIMIT <= GI_MASK + 1  # a group reference holds any index

_TIME_BITS = ((1 << 64) - 1) & ~UNTIMED_MASK  # a lease word's time
_DC_BITS = DC_MASK << DC_SHIFT  # a lease word's delivery count


def settled(word: int) -> int:
    """The DONE word that settles ``word`` without a delivery (a commit, a seek, a group's
    start): its delivery count kept and, for a delayed message never delivered (READY or
    DONE with 0 deliveries), its due time, so that ``reopened`` can wait for it again."""
    if word & STATE_DC_MASK in (READY, DONE):
        return DONE | (word & _TIME_BITS)
    return DONE | (word & _DC_BITS)


def reopened(word: int, now: int) -> int:
    """A settled ``word`` delivered again (a seek back) at ``now``, or at its due time when
    it is a delayed message settled before its first delivery (``settled``): READY.  One
    never delivered and not delayed is due at time 0: READY with 0 deliveries and a later
    time is what a delayed message looks like, which a group made at this index would keep
    waiting, and the checker holds to Q_DELAY_MAX."""
    if word & STATE_DC_MASK == DONE and word & _TIME_BITS:
        return READY | (word & _TIME_BITS)
    dc = word & _DC_BITS
    return READY | dc | ((now if dc else 0) << TIME_SHIFT)


class GroupTable:
    """The group table's entries and the queue's geometry: the state of ``Groups``, and
    what its mixins (``Delivery``, ``Settlement``) are typed against."""

    def __init__(self, ring: Ring, wall_ns: Callable[[], int] = time.time_ns) -> None:
        self.ring = ring
        self.w = ring.w
        self.mm = ring.mm
        self.cap = ring.capacity
        self.sw = ring.slot_words
        self.sl = ring.slots_w
        self.gw = ring.groups_w
        self.size = ring.size
        self.data_off = ring.data_off
        self._geom = (self.sl, self.cap, self.sw, self.size, self.data_off, self.mm)
        self.max_groups = ring.max_groups
        self.max_deliveries = ring.max_deliveries
        self._gen = -1  # Q_GROUP_GEN that _active_bases was computed for
        self._active_bases: list[int] = []
        # the Q_GROUP_GEN for which this is the queue's only group, else -1: one attribute,
        # so that the compiled acks, which read it without the lock, never see a refresh
        # of another thread's half made
        self.lone_gen = -1
        # ``always`` queues deliver only what is journaled (Q_DURABLE_OFFSET); the others
        # everything published (Q_NEXT_OFFSET)
        self.tail_word = Q_DURABLE_OFFSET if ring.durability == _ALWAYS else Q_NEXT_OFFSET
        # journaled queues keep messages in memory until the journal has them
        self.journaled = ring.durability != 0
        # a message given back this often goes to the dead-letter queue; a dead-letter
        # queue's own messages (no limit) are moved to its tail before the 8-bit delivery
        # count would saturate, so a stale lease can never match a newer delivery
        self.give_up_at = ring.max_deliveries or DC_MASK
        # TTL: a message whose S_TIMESTAMP (wall ns) is this old when first delivered to a
        # group expires for it (0: never); dropped, or dead-lettered (``delivery``)
        self.ttl_ns = ring.message_ttl_ms * 1_000_000
        self.ttl_drop = bool(ring.flags & F_TTL_DROP)
        self.wall_ns = wall_ns  # the clock of the producers' timestamps, which TTLs count from

    # ------------------------------------------------------------ group table
    def _name(self, gi: int) -> str:
        g = self.gw + gi * G_WORDS
        n = self.w[g + G_NAME_LEN]
        return bytes(self.mm[(g + G_NAME) * WORD:(g + G_NAME) * WORD + n]).decode()

    def active(self) -> list[tuple[int, str]]:
        w = self.w
        return [(gi, self._name(gi)) for gi in range(self.max_groups)
                if w[self.gw + gi * G_WORDS + G_STATE] == GS_ACTIVE]

    def index(self, name: str) -> int:
        for gi, gname in self.active():
            if gname == name:
                return gi
        return -1

    def create(self, name: str, start: str | int) -> int:
        """A new group at the first free index: its fields and lease words are written
        while it is FREE; its serial, ACTIVE and the new generation come last.  A crash
        between those stores is mended by ``repair`` (a fresh generation).  ``start``:
        "earliest", "latest" or an offset (clamped to the retained ones, or the next)."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[Q_SETTLE_SEQ] += 1
        if start not in ("earliest", "latest") and type(start) is not int:
            raise InvalidArgument("start must be 'earliest' or 'latest'")
        if self.index(name) >= 0:
            raise GroupExists(f"group {name!r} exists on queue {self.ring.name!r}")
        w = self.w
        for gi in range(self.max_groups):
            g = self.gw + gi * G_WORDS
            if w[g + G_STATE] != GS_FREE:
                continue
            mm = self.mm
            mm[g * WORD:(g + G_WORDS) * WORD] = bytes(G_WORDS * WORD)
            tail = w[Q_NEXT_OFFSET]
            free = w[Q_FREE_OFFSET]
            first = (free if start == "earliest" else tail if start == "latest"
                     else min(max(int(start), free), tail))
            lw = S_GROUPS + gi
            for o in range(free, tail):  # a reused index may hold an old group's words
                b = self.sl + (o % self.cap) * self.sw + lw
                x = w[b]
                if o < first:
                    w[b] = settled(x)
                elif x & STATE_DC_MASK == DONE and x & _TIME_BITS:  # delayed, settled by the old group
                    w[b] = READY | (x & _TIME_BITS)
                elif x & STATE_DC_MASK != READY:  # READY, 0 deliveries: delayed (ring._delay)
                    w[b] = NEW
            w[g + G_CURSOR] = first
            w[g + G_FLOOR] = first
            w[g + G_CREATED_NS] = time.time_ns()
            raw = name.encode()
            w[g + G_NAME_LEN] = len(raw)
            mm[(g + G_NAME) * WORD:(g + G_NAME) * WORD + len(raw)] = raw
            gen = w[Q_GROUP_GEN] + 1
            w[g + G_SERIAL] = gen
            w[g + G_STATE] = GS_ACTIVE
            if crashpoints.active:
                crashpoints.hit("group.create.active")
            w[Q_GROUP_GEN] = gen
            return gi
        raise LimitExceeded(f"queue {self.ring.name!r} has {self.max_groups} groups already (max_groups)")

    def delete(self, gi: int) -> bool:
        """Remove a group; True when storage was freed."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[Q_SETTLE_SEQ] += 1
        self.w[self.gw + gi * G_WORDS + G_SERIAL] = 0  # its leases are stale from now on
        self.w[self.gw + gi * G_WORDS + G_STATE] = GS_FREE
        if crashpoints.active:
            crashpoints.hit("group.delete.freed")
        self.w[Q_GROUP_GEN] += 1
        return self._recompute_free()

    def ref(self, gi: int) -> int:
        """The reference deliveries of group ``gi`` carry (``layout.group_ref``)."""
        return group_ref(gi, self.w[self.gw + gi * G_WORDS + G_SERIAL])

    def live(self, ref: int) -> int:
        """The index of the group ``ref`` names, or -1 when that group is gone (deleted,
        maybe created again since)."""
        gi = ref & GI_MASK
        if ref < 0 or self.w[self.gw + gi * G_WORDS + G_SERIAL] != ref >> GI_BITS:
            return -1
        return gi

    # ------------------------------------------------------------ floors
    def advance_floor(self, gi: int, done_to: int = 0) -> bool:
        """Move the group's floor past DONE words; True when queue storage was freed.
        ``done_to``: the caller knows every word from the floor up to there is DONE."""
        w = self.w
        g = self.gw + gi * G_WORDS
        f = old = w[g + G_FLOOR]
        cur = w[g + G_CURSOR]
        if done_to > f:
            f = min(done_to, cur)
        lw = S_GROUPS + gi
        while f < cur and w[self.sl + (f % self.cap) * self.sw + lw] & STATE_MASK == DONE:
            f += 1
        if f == old:
            return False
        w[g + G_FLOOR] = f
        if crashpoints.active:
            crashpoints.hit("floor.moved")
        if self.journaled:  # the journal writer's mark may hold the free offset back
            return self._recompute_free()
        if old != w[Q_FREE_OFFSET]:  # another group holds the free offset back
            return False
        if w[Q_GROUP_GEN] == self.lone_gen:  # the only group: its floor is the free offset
            w[Q_FREE_OFFSET] = f
            return True
        return self._recompute_free()

    def _recompute_free(self) -> bool:
        w = self.w
        if w[Q_GROUP_GEN] != self._gen:  # refresh the list of active group bases
            self._gen = w[Q_GROUP_GEN]
            self._active_bases = [self.gw + gi * G_WORDS for gi in range(self.max_groups)
                                  if w[self.gw + gi * G_WORDS + G_STATE] == GS_ACTIVE]
            self.lone_gen = self._gen if len(self._active_bases) == 1 else -1
        low = w[Q_NEXT_OFFSET]
        if w[Q_DURABLE_OFFSET] < low:  # journaled queues free only what the journal has
            low = w[Q_DURABLE_OFFSET]
        for g in self._active_bases:
            if w[g + G_STATE] == GS_ACTIVE and w[g + G_FLOOR] < low:
                low = w[g + G_FLOOR]
        if low > w[Q_FREE_OFFSET]:
            w[Q_FREE_OFFSET] = low
            return True
        return False

    # ------------------------------------------------------------ hints
    def _ready_hint(self, g: int, offset: int, ready_at: int) -> None:
        """The READY hints of group entry ``g`` take in one more READY word, at ``offset``,
        deliverable at ``ready_at``: raised before the word is stored (too high a count is
        allowed, a wasted scan; too low is not, a stranded message)."""
        w = self.w
        if not w[g + G_REDELIVER] or offset < w[g + G_READY_LO]:
            w[g + G_READY_LO] = offset
        nr = w[g + G_NEXT_READY]
        if not w[g + G_REDELIVER] or ready_at < nr:
            w[g + G_NEXT_READY] = ready_at
        w[g + G_REDELIVER] += 1

    # ------------------------------------------------------------ reading
    def stats(self, gi: int, now: int = 0) -> dict[str, int]:
        """The group's numbers; ``delayed``: messages put with a delay that are not due
        at ``now`` (they count in ``depth`` too)."""
        w = self.w
        g = self.gw + gi * G_WORDS
        lw = S_GROUPS + gi
        in_flight = ready = delayed = 0
        for o in range(w[g + G_FLOOR], w[g + G_CURSOR]):
            word = w[self.sl + (o % self.cap) * self.sw + lw]
            state = word & STATE_MASK
            if state == LEASED:
                in_flight += 1
            elif state == READY:
                ready += 1
                if word & STATE_DC_MASK == READY and word >> TIME_SHIFT > now:
                    delayed += 1
        if w[Q_DELAY_MAX] > now:  # some may wait past the cursor
            for o in range(w[g + G_CURSOR], w[Q_NEXT_OFFSET]):
                word = w[self.sl + (o % self.cap) * self.sw + lw]
                if word & STATE_DC_MASK == READY and word >> TIME_SHIFT > now:
                    delayed += 1
        backlog = w[Q_NEXT_OFFSET] - w[g + G_CURSOR]
        return {"delayed": delayed,
            "depth": backlog + ready, "backlog": backlog, "ready": ready, "in_flight": in_flight,
            "cursor": w[g + G_CURSOR], "floor": w[g + G_FLOOR],
            "acked": w[g + G_ACKED], "nacked": w[g + G_NACKED],
            "redelivered": w[g + G_REDELIVERED], "dead_lettered": w[g + G_DEAD_LETTERED],
            "expired": w[g + G_EXPIRED], "ttl_expired": w[g + G_TTL_EXPIRED],
        }

    def require(self, name: str) -> int:
        gi = self.index(name)
        if gi < 0:
            raise GroupNotFound(f"no group {name!r} on queue {self.ring.name!r}")
        return gi
