"""The ring log of one queue: a slot table and a byte ring in one segment.

Producer side only: appending records and reading them back.  The consumer
side (groups, leases, acknowledgements) is in ``group``.  The layout is
drawn in ``layout``.

Invariants (checked by ``check_invariants`` after every step of the model test)::

    free_offset <= floor(g) <= cursor(g) <= next_offset          for every active group g
    next_offset - free_offset <= capacity
    tail_bytes - bytepos(free_offset) <= max_bytes                 (when not empty)
    bytepos(o) < bytepos(o + 1), each record inside one lap of the byte ring

A put writes the record bytes and the slot first, then publishes it with one
store to ``Q_NEXT_OFFSET``: a producer killed at any instruction leaves either
no message or a whole one.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from itertools import accumulate, compress
from typing import Any, cast

from shmq import crashpoints, options
from shmq.accel import ext
from shmq.core import layout as L
from shmq.core.geometry import check_geometry
from shmq.core.layout import (
    LEN_META_SHIFT,
    LEN_PAYLOAD_MASK,
    P_COMMIT,
    P_KEY,
    P_PREV,
    P_SEQ,
    P_WORDS,
    Q_FREE_OFFSET,
    Q_NEXT_OFFSET,
    Q_PENDING_PRODUCER,
    Q_TAIL_BYTES,
    S_BYTEPOS,
    S_EXPIRES,
    S_FIXED_WORDS,
    S_LENS,
    S_OFFSET,
    S_TIMESTAMP,
    SLOT_HEAD,
    WORD,
)
from shmq.core.lock import RobustLock, trylock, unlock
from shmq.core.segment import Mapping
from shmq.errors import InstanceError, StorageError
from shmq.joined import Joined

DUPLICATE = -2  # try_put_many: this producer already wrote that sequence

# bound once: on 3.11 GLOBAL.method(...) is an attribute load and a bound method per call
_pack_slot = SLOT_HEAD.pack

_put_c = None if ext is None else ext.put_one  # the compiled twin of try_put's body (shmq.accel)


def producer_key(producer: str) -> int:
    """The nonzero 64-bit key of an idempotent producer's id."""
    key = int.from_bytes(hashlib.blake2b(producer.encode(), digest_size=8).digest(), "little")
    return key or 1


class Ring:
    """A mapped queue segment: header fields, locks, and the producer's operations."""

    def __init__(self, mapping: Mapping) -> None:
        w = mapping.words
        if w[L.Q_MAGIC] != L.QUEUE_MAGIC or w[L.Q_VERSION] != L.LAYOUT_VERSION:
            raise InstanceError(f"{mapping.name} is not a shmq queue segment of layout {L.LAYOUT_VERSION}")
        check_geometry(mapping)
        self.mapping = mapping
        self.w = w
        self.mm = mapping.mm
        self.queue_id = w[L.Q_QUEUE_ID]
        self.instance_uid = w[L.Q_INSTANCE_UID]
        self.capacity = w[L.Q_CAPACITY]
        self.size = w[L.Q_MAX_BYTES]
        self.max_message_size = w[L.Q_MAX_MESSAGE_SIZE]
        self.visibility_ms = w[L.Q_VISIBILITY_MS]
        self.max_deliveries = w[L.Q_MAX_DELIVERIES]
        self.max_groups = w[L.Q_MAX_GROUPS]
        self.max_clients = w[L.Q_MAX_CLIENTS]
        self.durability = w[L.Q_DURABILITY]
        self.flags = w[L.Q_FLAGS]
        # the priority levels of the queue it holds (or holds a level of); 0 or 1: none
        self.priorities = (self.flags & L.PRIO_MASK) >> L.PRIO_SHIFT
        self.message_ttl_ms = w[L.Q_MESSAGE_TTL_MS]
        self.slot_words = w[L.Q_SLOT_WORDS]
        self.slots_w = w[L.Q_SLOTS_OFF] // L.WORD
        self.groups_w = w[L.Q_GROUPS_OFF] // L.WORD
        self.producers_w = w[L.Q_PRODUCERS_OFF] // L.WORD
        self.max_producers = w[L.Q_MAX_PRODUCERS]
        self.data_off = w[L.Q_DATA_OFF]
        self.name = bytes(self.mm[L.Q_NAME * L.WORD: L.Q_NAME * L.WORD + w[L.Q_NAME_LEN]]).decode()
        self.plock = RobustLock(self.mm, L.Q_LOCK_P, (w, L.Q_PLOCK_RECOVERIES))
        self.clock = RobustLock(self.mm, L.Q_LOCK_C, (w, L.Q_CLOCK_RECOVERIES))
        # a producer died holding the producer lock: its idempotent put counts only if committed
        self.plock.on_recover = self._recover_producer
        self._zero_leases = bytes(L.WORD * (self.slot_words - S_EXPIRES))  # S_EXPIRES and the lease words
        self._put_geom = (self.mm, self.groups_w, self.slots_w, self.capacity, self.slot_words, Q_NEXT_OFFSET,
                          self.data_off, self.size)  # the compiled put_one's (as Delivery.one_geom's)

    @classmethod
    def attach(cls, shm_name: str) -> Ring:
        """Map a queue segment (``Mapping.attach``'s errors; unmapped again if it is not one)."""
        mapping = Mapping.attach(shm_name)
        try:
            return cls(mapping)
        except BaseException:
            mapping.close()
            raise

    # ------------------------------------------------------------ creation
    @classmethod
    def create(cls, shm_name: str, *, instance_uid: int, queue_id: int, name: str, capacity: int,
               max_bytes: int, max_message_size: int, visibility_ms: int, max_deliveries: int,
               max_groups: int, max_clients: int, durability: int, flags: int,
               default_group: str, message_ttl_ms: int = 0) -> Ring:
        sizes = L.queue_size(capacity, max_bytes, max_groups, options.MAX_PRODUCERS)
        mapping = Mapping.create(shm_name, sizes["total"])
        w = mapping.words
        w[L.Q_VERSION] = L.LAYOUT_VERSION
        w[L.Q_INSTANCE_UID] = instance_uid
        w[L.Q_QUEUE_ID] = queue_id
        w[L.Q_STATE] = L.QS_ACTIVE
        w[L.Q_CAPACITY] = capacity
        w[L.Q_MAX_BYTES] = max_bytes
        w[L.Q_MAX_MESSAGE_SIZE] = max_message_size
        w[L.Q_VISIBILITY_MS] = visibility_ms
        w[L.Q_MAX_DELIVERIES] = max_deliveries
        w[L.Q_MAX_GROUPS] = max_groups
        w[L.Q_MAX_CLIENTS] = max_clients
        w[L.Q_DURABILITY] = durability
        w[L.Q_FLAGS] = flags
        w[L.Q_MESSAGE_TTL_MS] = message_ttl_ms
        w[L.Q_CREATED_NS] = time.time_ns()
        w[L.Q_GROUPS_OFF] = sizes["groups_off"]
        w[L.Q_PRODUCERS_OFF] = sizes["producers_off"]
        w[L.Q_MAX_PRODUCERS] = options.MAX_PRODUCERS
        # memory-only queues have no journal: nothing waits for its marks
        mark = L.NO_MARK if durability == 0 else 0
        w[L.Q_DURABLE_OFFSET] = mark
        w[L.Q_DURABLE_SETTLE] = mark
        w[L.Q_SLOTS_OFF] = sizes["slots_off"]
        w[L.Q_DATA_OFF] = sizes["data_off"]
        w[L.Q_TOTAL_SIZE] = sizes["total"]
        w[L.Q_SLOT_WORDS] = sizes["slot_words"]
        raw = name.encode()
        w[L.Q_NAME_LEN] = len(raw)
        mapping.mm[L.Q_NAME * L.WORD: L.Q_NAME * L.WORD + len(raw)] = raw
        RobustLock(mapping.mm, L.Q_LOCK_P).initialise()
        RobustLock(mapping.mm, L.Q_LOCK_C).initialise()
        g = sizes["groups_off"] // L.WORD
        w[g + L.G_CREATED_NS] = time.time_ns()
        graw = default_group.encode()
        w[g + L.G_NAME_LEN] = len(graw)
        mapping.mm[(g + L.G_NAME) * L.WORD:(g + L.G_NAME) * L.WORD + len(graw)] = graw
        w[g + L.G_STATE] = L.GS_ACTIVE
        w[L.Q_MAGIC] = L.QUEUE_MAGIC  # last: the segment is whole
        return cls(mapping)

    def close(self) -> None:
        self.plock.detach()
        self.clock.detach()
        self.mapping.close()

    @property
    def deleted(self) -> bool:
        return self.w[L.Q_STATE] != L.QS_ACTIVE

    # ------------------------------------------------------------ records
    def slot_base(self, offset: int) -> int:
        return self.slots_w + (offset % self.capacity) * self.slot_words

    def record(self, offset: int) -> tuple[bytes, bytes, int]:
        """(payload, metadata, timestamp_ns) of a retained offset; call under the consumer lock."""
        w = self.w
        base = self.slots_w + (offset % self.capacity) * self.slot_words
        lens = w[base + S_LENS]
        plen = lens & LEN_PAYLOAD_MASK
        mlen = lens >> LEN_META_SHIFT
        start = self.data_off + w[base + S_BYTEPOS] % self.size
        mm = self.mm
        return (mm[start + mlen:start + mlen + plen], (mm[start:start + mlen] if mlen else b""),
                w[base + S_TIMESTAMP])

    def fits_empty(self, nbytes: int, count: int) -> bool:
        """Could this batch ever fit (into an empty ring)?"""
        return count <= self.capacity and nbytes <= self.size

    # ------------------------------------------------------------ producing
    def try_put(self, payload: bytes | bytearray | memoryview, ts: int, meta: bytes = b"") -> int:
        """Append one record (``meta``: its metadata); its offset, or -1 when there is no room now."""
        w = self.w
        n = lens = len(payload)
        mlen = len(meta)
        if mlen:
            lens |= mlen << LEN_META_SHIFT
            n += mlen
        size = self.size
        addr = self.plock.address
        rc = trylock(addr)
        if rc:
            self.plock.acquire_slow(rc)
        try:
            if w[Q_PENDING_PRODUCER]:  # the last idempotent put's writer died
                self._settle_pending()
            if _put_c is not None:
                return _put_c(self._put_geom, payload, meta, ts)  # type: ignore[no-any-return]
            off = w[Q_NEXT_OFFSET]
            free = w[Q_FREE_OFFSET]
            if off - free >= self.capacity:
                return -1
            tb = w[Q_TAIL_BYTES]
            if free == off:  # empty: start the next lap at physical 0
                p = -(-tb // size) * size
                floor = p
            else:
                floor = w[self.slots_w + (free % self.capacity) * self.slot_words + S_BYTEPOS]
                phys = tb % size
                p = tb if phys + n <= size else tb + size - phys
            if p + n - floor > size:
                return -1
            start = self.data_off + p % size
            mm = self.mm
            if mlen:  # metadata || payload, each copied once into place
                mm[start:start + mlen] = meta
                mm[start + mlen:start + n] = payload
            else:
                mm[start:start + n] = payload
            base = self.slots_w + (off % self.capacity) * self.slot_words
            mm[base * WORD:(base + S_EXPIRES) * WORD] = _pack_slot(off, p, lens, ts)
            b = (base + S_EXPIRES) * WORD
            mm[b:b + len(self._zero_leases)] = self._zero_leases
            w[Q_TAIL_BYTES] = p + n
            if crashpoints.active:
                crashpoints.hit("put.written")
            w[Q_NEXT_OFFSET] = off + 1  # commit
            if crashpoints.active:
                crashpoints.hit("put.committed")
            return off
        finally:
            unlock(addr)

    def try_put_many(self, payloads: list[bytes] | Joined, metas: list[bytes] | None, ts: int,
                     producer: int = 0, seq: int = 0, due: int = 0, expires: int = 0) -> int:
        """Append a batch atomically (all or none); the first offset, -1 when it does not
        fit now, or DUPLICATE when ``producer`` (a key from ``producer_key``) already
        wrote ``seq`` or a later sequence.  ``due`` (monotonic ms, 0: none): delayed
        messages, READY for every group at ``due`` (``_delay``).  ``expires`` (wall ns, 0:
        none): their own TTL runs out then (S_EXPIRES; Q_EXPIRES_MAX rises to it)."""
        w = self.w
        size = self.size
        cap = self.capacity
        count = len(payloads)
        self.plock.acquire()
        try:
            if w[Q_PENDING_PRODUCER]:
                self._settle_pending()
            off = w[Q_NEXT_OFFSET]
            free = w[Q_FREE_OFFSET]
            if producer:
                pe = self._producer_entry(producer)
                if w[pe + P_KEY] == producer and seq <= w[pe + P_SEQ]:
                    return DUPLICATE
            if off - free + count > cap:
                return -1
            tb = w[Q_TAIL_BYTES]
            mm = self.mm
            sw = self.slot_words
            sl = self.slots_w
            data = self.data_off
            if free == off:
                p = -(-tb // size) * size
                floor = p
            else:
                floor = w[sl + (free % cap) * sw + S_BYTEPOS]
                p = tb
            # place every record first: nothing is written unless the whole batch fits
            one_run = False
            joined = payloads if payloads.__class__ is Joined else None
            plist = cast("list[bytes]", payloads)  # (when joined is None)
            if metas:
                lens = [len(plist[i]) | (len(metas[i]) << LEN_META_SHIFT) for i in range(count)]
            else:
                lens = list(map(len, plist)) if joined is None else joined.lens
                total = sum(lens)
                one_run = p % size + total <= size  # back to back, inside this lap
            if one_run:
                if p + total - floor > size:
                    return -1
                positions = list(accumulate(lens, initial=p))
                p = positions.pop()
            else:
                positions = []
                for i in range(count):
                    n = (lens[i] & LEN_PAYLOAD_MASK) + (lens[i] >> LEN_META_SHIFT)
                    phys = p % size
                    if phys + n > size:
                        p += size - phys
                    if p + n - floor > size:
                        return -1
                    positions.append(p)
                    p += n
            # slots, one strided block per run that does not wrap the slot table
            i = 0
            while i < count:
                i0 = (off + i) % cap
                k = min(count - i, cap - i0)
                block = array("Q", bytes(WORD * k * sw))  # lease words start NEW (0)
                block[S_OFFSET::sw] = array("Q", range(off + i, off + i + k))
                block[S_BYTEPOS::sw] = array("Q", positions[i:i + k])
                block[S_LENS::sw] = array("Q", lens[i:i + k])
                block[S_TIMESTAMP::sw] = array("Q", [ts]) * k
                if expires:
                    block[S_EXPIRES::sw] = array("Q", [expires]) * k
                w[sl + i0 * sw:sl + (i0 + k) * sw] = block
                if due:
                    self._delay(sl + i0 * sw, k, due)
                i += k
            # records, one copy per physically contiguous run
            i = 0
            if one_run:
                start = data + positions[0] % size
                if joined is not None:  # given back to back: one copy
                    mm[start:start + total] = joined.data
                elif total < count * 2048:  # small records: one join, one copy into place
                    mm[start:start + total] = b"".join(plist)
                else:  # large ones: each copied once, straight into place (no joined copy)
                    for pl, at in zip(plist, positions, strict=True):
                        a = data + at % size
                        mm[a:a + len(pl)] = pl
                i = count
            while i < count:
                j = i + 1
                end = positions[i] + (lens[i] & LEN_PAYLOAD_MASK) + (lens[i] >> LEN_META_SHIFT)
                while j < count and positions[j] == end and end % size:
                    end += (lens[j] & LEN_PAYLOAD_MASK) + (lens[j] >> LEN_META_SHIFT)
                    j += 1
                start = data + positions[i] % size
                if metas:
                    parts: list[Any] = [x for k2 in range(i, j) for x in (metas[k2], plist[k2])]
                elif joined is None:
                    parts = plist[i:j]
                else:  # records i .. j - 1 of the joined bytes
                    parts = [joined.data[sum(lens[:i]):sum(lens[:j])]]
                mm[start:start + end - positions[i]] = b"".join(parts)
                i = j
            w[Q_TAIL_BYTES] = p
            if expires > w[L.Q_EXPIRES_MAX]:  # before the commit: the bound covers what it publishes
                w[L.Q_EXPIRES_MAX] = expires
            if producer:  # the order matters: see "Producer entry" in layout
                w[Q_PENDING_PRODUCER] = (pe - self.producers_w) // P_WORDS + 1
                if crashpoints.active:
                    crashpoints.hit("put_idem.pending")
                if w[pe + P_KEY] == producer:
                    prev = w[pe + P_SEQ]
                else:
                    prev = 0
                    w[pe + P_KEY] = 0  # an entry half rewritten for a new key matches nobody
                w[pe + P_PREV] = prev
                w[pe + P_COMMIT] = off + count
                w[pe + P_SEQ] = seq
                w[pe + P_KEY] = producer
                if crashpoints.active:
                    crashpoints.hit("put_idem.entry")
                w[Q_NEXT_OFFSET] = off + count  # commit
                if crashpoints.active:
                    crashpoints.hit("put_idem.committed")
                w[Q_PENDING_PRODUCER] = 0
            else:
                if crashpoints.active:
                    crashpoints.hit("put_many.written")
                w[Q_NEXT_OFFSET] = off + count  # commit
                if crashpoints.active:
                    crashpoints.hit("put_many.committed")
            return off
        finally:
            self.plock.release()

    def _delay(self, base: int, k: int, due: int) -> None:
        """Under plock, before the commit: the ``k`` slots from word ``base`` hold delayed
        messages: every group's lease word (the free groups' too, for a group created
        later) is READY, no deliveries, at ``due``; Q_DELAY_MAX rises to ``due``."""
        word = L.READY | ((due & L.TIME_MASK) << L.TIME_SHIFT)
        sw = self.slot_words
        for gi in range(self.max_groups):
            b = base + S_FIXED_WORDS + gi
            self.w[b:b + k * sw:sw] = array("Q", [word]) * k
        if due > self.w[L.Q_DELAY_MAX]:
            self.w[L.Q_DELAY_MAX] = due

    # ------------------------------------------------------------ idempotent producers
    def _producer_entry(self, key: int) -> int:
        """The word index of ``key``'s entry; else of a free entry; else of the one
        written longest ago (its memory is lost: documented in options.MAX_PRODUCERS)."""
        w = self.w
        base = self.producers_w
        end = base + self.max_producers * P_WORDS
        keys = w[base + P_KEY:end:P_WORDS].tolist()
        if key in keys:
            return base + keys.index(key) * P_WORDS
        if 0 in keys:
            return base + keys.index(0) * P_WORDS
        commits = w[base + P_COMMIT:end:P_WORDS].tolist()
        return base + commits.index(min(commits)) * P_WORDS

    def _settle_pending(self) -> None:
        """Under plock: an idempotent put's writer died; keep its sequence only if it committed."""
        w = self.w
        pending = w[Q_PENDING_PRODUCER]
        if pending > self.max_producers:  # only a stray write gets here (checked at attach too)
            raise StorageError(f"queue {self.name!r} is corrupt: Q_PENDING_PRODUCER is {pending}")
        e = self.producers_w + (pending - 1) * P_WORDS
        if w[Q_NEXT_OFFSET] < w[e + P_COMMIT]:
            w[e + P_SEQ] = w[e + P_PREV]
        w[Q_PENDING_PRODUCER] = 0

    def _recover_producer(self) -> None:
        if self.w[L.Q_PENDING_PRODUCER]:
            self._settle_pending()

    def producer_table(self) -> list[tuple[int, int]]:
        """(key, last sequence) of every remembered producer; call under plock."""
        w = self.w
        if w[L.Q_PENDING_PRODUCER]:
            self._settle_pending()
        base = self.producers_w
        end = base + self.max_producers * L.P_WORDS
        keys = w[base + L.P_KEY:end:L.P_WORDS].tolist()
        if not any(keys):
            return []
        seqs = w[base + L.P_SEQ:end:L.P_WORDS].tolist()
        return list(compress(zip(keys, seqs, strict=True), keys))

    def restore_producers(self, table: list[tuple[int, int]], commit: int) -> None:
        """Fill the producer table (recovery); call under plock."""
        w = self.w
        for i, (key, seq) in enumerate(table[:self.max_producers]):
            e = self.producers_w + i * L.P_WORDS
            w[e + L.P_SEQ] = seq
            w[e + L.P_PREV] = seq
            w[e + L.P_COMMIT] = commit
            w[e + L.P_KEY] = key

    # ------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Assert the ring's invariants (tests call this after every step)."""
        w = self.w
        off, free = w[L.Q_NEXT_OFFSET], w[L.Q_FREE_OFFSET]
        assert free <= off, (free, off)
        assert off - free <= self.capacity, (off, free)
        prev_end = None
        for o in range(free, off):
            base = self.slot_base(o)
            assert w[base + L.S_OFFSET] == o, (o, w[base])
            pos = w[base + L.S_BYTEPOS]
            n = (w[base + L.S_LENS] & L.LEN_PAYLOAD_MASK) + (w[base + L.S_LENS] >> L.LEN_META_SHIFT)
            assert pos % self.size + n <= self.size, "record crosses the end of the ring"
            if prev_end is not None:
                assert pos >= prev_end, "records overlap"
            prev_end = pos + n
        if off > free:
            first = w[self.slot_base(free) + L.S_BYTEPOS]
            assert w[L.Q_TAIL_BYTES] - first <= self.size, "more bytes held than max_bytes"
        for gi in range(self.max_groups):
            g = self.groups_w + gi * L.G_WORDS
            if w[g + L.G_STATE] != L.GS_ACTIVE:
                continue
            assert free <= w[g + L.G_FLOOR] <= w[g + L.G_CURSOR] <= off, (
                gi, free, w[g + L.G_FLOOR], w[g + L.G_CURSOR], off)
