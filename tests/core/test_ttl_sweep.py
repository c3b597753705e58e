"""Expiry with nobody consuming: the broker's maintenance (``ServerBroker.maintain``, which
the supervisor runs every ``REAP_INTERVAL``) expires what a delivery would; and a
journaled message keeps its own TTL through a kill -9 of the whole broker.

``ServerBroker(instance, clock=...)`` runs the supervisor's maintenance on the test's
FakeClock, so each fate is exact; the last tests run a real ``shmq serve``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shmq
from shmq import options
from shmq.core import check
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerBroker
from tests.support.clock import FakeClock
from tests.support.durable import Durable
from tests.support.wait import wait_until


@pytest.fixture
def maint(instance: str, clock: FakeClock) -> Iterator[ServerBroker]:
    """The supervisor's view of a fresh instance, on the test's clock."""
    sb = ServerBroker(instance, clock=clock)
    yield sb
    sb.close()


def _dead(b: shmq.Broker, name: str) -> list[tuple[bytes, str, int]]:
    """(payload, origin group, origin offset) of ``name``'s dead letters, read, not leased."""
    try:
        dlq = b.queue(f"{name}.dlq")
    except shmq.QueueNotFound:
        return []
    out = []
    for m in dlq.read(0, 100):
        assert m.origin is not None and (m.origin.reason, m.origin.deliveries) == ("ttl_expired", 0)
        out.append((bytes(m.payload), m.origin.group, m.origin.offset))
    return sorted(out)


def test_maintenance_expires_up_to_the_first_live_message(maint: ServerBroker, clock: FakeClock) -> None:
    b = maint.broker
    q = b.create_queue("s")
    q.create_group("audit")
    q.put_many([b"a", b"b"], ttl=5)
    q.put(b"c")  # no TTL: it holds back what comes after it
    q.put(b"d", ttl=1)
    clock.advance(4.999)
    maint.maintain()
    assert _dead(b, "s") == []
    clock.advance(0.001)
    maint.maintain()
    assert _dead(b, "s") == [(b"a", "audit", 0), (b"a", "default", 0), (b"b", "audit", 1),
                             (b"b", "default", 1)]
    groups = q.stats()["groups"]
    for g in ("default", "audit"):
        assert (groups[g]["ttl_expired"], groups[g]["cursor"], groups[g]["depth"]) == (2, 2, 2)
    assert q.stats()["first_offset"] == 2  # their room is free
    (c,) = q.get_many(10, block=False)  # the default group's consumer comes back: "d" expires at delivery
    assert c.payload == b"c"
    c.ack()
    maint.maintain()  # and the audit group's "d" waits behind its "c"
    assert [d[1:] for d in _dead(b, "s") if d[0] == b"d"] == [("default", 3)]
    assert q.stats()["groups"]["audit"]["ttl_expired"] == 2
    assert check.check_instance(maint.instance) == []


def test_maintenance_drops_what_a_queue_ttl_expired(maint: ServerBroker, clock: FakeClock) -> None:
    b = maint.broker
    q = b.create_queue("s", message_ttl=2, expired_to_dlq=False)
    q.put_many([b"a", b"b", b"c"])
    clock.advance(1)
    q.put(b"d")
    clock.advance(1)
    maint.maintain()
    st = q.stats()
    assert (st["groups"]["default"]["ttl_expired"], st["first_offset"]) == (3, 3)
    assert [m.payload for m in q.get_many(10, block=False)] == [b"d"]
    assert _dead(b, "s") == []


def test_maintenance_expires_delayed_messages_when_due(maint: ServerBroker, clock: FakeClock) -> None:
    b = maint.broker
    q = b.create_queue("s")
    q.put(b"x", delay=3, ttl=4)
    q.put(b"y", delay=3, ttl=60)
    q.put(b"z", ttl=60)
    maint.maintain()  # steps over the delayed ones, to the live "z"
    assert q.stats()["groups"]["default"]["cursor"] == 2
    clock.advance(4)
    maint.maintain()
    assert _dead(b, "s") == [(b"x", "default", 0)]
    assert [m.payload for m in q.get_many(10, block=False)] == [b"y", b"z"]
    assert check.check_instance(maint.instance) == []


def test_maintenance_leaves_leases_and_given_back_messages(maint: ServerBroker, clock: FakeClock) -> None:
    b = maint.broker
    q = b.create_queue("s", visibility_timeout=60)
    q.put_many([b"a", b"b", b"c"], ttl=1)
    a, b_ = q.get_many(2, block=False)
    a.nack()
    clock.advance(2)
    maint.maintain()  # only "c", never delivered, expires
    assert _dead(b, "s") == [(b"c", "default", 2)]
    assert sorted(m.offset for m in q.get_many(10, block=False)) == [0]  # "a" again; "b" still leased
    b_.ack()


def test_maintenance_is_bounded_per_group_and_tick(maint: ServerBroker, clock: FakeClock) -> None:
    b = maint.broker
    q = b.create_queue("s", expired_to_dlq=False)
    q.put_many([b"%d" % i for i in range(5)], ttl=1)
    clock.advance(1)
    handle = maint.queue("s").handle
    assert [handle.sweep_ttl(budget=2) for _ in range(4)] == [2, 2, 1, 0]
    assert q.stats()["groups"]["default"]["ttl_expired"] == 5
    assert handle.sweep_ttl.__defaults__ == (options.TTL_SWEEP_BATCH,)  # what the broker's ticks use


def test_an_empty_queue_forgets_its_own_ttls(maint: ServerBroker, clock: FakeClock) -> None:
    q = maint.broker.create_queue("s")
    handle = maint.queue("s").handle
    q.put(b"x", ttl=60)
    w = q.words  # type: ignore[attr-defined]
    handle.sweep_ttl()
    assert w[L.Q_EXPIRES_MAX] > 0  # "x" is retained: its S_EXPIRES is still to be looked at
    q.get(block=False).ack()
    handle.sweep_ttl()
    assert w[L.Q_EXPIRES_MAX] == 0  # nothing retained: deliveries skip the column again
    q.put(b"y", ttl=5)
    assert w[L.Q_EXPIRES_MAX] > 0
    clock.advance(5)
    assert handle.sweep_ttl() == 1
    assert check.check_instance(maint.instance) == []


def test_a_queue_without_ttl_is_not_swept(maint: ServerBroker, clock: FakeClock) -> None:
    q = maint.broker.create_queue("s")
    q.put(b"x")
    clock.advance(10**6)
    assert maint.queue("s").handle.sweep_ttl() == 0
    assert q.stats()["groups"]["default"]["cursor"] == 0


def test_the_broker_expires_with_nobody_consuming(server: Any) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue("nobody", message_ttl=0.05)
        try:
            q.put(b"queue-ttl")
            q.put(b"own", ttl=0.1)
            wait_until(lambda: q.stats()["groups"]["default"]["ttl_expired"] == 2)
            assert q.stats()["groups"]["default"]["depth"] == 0
            wait_until(lambda: "nobody.dlq" in {i.name for i in b.list_queues()})  # (the copies follow
            dlq = b.queue("nobody.dlq")                                           # the count)
            wait_until(lambda: dlq.stats()["next_offset"] == 2)
            assert sorted(bytes(m.payload) for m in dlq.read(0, 10)) == [b"own", b"queue-ttl"]
        finally:
            for name in ("nobody", "nobody.dlq"):
                with contextlib.suppress(shmq.QueueNotFound):
                    b.delete_queue(name)


def test_a_journaled_dead_letter_queue_gets_each_expired_message_once(server: Any) -> None:
    """An `always` DLQ confirms a copy only once fsynced: the maintenance's copies wait for
    that (``DEAD_LETTER_SYNC_WAIT``) instead of being orphaned and copied again every tick."""
    with shmq.connect(server.url) as b:
        ttl = b.create_queue("jttl", durability="always", message_ttl=0.05)
        vis = b.create_queue("jvis", durability="always", visibility_timeout=0.05, max_deliveries=1)
        try:
            ttl.put_many([b"a", b"b"])
            vis.put(b"c")
            vis.get(timeout=5)  # its lease runs out: dead-lettered by the maintenance too
            wait_until(lambda: ttl.stats()["first_offset"] == 2 and vis.stats()["first_offset"] == 1)
            assert [m.payload for m in b.queue("jttl.dlq").read(0, 10)] == [b"a", b"b"]
            assert [m.payload for m in b.queue("jvis.dlq").read(0, 10)] == [b"c"]
        finally:
            for name in ("jttl", "jttl.dlq", "jvis", "jvis.dlq"):
                with contextlib.suppress(shmq.QueueNotFound):
                    b.delete_queue(name)


@pytest.mark.slow
def test_own_ttls_survive_kill9_and_the_loss_of_shared_memory(durable: Durable) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("keep", durability="always")
        q.put(b"a", ttl=3600, headers={"k": "v"})
        q.put(b"plain")
        q.put_many([b"b", b"c"], ttl=7200)
        q.put(b"soon", ttl=2.0)
        put_soon = time.time_ns()
    local = ShmBroker(durable.inst)
    try:
        ring = local.queue("keep").ring  # type: ignore[attr-defined]
        before = [ring.w[ring.slot_base(o) + L.S_EXPIRES] for o in range(5)]
    finally:
        local.close()
    assert [bool(x) for x in before] == [True, False, True, True, True]
    durable.crash(reboot=True)
    durable.start()
    local = ShmBroker(durable.inst)
    try:
        ring = local.queue("keep").ring  # type: ignore[attr-defined]
        assert [ring.w[ring.slot_base(o) + L.S_EXPIRES] for o in range(5)] == before
        assert ring.w[L.Q_EXPIRES_MAX] == max(before)
    finally:
        local.close()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("keep")
        wait_until(lambda: time.time_ns() > put_soon + 2_100_000_000)  # "soon" is past its TTL
        got = q.get_many(10, timeout=1)
        assert [bytes(m.payload) for m in got] == [b"a", b"plain", b"b", b"c"]
        assert dict(got[0].headers) == {"k": b"v"}
        wait_until(lambda: "keep.dlq" in {i.name for i in b.list_queues()})
        (d,) = b.queue("keep.dlq").get_many(10, timeout=5)
        assert (d.payload, d.origin.reason if d.origin else None) == (b"soon", "ttl_expired")
