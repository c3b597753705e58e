"""A co-located queue handle: the ``api.Queue`` interface straight on shared memory.

Blocking follows ``queue.Queue``: ``block=True, timeout=None`` waits for ever,
``timeout`` bounds the whole call on the monotonic clock, ``block=False``
raises at once.  Waiting sleeps on the queue's semaphores, which are only
wake-up hints: every sleep is at most ``options.WAIT_SLICE`` long and then
re-reads the header, so a count left wrong by a dead process costs latency,
never a lost wake-up.
"""

from __future__ import annotations

import errno
import json
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import posix_ipc

from . import crashpoints, options
from . import layout as L
from .api import Message, Payload, QueueConfig, as_bytes, check_producer, own_leases
from .api import Queue as QueueABC
from .doorbell import NO_BELLS, RINGER
from .durability import Durability, Mark
from .errors import (
    Duplicate,
    Empty,
    Full,
    InvalidArgument,
    MessageTooLarge,
    QueueNotFound,
    ShmqError,
    StaleAck,
    StorageError,
    Timeout,
)
from .group import ACK, DEAD, FREED, NACK, OK, STALE, TO_DLQ, TOUCH, DeadItem, Groups
from .lock import trylock, unlock
from .names import check_group_name as _check_group_name
from .registry import Registry
from .ring import DUPLICATE, Ring, producer_key
from .settle import Settle

_ALWAYS = options.DURABILITY_MODES.index("always")



class Host(Protocol):
    """What a queue handle needs of the process's view of its instance (``shm.Attachment``,
    which makes the handles: this module does not import it)."""

    url: str
    now_ms: Callable[[], int]
    bell_skip: int
    _slot: int | None  # this process's client slot, None until it has one (read on the hot path)

    @property
    def registry(self) -> Registry: ...
    def client_slot(self) -> int: ...
    def reap(self, now: int, force: bool = False) -> int: ...
    def forget(self, queue_id: int) -> None: ...
    def dead_letter_queue(self, q: ShmQueue) -> ShmQueue | None: ...

_BusyError = posix_ipc.BusyError
_CRASH = crashpoints.watch(__name__)
_monotonic_ns = time.monotonic_ns


def monotonic_ms() -> int:
    """The default clock of leases and delays: monotonic, system-wide, in ms."""
    return _monotonic_ns() // 1_000_000


class ShmQueue(QueueABC):
    """One queue of a co-located instance."""

    def __init__(self, att: Host, ring: Ring, not_empty: posix_ipc.Semaphore,
                 not_full: posix_ipc.Semaphore, journal: posix_ipc.Semaphore,
                 durable: posix_ipc.Semaphore) -> None:
        self._att = att
        self._ring = ring
        self._groups = Groups(ring)
        self._w = ring.w
        self._ne = not_empty
        self._nf = not_full
        self._js = journal
        self._ds = durable
        self._durable = ring.durability != 0
        self._always = ring.durability == _ALWAYS
        self.name = ring.name
        self._max = ring.max_message_size
        self._gcache: dict[str, int] = {}  # group name -> reference (layout.group_ref)
        self._ggen = -1
        self._now = att.now_ms
        self._real_clock = att.now_ms is monotonic_ms  # the hot path reads it inline
        self._vis = ring.visibility_ms
        self._clock_addr = ring.clock.address
        self._mm = ring.mm  # the bell table is read as one slice of it (no buffer export kept)
        self._dur = Durability(self)  # the durable marks (both sides: shmq.durability)

    def __repr__(self) -> str:
        return f"ShmQueue({self._att.url!r}, {self.name!r})"

    @property
    def config(self) -> QueueConfig:
        r = self._ring
        return QueueConfig(r.capacity, r.size, r.max_message_size, r.visibility_ms / 1000,
                           r.max_deliveries, r.max_groups, options.DURABILITY_MODES[r.durability])

    @property
    def is_dlq(self) -> bool:
        return bool(self._ring.flags & L.F_DLQ)

    def _alive(self) -> None:
        if self._w[L.Q_STATE] != L.QS_ACTIVE:
            self._att.forget(self._ring.queue_id)
            raise QueueNotFound(f"queue {self.name!r} was deleted")

    # ------------------------------------------------------------ produce
    def put(self, payload: Payload, block: bool = True, timeout: float | None = None,
            *, wait_durable: bool = True) -> int:
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        if len(payload) > self._max:
            raise MessageTooLarge(f"payload of {len(payload)} bytes exceeds max_message_size "
                                  f"{self._max} of queue {self.name!r}")
        if self._w[4] != 1:  # Q_STATE
            self._alive()
        if self._durable:
            return self._put_durable([payload], block, timeout, wait_durable, 0, 0)
        off = self._ring.try_put(payload, time.time_ns())
        if off < 0:
            off = self._put_wait([payload], None, block, timeout)
        self._wake_consumers(1)
        return off

    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None, wait_durable: bool = True) -> list[int]:
        """Append a batch atomically.  With ``producer`` and ``seq`` (an idempotent
        producer): raise :class:`Duplicate` and write nothing when this producer already
        wrote ``seq`` or a later sequence to this queue."""
        key = producer_key(producer) if check_producer(producer, seq) else 0  # type: ignore[arg-type]
        if set(map(type, payloads)) == {bytes}:  # the usual case, checked at C speed
            items = list(payloads)
        else:
            items = [p if type(p) is bytes else as_bytes(p) for p in payloads]
        if not items:
            return []
        self._alive()
        big = max(map(len, items))
        if big > self._max:
            raise MessageTooLarge(f"a payload of {big} bytes exceeds max_message_size {self._max} "
                                  f"of queue {self.name!r}")
        if self._durable:
            first = self._put_durable(items, block, timeout, wait_durable, key, seq or 0)
        else:
            first = self._put_wait(items, None, block, timeout, first_try=True, producer=key, seq=seq or 0)
            self._wake_consumers(len(items))
        return list(range(first, first + len(items)))

    def _publish(self, payload: Payload, block: bool, timeout: float | None) -> int:
        return self.put(payload, block, timeout, wait_durable=False)

    def _confirm(self, token: int) -> int:
        if self._always:
            self.wait_durable(token + 1)
        return token

    def _put_durable(self, items: list[Any], block: bool, timeout: float | None, wait_durable: bool,
                     key: int, seq: int) -> int:
        """put / put_many on a journaled queue: refused while the journal cannot be written;
        with ``always`` (and ``wait_durable``) it returns once the journal has the batch."""
        self._dur.check()
        deadline = None if timeout is None else time.monotonic() + timeout
        first = self._put_wait(items, None, block, timeout, first_try=True, producer=key, seq=seq)
        if not self._always:  # an `always` batch is shown to consumers once journaled
            self._wake_consumers(len(items))
        else:
            mark = self._dur.put_mark(first + len(items))
            if wait_durable and mark is not None:
                mark.wait(deadline)
        return first

    def durable_offset(self) -> int:
        """Offsets below this are as durable as the queue's policy makes them."""
        return self._dur.offset()

    def wait_durable(self, end: int, deadline: float | None = None) -> None:
        """Wait until every offset below ``end`` is in the journal (fsynced).  Raises
        :class:`Timeout` at ``deadline`` (monotonic s), :class:`StorageError` when the
        journal writer reports a write error."""
        self._dur.wait(L.Q_DURABLE_OFFSET, end, deadline)

    def _settled(self) -> None:
        """After a change of group state on a journaled queue: tell the journal writer;
        on an ``always`` queue, return once the change is on disk."""
        _sync(self._dur.settle_mark())

    def _sleep_until(self, attempt: Callable[[], int | None], sem: posix_ipc.Semaphore, waiters: int,
                     deadline: float | None, expired: Callable[[], Exception]) -> int:
        """Call ``attempt`` until it returns a value.  Between tries, sleep on ``sem`` (a
        wake-up hint, at most ``WAIT_SLICE``), announced in the header word ``waiters`` so
        that wakers post it; raise ``expired()`` at ``deadline`` (monotonic s)."""
        w = self._w
        registered = False
        try:
            while True:
                r = attempt()
                if r is not None:
                    return r
                self._alive()
                wait = options.WAIT_SLICE
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise expired()
                    wait = min(wait, remaining)
                if not registered:
                    with self._ring.plock:
                        w[waiters] += 1
                    registered = True
                    continue  # try again after announcing ourselves: no lost wake-up
                try:
                    sem.acquire(wait)
                except _BusyError:
                    pass
        finally:
            if registered:
                with self._ring.plock:
                    w[waiters] -= 1 if w[waiters] else 0

    def _put_meta(self, payload: bytes, meta: bytes, timeout: float) -> int:
        """Internal: append with metadata (dead-letter origin); on an ``always`` queue,
        returns once the copy is journaled, so the original can be settled safely."""
        self._alive()
        if self._durable:
            self._dur.check()
        off = self._put_wait([payload], [meta], True, timeout, first_try=True)
        self._wake_consumers(1)
        mark = self._dur.put_mark(off + 1)
        if mark is not None:
            mark.wait(time.monotonic() + timeout)
        return off

    def _put_wait(self, items: list[Any], metas: list[bytes] | None, block: bool,
                  timeout: float | None, first_try: bool = False, producer: int = 0, seq: int = 0) -> int:
        ring = self._ring
        nbytes = sum(map(len, items)) + (sum(map(len, metas)) if metas else 0)
        if not ring.fits_empty(nbytes, len(items)):
            raise Full(f"a batch of {len(items)} messages / {nbytes} bytes can never fit queue "
                       f"{self.name!r} (capacity {ring.capacity}, max_bytes {ring.size})")
        if timeout is not None and timeout < 0:
            raise InvalidArgument("timeout must be >= 0")
        deadline = None if timeout is None else time.monotonic() + timeout

        def attempt() -> int | None:
            off = ring.try_put_many(items, metas, time.time_ns(), producer, seq)
            if off == DUPLICATE:
                raise Duplicate(f"producer already wrote sequence {seq} (or a later one) to "
                                f"{self.name!r}: nothing was written")
            return off if off >= 0 else None

        if first_try:
            off = attempt()
            if off is not None:
                return off
        self._alive()
        if not block:
            raise Full(f"queue {self.name!r} is full")
        return self._sleep_until(attempt, self._nf, L.Q_PRODUCER_WAITERS, deadline,
                                 lambda: Full(f"queue {self.name!r} is full (timed out after {timeout} s)"))

    def _wake_consumers(self, n: int) -> None:
        """``n`` messages became available: wake co-located consumers sleeping on the
        not-empty semaphore and ring the doorbells of workers with requests parked here."""
        if self._w[L.Q_CONSUMER_WAITERS]:
            self._wake(self._ne, self._w[L.Q_CONSUMER_WAITERS], n)
        bells = self._mm[L.Q_BELLS:L.Q_BELLS + L.Q_BELLS_SIZE]
        if bells != NO_BELLS:
            RINGER.ring(bells, self._ring.instance_uid, self._ring.queue_id, self._att.bell_skip)

    @staticmethod
    def _wake(sem: posix_ipc.Semaphore, waiters: int, n: int) -> None:
        # a hint: never push the count far past the number of sleepers
        for _ in range(min(n, waiters - sem.value)):
            sem.release()

    # ------------------------------------------------------------ consume
    def _group(self, name: str, create: bool = True) -> int:
        """The index of a group (created, from the earliest retained offset, if new)."""
        return self._group_ref(name, create) & L.GI_MASK

    def _group_ref(self, name: str, create: bool = True) -> int:
        """The reference of a group, which its deliveries carry (``layout.group_ref``)."""
        gen = self._w[L.Q_GROUP_GEN]
        if gen != self._ggen:
            self._gcache = {}
            self._ggen = gen
        ref = self._gcache.get(name)
        if ref is None:
            with self._ring.clock:
                gi = self._groups.index(name)
                if gi < 0:
                    if not create:
                        self._groups.require(name)
                    _check_group_name(name)
                    gi = self._groups.create(name, "earliest")
                ref = self._groups.ref(gi)
            self._gcache[name] = ref
        return ref

    def get(self, group: str = options.DEFAULT_GROUP, block: bool = True, timeout: float | None = None,
            visibility_timeout: float | None = None) -> Message:
        if visibility_timeout is None:
            one = self._take_one(group)
            if one is not None and one[0] is not None:
                return one[0]
        return self._take(group, 1, block, timeout, visibility_timeout)[0]

    def _take_one(self, group: str) -> tuple[Message | None, int, int] | None:
        """The hot path of taking one message: a known group, the queue's groups
        unchanged, a client slot of ours.  None when it does not apply; else (the message
        leased, or None when no new one was ready, the group index, the time in ms).
        Taking the consumer lock is also the full barrier a doorbell's flag needs."""
        ref = self._gcache.get(group)
        owner = self._att._slot
        w = self._w
        if ref is None or owner is None or w[4] != 1:  # Q_STATE
            return None
        gi = ref & 63  # L.GI_MASK
        now = _monotonic_ns() // 1_000_000 if self._real_clock else self._now()
        addr = self._clock_addr
        rc = trylock(addr)
        if rc:
            self._ring.clock.acquire_slow(rc)
        try:
            if w[35] != self._ggen:  # Q_GROUP_GEN: a group was created or deleted since we looked
                return None
            m = self._groups.deliver_one(gi, ref, 9 | (owner << 11) | ((now + self._vis) << 24), now,
                                         Message, self, group)
        finally:
            unlock(addr)
        return m, gi, now

    def get_many(self, max_messages: int, group: str = options.DEFAULT_GROUP, block: bool = True,
                 timeout: float | None = None, visibility_timeout: float | None = None) -> list[Message]:
        if max_messages < 1:
            raise InvalidArgument("max_messages must be >= 1")
        return self._take(group, max_messages, block, timeout, visibility_timeout)

    def _take(self, group: str, max_n: int, block: bool, timeout: float | None,
              visibility_timeout: float | None, max_bytes: int = 0) -> list[Message]:
        w = self._w
        tw = self._groups.tail_word
        if w[4] != 1:  # Q_STATE
            self._alive()
        ref = self._group_ref(group)
        gi = ref & L.GI_MASK
        att = self._att
        owner = att._slot
        if owner is None:
            owner = att.client_slot()
        vis = self._ring.visibility_ms if visibility_timeout is None else _ms(
            visibility_timeout, "visibility_timeout")
        if timeout is None:
            deadline = None
        elif timeout >= 0:
            deadline = time.monotonic() + timeout
        else:
            raise InvalidArgument("timeout must be >= 0")
        clock = self._ring.clock
        addr = clock.address
        deliver = self._groups.deliver
        waiting = False
        got: list[Message] = []
        dead: list[DeadItem] = []
        prefix = (self, ref, group)
        g = self._ring.groups_w + gi * L.G_WORDS
        announce = False
        while True:
            now = self._now()
            rc = trylock(addr)
            if rc:
                clock.acquire_slow(rc)
            try:
                if waiting:
                    w[33] -= 1 if w[33] else 0  # Q_CONSUMER_WAITERS
                    waiting = False
                if w[g + L.G_SERIAL] != ref >> L.GI_BITS:  # deleted (maybe created again) meanwhile
                    ref = self._groups.ref(self._groups.require(group))
                    gi = ref & L.GI_MASK
                    prefix = (self, ref, group)
                    g = self._ring.groups_w + gi * L.G_WORDS
                deliver(gi, owner, now, max_n, vis, got, dead, Message, prefix, max_bytes)
                if not got and announce:
                    w[33] += 1  # announce a sleeper before letting go of the lock
                    waiting = True
                    if _CRASH:
                        crashpoints.hit("wait.announced")
            finally:
                unlock(addr)
            if dead:
                self._dead_letter(dead)
                dead = []
            if got:
                return got
            att.reap(now)
            if not block:
                raise Empty(f"queue {self.name!r} has no message for group {group!r}")
            if not announce:
                # A producer is likely mid-put: look again for a moment before sleeping.
                for _ in range(options.SPIN_CHECKS):
                    if w[tw] > w[g + 1]:  # Q_NEXT_OFFSET (Q_DURABLE_OFFSET if `always`) > G_CURSOR
                        break
                announce = True
                continue
            announce = False  # after the sleep, look again before announcing again
            wait = options.WAIT_SLICE
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    with clock:
                        w[33] -= 1 if w[33] else 0
                    raise Empty(f"no message for group {group!r} of queue {self.name!r} "
                                f"within {timeout} s")
                wait = min(wait, remaining)
            if w[tw] > w[g + L.G_CURSOR]:
                continue  # published while we announced ourselves
            if w[g + L.G_REDELIVER]:
                wait = max(0.0, min(wait, (w[g + L.G_NEXT_READY] - now) / 1000))
            if w[g + L.G_NEXT_EXPIRY]:
                wait = max(0.0, min(wait, (w[g + L.G_NEXT_EXPIRY] - now) / 1000))
            if w[L.Q_STATE] != L.QS_ACTIVE:
                with clock:
                    w[33] -= 1 if w[33] else 0
                self._alive()
            try:
                self._ne.acquire(wait)
            except _BusyError:
                pass

    # ------------------------------------------------------------ settle
    def _ack_nowait(self, msg: Message) -> None:
        self._ack(msg, wait_durable=False)

    def _ack(self, msg: Message, wait_durable: bool = True) -> None:
        ref = msg[1]
        if ref < 0 or msg[0] is not self:
            raise self._not_ours(msg)
        addr = self._clock_addr
        rc = trylock(addr)
        if rc:
            self._ring.clock.acquire_slow(rc)
        try:
            result = self._groups.ack(ref, msg[3], msg[4])
        finally:
            unlock(addr)
        if result == FREED:
            if self._w[27]:  # Q_PRODUCER_WAITERS
                self._wake(self._nf, self._w[27], 1)
        elif result == STALE:
            raise self._stale(msg)
        if self._durable:
            if wait_durable:
                self._settled()
            else:
                self._dur.poke()

    def _not_ours(self, msg: Message) -> StaleAck:
        return StaleAck(f"message {msg[3]} is not a delivery of {self.name!r} (read() results "
                        "cannot be settled)")

    def _stale(self, msg: Message) -> StaleAck:
        return StaleAck(f"the lease of message {msg[3]} (delivery {msg[4]}) on {self.name!r} is no "
                        "longer held: it was settled already, or it expired and was given back")

    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        """nack / touch / dead-letter (ack has its own path, ``_ack``)."""
        if action == ACK:
            return self._ack(msg)
        _sync(self._settle_unsynced(msg, action, arg))

    def _settle_unsynced(self, msg: Message, action: Settle, arg: float | None) -> Mark | None:
        """nack / touch / dead-letter, not waiting for the journal: the mark that confirms
        it on an ``always`` queue (``shmq.durability``)."""
        ref = msg[1]
        if ref < 0 or msg[0] is not self:
            raise self._not_ours(msg)
        if action == TOUCH:
            arg_ms = self._ring.visibility_ms if arg is None else _ms(arg, "visibility_timeout")
        else:
            if action == DEAD and self.is_dlq:
                raise InvalidArgument("a message of a dead-letter queue cannot be dead-lettered")
            arg_ms = _ms(arg or 0.0, "delay")
        owner = self._att.client_slot()
        with self._ring.clock:
            result = self._groups.settle(ref, msg[3], msg[4], action, owner, self._now(), arg_ms)
        if result == STALE:
            raise self._stale(msg)
        mark = self._dur.settle_mark() if action != TOUCH else None
        if result == OK and action == NACK and not arg_ms:
            self._wake_consumers(1)  # deliverable again now, wherever its consumers wait
        if result == TO_DLQ:
            reason = "nack" if action == NACK else "dead_letter"
            self._dead_letter([(ref & L.GI_MASK, msg[3], msg[4], reason)], options.WAIT_SLICE * 20)
        return mark

    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        msgs, stale, total = own_leases(self, messages)
        if not total:
            return
        clock = self._ring.clock
        clock.acquire()
        try:
            freed = self._groups.ack_batch(msgs, stale)
        finally:
            clock.release()
        self._after_acks(freed, len(msgs), wait)
        if stale:
            raise StaleAck.of_batch(stale, total)

    def _after_acks(self, freed: bool, n: int, wait_durable: bool = True) -> None:
        if freed and self._w[27]:  # Q_PRODUCER_WAITERS
            self._wake(self._nf, self._w[27], n)
        if self._durable:
            if wait_durable:
                self._settled()
            else:
                self._dur.poke()

    # ------------------------------------------------------------ dead letters
    def _dead_letter(self, items: list[DeadItem], wait: float = 0.0) -> None:
        """Copy DEADING messages (owned by us, pinned) to the dead-letter queue, then mark
        DONE.  A dead-letter queue's own message (given back 255 times: its delivery count
        would saturate) is moved to the tail of the same queue, its origin kept.  ``wait``:
        how long a copy may wait for room in a full DLQ before it is orphaned (retried by
        the next reap): only a caller's own nack or dead-letter waits, never a reaper, an
        expiry or a give-back done for others."""
        ring = self._ring
        dlq: ShmQueue | None = self
        if not self.is_dlq:
            try:
                dlq = self._att.dead_letter_queue(self)
            except ShmqError:  # e.g. a journaled DLQ while no journal writer runs: retried later
                dlq = None
        names = dict(self._groups.active())
        for gi, off, dc, reason in items:
            payload, meta, ts = ring.record(off)
            origin = meta if self.is_dlq else json.dumps(
                {"queue": self.name, "offset": off, "group": names.get(gi, "?"), "reason": reason,
                 "deliveries": dc, "timestamp_ns": ts}).encode()
            try:
                if dlq is None:
                    raise Full("no dead-letter queue")
                dlq._put_meta(payload, origin, wait)
            except (Full, QueueNotFound, Timeout, StorageError):  # retried by maintenance
                with ring.clock:
                    self._groups.orphan_dead(gi, off, dc)
                continue
            if _CRASH:
                crashpoints.hit("dlq.copied")
            with ring.clock:
                freed = self._groups.finish_dead(gi, off, dc)
            if freed and self._w[L.Q_PRODUCER_WAITERS]:
                self._wake(self._nf, self._w[L.Q_PRODUCER_WAITERS], 1)

    # ------------------------------------------------------------ maintenance
    def maintain(self, now: int | None = None) -> int:
        """Expire leases of every group and retry orphaned dead-letters; the number returned."""
        self._alive()
        now = self._now() if now is None else now
        owner = self._att.client_slot()
        dead: list[DeadItem] = []
        with self._ring.clock:
            n = sum(self._groups.expire(gi, now, owner, dead) for gi, _ in self._groups.active())
            if self._w[L.Q_ORPHANS]:
                self._w[L.Q_ORPHANS] = 0
                self._groups.reap_owner(L.NO_OWNER, owner, now, dead)
        if dead:
            self._dead_letter(dead)
        if n:
            self._wake_consumers(n)
        return n

    def _reap_client(self, client: int, now: int, identity: tuple[int, int] | None = None) -> int:
        """Give back the leases of client slot ``client`` here.  ``identity``: the (pid,
        start) of the dead process it must still hold -- checked under the consumer lock,
        where no new holder of the slot can lease anything meanwhile."""
        owner = self._att.client_slot()
        dead: list[DeadItem] = []
        with self._ring.clock:
            if identity is not None and not self._att.registry.holds(client, *identity):
                return 0  # reaped and reused already: the leases are a live process's
            n = self._groups.reap_owner(client, owner, now, dead)
        if dead:
            self._dead_letter(dead)
        if n:
            self._wake_consumers(n)
        return n

    # ------------------------------------------------------------ groups, replay, stats
    # Each change of group state has an ``_unsynced`` form that returns the mark confirming
    # it on an ``always`` queue instead of waiting for it (``shmq.serverqueue`` uses those).
    def create_group(self, name: str, start: str = "earliest") -> None:
        _sync(self._create_group_unsynced(name, start))

    def _create_group_unsynced(self, name: str, start: str) -> Mark | None:
        self._alive()
        _check_group_name(name)
        with self._ring.clock:
            self._groups.create(name, start)
        return self._dur.settle_mark()

    def delete_group(self, name: str) -> None:
        _sync(self._delete_group_unsynced(name))

    def _delete_group_unsynced(self, name: str) -> Mark | None:
        self._alive()
        if name == options.DEFAULT_GROUP:
            raise InvalidArgument("the default group cannot be deleted")
        with self._ring.clock:
            freed = self._groups.delete(self._groups.require(name))
        if freed and self._w[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self._w[L.Q_PRODUCER_WAITERS], 1)
        return self._dur.settle_mark()

    def groups(self) -> list[str]:
        return [name for _, name in self._groups.active()]

    def commit(self, group: str, offset: int) -> None:
        """Settle every message of ``group`` below ``offset`` (leases on them turn stale)."""
        _sync(self._commit_unsynced(group, offset))

    def _commit_unsynced(self, group: str, offset: int) -> Mark | None:
        self._alive()
        if offset < 0:
            raise InvalidArgument("offset must be >= 0")
        with self._ring.clock:
            freed = self._groups.commit(self._groups.require(group), offset)
        if freed and self._w[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self._w[L.Q_PRODUCER_WAITERS], 1)
        return self._dur.settle_mark()

    def purge(self) -> int:
        """Drop every retained message for every group; the number dropped."""
        n, mark = self._purge_unsynced()
        _sync(mark)
        return n

    def _purge_unsynced(self) -> tuple[int, Mark | None]:
        self._alive()
        with self._ring.clock:
            first, nxt = self._w[L.Q_FREE_OFFSET], self._w[L.Q_NEXT_OFFSET]
            for gi, _ in self._groups.active():
                self._groups.commit(gi, nxt)
        if self._w[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self._w[L.Q_PRODUCER_WAITERS], self._w[L.Q_PRODUCER_WAITERS])
        return int(nxt - first), self._dur.settle_mark()

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        """Retained messages from ``offset`` on, without leasing them (replay)."""
        self._alive()
        if max_messages < 1 or offset < 0:
            raise InvalidArgument("offset must be >= 0 and max_messages >= 1")
        ring = self._ring
        out = []
        with ring.clock:
            start = max(offset, self._w[L.Q_FREE_OFFSET])
            end = min(self._w[self._groups.tail_word], start + max_messages)
            for off in range(start, end):
                payload, meta, ts = ring.record(off)
                out.append(Message((self, -1, None, off, 0, payload, meta, ts)))
        return out

    def offsets(self) -> tuple[int, int]:
        """(first retained offset, next offset to be delivered: on an ``always`` queue, the
        next one not yet journaled)."""
        return self._w[L.Q_FREE_OFFSET], self._w[self._groups.tail_word]

    def stats(self) -> dict[str, Any]:
        self.maintain()
        ring = self._ring
        w = self._w
        with ring.clock:
            free, nxt = w[L.Q_FREE_OFFSET], w[L.Q_NEXT_OFFSET]
            used = 0
            if nxt > free:
                used = w[L.Q_TAIL_BYTES] - w[ring.slot_base(free) + L.S_BYTEPOS]
            groups = {name: self._groups.stats(gi) for gi, name in self._groups.active()}
        return {
            "name": self.name, "is_dlq": self.is_dlq, "retained": nxt - free, "bytes_used": used,
            "capacity": ring.capacity, "max_bytes": ring.size, "first_offset": free, "next_offset": nxt,
            "produced": nxt, "fill": max((nxt - free) / ring.capacity, used / ring.size),
            "groups": groups, "lock_recoveries": w[L.Q_PLOCK_RECOVERIES] + w[L.Q_CLOCK_RECOVERIES],
            "config": self.config.__dict__,
            # journaled queues: offsets below durable_offset are on disk; journal_error is the
            # errno of a failing journal write (produce is refused meanwhile), else null
            "durable_offset": self.durable_offset(),
            "journal_error": (errno.errorcode.get(w[L.Q_JOURNAL_ERRNO], w[L.Q_JOURNAL_ERRNO])
                              if w[L.Q_JOURNAL_ERRNO] else None),
        }


def _sync(mark: Mark | None) -> None:
    """Wait for a durable mark (``always`` queues); None: nothing to wait for."""
    if mark is not None:
        mark.wait()


def _ms(seconds: float, what: str) -> int:
    if not 0 <= seconds <= options.MAX_VISIBILITY_TIMEOUT:
        raise InvalidArgument(f"{what} must be between 0 and {options.MAX_VISIBILITY_TIMEOUT} s")
    return int(seconds * 1000)


