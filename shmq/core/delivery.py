"""Delivery: leasing a group's messages to a consumer, new ones and given-back ones.

``Delivery`` is a mixin of ``shmq.core.groups.Groups``, declared there with ``Settlement``
and their base ``GroupTable`` (it is typed against that class and ``Settlement.expire``,
all it uses of them).  Every method here is called with the consumer lock held and keeps
the invariants in ``shmq.core.groups``'s docstring.  A delivery stores the lease words
first (LEASED, the owner, the deadline) and moves the cursor and the expiry hint after
them, so a deliverer killed in between leaves words that ``Groups.repair`` turns back
into NEW.  ``deliver`` is the general path (expired leases first, then redeliveries,
then new messages); ``deliver_one`` and ``deliver_block`` are its hot paths for one new
message and for a run of them.  ``sweep`` is the broker's maintenance: it expires what a
delivery would, with no consumer.

TTL: a message expires for a group when it would be delivered to it for the first time
after the queue's TTL (``ttl_ns``, counted from S_TIMESTAMP) or its own (S_EXPIRES)
ran out.  The S_EXPIRES column is read only while ``Q_EXPIRES_MAX`` is set (a message
with its own TTL was put), so a queue without any pays one header word per call.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol

from shmq import crashpoints
from shmq.accel import ext
from shmq.core.group_table import DeadItem, GroupTable
from shmq.core.layout import (
    DC_MASK,
    DC_SHIFT,
    DEADING,
    DONE,
    G_CURSOR,
    G_DELIVERED,
    G_FLOOR,
    G_NEXT_EXPIRY,
    G_NEXT_READY,
    G_READY_LO,
    G_REDELIVER,
    G_REDELIVERED,
    G_STATE,
    G_TTL_EXPIRED,
    G_WORDS,
    GS_ACTIVE,
    LEASED,
    LEASED_ONCE,
    LEN_META_SHIFT,
    LEN_PAYLOAD_MASK,
    OWNER_SHIFT,
    Q_EXPIRES_MAX,
    Q_SETTLE_SEQ,
    READY,
    S_BYTEPOS,
    S_EXPIRES,
    S_GROUPS,
    S_LENS,
    S_TIMESTAMP,
    SLOT_HEAD,
    STATE_DC_MASK,
    STATE_MASK,
    TIME_SHIFT,
    WORD,
)

_unpack_slot = SLOT_HEAD.unpack_from

TTL_REASON = "ttl_expired"  # a dead letter's origin reason when its message's TTL passed


def _none_expired(expires: Any, now: int) -> bool:
    """No S_EXPIRES of ``expires`` (a strided column) is set and at or before ``now``."""
    lo = min(expires)
    if lo:
        return bool(lo > now)
    return min(filter(None, expires), default=now + 1) > now


def _records_py(out: list[Any], cls: type, prefix: tuple[Any, ...], w: memoryview, mm: Any, b0: int,
                sw: int, k: int, offset: int, data: int, size: int) -> None:
    """Append ``cls((*prefix, offset + i, 1, payload, metadata, timestamp_ns))`` to ``out``
    for the ``k`` slots whose heads start at words ``b0``, ``b0 + sw``, ... of ``w`` (the
    words of the mapping ``mm``): a run of first deliveries.  ``shmq._speedups.records``
    is its compiled twin (``shmq.accel``)."""
    end = b0 + k * sw
    new = tuple.__new__
    append = out.append
    for o, pos, lens, ts in zip(range(offset, offset + k), w[b0 + S_BYTEPOS:end:sw].tolist(),
                                w[b0 + S_LENS:end:sw].tolist(), w[b0 + S_TIMESTAMP:end:sw].tolist(),
                                strict=True):
        start = data + pos % size
        mlen = lens >> LEN_META_SHIFT
        if mlen:
            append(new(cls, (*prefix, o, 1, mm[start + mlen:start + mlen + (lens & LEN_PAYLOAD_MASK)],
                             mm[start:start + mlen], ts)))
        else:
            append(new(cls, (*prefix, o, 1, mm[start:start + lens], b"", ts)))


_records = _records_py if ext is None else ext.records


def _within(lens: list[int], used: int, max_bytes: int, got: int) -> tuple[int, int]:
    """How many of these records (slots' S_LENS words: payload | metadata length << 32)
    fit a byte budget of which ``used`` is spent, at least one when nothing was taken
    yet (``got`` == 0); and the budget spent once they are taken."""
    cum = list(accumulate([(x & LEN_PAYLOAD_MASK) + (x >> LEN_META_SHIFT) for x in lens], initial=used))
    k = max(bisect_right(cum, max_bytes) - 1, 0)
    if not k and not got:
        k = 1
    return k, cum[k]


if TYPE_CHECKING:
    class _Expiry(Protocol):
        def expire(self, gi: int, now: int, owner: int, dead: list[DeadItem]) -> int:
            """``Settlement.expire``: a delivery gives the group's expired leases back first."""
            ...

    class _Needs(GroupTable, _Expiry):
        """What ``Delivery`` uses of ``Groups``: its ``GroupTable``, and ``Settlement.expire``."""
else:
    _Needs = object


class Delivery(_Needs):
    """Leasing messages to consumers: a mixin of ``Groups``, on its ``GroupTable``."""

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
        g = self.gw + gi * G_WORDS
        ttl = self.ttl_ns
        own = w[Q_EXPIRES_MAX]  # a message with a TTL of its own (S_EXPIRES) may be here
        wall = self.wall_ns() if ttl or own else 0
        cutoff = wall - ttl if ttl else 0  # a message put at or before it has expired
        mine = wall if own else 0  # a message whose S_EXPIRES is at or before it has expired
        ne = w[g + G_NEXT_EXPIRY]
        if ne and now >= ne:
            self.expire(gi, now, owner, dead)
            ne = w[g + G_NEXT_EXPIRY]
        if w[g + G_REDELIVER] and now >= w[g + G_NEXT_READY]:
            if self._redeliver(gi, owner, now, max_n, vis_ms, out, cls, prefix, max_bytes, dead, cutoff,
                               mine):
                return  # the byte budget is spent: new messages wait behind the redeliveries
        cur = w[g + G_CURSOR]
        tail = w[self.tail_word]  # Q_NEXT_OFFSET, or Q_DURABLE_OFFSET of an `always` queue
        got = first = len(out)
        if cur >= tail or got >= max_n:
            return
        used = sum(len(m[-3]) + len(m[-2]) for m in out) if max_bytes else 0
        sl, cap, sw, size, data, mm = self._geom
        lw = S_GROUPS + gi
        deadline = now + vis_ms
        word = LEASED_ONCE | (owner << OWNER_SHIFT) | (deadline << TIME_SHIFT)
        new = tuple.__new__
        append = out.append
        unpack = _unpack_slot
        skipped = due_now = False
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
            if k > 1 and not any(w[b0 + lw:end:sw].tolist()) and (
                    not ttl or min(w[b0 + S_TIMESTAMP:end:sw]) > cutoff) and (
                    not mine or _none_expired(w[b0 + S_EXPIRES:end:sw], mine)):  # (else one at a time)
                if max_bytes:  # as many as the byte budget holds (at least one in all)
                    k, used = _within(w[b0 + S_LENS:end:sw].tolist(), used, max_bytes, got)
                    if not k:
                        break
                    end = b0 + k * sw
                w[b0 + lw:end:sw] = array("Q", [word]) * k
                _records(out, cls, prefix, w, mm, b0, sw, k, cur, data, size)
                got += k
                cur += k
                continue
            else:  # one at a time, stepping over DONE words (settled without a delivery)
                if w[b0 + lw]:
                    if w[b0 + lw] & STATE_MASK == READY:  # delayed: the READY scan takes it when due
                        due = w[b0 + lw] >> TIME_SHIFT
                        self._ready_hint(g, cur, due)  # the cursor passes it: the hints take it in
                        due_now = due_now or due <= now
                    cur += 1
                    skipped = True
                    continue
                if (ttl and w[b0 + S_TIMESTAMP] <= cutoff) or (
                        mine and 0 < w[b0 + S_EXPIRES] <= mine):  # expired before its first delivery
                    self._ttl_expire(g, gi, b0 + lw, cur, owner, dead)
                    cur += 1
                    skipped = True
                    continue
                if max_bytes:
                    k, used = _within([w[b0 + S_LENS]], used, max_bytes, got)
                    if not k:
                        break
                w[b0 + lw] = word
                got += 1
                _o, pos, lens, ts = unpack(mm, b0 * WORD)
                start = data + pos % size
                mlen = lens >> LEN_META_SHIFT
                if mlen:
                    plen = lens & LEN_PAYLOAD_MASK
                    append(new(cls, (*prefix, cur, 1, mm[start + mlen:start + mlen + plen],
                                     mm[start:start + mlen], ts)))
                else:
                    append(new(cls, (*prefix, cur, 1, mm[start:start + lens], b"", ts)))
                cur += 1
        if crashpoints.active:
            crashpoints.hit("deliver.run.leased")
        w[g + G_CURSOR] = cur
        w[g + G_DELIVERED] += got - first
        if crashpoints.active:
            crashpoints.hit("deliver.cursor")
        if not ne or deadline < ne:
            w[g + G_NEXT_EXPIRY] = deadline
        if skipped:  # the floor may stand on one of them
            self.advance_floor(gi)
        if due_now and got < max_n and not (max_bytes and got):  # passed a delayed one that is due
            self._redeliver(gi, owner, now, max_n, vis_ms, out, cls, prefix, max_bytes, dead, cutoff, mine)

    def _ttl_expire(self, g: int, gi: int, lw: int, offset: int, owner: int, dead: list[DeadItem]) -> None:
        """The message at lease word ``lw`` (NEW, or READY with 0 deliveries) outlived its
        TTL before its first delivery to the group: DONE (the queue drops expired
        messages), or DEADING owned by ``owner`` and queued in ``dead`` for the
        dead-letter queue.  Past the cursor, the cursor moves after this store (``repair``
        makes a DEADING word left there NEW again)."""
        w = self.w
        if self.journaled:  # the journal writer snapshots the groups once this moves
            w[Q_SETTLE_SEQ] += 1
        if self.ttl_drop:
            w[lw] = DONE
        else:
            w[lw] = DEADING | (owner << OWNER_SHIFT)
            dead.append((gi, offset, 0, TTL_REASON))
        if crashpoints.active:
            crashpoints.hit("ttl.expired")
        w[g + G_TTL_EXPIRED] += 1

    def deliver_one(self, gi: int, ref: int, word: int, now: int, cls: type, q: Any, group: str) -> Any:
        """The hot path of ``deliver`` for a single new message; None when the general
        path is needed (expiry due, redeliveries pending, nothing new, crash leftovers).
        ``word`` is the LEASED lease word (1 delivery, owner, deadline) to store; ``ref``
        the group's reference, for the message."""
        w = self.w
        g = self.gw + gi * G_WORDS
        ne = w[g + G_NEXT_EXPIRY]
        cur = w[g + G_CURSOR]
        if (ne and now >= ne) or w[g + G_REDELIVER] or cur >= w[self.tail_word]:
            return None
        base = self.sl + (cur % self.cap) * self.sw
        if w[base + S_GROUPS + gi]:  # DONE: settled without a delivery, stepped over by ``deliver``
            return None
        if self.ttl_ns and w[base + S_TIMESTAMP] <= self.wall_ns() - self.ttl_ns:
            return None  # expired: ``deliver`` expires it
        if w[base + S_EXPIRES] and w[base + S_EXPIRES] <= self.wall_ns():
            return None  # its own TTL ran out: ``deliver`` expires it
        w[base + S_GROUPS + gi] = word
        if crashpoints.active:
            crashpoints.hit("deliver.one.leased")
        w[g + G_CURSOR] = cur + 1
        w[g + G_DELIVERED] += 1
        deadline = word >> TIME_SHIFT
        if not ne or deadline < ne:
            w[g + G_NEXT_EXPIRY] = deadline
        _o, pos, lens, ts = _unpack_slot(self.mm, base * WORD)
        start = self.data_off + pos % self.size
        mlen = lens >> LEN_META_SHIFT
        if mlen:
            payload = self.mm[start + mlen:start + mlen + (lens & LEN_PAYLOAD_MASK)]
            return tuple.__new__(cls, (q, ref, group, cur, 1, payload, self.mm[start:start + mlen], ts))
        return tuple.__new__(cls, (q, ref, group, cur, 1, self.mm[start:start + lens], b"", ts))

    def one_geom(self, cls: type, q: Any) -> tuple[Any, ...] | None:
        """What the compiled ``deliver_one`` (``shmq._speedups``) reads of this queue, bound
        once per handle; None on a queue with a TTL (the twin reads the wall clock)."""
        if self.ttl_ns:
            return None
        return (self.mm, self.gw, self.sl, self.cap, self.sw, self.tail_word, self.data_off, self.size,
                cls, q)

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
        g = self.gw + gi * G_WORDS
        ne = w[g + G_NEXT_EXPIRY]
        if (ne and now >= ne) or w[g + G_REDELIVER]:  # an expiry is due / redeliveries wait
            return None
        sl, cap, sw, size, data, mm = self._geom
        cur = w[g + G_CURSOR]
        i0 = cur % cap
        k = min(w[self.tail_word] - cur, max_n, cap - i0)
        if k < 2:
            return (cur, [], [], b"") if k <= 0 else None
        b0 = sl + i0 * sw
        end = b0 + k * sw
        lw = b0 + S_GROUPS + gi
        if any(w[lw:end:sw]):  # a DONE word (settled without a delivery): the general path
            return None
        lens = w[b0 + S_LENS:end:sw].tolist()
        if max(lens) > LEN_PAYLOAD_MASK:  # some record has metadata
            return None
        if max_bytes and sum(lens) > max_bytes:
            k, _ = _within(lens, 0, max_bytes, 1)
            if k < 2:
                return None
            end = b0 + k * sw
            lens = lens[:k]
        p0 = w[b0 + S_BYTEPOS]
        span = w[end - sw + S_BYTEPOS] + lens[-1] - p0
        start = p0 % size
        if span != sum(lens) or start + span > size:  # not back to back in one lap
            return None
        stamps = w[b0 + S_TIMESTAMP:end:sw].tolist()
        if self.ttl_ns and min(stamps) <= self.wall_ns() - self.ttl_ns:
            return None  # some expired: ``deliver`` expires them
        if w[Q_EXPIRES_MAX] and not _none_expired(w[b0 + S_EXPIRES:end:sw], self.wall_ns()):
            return None  # some outlived their own TTL: ``deliver`` expires them
        deadline = now + vis_ms
        w[lw:end:sw] = array("Q", [LEASED_ONCE | (owner << OWNER_SHIFT) | (deadline << TIME_SHIFT)]) * k
        if crashpoints.active:
            crashpoints.hit("deliver.block.leased")
        w[g + G_CURSOR] = cur + k
        w[g + G_DELIVERED] += k
        if not ne or deadline < ne:
            w[g + G_NEXT_EXPIRY] = deadline
        return cur, stamps, lens, mm[data + start:data + start + span]

    def _redeliver(self, gi: int, owner: int, now: int, max_n: int, vis_ms: int,
                   out: list[Any], cls: type, prefix: tuple[Any, ...], max_bytes: int = 0,
                   dead: list[DeadItem] | None = None, cutoff: int = 0, mine: int = 0) -> bool:
        """Lease READY messages whose time has come, lowest offset first.  A delayed one
        (0 deliveries) put at or before ``cutoff`` (wall ns; the queue's TTL), or whose own
        TTL ran out at ``mine`` (wall ns: S_EXPIRES at or before it), expires instead.

        Scans from the G_READY_LO hint and stops once max_n are taken (or ``max_bytes``
        would be passed: then it returns True), so a long run of given-back messages
        costs O(1) per delivery, not O(window).
        """
        w = self.w
        g = self.gw + gi * G_WORDS
        lw = S_GROUPS + gi
        cur = w[g + G_CURSOR]
        o = max(w[g + G_FLOOR], w[g + G_READY_LO])
        pending = 0
        next_ready = 0
        first_pending = -1
        deadline = now + vis_ms
        taken = firsts = 0
        used = 0
        spent = False
        gone = 0  # TTL expiries
        full = len(out) >= max_n
        while o < cur and not full:
            base = self.sl + (o % self.cap) * self.sw + lw
            word = w[base]
            if word & STATE_MASK == READY:
                t = word >> TIME_SHIFT
                if t <= now:
                    if ((cutoff or mine) and word & STATE_DC_MASK == READY and dead is not None
                            and ((cutoff and w[base - lw + S_TIMESTAMP] <= cutoff)
                                 or (mine and 0 < w[base - lw + S_EXPIRES] <= mine))):
                        self._ttl_expire(g, gi, base, o, owner, dead)
                        gone += 1
                        o += 1
                        continue
                    if max_bytes:
                        fits, used = _within([w[base - lw + S_LENS]], used, max_bytes, len(out))
                        if not fits:
                            spent = True
                            break  # o stays READY (see "stopped early" below)
                    dc = ((word >> DC_SHIFT) & DC_MASK) + 1  # at most DC_MASK: see give_up_at
                    w[base] = LEASED | (dc << DC_SHIFT) | (owner << OWNER_SHIFT) | (deadline << TIME_SHIFT)
                    if crashpoints.active:
                        crashpoints.hit("redeliver.leased")
                    payload, meta, ts = self.ring.record(o)
                    out.append(tuple.__new__(cls, (*prefix, o, dc, payload, meta, ts)))
                    taken += 1
                    if dc == 1:  # a delayed message's first delivery
                        firsts += 1
                    full = len(out) >= max_n
                else:
                    pending += 1
                    if first_pending < 0:
                        first_pending = o
                    if not next_ready or t < next_ready:
                        next_ready = t
            o += 1
        if o >= cur:  # scanned to the end: the hints are exact now
            w[g + G_REDELIVER] = pending
            w[g + G_NEXT_READY] = next_ready
            w[g + G_READY_LO] = first_pending if first_pending >= 0 else cur
        else:  # stopped early: more may be READY from o on, due at any time (0: a true bound)
            w[g + G_REDELIVER] = max(w[g + G_REDELIVER] - taken - gone, pending + 1)
            w[g + G_NEXT_READY] = 0
            w[g + G_READY_LO] = first_pending if first_pending >= 0 else o
        if gone:  # the floor may stand on a TTL expiry
            self.advance_floor(gi)
        if taken:
            w[g + G_REDELIVERED] += taken - firsts
            w[g + G_DELIVERED] += firsts
            ne = w[g + G_NEXT_EXPIRY]
            if not ne or deadline < ne:
                w[g + G_NEXT_EXPIRY] = deadline
        return spent

    # ------------------------------------------------------------ expiry without a consumer
    def sweep(self, gi: int, owner: int, now: int, budget: int, dead: list[DeadItem]) -> int:
        """The broker's maintenance of a group nobody may be consuming: expire what a
        delivery at ``now`` would expire, owned by ``owner`` (DEADING ones are queued in
        ``dead`` for the dead-letter queue), looking at most at ``budget`` lease words.

        From the cursor on it steps over DONE and delayed words (as ``deliver`` does),
        expires NEW words whose TTL ran out and moves the cursor past them, and stops at
        the first message still live: a message behind it waits until that one is
        delivered or expires (as RabbitMQ's per-message TTL).  Then the delayed words
        below the cursor (READY, never delivered) that are due and expired.  The words
        are stored before the cursor moves, as in ``deliver``.  Returns the number expired."""
        w = self.w
        g = self.gw + gi * G_WORDS
        ttl = self.ttl_ns
        own = w[Q_EXPIRES_MAX]
        if (not ttl and not own) or w[g + G_STATE] != GS_ACTIVE:
            return 0
        wall = self.wall_ns()
        cutoff = wall - ttl if ttl else -1  # (-1: no timestamp is at or before it)
        sl, cap, sw = self.sl, self.cap, self.sw
        lw = S_GROUPS + gi
        gone = 0
        cur = o = w[g + G_CURSOR]
        tail = w[self.tail_word]
        while o < tail and budget > 0:
            budget -= 1
            base = sl + (o % cap) * sw
            word = w[base + lw]
            if word:  # DONE (settled without a delivery), or delayed: stepped over
                if word & STATE_MASK == READY:
                    self._ready_hint(g, o, word >> TIME_SHIFT)
            elif w[base + S_TIMESTAMP] <= cutoff or (own and 0 < w[base + S_EXPIRES] <= wall):
                self._ttl_expire(g, gi, base + lw, o, owner, dead)
                gone += 1
            else:
                break  # live: the messages behind it wait for it
            o += 1
        moved = o != cur
        if moved:
            w[g + G_CURSOR] = o
        if w[g + G_REDELIVER] and now >= w[g + G_NEXT_READY]:  # delayed ones that came due
            o = max(w[g + G_FLOOR], w[g + G_READY_LO])
            cur = w[g + G_CURSOR]
            while o < cur and budget > 0:
                budget -= 1
                base = sl + (o % cap) * sw
                word = w[base + lw]
                if word & STATE_DC_MASK == READY and word >> TIME_SHIFT <= now and (
                        w[base + S_TIMESTAMP] <= cutoff or (own and 0 < w[base + S_EXPIRES] <= wall)):
                    self._ttl_expire(g, gi, base + lw, o, owner, dead)  # (the READY hints stay bounds)
                    gone += 1
                o += 1
        if gone or moved:
            self.advance_floor(gi)
        return gone
