"""Crash safety with real SIGKILLs: lock holders, writers mid-record, consumers with leases,
and a storm of kills over a multi-process run, then a Jepsen-style total-queue check."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import posix_ipc
import pytest

import shmq
from shmq import layout as L
from shmq import process
from shmq.shm import ShmBroker

from .conftest import unique_instance, wait_until

CTX = mp.get_context("fork")


def _kill(p: mp.process.BaseProcess) -> None:
    os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
    p.join()


# ---------------------------------------------------------------- deterministic kills
def _hold_locks_then_hang(url: str, ready: mp.Event) -> None:  # type: ignore[type-arg]
    q = shmq.connect(url).queue("q")
    q._ring.plock.acquire()
    q._ring.clock.acquire()
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


def _half_write_then_hang(url: str, ready: mp.Event) -> None:  # type: ignore[type-arg]
    q = shmq.connect(url).queue("q")
    ring = q._ring
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
    q._ring.check_invariants()


def _lease_without_cursor_then_hang(url: str, ready: mp.Event) -> None:  # type: ignore[type-arg]
    b = shmq.connect(url)
    q = b.queue("q")
    slot = q._att.client_slot()
    ring = q._ring
    ring.clock.acquire()
    g = ring.groups_w
    cur = ring.w[g + L.G_CURSOR]
    word = L.lease_word(L.LEASED, 1, slot, time.monotonic_ns() // 10**6 + 60_000)
    ring.w[ring.slot_base(cur) + L.S_GROUPS] = word  # leased, but the cursor never moved
    ready.set()
    time.sleep(60)


def test_consumer_killed_between_lease_and_cursor(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q", visibility_timeout=600)
    q.put_many([b"a", b"b"])
    ready = CTX.Event()
    p = CTX.Process(target=_lease_without_cursor_then_hang, args=(shm_broker.url, ready))
    p.start()
    assert ready.wait(10)
    _kill(p)
    first = q.get(timeout=5)
    assert (first.payload, first.deliveries) == (b"b", 1)  # the half-taken one is stepped over
    again = q.get(timeout=5)  # and given back because its owner is dead, long before 600 s
    assert (again.payload, again.deliveries) == (b"a", 2)
    q.ack_many([first, again])
    q._ring.check_invariants()


def _take_and_hang(url: str, n: int, ready: mp.Event) -> None:  # type: ignore[type-arg]
    q = shmq.connect(url).queue("q")
    q.get_many(n)
    ready.set()
    time.sleep(60)


def test_dead_consumers_leases_come_back_within_a_second(shm_broker: ShmBroker) -> None:
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
    got = []
    while len(got) < 5:
        got += q.get_many(5, timeout=2)
    assert time.monotonic() - t0 < 1.5
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


def _take_close_and_hang(url: str, ready: mp.Event) -> None:  # type: ignore[type-arg]
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
def _storm_producer(url: str, pid_tag: int, log_dir: str, start: int, n: int) -> None:
    q = shmq.connect(url).queue("storm")
    with open(f"{log_dir}/p{pid_tag}.log", "a", buffering=1) as log:
        for i in range(start, start + n):
            ident = f"{pid_tag}.{i}"
            log.write(f"A {ident}\n")
            q.put(f"{ident}|{ident}".encode())  # the payload repeats the id: corruption shows
            log.write(f"C {ident}\n")


def _storm_consumer(url: str, tag: int, log_dir: str) -> None:
    q = shmq.connect(url).queue("storm")
    rnd = random.Random(tag)
    with open(f"{log_dir}/c{tag}.log", "a", buffering=1) as log:
        while True:
            try:
                msgs = q.get_many(rnd.choice([1, 1, 5, 20]), timeout=0.5)
            except shmq.Empty:
                continue
            for m in msgs:
                log.write(f"G {m.payload.decode()}\n")
            if rnd.random() < 0.1 and msgs:
                msgs[0].nack()
                msgs = msgs[1:]
            if len(msgs) > 1:
                q.ack_many(msgs)
            elif msgs:
                msgs[0].ack()
            for m in msgs:
                log.write(f"K {m.payload.decode()}\n")


def _storm_lock_hog(url: str) -> None:
    """Holds the queue's locks much of the time, so that kills land inside them."""
    q = shmq.connect(url).queue("storm")
    ring = q._ring
    while True:
        lock = ring.plock if random.random() < 0.5 else ring.clock
        lock.acquire()
        time.sleep(random.uniform(0, 0.002))
        lock.release()
        time.sleep(random.uniform(0, 0.001))


def _read_logs(log_dir: Path) -> dict[str, set[str]]:
    sets: dict[str, set[str]] = {k: set() for k in "ACGK"}
    for f in log_dir.iterdir():
        for line in f.read_text().splitlines():
            parts = line.split(" ", 1)
            if len(parts) == 2 and parts[0] in sets:
                sets[parts[0]].add(parts[1])
    return sets


def test_sigkill_storm_loses_nothing_and_invents_nothing(instance: str, tmp_path: Path) -> None:
    b = ShmBroker(instance)
    q = b.create_queue("storm", capacity=512, max_bytes=64 * 1024, visibility_timeout=30,
                       max_deliveries=255)
    rnd = random.Random(1234)
    producers: dict[int, mp.process.BaseProcess] = {}
    consumers: dict[int, mp.process.BaseProcess] = {}
    next_tag = 0
    kills = 0
    per_producer = 2000

    def spawn_producer() -> None:
        nonlocal next_tag
        next_tag += 1
        p = CTX.Process(target=_storm_producer, args=(b.url, next_tag, str(tmp_path), 0, per_producer))
        p.start()
        producers[next_tag] = p

    def spawn_consumer() -> None:
        nonlocal next_tag
        next_tag += 1
        p = CTX.Process(target=_storm_consumer, args=(b.url, next_tag, str(tmp_path)))
        p.start()
        consumers[next_tag] = p

    def spawn_hog() -> None:
        nonlocal next_tag
        next_tag += 1
        p = CTX.Process(target=_storm_lock_hog, args=(b.url,))
        p.start()
        hogs[next_tag] = p

    hogs: dict[int, mp.process.BaseProcess] = {}
    spawners = {id(producers): spawn_producer, id(consumers): spawn_consumer, id(hogs): spawn_hog}
    for _ in range(3):
        spawn_producer()
        spawn_consumer()
    spawn_hog()
    deadline = time.monotonic() + 25
    while kills < 200 and time.monotonic() < deadline:
        time.sleep(rnd.uniform(0.002, 0.03))
        pool = rnd.choice([producers, consumers, hogs])
        tag = rnd.choice(list(pool))
        proc = pool.pop(tag)
        if proc.is_alive():
            _kill(proc)
            kills += 1
        else:
            proc.join()
        spawners[id(pool)]()
    for p in hogs.values():
        _kill(p)
    finish = time.monotonic() + 60
    for p in producers.values():  # let the last producers finish their runs
        p.join(max(0.1, finish - time.monotonic()))
    stuck = [p.pid for p in producers.values() if p.is_alive()]
    for p in [*consumers.values(), *producers.values()]:
        if p.is_alive():
            _kill(p)
    assert not stuck, f"producers {stuck} could not finish: {q.stats()}"
    assert kills >= 100, f"only {kills} kills happened"

    # drain: every dead consumer's leases must come back (reaper), nothing may be stuck
    drained: list[str] = []
    while True:
        try:
            msgs = q.get_many(100, timeout=1.5)
        except shmq.Empty:
            break
        drained += [m.payload.decode() for m in msgs]
        q.ack_many(msgs)

    logs = _read_logs(tmp_path)
    logs_count = sum(f.read_text().count("\nG ") for f in tmp_path.iterdir())
    for payload in drained + list(logs["G"]):
        ident, copy = payload.split("|")
        assert ident == copy, f"corrupted payload {payload!r}"
    # delivered: received by some consumer (logged before its ack) or drained at the end.
    # A consumer killed after its ack but before its log line still logged the receipt.
    delivered = {p.split("|")[0] for p in drained} | {p.split("|")[0] for p in logs["G"]}
    lost = logs["C"] - delivered
    unexpected = delivered - logs["A"]
    duplicates = len(drained) + logs_count - len(delivered)
    stats = q.stats()
    print(f"kills={kills} attempted={len(logs['A'])} confirmed={len(logs['C'])} "
          f"delivered={len(delivered)} duplicates~{duplicates} lock_recoveries={stats['lock_recoveries']}")
    assert not lost, f"{len(lost)} confirmed messages were lost: {sorted(lost)[:10]}"
    assert not unexpected, f"messages that were never produced: {sorted(unexpected)[:10]}"
    assert stats["retained"] == 0 and stats["groups"]["default"]["in_flight"] == 0
    assert stats["lock_recoveries"] > 0, "no kill landed inside a lock"
    q._ring.check_invariants()
    q.put(b"still works")  # and the queue still works
    assert q.get(timeout=1).payload == b"still works"
    b.destroy()


# ---------------------------------------------------------------- stale shared memory
def _create_instance_and_hang(name: str, ready: mp.Event) -> None:  # type: ignore[type-arg]
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
    foreign = Path(f"/dev/shm/shmq.{dead_name}.notes")  # not a name of ours: never touched
    foreign.write_bytes(b"someone else's")
    try:
        reports = shmq.reclaim(dead_name, dry_run=True)
        assert [r.instance for r in reports] == [dead_name] and not reports[0].alive
        assert os.path.exists(f"/dev/shm/shmq.{dead_name}.reg")  # dry run
        shmq.reclaim(dead_name)
        assert not [n for n in os.listdir("/dev/shm") if f"shmq.{dead_name}." in n
                    and not n.endswith(".notes")]
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
    stale = posix_ipc.SharedMemory(f"/shmq.{instance}.q1", posix_ipc.O_CREX, size=4096)
    stale.close_fd()
    b = ShmBroker(instance)
    q = b.create_queue("fresh")  # gets id 1: the leftover is reclaimed, not an error
    q.put(b"ok")
    assert q.get().payload == b"ok"
    b.destroy()


def test_doctor_cli_lists_and_cleans(instance: str) -> None:
    from typer.testing import CliRunner

    from shmq.cli import app

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
    wait_until(lambda: not [n for n in os.listdir("/dev/shm") if f"shmq.{dead}." in n], 2)


def _die_between_floor_and_free(url: str) -> None:
    """What advance_floor does for a lone group, killed between its two stores."""
    q = shmq.connect(url).queue("floorfree")
    ring = q._ring
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
