"""The instance registry: one segment that names the queues and the processes attached.

Lock order: the registry lock is taken before any queue lock, never after.
A queue is created in three steps: its name and id are reserved under the registry lock
(``reserve_queue``), its segment is made outside it (reserving a large segment's pages
takes a while), and it is listed under the lock again (``publish_queue``).  A reservation
whose creator died is dropped by the next one who looks (``repair``).
A registry is created whole under a temporary name and linked into place, so
no process ever attaches to a half-written one.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from dataclasses import dataclass

from shmq import crashpoints, options, process
from shmq.core import layout as L
from shmq.core.lock import RobustLock
from shmq.core.segment import (
    SHM_DIR,
    Mapping,
    link_into_place,
    queue_id_of,
    queue_segment_name,
    registry_name,
    semaphore_names,
    shm_path,
    unlink_ours,
    unlink_semaphore,
    unlink_shm,
)
from shmq.errors import InstanceError, InstanceNotFound, InvalidArgument, LimitExceeded, QueueExists
from shmq.journal.files import retire_journal
from shmq.names import is_reply_name

#: why a reply was dropped -> the registry word counting it (``shmq.api.reply``)
REPLY_DROPS = {"late": L.R_REPLIES_LATE, "gone": L.R_REPLIES_GONE, "full": L.R_REPLIES_FULL}


def _attached(mapping: Mapping) -> bool:
    """Take the shared flock on an attached registry and check it is still the live one
    (the name leads to this file, the magic is valid); else close it."""
    fcntl.flock(mapping.fd, fcntl.LOCK_SH)  # waits out a reclaimer's exclusive lock
    try:
        same = os.stat(shm_path(mapping.name)).st_ino == os.fstat(mapping.fd).st_ino
    except FileNotFoundError:
        same = False
    if same and mapping.words[L.R_MAGIC] == L.REGISTRY_MAGIC:
        return True
    mapping.close()
    return False


@dataclass(frozen=True)
class QueueEntry:
    name: str
    queue_id: int
    is_dlq: bool
    created_ns: int


@dataclass(frozen=True)
class ClientEntry:
    slot: int
    pid: int
    start: int  # clock ticks since boot (process.start_ticks)


class Registry:
    def __init__(self, instance: str, mapping: Mapping) -> None:
        w = mapping.words
        if w[L.R_MAGIC] != L.REGISTRY_MAGIC or w[L.R_VERSION] != L.LAYOUT_VERSION:
            raise InstanceError(f"{mapping.name} is not a shmq registry of layout {L.LAYOUT_VERSION}")
        self.instance = instance
        self.mapping = mapping
        self.w = w
        self.mm = mapping.mm
        self.uid = w[L.R_INSTANCE_UID]
        self.max_queues = w[L.R_MAX_QUEUES]
        self.max_clients = w[L.R_MAX_CLIENTS]
        self.clients_w = w[L.R_CLIENTS_OFF] // L.WORD
        self.queues_w = w[L.R_QUEUES_OFF] // L.WORD
        self.lock = RobustLock(self.mm, L.R_LOCK_OFF)
        # a process died holding the registry lock: drop what its half-done work left
        self.lock.on_recover = self.repair
        self._dead: set[tuple[int, int]] = set()

    # ------------------------------------------------------------ open / create
    @classmethod
    def open(cls, instance: str, *, create: bool = True, max_queues: int = options.MAX_QUEUES,
             max_clients: int = options.MAX_CLIENTS) -> Registry:
        """Attach the instance's registry (creating it when ``create`` and none exists).

        The returned registry holds a shared ``flock`` on the registry's file for as long
        as it is open: the kernel's proof that this process (or a forked child, which
        inherits it) is attached, read by ``reclaim``.  The lock is taken before the
        mapping is trusted, and the name is checked to still lead to the same file with a
        valid magic, so a registry reclaimed meanwhile is never used."""
        name = registry_name(instance)
        deadline = time.monotonic() + options.ATTACH_TIMEOUT
        while True:
            mapping: Mapping | None
            try:
                mapping = Mapping.attach(name, hold=True)
            except FileNotFoundError:
                if not create:
                    raise InstanceNotFound(f"no shmq instance {instance!r} on this host") from None
                mapping = cls._create(instance, max_queues, max_clients)
            if mapping is not None and _attached(mapping):
                return cls(instance, mapping)
            if time.monotonic() > deadline:  # lost the race, and the winner's object vanished
                raise InstanceError(f"could not open instance {instance!r}")

    @staticmethod
    def _create(instance: str, max_queues: int, max_clients: int) -> Mapping | None:
        """A new registry, whole and attached (its shared flock taken before its name
        exists); None when another process published one first."""
        if not 1 <= max_clients < L.MAX_OWNER:
            raise LimitExceeded(f"max_clients must be 1..{L.MAX_OWNER - 1}")
        clients_off, queues_off, total = L.registry_size(max_queues, max_clients)
        tmp = f"{registry_name(instance)}.tmp{os.getpid()}.{secrets.token_hex(4)}"
        mapping = Mapping.create(tmp, total, hold=True)
        try:
            fcntl.flock(mapping.fd, fcntl.LOCK_SH)
            w = mapping.words
            pid, start = process.me()
            w[L.R_VERSION] = L.LAYOUT_VERSION
            w[L.R_INSTANCE_UID] = secrets.randbits(63) | 1
            w[L.R_OWNER_PID] = pid
            w[L.R_OWNER_START] = start
            w[L.R_CREATED_NS] = time.time_ns()
            w[L.R_MAX_QUEUES] = max_queues
            w[L.R_MAX_CLIENTS] = max_clients
            w[L.R_NEXT_QUEUE_ID] = 1
            w[L.R_CLIENTS_OFF] = clients_off
            w[L.R_QUEUES_OFF] = queues_off
            w[L.R_TOTAL_SIZE] = total
            RobustLock(mapping.mm, L.R_LOCK_OFF).initialise()
            w[L.R_MAGIC] = L.REGISTRY_MAGIC
            if link_into_place(tmp, registry_name(instance)):
                mapping.rename(registry_name(instance))
                return mapping
        except BaseException:
            mapping.close()
            raise
        finally:
            unlink_shm(tmp)
        mapping.close()
        return None

    def close(self) -> None:
        self.lock.detach()
        self.mapping.close()

    def detach(self) -> None:
        """Let go of the shared flock (the instance is being destroyed); the mapping stays."""
        self.mapping.close_fd()

    # ------------------------------------------------------------ owner
    @property
    def live(self) -> bool:
        """Still the instance's registry?  (A removed one's magic is zeroed before its name
        goes: ``ShmBroker.destroy``, ``reclaim``.)"""
        return bool(self.w[L.R_MAGIC] == L.REGISTRY_MAGIC)

    @property
    def owner(self) -> tuple[int, int]:
        return self.w[L.R_OWNER_PID], self.w[L.R_OWNER_START]

    def live_owner(self) -> tuple[int, float] | None:
        """(pid, seconds since it started) of the instance's owner (``shmq serve``'s
        supervisor, else the process that created the instance); None when it is gone."""
        pid, start = self.owner
        if not process.is_alive(pid, start):
            return None
        return pid, process.age(start)

    def take_ownership(self) -> None:
        pid, start = process.me()
        with self.lock:
            self.w[L.R_OWNER_PID] = pid
            self.w[L.R_OWNER_START] = start

    def set_journal(self, data_dir: str | None) -> None:
        """Announce (or, with None, withdraw) this process as the journal writer."""
        raw = (data_dir or "").encode()
        if len(raw) > L.R_DATA_DIR_BYTES:
            raise InvalidArgument(f"data dir path longer than {L.R_DATA_DIR_BYTES} bytes: {data_dir}")
        pid, start = process.me() if data_dir else (0, 0)
        with self.lock:
            self.w[L.R_JOURNAL_PID] = 0
            self.mm[L.R_DATA_DIR * 8:L.R_DATA_DIR * 8 + len(raw)] = raw
            self.w[L.R_DATA_DIR_LEN] = len(raw)
            self.w[L.R_JOURNAL_START] = start
            self.w[L.R_JOURNAL_PID] = pid

    def journal(self) -> str | None:
        """The data dir of a live journal writer, else None."""
        w = self.w
        pid, start = w[L.R_JOURNAL_PID], w[L.R_JOURNAL_START]
        if not pid or not process.is_alive(pid, start):
            return None
        return bytes(self.mm[L.R_DATA_DIR * 8:L.R_DATA_DIR * 8 + w[L.R_DATA_DIR_LEN]]).decode()

    def data_dir(self) -> str | None:
        """The data dir last announced (the writer may be dead), else None."""
        n = self.w[L.R_DATA_DIR_LEN]
        return bytes(self.mm[L.R_DATA_DIR * 8:L.R_DATA_DIR * 8 + n]).decode() if n else None

    def count_reply_dropped(self, reason: str) -> None:
        """A reply was dropped here, for ``reason`` (a key of :data:`REPLY_DROPS`)."""
        with self.lock:
            self.w[REPLY_DROPS[reason]] += 1

    def replies_dropped(self) -> dict[str, int]:
        """The replies dropped in this instance so far, by reason (read without the lock)."""
        w = self.w
        return {reason: w[word] for reason, word in REPLY_DROPS.items()}

    # ------------------------------------------------------------ clients
    def register_client(self) -> int:
        pid, start = process.me()
        w = self.w
        with self.lock:
            for slot in range(self.max_clients):
                c = self.clients_w + slot * L.C_WORDS
                if w[c + L.C_STATE] == L.C_FREE:
                    w[c + L.C_PID] = pid
                    w[c + L.C_START] = start
                    w[c + L.C_STATE] = L.C_LIVE
                    if crashpoints.active:
                        crashpoints.hit("registry.slot.taken")
                    return slot
        raise LimitExceeded(f"instance {self.instance!r} has {self.max_clients} processes attached already")

    def unregister_client(self, slot: int) -> None:
        with self.lock:
            self.w[self.clients_w + slot * L.C_WORDS + L.C_STATE] = L.C_FREE
            if crashpoints.active:
                crashpoints.hit("registry.slot.freed")

    def holds(self, slot: int, pid: int, start: int) -> bool:
        """Is client ``slot`` still taken by the process (pid, start)?  A reaper asks this
        under each queue's consumer lock before it gives back that slot's leases there: a
        slot freed by another reaper and taken by a new process must keep its leases."""
        c = self.clients_w + slot * L.C_WORDS
        w = self.w
        return w[c + L.C_STATE] == L.C_LIVE and w[c + L.C_PID] == pid and w[c + L.C_START] == start

    def free_client(self, entry: ClientEntry) -> None:
        """Free a dead client's slot, if it still holds that client."""
        with self.lock:
            if self.holds(entry.slot, entry.pid, entry.start):
                self.w[self.clients_w + entry.slot * L.C_WORDS + L.C_STATE] = L.C_FREE

    def clients(self) -> list[ClientEntry]:
        w = self.w
        out = []
        for slot in range(self.max_clients):
            c = self.clients_w + slot * L.C_WORDS
            if w[c + L.C_STATE] == L.C_LIVE:
                out.append(ClientEntry(slot, w[c + L.C_PID], w[c + L.C_START]))
        return out

    def attached(self) -> list[int]:
        """The pids of the live processes in the client table now (those that have leased or
        maintained a queue: a process that only produces takes no slot)."""
        return [e.pid for e in self.clients() if process.is_alive(e.pid, e.start)]

    def client_alive(self, entry: ClientEntry) -> bool:
        key = (entry.pid, entry.start)
        if key in self._dead:
            return False
        if process.is_alive(*key):
            return True
        self._dead.add(key)
        return False

    def forget_dead(self, entry: ClientEntry) -> None:
        self._dead.discard((entry.pid, entry.start))

    def reap_due(self, now_ms: int, interval_ms: int) -> bool:
        """True about once per interval across all processes: a cheap hint, not a lock.
        Two reapers may overlap; each re-checks a dead client's identity under every
        queue's consumer lock (``holds``), so that is harmless."""
        w = self.w
        if now_ms < w[L.R_NEXT_REAP_MS]:
            return False
        w[L.R_NEXT_REAP_MS] = now_ms + interval_ms
        return True

    # ------------------------------------------------------------ queues
    def _entry_name(self, e: int) -> str:
        n = self.w[e + L.E_NAME_LEN]
        return bytes(self.mm[(e + L.E_NAME) * 8:(e + L.E_NAME) * 8 + n]).decode()

    def _entries(self, *states: int) -> list[int]:
        """Word indexes of the queue-table entries in one of ``states`` (the state column
        read as one strided slice)."""
        qw = self.queues_w
        column = self.w[qw + L.E_STATE:qw + self.max_queues * L.E_WORDS:L.E_WORDS].tolist()
        return [qw + i * L.E_WORDS for i, state in enumerate(column) if state in states]

    def queues(self) -> list[QueueEntry]:
        w = self.w
        return [QueueEntry(self._entry_name(e), w[e + L.E_QUEUE_ID], bool(w[e + L.E_FLAGS] & L.F_DLQ),
                           w[e + L.E_CREATED_NS]) for e in self._entries(L.E_ACTIVE)]

    def find(self, name: str) -> QueueEntry | None:
        for q in self.queues():
            if q.name == name:
                return q
        return None

    @property
    def generation(self) -> int:
        return self.w[L.R_GENERATION]

    def reserve_queue(self, name: str, is_dlq: bool) -> int:
        """Reserve a name and a fresh queue id (state E_CREATING, naming this process as
        the creator) so that the segment can be made outside the registry lock; the id.
        Call with the registry lock held.  A reservation whose creator died is dropped."""
        w = self.w
        raw = name.encode()
        free = -1
        for i in range(self.max_queues):
            e = self.queues_w + i * L.E_WORDS
            state = w[e + L.E_STATE]
            if state != L.E_FREE and self._entry_name(e) == name:
                if state == L.E_CREATING and not self._creator_alive(e):
                    self._drop(e)
                else:
                    raise QueueExists(f"queue {name!r} exists in instance {self.instance!r}")
            if w[e + L.E_STATE] == L.E_FREE and free < 0:
                free = e
        if free < 0:
            raise LimitExceeded(f"instance {self.instance!r} holds {self.max_queues} queues already")
        qid = w[L.R_NEXT_QUEUE_ID]
        w[L.R_NEXT_QUEUE_ID] = qid + 1
        pid, start = process.me()
        w[free + L.E_QUEUE_ID] = qid
        w[free + L.E_FLAGS] = L.F_DLQ if is_dlq else 0
        w[free + L.E_CREATED_NS] = time.time_ns()
        w[free + L.E_NAME_LEN] = len(raw)
        self.mm[(free + L.E_NAME) * 8:(free + L.E_NAME) * 8 + len(raw)] = raw
        w[free + L.E_CREATOR] = pid | start << L.CREATOR_PID_BITS
        w[free + L.E_STATE] = L.E_CREATING
        return qid

    def _entry(self, queue_id: int, state: int) -> int:
        """The word index of queue ``queue_id``'s entry in ``state``, else -1."""
        return next((e for e in self._entries(state) if self.w[e + L.E_QUEUE_ID] == queue_id), -1)

    def publish_queue(self, queue_id: int) -> bool:
        """A reserved queue's segment is complete: list it.  False when the reservation
        is gone (dropped as a dead creator's, which this process is not).  Call with the
        registry lock held."""
        e = self._entry(queue_id, L.E_CREATING)
        if e < 0:
            return False
        self.w[e + L.E_STATE] = L.E_ACTIVE
        self.w[L.R_GENERATION] += 1
        return True

    def cancel_reservation(self, queue_id: int) -> None:
        """Call with the registry lock held."""
        e = self._entry(queue_id, L.E_CREATING)
        if e >= 0:
            self.w[e + L.E_STATE] = L.E_FREE

    def _creator_alive(self, e: int) -> bool:
        c = self.w[e + L.E_CREATOR]
        return process.is_alive(c & ((1 << L.CREATOR_PID_BITS) - 1), c >> L.CREATOR_PID_BITS)

    def _drop(self, e: int) -> None:
        """Remove a queue's objects (a dead creator's, or a half-deleted queue's), then
        free its entry."""
        qid = self.w[e + L.E_QUEUE_ID]
        unlink_shm(queue_segment_name(self.instance, qid))
        for s in semaphore_names(self.instance, qid):
            unlink_semaphore(s)
        self.w[e + L.E_STATE] = L.E_FREE

    def repair(self) -> int:
        """Finish what a process that died holding the registry lock (or while creating a
        queue) left half-done; the number of objects dropped.  Call with the lock held.

        * a reservation whose creator died: its objects and the reservation go;
        * a queue marked deleted but still listed (``delete_queue`` cut short): the
          delete is finished (a journaled queue's journal is retired);
        * a segment the registry neither lists nor is creating (a delete cut short after
          unlisting): unlinked with its semaphores."""
        w = self.w
        n = 0
        for e in self._entries(L.E_CREATING, L.E_ACTIVE):
            if w[e + L.E_STATE] == L.E_CREATING and not self._creator_alive(e):
                self._drop(e)
                n += 1
            elif w[e + L.E_STATE] == L.E_ACTIVE and self._marked_deleted(w[e + L.E_QUEUE_ID]):
                name, durable = self._entry_name(e), self._durable(w[e + L.E_QUEUE_ID])
                self._drop(e)
                w[L.R_GENERATION] += 1
                data_dir = self.data_dir()
                if durable and data_dir:
                    retire_journal(data_dir, name)
                n += 1
        ids = self.reserved_ids()
        for name in os.listdir(SHM_DIR):
            qid = queue_id_of(self.instance, name)
            if qid is not None and qid not in ids and qid < w[L.R_NEXT_QUEUE_ID]:
                unlink_ours(queue_segment_name(self.instance, qid), semaphore=False)  # never another's
                for s in semaphore_names(self.instance, qid):
                    unlink_ours(s, semaphore=True)
                n += 1
        return n

    def _segment_word(self, queue_id: int, word: int) -> int | None:
        try:
            m = Mapping.attach(queue_segment_name(self.instance, queue_id))
        except (FileNotFoundError, InstanceError):
            return None
        try:
            return m.words[word] if m.words[L.Q_MAGIC] == L.QUEUE_MAGIC else None
        finally:
            m.close()

    def _marked_deleted(self, queue_id: int) -> bool:
        return self._segment_word(queue_id, L.Q_STATE) == L.QS_DELETED

    def _durable(self, queue_id: int) -> bool:
        return bool(self._segment_word(queue_id, L.Q_DURABILITY))

    def orphan_reply_queues(self) -> list[str]:
        """The reply queues (``names.is_reply_name``) whose creating process is dead: a
        co-located requester, or the worker that served a TCP requester."""
        return [self._entry_name(e) for e in self._entries(L.E_ACTIVE)
                if is_reply_name(self._entry_name(e)) and not self._creator_alive(e)]

    def stale_reservations(self) -> list[int]:
        """Ids of reservations whose creator is dead (read without the lock: a hint)."""
        return [self.w[e + L.E_QUEUE_ID] for e in self._entries(L.E_CREATING) if not self._creator_alive(e)]

    def reserved_ids(self) -> set[int]:
        """Ids of the queues listed or being created."""
        return {self.w[e + L.E_QUEUE_ID] for e in self._entries(L.E_ACTIVE, L.E_CREATING)}

    def remove_queue(self, queue_id: int) -> None:
        """Call with the registry lock held."""
        e = self._entry(queue_id, L.E_ACTIVE)
        if e >= 0:
            self.w[e + L.E_STATE] = L.E_FREE
            self.w[L.R_GENERATION] += 1
