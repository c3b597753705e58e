"""The machinery every queue handle shares: its words and semaphores, sleeping and
waking, groups by name, dead-letter copies and maintenance.

A handle is one class in three modules, declared in ``shmq.core.queue``::

    class ShmQueue(Consuming, QueueHandle, QueueABC)
      shmq.core.queue      ShmQueue: the public api.Queue: produce, groups, replay, stats
      shmq.core.consumer   Consuming, a mixin: get / get_many, and settling their leases
      shmq.core.handle     QueueHandle, the base: this module (the state, and what both use)

Blocking follows ``queue.Queue``: ``block=True, timeout=None`` waits for ever,
``timeout`` bounds the whole call on the monotonic clock, ``block=False``
raises at once.  Waiting sleeps on the queue's semaphores, which are only
wake-up hints: every sleep is at most ``options.WAIT_SLICE`` long and then
re-reads the header, so a count left wrong by a dead process costs latency,
never a lost wake-up.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

import posix_ipc

from shmq import crashpoints, options
from shmq.api import Message, QueueConfig
from shmq.core import layout as L
from shmq.core.doorbell import NO_BELLS, RINGER
from shmq.core.durability import Durability, Mark
from shmq.core.groups import DeadItem, Groups
from shmq.core.registry import Registry
from shmq.core.ring import DUPLICATE, Ring
from shmq.errors import (
    Duplicate,
    Full,
    InstanceError,
    InvalidArgument,
    QueueNotFound,
    ShmqError,
    StorageError,
    Timeout,
)
from shmq.headers import block_of
from shmq.joined import nbytes as batch_bytes
from shmq.journal.files import queue_dir
from shmq.names import check_group_name as _check_group_name
from shmq.names import level_of

_ALWAYS = options.DURABILITY_MODES.index("always")
_CLOSED = "closed"  # QueueHandle.release's reason when the broker handle was closed
# a semaphore sleep ends at its timeout, or early once a signal was handled (its handler
# did not raise: a CLI's Ctrl-C, a SIGCHLD, ...): either way the waiter looks again
_BusyError = (posix_ipc.BusyError, posix_ipc.SignalError)
_monotonic_ns = time.monotonic_ns


class Host(Protocol):
    """What a queue handle needs of the process's view of its instance (``shm.Attachment``,
    which makes the handles: this module does not import it)."""

    url: str
    now_ms: Callable[[], int]
    wall_ns: Callable[[], int]  # the producers' timestamps and the TTL's clock
    bell_skip: int
    _slot: int | None  # this process's client slot, None until it has one (read on the hot path)

    @property
    def registry(self) -> Registry: ...
    def client_slot(self) -> int: ...
    def reap(self, now: int, force: bool = False) -> int: ...
    def forget(self, queue_id: int) -> None: ...
    def queue(self, name: str) -> QueueHandle: ...
    def dead_letter_queue(self, q: QueueHandle) -> QueueHandle | None: ...


def monotonic_ms() -> int:
    """The default clock of leases and delays: monotonic, system-wide, in ms."""
    return _monotonic_ns() // 1_000_000




class QueueHandle:
    """One queue of a co-located instance: what every part of the handle shares (the base
    class of ``ShmQueue``, and what its mixin ``Consuming`` is typed against)."""

    # A priority queue's level above 0: its level 0, whose consumers it wakes too
    # (``wake_base``).  A class default, not an instance field: a handle's fields stay few
    # enough for CPython to share their keys, which its hot paths' lookups are quicker for.
    _base: QueueHandle | None = None

    def __init__(self, att: Host, ring: Ring, not_empty: posix_ipc.Semaphore,
                 not_full: posix_ipc.Semaphore, journal: posix_ipc.Semaphore,
                 durable: posix_ipc.Semaphore) -> None:
        self._att = att
        self.ring = ring
        ring.mapping.populate()  # this process's page tables filled in once, not faulted in by puts and gets
        self.consumer_groups = Groups(ring, att.wall_ns)
        self._wall = att.wall_ns
        self.words = ring.w
        self._ne = not_empty
        self._nf = not_full
        self._js = journal
        self._ds = durable
        self._durable = ring.durability != 0
        self._always = ring.durability == _ALWAYS
        self.name = ring.name
        self._max = ring.max_message_size
        self._gcache: dict[str, int] = {}  # group name -> reference (layout.group_ref)
        self._spin = int(options.LOCAL_SPIN_US * 1000)  # ns a blocked get spins before it sleeps
        self._ggen = -1
        self._now = att.now_ms
        self._real_clock = att.now_ms is monotonic_ms  # the hot path reads it inline
        self._vis = ring.visibility_ms
        self._clock_addr = ring.clock.address
        self._mm = ring.mm  # the bell table is read as one slice of it (no buffer export kept)
        self.durability = Durability(self)  # the durable marks (both sides: shmq.core.durability)
        self._one = self.consumer_groups.one_geom(Message, self)  # for the compiled deliver_one (consume)
        # let go of (``release``): why, once the queue was deleted or its broker handle closed
        self._gone: str | None = None
        self._life = threading.Lock()  # guards the fields below
        self._sleepers = 0  # threads of this process asleep on a semaphore of the queue
        self._sems_open = True

    def __repr__(self) -> str:
        return f"ShmQueue({self._att.url!r}, {self.name!r})"

    @property
    def config(self) -> QueueConfig:
        """The limits the queue was created with (``QueueConfig``)."""
        r = self.ring
        return QueueConfig(r.capacity, r.size, r.max_message_size, r.visibility_ms / 1000,
                           r.max_deliveries, r.max_groups, options.DURABILITY_MODES[r.durability],
                           r.message_ttl_ms / 1000, not r.flags & L.F_TTL_DROP,
                           "sync" if r.flags & L.F_REPL_SYNC else "async" if r.flags & L.F_REPL_ASYNC else "",
                           r.priorities)

    @property
    def base_name(self) -> str:
        """The queue this one holds a level of (``jobs`` for ``jobs.prio3``), else its name."""
        return level_of(self.ring.name)[0]

    @property
    def level(self) -> int:
        """The priority level this queue holds of ``base_name`` (0: level 0, or no priority queue)."""
        return level_of(self.ring.name)[1]

    @property
    def is_dlq(self) -> bool:
        """True for a dead-letter queue (``<queue>.dlq``)."""
        return bool(self.ring.flags & L.F_DLQ)

    def _alive(self) -> None:
        if self.words[L.Q_STATE] != L.QS_ACTIVE:
            if self._gone is None:
                self._att.forget(self.ring.queue_id)  # (lets go of it: ``release``)
            self._raise_gone()

    # ------------------------------------------------------------ letting go
    def release(self, why: str = "deleted") -> bool:
        """Let go of the queue's memory and semaphores in this process, for good (``why``:
        "deleted", or "closed" with the broker handle): from now on the handle raises
        :class:`QueueNotFound` (:class:`InstanceError` when closed).  Views of the segment
        stay valid and read zeros (``Mapping.vacate``), so a call in flight in another
        thread ends with an error, never a fault.  Done at once unless a thread of this
        process holds, or waits for, one of the queue's locks (False: call again later);
        semaphores go when the last thread asleep on one wakes."""
        with self._life:
            if self._gone is None:
                self._gone = why
            ring = self.ring
            if not ring.mapping.vacated:
                if ring.plock.busy_here() or ring.clock.busy_here():
                    return False
                ring.mapping.vacate()
            if not self._sleepers:
                self._close_semaphores()
        return True

    def _close_semaphores(self) -> None:
        if self._sems_open:
            self._sems_open = False
            for sem in (self._ne, self._nf, self._js, self._ds):
                try:
                    sem.close()
                except posix_ipc.Error:
                    pass

    def _sem_sleep(self, sem: posix_ipc.Semaphore, timeout: float) -> None:
        """Sleep on one of the queue's semaphores at most ``timeout`` s (a wake-up hint: a
        post, a timeout and a signal handled all return).  Counted, so that ``release``
        never closes a semaphore a thread sleeps on."""
        with self._life:
            if self._gone is not None:
                self._raise_gone()
            self._sleepers += 1
        try:
            sem.acquire(timeout)
        except _BusyError:
            pass
        finally:
            with self._life:
                self._sleepers -= 1
                if self._gone is not None and self.ring.mapping.vacated and not self._sleepers:
                    self._close_semaphores()

    def _raise_gone(self) -> NoReturn:
        """The error of a deleted queue's handle, or of one whose broker handle was closed."""
        if self._gone == _CLOSED:
            raise InstanceError(f"queue {self.name!r}: the broker handle it came from was closed")
        raise QueueNotFound(f"queue {self.name!r} was deleted")

    def _journal_dir(self) -> str | None:
        """Where the journal of this queue lives (None: no journal writer has said)."""
        data_dir = self._att.registry.data_dir()
        return str(queue_dir(data_dir, self.name)) if data_dir else None

    def durable_offset(self) -> int:
        """Offsets below this are as durable as the queue's policy makes them."""
        return self.durability.offset()

    def wait_durable(self, end: int, deadline: float | None = None) -> None:
        """Wait until every offset below ``end`` is in the journal (fsynced).  Raises
        :class:`Timeout` at ``deadline`` (monotonic s), :class:`StorageError` when the
        journal writer reports a write error."""
        self.durability.wait(L.Q_DURABLE_OFFSET, end, deadline)

    def _settled(self) -> None:
        """After a change of group state on a journaled queue: tell the journal writer;
        on an ``always`` queue, return once the change is on disk."""
        _sync(self.durability.settle_mark())

    def _sleep_until(self, attempt: Callable[[], int | None], sem: posix_ipc.Semaphore, waiters: int,
                     deadline: float | None, expired: Callable[[], Exception]) -> int:
        """Call ``attempt`` until it returns a value.  Between tries, sleep on ``sem`` (a
        wake-up hint, at most ``WAIT_SLICE``), announced in the header word ``waiters`` so
        that wakers post it; raise ``expired()`` at ``deadline`` (monotonic s)."""
        w = self.words
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
                    with self.ring.plock:
                        w[waiters] += 1
                    registered = True
                    continue  # try again after announcing ourselves: no lost wake-up
                self._sem_sleep(sem, wait)
        finally:
            if registered:
                with self.ring.plock:
                    w[waiters] -= 1 if w[waiters] else 0

    def _put_meta(self, payload: bytes, meta: bytes, timeout: float) -> int:
        """Internal: append with metadata (dead-letter origin); on an ``always`` queue,
        the caller waits for ``_dur.put_mark(off + 1)`` before it settles the original."""
        self._alive()
        if self._durable:
            self.durability.check()
        off = self._put_wait([payload], [meta], True, timeout, first_try=True)
        self._wake_consumers(1)
        return off

    def _put_wait(self, items: list[Any], metas: list[bytes] | None, block: bool,
                  timeout: float | None, first_try: bool = False, producer: int = 0, seq: int = 0,
                  delay: int = 0, ttl: int = 0) -> int:
        """Store a batch (``delay``, ``ttl``: ms, 0 for none), sleeping for room as asked."""
        ring = self.ring
        nbytes = batch_bytes(items) + (sum(map(len, metas)) if metas else 0)
        if not ring.fits_empty(nbytes, len(items)):
            raise Full(f"a batch of {len(items)} messages / {nbytes} bytes can never fit queue "
                       f"{self.name!r} (capacity {ring.capacity}, max_bytes {ring.size})")
        if timeout is not None and timeout < 0:
            raise InvalidArgument("timeout must be >= 0")
        deadline = None if timeout is None else time.monotonic() + timeout

        def attempt() -> int | None:
            ts = self._wall()
            off = ring.try_put_many(items, metas, ts, producer, seq, self._now() + delay if delay else 0,
                                    ts + ttl * 1_000_000 if ttl else 0)
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
        if self.words[L.Q_CONSUMER_WAITERS]:
            self._wake(self._ne, self.words[L.Q_CONSUMER_WAITERS], n)
        bells = self._mm[L.Q_BELLS:L.Q_BELLS + L.Q_BELLS_SIZE]
        if bells != NO_BELLS:
            RINGER.ring(bells, self.ring.instance_uid, self.ring.queue_id, self._att.bell_skip)

    def wake_base(self, base: QueueHandle) -> None:
        """This queue is a level of the priority queue whose level 0 is ``base``: its wake-ups
        wake ``base``'s consumers too, and ring ``base``'s doorbells, where that queue's
        consumers wait (set on the instance: a plain queue's puts pay nothing for it)."""
        self._base = base
        own = type(self)._wake_consumers

        def wake(n: int) -> None:
            own(self, n)
            base._wake_consumers(n)
        self._wake_consumers = wake  # type: ignore[method-assign]

    @staticmethod
    def _wake(sem: posix_ipc.Semaphore, waiters: int, n: int) -> None:
        # a hint: never push the count far past the number of sleepers
        try:
            for _ in range(min(n, waiters - sem.value)):
                sem.release()
        except posix_ipc.ExistentialError:
            pass  # closed: the queue was let go of (``release``), nobody here sleeps on it

    # ------------------------------------------------------------ groups by name
    def _group_ref(self, name: str, create: bool = True) -> int:
        """The reference of a group, which its deliveries carry (``layout.group_ref``)."""
        gen = self.words[L.Q_GROUP_GEN]
        if gen != self._ggen:
            self._gcache = {}
            self._ggen = gen
        ref = self._gcache.get(name)
        if ref is None:
            with self.ring.clock:
                gi = self.consumer_groups.index(name)
                if gi < 0:
                    if not create:
                        self.consumer_groups.require(name)
                    _check_group_name(name)
                    gi = self.consumer_groups.create(name, "earliest")
                ref = self.consumer_groups.ref(gi)
            self._gcache[name] = ref
        return ref

    # ------------------------------------------------------------ dead letters
    def _dead_letter(self, items: list[DeadItem], wait: float = 0.0) -> None:
        """Copy DEADING messages (owned by us, pinned) to the dead-letter queue, then mark
        DONE.  A dead-letter queue's own message (given back 255 times: its delivery count
        would saturate) is moved to the tail of the same queue, its origin kept.  ``wait``:
        how long a copy may wait for room in a full DLQ before it is orphaned (retried by
        the next reap): only a caller's own nack or dead-letter waits, never a reaper, an
        expiry or a give-back done for others.  On an ``always`` DLQ the originals are
        settled once the journal has every copy (one mark for the batch), waited for at
        least ``DEAD_LETTER_SYNC_WAIT``: a copy orphaned for want of an fsync would be
        copied again at every retry."""
        ring = self.ring
        dlq: QueueHandle | None = self
        if not self.is_dlq:
            try:
                dlq = self._att.dead_letter_queue(self)
            except ShmqError:  # e.g. a journaled DLQ while no journal writer runs: retried later
                dlq = None
        names = dict(self.consumer_groups.active())
        copied: list[tuple[int, int, int]] = []  # (group, offset, deliveries) of the copies made
        last = -1
        for gi, off, dc, reason in items:
            payload, meta, ts = ring.record(off)
            origin = meta if self.is_dlq else block_of(meta) + json.dumps(
                {"queue": self.base_name, "offset": self.level << options.PRIORITY_SHIFT | off,
                 "group": names.get(gi, "?"), "reason": reason,
                 "deliveries": dc, "timestamp_ns": ts}).encode()
            try:
                if dlq is None:
                    raise Full("no dead-letter queue")
                last = dlq._put_meta(payload, origin, wait)
            except (Full, QueueNotFound, Timeout, StorageError):  # retried by maintenance
                with ring.clock:
                    self.consumer_groups.orphan_dead(gi, off, dc)
                continue
            copied.append((gi, off, dc))
        if not copied or dlq is None:
            return
        try:
            mark = dlq.durability.put_mark(last + 1)
            if mark is not None:  # an `always` DLQ: the originals stay until the copies are on disk
                mark.wait(time.monotonic() + max(wait, options.DEAD_LETTER_SYNC_WAIT))
        except (QueueNotFound, Timeout, StorageError):  # retried by maintenance
            with ring.clock:
                for gi, off, dc in copied:
                    self.consumer_groups.orphan_dead(gi, off, dc)
            return
        if crashpoints.active:
            crashpoints.hit("dlq.copied")
        freed = False
        with ring.clock:
            for gi, off, dc in copied:
                freed = self.consumer_groups.finish_dead(gi, off, dc) or freed
        if freed and self.words[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self.words[L.Q_PRODUCER_WAITERS], 1)

    # ------------------------------------------------------------ maintenance
    def maintain(self, now: int | None = None) -> int:
        """Expire leases of every group and retry orphaned dead-letters; the number returned."""
        self._alive()
        now = self._now() if now is None else now
        owner = self._att.client_slot()
        dead: list[DeadItem] = []
        with self.ring.clock:
            groups = self.consumer_groups
            n = sum(groups.expire(gi, now, owner, dead) for gi, _ in groups.active())
            if self.words[L.Q_ORPHANS]:
                self.words[L.Q_ORPHANS] = 0
                self.consumer_groups.reap_owner(L.NO_OWNER, owner, now, dead)
        if dead:
            self._dead_letter(dead)
        if n:
            self._wake_consumers(n)
        return n

    def sweep_ttl(self, budget: int = options.TTL_SWEEP_BATCH) -> int:
        """Expire, in every group, what a delivery would expire now (``Groups.sweep``: from
        the cursor up to the first live message), looking at most at ``budget`` lease words
        per group, in one hold of the consumer lock per group; the number expired.  The
        broker's maintenance calls it on every queue with a TTL, so that expired messages
        reach the dead-letter queue (or are dropped) with nobody consuming.  An empty queue
        forgets that it held messages with a TTL of their own (``Q_EXPIRES_MAX`` back to 0),
        so its deliveries stop looking at S_EXPIRES."""
        w = self.words
        if w[L.Q_EXPIRES_MAX] and w[L.Q_FREE_OFFSET] == w[L.Q_NEXT_OFFSET]:
            with self.ring.plock:  # (no put in progress; the free offset only rises)
                if w[L.Q_FREE_OFFSET] == w[L.Q_NEXT_OFFSET]:
                    w[L.Q_EXPIRES_MAX] = 0
        if not self.ring.message_ttl_ms and not w[L.Q_EXPIRES_MAX]:
            return 0
        self._alive()
        now = self._now()
        owner = self._att.client_slot()
        free = w[L.Q_FREE_OFFSET]
        dead: list[DeadItem] = []
        n = 0
        for gi, _ in self.consumer_groups.active():
            with self.ring.clock:  # (a group deleted meanwhile is skipped there)
                n += self.consumer_groups.sweep(gi, owner, now, budget, dead)
        if dead:
            self._dead_letter(dead)
        if n and self._durable:
            self.durability.poke()
        if w[L.Q_FREE_OFFSET] != free and w[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, w[L.Q_PRODUCER_WAITERS], w[L.Q_PRODUCER_WAITERS])
        return n

    def _reap_client(self, client: int, now: int, identity: tuple[int, int] | None = None) -> int:
        """Give back the leases of client slot ``client`` here.  ``identity``: the (pid,
        start) of the dead process it must still hold -- checked under the consumer lock,
        where no new holder of the slot can lease anything meanwhile."""
        owner = self._att.client_slot()
        dead: list[DeadItem] = []
        with self.ring.clock:
            if identity is not None and not self._att.registry.holds(client, *identity):
                return 0  # reaped and reused already: the leases are a live process's
            n = self.consumer_groups.reap_owner(client, owner, now, dead)
            if identity is not None and n:  # a dead process's, not our own given back at exit
                self.words[L.Q_LEASES_REAPED] += n
        if dead:
            self._dead_letter(dead)
        if n:
            self._wake_consumers(n)
        return n


def _sync(mark: Mark | None) -> None:
    """Wait for a durable mark (``always`` queues); None: nothing to wait for."""
    if mark is not None:
        mark.wait()


def _ms(seconds: float, what: str) -> int:
    if not 0 <= seconds <= options.MAX_VISIBILITY_TIMEOUT:
        raise InvalidArgument(f"{what} must be between 0 and {options.MAX_VISIBILITY_TIMEOUT} s")
    return int(seconds * 1000)



