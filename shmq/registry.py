"""The instance registry: one segment that names the queues and the processes attached.

Lock order: the registry lock is taken before any queue lock, never after.
A registry is created whole under a temporary name and linked into place, so
no process ever attaches to a half-written one.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass

from . import layout as L
from . import options, process
from .errors import InstanceError, InvalidArgument, LimitExceeded
from .lock import RobustLock
from .segment import Mapping, link_into_place, registry_name, unlink_shm


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
    start_ms: int
    heartbeat_ms: int


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
        self._dead: set[tuple[int, int]] = set()

    # ------------------------------------------------------------ open / create
    @classmethod
    def open(cls, instance: str, *, create: bool = True, max_queues: int = options.MAX_QUEUES,
             max_clients: int = options.MAX_CLIENTS) -> Registry:
        name = registry_name(instance)
        deadline = time.monotonic() + options.ATTACH_TIMEOUT
        while True:
            try:
                return cls(instance, Mapping.attach(name))
            except FileNotFoundError:
                if not create:
                    raise InstanceError(f"no shmq instance named {instance!r} on this host") from None
            if cls._create(instance, max_queues, max_clients):
                return cls(instance, Mapping.attach(name))
            if time.monotonic() > deadline:  # lost the race, and the winner's object vanished
                raise InstanceError(f"could not open instance {instance!r}")

    @staticmethod
    def _create(instance: str, max_queues: int, max_clients: int) -> bool:
        if not 1 <= max_clients < L.MAX_OWNER:
            raise LimitExceeded(f"max_clients must be 1..{L.MAX_OWNER - 1}")
        clients_off, queues_off, total = L.registry_size(max_queues, max_clients)
        tmp = f"{registry_name(instance)}.tmp{os.getpid()}.{secrets.token_hex(4)}"
        mapping = Mapping.create(tmp, total)
        try:
            w = mapping.words
            pid, start = process.me()
            w[L.R_VERSION] = L.LAYOUT_VERSION
            w[L.R_INSTANCE_UID] = secrets.randbits(63) | 1
            w[L.R_OWNER_PID] = pid
            w[L.R_OWNER_START] = start
            w[L.R_HEARTBEAT] = int(time.time() * 1000)
            w[L.R_CREATED_NS] = time.time_ns()
            w[L.R_MAX_QUEUES] = max_queues
            w[L.R_MAX_CLIENTS] = max_clients
            w[L.R_NEXT_QUEUE_ID] = 1
            w[L.R_CLIENTS_OFF] = clients_off
            w[L.R_QUEUES_OFF] = queues_off
            w[L.R_TOTAL_SIZE] = total
            RobustLock(mapping.mm, L.R_LOCK_OFF).initialise()
            w[L.R_MAGIC] = L.REGISTRY_MAGIC
            return link_into_place(tmp, registry_name(instance))
        finally:
            mapping.close()
            unlink_shm(tmp)

    def close(self) -> None:
        self.lock.detach()
        self.mapping.close()

    # ------------------------------------------------------------ owner
    @property
    def owner(self) -> tuple[int, int]:
        return self.w[L.R_OWNER_PID], self.w[L.R_OWNER_START]

    def take_ownership(self) -> None:
        pid, start = process.me()
        with self.lock:
            self.w[L.R_OWNER_PID] = pid
            self.w[L.R_OWNER_START] = start
            self.beat()

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

    def beat(self) -> None:
        self.w[L.R_HEARTBEAT] = int(time.time() * 1000)

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
                    w[c + L.C_HEARTBEAT] = int(time.time() * 1000)
                    w[c + L.C_STATE] = L.C_LIVE
                    return slot
        raise LimitExceeded(f"instance {self.instance!r} has {self.max_clients} processes attached already")

    def unregister_client(self, slot: int) -> None:
        with self.lock:
            self.w[self.clients_w + slot * L.C_WORDS + L.C_STATE] = L.C_FREE

    def clients(self) -> list[ClientEntry]:
        w = self.w
        out = []
        for slot in range(self.max_clients):
            c = self.clients_w + slot * L.C_WORDS
            if w[c + L.C_STATE] == L.C_LIVE:
                out.append(ClientEntry(slot, w[c + L.C_PID], w[c + L.C_START], w[c + L.C_HEARTBEAT]))
        return out

    def client_alive(self, entry: ClientEntry) -> bool:
        key = (entry.pid, entry.start_ms)
        if key in self._dead:
            return False
        if process.is_alive(*key):
            return True
        self._dead.add(key)
        return False

    def forget_dead(self, entry: ClientEntry) -> None:
        self._dead.discard((entry.pid, entry.start_ms))

    def touch_client(self, slot: int) -> None:
        self.w[self.clients_w + slot * L.C_WORDS + L.C_HEARTBEAT] = int(time.time() * 1000)

    def reap_due(self, now_ms: int, interval_ms: int) -> bool:
        """True at most once per interval across all processes (a cheap hint, not a lock)."""
        w = self.w
        if now_ms < w[L.R_NEXT_REAP_MS]:
            return False
        w[L.R_NEXT_REAP_MS] = now_ms + interval_ms
        return True

    # ------------------------------------------------------------ queues
    def _entry_name(self, e: int) -> str:
        n = self.w[e + L.E_NAME_LEN]
        return bytes(self.mm[(e + L.E_NAME) * 8:(e + L.E_NAME) * 8 + n]).decode()

    def queues(self) -> list[QueueEntry]:
        w = self.w
        out = []
        for i in range(self.max_queues):
            e = self.queues_w + i * L.E_WORDS
            if w[e + L.E_STATE] == L.E_ACTIVE:
                out.append(QueueEntry(self._entry_name(e), w[e + L.E_QUEUE_ID],
                                      bool(w[e + L.E_FLAGS] & L.F_DLQ), w[e + L.E_CREATED_NS]))
        return out

    def find(self, name: str) -> QueueEntry | None:
        for q in self.queues():
            if q.name == name:
                return q
        return None

    @property
    def generation(self) -> int:
        return self.w[L.R_GENERATION]

    def allocate_queue_id(self) -> int:
        """Call with the registry lock held."""
        qid = self.w[L.R_NEXT_QUEUE_ID]
        self.w[L.R_NEXT_QUEUE_ID] = qid + 1
        return qid

    def add_queue(self, name: str, queue_id: int, is_dlq: bool) -> None:
        """Publish a queue whose segment is complete.  Call with the registry lock held."""
        w = self.w
        raw = name.encode()
        for i in range(self.max_queues):
            e = self.queues_w + i * L.E_WORDS
            if w[e + L.E_STATE] == L.E_FREE:
                w[e + L.E_QUEUE_ID] = queue_id
                w[e + L.E_FLAGS] = L.F_DLQ if is_dlq else 0
                w[e + L.E_CREATED_NS] = time.time_ns()
                w[e + L.E_NAME_LEN] = len(raw)
                self.mm[(e + L.E_NAME) * 8:(e + L.E_NAME) * 8 + len(raw)] = raw
                w[e + L.E_STATE] = L.E_ACTIVE
                w[L.R_GENERATION] += 1
                return
        raise LimitExceeded(f"instance {self.instance!r} holds {self.max_queues} queues already")

    def remove_queue(self, queue_id: int) -> None:
        """Call with the registry lock held."""
        w = self.w
        for i in range(self.max_queues):
            e = self.queues_w + i * L.E_WORDS
            if w[e + L.E_STATE] == L.E_ACTIVE and w[e + L.E_QUEUE_ID] == queue_id:
                w[e + L.E_STATE] = L.E_FREE
                w[L.R_GENERATION] += 1
                return
