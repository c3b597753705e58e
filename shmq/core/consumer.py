"""The consumer side of a queue handle: leases taken (``get``, ``get_many``) and settled.

``Consuming`` is a mixin of ``shmq.core.queue.ShmQueue``, declared there with its base
``shmq.core.handle.QueueHandle``, whose state and machinery it uses (it is typed against
that class).  ``_take_one`` is the hot path of one message (a known group, nothing
changed, one lock hold; compiled whole, lock and all, as ``take_one``); ``_take`` the
general one, which waits while there is nothing to deliver: a look in one hold of the
consumer lock (``_lease``), a short spin (``_spin_wait``), a look that announces the
consumer, a sleep (``_sleep_for_messages``).
Settling a lease is one store of its lease word under the consumer lock
(``shmq.core.groups``); on an ``always`` queue the caller then waits for the journal
(``shmq.core.durability``) unless it asked not to.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from shmq import crashpoints, options
from shmq.accel import ext
from shmq.api import Message, Queue, group_as_block, own_leases, shares_docs
from shmq.core.durability import Mark
from shmq.core.groups import ACK, DEAD, FREED, NACK, OK, STALE, TO_DLQ, TOUCH, DeadItem
from shmq.core.handle import QueueHandle, _ms, _sync
from shmq.core.layout import (
    DC_SHIFT,
    G_CURSOR,
    G_NEXT_EXPIRY,
    G_NEXT_READY,
    G_REDELIVER,
    G_SERIAL,
    G_WORDS,
    GI_BITS,
    GI_MASK,
    LEASED,
    OWNER_SHIFT,
    Q_CONSUMER_WAITERS,
    Q_GROUP_GEN,
    Q_PRODUCER_WAITERS,
    Q_STATE,
    QS_ACTIVE,
    TIME_SHIFT,
)
from shmq.core.lock import trylock, unlock
from shmq.errors import Empty, InvalidArgument, StaleAck
from shmq.settle import Settle

# a semaphore sleep ends at its timeout, or early once a signal was handled (its handler
# did not raise: a CLI's Ctrl-C, a SIGCHLD, ...): either way the waiter looks again
_monotonic_ns = time.monotonic_ns
# the compiled twin of Groups.deliver_one (shmq.accel); _take_one falls back to the twin
_deliver_c = None if ext is None else ext.deliver_one
_ack_c = None if ext is None else ext.ack_one  # the same, of Groups.ack (memory-only queues)
_ack_run_c = None if ext is None else ext.ack_run  # ... and of ack_many's usual batch
_spin_c = None if ext is None else ext.spin_wait  # ... and of Consuming._spin_wait
_ack_lock_c = None if ext is None else ext.ack_lock  # ack_one with its lock, in one call
_take_c = None if ext is None else ext.take_one  # _take_one whole: its lock, deliver_one, unlock
_RECOMPUTE = 4  # _ack_c: the floor moved; the free offset is recomputed here
FIRST_LEASE = LEASED | (1 << DC_SHIFT)  # a first delivery's lease word, before its owner and deadline

if TYPE_CHECKING:
    _Handle = QueueHandle  # the state and machinery of ``ShmQueue`` this mixin uses
else:
    _Handle = object


def get_many(q: Any, max_messages: int, block: bool, timeout: float | None, group: str,
             visibility_timeout: float | None, ack: Iterable[Message]) -> list[Message]:
    """``Queue.get_many`` on a co-located queue ``q`` (``ShmQueue``, or a priority queue's
    ``PriorityQueue``): its arguments checked, ``ack`` acknowledged, then ``q._take``."""
    if block.__class__ is str:
        raise group_as_block("get_many", block)
    if max_messages < 1:
        raise InvalidArgument("max_messages must be >= 1")
    acks = list(ack)
    if acks:
        q.ack_many(acks)
    return q._take(group, max_messages, block, timeout, visibility_timeout)  # type: ignore[no-any-return]


def _deadline(timeout: float | None) -> float | None:
    """The monotonic time (s) a call given ``timeout`` (s; None: for ever) ends at."""
    if timeout is None:
        return None
    if timeout >= 0:
        return time.monotonic() + timeout
    raise InvalidArgument("timeout must be >= 0")


@shares_docs(Queue)
class Consuming(_Handle):
    """get / get_many, and the settling of what they lease: a mixin of ``ShmQueue``, on its
    ``QueueHandle``."""

    def get(self, block: bool = True, timeout: float | None = None, *, group: str = options.DEFAULT_GROUP,
            visibility_timeout: float | None = None, ack: Message | None = None) -> Message:
        if block is not True and block.__class__ is str:  # get("billing"): group is a keyword now
            raise group_as_block("get", block)
        if ack is not None:
            ack.ack()
        if visibility_timeout is None:
            take = _take_c
            if take is not None and self._one is not None:  # the hot path in one compiled call
                ref, owner = self._gcache.get(group), self._att._slot
                if ref is not None and owner is not None:
                    m = take(self._one, ref, owner, self._vis, group, self._clock_addr, self._ggen,
                             -1 if self._real_clock else self._now())
                    if m.__class__ is Message:
                        return m  # type: ignore[no-any-return]
                    if m.__class__ is int:  # the lock not taken at once: waited for (or recovered), let go
                        self.ring.clock.acquire_slow(m)
                        unlock(self._clock_addr)
                    # nothing new, the lock was busy, the groups changed, a TTL: the twin's look decides
            one = self._take_one(group)
            if one is not None:
                if one[0] is not None:
                    return one[0]
                # nothing new yet: spin here, and take what comes on the hot path again
                if block and self._spin_wait(one[1], one[2]):
                    one = self._take_one(group)
                    if one is not None and one[0] is not None:
                        return one[0]
                return self._take(group, 1, block, timeout, None, spun=True)[0]
        return self._take(group, 1, block, timeout, visibility_timeout)[0]

    def _take_one(self, group: str) -> tuple[Message | None, int, int] | None:
        """The hot path of taking one message: a known group, the queue's groups
        unchanged, a client slot of ours.  None when it does not apply; else (the message
        leased, or None when no new one was ready, the group index, the time in ms).
        Taking the consumer lock is also the full barrier a doorbell's flag needs."""
        ref = self._gcache.get(group)
        owner = self._att._slot
        w = self.words
        if ref is None or owner is None or w[Q_STATE] != QS_ACTIVE:
            return None
        gi = ref & GI_MASK
        now = _monotonic_ns() // 1_000_000 if self._real_clock else self._now()
        addr = self._clock_addr
        rc = trylock(addr)
        if rc:
            self.ring.clock.acquire_slow(rc)
        try:
            if w[Q_GROUP_GEN] != self._ggen:  # a group was created or deleted since we looked
                return None
            word = FIRST_LEASE | (owner << OWNER_SHIFT) | ((now + self._vis) << TIME_SHIFT)
            d1 = _deliver_c
            if d1 is not None and self._one is not None:
                m = d1(self._one, gi, word, now, ref, group)
                if m is False:  # a TTL of its own: the twin reads the wall clock
                    m = self.consumer_groups.deliver_one(gi, ref, word, now, Message, self, group)
            else:
                m = self.consumer_groups.deliver_one(gi, ref, word, now, Message, self, group)
        finally:
            unlock(addr)
        return m, gi, now

    def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                 group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                 ack: Iterable[Message] = ()) -> list[Message]:
        return get_many(self, max_messages, block, timeout, group, visibility_timeout, ack)

    def _take(self, group: str, max_n: int, block: bool, timeout: float | None,
              visibility_timeout: float | None, max_bytes: int = 0, spun: bool = False) -> list[Message]:
        """The general path of ``get`` and ``get_many``: up to ``max_n`` messages of
        ``group`` leased (``max_bytes``: the byte budget, ``Groups.deliver``), waiting while
        there is none to deliver as ``block`` and ``timeout`` say.  After an empty look, a
        spin (``_spin_wait``), then a look that announces this consumer (Q_CONSUMER_WAITERS,
        so that a put wakes it), then a sleep, and again (``spun``: the caller spun
        already, so the first look announces)."""
        if self.words[Q_STATE] != QS_ACTIVE:
            self._alive()
        ref = self._group_ref(group)
        att = self._att
        owner = att._slot
        if owner is None:
            owner = att.client_slot()
        vis = self.ring.visibility_ms if visibility_timeout is None else _ms(
            visibility_timeout, "visibility_timeout")
        deadline = _deadline(timeout)
        w = self.words
        groups = self.consumer_groups
        addr = self._clock_addr
        got: list[Message] = []
        dead: list[DeadItem] = []
        announce, counted = spun, False  # counted: this call is one of Q_CONSUMER_WAITERS
        while True:
            # one look, in one hold of the consumer lock (inline: it runs on every pass, and a
            # call per look cost a co-located ping-pong 4%, bench/ab.py): lease what the group
            # has to deliver; announce this consumer (Q_CONSUMER_WAITERS) before the lock is let
            # go of, so that no put can miss it, when nothing was leased
            now = self._now()
            rc = trylock(addr)
            if rc:
                self.ring.clock.acquire_slow(rc)
            try:
                if counted:
                    w[Q_CONSUMER_WAITERS] -= 1 if w[Q_CONSUMER_WAITERS] else 0
                if w[self.ring.groups_w + (ref & GI_MASK) * G_WORDS + G_SERIAL] != ref >> GI_BITS:
                    ref = groups.ref(groups.require(group))  # deleted (maybe made again) since
                groups.deliver(ref & GI_MASK, owner, now, max_n, vis, got, dead, Message, (self, ref, group),
                               max_bytes)
                if announce and not got:
                    w[Q_CONSUMER_WAITERS] += 1
                    if crashpoints.active:
                        crashpoints.hit("wait.announced")
            finally:
                unlock(addr)
            if dead:
                self._dead_letter(dead)
                dead = []
            if got:
                return got
            counted = announce
            att.reap(now)
            if not block:
                raise Empty(f"queue {self.name!r} has no message for group {group!r}")
            if not announce:  # a spin, then a look that announces this consumer
                self._spin_wait(ref & GI_MASK, now)
                announce = True
                continue
            announce = False  # after the sleep, look again before announcing again
            self._sleep_for_messages(group, ref, now, deadline, timeout)

    def _spin_wait(self, gi: int, now: int) -> bool:
        """Whether to look again now: at once when group ``gi`` has a lease expiry due at
        ``now`` (ms); else after re-reading the header for at most ``_spin`` ns
        (``options.LOCAL_SPIN_US``) until the group has a message past its cursor or one
        given back (True), or the window passed (False).  A look after a put in progress
        costs less than a sleep and a wake-up, and a spin no longer than what those cost
        wastes at most as much CPU as sleeping would (spin, then sleep).  Compiled
        (``shmq.accel``; it lets go of the GIL while it spins) where the handle has the
        compiled geometry."""
        s = _spin_c
        if s is not None and self._one is not None:
            return s(self._one, gi, self._spin, now)  # type: ignore[no-any-return]
        w = self.words
        g = self.ring.groups_w + gi * G_WORDS
        ne = w[g + G_NEXT_EXPIRY]
        if ne and now >= ne:
            return True
        tw = self.consumer_groups.tail_word  # Q_NEXT_OFFSET (Q_DURABLE_OFFSET if `always`)
        cursor, redeliver = g + G_CURSOR, g + G_REDELIVER
        clock = time.perf_counter_ns
        end = clock() + self._spin
        while w[tw] <= w[cursor] and not w[redeliver]:
            if clock() >= end:
                return bool(w[tw] > w[cursor] or w[redeliver])
        return True

    def _sleep_for_messages(self, group: str, ref: int, now: int, deadline: float | None,
                            timeout: float | None) -> None:
        """Sleep on the not-empty semaphore, this consumer announced (one of
        Q_CONSUMER_WAITERS): at most ``WAIT_SLICE``, and no later than ``deadline`` or the
        group's next redelivery or lease expiry (as of ``now``); not at all when a message
        was published since the announcing look.  At ``deadline``, or once the queue is
        deleted, the consumer stops being a waiter and the call raises (:class:`Empty`,
        :class:`QueueNotFound`)."""
        w = self.words
        g = self.ring.groups_w + (ref & GI_MASK) * G_WORDS
        wait = options.WAIT_SLICE
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._stop_waiting()
                raise Empty(f"no message for group {group!r} of queue {self.name!r} within {timeout} s")
            wait = min(wait, remaining)
        if w[self.consumer_groups.tail_word] > w[g + G_CURSOR]:
            return  # published while we announced ourselves
        if w[g + G_REDELIVER]:
            wait = max(0.0, min(wait, (w[g + G_NEXT_READY] - now) / 1000))
        if w[g + G_NEXT_EXPIRY]:
            wait = max(0.0, min(wait, (w[g + G_NEXT_EXPIRY] - now) / 1000))
        if w[Q_STATE] != QS_ACTIVE:
            self._stop_waiting()
            self._alive()
        self._sem_sleep(self._ne, wait)

    def _due_in(self, group: str) -> float:
        """Seconds before ``group`` may have a message here that a look found none of: 0
        when one was published past its cursor, else until its next redelivery or lease
        expiry, at most ``WAIT_SLICE`` (a priority queue's wait over its levels)."""
        ref = self._gcache.get(group)
        if ref is None or self.words[Q_STATE] != QS_ACTIVE:
            return options.WAIT_SLICE
        w = self.words
        g = self.ring.groups_w + (ref & GI_MASK) * G_WORDS
        if w[self.consumer_groups.tail_word] > w[g + G_CURSOR]:
            return 0.0
        now = self._now()
        wait = options.WAIT_SLICE
        if w[g + G_REDELIVER]:
            wait = max(0.0, min(wait, (w[g + G_NEXT_READY] - now) / 1000))
        if w[g + G_NEXT_EXPIRY]:
            wait = max(0.0, min(wait, (w[g + G_NEXT_EXPIRY] - now) / 1000))
        return wait

    def _stop_waiting(self) -> None:
        """This consumer is no longer one of Q_CONSUMER_WAITERS (a hint: never below 0)."""
        w = self.words
        with self.ring.clock:
            w[Q_CONSUMER_WAITERS] -= 1 if w[Q_CONSUMER_WAITERS] else 0

    # ------------------------------------------------------------ settle
    def _ack_nowait(self, msg: Message) -> None:
        self._ack(msg, wait_durable=False)

    def _ack(self, msg: Message, wait_durable: bool = True) -> None:
        # msg.group_ref, .queue_handle, .offset, .deliveries: indexed, as fast as a co-located
        # consumer's ack can read them (a property, or unpacking the tuple subclass, costs more)
        ref, offset, deliveries = msg[1], msg[3], msg[4]
        if ref < 0 or msg[0] is not self:
            raise self._not_ours(msg)
        addr = self._clock_addr
        a1 = _ack_lock_c
        if a1 is not None and self._one is not None and not self._durable:  # one compiled call, lock and all
            groups = self.consumer_groups
            result = a1(self._one, ref, offset, deliveries, groups.lone_gen, addr)
            if result == _RECOMPUTE:  # the floor moved: the free offset, derived again in a hold of its own
                with self.ring.clock:
                    result = FREED if groups._recompute_free() else OK
            rc = -result if result < 0 else 0  # the lock not taken at once: trylock's error number
        else:
            result, rc = -1, trylock(addr)
        if result < 0:  # not compiled, journaled, or the lock not taken at once
            if rc:
                self.ring.clock.acquire_slow(rc)
            try:
                a1 = _ack_c
                if a1 is not None and self._one is not None and not self._durable:
                    groups = self.consumer_groups
                    result = a1(self._one, ref, offset, deliveries, groups.lone_gen)
                    if result == _RECOMPUTE:
                        result = FREED if groups._recompute_free() else OK
                else:
                    result = self.consumer_groups.ack(ref, offset, deliveries)
            finally:
                unlock(addr)
        if result == FREED:
            if self.words[Q_PRODUCER_WAITERS]:
                self._wake(self._nf, self.words[Q_PRODUCER_WAITERS], 1)
        elif result == STALE:
            raise self._stale(msg)
        if self._durable:
            if wait_durable:
                self._settled()
            else:
                self.durability.poke()

    def _not_ours(self, msg: Message) -> StaleAck:
        return StaleAck(f"message {msg.offset} is not a delivery of {self.name!r} (read() results "
                        "cannot be settled)")

    def _stale(self, msg: Message) -> StaleAck:
        self._alive()  # a lease of a deleted queue: QueueNotFound says why
        return StaleAck(f"the lease of message {msg.offset} (delivery {msg.deliveries}) on {self.name!r} is "
                        "no longer held: it was settled already, or it expired and was given back")

    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        """nack / touch / dead-letter (ack has its own path, ``_ack``)."""
        if action == ACK:
            return self._ack(msg)
        _sync(self._settle_unsynced(msg, action, arg))

    def _settle_unsynced(self, msg: Message, action: Settle, arg: float | None) -> Mark | None:
        """nack / touch / dead-letter, not waiting for the journal: the mark that confirms
        it on an ``always`` queue (``shmq.core.durability``)."""
        ref = msg.group_ref
        if ref < 0 or msg.queue_handle is not self:
            raise self._not_ours(msg)
        if action == TOUCH:
            arg_ms = self.ring.visibility_ms if arg is None else _ms(arg, "visibility_timeout")
        else:
            if action == DEAD and self.is_dlq:
                raise InvalidArgument("a message of a dead-letter queue cannot be dead-lettered")
            arg_ms = _ms(arg or 0.0, "delay")
        owner = self._att.client_slot()
        with self.ring.clock:
            result = self.consumer_groups.settle(ref, msg.offset, msg.deliveries, action, owner, self._now(),
                                                 arg_ms)
        if result == STALE:
            raise self._stale(msg)
        mark = self.durability.settle_mark() if action != TOUCH else None
        if result == OK and action == NACK and not arg_ms:
            self._wake_consumers(1)  # deliverable again now, wherever its consumers wait
        if result == TO_DLQ:
            reason = "nack" if action == NACK else "dead_letter"
            self._dead_letter([(ref & GI_MASK, msg.offset, msg.deliveries, reason)], options.WAIT_SLICE * 20)
        return mark

    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        run = _ack_run_c
        if run is not None and messages.__class__ is list and self._one is not None and not self._durable:
            groups = self.consumer_groups
            clock = self.ring.clock
            clock.acquire()
            try:  # the usual batch, one run of one group's deliveries, at C speed (-1: not one)
                result = run(self._one, messages, self, groups.lone_gen)
                if result == _RECOMPUTE:
                    result = FREED if groups._recompute_free() else OK
            finally:
                clock.release()
            if result >= 0:
                self._after_acks(result == FREED, len(messages), wait)  # type: ignore[arg-type]
                return
        msgs, stale, total = own_leases(self, messages)
        if not total:
            return
        clock = self.ring.clock
        clock.acquire()
        try:
            freed = self.consumer_groups.ack_batch(msgs, stale)
        finally:
            clock.release()
        self._after_acks(freed, len(msgs), wait)
        if stale:
            raise StaleAck.of_batch(stale, total)

    def _after_acks(self, freed: bool, n: int, wait_durable: bool = True) -> None:
        if freed and self.words[Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self.words[Q_PRODUCER_WAITERS], n)
        if self._durable:
            if wait_durable:
                self._settled()
            else:
                self.durability.poke()

