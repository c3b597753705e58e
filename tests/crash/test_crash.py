"""Crash safety with real SIGKILLs: lock holders, writers mid-record, consumers with leases,
and a storm of kills over a multi-process run, then a Jepsen-style total-queue check."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import posix_ipc
import pytest

import shmq
from shmq import options, process
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.segment import instance_prefix, queue_segment_name, shm_path
from tests.support.connect import connect_shm
from tests.support.instances import objects, reg_path, unique_instance
from tests.support.wait import wait_until

pytestmark = pytest.mark.crash

CTX = mp.get_context("fork")


def _kill(p: mp.process.BaseProcess) -> None:
    os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
    p.join()


# ---------------------------------------------------------------- deterministic kills
def _hold_locks_then_hang(url: str, ready: Event) -> None:
    q = connect_shm(url).queue("q")
    q.ring.plock.acquire()
    q.ring.clock.acquire()
    ready.set()
    time.sleep(60)


def test_lock_holder_killed_inside_the_lock(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q")
    ready = CTX.Event()
    p = CTX.Process(target=_hold_locks_then_hang, args=(shm_broker.url, ready))
    p.start()
    assert ready.wait(10)
    _kill(p)
    q.put(b"after")  # would deadlock with a plain semaphore as the lock
    assert q.get(timeout=1).payload == b"after"
    assert q.stats()["lock_recoveries"] == 2


def _half_write_then_hang(url: str, ready: Event) -> None:
    q = connect_shm(url).queue("q")
    ring = q.ring
    w = ring.w
    ring.plock.acquire()
    off = w[L.Q_NEXT_OFFSET]
    base = ring.slot_base(off)
    pos = w[L.Q_TAIL_BYTES]
    start = ring.data_off + pos % ring.size
    ring.mm[start:start + 9] = b"GARBAGE!!"  # the record is written ...
    w[base + L.S_OFFSET] = off
    w[base + L.S_BYTEPOS] = pos
    w[base + L.S_LENS] = 9
    ready.set()  # ... but never published
    time.sleep(60)


def test_producer_killed_mid_write_publishes_nothing(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q")
    q.put(b"before")
    ready = CTX.Event()
    p = CTX.Process(target=_half_write_then_hang, args=(shm_broker.url, ready))
    p.start()
    assert ready.wait(10)
    _kill(p)
    assert q.put(b"after") == 1
    assert [m.payload for m in q.get_many(10)] == [b"before", b"after"]
    q.ring.check_invariants()


def _lease_without_cursor_then_hang(url: str, ready: Event) -> None:
    b = connect_shm(url)
    q = b.queue("q")
    slot = q._att.client_slot()
    ring = q.ring
    ring.clock.acquire()
    g = ring.groups_w
    cur = ring.w[g + L.G_CURSOR]
    word = L.lease_word(L.LEASED, 1, slot, time.monotonic_ns() // 10**6 + 60_000)
    ring.w[ring.slot_base(cur) + L.S_GROUPS] = word  # leased, but the cursor never moved
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("reap_first", [False, True], ids=["deliver-first", "reap-first"])
def test_consumer_killed_between_lease_and_cursor(shm_broker: ShmBroker, reap_first: bool) -> None:
    """The lease never reached anyone: the next holder of the consumer lock makes the word
    NEW again, whether a reaper or a delivery comes first (a reaper used to turn it READY
    above the cursor, where nothing delivers: the message was stranded for good)."""
    from shmq.core.check import check_instance
    q = shm_broker.create_queue("q", visibility_timeout=600)
    q.put_many([b"a", b"b"])
    ready = CTX.Event()
    p = CTX.Process(target=_lease_without_cursor_then_hang, args=(shm_broker.url, ready))
    p.start()
    assert ready.wait(10)
    _kill(p)
    if reap_first:
        shm_broker.reap()
    got = q.get_many(2, timeout=5)
    assert [(m.payload, m.deliveries) for m in got] == [(b"a", 1), (b"b", 1)]
    q.ack_many(got)
    assert q.stats()["groups"]["default"]["depth"] == 0
    assert check_instance(shm_broker.instance) == []


def _take_and_hang(url: str, n: int, ready: Event) -> None:
    q = shmq.connect(url).queue("q")
    q.get_many(n)
    ready.set()
    time.sleep(60)


def test_dead_consumers_leases_come_back_within_the_reap_interval(shm_broker: ShmBroker) -> None:
    """The README's bound: REAP_INTERVAL (0.25 s), for a consumer that waits meanwhile; the
    margin is a WAIT_SLICE (50 ms) for its next look, and scheduling on a loaded machine."""
    q = shm_broker.create_queue("q", visibility_timeout=300)
    q.put_many([f"{i}".encode() for i in range(5)])
    ready = CTX.Event()
    p = CTX.Process(target=_take_and_hang, args=(shm_broker.url, 5, ready))
    p.start()
    assert ready.wait(10)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    _kill(p)
    t0 = time.monotonic()
    got: list[shmq.Message] = []
    while len(got) < 5:
        got += q.get_many(5, timeout=2)
    took = time.monotonic() - t0
    print(f"leases back after {took:.3f} s")
    assert took < options.REAP_INTERVAL + options.WAIT_SLICE + 0.2, took
    assert sorted((m.payload, m.deliveries) for m in got) == [(f"{i}".encode(), 2) for i in range(5)]


def _take_and_exit(url: str) -> None:
    shmq.connect(url).queue("q").get()


def test_exiting_process_gives_its_leases_back_at_once(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q", visibility_timeout=300)
    q.put(b"x")
    p = CTX.Process(target=_take_and_exit, args=(shm_broker.url,))
    p.start()
    p.join()
    m = q.get(block=False)  # no reaper needed: the clean exit returned it
    assert (m.payload, m.deliveries) == (b"x", 2)


def _take_close_and_hang(url: str, ready: Event) -> None:
    b = shmq.connect(url)  # in a forked child, over the handle state inherited from the parent
    b.queue("q").get()
    b.close()
    ready.set()
    time.sleep(60)


def test_close_in_a_forked_child_gives_its_leases_back(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q", visibility_timeout=300)
    q.put(b"x")
    ready = CTX.Event()
    p = CTX.Process(target=_take_close_and_hang, args=(shm_broker.url, ready))
    p.start()
    assert ready.wait(10)
    m = q.get(block=False)  # the child is alive: only its close() can have returned this
    assert (m.payload, m.deliveries) == (b"x", 2)
    _kill(p)


# ---------------------------------------------------------------- the storm
@pytest.mark.slow
def test_sigkill_storm_loses_nothing_and_invents_nothing(instance: str, tmp_path: Path) -> None:
    """A short run of ``shmq.testing.chaos`` (``bench/chaos.py`` runs long ones): producers (plain and
    idempotent), consumers of two groups, a dead-letter queue's consumer, lock hogs and forced
    reapers are SIGKILLed at random (some also at armed crash points) and replaced, with one
    queue journaled by a ``shmq serve``; then every group is drained and each message's fate
    is checked against the processes' own logs, Jepsen style."""
    from shmq.testing.chaos import run_storm, summary

    r = run_storm(kills=150, seconds=20, seed=1234, instance=instance, journal=True,
                  log_dir=str(tmp_path), gap=(0.01, 0.1))
    print(summary(r))
    assert r.kills >= 50, f"only {r.kills} kills happened: {summary(r)}"
    assert not r.bad_exits, f"children exited other than by our SIGKILL: {r.bad_exits}"
    assert r.lost == {}, f"confirmed (or given back) messages were lost: {summary(r)}"
    assert r.unexpected == {}, f"messages that were never produced: {summary(r)}"
    assert r.stranded == {}, f"messages stranded after the drain: {summary(r)}"
    assert not r.corrupted and not r.doubled, summary(r)
    assert not r.stolen, f"leases taken from live consumers: {r.stolen[:10]}"
    assert r.checker and r.violations == [], f"invariants violated after the storm: {r.violations}"
    assert not r.problems, r.problems  # in flight, retained, the queues still work, /dev/shm clean
    assert r.lock_recoveries > 0, "no kill landed inside a lock"
    assert r.crash_deaths, "no child reached its armed crash point"
    assert r.confirmed > 1000 and r.dead_lettered > 0, summary(r)
    assert r.ok


# ---------------------------------------------------------------- stale shared memory
def _create_instance_and_hang(name: str, ready: Event) -> None:
    b = ShmBroker(name)
    b.create_queue("left").put(b"behind")
    ready.set()
    time.sleep(60)


def test_reclaim_takes_dead_instances_and_never_live_ones(shm_broker: ShmBroker) -> None:
    dead_name = unique_instance()
    ready = CTX.Event()
    p = CTX.Process(target=_create_instance_and_hang, args=(dead_name, ready))
    p.start()
    assert ready.wait(10)
    live = shm_broker.create_queue("keep")
    live.put(b"mine")
    # while its creator lives, the other instance is live too
    assert {r.instance: r.alive for r in shmq.scan()}[dead_name] is True
    assert shmq.reclaim(dead_name) == []
    _kill(p)
    foreign = Path(shm_path(instance_prefix(dead_name) + "notes"))  # not a name of ours: never touched
    foreign.write_bytes(b"someone else's")
    try:
        reports = shmq.reclaim(dead_name, dry_run=True)
        assert [r.instance for r in reports] == [dead_name] and not reports[0].alive
        assert os.path.exists(reg_path(dead_name))  # dry run
        shmq.reclaim(dead_name)
        assert not objects(dead_name)
        assert foreign.exists()
        assert shmq.reclaim(shm_broker.instance) == []  # the live one is left alone
        assert live.get(timeout=1).payload == b"mine"
    finally:
        foreign.unlink()


def test_pid_reuse_is_not_mistaken_for_life() -> None:
    pid, start = process.me()
    assert process.is_alive(pid, start)
    assert not process.is_alive(pid, start - 5000)  # same pid, another start time
    assert not process.is_alive(2**22 + 12345, start)


def test_leftover_segment_of_an_earlier_run_is_replaced(instance: str) -> None:
    stale = posix_ipc.SharedMemory(queue_segment_name(instance, 1), posix_ipc.O_CREX, size=4096)
    stale.close_fd()
    b = ShmBroker(instance)
    q = b.create_queue("fresh")  # gets id 1: the leftover is reclaimed, not an error
    q.put(b"ok")
    assert q.get().payload == b"ok"
    b.destroy()


def test_doctor_cli_lists_and_cleans(instance: str) -> None:
    from typer.testing import CliRunner

    from shmq.cli.app import app

    dead = unique_instance()
    ready = CTX.Event()
    p = CTX.Process(target=_create_instance_and_hang, args=(dead, ready))
    p.start()
    assert ready.wait(10)
    _kill(p)
    runner = CliRunner()
    out = runner.invoke(app, ["doctor", "--instance", dead, "--json"])
    assert out.exit_code == 0 and '"alive": false' in out.output
    out = runner.invoke(app, ["doctor", "--clean", "--instance", dead])
    assert out.exit_code == 0
    wait_until(lambda: not objects(dead), 2)


def _die_between_floor_and_free(url: str) -> None:
    """What advance_floor does for a lone group, killed between its two stores."""
    q = connect_shm(url).queue("floorfree")
    ring = q.ring
    w = ring.w
    ring.clock.acquire()
    for o in range(3):
        w[ring.slot_base(o) + L.S_GROUPS] = L.DONE
    w[ring.groups_w + L.G_FLOOR] = 3  # the floor moved; Q_FREE_OFFSET did not
    os._exit(0)  # dies holding the consumer lock


def test_consumer_killed_between_floor_and_free_offset(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("floorfree", capacity=3)
    q.put_many([b"a", b"b", b"c"])
    q.get_many(3, timeout=1)
    p = CTX.Process(target=_die_between_floor_and_free, args=(shm_broker.url,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    with pytest.raises(shmq.Empty):  # the next holder of the consumer lock repairs the free offset
        q.get(block=False)
    assert q.stats()["lock_recoveries"] == 1
    assert q.put(b"d", block=False) == 3  # room again: nothing leaked
