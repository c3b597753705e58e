"""A priority queue in shared memory: N rings behind one name.

``create_queue(name, priorities=N)`` makes N queues: ``name`` itself holds level 0 (the
lowest), and the hidden queues ``name.prio1`` .. ``name.prio<N-1>`` hold the levels above
(``shmq.names.level_name``).  Each level is a whole queue, with its own ring, leases,
groups, DLQ copies, TTLs, delays, crash points, checker and journal: nothing of a queue's
machinery changes.  ``PriorityQueue`` is the ``api.Queue`` over them:

* ``put(priority=p)`` appends to level ``p``;
* a delivery looks at the levels from the highest down and leases what each has ready for
  the group (a batch, up to its size, level after level), so the highest priority ready
  goes first and one level stays FIFO (a redelivery of a level goes before its new
  messages, as in any queue);
* an offset names its level in its top bits: ``level << options.PRIORITY_SHIFT | the offset
  in the level`` (level 0's offsets are the plain ones); a settle, ``read`` and ``commit``
  go to the level their offset names;
* groups exist on every level: one made on any is made on all (a level that lacks one
  makes it on its first delivery, as any queue makes a group named for the first time);
* a consumer that waits sleeps on level 0's not-empty semaphore, announced there, and a
  put at any level wakes it: a level's handle wakes its base's consumers too
  (``QueueHandle._base``), and rings its base's doorbells, where broker workers park.

Why rings and not a priority index in one ring: docs/architecture.md, "Priorities".
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

from shmq import options
from shmq.api import (
    Headers,
    Message,
    Payload,
    QueueConfig,
    RecordColumns,
    check_priority,
    check_read,
    group_as_block,
    own_leases,
    shares_docs,
)
from shmq.api import Queue as QueueABC
from shmq.core import layout as L
from shmq.core.consumer import get_many
from shmq.core.durability import Mark
from shmq.core.queue import ShmQueue
from shmq.errors import Empty, InvalidArgument, QueueExists, StaleAck
from shmq.joined import Joined
from shmq.seektime import Start, When
from shmq.settle import Settle

SHIFT = options.PRIORITY_SHIFT
LOW = (1 << SHIFT) - 1  # the offset in its level


def level_of(offset: int) -> tuple[int, int]:
    """(level, offset in the level) of a priority queue's offset."""
    return offset >> SHIFT, offset & LOW


@shares_docs(QueueABC)
class PriorityQueue(QueueABC):
    """A co-located priority queue (the module docstring): the ``api.Queue`` over its
    levels, ``levels[k]`` the ``ShmQueue`` of priority ``k``."""

    def __init__(self, levels: list[ShmQueue]) -> None:
        self.levels = levels
        self.base = levels[0]
        self.name = self.base.name
        self.priorities = len(levels)
        self._top_down = list(enumerate(levels))[::-1]

    def __repr__(self) -> str:
        return f"PriorityQueue({self.base._att.url!r}, {self.name!r}, priorities={self.priorities})"

    @property
    def config(self) -> QueueConfig:
        """The limits the queue was created with (each level has them)."""
        return self.base.config

    @property
    def is_dlq(self) -> bool:
        """False: a dead-letter queue has no priorities."""
        return False

    @property
    def deleted(self) -> bool:
        """True once any level was deleted (the queue is then let go of and made again on use)."""
        return any(q.words[L.Q_STATE] != L.QS_ACTIVE for q in self.levels)

    def _level(self, priority: object) -> ShmQueue:
        return self.levels[check_priority(priority, self.priorities, self.name)]

    # ------------------------------------------------------------ produce
    def put(self, payload: Payload, block: bool = True, timeout: float | None = None, *,
            wait_durable: bool = True, headers: Headers | None = None, delay: float | None = None,
            ttl: float | None = None, priority: int = 0) -> int:
        q = self._level(priority)
        return priority << SHIFT | q.put(payload, block, timeout, wait_durable=wait_durable, headers=headers,
                                         delay=delay, ttl=ttl)

    def put_many(self, payloads: Sequence[Payload], block: bool = True, timeout: float | None = None, *,
                 producer: str | None = None, seq: int | None = None, wait_durable: bool = True,
                 headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                 ttl: float | None = None, priority: int = 0) -> list[int]:
        q = self._level(priority)
        offs = q.put_many(payloads, block, timeout, producer=producer, seq=seq, wait_durable=wait_durable,
                          headers=headers, delay=delay, ttl=ttl)
        return [priority << SHIFT | o for o in offs] if priority else offs

    def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                   producer: str | None = None, seq: int | None = None, priority: int = 0,
                   wait_durable: bool = True) -> int:
        q = self._level(priority)
        return priority << SHIFT | q.put_joined(batch, block, timeout, producer=producer, seq=seq,
                                                wait_durable=wait_durable)

    def _publish(self, payload: Payload, block: bool, timeout: float | None, headers: Headers | None = None,
                 delay: float | None = None, ttl: float | None = None) -> int:
        return self.base._publish(payload, block, timeout, headers, delay, ttl)  # (level 0)

    def _confirm(self, token: int) -> int:
        return self.base._confirm(token)

    def _publish_many(self, payloads: Sequence[Payload], block: bool, timeout: float | None,
                      headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                      ttl: float | None = None) -> list[int]:
        return self.base._publish_many(payloads, block, timeout, headers, delay, ttl)

    def _confirm_many(self, token: list[int]) -> list[int]:
        return self.base._confirm_many(token)

    # ------------------------------------------------------------ consume
    def get(self, block: bool = True, timeout: float | None = None, *, group: str = options.DEFAULT_GROUP,
            visibility_timeout: float | None = None, ack: Message | None = None) -> Message:
        if block is not True and block.__class__ is str:  # get("billing"): group is a keyword
            raise group_as_block("get", block)
        if ack is not None:
            ack.ack()
        return self._take(group, 1, block, timeout, visibility_timeout)[0]

    def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                 group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                 ack: Iterable[Message] = ()) -> list[Message]:
        return get_many(self, max_messages, block, timeout, group, visibility_timeout, ack)

    def _look(self, group: str, max_n: int, vis: float | None) -> list[Message]:
        """One look, from the highest level down: up to ``max_n`` messages ready for
        ``group``, leased level by level (as this queue's messages), or []."""
        out: list[Message] = []
        for k, q in self._top_down:
            w = q.words
            if w[L.Q_NEXT_OFFSET] == w[L.Q_FREE_OFFSET] and w[L.Q_STATE] == L.QS_ACTIVE:
                continue  # the level retains nothing: nothing to deliver there
            try:
                got = q.get_many(max_n - len(out), False, group=group, visibility_timeout=vis)
            except Empty:
                continue
            if not k:
                out += [tuple.__new__(Message, (self, *m[1:])) for m in got]
            else:
                out += [tuple.__new__(Message, (self, m[1], m[2], k << SHIFT | m[3], *m[4:])) for m in got]
            if len(out) >= max_n:
                break
        return out

    def _take(self, group: str, max_n: int, block: bool, timeout: float | None,
              vis: float | None) -> list[Message]:
        """Lease up to ``max_n`` messages, the highest levels' first, waiting as
        ``block`` and ``timeout`` say: announced on level 0 (``Q_CONSUMER_WAITERS``), which a
        put at any level wakes, and looking again after announcing, so no put is missed."""
        if timeout is not None and timeout < 0:
            raise InvalidArgument("timeout must be >= 0")
        deadline = None if timeout is None else time.monotonic() + timeout
        base = self.base
        announced = False
        try:
            while True:
                got = self._look(group, max_n, vis)
                if got:
                    return got
                if not block:
                    raise Empty(f"queue {self.name!r} has no message for group {group!r}")
                if not announced:
                    with base.ring.clock:
                        base.words[L.Q_CONSUMER_WAITERS] += 1
                    announced = True
                    continue  # look again, announced: a put from now on wakes us
                wait = options.WAIT_SLICE
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise Empty(f"no message for group {group!r} of queue {self.name!r} "
                                    f"within {timeout} s")
                wait = min([wait, *(q._due_in(group) for q in self.levels)])
                if wait > 0:
                    base._sem_sleep(base._ne, wait)
        finally:
            if announced:
                base._stop_waiting()

    # ------------------------------------------------------------ settle
    def _unwrap(self, msg: Message) -> tuple[ShmQueue, Message]:
        """The level a message of ours was delivered from, and the message as that level
        delivered it; ``StaleAck`` for one that is no delivery of this queue."""
        if msg[0] is not self or msg[1] < 0:
            raise StaleAck(f"message {msg.offset} is not a delivery of {self.name!r} (read() results "
                           "cannot be settled)")
        k, off = level_of(msg[3])
        if k >= self.priorities:
            raise StaleAck(f"message {msg.offset} is not a delivery of {self.name!r}")
        q = self.levels[k]
        return q, tuple.__new__(Message, (q, msg[1], msg[2], off, *msg[4:]))

    def _ack(self, msg: Message) -> None:
        q, m = self._unwrap(msg)
        q._ack(m)

    def _ack_nowait(self, msg: Message) -> None:
        q, m = self._unwrap(msg)
        q._ack_nowait(m)

    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        q, m = self._unwrap(msg)
        q._settle(m, action, arg)

    def _settle_unsynced(self, msg: Message, action: Settle, arg: float | None) -> Mark | None:
        q, m = self._unwrap(msg)
        return q._settle_unsynced(m, action, arg)

    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        msgs, stale, total = own_leases(self, messages)
        if not total:
            return
        by_level: dict[int, list[Message]] = {}
        for m in msgs:
            q, lm = self._unwrap(m)
            by_level.setdefault(m[3] >> SHIFT, []).append(lm)
        for k, ms in sorted(by_level.items()):
            try:
                self.levels[k].ack_many(ms, wait)
            except StaleAck as e:
                stale.extend(k << SHIFT | o for o in e.stale)
        if stale:
            raise StaleAck.of_batch(stale, total)

    # ------------------------------------------------------------ groups
    def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        try:
            self.base.create_group(name, start, exist_ok)
        finally:  # (made on the others too, even if level 0 had it: a level may lack it)
            for q in self.levels[1:]:
                try:
                    q.create_group(name, start, exist_ok=True)
                except QueueExists:  # pragma: no cover - exist_ok
                    pass

    def seek(self, group: str, when: When) -> int:
        """``Queue.seek`` on every level; level 0's offset."""
        offs = [q.seek(group, when) for q in self.levels]
        return offs[0]

    def delete_group(self, name: str) -> None:
        self.base.delete_group(name)
        for q in self.levels[1:]:
            if name in q.groups():
                q.delete_group(name)

    def groups(self) -> list[str]:
        return self.base.groups()

    def commit(self, group: str, offset: int) -> None:
        """``Queue.commit`` in the level ``offset`` names (its top bits)."""
        if offset < 0:
            raise InvalidArgument("offset must be >= 0")
        k, off = level_of(offset)
        if k >= self.priorities:
            raise InvalidArgument(f"offset {offset} names level {k}; queue {self.name!r} has "
                                  f"{self.priorities}")
        self.levels[k].commit(group, off)

    def purge(self) -> int:
        return sum(q.purge() for q in self.levels)

    def _reply_queue(self, name: str) -> QueueABC:
        return self.base._reply_queue(name)

    def _reply_dropped(self, what: str) -> None:
        self.base._reply_dropped(what)

    # ------------------------------------------------------------ replay, stats
    def _read_level(self, offset: int) -> tuple[int, ShmQueue, int]:
        k, off = level_of(offset)
        if k >= self.priorities:
            raise InvalidArgument(f"offset {offset} names level {k}; queue {self.name!r} has "
                                  f"{self.priorities}")
        return k, self.levels[k], off

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        """``Queue.read`` of the level ``offset`` names: its retained messages from there on."""
        check_read(offset, max_messages)
        k, q, off = self._read_level(offset)
        return [tuple.__new__(Message, (self, -1, None, k << SHIFT | m[3], *m[4:]))
                for m in q.read(off, max_messages)]

    def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        check_read(offset, max_messages)
        k, q, off = self._read_level(offset)
        c = q.read_columns(off, max_messages)
        if not k:
            return c
        offs = c.offsets
        shifted = (range(k << SHIFT | offs.start, k << SHIFT | offs.stop) if isinstance(offs, range)
                   else [k << SHIFT | o for o in offs])
        return RecordColumns(shifted, c.stamps, c.meta_lens, c.payload_lens, c.data)

    def offsets(self) -> list[tuple[int, int]]:
        """Each level's (first retained offset, next offset to be delivered), as this queue's offsets."""
        return [(k << SHIFT | a, k << SHIFT | b) for k, (a, b) in enumerate(q.offsets() for q in self.levels)]

    def stats(self) -> dict[str, Any]:
        """``Queue.stats`` of level 0, with ``retained``, ``bytes_used`` and ``produced`` of all
        levels, and ``levels``: each level's own (``priority`` 0 up), its offsets as this
        queue's (its first and next offset, each group's cursor and floor)."""
        levels = [q.stats() for q in self.levels]
        s = dict(levels[0])
        for key in ("retained", "bytes_used", "produced"):
            s[key] = sum(x[key] for x in levels)
        s["fill"] = max(x["fill"] for x in levels)
        s["priorities"] = self.priorities
        s["levels"] = [{"priority": k, "retained": x["retained"], "bytes_used": x["bytes_used"],
                        "first_offset": k << SHIFT | x["first_offset"],
                        "next_offset": k << SHIFT | x["next_offset"],
                        "groups": {g: {**gs, "cursor": k << SHIFT | gs["cursor"],
                                       "floor": k << SHIFT | gs["floor"]} for g, gs in x["groups"].items()}}
                       for k, x in enumerate(levels)]
        return s


def wrap_offsets(level: int, offsets: Iterable[int]) -> list[int]:
    """A level's offsets as its priority queue's."""
    return list(map(int.__or__, repeat(level << SHIFT), offsets))


__all__ = ["LOW", "SHIFT", "PriorityQueue", "check_priority", "level_of", "wrap_offsets"]
