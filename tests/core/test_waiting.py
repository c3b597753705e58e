"""A co-located get that has to wait, and what waiting must never cost: the consumer lock
held elsewhere (the compiled ``take_one`` / ``ack_lock`` try it once and leave the waiting
to the twin's path), the spin before the sleep (``_spin_wait``: it lets go of the GIL, and
a message given back ends it as a new one does), and the page tables a handle fills in
(``Mapping.populate``), in this process and in a forked child."""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from shmq.core import consumer as consume
from shmq.core import layout as L
from shmq.core import lock
from shmq.core.colocated import ShmBroker
from shmq.errors import Empty
from tests.support.wait import wait_until

LONG_SPIN = 30 * 10**9  # ns: a window no test here may wait out (each finishes in well under 10 s)
PROMPT = 10.0  # s: what "at once" means to these tests, a third of LONG_SPIN


@pytest.fixture
def broker(instance: str) -> Iterator[ShmBroker]:
    b = ShmBroker(instance)
    try:
        yield b
    finally:
        b.destroy()


def _asleep_on(q: Any) -> bool:
    """Does a thread of this process sleep waiting for ``q``'s consumer lock?"""
    return q.ring.clock.address in lock._sleeping


def _delivered(q: Any) -> int:
    """The default group's count of deliveries, read without the consumer lock (``stats``
    takes it, and these tests hold it)."""
    return int(q.words[q.ring.groups_w + (q._gcache["default"] & L.GI_MASK) * L.G_WORDS + L.G_DELIVERED])


def _acked(q: Any) -> int:
    return int(q.words[q.ring.groups_w + (q._gcache["default"] & L.GI_MASK) * L.G_WORDS + L.G_ACKED])


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


# ------------------------------------------------------------------ the lock held elsewhere
def test_a_get_waits_for_a_consumer_lock_held_elsewhere_and_takes_one_message(impl: str,
                                                                            broker: ShmBroker) -> None:
    """The compiled get tries the lock once; held by another thread, it takes nothing there,
    waits for the lock, and delivers once it is let go of: each message once, in order."""
    q = broker.create_queue("held")
    q.put_many([b"a", b"b", b"c"])
    first = q.get()  # the handle learns the group and takes its client slot
    clock = q.ring.clock
    clock.acquire()
    try:
        t, got = _in_thread(q.get)
        wait_until(lambda: _asleep_on(q), PROMPT)  # its get is asleep on the lock, not spinning on it
        assert _delivered(q) == 1  # nothing taken while it was held
    finally:
        clock.release()
    t.join(PROMPT)
    assert not t.is_alive()
    first.ack()
    got[0].ack()
    rest = q.get(block=False)
    rest.ack()
    assert [first.payload, got[0].payload, rest.payload] == [b"a", b"b", b"c"]
    assert [first.deliveries, got[0].deliveries, rest.deliveries] == [1, 1, 1]
    assert q.stats()["groups"]["default"]["acked"] == 3


def test_an_ack_waits_for_a_consumer_lock_held_elsewhere(impl: str, broker: ShmBroker) -> None:
    q = broker.create_queue("held_ack")
    q.put_many([b"a", b"b"])
    m = q.get()
    clock = q.ring.clock
    clock.acquire()
    try:
        t, _ = _in_thread(m.ack)
        wait_until(lambda: _asleep_on(q), PROMPT)
        assert _acked(q) == 0
    finally:
        clock.release()
    t.join(PROMPT)
    assert not t.is_alive()
    assert q.stats()["groups"]["default"]["acked"] == 1
    n = q.get(block=False)  # "a" is settled: never delivered again
    assert (n.payload, n.deliveries) == (b"b", 1)
    n.ack()
    with pytest.raises(Empty):
        q.get(block=False)


# ------------------------------------------------------------------ the spin
def _spinning(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event set as a get starts its spin (whichever implementation spins)."""
    started = threading.Event()
    real = consume.Consuming._spin_wait

    def spin(self: Any, gi: int, now: int) -> bool:
        started.set()
        return real(self, gi, now)

    monkeypatch.setattr(consume.Consuming, "_spin_wait", spin)
    return started


def test_a_spinning_get_lets_a_thread_of_its_own_process_put(impl: str, broker: ShmBroker,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The spin lets go of the GIL: a producer thread of the same process puts while the
    consumer spins, and the consumer takes the message then, not when its window ends."""
    q = broker.create_queue("threads")
    q.put(b"warm")
    q.get().ack()
    q._spin = LONG_SPIN  # type: ignore[attr-defined]
    started = _spinning(monkeypatch)
    t0 = time.monotonic()
    t, got = _in_thread(q.get)
    assert started.wait(PROMPT)
    q.put(b"from a thread")
    t.join(PROMPT)
    assert not t.is_alive() and time.monotonic() - t0 < PROMPT
    assert got[0].payload == b"from a thread"
    got[0].ack()


def test_a_message_given_back_ends_a_spin_as_a_new_one_does(impl: str, broker: ShmBroker,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A nack makes no new offset, and wakes only the consumers that sleep: one that spins
    sees the group's redelivery count move and takes the message at once."""
    q = broker.create_queue("given_back")
    q.put(b"m")
    m = q.get()
    q._spin = LONG_SPIN  # type: ignore[attr-defined]
    started = _spinning(monkeypatch)
    t0 = time.monotonic()
    t, got = _in_thread(q.get)
    assert started.wait(PROMPT)
    m.nack()
    t.join(PROMPT)
    assert not t.is_alive() and time.monotonic() - t0 < PROMPT
    assert (got[0].payload, got[0].offset, got[0].deliveries) == (b"m", m.offset, 2)
    got[0].ack()


def test_a_get_with_a_lease_expiry_due_does_not_spin(impl: str, instance: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease whose visibility timeout has passed is given back by the next look: the spin
    returns at once (the clock is the broker's, here one the test moves)."""
    now = [1000.0]
    b = ShmBroker(instance, clock=lambda: now[0])
    try:
        q = b.create_queue("expiry", visibility_timeout=5)
        q.put(b"m")
        m = q.get()
        q._spin = LONG_SPIN  # type: ignore[attr-defined]
        now[0] += 6  # its lease has expired
        t0 = time.monotonic()
        again = q.get(timeout=PROMPT)
        assert time.monotonic() - t0 < PROMPT
        assert (again.payload, again.offset, again.deliveries) == (b"m", m.offset, 2)
        again.ack()
    finally:
        b.destroy()


# ------------------------------------------------------------------ page tables
PASS_BYTES = 4 << 20  # the byte ring one pass goes through: 1,024 pages
FEW = 32  # faults a pass may take all the same (a forked child's first writes to what it shares)


def _one_pass(q: Any) -> int:
    """Minor page faults of this process while ``q``'s byte ring is gone through once
    (puts, gets and acks of 1 KiB), after a few messages that warm up the rest (in a
    forked child, the first writes to each object it shares with its parent fault too)."""
    payload = b"x" * 1000
    for _ in range(8):
        q.put(payload)
        q.get().ack()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(PASS_BYTES // 1000):
        q.put(payload)
        q.get().ack()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _child_pass(q: Any, out: Any) -> None:
    out.put(_one_pass(q))


def test_a_handle_fills_in_its_page_tables_so_a_first_pass_takes_no_fault(broker: ShmBroker) -> None:
    """A fresh queue's first pass through its byte ring met a page fault at every few pages
    (microseconds each on a VM: a co-located ping-pong's slowest 1%).  A handle fills in
    its process's page tables when it is made, and a forked child the ones it inherits (a
    fork copies none of a shared mapping's).  (Where the kernel cannot, before Linux
    5.14, the pages fault in as before, and the pass works all the same.)"""
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    can = release >= (5, 14)
    q = broker.create_queue("pages", capacity=8192, max_bytes=PASS_BYTES)
    faults = _one_pass(q)
    assert faults < FEW if can else faults >= 0
    child_q = broker.create_queue("pages_child", capacity=8192, max_bytes=PASS_BYTES)
    ctx = mp.get_context("fork")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_child_pass, args=(child_q, out))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    faults = out.get()
    assert faults < FEW if can else faults >= 0
