"""Delayed delivery: ``put(delay=)`` stores at once and delivers to every group when due."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

import shmq
from shmq.core import check
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.queue import ShmQueue
from tests.support.clock import FakeClock
from tests.support.durable import Durable


def test_delayed_message_waits_then_goes_to_every_group(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("d")
    q.create_group("audit")
    off = q.put(b"later", delay=30)
    q.put(b"now")
    assert q.stats()["groups"]["default"]["delayed"] == 1
    first = q.get(timeout=0)
    assert first.payload == b"now"  # a later undelayed message goes first
    first.ack()
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert [m.payload for m in q.get_many(10, group="audit", block=False)] == [b"now"]
    clock.advance(29.9)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    clock.advance(0.2)
    for group in ("default", "audit"):
        m = q.get(group=group, block=False)
        assert (m.offset, m.payload, m.deliveries, m.redelivered) == (off, b"later", 1, False)
        m.ack()
    st = q.stats()["groups"]["default"]
    assert (st["delayed"], st["redelivered"]) == (0, 0)


def test_first_delivery_is_not_a_redelivery(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("d")
    q.put_many([b"a", b"b"], delay=5)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    clock.advance(5)
    a, b = q.get_many(10, block=False)
    assert (a.deliveries, b.deliveries, a.redelivered) == (1, 1, False)
    a.nack()
    b.ack()
    again = q.get(block=False)
    assert (again.offset, again.deliveries, again.redelivered) == (a.offset, 2, True)
    again.ack()
    w = q.words  # type: ignore[attr-defined]
    g = q.ring.groups_w  # type: ignore[attr-defined]
    assert (w[g + L.G_DELIVERED], w[g + L.G_REDELIVERED]) == (2, 1)


def test_a_group_created_later_sees_it_when_due(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("d")
    off = q.put(b"x", delay=10)
    q.create_group("late", start="earliest")
    with pytest.raises(shmq.Empty):
        q.get(group="late", block=False)
    assert q.stats()["groups"]["late"]["delayed"] == 1
    clock.advance(10)
    assert q.get(group="late", block=False).offset == off


def test_commit_and_seek_past_a_delayed_message(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("d")
    q.put(b"x", delay=10)
    q.put(b"y")
    q.commit("default", 1)  # settles the delayed one too
    assert q.get(block=False).payload == b"y"
    clock.advance(10)
    with pytest.raises(shmq.Empty):
        q.get(block=False)


def _settle_early(q: ShmQueue, group: str, how: str) -> None:
    """``group`` settles everything produced so far without a delivery."""
    if how == "commit":
        q.commit(group, q.offsets()[1])
    elif how == "seek":
        q.seek(group, time.time() + 3600)  # (after every message: the next offset)
    else:  # a group made after them, at "latest", then dropped
        q.delete_group(group)
        q.create_group(group, start="latest")


@pytest.mark.parametrize("how", ["commit", "seek", "start"])
def test_a_group_made_at_an_index_that_settled_a_delayed_message_waits(
        clocked: ShmBroker, clock: FakeClock, how: str) -> None:
    q = clocked.create_queue("d")  # (the default group keeps the message)
    q.create_group("a")
    off = q.put(b"x", delay=30)
    _settle_early(q, "a", how)  # before it is due
    gi = q.consumer_groups.index("a")
    q.delete_group("a")
    q.create_group("b", start="earliest")
    assert q.consumer_groups.index("b") == gi  # the index "a" had
    with pytest.raises(shmq.Empty):
        q.get(group="b", block=False)
    assert q.stats()["groups"]["b"]["delayed"] == 1
    clock.advance(30)
    m = q.get(group="b", block=False)
    assert (m.offset, m.deliveries, m.redelivered) == (off, 1, False)


def test_a_seek_back_over_a_delayed_message_settled_early_waits(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("d")
    q.create_group("audit")  # keeps both messages retained
    off = q.put(b"x", delay=30)
    q.put(b"y")
    q.commit("default", 2)  # settles the delayed one before it is due
    assert q.seek("default", 0) == 0  # back: y is delivered again at once, x when due
    assert q.get(block=False).payload == b"y"
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    clock.advance(30)
    m = q.get(block=False)
    assert (m.offset, m.payload, m.deliveries) == (off, b"x", 1)


@pytest.mark.slow
def test_a_delayed_message_settled_early_keeps_its_due_time_through_recovery(durable: Durable) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("d", durability="always")  # (the default group keeps the message)
        q.create_group("a")
        q.put(b"x", delay=600)
        q.commit("a", 1)  # before it is due: DONE for "a", with its due time
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("d")
        q.delete_group("a")
        q.create_group("b", start="earliest")  # at the index "a" had
        with pytest.raises(shmq.Empty):
            q.get(group="b", block=False)
        assert q.stats()["groups"]["b"]["delayed"] == 1


def test_leased_then_expired_delayed_message_comes_back(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("d", visibility_timeout=5)
    q.put(b"x", delay=1)
    clock.advance(1)
    m = q.get(block=False)
    clock.advance(6)
    again = q.get(block=False)
    assert (again.offset, again.deliveries) == (m.offset, 2)


def test_check_passes_with_delayed_messages(clocked: ShmBroker, clock: FakeClock, instance: str) -> None:
    q = clocked.create_queue("d")
    q.put_many([b"a", b"b"], delay=60)
    q.put(b"c")
    q.get(block=False).ack()  # the cursor steps over the delayed ones
    q.put(b"d", delay=30)
    assert check.check_instance(instance) == []
    w = q.words  # type: ignore[attr-defined]
    w[L.Q_DELAY_MAX] = 1  # the checker notices a delayed word past a lying bound
    assert any("Q_DELAY_MAX" in p for p in check.check_instance(instance))
    w[L.Q_DELAY_MAX] = 10**9


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, 8 * 86400, "3", True])
def test_bad_delay_is_invalid_and_stores_nothing(broker: shmq.Broker, bad: Any) -> None:
    q = broker.create_queue("d")
    with pytest.raises(shmq.InvalidArgument):
        q.put(b"x", delay=bad)
    with pytest.raises(shmq.InvalidArgument):
        q.put_many([b"x"], delay=bad)
    assert q.stats()["next_offset"] == 0


def test_delay_on_both_transports(broker: shmq.Broker) -> None:
    q = broker.create_queue("d")
    q.put(b"h", delay=3600, headers={"k": "v"})
    q.put_many([b"a", b"b"], delay=3600)
    q.put(b"now")
    m = q.get(timeout=1)
    assert m.payload == b"now"
    m.ack()
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    st = q.stats()["groups"]["default"]
    assert (st["delayed"], st["depth"]) == (3, 3)
    assert q.put(b"zero", delay=0) == 4
    assert q.get(timeout=1).payload == b"zero"


async def _aio(url: str) -> list[int]:
    from shmq.client import aio

    async with await aio.connect(url) as b:
        q = await b.create_queue("a")
        offs = [await q.put(b"x", delay=3600), *await q.put_many([b"y"], delay=3600)]
        with pytest.raises(shmq.Empty):
            await q.get(block=False)
        return offs


def test_aio_put_with_delay(server: Any) -> None:
    import asyncio

    assert asyncio.run(_aio(server.url)) == [0, 1]
