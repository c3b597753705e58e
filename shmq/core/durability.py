"""Durable marks: both sides of the protocol between a journaled queue and its journal writer.

::

    producers, ackers (any process)               the journal writer (one thread per queue)
    ───────────────────────────────               ─────────────────────────────────────────
    change the ring or a lease word;              snapshot(): the group state (consumer lock),
      group changes bump Q_SETTLE_SEQ               then Q_NEXT_OFFSET (producer lock)
    poke(): post .j if the writer sleeps  ──►     append the new records and the snapshot,
                                                    fsync
    Mark(word, value).wait(): sleep on .d ◄──     publish(): Q_DURABLE_OFFSET, Q_DURABLE_SETTLE,
      (StorageError while Q_JOURNAL_ERRNO)          the free offset; wake .d, .nf, consumers
                                                  fail(errno): Q_JOURNAL_ERRNO, wake .d

A *mark* is a header word and the value it must reach before a change counts as
durable: ``Q_DURABLE_OFFSET >= end`` for a put of offsets below ``end``, and
``Q_DURABLE_SETTLE >= seq`` for a change of group state that left ``Q_SETTLE_SEQ``
at ``seq`` (or later: a mark taken after someone else's change only waits longer).
Both words only rise, and only the writer stores them.  Memory-only queues hold
``NO_MARK`` in both, so every mark on them is reached.

An ``always`` queue confirms a put or a settle once its mark is reached: a
blocking caller waits here (:meth:`Mark.wait`); the broker's event loop may not
block, so it takes the mark as a value (``shmq.core.serverqueue``) and holds the reply
until a thread of its own sees the mark reached.  An ``interval`` queue never
waits for marks: the writer runs at least every ``sync_interval`` seconds.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import posix_ipc

from shmq import options
from shmq.core import layout as L
from shmq.core.groups import Groups
from shmq.core.ring import Ring
from shmq.errors import StorageError, Timeout


class Journaled(Protocol):
    """What the marks need of their queue's handle (``handle.QueueHandle``, which makes its
    ``Durability``: this module does not import it)."""

    name: str
    ring: Ring
    consumer_groups: Groups
    words: Any  # the header words (a memoryview cast to "Q")
    _js: posix_ipc.Semaphore
    _ds: posix_ipc.Semaphore
    _nf: posix_ipc.Semaphore
    _now: Callable[[], int]  # the lease clock, monotonic ms

    def _sleep_until(self, attempt: Callable[[], int | None], sem: posix_ipc.Semaphore, waiters: int,
                     deadline: float | None, expired: Callable[[], Exception]) -> int: ...
    def _wake(self, sem: posix_ipc.Semaphore, waiters: int, n: int) -> None: ...
    def _sem_sleep(self, sem: posix_ipc.Semaphore, timeout: float) -> None: ...
    def _journal_dir(self) -> str | None: ...
    def _wake_consumers(self, n: int) -> None: ...

_ALWAYS = options.DURABILITY_MODES.index("always")
#: what ``Durability.wait`` returns for a settle mark let go of while the journal cannot be written
WAIVED = (1 << 64) - 1


class Mark(NamedTuple):
    """A header word of one queue and the value it must reach."""

    durability: Durability
    word: int  # L.Q_DURABLE_OFFSET or L.Q_DURABLE_SETTLE
    value: int

    def reached(self) -> bool:
        return bool(self.durability.w[self.word] >= self.value)

    def wait(self, deadline: float | None = None) -> None:
        """Return once reached.  Raises :class:`StorageError` while the journal cannot be
        written, :class:`Timeout` at ``deadline`` (monotonic s), ``QueueNotFound`` when
        the queue is deleted meanwhile."""
        self.durability.wait(self.word, self.value, deadline)


class Marks(list):  # type: ignore[type-arg]
    """The marks of one change made in several queues (a priority queue's levels): reached
    once each is; a held reply waits for them one after the other (``server.marks``)."""

    def reached(self) -> bool:
        return all(m.reached() for m in self)

    @staticmethod
    def of(marks: list[Mark | Marks | None]) -> Mark | Marks | None:
        """One mark for them all: None when there is none to wait for."""
        out = Marks()
        for m in marks:
            if isinstance(m, Marks):
                out.extend(m)
            elif m is not None:
                out.append(m)
        return None if not out else out[0] if len(out) == 1 else out


class Snapshot(NamedTuple):
    """What one round of the writer journals: the group state, then the tail."""

    settle_seq: int  # Q_SETTLE_SEQ before the group state was read
    groups: list[dict[str, Any]]
    next_offset: int  # Q_NEXT_OFFSET: offsets below it are published
    producers: list[tuple[int, int]]  # the idempotent producers' (key, last sequence)
    delays: list[tuple[int, int]] = []  # (offset, wall-clock ms when due) of the delayed messages


class Durability:
    """The durable marks of one queue (``q``: the handle whose header and semaphores they are)."""

    def __init__(self, q: Journaled) -> None:
        self._q = q
        self.ring = q.ring
        self.w = q.words
        self.name = q.name
        self.journaled = self.ring.durability != 0
        self.always = self.ring.durability == _ALWAYS
        self._js: posix_ipc.Semaphore = q._js  # posted to start a round
        self._ds: posix_ipc.Semaphore = q._ds  # posted when a mark moves (or the journal fails)

    # ------------------------------------------------------------ the queue's side
    def check(self) -> None:
        """Raise :class:`StorageError` while the journal cannot be written."""
        if self.w[L.Q_JOURNAL_ERRNO]:
            raise StorageError(f"queue {self.name!r} cannot take messages: {self.error_text()}; consumers "
                               "and their acks are still served")

    def error_text(self) -> str:
        """What the journal writer reports: the journal's path, and its errno."""
        err = self.w[L.Q_JOURNAL_ERRNO] or errno.EIO
        if err == errno.ESTALE:  # set by the journal writer of a fenced primary (server.replication)
            return ("this node was superseded by a newer primary (a higher epoch: shmq promote ran "
                    "elsewhere); it confirms no more writes: rejoin it as a standby "
                    "(shmq serve --replica-of)")
        if err == errno.ENOLINK:  # set by a `sync` queue's journal writer (server.replication)
            return ("no standby confirmed its copy within --sync-timeout (replication=\"sync\"); puts are "
                    "confirmed again once a standby does")
        where = self._q._journal_dir() or "its journal"
        return f"{where} cannot be written ({errno.errorcode.get(err, err)}: {os.strerror(err)})"

    def poke(self) -> None:
        """Wake the writer if it sleeps (an ``always`` round starts at once)."""
        if self.w[L.Q_JOURNAL_WAITING]:
            self.wake_writer()

    def offset(self) -> int:
        """Offsets below this are as durable as the queue's policy makes them."""
        return min(self.w[L.Q_DURABLE_OFFSET], self.w[L.Q_NEXT_OFFSET])

    def put_mark(self, end: int, poke: bool = True) -> Mark | None:
        """After a put of offsets below ``end``: the mark that confirms it on an ``always``
        queue (the writer poked, unless ``poke`` is False: it was already), None when
        nothing waits (or it is reached already)."""
        if not self.always:
            return None
        if poke:
            self.poke()
        return None if self.w[L.Q_DURABLE_OFFSET] >= end else Mark(self, L.Q_DURABLE_OFFSET, end)

    def settle_mark(self, poke: bool = True) -> Mark | None:
        """After a change of group state: the writer poked (unless ``poke`` is False: it
        was already); on an ``always`` queue, the mark that confirms the change (None
        when nothing waits)."""
        if not self.journaled:
            return None
        seq = self.w[L.Q_SETTLE_SEQ]  # moved by the change, under the consumer lock
        if poke:
            self.poke()
        if not self.always or self.w[L.Q_DURABLE_SETTLE] >= seq:
            return None
        return Mark(self, L.Q_DURABLE_SETTLE, seq)

    def wait(self, word: int, end: int, deadline: float | None, strict: bool = False) -> int:
        """Sleep on the ``.d`` semaphore (announced in ``Q_DURABLE_WAITERS``) until
        ``w[word] >= end``; see :meth:`Mark.wait`.  The mark's value reached: ``WAIVED``
        when a settle mark (``Q_DURABLE_SETTLE``) is let go of because the journal cannot
        be written -- a settle applied in memory stands then, confirmed without the
        journal (``strict``: raise :class:`StorageError` instead, as a put's mark does)."""
        w = self.w
        if w[word] >= end:
            return int(w[word])
        for _ in range(options.SPIN_CHECKS):
            if w[word] >= end:
                return int(w[word])
        waive = word == L.Q_DURABLE_SETTLE and not strict

        def reached() -> int | None:
            if w[word] >= end:
                return int(w[word])
            if waive and w[L.Q_JOURNAL_ERRNO]:
                return WAIVED
            self.check()
            return None

        return self._q._sleep_until(reached, self._ds, L.Q_DURABLE_WAITERS, deadline,
                                    lambda: Timeout(f"{self.name!r} was not journaled in time (the change "
                                                    "is in shared memory and may still take effect)"))

    # ------------------------------------------------------------ the writer's side
    @property
    def error(self) -> int:
        """The errno of the writer's failing write, 0 while it writes fine."""
        return int(self.w[L.Q_JOURNAL_ERRNO])

    @property
    def deleted(self) -> bool:
        return bool(self.w[L.Q_STATE] != L.QS_ACTIVE)

    @property
    def created_ns(self) -> int:
        """When the queue was made: tells a journal of this queue from one of an earlier
        queue of the same name."""
        return int(self.w[L.Q_CREATED_NS])

    @property
    def free_offset(self) -> int:
        return int(self.w[L.Q_FREE_OFFSET])

    def changed(self, next_offset: int, settle_seq: int) -> bool:
        """Has anything been published or settled since a round that journaled up to
        ``next_offset`` and ``settle_seq``?"""
        w = self.w
        return bool(w[L.Q_NEXT_OFFSET] != next_offset or w[L.Q_SETTLE_SEQ] != settle_seq)

    @property
    def producers_wait(self) -> bool:
        """Producers sleep for room (an ``interval`` queue then runs a round early:
        memory is freed only below the durable mark)."""
        return bool(self.w[L.Q_PRODUCER_WAITERS] > 0)

    def sleep(self, timeout: float, due: Callable[[], bool]) -> None:
        """Sleep on the ``.j`` semaphore at most ``timeout`` s, announced in
        ``Q_JOURNAL_WAITING`` so that :meth:`poke` posts it; ``due`` is asked again
        after announcing, so that no poke is missed."""
        w = self.w
        w[L.Q_JOURNAL_WAITING] = 1
        try:
            if not due():
                self._q._sem_sleep(self._js, timeout)
        finally:
            w[L.Q_JOURNAL_WAITING] = 0

    def wake_writer(self) -> None:
        """Post ``.j`` unconditionally (a writer told to stop ends its sleep)."""
        try:
            self._js.release()
        except posix_ipc.ExistentialError:
            pass  # closed: the queue was let go of here (``QueueHandle.release``)

    def snapshot(self) -> Snapshot:
        """The group state (consumer lock), then the tail and the producer table (producer
        lock): the snapshot never mentions an offset past the tail it comes with."""
        settle = self.w[L.Q_SETTLE_SEQ]
        ring = self.ring
        now = self._q._now()
        with ring.clock:
            groups = self._q.consumer_groups.snapshot(now)
        with ring.plock:
            nxt = self.w[L.Q_NEXT_OFFSET]
            producers = ring.producer_table()
        delays: list[tuple[int, int]] = []
        wall = time.time_ns() // 1_000_000  # monotonic time restarts with the machine
        for st in groups:  # a nack's delay, as wall-clock time
            if "backoff" in st:
                st["backoff"] = [(o, wall + ms) for o, ms in st["backoff"]]
        if self.w[L.Q_DELAY_MAX] > now:  # (read after the tail: it covers every put below it)
            with ring.clock:
                waits = self._q.consumer_groups.delays(nxt, now)
            delays = [(o, wall + ms) for o, ms in waits]
        return Snapshot(settle, groups, nxt, producers, delays)

    def records(self, first: int, end: int) -> list[tuple[Any, ...]]:
        """(offset, timestamp_ns, payload), or (offset, timestamp_ns, payload, metadata) for
        a record with metadata (headers, a dead letter's origin), or (offset, timestamp_ns,
        payload, metadata, expires_ns) for one put with its own TTL, of the published offsets
        ``first`` .. ``end``-1 (not freed yet: free <= durable <= next)."""
        out: list[tuple[Any, ...]] = []
        ring = self.ring
        timed = self.w[L.Q_EXPIRES_MAX]  # (0: no message here has a TTL of its own)
        for o in range(first, end):
            payload, meta, ts = ring.record(o)
            if timed and (exp := self.w[ring.slot_base(o) + L.S_EXPIRES]):
                out.append((o, ts, payload, meta, exp))
            else:
                out.append((o, ts, payload, meta) if meta else (o, ts, payload))
        return out

    def publish(self, next_offset: int, settle_seq: int, new: int, crash: Callable[[], None] | None = None
                ) -> bool:
        """A round is on disk: move both marks (and the free offset, in the same hold of the
        consumer lock: ``shmq.core.check``), clear a journal error, and wake whoever waits:
        mark waiters, producers waiting for room, and an ``always`` queue's consumers
        for the ``new`` messages now shown to them.  ``crash``: a crash point, passed
        between the marks and the free offset.  True when the error was cleared."""
        w, q = self.w, self._q
        with self.ring.clock:
            w[L.Q_DURABLE_OFFSET] = next_offset
            w[L.Q_DURABLE_SETTLE] = settle_seq
            if crash is not None:
                crash()
            freed = q.consumer_groups._recompute_free()
        cleared = bool(w[L.Q_JOURNAL_ERRNO])
        if cleared:
            w[L.Q_JOURNAL_ERRNO] = 0
        if freed and w[L.Q_PRODUCER_WAITERS]:
            q._wake(q._nf, w[L.Q_PRODUCER_WAITERS], w[L.Q_PRODUCER_WAITERS])
        if w[L.Q_DURABLE_WAITERS]:
            q._wake(self._ds, w[L.Q_DURABLE_WAITERS], w[L.Q_DURABLE_WAITERS])
        if self.always and new:
            q._wake_consumers(new)
        return cleared

    def fail(self, err: int) -> bool:
        """The journal cannot be written: produces are refused with ``StorageError`` and
        mark waiters raise it.  True when this is news (no error was set)."""
        w = self.w
        first = not w[L.Q_JOURNAL_ERRNO]
        w[L.Q_JOURNAL_ERRNO] = err or errno.EIO
        if w[L.Q_DURABLE_WAITERS]:
            self._q._wake(self._ds, w[L.Q_DURABLE_WAITERS], w[L.Q_DURABLE_WAITERS])
        return first
