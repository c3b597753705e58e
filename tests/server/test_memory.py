"""A deleted queue's memory goes back to the kernel, in every process that mapped it.

Memory is measured, not files: the file of a deleted queue leaves /dev/shm at once, but
its pages stay for as long as any process maps them (or holds a descriptor of them).
So each test reads the processes' own maps (``/proc/PID/maps``, where such a mapping
reads ``(deleted)``), their resident shared memory (``RssShmem``) and their open
descriptors.  (The system's ``Shmem`` in ``/proc/meminfo`` says the same for the
whole host, but the suite runs tests in parallel, so it moves with theirs;
``bench/soak.py`` reads it.)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import urllib.request
from typing import Any

import pytest

import shmq
from shmq.core.colocated import ShmBroker
from shmq.server.placement import affinity_for
from tests.support.connect import connect_tcp
from tests.support.memory import fds, mapped, mapped_by, queue_ids
from tests.support.server import Server, broker_pids
from tests.support.wait import wait_until

CTX = mp.get_context("fork")
MB = 1 << 20
POLICIES = ("memory", "interval", "always")
# the maintenance tick of a broker's slowest process (the supervisor) is 0.25 s: a deleted
# queue's memory goes within it; the margin is for a loaded 2-core machine running tests
RELEASE_BOUND = 0.25 + 1.25


def rss_shmem_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no RssShmem")


def released_within(pids: list[int], instance: str, qid: int) -> float:
    """Seconds until no process of ``pids`` maps anything of queue ``qid`` (the delete
    having returned just before); fails past ``RELEASE_BOUND``."""
    t0 = time.monotonic()
    while held := mapped_by(pids, instance, qid):
        assert time.monotonic() - t0 < RELEASE_BOUND, f"still mapped after {RELEASE_BOUND} s: {held}"
        time.sleep(0.01)  # (polling other processes' maps)
    return time.monotonic() - t0


@pytest.mark.slow
def test_fifty_deleted_queues_leave_no_memory_in_any_broker_process() -> None:
    """50 create, fill, delete cycles of a 64 MiB queue, the durability modes in turn,
    with the supervisor, both workers, the journal and the metrics process all mapping it."""
    srv = Server(workers=2, extra=["--metrics", "127.0.0.1:0"])
    try:
        pids = broker_pids(srv)
        assert len(pids) == 5, "supervisor, 2 workers, journal, metrics"
        b = connect_tcp(srv.url, srv.token)
        # a connection on each worker: both map the queue, and only one of them deletes it
        w0, w1 = (connect_tcp(srv.url, srv.token, affinity=affinity_for(i, 2)) for i in range(2))
        assert (w0.worker, w1.worker) == (0, 1)
        base = {pid: (rss_shmem_mb(pid), fds(pid)) for pid in pids}
        payload = b"m" * (256 << 10)
        slowest = 0.0
        for i in range(50):
            before = queue_ids(srv.instance)
            q = b.create_queue("cycle", durability=POLICIES[i % 3], capacity=1024, max_bytes=64 * MB)
            (qid,) = queue_ids(srv.instance) - before
            for w in (w0, w1, w0, w1):  # 8 MiB, through both workers
                w.queue("cycle").put_many([payload] * 8)
            with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:  # the metrics process maps it
                assert b'queue="cycle"' in r.read()
            assert q.get(timeout=5).payload == payload
            assert mapped_by(pids, srv.instance, qid), "the broker's processes map a live queue"
            b.delete_queue("cycle")
            slowest = max(slowest, released_within(pids, srv.instance, qid))
        assert mapped_by(pids, srv.instance) == {}
        assert queue_ids(srv.instance) == set()
        for pid in pids:  # what each process holds resident of shared memory, and its fds
            shm, fd = base[pid]
            assert rss_shmem_mb(pid) <= shm + 1, (pid, rss_shmem_mb(pid), shm)
            assert fds(pid) <= fd + 2, (pid, fds(pid), fd)
        for h in (b, w0, w1):
            h.close()
        print(f"slowest release: {slowest:.3f} s")
    finally:
        assert srv.stop() == 0


def test_fifty_deleted_queues_leave_no_memory_in_the_deleting_process(instance: str) -> None:
    """Co-located: the handles and a message of every queue are kept alive by the test,
    and still the process maps nothing of a queue once it deleted it."""
    b = ShmBroker(instance)
    me = os.getpid()
    base_shm, base_fds = rss_shmem_mb(me), fds(me)
    kept: list[Any] = []
    try:
        for _ in range(50):
            before = queue_ids(instance)
            q = b.create_queue("cycle", capacity=1024, max_bytes=64 * MB)
            (qid,) = queue_ids(instance) - before
            q.put_many([b"c" * (256 << 10)] * 32)  # 8 MiB
            m = q.get()
            kept += [q, m]
            assert mapped_by([me], instance, qid)
            b.delete_queue("cycle")
            assert mapped_by([me], instance, qid) == {}, "let go of at once, by the deleting process"
            with pytest.raises(shmq.QueueNotFound):
                q.put(b"after")
            with pytest.raises(shmq.QueueNotFound):
                m.ack()
            assert fds(me) <= base_fds + 1
        assert rss_shmem_mb(me) <= base_shm + 1
        for q in kept[::2]:  # every kept handle answers as a deleted queue's should
            with pytest.raises(shmq.QueueNotFound):
                q.get(block=False)
            with pytest.raises(shmq.QueueNotFound):
                q.stats()
    finally:
        b.destroy()
    assert mapped(me, instance) == set()
    assert fds(me) <= base_fds


def _hold_then_call(url: str, ready: Any, go: Any, out: Any) -> None:
    q = shmq.connect(url).queue("held")
    q.put(b"x")
    ready.set()
    go.wait(30)
    try:
        q.put(b"y")
        out.put(("put", "succeeded"))
    except shmq.QueueNotFound:
        out.put(("put", "QueueNotFound"))
    out.put(("mapped", sorted(mapped(os.getpid(), url[len("shm://"):]))))


def test_a_process_holding_a_deleted_queue_lets_go_at_its_next_call(shm_broker: ShmBroker) -> None:
    shm_broker.create_queue("held", max_bytes=8 * MB)
    ready, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    p = CTX.Process(target=_hold_then_call, args=(shm_broker.url, ready, go, out))
    p.start()
    assert p.pid is not None
    try:
        assert ready.wait(30)
        assert mapped_by([p.pid], shm_broker.instance), "the other process maps the queue"
        shm_broker.delete_queue("held")
        go.set()
        assert out.get(timeout=30) == ("put", "QueueNotFound")
        assert out.get(timeout=30) == ("mapped", [])
    finally:
        p.join(30)
    assert p.exitcode == 0


def test_a_consumer_blocked_in_get_gets_queue_not_found_and_lets_go(shm_broker: ShmBroker) -> None:
    """A thread asleep on the queue's semaphore when another thread deletes it: it wakes
    with QueueNotFound, and the semaphores go once it is out of its sleep."""
    q = shm_broker.create_queue("blocked", max_bytes=8 * MB)
    ended: list[str] = []

    def consume() -> None:
        try:
            q.get(timeout=30)
            ended.append("message")
        except shmq.QueueNotFound:
            ended.append("QueueNotFound")

    t = threading.Thread(target=consume)
    t.start()
    wait_until(lambda: q._sleepers == 1)  # asleep on the not-empty semaphore
    shm_broker.delete_queue("blocked")
    t.join(10)
    assert ended == ["QueueNotFound"]
    assert mapped(os.getpid(), shm_broker.instance) == set()


def test_a_tcp_consumer_blocked_in_get_and_a_subscription_end_with_the_queue() -> None:
    srv = Server(workers=2)
    try:
        pids = broker_pids(srv)
        admin = connect_tcp(srv.url, srv.token)
        q = admin.create_queue("waited", max_bytes=16 * MB)
        q.put(b"first")
        sub_b = connect_tcp(srv.url, srv.token)
        sub = sub_b.queue("waited").subscribe(group="sub", credit=4)
        assert next(sub).payload == b"first"
        get_b = connect_tcp(srv.url, srv.token)
        gq = get_b.queue("waited")
        gq.create_group("late", start="latest")
        ended: list[str] = []

        def blocked_get() -> None:
            try:
                gq.get(group="late", timeout=30)
                ended.append("message")
            except shmq.QueueNotFound:
                ended.append("QueueNotFound")

        t = threading.Thread(target=blocked_get)
        t.start()
        (qid,) = queue_ids(srv.instance)
        wait_until(lambda: len(mapped_by(pids, srv.instance, qid)) >= 3)  # both workers and the supervisor
        admin.delete_queue("waited")
        t.join(10)
        assert ended == ["QueueNotFound"]
        with pytest.raises(shmq.QueueNotFound):
            next(sub)
        released_within(pids, srv.instance, qid)
        for h in (sub_b, get_b, admin):
            h.close()
    finally:
        assert srv.stop() == 0


def test_a_queue_and_its_dead_letter_queue_are_both_let_go_of() -> None:
    srv = Server(workers=2)
    try:
        pids = broker_pids(srv)
        b = connect_tcp(srv.url, srv.token)
        for i in range(3):
            q = b.create_queue("poison", durability=POLICIES[i], max_bytes=16 * MB)
            q.put(b"bad")
            q.get(timeout=5).dead_letter()
            assert b.queue("poison.dlq").get(timeout=5).payload == b"bad"
            ids = queue_ids(srv.instance)
            assert len(ids) == 2
            b.delete_queue("poison")
            b.delete_queue("poison.dlq")
            for qid in ids:
                released_within(pids, srv.instance, qid)
        assert mapped_by(pids, srv.instance) == {}
        b.close()
    finally:
        assert srv.stop() == 0


def test_a_thread_holding_a_lock_of_the_deleted_queue_defers_the_letting_go(shm_broker: ShmBroker) -> None:
    """The memory under a lock that a thread of ours holds (or waits for) is never let go
    of: a held robust mutex is on its thread's robust list.  The delete leaves it to the
    next call, once the lock is free."""
    q = shm_broker.create_queue("locked", max_bytes=8 * MB)
    held, free = threading.Event(), threading.Event()

    def hold() -> None:
        with q.ring.clock:
            held.set()
            free.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    (qid,) = queue_ids(shm_broker.instance)
    shm_broker.delete_queue("locked")
    assert mapped_by([os.getpid()], shm_broker.instance, qid), "kept while a thread holds its lock"
    with pytest.raises(shmq.QueueNotFound):
        q.put(b"x")
    free.set()
    t.join(10)
    with pytest.raises(shmq.QueueNotFound):
        shm_broker.queue("locked")  # any call on the broker handle lets go of what is due
    assert mapped_by([os.getpid()], shm_broker.instance, qid) == {}


def test_a_closed_broker_handle_lets_go_of_every_mapping(instance: str) -> None:
    keep, b = ShmBroker(instance), ShmBroker(instance)
    q = keep.create_queue("kept", max_bytes=8 * MB)
    q.put(b"x")
    other = ShmBroker(instance)
    assert other._att is b._att and other._att is keep._att  # one attachment per process
    try:
        keep.close()
        other.close()
        assert mapped(os.getpid(), instance), "another handle still uses the attachment"
        b.close()
        assert mapped(os.getpid(), instance) == set()
        with pytest.raises(shmq.InstanceError, match="closed"):
            q.put(b"y")
        b2 = ShmBroker(instance)  # attaching again sees the queue whole
        assert b2.queue("kept").get(block=False).payload == b"x"
        b2.close()
    finally:
        ShmBroker(instance).destroy()
