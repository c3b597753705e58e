"""The queue's behaviour through the public API: the seed projects' scenarios and the error paths."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext

import pytest

import shmq
from shmq import options
from shmq.core.colocated import ShmBroker
from shmq.core.doorbell import Bell
from shmq.core.serverqueue import ServerQueue
from tests.support.clock import FakeClock
from tests.support.instances import objects

CTX = mp.get_context("fork")


# ---------------------------------------------------------------- helpers run in child processes
def _produce(url: str, queue: str, tag: int, n: int) -> None:
    q = shmq.connect(url).queue(queue)
    for i in range(n):
        q.put(f"{tag}:{i}".encode())


def _consume(url: str, queue: str, group: str, n_total: int, out: mp.Queue) -> None:
    q = shmq.connect(url).queue(queue)
    got = []
    while True:
        try:
            m = q.get(group=group, timeout=0.5)
        except shmq.Empty:
            break
        got.append(m.payload)
        m.ack()
    out.put((group, got))


# ---------------------------------------------------------------- basic order and delivery
def test_fifo_with_one_consumer(broker: shmq.Broker) -> None:
    q = broker.create_queue("fifo")
    offsets = [q.put(f"m{i}".encode()) for i in range(500)]
    assert offsets == list(range(500))
    for i in range(500):
        m = q.get(timeout=1)
        assert (m.offset, m.payload, m.deliveries) == (i, f"m{i}".encode(), 1)
        m.ack()
    with pytest.raises(shmq.Empty):
        q.get(block=False)


def test_all_delivered_with_several_producers(broker: shmq.Broker) -> None:
    q = broker.create_queue("many", capacity=256)
    procs = [CTX.Process(target=_produce, args=(broker.url, "many", t, 400)) for t in range(4)]
    for p in procs:
        p.start()
    got: list[bytes] = []
    while len(got) < 1600:
        m = q.get(timeout=10)
        got.append(m.payload)
        m.ack()
    for p in procs:
        p.join()
    assert sorted(got) == sorted(f"{t}:{i}".encode() for t in range(4) for i in range(400))
    per_producer = {t: [int(x.split(b":")[1]) for x in got if x.startswith(f"{t}:".encode())]
                    for t in range(4)}
    assert all(v == sorted(v) for v in per_producer.values())  # FIFO per producer


def test_published_before_any_consumer_is_delivered_later(instance: str) -> None:
    url = f"shm://{instance}"
    b = ShmBroker(instance)
    b.create_queue("early")
    p = CTX.Process(target=_produce, args=(url, "early", 0, 50))
    p.start()
    p.join()
    assert p.exitcode == 0
    b.close()  # no handle of ours was open while the messages waited
    b2 = ShmBroker(instance)
    q = b2.queue("early")
    assert [q.get(timeout=1).payload for _ in range(50)] == [f"0:{i}".encode() for i in range(50)]
    b2.destroy()


def test_competing_consumers_get_disjoint_sets_whose_union_is_everything(broker: shmq.Broker) -> None:
    q = broker.create_queue("work")
    q.put_many([f"{i}".encode() for i in range(2000)])
    out: mp.Queue = CTX.Queue()
    procs = [CTX.Process(target=_consume, args=(broker.url, "work", "default", 2000, out))
             for _ in range(3)]
    for p in procs:
        p.start()
    sets = [out.get(timeout=30)[1] for _ in procs]
    for p in procs:
        p.join()
    flat = [x for s in sets for x in s]
    assert len(flat) == len(set(flat)) == 2000
    assert set(flat) == {f"{i}".encode() for i in range(2000)}


def test_separate_groups_each_get_everything(broker: shmq.Broker) -> None:
    q = broker.create_queue("fan")
    q.create_group("audit")
    q.create_group("billing")
    q.put_many([f"{i}".encode() for i in range(300)])
    out: mp.Queue = CTX.Queue()
    procs = [CTX.Process(target=_consume, args=(broker.url, "fan", g, 300, out))
             for g in ("audit", "audit", "billing")]
    for p in procs:
        p.start()
    results = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join()
    everything = {f"{i}".encode() for i in range(300)}
    audit = [x for g, got in results if g == "audit" for x in got]
    billing = [x for g, got in results if g == "billing" for x in got]
    assert sorted(audit) == sorted(everything)  # shared inside the group, once each
    assert sorted(billing) == sorted(everything)
    # storage is freed only once every group (default included) has acknowledged
    assert q.stats()["retained"] == 300
    q.ack_many(q.get_many(300))
    assert q.stats()["retained"] == 0


def test_group_starting_at_latest_sees_only_new_messages(broker: shmq.Broker) -> None:
    q = broker.create_queue("late")
    q.put(b"old")
    q.create_group("tail", start="latest")
    q.put(b"new")
    assert q.get(group="tail", timeout=1).payload == b"new"
    with pytest.raises(shmq.Empty):
        q.get(group="tail", block=False)
    q.create_group("head", start="earliest")
    assert q.get(group="head", timeout=1).payload == b"old"
    with pytest.raises(shmq.QueueExists):
        q.create_group("head")


def test_groups_bound(broker: shmq.Broker) -> None:
    q = broker.create_queue("g", max_groups=2)
    q.create_group("one")
    with pytest.raises(shmq.LimitExceeded):
        q.create_group("two")
    q.delete_group("one")
    q.create_group("two")
    assert sorted(q.groups()) == ["default", "two"]


def test_a_lease_of_a_deleted_group_never_settles_its_successors_delivery(broker: shmq.Broker) -> None:
    """A group deleted and created again takes the same place in the group table, and
    delivers the same message with the same offset and delivery count: the old group's
    lease is stale all the same, and the new lease (another client's) stays held."""
    q = broker.create_queue("reborn")
    q.create_group("g")
    q.put_many([b"m", b"n"])
    old = q.get_many(2, group="g", timeout=1)
    q.delete_group("g")
    q.create_group("g")  # from the earliest offset: both are new to it
    other = shmq.connect(broker.url)
    try:
        oq = other.queue("reborn")
        new = oq.get_many(2, group="g", timeout=1)
        assert [(m.offset, m.deliveries) for m in new] == [(m.offset, m.deliveries) for m in old]
        with pytest.raises(shmq.StaleAck):
            old[0].ack()
        with pytest.raises(shmq.StaleAck):
            old[0].nack()
        with pytest.raises(shmq.StaleAck):
            q.ack_many(old)
        assert q.stats()["groups"]["g"]["acked"] == 0
        new[0].ack()  # still held by the other client
        q.delete_group("g")
        q.create_group("h")  # another name, the same place in the table
        h = oq.get(group="h", timeout=1)
        with pytest.raises(shmq.StaleAck):
            old[0].ack()
        with pytest.raises(shmq.StaleAck):
            old[0].dead_letter()
        h.ack()
        assert q.stats()["groups"]["h"]["acked"] == 1
    finally:
        other.close()


# ---------------------------------------------------------------- acks, nacks, leases
def test_acknowledged_message_is_never_redelivered(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("acks", visibility_timeout=5)
    q.put_many([b"a", b"b", b"c"])
    a, b, c = q.get_many(3)
    c.ack()
    a.ack()  # out of order
    clock.advance(10)
    m = q.get(timeout=0)
    assert (m.payload, m.deliveries) == (b"b", 2)
    m.ack()
    clock.advance(10)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert q.stats()["retained"] == 0


def test_visibility_timeout_redelivers_and_stale_ack_is_refused(clocked: ShmBroker,
                                                                 clock: FakeClock) -> None:
    q = clocked.create_queue("vis", visibility_timeout=2)
    q.put(b"x")
    first = q.get(timeout=0)
    clock.advance(2.5)
    second = q.get(timeout=0)
    assert (second.offset, second.deliveries, second.redelivered) == (first.offset, 2, True)
    with pytest.raises(shmq.StaleAck):
        first.ack()
    with pytest.raises(shmq.StaleAck):
        first.nack()
    with pytest.raises(shmq.StaleAck):
        first.touch()
    second.ack()  # the stale ack did not take the new delivery's place
    with pytest.raises(shmq.StaleAck):
        second.ack()
    assert q.stats()["groups"]["default"]["expired"] == 1


def test_touch_extends_the_lease(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("touch", visibility_timeout=2)
    q.put(b"x")
    m = q.get(timeout=0)
    for _ in range(5):
        clock.advance(1.5)
        m.touch()
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    m.touch(visibility_timeout=10)
    clock.advance(9)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    m.ack()


def test_nack_with_delay(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("delay")
    q.put_many([b"first", b"second"])
    m = q.get(timeout=0)
    m.nack(delay=5)
    assert q.get(timeout=0).payload == b"second"  # the delayed one waits
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    clock.advance(5)
    again = q.get(timeout=0)
    assert (again.payload, again.deliveries) == (b"first", 2)


def test_nack_goes_back_to_the_front(broker: shmq.Broker) -> None:
    q = broker.create_queue("front")
    q.put_many([b"1", b"2", b"3"])
    m1 = q.get()
    m1.nack()
    assert [q.get().payload for _ in range(3)] == [b"1", b"2", b"3"]


def test_nack_below_limit_redelivers_at_limit_dead_letters(broker: shmq.Broker) -> None:
    q = broker.create_queue("poison", max_deliveries=3)
    q.put_many([b"poison", b"good1", b"good2"])
    for attempt in range(1, 4):
        m = q.get(timeout=1)
        assert (m.payload, m.deliveries) == (b"poison", attempt)
        m.nack()
    # the group moved on, other messages flow
    assert [q.get(timeout=1).payload for _ in range(2)] == [b"good1", b"good2"]
    dlq = broker.queue("poison.dlq")
    d = dlq.get(timeout=1)
    assert d.payload == b"poison"
    assert d.origin == shmq.Origin("poison", 0, "default", "nack", 3)
    assert dlq.stats()["is_dlq"]
    assert q.stats()["groups"]["default"]["dead_lettered"] == 1


def test_nack_and_timeout_count_against_one_limit(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("mixed", max_deliveries=3, visibility_timeout=1)
    q.put(b"p")
    q.get(timeout=0).nack()  # delivery 1: nack
    q.get(timeout=0)  # delivery 2: times out
    clock.advance(2)
    m = q.get(timeout=0)  # delivery 3
    assert m.deliveries == 3
    clock.advance(2)  # times out with no deliveries left
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    d = clocked.queue("mixed.dlq").get(timeout=0)
    assert d.payload == b"p" and d.origin is not None and d.origin.reason == "expired"


def test_explicit_dead_letter(broker: shmq.Broker) -> None:
    q = broker.create_queue("explicit")
    q.put(b"bad")
    q.get().dead_letter()
    d = broker.queue("explicit.dlq").get(timeout=1)
    assert d.origin is not None and (d.payload, d.origin.reason) == (b"bad", "dead_letter")
    with pytest.raises(shmq.InvalidArgument):
        d.dead_letter()


def test_poison_message_does_not_block_other_consumers(broker: shmq.Broker) -> None:
    q = broker.create_queue("busy", max_deliveries=2)
    q.put_many([b"poison"] + [b"ok"] * 10)
    poison = q.get()
    others = q.get_many(10)  # another consumer is served while poison is held
    assert [m.payload for m in others] == [b"ok"] * 10
    poison.nack()
    q.get().nack()
    q.ack_many(others)
    assert broker.queue("busy.dlq").get(timeout=1).payload == b"poison"
    assert q.stats()["retained"] == 0


def test_ack_many_reports_stale_and_applies_the_rest(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("batch", visibility_timeout=1)
    q.put_many([b"a", b"b", b"c"])
    msgs = q.get_many(3)
    msgs[1].ack()
    with pytest.raises(shmq.StaleAck) as info:
        q.ack_many(msgs)
    assert info.value.stale == [1]  # type: ignore[attr-defined]
    assert q.stats()["retained"] == 0


def test_server_batch_path_takes_runs_and_acks_them_as_columns(shm_broker: ShmBroker) -> None:
    """take_block / ack_offsets, the TCP worker's batch path: a run of new messages comes out
    as columns; acking its first part moves the floor exactly past it; stale pairs are named."""
    q = shm_broker.create_queue("blocks")
    q.put_many([b"a", b"bb", b"ccc", b"dddd", b"e", b"f"])
    sq = ServerQueue(q)
    first, stamps, lens, data = sq.take_block("default", 4)  # type: ignore[misc]
    assert (first, lens, data) == (0, [1, 2, 3, 4], b"abbcccdddd") and len(stamps) == 4
    assert [m.offset for m in q.get_many(10)] == [4, 5]  # the rest, the general way
    ref = sq.group_ref("default")
    assert sq.ack_offsets(ref, [0, 1], [1, 1])[0] == []  # a run: one strided store, the floor jumps
    assert q.offsets() == (2, 6)  # exactly past the acked run: 2 and 3 are still leased
    assert sq.ack_offsets(ref, [2, 2, 3, 9], [1, 1, 2, 1])[0] == [2, 3, 9]  # twice / wrong delivery / never
    assert q.offsets() == (3, 6)
    assert sq.ack_offsets(ref, [3, 4, 5], [1, 1, 1])[0] == [] and q.offsets() == (6, 6)
    assert q.stats()["groups"]["default"]["acked"] == 6


def test_server_gives_back_a_closed_connections_leases_at_once(clocked: ShmBroker, clock: FakeClock) -> None:
    """give_back, what the server does with a closed connection's leases: held ones come
    back now (not at their timeout), stale ones are skipped, one that reached
    max_deliveries goes to the dead-letter queue, and workers waiting on the queue are rung."""
    q = clocked.create_queue("giveall", visibility_timeout=30, max_deliveries=2)
    q.put_many([b"a", b"b", b"c", b"d"])
    sq = ServerQueue(q)
    ref = sq.group_ref("default")
    ms = q.get_many(4)
    ms[1].ack()  # settled: stale for give_back
    ms[3].nack()
    d2 = q.get(timeout=0)
    assert (d2.offset, d2.deliveries) == (3, 2)
    bell = Bell(q.ring.instance_uid, 7)
    try:
        sq.set_bell(7, True)  # worker 7 has a request parked here
        assert sq.give_back(ref, [0, 1, 2, 3, 3], [1, 1, 1, 1, 2]) == 3  # (1, 1) and (3, 1) are stale
        assert bell.drain() == {sq.queue_id}
    finally:
        bell.close()
    assert [(m.offset, m.deliveries) for m in q.get_many(10, timeout=0)] == [(0, 2), (2, 2)]
    dead = clocked.queue("giveall.dlq").get(timeout=0)
    assert dead.payload == b"d" and dead.origin is not None and dead.origin.reason == "nack"
    assert sq.give_back(sq.group_ref("default") + 64, [0], [2]) == 0  # another incarnation: stale


def test_server_batch_path_leaves_what_it_cannot_take_to_get_many(clocked: ShmBroker,
                                                                   clock: FakeClock) -> None:
    q = clocked.create_queue("noblock", visibility_timeout=5)
    sq = ServerQueue(q)
    assert sq.take_block("default", 10) == (0, [], [], b"")  # nothing at all: an empty run
    q.put(b"one")
    assert sq.take_block("default", 10) is None  # fewer than two
    q.put(b"two")
    m1, m2 = q.get_many(2)
    m1.nack()
    q.put_many([b"3", b"4"])
    assert sq.take_block("default", 10) is None  # a redelivery is pending: it goes first
    assert [m.offset for m in q.get_many(1)] == [0]
    clock.advance(6)  # m2's lease (and m1's second) expired: due back before anything new
    assert sq.take_block("default", 10) is None
    got = q.get_many(10)
    assert sorted(m.offset for m in got) == [0, 1, 2, 3]
    assert sq.take_block("default", 10) == (4, [], [], b"")  # all leased, none due: nothing to do
    clock.advance(6)
    assert sq.take_block("default", 10) is None  # their leases expired: the general path


def test_server_poll_stops_at_a_byte_budget(shm_broker: ShmBroker) -> None:
    """A batch answer must fit one frame: the server polls with a byte budget, new
    messages and redeliveries alike, and always takes one message at least."""
    q = shm_broker.create_queue("budget")
    sq = ServerQueue(q)
    q.put_many([b"a" * 400, b"b" * 400, b"c" * 400])
    first = sq.poll("default", 3, max_bytes=900)
    assert [m.offset for m in first] == [0, 1]
    last = sq.poll("default", 3, max_bytes=10)
    assert [m.offset for m in last] == [2]  # one, even past the budget
    for m in first + last:
        m.nack()
    q.put(b"d" * 10)  # a new message that would fit, but may not pass a redelivery
    again = sq.poll("default", 3, max_bytes=900)  # redeliveries, under the same budget
    assert [(m.offset, m.deliveries) for m in again] == [(0, 2), (1, 2)]
    assert [m.offset for m in sq.poll("default", 3, max_bytes=900)] == [2, 3]
    q.put_many([b"e" * 20, b"f" * 20])
    assert sq.take_block("default", 3, max_bytes=10) is None  # cut to one: a run of one is not a run


def test_the_largest_message_travels_both_ways(broker: shmq.Broker) -> None:
    """max_message_size stops at 16 MiB so that every message fits one TCP frame."""
    with pytest.raises(shmq.InvalidArgument, match="one TCP frame"):
        broker.create_queue("huge", max_bytes=64 << 20, max_message_size=options.MAX_MESSAGE_SIZE + 1)
    q = broker.create_queue("huge", max_bytes=40 << 20, max_message_size=options.MAX_MESSAGE_SIZE)
    big = bytes(range(256)) * (options.MAX_MESSAGE_SIZE // 256)
    q.put_many([big, b"small"])
    got = q.get_many(2, timeout=5)  # over TCP: the first fills a frame, the second comes next
    got += q.get_many(2, timeout=5) if len(got) < 2 else []
    assert [m.payload for m in got] == [big, b"small"]
    q.ack_many(got)


def test_read_replays_without_leasing(broker: shmq.Broker) -> None:
    q = broker.create_queue("replay")
    q.put_many([f"{i}".encode() for i in range(10)])
    msgs = q.read(3, 4)
    assert [(m.offset, m.payload) for m in msgs] == [(i, f"{i}".encode()) for i in range(3, 7)]
    with pytest.raises(shmq.StaleAck):
        msgs[0].ack()
    assert q.get().offset == 0  # nothing was leased by read()
    assert q.read(100) == []


# ---------------------------------------------------------------- limits and errors
def test_full_queue_with_and_without_timeout(broker: shmq.Broker) -> None:
    q = broker.create_queue("small", capacity=4)
    q.put_many([b"1", b"2", b"3", b"4"])
    with pytest.raises(shmq.Full):
        q.put(b"5", block=False)
    t0 = time.monotonic()
    with pytest.raises(shmq.Full):
        q.put(b"5", timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    with pytest.raises(shmq.Full):  # a batch that can never fit fails at once
        q.put_many([b"x"] * 5, timeout=100)
    assert isinstance(shmq.Full(), __import__("queue").Full)  # stdlib-compatible
    # every message's fate: the four are all there, once each and in order; none of the
    # refused ones is; and a put that waits is stored once room is made, after them
    got = q.get_many(10, block=False)
    assert [(m.offset, m.payload) for m in got] == [(0, b"1"), (1, b"2"), (2, b"3"), (3, b"4")]
    got[0].ack()
    assert q.put(b"6", timeout=5) == 4
    q.ack_many(got[1:])
    assert [(m.offset, m.payload) for m in q.get_many(10, block=False)] == [(4, b"6")]


def test_blocked_put_wakes_when_space_is_freed(broker: shmq.Broker) -> None:
    q = broker.create_queue("wake", capacity=2)
    q.put_many([b"1", b"2"])
    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(q.put(b"3", timeout=10)))
    t.start()
    m = q.get()
    m.ack()
    t.join(5)
    assert result == [2]


def test_blocked_get_wakes_when_a_message_arrives(instance: str) -> None:
    b = ShmBroker(instance)
    q = b.create_queue("wake")
    p = CTX.Process(target=_produce, args=(b.url, "wake", 9, 1))
    t0 = time.monotonic()
    p.start()
    m = q.get(timeout=10)
    p.join()
    assert m.payload == b"9:0" and time.monotonic() - t0 < 5
    b.destroy()


def test_bytes_limit(broker: shmq.Broker) -> None:
    q = broker.create_queue("bytes", max_bytes=8192, max_message_size=3000)
    q.put(b"x" * 3000)
    q.put(b"y" * 3000)
    with pytest.raises(shmq.Full):
        q.put(b"z" * 3000, block=False)
    q.get().ack()
    q.put(b"z" * 3000, block=False)  # wraps around the byte ring
    assert [q.get().payload[:1] for _ in range(2)] == [b"y", b"z"]


def test_oversized_payload_fails_at_once(broker: shmq.Broker) -> None:
    q = broker.create_queue("big", max_message_size=100)
    with pytest.raises(shmq.MessageTooLarge) as info:
        q.put(b"x" * 101, timeout=None)  # would hang in faster-fifo; here it fails at once
    assert info.value.code == shmq.Status.PAYLOAD_TOO_LARGE
    with pytest.raises(shmq.MessageTooLarge):
        q.put_many([b"ok", b"x" * 101])
    assert q.stats()["retained"] == 0  # nothing of the batch went in


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "sp ace", "x" * 201, "ünï", None, 5])
def test_bad_queue_names(broker: shmq.Broker, name: object) -> None:
    with pytest.raises(shmq.InvalidName) as info:
        broker.create_queue(name)  # type: ignore[arg-type]
    assert info.value.code == shmq.Status.INVALID_NAME


def test_bad_group_and_instance_names(broker: shmq.Broker) -> None:
    q = broker.create_queue("ok.name-1_2")
    with pytest.raises(shmq.InvalidName):
        q.get(group="bad/group", block=False)
    with pytest.raises(shmq.InvalidName):
        shmq.connect("shm://bad.instance")
    with pytest.raises(shmq.InvalidArgument):
        shmq.connect("http://nope")


@pytest.mark.parametrize("limits", [dict(capacity=0), dict(max_bytes=10), dict(max_deliveries=0),
                                    dict(max_deliveries=256), dict(visibility_timeout=0),
                                    dict(max_groups=65), dict(durability="sometimes"),
                                    dict(colour="red")])
def test_bad_limits(broker: shmq.Broker, limits: dict) -> None:
    with pytest.raises(shmq.InvalidArgument):
        broker.create_queue("q", **limits)
    assert broker.list_queues() == []


def test_unknown_and_existing_and_deleted_queues(broker: shmq.Broker) -> None:
    with pytest.raises(shmq.QueueNotFound) as info:
        broker.queue("nope")
    assert info.value.code == shmq.Status.QUEUE_NOT_FOUND
    q = broker.create_queue("q")
    with pytest.raises(shmq.QueueExists):
        broker.create_queue("q")
    assert [i.name for i in broker.list_queues()] == ["q"]
    broker.delete_queue("q")
    with pytest.raises(shmq.QueueNotFound):
        q.put(b"x")
    with pytest.raises(shmq.QueueNotFound):
        broker.delete_queue("q")
    broker.create_queue("q").put(b"fresh")  # the name can be used again


def test_get_timeout_is_bounded_and_monotonic(broker: shmq.Broker) -> None:
    q = broker.create_queue("t")
    t0 = time.monotonic()
    with pytest.raises(shmq.Empty):
        q.get(timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    with pytest.raises(shmq.InvalidArgument):
        q.get(timeout=-1)


def test_str_payloads_and_stats(broker: shmq.Broker) -> None:
    q = broker.create_queue("s")
    q.put("héllo")
    m = q.get()
    assert m.text == "héllo" and m.timestamp > 0
    st = q.stats()
    assert st["groups"]["default"]["in_flight"] == 1 and st["produced"] == 1
    assert st["bytes_used"] == len("héllo".encode())
    with pytest.raises(shmq.InvalidArgument):
        q.put(12345)  # type: ignore[arg-type]


# ---------------------------------------------------------------- processes
def _child_uses_pickled_queue(q: shmq.Queue, out: mp.Queue) -> None:
    m = q.get(timeout=5)
    m.ack()
    out.put((os.getpid(), m.payload))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_handles_cross_into_children(broker: shmq.Broker, method: str) -> None:
    ctx = mp.get_context(method)
    assert isinstance(ctx, ForkContext | SpawnContext | ForkServerContext)  # for mypy: one with a Process
    q = broker.create_queue("kids")
    q.put(b"hello child")
    out = ctx.Queue()
    p = ctx.Process(target=_child_uses_pickled_queue, args=(q, out))
    p.start()
    pid, payload = out.get(timeout=60)
    p.join(30)
    assert (pid, payload, p.exitcode) == (p.pid, b"hello child", 0)
    assert q.stats()["retained"] == 0


def test_objects_are_private_and_named_for_the_user_and_the_instance(shm_broker: ShmBroker) -> None:
    shm_broker.create_queue("private")
    names = objects(shm_broker.instance)
    assert len(names) == 6  # registry, queue segment, four semaphores
    mine = f"shmq.{os.geteuid()}.{shm_broker.instance}."
    assert all(n.startswith((mine, "sem." + mine)) for n in names), names
    for n in names:
        assert os.stat(f"/dev/shm/{n}").st_mode & 0o777 == 0o600, n


def test_stale_counts_after_double_settle(broker: shmq.Broker) -> None:
    q = broker.create_queue("twice")
    q.put(b"x")
    m = q.get()
    m.nack()
    with pytest.raises(shmq.StaleAck):
        m.ack()  # the nack gave the lease back: acking it now would be acking nothing we hold
    again = q.get()
    again.ack()
    assert q.stats()["retained"] == 0


def test_commit_settles_below_an_offset_and_purge_empties(broker: shmq.Broker) -> None:
    q = broker.create_queue("commit")
    q.create_group("spark")
    q.put_many([f"{i}".encode() for i in range(10)])
    held = q.get(group="spark")
    q.commit("spark", 6)
    with pytest.raises(shmq.StaleAck):
        held.ack()  # committed past it
    assert q.get(group="spark").offset == 6
    assert q.stats()["groups"]["spark"]["floor"] == 6
    with pytest.raises(shmq.GroupNotFound):
        q.commit("nope", 1)
    assert q.purge() == 10
    assert q.stats()["retained"] == 0
    with pytest.raises(shmq.Empty):
        q.get(block=False)


def test_idempotent_producer_writes_each_sequence_once(broker: shmq.Broker) -> None:
    q = broker.create_queue("idem")
    assert q.put_many([b"a", b"b"], producer="sink-1", seq=1) == [0, 1]
    with pytest.raises(shmq.Duplicate):
        q.put_many([b"a", b"b"], producer="sink-1", seq=1)  # a replay
    with pytest.raises(shmq.Duplicate):
        q.put_many([b"old"], producer="sink-1", seq=0 + 1)
    assert q.put_many([b"x"], producer="sink-2", seq=1) == [2]  # producers are independent
    assert q.put_many([b"c"], producer="sink-1", seq=5) == [3]  # gaps are allowed
    with pytest.raises(shmq.Duplicate):
        q.put_many([b"c"], producer="sink-1", seq=4)
    assert [m.payload for m in q.get_many(10, timeout=1)] == [b"a", b"b", b"x", b"c"]
    for bad in ({"producer": "p"}, {"seq": 1}, {"producer": "", "seq": 1}, {"producer": "p", "seq": 0},
                {"producer": "p" * 257, "seq": 1}, {"producer": "p", "seq": 1 << 63}):
        with pytest.raises(shmq.InvalidArgument):
            q.put_many([b"z"], **bad)  # type: ignore[arg-type]
    # nothing of the refused batches was written
    assert [m.payload for m in q.read(0, 10)] == [b"a", b"b", b"x", b"c"]
    assert q.put_many([b"d"], producer="sink-2", seq=2) == [4]


def test_idempotent_producer_table_forgets_the_oldest(shm_broker: shmq.Broker) -> None:
    q = shm_broker.create_queue("idem-many", capacity=1024)
    for i in range(options.MAX_PRODUCERS + 1):
        q.put_many([b"."], producer=f"p{i}", seq=1)
    q.put_many([b"."], producer=f"p{options.MAX_PRODUCERS}", seq=2)
    with pytest.raises(shmq.Duplicate):
        q.put_many([b"."], producer="p1", seq=1)  # still remembered
    q.put_many([b"."], producer="p0", seq=1)  # the oldest was forgotten: accepted again


@pytest.mark.parametrize("died_after", ["prev", "commit_word", "seq", "key", "published"])
def test_idempotent_put_whose_writer_died_is_settled_by_the_next_producer(
        shm_broker: shmq.Broker, died_after: str) -> None:
    """Replay the stores of an idempotent put up to a point, as a SIGKILLed writer leaves
    them (see layout's 'Producer entry'), and check the next plock holder's verdict."""
    from shmq.core import layout as L
    from shmq.core.ring import producer_key
    q = shm_broker.create_queue("idem-crash")
    q.put_many([b"a"], producer="p", seq=1)
    ring = q.ring  # type: ignore[attr-defined]
    w = ring.w
    e = ring._producer_entry(producer_key("p"))
    off = w[L.Q_NEXT_OFFSET]
    steps = ["prev", "commit_word", "seq", "key", "published"]
    upto = steps.index(died_after)
    w[L.Q_PENDING_PRODUCER] = (e - ring.producers_w) // L.P_WORDS + 1
    w[e + L.P_PREV] = 1
    if upto >= 1:
        w[e + L.P_COMMIT] = off + 1
    if upto >= 2:
        w[e + L.P_SEQ] = 2
    if upto >= 3:
        w[e + L.P_KEY] = producer_key("p")
    if died_after == "published":  # a whole put whose writer died before clearing the mark
        assert ring.try_put_many([b"b"], None, 0, producer_key("p"), 2) == off
        w[L.Q_PENDING_PRODUCER] = (e - ring.producers_w) // L.P_WORDS + 1
    published = died_after == "published"
    q.put(b"other")  # the next producer finds Q_PENDING_PRODUCER set and settles it
    assert w[L.Q_PENDING_PRODUCER] == 0
    if published:
        with pytest.raises(shmq.Duplicate):
            q.put_many([b"b"], producer="p", seq=2)
    else:
        assert q.put_many([b"b"], producer="p", seq=2)


@pytest.mark.parametrize("durability", ["interval", "always"])
def test_journaled_queue_needs_a_journal_writer(shm_broker: shmq.Broker, durability: str) -> None:
    with pytest.raises(shmq.InvalidArgument, match="journal"):
        shm_broker.create_queue("q", durability=durability)
    assert shm_broker.list_queues() == []


def _delete_in_child(instance: str, name: str) -> None:
    ShmBroker(instance).delete_queue(name)


def test_a_long_lived_process_lets_go_of_deleted_queues(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("doomed")
    shm_broker.create_queue("other")
    att = shm_broker._att
    qid = q.ring.queue_id  # type: ignore[attr-defined]
    del q
    assert qid in att._queues
    p = mp.get_context("spawn").Process(target=_delete_in_child, args=(shm_broker.instance, "doomed"))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    shm_broker.queue("other")  # any lookup after the registry changed prunes the cache
    assert qid not in att._queues  # its mapping goes once no handle is left


# ---------------------------------------------------------------- publisher confirms
def test_publisher_confirms_every_put_in_order(broker: shmq.Broker) -> None:
    q = broker.create_queue("pub")
    with q.publisher(window=8) as p:
        for i in range(100):
            p.put(f"m{i}")
            assert p.pending <= 8
    assert (p.sent, p.confirmed, p.failed, p.pending) == (100, 100, 0, 0)
    assert p.last_offset == 99
    got = q.get_many(200, timeout=1)
    assert [m.payload for m in got] == [f"m{i}".encode() for i in range(100)]
    assert [m.offset for m in got] == list(range(100))


def test_publisher_keeps_order_while_the_queue_is_full(broker: shmq.Broker) -> None:
    """Puts wait for room in order: a later small put never overtakes an earlier one."""
    q = broker.create_queue("pubfull", capacity=3)
    n = 60
    got: list[bytes] = []

    def consume() -> None:
        while len(got) < n:
            m = q.get(timeout=10)
            got.append(bytes(m.payload))
            m.ack()

    t = threading.Thread(target=consume)
    t.start()
    with q.publisher(window=16, timeout=10) as p:
        for i in range(n):
            p.put(str(i))
    t.join(20)
    assert got == [str(i).encode() for i in range(n)]


def test_publisher_errors_name_the_put_and_spare_the_others(broker: shmq.Broker) -> None:
    q = broker.create_queue("puberr", max_message_size=10)
    p = q.publisher(window=4)
    p.put(b"a")
    with pytest.raises(shmq.MessageTooLarge) as info:  # raised by the put (shm) or on collecting it (tcp)
        p.put(b"x" * 11)
        p.flush()
    if hasattr(info.value, "index"):
        assert info.value.index == 1
    p.put(b"b")
    p.flush()
    assert p.confirmed == 2 and p.pending == 0
    assert [m.payload for m in q.get_many(10, timeout=1)] == [b"a", b"b"]


def test_publisher_without_blocking_fails_the_puts_that_find_no_room(broker: shmq.Broker) -> None:
    q = broker.create_queue("pubnb", capacity=2)
    p = q.publisher(window=8, block=False)
    errors = 0
    for i in range(5):
        try:
            p.put(str(i))
        except shmq.Full:
            errors += 1
    while p.pending:
        try:
            p.flush()
        except shmq.Full:
            errors += 1
    assert (p.confirmed, errors) == (2, 3)
    assert [m.payload for m in q.get_many(10, timeout=1)] == [b"0", b"1"]


def test_publisher_batches_are_confirmed_whole_and_in_order(broker: shmq.Broker) -> None:
    """``put_many`` through a publisher: each batch counts its messages in the window, and
    batches and single puts are stored in the order they were started."""
    q = broker.create_queue("pubmany")
    sent: list[bytes] = []
    with q.publisher(window=10) as p:
        for i in range(30):
            if i % 3 == 0:
                p.put(f"s{i}")
                sent.append(f"s{i}".encode())
            else:
                batch = [f"b{i}.{j}".encode() for j in range(i % 7 + 1)]
                p.put_many(batch)
                sent.extend(batch)
            assert p.pending <= 10
        p.put_many([])  # nothing to start
        assert p.sent == len(sent)
    assert (p.confirmed, p.failed, p.pending) == (len(sent), 0, 0)
    assert p.last_offset == len(sent) - 1
    got = q.get_many(1000, timeout=1)
    assert [m.payload for m in got] == sent
    assert [m.offset for m in got] == list(range(len(sent)))


def test_publisher_batch_larger_than_the_window_goes_alone(broker: shmq.Broker) -> None:
    q = broker.create_queue("pubbig")
    p = q.publisher(window=4)
    p.put(b"a")
    p.put_many([b"%d" % i for i in range(9)])  # waits for "a" first, then is the only one pending
    assert (p.confirmed, p.pending) == (1, 9)
    p.put(b"z")  # waits for the batch
    assert (p.confirmed, p.pending) == (10, 1)
    p.flush()
    assert [m.payload for m in q.get_many(20, timeout=1)] == [b"a"] + [b"%d" % i for i in range(9)] + [b"z"]


def test_publisher_batch_errors_fail_the_whole_batch_and_spare_the_others(broker: shmq.Broker) -> None:
    q = broker.create_queue("pubmanyerr", max_message_size=10)
    p = q.publisher(window=8)
    p.put_many([b"a", b"b"])
    with pytest.raises(shmq.MessageTooLarge) as info:  # raised at once (shm) or on collecting it (tcp)
        p.put_many([b"c", b"x" * 11, b"d"])
        p.flush()
    if hasattr(info.value, "index"):
        assert info.value.index == 2  # the failed batch's first message
        assert p.failed == 3
    p.put_many([b"e"])
    p.put(b"f")
    p.flush()
    assert (p.confirmed, p.pending) == (4, 0)
    assert [m.payload for m in q.get_many(10, timeout=1)] == [b"a", b"b", b"e", b"f"]


def test_publisher_batch_without_blocking_fails_whole_when_it_finds_no_room(broker: shmq.Broker) -> None:
    q = broker.create_queue("pubmanynb", capacity=4)
    p = q.publisher(window=16, block=False)
    fates: list[str] = []
    for batch in ([b"0", b"1", b"2"], [b"3", b"4"], [b"5"]):
        try:
            p.put_many(batch)
            p.flush()
            fates.append("stored")
        except shmq.Full:
            fates.append("full")
    assert fates == ["stored", "full", "stored"]
    assert (p.confirmed, p.pending) == (4, 0)
    assert [m.payload for m in q.get_many(10, timeout=1)] == [b"0", b"1", b"2", b"5"]


@pytest.mark.parametrize("window", [0, -1, options.MAX_PUBLISH_WINDOW + 1, 2.5])
def test_publisher_window_is_bounded(broker: shmq.Broker, window: object) -> None:
    q = broker.create_queue("pubwin")
    with pytest.raises(shmq.InvalidArgument):
        q.publisher(window=window)  # type: ignore[arg-type]


# ---------------------------------------------------------------- acks without a round trip
def test_ack_without_waiting_is_applied_before_the_next_request(broker: shmq.Broker) -> None:
    q = broker.create_queue("nowait")
    q.put_many([b"a", b"b", b"c"])
    for _ in range(3):
        q.get(timeout=1).ack(wait=False)
    st = q.stats()  # the same connection: its acks were applied before this request
    assert st["groups"]["default"]["acked"] == 3 and st["groups"]["default"]["in_flight"] == 0
    assert st["retained"] == 0
    with pytest.raises(shmq.Empty):
        q.get(block=False)


def test_ack_many_without_waiting_is_applied_before_the_next_request(broker: shmq.Broker) -> None:
    q = broker.create_queue("nowaitmany")
    q.put_many([b"%d" % i for i in range(250)])
    got = 0
    while got < 250:
        msgs = q.get_many(100, timeout=1)
        q.ack_many(msgs, wait=False)
        got += len(msgs)
    st = q.stats()  # the same connection: its acks were applied before this request
    assert st["groups"]["default"]["acked"] == 250 and st["groups"]["default"]["in_flight"] == 0
    assert st["retained"] == 0


def test_stale_ack_many_without_waiting_applies_the_rest(broker: shmq.Broker) -> None:
    q = broker.create_queue("nowaitmanystale")
    q.put_many([b"a", b"b", b"c"])
    msgs = q.get_many(3, timeout=1)
    msgs[1].ack()
    if isinstance(broker, ShmBroker):  # known at once in shared memory
        with pytest.raises(shmq.StaleAck) as e:
            q.ack_many(msgs, wait=False)
        assert e.value.stale == [1]  # type: ignore[attr-defined]
    else:
        q.ack_many(msgs, wait=False)  # over TCP the answer is not waited for ...
        q.stats()  # ... an error would come before this reply
        errs = list(broker.nowait_errors)  # type: ignore[attr-defined]
        assert len(errs) == 1 and isinstance(errs[0], shmq.StaleAck) and "1 of 3" in str(errs[0])
    assert q.stats()["groups"]["default"]["acked"] == 3


@pytest.mark.parametrize("wait", [True, False])
def test_ack_many_of_another_queues_message_settles_nothing_here(broker: shmq.Broker, wait: bool) -> None:
    """A lease of queue A handed to queue B's ack_many is stale there (known at once, even
    unwaited): it must not settle B's delivery that has the same offset, group and count."""
    a = broker.create_queue("ackhome")
    b = broker.create_queue("ackaway")
    a.put_many([b"a0", b"a1"])
    b.put_many([b"b0", b"b1"])
    ma, mb = a.get_many(2, timeout=1), b.get_many(2, timeout=1)
    assert [(m.offset, m.deliveries, m.group) for m in ma] == [(m.offset, m.deliveries, m.group) for m in mb]
    with pytest.raises(shmq.StaleAck) as e:
        b.ack_many([ma[0], mb[1]], wait=wait)  # the foreign one is refused, ours is applied
    assert e.value.stale == [0]  # type: ignore[attr-defined]
    st = b.stats()["groups"]["default"]
    assert (st["acked"], st["in_flight"]) == (1, 1)
    assert a.stats()["groups"]["default"]["in_flight"] == 2
    broker.queue("ackaway").ack_many([mb[0]])  # both leases of offset 0 are still held; another
    a.ack_many(ma)                              # handle of the same queue may settle them
    assert not getattr(broker, "nowait_errors", [])


def test_stale_ack_without_waiting_is_reported_where_it_can_be(broker: shmq.Broker) -> None:
    q = broker.create_queue("nowaitstale")
    q.put(b"a")
    m = q.get(timeout=1)
    m.ack()
    if isinstance(broker, ShmBroker):  # known at once in shared memory
        with pytest.raises(shmq.StaleAck):
            m.ack(wait=False)
        return
    m.ack(wait=False)  # over TCP the answer is not waited for ...
    q.stats()  # ... and is read with the next reply
    errs = list(broker.nowait_errors)  # type: ignore[attr-defined]
    assert len(errs) == 1 and isinstance(errs[0], shmq.StaleAck)
    assert q.stats()["groups"]["default"]["acked"] == 1
