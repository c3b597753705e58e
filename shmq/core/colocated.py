"""``shm://``: the co-located transport.  A process attaches the instance's
shared memory and gets the whole ``api.Broker`` interface with no broker hop.

One ``Attachment`` per instance per process holds the registry mapping, this
process's client slot (who holds leases) and the mapped queues.  Handles
(brokers, queues) pickle as their URL and re-attach by name, so they cross
into children under fork and spawn alike.  After a fork the child registers
a client slot of its own on first use.
"""

from __future__ import annotations

import atexit
import contextlib
import copyreg
import multiprocessing.util as mp_util
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import posix_ipc

from shmq import crashpoints, options
from shmq.api import Broker, BrokerInfo, QueueConfig, QueueInfo, shares_docs
from shmq.api.limits import check_config
from shmq.api.reply import end_requests
from shmq.core import layout as L
from shmq.core.handle import QueueHandle, monotonic_ms
from shmq.core.priority import PriorityQueue
from shmq.core.queue import ShmQueue
from shmq.core.registry import QueueEntry, Registry
from shmq.core.ring import Ring
from shmq.core.segment import (
    check_instance_name,
    clear_leftover,
    open_semaphore,
    open_semaphores,
    queue_segment_name,
    registry_name,
    semaphore_names,
    unlink_ours,
    unlink_semaphore,
    unlink_shm,
)
from shmq.errors import InstanceError, InvalidArgument, QueueExists, QueueNotFound, StorageError, Timeout
from shmq.journal.files import retire_journal
from shmq.names import check_new_queue_name, check_queue_name, dlq_name, is_dlq_name, level_name, level_of
from shmq.version import __version__


class Attachment:
    """This process's view of one instance."""

    def __init__(self, instance: str, now_ms: Callable[[], int], create: bool = True) -> None:
        self.instance = instance
        self.uid = os.geteuid()  # whose names it attached (``_attachments``)
        self.url = f"shm://{instance}"
        self.registry = Registry.open(instance, create=create)
        self.now_ms = now_ms
        # the producers' timestamps and the TTL's clock: the wall clock, or one that moves
        # with an injected lease clock (tests), from the wall clock's time now
        if now_ms is monotonic_ms:
            self.wall_ns: Callable[[], int] = time.time_ns
        else:
            skew = time.time_ns() - now_ms() * 1_000_000
            self.wall_ns = lambda: now_ms() * 1_000_000 + skew
        self._slot: int | None = None
        self._slot_pid = 0
        self._queues: dict[int, ShmQueue] = {}
        self._names: dict[str, ShmQueue] = {}
        self._gen = -1
        self._pruned_gen = -1  # registry generation the queue cache was last pruned at
        self._lock = threading.RLock()
        self._letting_go: list[ShmQueue] = []  # let go of, but a thread of ours held a lock of it
        self._priority: dict[int, PriorityQueue] = {}  # by level 0's queue id
        self.refs = 0
        self.bell_skip = -1  # a broker worker's own id: it does not ring its own doorbell

    # ------------------------------------------------------------ client slot
    def client_slot(self) -> int:
        slot = self._slot
        if slot is None:
            with self._lock:
                if self._slot is None:
                    self._slot = self.registry.register_client()
                    self._slot_pid = os.getpid()
                    _exit_hooks()
                slot = self._slot
        return slot

    def after_fork(self) -> None:
        """In a forked child: the parent's client slot and handle count are not ours, and
        the page tables of the queues it inherited are to be filled in again (a fork
        copies none of a shared mapping's: ``Mapping.populate``)."""
        self._slot = None
        self.refs = 0
        self._lock = threading.RLock()
        for q in list(self._queues.values()):
            q.ring.mapping.populate()

    # ------------------------------------------------------------ queues
    def queue(self, name: str) -> ShmQueue:
        gen = self.registry.generation
        if gen != self._gen:
            with self._lock:
                self._names = {}
                self._gen = gen
            self.prune()
        elif self._letting_go:
            self.prune()
        q = self._names.get(name)
        if q is None:
            entry = self.registry.find(name)
            if entry is None:
                raise QueueNotFound(f"no queue named {name!r} in instance {self.instance!r}")
            q = self._open(entry)
            self._names[name] = q
        return q

    def _open(self, entry: QueueEntry) -> ShmQueue:
        with self._lock:
            q = self._queues.get(entry.queue_id)
            if q is None:
                try:  # deleted under our feet: the segment or a semaphore may be gone already
                    ring = Ring.attach(queue_segment_name(self.instance, entry.queue_id))
                    try:
                        sems = open_semaphores(semaphore_names(self.instance, entry.queue_id))
                    except BaseException:
                        ring.close()  # now, not when the GC finds it
                        raise
                except (FileNotFoundError, posix_ipc.ExistentialError):
                    raise QueueNotFound(f"queue {entry.name!r} was deleted") from None
                q = ShmQueue(self, ring, *sems)
                self._queues[entry.queue_id] = q
            return q

    def priority_queue(self, base: ShmQueue) -> PriorityQueue:
        """The priority queue whose level 0 is ``base`` (its levels attached, and made where
        missing: a creator or a deleter killed halfway left them so; a level made again is
        empty, and its messages, if any, went with the deleted one)."""
        pq = self._priority.get(base.ring.queue_id)
        if pq is not None and not pq.deleted:
            return pq
        levels = [base]
        for k in range(1, base.ring.priorities):
            name = level_name(base.name, k)
            try:
                q = self.queue(name)
            except QueueNotFound:
                try:
                    q = self.create_queue(name, base.config)
                except QueueExists:
                    q = self.queue(name)
            if q._base is not base:
                q.wake_base(base)
            levels.append(q)
        pq = PriorityQueue(levels)
        with self._lock:
            self._priority = {k: v for k, v in self._priority.items() if not v.deleted}
            self._priority[base.ring.queue_id] = pq
        return pq

    def prune(self) -> None:
        """Let go of the queues deleted by anyone since the last call, so that no process
        keeps their memory (a long-lived one, such as a broker's, calls this on its tick)."""
        if self._letting_go:
            with self._lock:
                self._letting_go = [q for q in self._letting_go if not q.release()]
        gen = self.registry.generation
        if gen == self._pruned_gen:
            return
        self._pruned_gen = gen
        live = {e.queue_id for e in self.registry.queues()}
        for qid in [qid for qid in self._queues if qid not in live]:
            self.forget(qid)

    def forget(self, queue_id: int, why: str = "deleted") -> None:
        """Drop a queue from the cache and let go of its memory and semaphores here
        (``QueueHandle.release``): handles still held raise ``QueueNotFound`` (``why``
        "closed": ``InstanceError``)."""
        with self._lock:
            q = self._queues.pop(queue_id, None)
            self._names = {k: v for k, v in self._names.items() if v is not q}
            if q is not None and not q.release(why):
                self._letting_go.append(q)  # a thread of ours holds one of its locks: next prune

    def create_queue(self, name: str, config: QueueConfig, is_dlq: bool = False,
                     restore: Callable[[Ring], None] | None = None) -> ShmQueue:
        """Create a queue; ``restore`` (recovery) fills its segment before it is published."""
        reg = self.registry
        cap, mb, mms = config.capacity, config.max_bytes, config.max_message_size
        vis = int(config.visibility_timeout * 1000)
        if config.durability != "memory" and restore is None and reg.journal() is None:
            raise InvalidArgument(
                f"durability {config.durability!r} needs a running broker to write the journal "
                f"(shmq serve --instance {self.instance}); no journal writer is attached to this instance")
        with reg.lock:
            qid = reg.reserve_queue(name, is_dlq)
        if crashpoints.active:
            crashpoints.hit("queue.create.segment")
        seg = queue_segment_name(self.instance, qid)
        sems = semaphore_names(self.instance, qid)
        try:
            # The id is fresh in this registry, so an object of ours already under its name
            # can only be a leftover of a dead earlier run of this instance: reclaim it.
            # One that is not ours was put there by someone else: refused.
            clear_leftover(seg, semaphore=False)
            for s in sems:
                clear_leftover(s, semaphore=True)
            for s in sems:
                open_semaphore(s, create=True).close()
            # outside the registry lock: reserving a large segment's pages takes a while
            ring = Ring.create(
                seg, instance_uid=reg.uid, queue_id=qid, name=name, capacity=cap, max_bytes=mb,
                max_message_size=mms, visibility_ms=vis,
                max_deliveries=0 if is_dlq else config.max_deliveries,
                max_groups=config.max_groups, max_clients=reg.max_clients,
                durability=options.DURABILITY_MODES.index(config.durability),
                flags=(L.F_DLQ if is_dlq else 0) | (0 if is_dlq or config.expired_to_dlq else L.F_TTL_DROP)
                | L.REPLICATION_FLAGS[config.replication]
                | (0 if is_dlq else config.priorities << L.PRIO_SHIFT),
                default_group=options.DEFAULT_GROUP,
                message_ttl_ms=0 if is_dlq or not config.message_ttl else max(
                    1, round(config.message_ttl * 1000)))
            if restore is not None:
                restore(ring)
            ring.close()
            with reg.lock:
                if not reg.publish_queue(qid):
                    raise InstanceError(f"the reservation of queue {name!r} was dropped")
                if crashpoints.active:
                    crashpoints.hit("queue.create.published")
        except BaseException:
            with reg.lock:
                reg.cancel_reservation(qid)
                unlink_ours(seg, semaphore=False)
                for s in sems:
                    unlink_ours(s, semaphore=True)
            raise
        q = self.queue(name)
        if config.durability != "memory" and restore is None:
            # return once the journal writer has taken the queue on (its meta file is on disk);
            # all or nothing: a queue whose journal cannot be made (a full disk) goes again
            w = q.words
            with q.ring.clock:
                w[L.Q_SETTLE_SEQ] += 1
                seq = w[L.Q_SETTLE_SEQ]
            try:
                q.durability.wait(L.Q_DURABLE_SETTLE, seq, time.monotonic() + options.JOURNAL_ADOPT_TIMEOUT,
                            strict=True)
            except (StorageError, Timeout) as e:
                why = q.durability.error_text() if isinstance(e, StorageError) else str(e)
                with contextlib.suppress(QueueNotFound):
                    self.delete_queue(name)
                raise type(e)(f"queue {name!r} was not created: {why}") from None
        return q

    def delete_queue(self, name: str) -> None:
        reg = self.registry
        with reg.lock:
            entry = reg.find(name)
            if entry is None:
                raise QueueNotFound(f"no queue named {name!r} in instance {self.instance!r}")
            q = self._open(entry)
            q.words[L.Q_STATE] = L.QS_DELETED  # other handles see this on their next call
            if crashpoints.active:
                crashpoints.hit("queue.delete.marked")
            for sem in (q._ne, q._nf, q._js, q._ds):  # wake sleepers so they notice at once
                for _ in range(8):
                    sem.release()
            reg.remove_queue(entry.queue_id)
            if crashpoints.active:
                crashpoints.hit("queue.delete.unlisted")
            unlink_shm(queue_segment_name(self.instance, entry.queue_id))
            for s in semaphore_names(self.instance, entry.queue_id):
                unlink_semaphore(s)
        self.forget(entry.queue_id)
        if q._durable:  # the journal goes with the queue
            data_dir = reg.data_dir()
            if data_dir:
                retire_journal(data_dir, name)

    def dead_letter_queue(self, q: QueueHandle) -> ShmQueue | None:
        """The DLQ of ``q``, made at its first dead letter (a priority queue's levels share
        their queue's: ``<queue>.dlq``, a plain queue)."""
        if q.is_dlq:
            return None
        name = dlq_name(q.base_name)
        try:
            return self.queue(name)
        except QueueNotFound:
            pass
        try:
            return self.create_queue(name, replace(q.config, priorities=0), is_dlq=True)
        except QueueExists:
            return self.queue(name)

    # ------------------------------------------------------------ reaping
    def reap(self, now: int, force: bool = False) -> int:
        """Give back the leases of dead processes (at most about once per REAP_INTERVAL,
        instance-wide, unless ``force``), drop queue reservations of dead creators, and
        retry dead-letter copies that failed; the number of leases given back."""
        reg = self.registry
        if not reg.reap_due(now, int(options.REAP_INTERVAL * 1000)) and not force:
            return 0
        me = self.client_slot()
        n = 0
        for c in reg.clients():
            if c.slot == me or reg.client_alive(c):
                continue
            for entry in reg.queues():
                try:
                    n += self._open(entry)._reap_client(c.slot, now, (c.pid, c.start))
                except QueueNotFound:
                    continue
                if crashpoints.active:
                    crashpoints.hit("reap.queue")
            reg.free_client(c)
            reg.forget_dead(c)  # the slot is free: no need to remember that its process died
        if reg.stale_reservations():
            with reg.lock:
                reg.repair()
        for name in reg.orphan_reply_queues():  # a dead requester's (or TCP worker's)
            with contextlib.suppress(QueueNotFound):
                self.delete_queue(name)
        for q in list(self._queues.values()):  # the queues this process has mapped (the
            if q.words[L.Q_ORPHANS]:  # broker's supervisor maintains them all)
                try:
                    q.maintain(now)  # a dead-letter copy met a full DLQ: try it again
                except QueueNotFound:
                    pass
        return n

    def release(self) -> None:
        """Give this process's leases back and free its client slot (at exit).  The mappings
        stay (held handles register again on their next get): ``close`` lets go of them."""
        if self._slot is not None and self._slot_pid == os.getpid():
            now = self.now_ms()
            for q in list(self._queues.values()):
                try:
                    if not q.ring.deleted:
                        q._reap_client(self._slot, now)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            self.registry.unregister_client(self._slot)
        self._slot = None

    def close(self, gone: bool = False) -> None:
        """``release``, then let go of every mapping made here: the queues' (held handles
        raise ``InstanceError``) and the registry's, with its flock.  ``gone``: the instance
        was destroyed (nothing to give back; held handles raise ``QueueNotFound``)."""
        if not gone:
            self.release()
        self._slot = None
        for qid in list(self._queues):
            self.forget(qid, "deleted" if gone else "closed")
        reg = self.registry
        if reg.lock.busy_here():  # a thread of ours is inside it: the GC unmaps it later
            reg.detach()
        else:
            reg.mapping.vacate()


# the shared one per instance (default clock), and per effective uid: a forked child that
# became another user names, and attaches, that user's instance, never the one it inherited
_attachments: dict[tuple[int, str], Attachment] = {}
_every_attachment: weakref.WeakSet[Attachment] = weakref.WeakSet()  # released at exit
_attach_lock = threading.Lock()


def _attach(instance: str, now_ms: Callable[[], int] | None, create: bool = True) -> Attachment:
    check_instance_name(instance)
    with _attach_lock:
        key = (os.geteuid(), instance)
        att = _attachments.get(key)
        if att is None or now_ms is not None:
            att = Attachment(instance, now_ms or monotonic_ms, create)
            _every_attachment.add(att)
            if now_ms is None:
                _attachments[key] = att
        att.refs += 1
        return att


def _after_fork_in_child() -> None:
    global _attach_lock
    _attach_lock = threading.Lock()
    for att in _every_attachment:
        att.after_fork()


def _at_exit() -> None:
    for att in list(_every_attachment):
        try:
            att.release()
        except Exception:  # noqa: BLE001
            pass


_hooked_pid = 0


def _exit_hooks() -> None:
    """Give leases back when this process ends normally.  multiprocessing's children end
    with os._exit, which skips atexit, so its own finalizer hook is used as well."""
    global _hooked_pid
    if _hooked_pid != os.getpid():
        _hooked_pid = os.getpid()
        atexit.register(_at_exit)
        mp_util.Finalize(None, _at_exit, exitpriority=100)


os.register_at_fork(after_in_child=_after_fork_in_child)


@shares_docs(Broker)
class ShmBroker(Broker):
    """A co-located broker handle (``shmq.connect("shm://name")``).

    Attaching creates the instance's registry when none exists (with ``create=False``:
    ``InstanceNotFound`` instead), and each queue reserves its memory in /dev/shm when it
    is created (``shmq.connect`` says how much).  The instance outlives the process
    (``close()`` only detaches) until ``destroy()``, or ``shmq.reclaim`` (``shmq doctor
    --clean``) once every process that used it is gone.
    """

    def __init__(self, instance: str = options.DEFAULT_INSTANCE, *,
                 clock: Callable[[], float] | None = None, create: bool = True) -> None:
        now_ms = None
        if clock is not None:
            now_ms = lambda: int(clock() * 1000)
            if not 0 <= now_ms() < 1 << (L.TIME_SHIFT + 15):
                raise InvalidArgument(
                    "clock must count seconds from a recent origin, as time.monotonic does (lease "
                    f"deadlines are kept in {64 - L.TIME_SHIFT} bits of ms): time.time does not fit")
        self._att = _attach(instance, now_ms, create)
        self.instance = instance
        self.url = f"shm://{instance}"
        self._closed = False

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (ShmBroker, (self.instance,))

    def __repr__(self) -> str:
        return f"ShmBroker({self.url!r})"

    def create_queue(self, name: str, *, dead_letter: bool = False, **limits: Any) -> ShmQueue:
        """``Broker.create_queue``, in shared memory (about 18 MiB of /dev/shm with the default
        limits; ``LimitExceeded`` when /dev/shm has no room).  ``dead_letter=True`` makes
        ``<queue>.dlq`` before the broker would (at ``<queue>``'s first dead letter), with
        limits of its own."""
        check_new_queue_name(name, dead_letter=bool(dead_letter))
        config = check_config(dict(limits))
        if config.priorities < 2:
            return self._att.create_queue(name, config, is_dlq=bool(dead_letter))
        # (a priority queue's handle is a PriorityQueue, the same api.Queue: the annotation
        # names the plain queue's handle, whose internals the core's tools and tests reach)
        return self._create_priority_queue(name, config, bool(dead_letter))  # type: ignore[return-value]

    def _create_priority_queue(self, name: str, config: QueueConfig, dead_letter: bool) -> PriorityQueue:
        """A queue of ``config.priorities`` levels: ``name`` (level 0) and its hidden levels
        (``shmq.core.priority``), all or none.  A level left by a deleter killed halfway
        (its queue gone) is removed first."""
        if dead_letter:
            raise InvalidArgument("a dead-letter queue has no priorities")
        longest = level_name(name, config.priorities - 1)
        if len(longest) > options.QUEUE_NAME_MAX:
            raise InvalidArgument(f"a priority queue's name leaves room for its levels' ({longest!r}): "
                                  f"at most {options.QUEUE_NAME_MAX - len(longest) + len(name)} chars")
        att = self._att
        base = att.create_queue(name, config)
        made = [name]
        try:
            for k in range(1, config.priorities):
                lname = level_name(name, k)
                if att.registry.find(lname) is not None:
                    att.delete_queue(lname)  # a leftover: its priority queue is the one just made
                att.create_queue(lname, config)
                made.append(lname)
        except BaseException:
            for lname in reversed(made):
                with contextlib.suppress(QueueNotFound):
                    att.delete_queue(lname)
            raise
        return att.priority_queue(base)

    def queue(self, name: str) -> ShmQueue:
        if not isinstance(name, str):
            check_queue_name(name)
        q = self._plain(name)
        if q.ring.priorities > 1:
            return self._att.priority_queue(q)  # type: ignore[return-value]  # (as create_queue's)
        return q

    def _plain(self, name: str) -> ShmQueue:
        """Queue ``name``'s own handle (a priority queue's level 0); a priority queue's
        hidden level is not found by its name."""
        q = self._att.queue(name)
        if q.ring.priorities > 1 and q.level:
            raise QueueNotFound(f"{name!r} is level {q.level} of priority queue {q.base_name!r}: "
                                f"put(priority={q.level}) to {q.base_name!r} reaches it")
        return q

    def list_queues(self) -> list[QueueInfo]:
        out = []
        for entry in self._att.registry.queues():
            if level_of(entry.name)[1]:
                continue  # a priority queue's hidden level
            try:
                q = self._att._open(entry)
            except QueueNotFound:
                continue
            out.append(QueueInfo(entry.name, entry.is_dlq, q.config))
        return sorted(out, key=lambda i: i.name)

    def delete_queue(self, name: str) -> None:
        """``Broker.delete_queue``; a priority queue goes with its levels (the highest first,
        level 0 last: one killed halfway leaves the queue, whose next use makes the missing
        levels again, empty)."""
        check_queue_name(name) if not is_dlq_name(name) else None
        for k in range(self._plain(name).ring.priorities - 1, 0, -1):
            with contextlib.suppress(QueueNotFound):  # (a level missing already)
                self._att.delete_queue(level_name(name, k))
        self._att.delete_queue(name)

    @property
    def registry(self) -> Registry:
        """The instance's registry (``shmq.core.registry``): for the core's own tools (the
        chaos storm's lock hog, ``shmq doctor``), not an API."""
        return self._att.registry

    def _reply_dropped(self, what: str) -> None:
        self._att.registry.count_reply_dropped(what)

    def info(self) -> BrokerInfo:
        """The instance's owner and the processes attached (no worker pool over ``shm://``)."""
        reg = self._att.registry
        if not reg.live:
            raise InstanceError(f"instance {self.instance!r} was removed (its broker stopped?)")
        pid, uptime = reg.live_owner() or (None, None)
        return BrokerInfo(__version__, self.instance, pid, uptime, reg.attached(),
                          replies_dropped=reg.replies_dropped())

    def reap(self) -> int:
        """Give back the leases of dead processes now; the number returned."""
        return self._att.reap(self._att.now_ms(), force=True)

    def close(self) -> None:
        if self._closed:
            return
        end_requests(self)  # its reply queue goes
        self._closed = True
        att = self._att
        with _attach_lock:
            att.refs -= 1
            if att.refs > 0:
                return
            if _attachments.get((att.uid, att.instance)) is att:
                del _attachments[att.uid, att.instance]
        att.close()

    def destroy(self) -> None:
        """Remove the instance's shared memory from /dev/shm (every queue, semaphore and the
        registry) and close this handle: other processes' handles on it raise
        ``QueueNotFound`` / ``InstanceError`` from then on.  Do not destroy the instance a
        running ``shmq serve`` serves (it removes its own when it stops)."""
        att = self._att
        reg = att.registry
        with reg.lock:
            entries = reg.queues()
            for entry in entries:
                try:
                    q = att._open(entry)
                    q.words[L.Q_STATE] = L.QS_DELETED
                except QueueNotFound:
                    pass
            reg.w[L.R_MAGIC] = 0  # late attachers see a dead registry
        reg.detach()  # this process no longer keeps the instance alive
        next_id = reg.w[L.R_NEXT_QUEUE_ID]
        for qid in range(1, next_id):
            unlink_shm(queue_segment_name(self.instance, qid))
            for s in semaphore_names(self.instance, qid):
                unlink_semaphore(s)
        unlink_shm(registry_name(self.instance))
        self._closed = True
        with _attach_lock:
            if _attachments.get((att.uid, att.instance)) is att:
                del _attachments[att.uid, att.instance]
        att.close(gone=True)  # nothing to give back: the registry is gone


def _queue_from_url(url: str, name: str) -> ShmQueue:
    return ShmBroker(url[len("shm://"):] or options.DEFAULT_INSTANCE).queue(name)


def _reduce_queue(q: ShmQueue) -> tuple[Any, ...]:
    return (_queue_from_url, (q._att.url, q.name))


copyreg.pickle(ShmQueue, _reduce_queue)  # a queue handle pickles as its URL and name, and reattaches
copyreg.pickle(PriorityQueue, lambda q: _reduce_queue(q.base))
