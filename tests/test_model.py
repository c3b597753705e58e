"""A hypothesis state machine: the real queue (shared memory, injected clock) against a
plain-Python model of what it must do -- puts, batches, gets from two groups, acks, nacks
with delays, touches, commits, stale settles, lease expiry, dead-lettering and ring wrap-around.
The ring's invariants are asserted after every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import shmq
from shmq.shm import ShmBroker

from .conftest import FakeClock, unique_instance

CAP = 8
MAX_BYTES = 4096
MAX_SIZE = 700
MAX_DELIVERIES = 3
VIS = 10.0
GROUPS = ("default", "g2")
NEW, LEASED, READY, DONE = "new", "leased", "ready", "done"


@dataclass
class Lease:
    state: str = NEW
    dc: int = 0
    t: float = 0.0  # deadline (LEASED) or ready time (READY)


@dataclass
class Model:
    payloads: dict[int, bytes] = field(default_factory=dict)
    leases: dict[str, dict[int, Lease]] = field(default_factory=lambda: {g: {} for g in GROUPS})
    dlq: list[bytes] = field(default_factory=list)
    next_offset: int = 0

    def floor(self, g: str) -> int:
        pending = [o for o, lease in self.leases[g].items() if lease.state != DONE]
        return min(pending) if pending else self.next_offset

    def retained(self) -> list[int]:
        free = min(self.floor(g) for g in GROUPS)
        return [o for o in self.payloads if o >= free]

    def give_back(self, g: str, off: int, ready_at: float) -> None:
        lease = self.leases[g][off]
        if lease.dc >= MAX_DELIVERIES:
            lease.state = DONE
            self.dlq.append(self.payloads[off])
        else:
            lease.state, lease.t = READY, ready_at


class QueueMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.broker = ShmBroker(unique_instance(), clock=self.clock)
        self.q = self.broker.create_queue("m", capacity=CAP, max_bytes=MAX_BYTES,
                                          max_message_size=MAX_SIZE, visibility_timeout=VIS,
                                          max_deliveries=MAX_DELIVERIES)
        self.q.create_group("g2")
        self.model = Model()
        self.held: list[shmq.Message] = []
        self.counter = 0

    def teardown(self) -> None:
        self.broker.destroy()

    def _payload(self, size: int) -> bytes:
        self.counter += 1
        return (f"{self.counter}:".encode() + b"x" * size)[:max(size, len(str(self.counter)) + 1)]

    def _may_be_full(self, sizes: list[int]) -> bool:
        kept = self.model.retained()
        if len(kept) + len(sizes) > CAP:
            return True
        used = sum(len(self.model.payloads[o]) for o in kept)
        # records never straddle the end of the ring: up to one record's worth of padding
        return used + sum(sizes) + MAX_SIZE > MAX_BYTES

    def _accept(self, offsets: list[int], payloads: list[bytes]) -> None:
        assert offsets == list(range(self.model.next_offset, self.model.next_offset + len(payloads)))
        for o, p in zip(offsets, payloads, strict=True):
            self.model.payloads[o] = p
            for g in GROUPS:
                self.model.leases[g][o] = Lease()
        self.model.next_offset += len(payloads)

    @rule(size=st.integers(0, MAX_SIZE))
    def put(self, size: int) -> None:
        p = self._payload(size)
        try:
            off = self.q.put(p, block=False)
        except shmq.Full:
            assert self._may_be_full([len(p)]), "Full although the model has room"
            return
        self._accept([off], [p])

    @rule(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4))
    def put_many(self, sizes: list[int]) -> None:
        ps = [self._payload(s) for s in sizes]
        try:
            offs = self.q.put_many(ps, block=False)
        except shmq.Full:
            assert self._may_be_full([len(p) for p in ps]), "Full although the model has room"
            return
        self._accept(offs, ps)

    @rule(group=st.sampled_from(GROUPS), n=st.integers(1, 3),
          budget=st.sampled_from([0, 0, 0, 1, 300, 700, 1000]))
    def get(self, group: str, n: int, budget: int) -> None:
        """get_many; with a ``budget``, the server's poll: a prefix of what get_many would
        deliver whose payloads fit it (one message at least)."""
        now = self.clock.t
        leases = self.model.leases[group]
        for off, lease in sorted(leases.items()):  # expiry first
            if lease.state == LEASED and lease.t <= now:
                self.model.give_back(group, off, now)
        expect = [o for o, lease in sorted(leases.items()) if lease.state == READY and lease.t <= now][:n]
        expect += [o for o, lease in sorted(leases.items()) if lease.state == NEW][:n - len(expect)]
        if budget:
            total, fit = 0, 0
            for o in expect:
                total += len(self.model.payloads[o])
                if total > budget and fit:
                    break
                fit += 1
            expect = expect[:fit]
        if budget:
            got = self.q.poll(group, n, max_bytes=budget)
        else:
            try:
                got = self.q.get_many(n, group=group, block=False)
            except shmq.Empty:
                got = []
        assert [m.offset for m in got] == expect
        for m in got:
            lease = leases[m.offset]
            lease.state, lease.dc, lease.t = LEASED, lease.dc + 1, now + VIS
            assert (m.payload, m.deliveries, m.group) == (self.model.payloads[m.offset], lease.dc, group)
        self.held = (self.held + got)[-12:]

    @rule(group=st.sampled_from(GROUPS), n=st.integers(2, 5), budget=st.sampled_from([0, 0, 600, 1200]))
    def take_block(self, group: str, n: int, budget: int) -> None:
        """The server's batch path: a run it takes is what get_many would have delivered
        (cut short where its payloads would pass ``budget``)."""
        now = self.clock.t
        leases = self.model.leases[group]
        block = self.q.take_block(group, n, max_bytes=budget)
        if block is None:
            return  # the server then calls get_many (the rule above); nothing may have changed
        first, stamps, lens, data = block
        assert not any(lease.state == READY or (lease.state == LEASED and lease.t <= now)
                       for lease in leases.values()), "a run taken before redeliveries or expiries"
        expect = [o for o, lease in sorted(leases.items()) if lease.state == NEW][:n]
        offsets = list(range(first, first + len(lens)))
        assert offsets == expect[:len(offsets)]
        assert 2 <= len(offsets) or not offsets and not expect, "an empty run although one is new"
        assert len(stamps) == len(offsets) and sum(lens) == len(data)
        if budget:
            assert sum(lens) <= budget
        ref = self.q._group_ref(group)  # as the server keeps it
        got = []
        pos = 0
        for o, ln, ts in zip(offsets, lens, stamps, strict=True):
            payload = data[pos:pos + ln]
            pos += ln
            assert payload == self.model.payloads[o]
            lease = leases[o]
            lease.state, lease.dc, lease.t = LEASED, 1, now + VIS
            got.append(tuple.__new__(shmq.Message, (self.q, ref, group, o, 1, payload, b"", ts)))
        self.held = (self.held + got)[-12:]

    def _current(self, m: shmq.Message) -> bool:
        lease = self.model.leases[m.group][m.offset]
        return lease.state == LEASED and lease.dc == m.deliveries

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
        held by offset (often a run, leaving later deliveries unacknowledged)."""
        ms = sorted((m for m in self.held if m.group == group), key=lambda m: (m.offset, m.deliveries))[:k]
        if not ms:
            return
        current = [m for m in ms if self._current(m)]
        ref = self.q._group_ref(group)
        stale = self.q.ack_offsets(ref, [m.offset for m in ms], [m.deliveries for m in ms])
        assert sorted(stale) == sorted(m.offset for m in ms if not self._current(m))
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
    @rule(i=st.integers(0, 11))
    def touch(self, i: int) -> None:
        m = self.held[i % len(self.held)]
        if self._current(m):
            m.touch()
            self.model.leases[m.group][m.offset].t = self.clock.t + VIS
        else:
            try:
                m.touch()
            except shmq.StaleAck:
                return
            raise AssertionError("a stale touch was accepted")

    @rule(group=st.sampled_from(GROUPS), back=st.integers(0, 4))
    def commit(self, group: str, back: int) -> None:
        offset = max(0, self.model.next_offset - back)
        self.q.commit(group, offset)
        for o, lease in self.model.leases[group].items():
            if o < offset:
                lease.state = DONE  # leases held on them turn stale

    @rule(seconds=st.sampled_from([0.5, 3.0, 11.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @invariant()
    def matches_model(self) -> None:
        self.q._ring.check_invariants()
        first, nxt = self.q.offsets()
        assert nxt == self.model.next_offset
        assert nxt - first == len(self.model.retained())
        if self.model.dlq:
            dlq = self.broker.queue("m.dlq")
            assert dlq.offsets()[1] == len(self.model.dlq)
            assert [m.payload for m in dlq.read(0, len(self.model.dlq))] == self.model.dlq


QueueMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestQueueModel = QueueMachine.TestCase
