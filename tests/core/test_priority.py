"""Priority queues (``create_queue(priorities=N)``, ``put(priority=p)``): the highest
priority ready goes first, FIFO within one, and a level keeps every guarantee of a queue
(leases, redelivery, groups, DLQ, delay).  Each test runs over ``shm://`` and ``tcp://``
(the ``broker`` fixture), and checks every message's fate."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import shmq
from shmq import options
from shmq.core import check
from shmq.protocol.codec import FrameDecoder
from shmq.protocol.commands import put, put_many
from shmq.protocol.produce import PRIORITY_FLAG, split_priority
from shmq.server.parking import decode_produce
from tests.support.vectors import NamedQueue, doc_vectors

SHIFT = options.PRIORITY_SHIFT


def _drain(q: Any, group: str = options.DEFAULT_GROUP) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    while True:
        try:
            m = q.get(False, group=group)
        except shmq.Empty:
            return out
        out.append((m.text, m.priority))
        m.ack()


def test_the_highest_priority_ready_goes_first_fifo_within_one(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=4)
    puts = [(f"m{i}", p) for i, p in enumerate([0, 3, 1, 3, 0, 2, 1, 2, 0, 3])]
    offsets = {q.put(text, priority=p): (text, p) for text, p in puts}
    assert len(offsets) == len(puts)  # offsets are unique over the levels
    assert all(off >> SHIFT == p for off, (_, p) in offsets.items())
    want = sorted(puts, key=lambda tp: (-tp[1], int(tp[0][1:])))
    assert _drain(q) == want
    assert q.stats()["retained"] == 0


def test_a_batch_goes_to_one_level_and_get_many_takes_the_levels_in_order(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=3)
    q.put_many([b"low-a", b"low-b"])
    offs = q.put_many([b"hi-a", b"hi-b", b"hi-c"], priority=2)
    assert [o >> SHIFT for o in offs] == [2, 2, 2]
    assert [o & ((1 << SHIFT) - 1) for o in offs] == [0, 1, 2]
    got = q.get_many(4)
    assert [(m.text, m.priority) for m in got] == [("hi-a", 2), ("hi-b", 2), ("hi-c", 2), ("low-a", 0)]
    q.ack_many(got)  # (leases of two levels at once)
    assert _drain(q) == [("low-b", 0)]


def test_priorities_are_checked(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=3)
    for bad in (3, -1, 10, True, 1.0):
        with pytest.raises(shmq.InvalidArgument):
            q.put(b"x", priority=bad)
    with pytest.raises(TypeError):
        q.get("billing")  # the group is a keyword, as on every queue
    plain = broker.create_queue("plain")
    with pytest.raises(shmq.InvalidArgument, match="no priorities"):
        plain.put(b"x", priority=1)
    with pytest.raises(shmq.InvalidArgument, match="priorities"):
        broker.create_queue("many", priorities=options.MAX_PRIORITIES + 1)
    with pytest.raises(shmq.InvalidName):
        broker.create_queue("sneaky.prio1")
    assert [(i.name, i.config.priorities) for i in broker.list_queues()] == [("jobs", 3), ("plain", 0)]
    assert _drain(q) == [] and _drain(plain) == []  # nothing was stored by the errors


def test_a_nack_redelivers_within_its_level_before_lower_ones(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=2, max_deliveries=2)
    q.put(b"low")
    q.put(b"high", priority=1)
    m = q.get(timeout=5)
    assert (m.text, m.priority, m.deliveries) == ("high", 1, 1)
    m.nack()
    m = q.get(timeout=5)
    assert (m.text, m.deliveries, m.redelivered) == ("high", 2, True)
    m.nack()  # its second delivery: to the DLQ, with its origin in its own level
    d = broker.queue("jobs.dlq").get(timeout=5)
    assert d.text == "high" and d.origin.queue == "jobs" and d.origin.offset >> SHIFT == 1
    d.ack()
    with pytest.raises(shmq.StaleAck):
        m.ack()
    assert _drain(q) == [("low", 0)]


def test_every_group_sees_every_message_in_priority_order(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=3)
    q.create_group("audit")
    for p in (0, 2, 1):
        q.put(f"p{p}", priority=p)
    want = [("p2", 2), ("p1", 1), ("p0", 0)]
    assert _drain(q, "audit") == want
    assert _drain(q) == want
    assert sorted(q.groups()) == ["audit", options.DEFAULT_GROUP]


def test_a_lease_of_a_group_deleted_and_made_again_is_stale_on_every_level(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=3)
    q.create_group("g")
    q.put(b"hi", priority=2)
    old = q.get(timeout=5, group="g")
    q.delete_group("g")
    q.create_group("g")  # (at the earliest: "hi" is the new group's, a first delivery)
    with pytest.raises(shmq.StaleAck):
        old.ack()
    new = q.get(timeout=5, group="g")
    assert (new.text, new.priority, new.deliveries) == ("hi", 2, 1)
    new.ack()
    assert _drain(q, "g") == [] and _drain(q) == [("hi", 2)]


def test_a_delayed_high_message_waits_and_then_goes_first(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=2)
    q.put(b"high-later", priority=1, delay=0.3)
    q.put(b"low-now")
    m = q.get(timeout=5)
    assert m.text == "low-now"  # the high one is not due yet
    m.ack()
    q.put(b"low-after")
    time.sleep(0.35)  # (the delay itself is what is tested: it must have run out)
    assert _drain(q) == [("high-later", 1), ("low-after", 0)]


def test_a_waiting_consumer_is_woken_by_a_put_at_any_level(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=5)
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=30)))
    t.start()
    deadline = time.monotonic() + 10
    while not _waiting(broker, q) and time.monotonic() < deadline:
        time.sleep(0.005)
    q.put(b"wake", priority=3)
    t.join(30)
    assert got and got[0].text == "wake" and got[0].priority == 3
    got[0].ack()


def test_a_put_at_any_level_posts_level_0s_semaphore_for_its_waiters(shm_broker: Any) -> None:
    q = shm_broker.create_queue("jobs", priorities=3)
    base = q.base
    with base.ring.clock:
        base.words[shmq.core.layout.Q_CONSUMER_WAITERS] += 1  # one consumer asleep on the queue
    try:
        assert base._ne.value == 0
        q.put(b"x", priority=2)
        assert base._ne.value == 1  # it is woken (a hint: a sleep ends after WAIT_SLICE anyway)
        q.put(b"y", priority=1)
        assert base._ne.value == 1  # never past the number of sleepers
    finally:
        with base.ring.clock:
            base.words[shmq.core.layout.Q_CONSUMER_WAITERS] -= 1
    assert _drain(q) == [("x", 2), ("y", 1)]


def _waiting(broker: Any, q: Any) -> bool:
    """Is the consumer of the test above asleep (announced on level 0) yet?  Over TCP the
    get is parked in the broker: a put finds it either way, so any moment will do."""
    if isinstance(q, shmq.core.priority.PriorityQueue):
        return bool(q.base.words[shmq.core.layout.Q_CONSUMER_WAITERS])
    return True


def test_read_commit_and_purge_go_by_level(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=3)
    q.put(b"a0")
    q.put(b"b0")
    first2 = q.put(b"a2", priority=2)
    q.put(b"b2", priority=2)
    assert [m.text for m in q.read(first2, 10)] == ["a2", "b2"]
    assert [m.offset for m in q.read(first2, 10)] == [first2, first2 + 1]
    assert [m.text for m in q.read(0, 10)] == ["a0", "b0"]
    q.commit(options.DEFAULT_GROUP, first2 + 1)  # a2 settled for the default group, b2 not
    assert _drain(q) == [("b2", 2), ("a0", 0), ("b0", 0)]
    q.put(b"c1", priority=1)
    assert q.purge() == 1
    assert _drain(q) == []


def test_delete_takes_every_level_and_a_new_queue_starts_empty(broker: Any) -> None:
    q = broker.create_queue("jobs", priorities=3)
    q.put(b"x", priority=2)
    broker.delete_queue("jobs")
    assert broker.list_queues() == []
    with pytest.raises(shmq.QueueNotFound):
        broker.queue("jobs")
    q = broker.create_queue("jobs", priorities=3)
    assert _drain(q) == []


def test_levels_are_hidden_queues(shm_broker: Any, instance: str) -> None:
    q = shm_broker.create_queue("jobs", priorities=3)
    with pytest.raises(shmq.QueueNotFound, match="level 2 of priority queue 'jobs'"):
        shm_broker.queue("jobs.prio2")
    assert [i.name for i in shm_broker.list_queues()] == ["jobs"]
    assert shm_broker.registry.find("jobs.prio2") is not None
    # a creator killed halfway left a level missing: the next use makes it again, empty
    shm_broker._att.delete_queue("jobs.prio1")
    again = shm_broker.queue("jobs")
    again.put(b"back", priority=1)
    assert _drain(again) == [("back", 1)]
    assert q.priorities == 3


_HOLDER = """
import os, sys, shmq
q = shmq.connect(sys.argv[1]).queue("jobs")
m = q.get(timeout=30)
print(m.text, m.priority, flush=True)
os.kill(os.getpid(), 9)  # holding the lease
"""


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_killed_consumer_gives_its_high_message_back_at_once(transport: str, instance: str,
                                                               request: pytest.FixtureRequest) -> None:
    url = f"shm://{instance}" if transport == "shm" else request.getfixturevalue("server").url
    b: Any = shmq.connect(url)
    try:
        q = b.create_queue("jobs", priorities=3, visibility_timeout=600)
        q.put(b"low")
        q.put(b"high", priority=2)
        p = subprocess.run([sys.executable, "-c", _HOLDER, url], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SHMQ_TOKEN": os.environ.get("SHMQ_TOKEN", "")})
        assert p.returncode == -signal.SIGKILL and p.stdout.split() == ["high", "2"]
        if transport == "shm":
            b.reap()  # (a co-located consumer's death is found by the next reap; over TCP at once)
        m = q.get(timeout=10)  # long before the 600 s visibility timeout
        assert (m.text, m.priority, m.deliveries) == ("high", 2, 2)
        m.ack()
        assert _drain(q) == [("low", 0)]
    finally:
        b.delete_queue("jobs") if "jobs" in [i.name for i in b.list_queues()] else None
        if transport == "shm":
            b.destroy()
        else:
            b.close()


# ---------------------------------------------------------------- the wire
def test_the_documented_priority_frames_are_what_clients_send_and_the_broker_reads() -> None:
    docs = doc_vectors("priority")
    assert sorted(docs) == ["produce_batch_priority", "produce_priority_delay"]
    sent = {"produce_priority_delay": (24, put(NamedQueue("orders"), b"hi", False, None, None, 1.5, None, 3)),  # type: ignore[arg-type]
            "produce_batch_priority": (25, put_many(NamedQueue("q"), [b"a", b"bc"], False, None, None, None,  # type: ignore[arg-type]
                                                    priority=9))}
    for name, (msg_id, req) in sent.items():
        assert req.encode(msg_id, *req.args) == docs[name], name  # type: ignore[union-attr]
    read = {name: FrameDecoder().feed(raw)[0] for name, raw in docs.items()}
    one = decode_produce(read["produce_priority_delay"])
    assert (one["priority"], one["delay_ms"], one["ttl_ms"], one["payload"]) == (3, 1500, 0, b"hi")
    batch = decode_produce(read["produce_batch_priority"])
    assert (batch["priority"], batch["payloads"]) == (9, [b"a", b"bc"])


@pytest.mark.parametrize("body", ["", "00", "0a"])
def test_the_broker_refuses_a_bad_priority_prefix(body: str) -> None:
    raw = bytes.fromhex(body) + bytes.fromhex("0006 6f7264657273 00000000 6869".replace(" ", ""))
    with pytest.raises(shmq.InvalidArgument):
        split_priority(PRIORITY_FLAG, raw if body else b"")


def test_a_bad_priority_frame_gets_an_error_and_stores_nothing(server: Any) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue(f"prio-bad-{os.getpid()}", priorities=2)
        plain = b.create_queue(f"plain-bad-{os.getpid()}")
        try:
            with pytest.raises(shmq.InvalidArgument, match="priority must be an int in 0..1"):
                q.put(b"x", priority=2)  # (the client lets 1..9 go: the broker knows the levels)
            with pytest.raises(shmq.InvalidArgument, match="no priorities"):
                plain.put_many([b"x", b"y"], priority=1)
            q.put(b"fine", priority=1)  # the connection goes on
            assert _drain(q) == [("fine", 1)] and _drain(plain) == []
            assert q.stats()["produced"] == 1 and plain.stats()["produced"] == 0
        finally:
            b.delete_queue(q.name)
            b.delete_queue(plain.name)


# ---------------------------------------------------------------- a level keeps a queue's guarantees
def test_a_high_message_past_its_ttl_is_dead_lettered_and_a_younger_low_one_delivered(
        clocked: Any, clock: Any) -> None:
    q = clocked.create_queue("jobs", priorities=3, message_ttl=10)
    q.put(b"old-high", priority=2, headers={"k": "v"})
    clock.advance(9.999)
    q.put(b"young-low")
    clock.advance(0.001)  # "old-high" is 10 s old: expired, though it was the highest
    assert _drain(q) == [("young-low", 0)]
    d = clocked.queue("jobs.dlq").get(False)
    assert (d.text, d.headers, d.origin.reason, d.origin.offset) == ("old-high", {"k": b"v"}, "ttl_expired",
                                                                      2 << SHIFT)
    d.ack()
    assert check.check_instance(clocked.instance) == []  # every level passes the checker


def test_a_journaled_priority_queue_comes_back_whole_after_kill9_and_lost_memory(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("keep", durability="always", priorities=3)
        q.put_many([b"l0", b"l1", b"l2"])
        q.put_many([b"h0", b"h1"], priority=2)
        q.put(b"m0", priority=1)
        q.create_group("audit")
        got = q.get_many(2, timeout=1)
        assert [(m.text, m.priority) for m in got] == [("h0", 2), ("h1", 2)]
        got[0].ack()  # h0 acknowledged; h1 leased, never settled
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("keep")
        assert sorted(q.groups()) == ["audit", "default"]
        again = q.get_many(100, timeout=1)
        assert [(m.text, m.priority, m.deliveries) for m in again] == [
            ("h1", 2, 2), ("m0", 1, 1), ("l0", 0, 1), ("l1", 0, 1), ("l2", 0, 1)]  # h0 never again
        q.ack_many(again)
        assert [m.text for m in q.get_many(100, group="audit", timeout=1)] == ["h0", "h1", "m0", "l0", "l1",
                                                                                "l2"]
        assert q.put(b"next", priority=2) == 2 << SHIFT | 2  # the level's offsets go on, never reused


_MAKER = """
import sys, shmq
b = shmq.connect(sys.argv[1])
if sys.argv[2] == "create":
    b.create_queue("jobs", priorities=3, capacity=64, max_bytes=1 << 16)
else:
    b.delete_queue("jobs")
"""


@pytest.mark.parametrize(("what", "point"), [("create", "queue.create.published:2"),
                                              ("delete", "queue.delete.unlisted:1")])
def test_a_creator_or_deleter_killed_between_levels_leaves_a_queue_that_works(
        what: str, point: str, shm_broker: Any, instance: str) -> None:
    url = f"shm://{instance}"
    if what == "delete":
        q = shm_broker.create_queue("jobs", priorities=3, capacity=64, max_bytes=1 << 16)
        q.put(b"low")
    p = subprocess.run([sys.executable, "-c", _MAKER, url, what], capture_output=True, timeout=60,
                       env={**os.environ, "SHMQ_CRASH_POINT": point})
    assert p.returncode == -signal.SIGKILL, p.stderr
    names = {e.name for e in shm_broker.registry.queues()}
    assert names == {"jobs", "jobs.prio1"}  # killed with level 2 made (create) or gone (delete)
    assert [i.name for i in shm_broker.list_queues()] == ["jobs"]
    q = shm_broker.queue("jobs")  # the missing level is made again, empty
    q.put(b"top", priority=2)
    want = [("top", 2)] + ([("low", 0)] if what == "delete" else [])
    assert _drain(q) == want
    assert check.check_instance(instance) == []
    shm_broker.delete_queue("jobs")
    assert {e.name for e in shm_broker.registry.queues()} == set()
