"""A co-located queue handle: the ``api.Queue`` interface straight on shared memory.

``ShmQueue`` is declared here, as ``class ShmQueue(Consuming, QueueHandle, QueueABC)``:
its state and the machinery every handle shares are ``QueueHandle``'s
(``shmq.core.handle``), the consumer side is the mixin ``Consuming``
(``shmq.core.consumer``, typed against that class), and this module adds the producer
side, groups, replay and stats.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Sequence
from typing import Any

from shmq import headers as _headers
from shmq import options
from shmq.api import (
    Headers,
    Message,
    Payload,
    RecordColumns,
    as_bytes,
    check_joined,
    check_priority,
    check_producer,
    check_read,
    delay_ms,
    shares_docs,
    ttl_ms,
)
from shmq.api import Queue as QueueABC
from shmq.core import layout as L
from shmq.core import rawread
from shmq.core.consumer import Consuming
from shmq.core.durability import Mark
from shmq.core.handle import Host, QueueHandle, _sync, monotonic_ms
from shmq.core.layout import Q_STATE, QS_ACTIVE
from shmq.core.ring import producer_key
from shmq.errors import GroupExists, InvalidArgument, MessageTooLarge
from shmq.joined import Joined
from shmq.names import check_group_name as _check_group_name
from shmq.seektime import Start, When, start_ns, to_ns

READ_COLUMNS_BYTES = 64 << 20  # bytes of records one read_columns copies at most (but one record at least)


@shares_docs(QueueABC)
class ShmQueue(Consuming, QueueHandle, QueueABC):
    """One queue of a co-located instance, in three parts: ``QueueHandle``
    (``shmq.core.handle``), the base: the queue's words and semaphores, sleeping and
    waking, groups by name, dead-letter copies, maintenance; ``Consuming``
    (``shmq.core.consumer``), a mixin: ``get``, ``get_many`` and the settling of what they
    lease; and, here, ``put`` and its batches, groups, seeks, commits, purge, replay and
    stats."""

    # ------------------------------------------------------------ produce
    def put(self, payload: Payload, block: bool = True, timeout: float | None = None,
            *, wait_durable: bool = True, headers: Headers | None = None, delay: float | None = None,
            ttl: float | None = None, priority: int = 0) -> int:
        if priority:
            check_priority(priority, 0, self.name)
        if type(payload) is not bytes:
            payload = as_bytes(payload)
        if delay is not None or ttl is not None:
            metas = None if headers is None else [_headers.encode(headers)]
            ms = delay_ms(delay)
            return self._put_metas([payload], metas, block, timeout, 0, None, wait_durable, ms,
                                   ttl_ms(ttl, ms))[0]
        if headers is not None:
            enc = _headers.encode_c  # the compiled encoder, called at once (shmq.accel)
            meta = enc(headers, options.MAX_HEADERS, options.MAX_HEADERS_BYTES) if enc else None
            if meta is None:
                meta = _headers.encode(headers)
            if meta:
                if self._durable or len(payload) + len(meta) > self._max:
                    return self._put_metas([payload], [meta], block, timeout, 0, None, wait_durable)[0]
                if self.words[Q_STATE] != QS_ACTIVE:
                    self._alive()
                off = self.ring.try_put(payload, self._wall(), meta)
                if off < 0:
                    off = self._put_wait([payload], [meta], block, timeout)
                self._wake_consumers(1)
                return off
        if len(payload) > self._max:
            raise MessageTooLarge(f"payload of {len(payload)} bytes exceeds max_message_size "
                                  f"{self._max} of queue {self.name!r}")
        if self.words[Q_STATE] != QS_ACTIVE:
            self._alive()
        if self._durable:
            return self._put_durable([payload], block, timeout, wait_durable, 0, 0)
        off = self.ring.try_put(payload, self._wall())
        if off < 0:
            off = self._put_wait([payload], None, block, timeout)
        self._wake_consumers(1)
        return off

    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None, wait_durable: bool = True,
                 headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                 ttl: float | None = None, priority: int = 0) -> list[int]:
        # (its docstring is Queue.put_many's)
        if priority:
            check_priority(priority, 0, self.name)
        key = producer_key(producer) if check_producer(producer, seq) else 0  # type: ignore[arg-type]
        if set(map(type, payloads)) == {bytes}:  # the usual case, checked at C speed
            items = list(payloads)
        else:
            items = [p if type(p) is bytes else as_bytes(p) for p in payloads]
        metas = _headers.encode_many(headers, len(items)) if headers is not None else None
        ms = delay_ms(delay)
        return self._put_metas(items, metas, block, timeout, key, seq, wait_durable, ms, ttl_ms(ttl, ms))

    def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                   producer: str | None = None, seq: int | None = None, priority: int = 0,
                   wait_durable: bool = True) -> int:
        """``Queue.put_joined``: ``put_many`` of payloads given back to back (``Joined``), as
        one idempotent producer's with ``producer`` and ``seq``: the Spark sink's chunks and
        the broker's PRODUCE_BATCH bodies, with no object per payload on a memory-only queue
        (the ring copies the bytes in one run).  The first offset; the errors of ``put_many``."""
        if priority:
            check_priority(priority, 0, self.name)
        key = producer_key(producer) if check_producer(producer, seq) else 0  # type: ignore[arg-type]
        check_joined(batch)
        items = batch.payloads() if self._durable else batch  # the journal writes each payload: one by one
        return self._put_first(items, None, block, timeout, key, seq, wait_durable)

    def _put_metas(self, items: list[Any], metas: list[bytes] | None, block: bool, timeout: float | None,
                   key: int, seq: int | None, wait_durable: bool, delay: int = 0, ttl: int = 0) -> list[int]:
        """put_many of payloads (bytes) with their header blocks (None: no message has any);
        ``delay``: ms before they are due (0: now); ``ttl``: ms from the put before they
        expire, checked (0: none)."""
        if ttl and self.is_dlq:
            raise InvalidArgument(f"{self.name!r} is a dead-letter queue: its messages have no TTL")
        if not items:
            return []
        first = self._put_first(items, metas, block, timeout, key, seq, wait_durable, delay, ttl)
        return list(range(first, first + len(items)))

    def _put_first(self, items: Any, metas: list[bytes] | None, block: bool,
                   timeout: float | None, key: int, seq: int | None, wait_durable: bool, delay: int = 0,
                   ttl: int = 0) -> int:
        """``_put_metas`` of a batch that is not empty, a list of payloads or (with no metas,
        and not to a journaled queue) a ``Joined``: its first offset."""
        if metas is not None and not any(metas):
            metas = None
        self._alive()
        if items.__class__ is Joined:
            sizes = items.lens
        elif metas is None:
            sizes = list(map(len, items))
        else:
            sizes = [len(p) + len(m) for p, m in zip(items, metas, strict=True)]
        big = max(sizes)
        if big > self._max:
            raise MessageTooLarge(f"a {'payload' if metas is None else 'message (payload + headers)'} of "
                                  f"{big} bytes exceeds max_message_size {self._max} of queue {self.name!r}")
        if self._durable:
            return self._put_durable(items, block, timeout, wait_durable, key, seq or 0, metas, delay, ttl)
        first = self._put_wait(items, metas, block, timeout, first_try=True, producer=key, seq=seq or 0,
                               delay=delay, ttl=ttl)
        self._wake_consumers(len(items))
        return first

    def _publish(self, payload: Payload, block: bool, timeout: float | None, headers: Headers | None = None,
                 delay: float | None = None, ttl: float | None = None) -> int:
        return self.put(payload, block, timeout, wait_durable=False, headers=headers, delay=delay, ttl=ttl)

    def _confirm(self, token: int) -> int:
        if self._always:
            self.wait_durable(token + 1)
        return token

    def _publish_many(self, payloads: Sequence[Payload], block: bool, timeout: float | None,
                      headers: Sequence[Headers | None] | None = None, delay: float | None = None,
                      ttl: float | None = None) -> list[int]:
        return self.put_many(payloads, block, timeout, wait_durable=False, headers=headers, delay=delay,
                             ttl=ttl)

    def _confirm_many(self, token: list[int]) -> list[int]:
        self._confirm(token[-1])  # the batch is durable once its last message is
        return token

    def _put_durable(self, items: list[Any], block: bool, timeout: float | None, wait_durable: bool,
                     key: int, seq: int, metas: list[bytes] | None = None, delay: int = 0, ttl: int = 0
                     ) -> int:
        """put / put_many on a journaled queue: refused while the journal cannot be written;
        with ``always`` (and ``wait_durable``) it returns once the journal has the batch."""
        self.durability.check()
        deadline = None if timeout is None else time.monotonic() + timeout
        first = self._put_wait(items, metas, block, timeout, first_try=True, producer=key, seq=seq,
                               delay=delay, ttl=ttl)
        if not self._always:  # an `always` batch is shown to consumers once journaled
            self._wake_consumers(len(items))
        else:
            mark = self.durability.put_mark(first + len(items))
            if wait_durable and mark is not None:
                mark.wait(deadline)
        return first

    # ------------------------------------------------------------ groups, replay, stats
    # Each change of group state has an ``_unsynced`` form that returns the mark confirming
    # it on an ``always`` queue instead of waiting for it (``shmq.core.serverqueue`` uses those).
    def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        at = start_ns(start)
        try:
            _sync(self._create_group_unsynced(name, str(start)) if at is None
                  else self._create_group_at_unsynced(name, at)[1])
        except GroupExists:
            if not exist_ok:
                raise

    def _create_group_unsynced(self, name: str, start: str) -> Mark | None:
        self._alive()
        _check_group_name(name)
        with self.ring.clock:
            self.consumer_groups.create(name, start)
        return self.durability.settle_mark()

    def _create_group_at_unsynced(self, name: str, at_ns: int) -> tuple[int, Mark | None]:
        self._alive()
        _check_group_name(name)
        with self.ring.clock:
            offset = self.consumer_groups.offset_at(at_ns)
            self.consumer_groups.create(name, offset)
        return offset, self.durability.settle_mark()

    def seek(self, group: str, when: When) -> int:
        # Queue.seek's docstring; Groups.seek says what happens to the messages on either side
        offset, mark = self._seek_unsynced(group, to_ns(when))
        _sync(mark)
        return offset

    def _seek_unsynced(self, group: str, at_ns: int) -> tuple[int, Mark | None]:
        self._alive()
        with self.ring.clock:
            groups = self.consumer_groups
            gi = groups.require(group)
            offset = groups.offset_at(at_ns)
            freed = groups.seek(gi, offset, self._now())
        self._after_seek(freed)
        return offset, self.durability.settle_mark()

    def _after_seek(self, freed: bool) -> None:
        if freed and self.words[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self.words[L.Q_PRODUCER_WAITERS], 1)
        self._wake_consumers(max(1, self.words[L.Q_CONSUMER_WAITERS]))  # sought back: deliverable now

    def delete_group(self, name: str) -> None:
        _sync(self._delete_group_unsynced(name))

    def _delete_group_unsynced(self, name: str) -> Mark | None:
        self._alive()
        if name == options.DEFAULT_GROUP:
            raise InvalidArgument("the default group cannot be deleted")
        with self.ring.clock:
            freed = self.consumer_groups.delete(self.consumer_groups.require(name))
        if freed and self.words[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self.words[L.Q_PRODUCER_WAITERS], 1)
        return self.durability.settle_mark()

    def groups(self) -> list[str]:
        return [name for _, name in self.consumer_groups.active()]

    def commit(self, group: str, offset: int) -> None:
        _sync(self._commit_unsynced(group, offset))

    def _commit_unsynced(self, group: str, offset: int) -> Mark | None:
        self._alive()
        if offset < 0:
            raise InvalidArgument("offset must be >= 0")
        with self.ring.clock:
            freed = self.consumer_groups.commit(self.consumer_groups.require(group), offset)
        if freed and self.words[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self.words[L.Q_PRODUCER_WAITERS], 1)
        return self.durability.settle_mark()

    def _reply_queue(self, name: str) -> ShmQueue:
        q = self._att.queue(name)
        assert isinstance(q, ShmQueue)
        return q

    def _reply_dropped(self, what: str) -> None:
        self._att.registry.count_reply_dropped(what)

    def purge(self) -> int:
        n, mark = self._purge_unsynced()
        _sync(mark)
        return n

    def _purge_unsynced(self) -> tuple[int, Mark | None]:
        self._alive()
        with self.ring.clock:
            first, nxt = self.words[L.Q_FREE_OFFSET], self.words[L.Q_NEXT_OFFSET]
            for gi, _ in self.consumer_groups.active():
                self.consumer_groups.commit(gi, nxt)
        if self.words[L.Q_PRODUCER_WAITERS]:
            self._wake(self._nf, self.words[L.Q_PRODUCER_WAITERS], self.words[L.Q_PRODUCER_WAITERS])
        return int(nxt - first), self.durability.settle_mark()

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        self._alive()
        if max_messages < 1 or offset < 0:
            raise InvalidArgument("offset must be >= 0 and max_messages >= 1")
        ring = self.ring
        out = []
        with ring.clock:
            start = max(offset, self.words[L.Q_FREE_OFFSET])
            end = min(self.words[self.consumer_groups.tail_word], start + max_messages)
            for off in range(start, end):
                payload, meta, ts = ring.record(off)
                out.append(Message((self, -1, None, off, 0, payload, meta, ts)))
        return out

    def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        """``Queue.read_columns``: the slots and bytes copied out of the segment under the
        consumer lock and split into arrays (``rawread``, compiled where the accelerator is
        built), no object per record; at most ``READ_COLUMNS_BYTES`` of records, but one at least."""
        check_read(offset, max_messages)
        c = rawread.read_columns(self, offset, max_messages, READ_COLUMNS_BYTES)
        return RecordColumns(range(c.first, c.first + len(c)), c.stamps, c.meta_lens, c.payload_lens, c.data)

    def offsets(self) -> tuple[int, int]:
        """(first retained offset, next offset to be delivered: on an ``always`` queue, the
        next one not yet journaled)."""
        return self.words[L.Q_FREE_OFFSET], self.words[self.consumer_groups.tail_word]

    def stats(self) -> dict[str, Any]:
        self.maintain()
        ring = self.ring
        w = self.words
        with ring.clock:
            free, nxt = w[L.Q_FREE_OFFSET], w[L.Q_NEXT_OFFSET]
            used = 0
            if nxt > free:
                used = w[L.Q_TAIL_BYTES] - w[ring.slot_base(free) + L.S_BYTEPOS]
            now = self._now()
            groups = {name: self.consumer_groups.stats(gi, now) for gi, name in self.consumer_groups.active()}
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




__all__ = ["Host", "QueueHandle", "ShmQueue", "monotonic_ms"]
