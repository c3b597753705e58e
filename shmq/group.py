"""The consumer side of a queue: groups, leases, acknowledgements, redelivery.

Every method here is called with the queue's consumer lock held (``Ring.clock``)
and takes the time as ``now`` (monotonic ms), so tests drive the clock.

Each message has one lease word per group (drawn in ``layout``).  A state
change of a message is one store of its lease word; the group fields that
follow from it (cursor, floor, hints, counters) are written after it.

Invariants, for every active group (``shmq.check`` verifies them all)::

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

Deliveries name their group by reference (``layout.group_ref``: the index and the
group's serial), and every settle checks the serial first: a group deleted and
created again reuses an index, and a lease of the old group must not settle a
delivery of the new one that happens to have the same offset and delivery count.
"""

from __future__ import annotations

import time
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

from . import crashpoints, options
from . import layout as L
from .errors import GroupNotFound, InvalidArgument, LimitExceeded, QueueExists
from .ring import Ring
from .settle import Settle

_ALWAYS = options.DURABILITY_MODES.index("always")

OK = 0
STALE = 1
TO_DLQ = 2
FREED = 3

ACK, NACK, TOUCH, DEAD = Settle  # settle actions, as plain names for the hot paths

_LEASED, _READY, _DONE, _DEADING, _NEW = L.LEASED, L.READY, L.DONE, L.DEADING, L.NEW

_unpack_slot = L.SLOT_HEAD.unpack_from

_CRASH = crashpoints.watch(__name__)

# dead-letter work item: (group index, offset, deliveries, reason)
DeadItem = tuple[int, int, int, str]

assert options.MAX_GROUPS_LIMIT <= L.GI_MASK + 1  # a group reference holds any index


def _within(lens: list[int], used: int, max_bytes: int, got: int) -> tuple[int, int]:
    """How many of these records (slots' S_LENS words: payload | metadata length << 32)
    fit a byte budget of which ``used`` is spent, at least one when nothing was taken
    yet (``got`` == 0); and the budget spent once they are taken."""
    cum = list(accumulate([(x & 0xFFFFFFFF) + (x >> 32) for x in lens], initial=used))
    k = max(bisect_right(cum, max_bytes) - 1, 0)
    if not k and not got:
        k = 1
    return k, cum[k]


class Groups:
    def __init__(self, ring: Ring) -> None:
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
        self._lone = False
        # ``always`` queues deliver only what is journaled (Q_DURABLE_OFFSET); the others
        # everything published (Q_NEXT_OFFSET)
        self.tail_word = L.Q_DURABLE_OFFSET if ring.durability == _ALWAYS else L.Q_NEXT_OFFSET
        # journaled queues keep messages in memory until the journal has them
        self.journaled = ring.durability != 0
        # A consumer killed inside the consumer lock left the group table half-updated:
        # the next holder re-derives it from the lease words.
        ring.clock.on_recover = self.repair
        # a message given back this often goes to the dead-letter queue; a dead-letter
        # queue's own messages (no limit) are moved to its tail before the 8-bit delivery
        # count would saturate, so a stale lease can never match a newer delivery
        self.give_up_at = ring.max_deliveries or L.DC_MASK

    # ------------------------------------------------------------ group table
    def _name(self, gi: int) -> str:
        g = self.gw + gi * L.G_WORDS
        n = self.w[g + L.G_NAME_LEN]
        return bytes(self.mm[(g + L.G_NAME) * 8:(g + L.G_NAME) * 8 + n]).decode()

    def active(self) -> list[tuple[int, str]]:
        w = self.w
        return [(gi, self._name(gi)) for gi in range(self.max_groups)
                if w[self.gw + gi * L.G_WORDS + L.G_STATE] == L.GS_ACTIVE]

    def index(self, name: str) -> int:
        for gi, gname in self.active():
            if gname == name:
                return gi
        return -1

    def create(self, name: str, start: str) -> int:
        """A new group at the first free index: its fields and lease words are written
        while it is FREE; its serial, ACTIVE and the new generation come last.  A crash
        between those stores is mended by ``repair`` (a fresh generation)."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[L.Q_SETTLE_SEQ] += 1
        if start not in ("earliest", "latest"):
            raise InvalidArgument("start must be 'earliest' or 'latest'")
        if self.index(name) >= 0:
            raise QueueExists(f"group {name!r} exists on queue {self.ring.name!r}")
        w = self.w
        for gi in range(self.max_groups):
            g = self.gw + gi * L.G_WORDS
            if w[g + L.G_STATE] != L.GS_FREE:
                continue
            mm = self.mm
            mm[g * 8:(g + L.G_WORDS) * 8] = bytes(L.G_WORDS * 8)
            tail = w[L.Q_NEXT_OFFSET]
            free = w[L.Q_FREE_OFFSET]
            first = free if start == "earliest" else tail
            lw = L.S_GROUPS + gi
            for o in range(free, tail):  # a reused index may hold an old group's words
                w[self.sl + (o % self.cap) * self.sw + lw] = L.NEW if o >= first else L.DONE
            w[g + L.G_CURSOR] = first
            w[g + L.G_FLOOR] = first
            w[g + L.G_CREATED_NS] = time.time_ns()
            raw = name.encode()
            w[g + L.G_NAME_LEN] = len(raw)
            mm[(g + L.G_NAME) * 8:(g + L.G_NAME) * 8 + len(raw)] = raw
            gen = w[L.Q_GROUP_GEN] + 1
            w[g + L.G_SERIAL] = gen
            w[g + L.G_STATE] = L.GS_ACTIVE
            if _CRASH:
                crashpoints.hit("group.create.active")
            w[L.Q_GROUP_GEN] = gen
            return gi
        raise LimitExceeded(f"queue {self.ring.name!r} has {self.max_groups} groups already (max_groups)")

    def delete(self, gi: int) -> bool:
        """Remove a group; True when storage was freed."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[L.Q_SETTLE_SEQ] += 1
        self.w[self.gw + gi * L.G_WORDS + L.G_SERIAL] = 0  # its leases are stale from now on
        self.w[self.gw + gi * L.G_WORDS + L.G_STATE] = L.GS_FREE
        if _CRASH:
            crashpoints.hit("group.delete.freed")
        self.w[L.Q_GROUP_GEN] += 1
        return self._recompute_free()

    def ref(self, gi: int) -> int:
        """The reference deliveries of group ``gi`` carry (``layout.group_ref``)."""
        return L.group_ref(gi, self.w[self.gw + gi * L.G_WORDS + L.G_SERIAL])

    def live(self, ref: int) -> int:
        """The index of the group ``ref`` names, or -1 when that group is gone (deleted,
        maybe created again since)."""
        gi = ref & L.GI_MASK
        if ref < 0 or self.w[self.gw + gi * L.G_WORDS + L.G_SERIAL] != ref >> L.GI_BITS:
            return -1
        return gi

    # ------------------------------------------------------------ journal snapshot
    _COUNTERS = (L.G_ACKED, L.G_NACKED, L.G_REDELIVERED, L.G_DEAD_LETTERED, L.G_EXPIRED, L.G_CREATED_NS)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every active group's state, for the journal; call under the consumer lock.

        ``words`` holds, for each offset in [floor, cursor), its lease state and
        delivery count (``state | deliveries << 3``); owners and deadlines are not
        kept: after a recovery every lease is given back."""
        w = self.w
        out = []
        for gi, name in self.active():
            g = self.gw + gi * L.G_WORDS
            floor, cursor = w[g + L.G_FLOOR], w[g + L.G_CURSOR]
            words: list[int] = []
            o = floor
            while o < cursor:  # one strided run per stretch that does not wrap the slot table
                i0 = o % self.cap
                k = min(cursor - o, self.cap - i0)
                b = self.sl + i0 * self.sw + L.S_GROUPS + gi
                words.extend(x & 0x7FF for x in w[b:b + k * self.sw:self.sw].tolist())
                o += k
            out.append({"name": name, "floor": floor, "cursor": cursor, "words": words,
                        "counters": [w[g + c] for c in self._COUNTERS]})
        return out

    def restore(self, groups: list[dict[str, Any]], first: int, tail: int) -> None:
        """Rebuild the group table from a snapshot (recovery, before the queue is
        published).  Offsets below a group's floor are DONE for it; leased ones come
        back READY with their delivery counts; cursors and floors are clamped into
        [first, tail]."""
        w = self.w
        for gi in range(self.max_groups):
            w[self.gw + gi * L.G_WORDS + L.G_STATE] = L.GS_FREE
        for gi, st in enumerate(groups[:self.max_groups]):
            g = self.gw + gi * L.G_WORDS
            self.mm[g * 8:(g + L.G_WORDS) * 8] = bytes(L.G_WORDS * 8)
            floor = min(max(int(st["floor"]), first), tail)
            cursor = min(max(int(st["cursor"]), floor), tail)
            lw = L.S_GROUPS + gi
            for o in range(first, floor):
                w[self.sl + (o % self.cap) * self.sw + lw] = L.DONE
            ready = 0
            words = st["words"]
            base = int(st["floor"])
            for o in range(floor, cursor):
                i = o - base
                word = words[i] if 0 <= i < len(words) else L.NEW
                state, dc = word & L.STATE_MASK, (word >> L.DC_SHIFT) & L.DC_MASK
                if state == L.DONE:
                    new = L.DONE
                else:  # LEASED, READY, DEADING (NEW: a gap): given back, deliverable now
                    new = L.lease_word(L.READY, dc, L.NO_OWNER, 0)
                    ready += 1
                slot = self.sl + (o % self.cap) * self.sw
                if w[slot + L.S_GROUPS + gi] != L.DONE:  # a hole (never journaled) stays DONE
                    w[slot + lw] = new
            for c, v in zip(self._COUNTERS, st.get("counters", ()), strict=False):
                w[g + c] = int(v)
            w[g + L.G_CURSOR] = cursor
            w[g + L.G_FLOOR] = floor
            w[g + L.G_REDELIVER] = ready
            w[g + L.G_READY_LO] = floor
            raw = str(st["name"]).encode()
            w[g + L.G_NAME_LEN] = len(raw)
            self.mm[(g + L.G_NAME) * 8:(g + L.G_NAME) * 8 + len(raw)] = raw
            w[g + L.G_STATE] = L.GS_ACTIVE
        w[L.Q_GROUP_GEN] += 1
        restored = range(min(len(groups), self.max_groups))
        for gi in restored:
            w[self.gw + gi * L.G_WORDS + L.G_SERIAL] = w[L.Q_GROUP_GEN]
        self._recompute_free()
        for gi in restored:
            self.advance_floor(gi)

    # ------------------------------------------------------------ delivery
    def deliver(self, gi: int, owner: int, now: int, max_n: int, vis_ms: int,
                out: list[Any], dead: list[DeadItem], cls: type = tuple,
                prefix: tuple[Any, ...] = (), max_bytes: int = 0) -> None:
        """Lease up to max_n messages to owner.

        Appends ``cls((*prefix, offset, deliveries, payload, metadata, timestamp_ns))`` to
        ``out`` (``cls`` a tuple type: the API's Message is built here, once).
        Expired leases of this group are returned first (into ``dead`` when they
        have no deliveries left).  Redeliveries come before new messages.
        ``max_bytes``: stop before the payloads and metadata taken pass it (but take at
        least one message); 0: no limit.
        """
        w = self.w
        g = self.gw + gi * 32
        ne = w[g + 5]  # G_NEXT_EXPIRY
        if ne and now >= ne:
            self.expire(gi, now, owner, dead)
            ne = w[g + 5]
        if w[g + 3] and now >= w[g + 4]:  # G_REDELIVER, G_NEXT_READY
            if self._redeliver(gi, owner, now, max_n, vis_ms, out, cls, prefix, max_bytes):
                return  # the byte budget is spent: new messages wait behind the redeliveries
        cur = w[g + 1]
        tail = w[self.tail_word]  # Q_NEXT_OFFSET, or Q_DURABLE_OFFSET of an `always` queue
        got = len(out)
        if cur >= tail or got >= max_n:
            return
        used = sum(len(m[-3]) + len(m[-2]) for m in out) if max_bytes else 0
        sl, cap, sw, size, data, mm = self._geom
        lw = 4 + gi
        deadline = now + vis_ms
        word = 9 | (owner << 11) | (deadline << 24)  # LEASED, 1 delivery
        new = tuple.__new__
        append = out.append
        unpack = _unpack_slot
        skipped = False
        while cur < tail and got < max_n:
            # one run of slots that does not wrap: read and lease it with strided slices
            i0 = cur % cap
            k = tail - cur
            if max_n - got < k:
                k = max_n - got
            if cap - i0 < k:
                k = cap - i0
            b0 = sl + i0 * sw
            end = b0 + k * sw
            if k > 1 and not any(w[b0 + lw:end:sw].tolist()):
                if max_bytes:  # as many as the byte budget holds (at least one in all)
                    k, used = _within(w[b0 + 2:end:sw].tolist(), used, max_bytes, got)
                    if not k:
                        break
                    end = b0 + k * sw
                w[b0 + lw:end:sw] = array("Q", [word]) * k
                runs = zip(range(cur, cur + k), w[b0 + 1:end:sw].tolist(),
                           w[b0 + 2:end:sw].tolist(), w[b0 + 3:end:sw].tolist(), strict=True)
                got += k
                cur += k
            else:  # one at a time, stepping over DONE words (settled without a delivery)
                if w[b0 + lw]:
                    cur += 1
                    skipped = True
                    continue
                if max_bytes:
                    k, used = _within([w[b0 + 2]], used, max_bytes, got)
                    if not k:
                        break
                cur += 1
                w[b0 + lw] = word
                got += 1
                runs = (unpack(mm, b0 * 8),)  # type: ignore[assignment]
            for o, pos, lens, ts in runs:
                start = data + pos % size
                mlen = lens >> 32
                if mlen:
                    append(new(cls, (*prefix, o, 1, mm[start + mlen:start + mlen + (lens & 0xFFFFFFFF)],
                                     mm[start:start + mlen], ts)))
                else:
                    append(new(cls, (*prefix, o, 1, mm[start:start + lens], b"", ts)))
        if _CRASH:
            crashpoints.hit("deliver.run.leased")
        w[g + 1] = cur
        if _CRASH:
            crashpoints.hit("deliver.cursor")
        if not ne or deadline < ne:
            w[g + 5] = deadline
        if skipped:  # the floor may stand on one of them
            self.advance_floor(gi)

    def deliver_one(self, gi: int, ref: int, word: int, now: int, cls: type, q: Any, group: str) -> Any:
        """The hot path of ``deliver`` for a single new message; None when the general
        path is needed (expiry due, redeliveries pending, nothing new, crash leftovers).
        ``word`` is the LEASED lease word (1 delivery, owner, deadline) to store; ``ref``
        the group's reference, for the message."""
        w = self.w
        g = self.gw + gi * 32
        ne = w[g + 5]  # G_NEXT_EXPIRY
        cur = w[g + 1]  # G_CURSOR
        if (ne and now >= ne) or w[g + 3] or cur >= w[self.tail_word]:
            return None
        base = self.sl + (cur % self.cap) * self.sw
        if w[base + 4 + gi]:  # DONE: settled without a delivery, stepped over by ``deliver``
            return None
        w[base + 4 + gi] = word
        if _CRASH:
            crashpoints.hit("deliver.one.leased")
        w[g + 1] = cur + 1
        deadline = word >> 24
        if not ne or deadline < ne:
            w[g + 5] = deadline
        _o, pos, lens, ts = _unpack_slot(self.mm, base * 8)
        start = self.data_off + pos % self.size
        mlen = lens >> 32
        if mlen:
            payload = self.mm[start + mlen:start + mlen + (lens & 0xFFFFFFFF)]
            return tuple.__new__(cls, (q, ref, group, cur, 1, payload, self.mm[start:start + mlen], ts))
        return tuple.__new__(cls, (q, ref, group, cur, 1, self.mm[start:start + lens], b"", ts))

    def deliver_block(self, gi: int, owner: int, now: int, max_n: int, vis_ms: int,
                      max_bytes: int = 0) -> tuple[int, list[int], list[int], bytes] | None:
        """The hot path of ``deliver`` for a batch: a run of at least two new messages
        without metadata, stored back to back, leased to ``owner`` (1 delivery) with
        strided slice stores.  Returns (first offset, timestamps, payload lengths, the
        payloads as one bytes): an empty run when there is nothing to deliver at all
        (nothing new, nothing given back, no lease expired); None when the general path
        is needed (an expiry due, redeliveries pending, one new, a run that wraps the
        slot table or the byte ring, metadata, a DONE word).  ``max_bytes``: a run
        whose payloads would pass it is cut short (0: no limit)."""
        w = self.w
        g = self.gw + gi * 32
        ne = w[g + 5]  # G_NEXT_EXPIRY
        if (ne and now >= ne) or w[g + 3]:  # an expiry is due / G_REDELIVER
            return None
        sl, cap, sw, size, data, mm = self._geom
        cur = w[g + 1]  # G_CURSOR
        i0 = cur % cap
        k = min(w[self.tail_word] - cur, max_n, cap - i0)
        if k < 2:
            return (cur, [], [], b"") if k <= 0 else None
        b0 = sl + i0 * sw
        end = b0 + k * sw
        lw = b0 + 4 + gi
        if any(w[lw:end:sw]):  # a DONE word (settled without a delivery): the general path
            return None
        lens = w[b0 + 2:end:sw].tolist()
        if max(lens) > 0xFFFFFFFF:  # some record has metadata
            return None
        if max_bytes and sum(lens) > max_bytes:
            k, _ = _within(lens, 0, max_bytes, 1)
            if k < 2:
                return None
            end = b0 + k * sw
            lens = lens[:k]
        p0 = w[b0 + 1]
        span = w[end - sw + 1] + lens[-1] - p0
        start = p0 % size
        if span != sum(lens) or start + span > size:  # not back to back in one lap
            return None
        deadline = now + vis_ms
        w[lw:end:sw] = array("Q", [9 | (owner << 11) | (deadline << 24)]) * k  # LEASED, 1 delivery
        if _CRASH:
            crashpoints.hit("deliver.block.leased")
        w[g + 1] = cur + k
        if not ne or deadline < ne:
            w[g + 5] = deadline
        return cur, w[b0 + 3:end:sw].tolist(), lens, mm[data + start:data + start + span]

    def _redeliver(self, gi: int, owner: int, now: int, max_n: int, vis_ms: int,
                   out: list[Any], cls: type, prefix: tuple[Any, ...], max_bytes: int = 0) -> bool:
        """Lease READY messages whose time has come, lowest offset first.

        Scans from the G_READY_LO hint and stops once max_n are taken (or ``max_bytes``
        would be passed: then it returns True), so a long run of given-back messages
        costs O(1) per delivery, not O(window).
        """
        w = self.w
        g = self.gw + gi * L.G_WORDS
        lw = L.S_GROUPS + gi
        cur = w[g + L.G_CURSOR]
        o = max(w[g + L.G_FLOOR], w[g + L.G_READY_LO])
        pending = 0
        next_ready = 0
        first_pending = -1
        deadline = now + vis_ms
        taken = 0
        used = 0
        spent = False
        full = len(out) >= max_n
        while o < cur and not full:
            base = self.sl + (o % self.cap) * self.sw + lw
            word = w[base]
            if word & 7 == _READY:
                t = word >> 24
                if t <= now:
                    if max_bytes:
                        fits, used = _within([w[base - lw + L.S_LENS]], used, max_bytes, len(out))
                        if not fits:
                            spent = True
                            break  # o stays READY (see "stopped early" below)
                    dc = ((word >> 3) & 0xFF) + 1  # at most DC_MASK: see give_up_at
                    w[base] = _LEASED | (dc << 3) | (owner << 11) | (deadline << 24)
                    if _CRASH:
                        crashpoints.hit("redeliver.leased")
                    payload, meta, ts = self.ring.record(o)
                    out.append(tuple.__new__(cls, (*prefix, o, dc, payload, meta, ts)))
                    taken += 1
                    full = len(out) >= max_n
                else:
                    pending += 1
                    if first_pending < 0:
                        first_pending = o
                    if not next_ready or t < next_ready:
                        next_ready = t
            o += 1
        if o >= cur:  # scanned to the end: the hints are exact now
            w[g + L.G_REDELIVER] = pending
            w[g + L.G_NEXT_READY] = next_ready
            w[g + L.G_READY_LO] = first_pending if first_pending >= 0 else cur
        else:  # stopped early: more may be READY from o on, due at any time (0: a true bound)
            w[g + L.G_REDELIVER] = max(w[g + L.G_REDELIVER] - taken, pending + 1)
            w[g + L.G_NEXT_READY] = 0
            w[g + L.G_READY_LO] = first_pending if first_pending >= 0 else o
        if taken:
            w[g + L.G_REDELIVERED] += taken
            ne = w[g + L.G_NEXT_EXPIRY]
            if not ne or deadline < ne:
                w[g + L.G_NEXT_EXPIRY] = deadline
        return spent

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
            self.w[L.Q_SETTLE_SEQ] += 1
        gi = self.live(ref)
        if gi < 0:
            return STALE
        w = self.w
        base = self.sl + (offset % self.cap) * self.sw
        lw = base + 4 + gi
        word = w[lw]
        g = self.gw + gi * L.G_WORDS
        if word & 0x7FF != 1 | (dc << 3) or w[base] != offset or offset >= w[24] or offset < w[g + 2]:
            return STALE  # not LEASED, another delivery, or not this group's (below its floor)
        if action == TOUCH:  # the new deadline may come before every other: lower the bound
            deadline = now + arg_ms
            w[lw] = (word & 0xFFFFFF) | (deadline << 24)
            if _CRASH:
                crashpoints.hit("touch.extended")
            if deadline < w[g + L.G_NEXT_EXPIRY]:
                w[g + L.G_NEXT_EXPIRY] = deadline
            return OK
        if action == NACK:
            w[g + L.G_NACKED] += 1
            return self._give_back(gi, lw, word, owner, now + arg_ms)
        w[lw] = _DEADING | (dc << 3) | (owner << 11)  # DEAD
        if _CRASH:
            crashpoints.hit("dead.marked")
        return TO_DLQ

    def ack(self, ref: int, offset: int, dc: int) -> int:
        """settle(ACK) and advance_floor in one step (the hot path): STALE, OK or FREED."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[L.Q_SETTLE_SEQ] += 1
        w = self.w
        gi = ref & 63  # L.GI_MASK
        g = self.gw + gi * 32
        if w[g + 22] != ref >> 6:  # G_SERIAL: the group is gone
            return STALE
        sl, cap, sw = self.sl, self.cap, self.sw
        base = sl + (offset % cap) * sw
        lw = 4 + gi
        word = w[base + lw]
        if word & 0x7FF != 1 | (dc << 3) or w[base] != offset or offset >= w[24] or offset < w[g + 2]:
            return STALE  # (below the floor: a word left by an old group at this index)
        w[base + lw] = 3 | (dc << 3)  # DONE
        if _CRASH:
            crashpoints.hit("ack.done")
        w[g + 7] += 1  # G_ACKED
        return FREED if self.advance_floor(gi) else OK

    def ack_batch(self, deliveries: Sequence[Sequence[Any]], stale: list[int]) -> bool:
        """ACK many deliveries, each a sequence whose items 1, 3, 4 are (group reference,
        offset, deliveries) -- the API's Message is one.  Offsets of stale ones go to ``stale``.
        True when queue storage was freed."""
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
            self.w[L.Q_SETTLE_SEQ] += 1
        gi = self.live(ref)
        if gi < 0:
            stale.extend(offsets)
            return False
        w = self.w
        sl, cap, sw = self.sl, self.cap, self.sw
        tail = w[24]
        g = self.gw + gi * 32
        floor = w[g + 2]
        n = len(offsets)
        if n > 1:  # the common case: consecutive offsets, no wrap -> strided slices
            o0 = offsets[0]
            i0 = o0 % cap
            if i0 + n <= cap and max(offsets) < tail and min(offsets) >= floor:
                b0 = sl + i0 * sw
                end = b0 + n * sw
                lw = b0 + 4 + gi
                dc = dcs[0]
                leased = 1 | (dc << 3)  # LEASED with this delivery count
                # a run leased together has one lease word: compare the few distinct ones
                if (dcs.count(dc) == n and w[b0:end:sw].tolist() == offsets
                        and all(x & 0x7FF == leased for x in set(w[lw:end:sw]))):
                    w[lw:end:sw] = array("Q", [leased | 2]) * n  # LEASED(1) -> DONE(3)
                    if _CRASH:
                        crashpoints.hit("ack_range.done")
                    w[g + 7] += n  # G_ACKED
                    # the floor may jump over the whole run: every word of it is DONE now
                    return self.advance_floor(gi, o0 + n if o0 <= w[g + 2] else 0)
        acked = 0
        for offset, dc in zip(offsets, dcs, strict=True):
            base = sl + (offset % cap) * sw
            lw = base + 4 + gi
            if w[lw] & 0x7FF != 1 | (dc << 3) or w[base] != offset or offset >= tail or offset < floor:
                stale.append(offset)
                continue
            w[lw] = 3 | (dc << 3)  # DONE
            acked += 1
            if _CRASH:
                crashpoints.hit("ack_batch.partial")
        if not acked:
            return False
        w[g + 7] += acked  # G_ACKED
        return self.advance_floor(gi)

    def _give_back(self, gi: int, lw: int, word: int, owner: int, ready_at: int) -> int:
        """A LEASED word returns to the group, or heads for the dead-letter queue.

        The hints are raised before the word is stored, so a crash in between
        leaves them too high (a wasted scan), never too low (a stranded message).
        """
        w = self.w
        dc = (word >> 3) & 0xFF
        if dc >= self.give_up_at:
            w[lw] = _DEADING | (dc << 3) | (owner << 11)
            return TO_DLQ
        g = self.gw + gi * L.G_WORDS
        offset = w[lw - L.S_GROUPS - gi]  # S_OFFSET of the same slot
        if not w[g + L.G_REDELIVER] or offset < w[g + L.G_READY_LO]:
            w[g + L.G_READY_LO] = offset
        nr = w[g + L.G_NEXT_READY]
        if not w[g + L.G_REDELIVER] or ready_at < nr:
            w[g + L.G_NEXT_READY] = ready_at
        w[g + L.G_REDELIVER] += 1
        if _CRASH:
            crashpoints.hit("nack.hints")
        w[lw] = _READY | (dc << 3) | (ready_at << 24)
        return OK

    def finish_dead(self, gi: int, offset: int, dc: int) -> bool:
        """A DEADING message reached the dead-letter queue: mark it DONE.  True if storage freed."""
        w = self.w
        base = self.sl + (offset % self.cap) * self.sw
        lw = base + L.S_GROUPS + gi
        if w[base] != offset or w[lw] & 7 != _DEADING or (w[lw] >> 3) & 0xFF != dc:
            return False
        w[lw] = _DONE | (dc << 3)
        g = self.gw + gi * L.G_WORDS
        w[g + L.G_DEAD_LETTERED] += 1
        return offset == w[g + L.G_FLOOR] and self.advance_floor(gi)

    def orphan_dead(self, gi: int, offset: int, dc: int) -> None:
        """Give up a DEADING word we could not copy now: anyone's next reap retries it
        (``Q_ORPHANS`` is raised first, so no orphan is ever left without the flag)."""
        w = self.w
        base = self.sl + (offset % self.cap) * self.sw
        lw = base + L.S_GROUPS + gi
        if w[base] == offset and w[lw] & 7 == _DEADING:
            w[L.Q_ORPHANS] = 1
            if _CRASH:
                crashpoints.hit("dlq.orphaned")
            w[lw] = _DEADING | (dc << 3) | (L.NO_OWNER << 11)

    def commit(self, gi: int, offset: int) -> bool:
        """Settle everything of this group below ``offset`` (a consumer-managed position, as
        Kafka's commit): those messages become DONE whatever their state (a lease on one of
        them turns stale), and the cursor moves past them.  True when storage was freed."""
        if self.journaled:  # the journal writer snapshots the groups once this moves
            self.w[L.Q_SETTLE_SEQ] += 1
        w = self.w
        g = self.gw + gi * L.G_WORDS
        end = min(offset, w[L.Q_NEXT_OFFSET])
        lw = L.S_GROUPS + gi
        for o in range(w[g + L.G_FLOOR], end):
            base = self.sl + (o % self.cap) * self.sw + lw
            if w[base] & 7 != _DEADING:  # a dead-letter copy in flight finishes on its own
                w[base] = _DONE | (w[base] & (0xFF << 3))
        if _CRASH:
            crashpoints.hit("commit.words")
        if w[g + L.G_CURSOR] < end:
            w[g + L.G_CURSOR] = end
        return self.advance_floor(gi)

    # ------------------------------------------------------------ floors
    def advance_floor(self, gi: int, done_to: int = 0) -> bool:
        """Move the group's floor past DONE words; True when queue storage was freed.
        ``done_to``: the caller knows every word from the floor up to there is DONE."""
        w = self.w
        g = self.gw + gi * 32
        f = old = w[g + 2]
        cur = w[g + 1]
        if done_to > f:
            f = min(done_to, cur)
        lw = 4 + gi
        while f < cur and w[self.sl + (f % self.cap) * self.sw + lw] & 7 == _DONE:
            f += 1
        if f == old:
            return False
        w[g + 2] = f
        if _CRASH:
            crashpoints.hit("floor.moved")
        if self.journaled:  # the journal writer's mark may hold the free offset back
            return self._recompute_free()
        if old != w[32]:  # another group holds the free offset back
            return False
        if self._lone and w[35] == self._gen:  # the only group: its floor is the free offset
            w[32] = f
            return True
        return self._recompute_free()

    def _recompute_free(self) -> bool:
        w = self.w
        if w[35] != self._gen:  # Q_GROUP_GEN: refresh the list of active group bases
            self._gen = w[35]
            self._active_bases = [self.gw + gi * 32 for gi in range(self.max_groups)
                                  if w[self.gw + gi * 32] == L.GS_ACTIVE]
            self._lone = len(self._active_bases) == 1
        low = w[24]
        if w[28] < low:  # Q_DURABLE_OFFSET: journaled queues free only what the journal has
            low = w[28]
        for g in self._active_bases:
            if w[g] == L.GS_ACTIVE and w[g + 2] < low:
                low = w[g + 2]
        if low > w[32]:
            w[32] = low
            return True
        return False

    # ------------------------------------------------------------ repair
    def repair(self) -> None:
        """Re-derive the group table from the lease words; the consumer lock's
        ``on_recover``: its last holder died inside it, at any instruction.

        * A create or delete cut short: FREE groups get serial 0 (their leases are
          stale), and a fresh generation makes every process re-read the active set.
        * Lease words past a cursor that are not NEW or DONE belong to a delivery that
          never returned (its deliverer died before moving the cursor): NEW again.
        * The floor moves past DONE words; the hints (G_REDELIVER, G_NEXT_READY,
          G_READY_LO, G_NEXT_EXPIRY) become exact; the free offset is recomputed.
        * A dead-letter orphan (DEADING, no owner) raises Q_ORPHANS, so it is retried."""
        w = self.w
        for gi in range(self.max_groups):  # (a create stores the serial before ACTIVE)
            if w[self.gw + gi * L.G_WORDS + L.G_STATE] != L.GS_ACTIVE:
                w[self.gw + gi * L.G_WORDS + L.G_SERIAL] = 0
        w[L.Q_GROUP_GEN] += 1
        tail = w[L.Q_NEXT_OFFSET]
        orphans = False
        for gi, _name in self.active():
            g = self.gw + gi * L.G_WORDS
            lw = L.S_GROUPS + gi
            cur = w[g + L.G_CURSOR]
            for o in range(cur, tail):
                base = self.sl + (o % self.cap) * self.sw + lw
                if w[base] & 7 not in (_NEW, _DONE):
                    w[base] = _NEW
            ready = 0
            next_ready: int | None = None
            next_expiry: int | None = None
            ready_lo = cur
            for o in range(w[g + L.G_FLOOR], cur):
                base = self.sl + (o % self.cap) * self.sw + lw
                word = w[base]
                state = word & 7
                if state == _NEW:  # cannot happen below the cursor: deliverable now
                    word = w[base] = _READY
                    state = _READY
                t = word >> 24
                if state == _READY:
                    ready += 1
                    ready_lo = min(ready_lo, o)
                    next_ready = t if next_ready is None else min(next_ready, t)
                elif state == _LEASED:
                    next_expiry = t if next_expiry is None else min(next_expiry, t)
                elif state == _DEADING and (word >> 11) & L.OWNER_MASK == L.NO_OWNER:
                    orphans = True
            w[g + L.G_REDELIVER] = ready
            w[g + L.G_NEXT_READY] = next_ready or 0
            w[g + L.G_READY_LO] = ready_lo
            w[g + L.G_NEXT_EXPIRY] = max(next_expiry, 1) if next_expiry is not None else 0
            self.advance_floor(gi)
        if orphans:
            w[L.Q_ORPHANS] = 1
        self._recompute_free()

    # ------------------------------------------------------------ reaping
    def expire(self, gi: int, now: int, owner: int, dead: list[DeadItem]) -> int:
        """Return this group's expired leases; the number returned."""
        w = self.w
        g = self.gw + gi * L.G_WORDS
        lw = L.S_GROUPS + gi
        o, end = w[g + L.G_FLOOR], w[g + L.G_CURSOR]
        next_expiry = 0
        n = 0
        while o < end:
            base = self.sl + (o % self.cap) * self.sw + lw
            word = w[base]
            if word & 7 == _LEASED:
                t = word >> 24
                if t <= now:
                    if self._give_back(gi, base, word, owner, now) == TO_DLQ:
                        dead.append((gi, o, (word >> 3) & 0xFF, "expired"))
                    n += 1
                    if _CRASH:
                        crashpoints.hit("expire.given_back")
                elif not next_expiry or t < next_expiry:
                    next_expiry = t
            o += 1
        w[g + L.G_NEXT_EXPIRY] = next_expiry
        w[g + L.G_EXPIRED] += n
        return n

    def reap_owner(self, dead_client: int, owner: int, now: int, dead: list[DeadItem]) -> int:
        """Return every lease of a dead client (and retry its unfinished dead-letters).
        Leases live in [floor, cursor): the words past the cursor are NEW.  With
        ``dead_client`` NO_OWNER: retry the orphaned dead-letter copies."""
        w = self.w
        n = 0
        why = ("orphaned: its dead-letter queue was full" if dead_client == L.NO_OWNER
               else "owner died while dead-lettering")
        for gi, _name in self.active():
            g = self.gw + gi * L.G_WORDS
            lw = L.S_GROUPS + gi
            for o in range(w[g + L.G_FLOOR], w[g + L.G_CURSOR]):
                base = self.sl + (o % self.cap) * self.sw + lw
                word = w[base]
                state = word & 7
                if (word >> 11) & L.OWNER_MASK != dead_client:
                    continue
                if state == _LEASED:
                    if self._give_back(gi, base, word, owner, now) == TO_DLQ:
                        dead.append((gi, o, (word >> 3) & 0xFF, "owner died"))
                    n += 1
                    if _CRASH:
                        crashpoints.hit("reap.partial")
                elif state == _DEADING:
                    w[base] = (word & ~(L.OWNER_MASK << 11)) | (owner << 11)
                    dead.append((gi, o, (word >> 3) & 0xFF, why))
        return n

    # ------------------------------------------------------------ reading
    def stats(self, gi: int) -> dict[str, int]:
        w = self.w
        g = self.gw + gi * L.G_WORDS
        lw = L.S_GROUPS + gi
        in_flight = ready = 0
        for o in range(w[g + L.G_FLOOR], w[g + L.G_CURSOR]):
            state = w[self.sl + (o % self.cap) * self.sw + lw] & 7
            if state == _LEASED:
                in_flight += 1
            elif state == _READY:
                ready += 1
        backlog = w[L.Q_NEXT_OFFSET] - w[g + L.G_CURSOR]
        return {
            "depth": backlog + ready, "backlog": backlog, "ready": ready, "in_flight": in_flight,
            "cursor": w[g + L.G_CURSOR], "floor": w[g + L.G_FLOOR],
            "acked": w[g + L.G_ACKED], "nacked": w[g + L.G_NACKED],
            "redelivered": w[g + L.G_REDELIVERED], "dead_lettered": w[g + L.G_DEAD_LETTERED],
            "expired": w[g + L.G_EXPIRED],
        }

    def require(self, name: str) -> int:
        gi = self.index(name)
        if gi < 0:
            raise GroupNotFound(f"no group {name!r} on queue {self.ring.name!r}")
        return gi
