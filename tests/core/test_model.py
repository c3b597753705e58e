"""A hypothesis state machine: the real queue (shared memory, injected clock) against a
plain-Python model of what it must do -- puts (plain, delayed, with a TTL of their own),
batches, idempotent producers, gets from three groups (``get``, the compiled
one-message path, and ``get_many``) with per-delivery visibility timeouts, acks, nacks
with delays, touches that lengthen or shorten, commits, seeks by time, stale settles,
lease expiry, TTL expiry, dead-lettering, ring wrap-around, groups deleted and created
again, consumers that die (forked, with a crash point armed) and reapers at any step.  The
model keeps each group's cursor, as the queue does: a delivery gives back what is due
below it first, then takes new messages from it (stepping over delayed ones and expiring
those whose TTL ran out), then the delayed ones it passed that are due.  The invariant
checker (``shmq doctor --check``) runs after every step, and a put the model says cannot
fit must be refused.  Messages carry random headers (often none), which every delivery
and every dead letter must have."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import shmq
from shmq import crashpoints
from shmq import headers as H
from shmq.core import layout as L
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerQueue
from tests.support.clock import FakeClock
from tests.support.instances import unique_instance

pytestmark = pytest.mark.slow  # 60 examples of 60 steps: about 10 s

CTX = mp.get_context("fork")

CAP = 8
MAX_BYTES = 4096
MAX_SIZE = 700
MAX_DELIVERIES = 3
VIS = 10.0
GROUPS = ("default", "g2", "g3")  # in the order of their indexes
NEW, LEASED, READY, DONE = "new", "leased", "ready", "done"
# a message's headers: none, mostly; values bytes or str (stored as UTF-8)
HEADERS = st.one_of(st.none(), st.none(), st.dictionaries(
    st.sampled_from(["k", "trace-id", "é"]), st.one_of(st.binary(max_size=6), st.text(max_size=3)),
    max_size=3))


def stored(h: dict[str, bytes | str] | None) -> dict[str, bytes]:
    """What msg.headers reads back for ``h``."""
    return {k: v.encode() if isinstance(v, str) else v for k, v in (h or {}).items()}


@dataclass
class Lease:
    state: str = NEW
    dc: int = 0
    t: float = 0.0  # deadline (LEASED), ready time (READY); DONE: a delayed one's due time, kept
    dead: bool = False  # LEASED by a consumer that died (its reaper gives it back)

    def settle(self) -> None:
        """Settled without a delivery (a commit, a seek, a group's start): DONE, its delivery
        count kept, and a delayed message never delivered keeps its due time (``settled``)."""
        if not (self.dc == 0 and self.state in (READY, DONE)):
            self.t = 0.0
        self.state = DONE

    def reopen(self, now: float) -> None:
        """Delivered again after a seek back (``reopened``): at its due time when it is a
        delayed message settled before its first delivery, else now."""
        self.state, self.t = READY, (self.t if self.dc == 0 and self.t else now if self.dc else 0.0)


@dataclass
class Delivered:
    """What one delivery did: the offsets given back before (``red``), the new ones
    (``new``), the delayed ones it passed that were due (``late``), in that order; the
    ones whose TTL ran out on the way (``gone``, to the DLQ)."""

    red: list[int] = field(default_factory=list)
    new: list[int] = field(default_factory=list)
    late: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)

    @property
    def offsets(self) -> list[int]:
        return self.red + self.new + self.late


@dataclass
class Model:
    payloads: dict[int, bytes] = field(default_factory=dict)
    headers: dict[int, dict[str, bytes]] = field(default_factory=dict)
    sizes: dict[int, int] = field(default_factory=dict)  # payload + header block: what a record holds
    stamps: dict[int, int] = field(default_factory=dict)  # producer timestamps (ns), as the queue has them
    due: dict[int, float] = field(default_factory=dict)  # a delayed put's due time
    expires: dict[int, float] = field(default_factory=dict)  # a put's own TTL: when it expires
    leases: dict[str, dict[int, Lease]] = field(default_factory=lambda: {g: {} for g in GROUPS})
    cursor: dict[str, int] = field(default_factory=lambda: {g: 0 for g in GROUPS})
    dlq: list[tuple[bytes, dict[str, bytes]]] = field(default_factory=list)
    next_offset: int = 0
    producers: dict[str, int] = field(default_factory=dict)  # idempotent producer -> last seq

    def dead_letter(self, g: str, off: int) -> None:
        lease = self.leases[g][off]
        lease.state, lease.t = DONE, 0.0
        self.dlq.append((self.payloads[off], self.headers[off]))

    def deliver(self, g: str, now: float, n: int, budget: int = 0) -> Delivered:
        """A delivery of up to ``n`` (payloads and headers within ``budget``, at least one
        message; 0: no limit) to group ``g`` at ``now``, as ``Delivery.deliver`` does it;
        the model changed to match (its leases LEASED, the cursor moved).  Call ``expire``
        first."""
        leases = self.leases[g]
        d = Delivered()
        used = 0

        def take(o: int) -> bool:
            nonlocal used
            if budget and d.offsets and used + self.sizes[o] > budget:
                return False
            used += self.sizes[o]
            lease = leases[o]
            lease.state, lease.dc, lease.t, lease.dead = LEASED, lease.dc + 1, now + VIS, False
            return True

        def redeliver(into: list[int]) -> bool:
            """The READY ones below the cursor that are due, lowest first; True when the
            budget was spent (then the new ones wait)."""
            for o in sorted(leases):
                if o >= self.cursor[g] or len(d.offsets) >= n:
                    break
                lease = leases[o]
                if lease.state != READY or lease.t > now:
                    continue
                if not lease.dc and self.expires.get(o, now + 1) <= now:  # delayed, and its TTL ran out
                    d.gone.append(o)
                    self.dead_letter(g, o)
                    continue
                if not take(o):
                    return True
                into.append(o)
            return False

        if redeliver(d.red):
            return d
        due_now = False
        o = self.cursor[g]
        while o < self.next_offset and len(d.offsets) < n:
            lease = leases[o]
            if lease.state == DONE:
                o += 1
                continue
            if lease.state == READY:  # delayed: the cursor passes it, the READY scan takes it when due
                due_now = due_now or lease.t <= now
                o += 1
                continue
            if self.expires.get(o, now + 1) <= now:  # expired before its first delivery
                d.gone.append(o)
                self.dead_letter(g, o)
                o += 1
                continue
            if not take(o):
                break
            d.new.append(o)
            o += 1
        self.cursor[g] = o
        if due_now and len(d.offsets) < n and not (budget and d.offsets):
            redeliver(d.late)
        return d

    def floor(self, g: str) -> int:
        pending = [o for o, lease in self.leases[g].items() if lease.state != DONE]
        return min(pending) if pending else self.next_offset

    def retained(self) -> list[int]:
        free = min(self.floor(g) for g in self.leases)
        return [o for o in self.payloads if o >= free]

    def give_back(self, g: str, off: int, ready_at: float) -> None:
        lease = self.leases[g][off]
        lease.dead = False
        if lease.dc >= MAX_DELIVERIES:
            lease.state = DONE
            self.dlq.append((self.payloads[off], self.headers[off]))
        else:
            lease.state, lease.t = READY, ready_at

    def expiry_dead_letters(self, g: str, now: float) -> bool:
        """Would ``expire`` send a message to the dead-letter queue?"""
        return any(lease.state == LEASED and lease.t <= now and lease.dc >= MAX_DELIVERIES
                   for lease in self.leases[g].values())

    def expire(self, g: str, now: float) -> None:
        for off, lease in sorted(self.leases[g].items()):
            if lease.state == LEASED and lease.t <= now:
                self.give_back(g, off, now)

    def seek(self, g: str, to: int, now: float) -> None:
        """``Groups.seek`` to offset ``to`` (a retained one, or the next)."""
        leases, cur = self.leases[g], self.cursor[g]
        if to >= cur:
            self.commit(g, to)
            return
        for o, lease in leases.items():
            if o < to:
                lease.settle()
            elif o < cur and lease.state != READY and lease.dc < MAX_DELIVERIES:
                lease.reopen(now)

    def commit(self, g: str, offset: int) -> None:
        """Everything of ``g`` below ``offset`` settled; the cursor past it."""
        for o, lease in self.leases[g].items():
            if o < offset:
                lease.settle()  # leases held on them turn stale
        self.cursor[g] = max(self.cursor[g], min(offset, self.next_offset))


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.broker = ShmBroker(unique_instance(), clock=self.clock)
        self.q = self.broker.create_queue("m", capacity=CAP, max_bytes=MAX_BYTES,
                                          max_message_size=MAX_SIZE, visibility_timeout=VIS,
                                          max_deliveries=MAX_DELIVERIES)
        self.sq = ServerQueue(self.q)  # the server's view of it (poll, take_block, ack_offsets)
        # never full here
        self.broker.create_queue("m.dlq", dead_letter=True, capacity=1024, max_bytes=1 << 20)
        for g in GROUPS[1:]:
            self.q.create_group(g)
        # only the reap rule reaps (a get that finds nothing would, every REAP_INTERVAL)
        self.broker._att.registry.w[L.R_NEXT_REAP_MS] = 1 << 62
        self.model = Model()
        self.held: list[shmq.Message] = []
        self.counter = 0
        self.started = self.clock.t  # (a put's delay and TTL are whole ms of the lease clock)

    def teardown(self) -> None:
        self.broker.destroy()

    def _payload(self, size: int) -> bytes:
        self.counter += 1
        return (f"{self.counter}:".encode() + b"x" * size)[:max(size, len(str(self.counter)) + 1)]

    def _may_be_full(self, sizes: list[int]) -> bool:
        kept = self.model.retained()
        if len(kept) + len(sizes) > CAP:
            return True
        used = sum(self.model.sizes[o] for o in kept)
        # records never straddle the end of the ring: up to one record's worth of padding
        return used + sum(sizes) + MAX_SIZE > MAX_BYTES

    def _must_be_full(self, sizes: list[int]) -> bool:
        kept = self.model.retained()
        used = sum(self.model.sizes[o] for o in kept)
        return len(kept) + len(sizes) > CAP or used + sum(sizes) > MAX_BYTES

    def _refused(self, sizes: list[int]) -> None:
        assert not self._must_be_full(sizes), "a put was accepted although the queue has no room"

    def _accept(self, offsets: list[int], payloads: list[bytes], headers: list[dict[str, bytes | str] | None],
                delay: float = 0.0, ttl: float = 0.0) -> None:
        assert offsets == list(range(self.model.next_offset, self.model.next_offset + len(payloads)))
        now = self.clock.t
        for o, p, h in zip(offsets, payloads, headers, strict=True):
            self.model.payloads[o] = p
            self.model.headers[o] = stored(h)
            self.model.sizes[o] = len(p) + len(H.encode(h))
            self.model.stamps[o] = self.q.read(o, 1)[0].timestamp_ns
            if delay:
                self.model.due[o] = now + delay
            if ttl:
                self.model.expires[o] = now + ttl
            for g in GROUPS:
                self.model.leases[g][o] = Lease(READY, 0, now + delay) if delay else Lease()
        self.model.next_offset += len(payloads)

    @rule(size=st.integers(0, MAX_SIZE), headers=HEADERS)
    def put(self, size: int, headers: dict[str, bytes | str] | None = None) -> None:
        meta = len(H.encode(headers))
        p = self._payload(min(size, MAX_SIZE - meta))  # with its headers, at most max_message_size
        try:
            off = self.q.put(p, block=False, headers=headers)
        except shmq.Full:
            assert self._may_be_full([len(p) + meta]), "Full although the model has room"
            return
        self._refused([len(p) + meta])
        self._accept([off], [p], [headers])

    @rule(size=st.integers(0, 300), delay=st.sampled_from([1.0, 5.0]), ttl=st.sampled_from([0.0, 0.0, 7.0]),
          headers=HEADERS)
    def put_delayed(self, size: int, delay: float, ttl: float,
                    headers: dict[str, bytes | str] | None) -> None:
        """A put due later (with a TTL of its own too, at times): no group gets it before."""
        p = self._payload(size)
        meta = len(H.encode(headers))
        try:
            off = self.q.put(p, block=False, headers=headers, delay=delay, ttl=ttl or None)
        except shmq.Full:
            assert self._may_be_full([len(p) + meta]), "Full although the model has room"
            return
        self._refused([len(p) + meta])
        self._accept([off], [p], [headers], delay=delay, ttl=ttl)

    @rule(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=3), ttl=st.sampled_from([0.5, 3.0]),
          hs=st.lists(HEADERS, min_size=3, max_size=3))
    def put_with_ttl(self, sizes: list[int], ttl: float, hs: list[dict[str, bytes | str] | None]) -> None:
        """A batch with a TTL of its own: a group that has not had it in time never does;
        it goes to the dead-letter queue instead, once a delivery passes it."""
        ps = [self._payload(s) for s in sizes]
        hs = hs[:len(ps)]
        total = [len(p) + len(H.encode(h)) for p, h in zip(ps, hs, strict=True)]
        try:
            offs = self.q.put_many(ps, block=False, headers=hs, ttl=ttl)
        except shmq.Full:
            assert self._may_be_full(total), "Full although the model has room"
            return
        self._refused(total)
        self._accept(offs, ps, hs, ttl=ttl)

    @rule(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
          hs=st.lists(HEADERS, min_size=4, max_size=4))
    def put_many(self, sizes: list[int], hs: list[dict[str, bytes | str] | None] | None = None) -> None:
        ps = [self._payload(s) for s in sizes]
        hs = (hs or [None] * len(ps))[:len(ps)]
        total = [len(p) + len(H.encode(h)) for p, h in zip(ps, hs, strict=True)]
        try:
            offs = self.q.put_many(ps, block=False, headers=hs)
        except shmq.Full:
            assert self._may_be_full(total), "Full although the model has room"
            return
        self._refused(total)
        self._accept(offs, ps, hs)

    @rule(producer=st.sampled_from(["p1", "p2"]), step=st.sampled_from([-1, 0, 1, 1, 2]),
          sizes=st.lists(st.integers(0, 200), min_size=1, max_size=3),
          hs=st.lists(HEADERS, min_size=3, max_size=3))
    def put_idempotent(self, producer: str, step: int, sizes: list[int],
                       hs: list[dict[str, bytes | str] | None]) -> None:
        last = self.model.producers.get(producer, 0)
        seq = max(1, last + step)
        ps = [self._payload(s) for s in sizes]
        hs = hs[:len(ps)]
        total = [len(p) + len(H.encode(h)) for p, h in zip(ps, hs, strict=True)]
        try:
            offs = self.q.put_many(ps, block=False, producer=producer, seq=seq, headers=hs)
        except shmq.Duplicate:
            assert seq <= last, "a new sequence was taken for a duplicate"
            return
        except shmq.Full:
            assert self._may_be_full(total), "Full although the model has room"
            return
        assert seq > last, "a duplicate sequence was written again"
        self._refused(total)
        self.model.producers[producer] = seq
        self._accept(offs, ps, hs)

    @rule(group=st.sampled_from(GROUPS), n=st.integers(1, 3),
          budget=st.sampled_from([0, 0, 0, 1, 300, 700, 1000]), vis=st.sampled_from([None, None, 1.0, 30.0]),
          one=st.sampled_from([False, False, True]))
    def get(self, group: str, n: int, budget: int, vis: float | None, one: bool = False) -> None:
        """get_many; with ``one``, ``get`` (the one-message path, compiled where built); with
        a ``budget``, the server's poll: what get_many would deliver, stopped before the
        payloads and headers pass it (one message at least).  ``vis``: this delivery's
        visibility timeout."""
        now = self.clock.t
        leases = self.model.leases[group]
        self.model.expire(group, now)
        if one:
            n, budget = 1, 0
        expect = self.model.deliver(group, now, n, budget)
        if budget:
            got = self.sq.poll(group, n, visibility_timeout=vis, max_bytes=budget)
        else:
            try:
                got = ([self.q.get(group=group, block=False, visibility_timeout=vis)] if one else
                       self.q.get_many(n, group=group, block=False, visibility_timeout=vis))
            except shmq.Empty:
                got = []
        assert [m.offset for m in got] == expect.offsets
        for m in got:
            lease = leases[m.offset]
            lease.t = now + (VIS if vis is None else vis)
            assert (m.payload, m.deliveries, m.group) == (self.model.payloads[m.offset], lease.dc, group)
            assert dict(m.headers) == self.model.headers[m.offset]
        self.held = (self.held + got)[-12:]

    @rule(group=st.sampled_from(GROUPS), n=st.integers(2, 5), budget=st.sampled_from([0, 0, 600, 1200]))
    def take_block(self, group: str, n: int, budget: int) -> None:
        """The server's batch path: a run it takes is what get_many would have delivered
        (cut short where its payloads would pass ``budget``)."""
        now = self.clock.t
        leases = self.model.leases[group]
        block = self.sq.take_block(group, n, max_bytes=budget)
        if block is None:
            return  # the server then calls get_many (the rule above); nothing may have changed
        first, stamps, lens, data = block
        cur = self.model.cursor[group]
        assert not any((lease.state == READY and o < cur) or (lease.state == LEASED and lease.t <= now)
                       for o, lease in leases.items()), "a run taken before redeliveries or expiries"
        expect: list[int] = []  # the run of new messages at the cursor
        while cur + len(expect) < self.model.next_offset and len(expect) < n and (
                leases[cur + len(expect)].state == NEW):
            expect.append(cur + len(expect))
        offsets = list(range(first, first + len(lens)))
        assert offsets == expect[:len(offsets)]
        assert not any(self.model.expires.get(o, now + 1) <= now for o in offsets), "an expired one in a run"
        self.model.cursor[group] = cur + len(offsets)
        assert 2 <= len(offsets) or not offsets and not expect, "an empty run although one is new"
        assert len(stamps) == len(offsets) and sum(lens) == len(data)
        if budget:
            assert sum(lens) <= budget
        ref = self.sq.group_ref(group)  # as the server keeps it
        got = []
        pos = 0
        for o, ln, ts in zip(offsets, lens, stamps, strict=True):
            payload = data[pos:pos + ln]
            pos += ln
            assert payload == self.model.payloads[o]
            assert not self.model.headers[o], "a message with headers in a run (runs are records without)"
            lease = leases[o]
            lease.state, lease.dc, lease.t = LEASED, 1, now + VIS
            got.append(tuple.__new__(shmq.Message, (self.q, ref, group, o, 1, payload, b"", ts)))
        self.held = (self.held + got)[-12:]

    def _current(self, m: shmq.Message) -> bool:
        """Is this delivery (group incarnation, offset, deliveries) leased to us now?  A group
        made again has a new serial: the old one's deliveries are stale."""
        lease = self.model.leases[m.group].get(m.offset)
        return (lease is not None and lease.state == LEASED and lease.dc == m.deliveries
                and not lease.dead and m[1] == self.sq.group_ref(m.group))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 11))
    def ack(self, i: int) -> None:
        m = self.held[i % len(self.held)]
        if self._current(m):
            m.ack()
            self.model.leases[m.group][m.offset].state = DONE
        else:
            try:
                m.ack()
            except shmq.StaleAck:
                return
            raise AssertionError("a stale ack was accepted")

    @precondition(lambda self: len(self.held) > 1)
    @rule()
    def ack_many(self) -> None:
        current = [m for m in self.held if self._current(m)]
        stale = [m for m in self.held if not self._current(m)]
        try:
            self.q.ack_many(self.held)
        except shmq.StaleAck as e:
            assert sorted(e.stale) == sorted(m.offset for m in stale)  # type: ignore[attr-defined]
        else:
            assert not stale
        for m in current:
            self.model.leases[m.group][m.offset].state = DONE

    @precondition(lambda self: len(self.held) > 1)
    @rule(group=st.sampled_from(GROUPS), k=st.integers(2, 12))
    def ack_offsets(self, group: str, k: int) -> None:
        """The server's batch ack: (offset, deliveries) columns of one group, the first ``k``
        held by offset (often a run, leaving later deliveries unacknowledged), sent with the
        group reference they were delivered under (as a connection keeps its leases)."""
        ms = sorted((m for m in self.held if m.group == group), key=lambda m: (m.offset, m.deliveries))[:k]
        if not ms:
            return
        ref = ms[0][1]
        ms = [m for m in ms if m[1] == ref]
        current: list[shmq.Message] = []
        expect_stale = []
        for m in ms:  # a pair held twice is acknowledged once
            if self._current(m) and not [c for c in current if c.offset == m.offset]:
                current.append(m)
            else:
                expect_stale.append(m.offset)
        stale, _ = self.sq.ack_offsets(ref, [m.offset for m in ms], [m.deliveries for m in ms])
        assert sorted(stale) == sorted(expect_stale)
        for m in current:
            self.model.leases[m.group][m.offset].state = DONE

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 11), delay=st.sampled_from([0.0, 0.0, 3.0]))
    def nack(self, i: int, delay: float) -> None:
        m = self.held[i % len(self.held)]
        if self._current(m):
            m.nack(delay)
            self.model.give_back(m.group, m.offset, self.clock.t + delay)
        else:
            try:
                m.nack(delay)
            except shmq.StaleAck:
                return
            raise AssertionError("a stale nack was accepted")

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 11), vis=st.sampled_from([None, 0.5, 20.0]))
    def touch(self, i: int, vis: float | None) -> None:
        """Extend a lease, or shorten it (``vis`` below the queue's)."""
        m = self.held[i % len(self.held)]
        if self._current(m):
            m.touch(vis)
            self.model.leases[m.group][m.offset].t = self.clock.t + (VIS if vis is None else vis)
        else:
            try:
                m.touch(vis)
            except shmq.StaleAck:
                return
            raise AssertionError("a stale touch was accepted")

    @rule(group=st.sampled_from(GROUPS), back=st.integers(0, 4))
    def commit(self, group: str, back: int) -> None:
        offset = max(0, self.model.next_offset - back)
        self.q.commit(group, offset)
        self.model.commit(group, offset)

    @rule(group=st.sampled_from(GROUPS), back=st.integers(0, 6))
    def seek(self, group: str, back: int) -> None:
        """Seek ``group`` to the producer timestamp of a retained message (``back`` from the
        newest; past the oldest: its own, or the next offset's time): the first message put
        at or after it (the timestamps of one clock tick are equal) and everything after
        it, up to the cursor, are delivered again; what is below it is settled."""
        kept = self.model.retained()
        if not kept:
            return
        at = self.model.stamps[kept[max(0, len(kept) - 1 - back)]]
        to = min(o for o in kept if self.model.stamps[o] >= at)
        offset, _ = self.sq.seek(group, at)
        assert offset == to
        self.model.seek(group, to, self.clock.t)

    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(group=st.sampled_from(GROUPS[1:]), start=st.sampled_from(["earliest", "latest"]))
    def recreate_group(self, group: str, start: str) -> None:
        """Delete a group and create it again (the same index, a new serial): the old
        one's leases turn stale, the new one starts at the earliest retained or the next."""
        self.q.delete_group(group)
        old = self.model.leases.pop(group)
        kept = self.model.retained()
        self.q.create_group(group, start)
        new: dict[int, Lease] = {}
        for o in kept:  # the index's words, made the new group's (``GroupTable.create``)
            was = old.get(o, Lease())
            if start == "latest":
                was.settle()
                new[o] = was
            elif not was.dc and was.state == DONE and was.t:  # delayed, settled before its time
                new[o] = Lease(READY, 0, was.t)
            elif not was.dc and was.state == READY:  # delayed, never delivered
                new[o] = Lease(READY, 0, was.t)
            else:
                new[o] = Lease()
        self.model.leases[group] = new
        self.model.cursor[group] = min(kept) if kept and start == "earliest" else self.model.next_offset

    @rule(group=st.sampled_from(GROUPS), n=st.integers(1, 4),
          point=st.sampled_from(["", "deliver.run.leased", "deliver.cursor", "redeliver.leased"]))
    def consumer_dies(self, group: str, n: int, point: str) -> None:
        """A forked consumer takes ``n`` messages and dies: at ``point`` (SIGKILL, inside
        the consumer lock), or just after its get returned (no goodbye)."""
        now = self.clock.t
        if self.model.expiry_dead_letters(group, now):
            return  # the child's expiry would copy to the DLQ, and may die before it does: not here
        trial = copy.deepcopy(self.model)
        trial.expire(group, now)
        plan = trial.deliver(group, now, n)
        if plan.gone or plan.late or any(not self.model.leases[group][o].dc for o in plan.red):
            return  # a TTL expiry (a copy to the DLQ), or a delayed one: the kill's cut is not modelled
        self.model.expire(group, now)  # the child's get expires first, as ours does
        leases = self.model.leases[group]
        p = CTX.Process(target=_consume_and_die, args=(self.q, group, n, point))
        p.start()
        p.join(30)
        killed = p.exitcode == -signal.SIGKILL
        assert p.exitcode in (0, -signal.SIGKILL), p.exitcode
        if killed and point == "deliver.run.leased":
            taken = plan.red  # killed before its cursor moved: the new ones were never leased
        elif killed and point == "redeliver.leased":
            taken = plan.red[:1]  # killed at its first redelivery
        else:
            taken = plan.offsets
            self.model.cursor[group] = trial.cursor[group]
        for o in taken:
            lease = leases[o]
            lease.state, lease.dc, lease.t, lease.dead = LEASED, lease.dc + 1, now + VIS, True

    @rule()
    def reap(self) -> None:
        """A reaper gives back every lease of the consumers that died."""
        self.broker.reap()
        for g in GROUPS:
            for off, lease in sorted(self.model.leases[g].items()):
                if lease.state == LEASED and lease.dead:
                    self.model.give_back(g, off, self.clock.t)

    def _dlq_messages(self) -> list[tuple[bytes, dict[str, bytes]]]:
        dlq = self.broker.queue("m.dlq")
        return [(bytes(m.payload), dict(m.headers)) for m in dlq.read(0, max(1, dlq.offsets()[1]))]

    @invariant()
    def matches_model(self) -> None:
        violations = check_instance(self.broker.instance)
        assert violations == [], violations
        first, nxt = self.q.offsets()
        assert nxt == self.model.next_offset
        assert nxt - first == len(self.model.retained())
        def key(d: tuple[bytes, dict[str, bytes]]) -> tuple[bytes, list[tuple[str, bytes]]]:
            return d[0], sorted(d[1].items())

        # reapers copy in slot order; a dead letter keeps the headers it was put with
        assert sorted(self._dlq_messages(), key=key) == sorted(self.model.dlq, key=key)


def _consume_and_die(q: shmq.Queue, group: str, n: int, point: str) -> None:
    if point:
        crashpoints.arm(point)
    try:
        q.get_many(n, group=group, block=False)
    except shmq.Empty:
        pass
    os._exit(0)  # no goodbye: its leases stay until a reaper gives them back


QueueMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestQueueModel = QueueMachine.TestCase


def test_a_consumer_dying_where_its_expiry_would_dead_letter_leaves_the_model_untouched() -> None:
    """A sequence hypothesis found: the model ran an expiry that dead-letters (a lease past
    max_deliveries) and then skipped the step, so its DLQ got ahead of the broker's.
    Replayed as found, every invariant checked after each step."""
    state = QueueMachine()
    steps: list[tuple[str, dict[str, object]]] = [
        ("reap", {}), ("reap", {}), ("reap", {}), ("put", {"size": 0}), ("reap", {}),
        ("put", {"size": 132}), ("take_block", {"budget": 0, "group": "g2", "n": 2}),
        ("advance", {"seconds": 0.5}), ("reap", {}), ("reap", {}), ("touch", {"i": 0, "vis": 0.5}),
        ("reap", {}), ("advance", {"seconds": 0.5}),
        ("consumer_dies", {"group": "g2", "n": 3, "point": ""}),
        ("reap", {}), ("reap", {}), ("reap", {}), ("reap", {}),
        ("consumer_dies", {"group": "default", "n": 2, "point": ""}),
        ("reap", {}), ("reap", {}), ("reap", {}), ("reap", {}), ("reap", {}),
        ("get", {"budget": 0, "group": "default", "n": 3, "vis": None}), ("put_many", {"sizes": [254]}),
        ("get", {"budget": 0, "group": "g2", "n": 1, "vis": None}),
        ("take_block", {"budget": 0, "group": "default", "n": 2}), ("reap", {}),
        ("advance", {"seconds": 11.0}), ("reap", {}), ("reap", {}),
        ("consumer_dies", {"group": "g2", "n": 1, "point": ""}),
    ]
    try:
        state.matches_model()
        for name, kwargs in steps:
            getattr(state, name)(**kwargs)
            state.matches_model()
    finally:
        state.teardown()
