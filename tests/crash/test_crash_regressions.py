"""One test per crash-safety bug found in review (issue 17), each failing on the code
before its fix: stranded messages after a reap, reclaiming a live instance, a blocked get
holding a stale group, late expiries, two reapers, clock steps, a half-made group, the
delivery-count ABA of dead-letter queues, orphans never retried, clocks that overflow,
and the registry lock held while a segment's pages are reserved."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.synchronize import Event

import pytest

import shmq
from shmq import process
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.lock import EBUSY, trylock, unlock
from tests.support.clock import FakeClock
from tests.support.connect import connect_shm
from tests.support.instances import objects, reg_path
from tests.support.wait import wait_until

pytestmark = pytest.mark.crash

CTX = mp.get_context("fork")


# ---------------------------------------------------------------- bug 2: a producer keeps its instance
def _create_and_leave(name: str) -> None:
    b = ShmBroker(name)
    b.create_queue("q")
    b.close()  # a clean exit: its client slot (if any) is freed


def test_a_live_producer_only_process_keeps_its_instance(instance: str) -> None:
    """A process that only produces takes no client slot; it is attached all the same."""
    p = CTX.Process(target=_create_and_leave, args=(instance,))
    p.start()
    p.join()
    assert p.exitcode == 0
    producer = subprocess.Popen(
        [sys.executable, "-c", "import sys, shmq\n"
         f"shmq.connect('shm://{instance}').queue('q').put(b'kept')\n"
         "print('ready', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert producer.stdout is not None and producer.stdout.readline() == "ready\n"
        assert [r.alive for r in shmq.scan(instance)] == [True]
        assert shmq.reclaim(instance) == []  # live: nothing is touched
        assert os.path.exists(reg_path(instance))
    finally:
        producer.communicate("")
    assert producer.returncode == 0
    # the producer is gone and nobody else is attached: now it is dead, and reclaimed
    reports = shmq.reclaim(instance)
    assert [(r.instance, r.alive) for r in reports] == [(instance, False)]
    assert not objects(instance)


# ---------------------------------------------------------------- bug 3: a blocked get and its group
def test_a_blocked_get_follows_its_group_through_delete_and_create(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q", visibility_timeout=300)
    q.create_group("g", start="latest")
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(q.get(group="g", timeout=10)))
    t.start()
    wait_until(lambda: q.words[L.Q_CONSUMER_WAITERS] > 0)  # the get sleeps
    q.delete_group("g")
    q.create_group("g", start="latest")  # the same index, a new serial
    q.put(b"new")
    t.join(10)
    (m,) = got
    assert isinstance(m, shmq.Message) and m.payload == b"new"
    m.ack()  # a delivery of the new group, not a stale one
    assert q.stats()["groups"]["g"]["in_flight"] == 0


def test_a_blocked_get_on_a_deleted_group_is_told(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q")
    q.create_group("g", start="latest")
    errors: list[BaseException] = []

    def get() -> None:
        try:
            q.get(group="g", timeout=10)
        except shmq.ShmqError as e:
            errors.append(e)

    t = threading.Thread(target=get)
    t.start()
    wait_until(lambda: q.words[L.Q_CONSUMER_WAITERS] > 0)
    q.delete_group("g")
    q.put(b"x")  # wakes it
    t.join(10)
    assert [type(e) for e in errors] == [shmq.GroupNotFound]
    assert q.get(block=False).payload == b"x"  # the default group has it


# ---------------------------------------------------------------- bug 4: G_NEXT_EXPIRY is a lower bound
def test_a_short_lease_after_a_long_one_expires_on_time(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("q", visibility_timeout=1)
    q.put_many([b"long", b"short"])
    long = q.get(visibility_timeout=60)
    assert q.get().payload == b"short"  # the one-message hot path, with the queue's 1 s
    clock.advance(2)
    again = q.get(block=False)
    assert (again.payload, again.deliveries) == (b"short", 2)
    long.ack()
    again.ack()


def test_a_touch_that_shortens_a_lease_is_kept(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("q", visibility_timeout=60)
    q.put(b"x")
    q.get().touch(1)
    clock.advance(2)
    again = q.get(block=False)
    assert (again.payload, again.deliveries) == (b"x", 2)
    again.ack()


# ---------------------------------------------------------------- bug 5: two reapers
def _lease_and_hang(url: str, ready: Event) -> None:
    shmq.connect(url).queue("q").get()
    ready.set()
    time.sleep(60)


def test_a_late_reaper_never_takes_the_leases_of_the_slots_next_holder(
        shm_broker: ShmBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    q = shm_broker.create_queue("q", visibility_timeout=300)
    q.put_many([b"a", b"b"])
    late = ShmBroker(shm_broker.instance, clock=time.monotonic)  # a second attachment: reaper A
    late._att.client_slot()
    shm_broker._att.client_slot()
    ready = CTX.Event()
    p = CTX.Process(target=_lease_and_hang, args=(shm_broker.url, ready))
    p.start()
    assert ready.wait(10)
    os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
    p.join()
    stale = [c for c in shm_broker._att.registry.clients() if c.pid == p.pid]  # what A read
    shm_broker.reap()  # reaper B reaps first and frees the slot
    newcomer = ShmBroker(shm_broker.instance, clock=time.monotonic)
    m = newcomer.queue("q").get(timeout=1)
    assert (m.payload, m.deliveries) == (b"a", 2)
    assert newcomer._att._slot == stale[0].slot  # the dead one's slot, taken again
    # reaper A now acts on what it read before: the slot's process is dead, it thinks
    monkeypatch.setattr(late._att.registry, "clients", lambda: stale)
    monkeypatch.setattr(late._att.registry, "client_alive", lambda c: False)
    late.reap()
    m.ack()  # still the newcomer's lease
    assert [x.payload for x in q.get_many(5, block=False)] == [b"b"]
    newcomer.close()
    late.close()


# ---------------------------------------------------------------- bug 6: clock steps
def test_a_clock_step_does_not_make_live_processes_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    pid, start = process.me()
    import psutil._pslinux as pslinux
    real = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: real + 5.0)  # the wall clock stepped 5 s
    assert process.is_alive(pid, start)
    assert process.is_alive(os.getppid(), process.start_ticks(os.getppid()))
    assert not process.is_alive(pid, start - 1)  # the identity is exact


# ---------------------------------------------------------------- bug 7: a group create cut short
def _create_group_and_die(url: str) -> None:
    """The first stores of a group create, up to ACTIVE, then death inside the lock."""
    q = connect_shm(url).queue("q")
    ring, w = q.ring, q.ring.w
    ring.clock.acquire()
    g = ring.groups_w + 1 * L.G_WORDS
    free = w[L.Q_FREE_OFFSET]
    w[g + L.G_CURSOR] = free
    w[g + L.G_FLOOR] = free
    raw = b"late"
    w[g + L.G_NAME_LEN] = len(raw)
    ring.mm[(g + L.G_NAME) * 8:(g + L.G_NAME) * 8 + len(raw)] = raw
    w[g + L.G_SERIAL] = w[L.Q_GROUP_GEN] + 1
    w[g + L.G_STATE] = L.GS_ACTIVE  # and killed before the generation moves
    os._exit(0)


def test_a_group_created_half_way_holds_its_messages(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q", capacity=4)
    q.put_many([b"a", b"b", b"c", b"d"])
    q.get().ack()  # this process has computed the queue's active groups
    p = CTX.Process(target=_create_group_and_die, args=(shm_broker.url,))
    p.start()
    p.join()
    q.ack_many(q.get_many(3))  # must not free what "late" has not read
    q.put(b"e")
    with pytest.raises(shmq.Full):
        q.put(b"f", block=False)
    assert [m.payload for m in q.get_many(10, group="late")] == [b"b", b"c", b"d", b"e"]


# ---------------------------------------------------------------- bug 8: delivery-count ABA on a DLQ
def test_a_dead_letter_message_given_back_255_times_moves_to_the_tail(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("d", max_deliveries=1)
    q.put(b"poison")
    q.get().nack()  # to d.dlq
    dlq = shm_broker.queue("d.dlq")
    for i in range(1, 255):
        m = dlq.get(block=False)
        assert m.deliveries == i
        m.nack()
    last = dlq.get(block=False)
    assert last.deliveries == 255
    last.nack()  # a 256th delivery would not fit the count: the message moves instead
    moved = dlq.get(block=False)
    assert (moved.payload, moved.deliveries) == (b"poison", 1) and moved.offset != last.offset
    assert moved.origin is not None and moved.origin.queue == "d"
    with pytest.raises(shmq.StaleAck):
        last.ack()  # the old lease settles nothing
    moved.ack()
    assert dlq.stats()["retained"] == 0


# ---------------------------------------------------------------- bug 10: the smaller ones
def test_an_orphaned_dead_letter_copy_is_retried_without_a_server(clocked: ShmBroker,
                                                                  clock: FakeClock) -> None:
    q = clocked.create_queue("s", max_deliveries=1, visibility_timeout=1)
    dlq = clocked.create_queue("s.dlq", dead_letter=True, capacity=1)
    dlq.put(b"filler")
    q.put(b"x")
    q.get()
    clock.advance(2)
    with pytest.raises(shmq.Empty):
        q.get(block=False)  # expired, past max_deliveries, DLQ full: orphaned
    assert q.words[L.Q_ORPHANS] == 1
    dlq.get().ack()  # room
    clocked.reap()  # any co-located process's reaper retries it
    m = dlq.get(block=False)
    assert m.payload == b"x" and m.origin is not None and m.origin.reason.startswith("orphaned")
    m.ack()
    assert q.stats()["retained"] == 0


def test_a_wall_clock_is_refused_as_the_lease_clock(instance: str) -> None:
    with pytest.raises(shmq.InvalidArgument, match="time.monotonic"):
        ShmBroker(instance, clock=time.time)


def test_a_queue_segment_is_made_outside_the_registry_lock(shm_broker: ShmBroker,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from shmq.core.ring import Ring
    reg = shm_broker._att.registry
    seen: list[int] = []
    real = Ring.create.__func__  # type: ignore[attr-defined]

    second: list[type[BaseException]] = []

    def create(cls: type[Ring], *args: object, **kw: object) -> Ring:
        rc = trylock(reg.lock.address)  # the same thread: EBUSY while the lock is held
        if rc == 0:
            unlock(reg.lock.address)
        seen.append(rc)
        if not second:  # a second create of the same name while the first is being made
            try:
                shm_broker.create_queue("big")
            except BaseException as e:  # noqa: BLE001 - its type is the point
                second.append(type(e))
        return real(cls, *args, **kw)  # type: ignore[no-any-return]

    monkeypatch.setattr(Ring, "create", classmethod(create))
    shm_broker.create_queue("big")
    assert seen == [0] and seen != [EBUSY]
    assert second == [shmq.QueueExists]  # refused: the name is reserved while the segment is made
    assert [i.name for i in shm_broker.list_queues()] == ["big"]


def test_the_checker_sees_a_stranded_word(shm_broker: ShmBroker) -> None:
    """The checker would have caught bug 1: a READY word past the cursor."""
    from shmq.core.check import check_instance
    q = shm_broker.create_queue("q")
    q.put(b"x")
    ring = q.ring
    with ring.clock:
        ring.w[ring.slot_base(0) + L.S_GROUPS] = L.lease_word(L.READY, 1, L.NO_OWNER, 0)
    (v,) = check_instance(shm_broker.instance)
    assert "offset 0 past the cursor 0 is READY" in v
    with ring.clock:
        ring.w[ring.slot_base(0) + L.S_GROUPS] = L.NEW
    assert check_instance(shm_broker.instance) == []
    assert q.get(block=False).payload == b"x"  # NEW again: deliverable


def test_the_checker_sees_a_lease_with_no_delivery(shm_broker: ShmBroker) -> None:
    from shmq.core.check import check_instance
    q = shm_broker.create_queue("q", visibility_timeout=300)
    q.put(b"x")
    m = q.get(block=False)
    ring = q.ring
    assert check_instance(shm_broker.instance) == []
    with ring.clock:
        base = ring.slot_base(m.offset) + L.S_GROUPS
        word = ring.w[base]
        ring.w[base] = word & ~(L.DC_MASK << L.DC_SHIFT)  # the same lease, with 0 deliveries
    (v,) = check_instance(shm_broker.instance)
    assert "offset 0 is LEASED with 0 deliveries" in v
    with ring.clock:
        ring.w[base] = word
    assert check_instance(shm_broker.instance) == []
