"""Message TTL: a queue's ``message_ttl`` expires what a group has not had delivered in time.

The ``clocked`` broker's producer timestamps and TTL clock move with the test's FakeClock
(``Attachment.wall_ns``), so expiry is exact here; over TCP the broker's real clock runs.
"""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from typer.testing import CliRunner

import shmq
from shmq.cli.app import app
from shmq.core import check
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.readings import read_queue
from tests.support.clock import FakeClock
from tests.support.durable import Durable
from tests.support.wait import wait_until


def _dlq(b: shmq.Broker, name: str) -> list[Any]:
    try:
        return b.queue(f"{name}.dlq").get_many(100, block=False)
    except (shmq.Empty, shmq.QueueNotFound):
        return []


def test_expired_message_is_dead_lettered_with_its_headers(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=10)
    q.put(b"old", headers={"k": "v"})
    clock.advance(9.999)
    q.put(b"young")
    clock.advance(0.001)  # "old" is 10 s old: expired
    m = q.get(block=False)
    assert m.payload == b"young"
    m.ack()
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    (d,) = _dlq(clocked, "t")
    assert (d.payload, d.headers) == (b"old", {"k": b"v"})
    assert d.origin is not None
    o = d.origin
    assert (o.reason, o.deliveries, o.offset, o.group) == ("ttl_expired", 0, 0, "default")
    st = q.stats()["groups"]["default"]
    assert (st["ttl_expired"], st["dead_lettered"], st["expired"], st["depth"]) == (1, 1, 0, 0)
    assert q.stats()["first_offset"] == 2
    assert check.check_instance(clocked.instance) == []


def test_just_before_the_ttl_it_is_delivered(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=10)
    q.put(b"x")
    clock.advance(9.999)
    assert q.get(block=False).payload == b"x"
    assert q.stats()["groups"]["default"]["ttl_expired"] == 0


def test_each_group_expires_on_its_own(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=5)
    q.create_group("slow")
    q.put(b"x")
    q.get(block=False).ack()  # the default group got it in time
    clock.advance(5)
    with pytest.raises(shmq.Empty):
        q.get(group="slow", block=False)
    groups = q.stats()["groups"]
    assert (groups["default"]["ttl_expired"], groups["slow"]["ttl_expired"]) == (0, 1)
    (d,) = _dlq(clocked, "t")
    assert d.origin is not None and d.origin.group == "slow"


def test_dropped_when_expired_to_dlq_is_false(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=1, expired_to_dlq=False)
    q.put_many([b"a", b"b", b"c"])
    clock.advance(1)
    q.put(b"d")
    assert [m.payload for m in q.get_many(10, block=False)] == [b"d"]
    st = q.stats()["groups"]["default"]
    assert (st["ttl_expired"], st["dead_lettered"]) == (3, 0)
    (reading,) = read_queue(q).groups  # what the Prometheus metrics show
    assert (reading.name, reading.ttl_expired) == ("default", 3)
    assert _dlq(clocked, "t") == []
    assert q.stats()["first_offset"] == 3  # the dropped ones are settled: their room is free
    assert check.check_instance(clocked.instance) == []


def test_a_leased_message_is_not_taken_and_a_nacked_one_does_not_expire(
        clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=2, visibility_timeout=60)
    q.put_many([b"a", b"b"])
    a, b = q.get_many(2, block=False)
    clock.advance(10)
    a.ack()  # still its lease: not taken by the TTL
    b.nack()  # given back after the TTL: TTL means "not delivered before", and it was
    again = q.get(block=False)
    assert (again.offset, again.deliveries) == (b.offset, 2)
    assert q.stats()["groups"]["default"]["ttl_expired"] == 0


def test_a_delay_at_or_past_the_ttl_expires_when_due(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=10)
    q.put(b"late", delay=10)  # due exactly when it expires: counted from the put
    q.put(b"soon", delay=5)
    clock.advance(5)
    assert q.get(block=False).payload == b"soon"
    clock.advance(5)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    (d,) = _dlq(clocked, "t")
    assert d.payload == b"late" and d.origin is not None and d.origin.reason == "ttl_expired"
    st = q.stats()["groups"]["default"]
    assert (st["ttl_expired"], st["delayed"], st["redelivered"]) == (1, 0, 0)
    assert check.check_instance(clocked.instance) == []


def test_a_dropped_delayed_message_frees_the_floor(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=1, expired_to_dlq=False)
    q.put(b"x", delay=2)
    q.put(b"y")
    q.get(block=False).ack()
    clock.advance(2)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert q.stats()["first_offset"] == 2
    assert q.stats()["groups"]["default"]["ttl_expired"] == 1


def test_a_batch_delivers_the_live_and_expires_the_rest(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=10)
    q.put_many([b"a", b"b", b"c"])
    clock.advance(5)
    q.put(b"d")
    q.put_many([b"e", b"f"])
    clock.advance(5)  # a, b, c are 10 s old
    got = q.get_many(10, block=False)
    assert [m.payload for m in got] == [b"d", b"e", b"f"]
    assert [m.payload for m in _dlq(clocked, "t")] == [b"a", b"b", b"c"]


@pytest.mark.parametrize("whose", ["queue", "message"])
def test_the_hot_paths_leave_expired_messages_to_the_general_path(clocked: ShmBroker, clock: FakeClock,
                                                                  whose: str) -> None:
    """The queue's TTL or each message's own: the one-message and the batch delivery
    paths hand an expired message to the general path, which expires it."""
    if whose == "queue":
        q = clocked.create_queue("t", message_ttl=1)
        q.put_many([b"a", b"b"])
    else:
        q = clocked.create_queue("t")
        q.put_many([b"a", b"b"], ttl=1)
    groups, ring = q.consumer_groups, q.ring  # type: ignore[attr-defined]
    slot = clocked._att.client_slot()  # type: ignore[attr-defined]
    with ring.clock:
        word = L.LEASED_ONCE | (slot << L.OWNER_SHIFT) | (10**6 << L.TIME_SHIFT)
        clock.advance(1)
        assert groups.deliver_one(0, groups.ref(0), word, 10**6, tuple, q, "default") is None
        assert groups.deliver_block(0, slot, 10**6, 10, 1000) is None
        assert q.words[ring.groups_w + L.G_CURSOR] == 0  # type: ignore[attr-defined]
    assert q.stats()["groups"]["default"]["ttl_expired"] == 0  # not yet looked at
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert q.stats()["groups"]["default"]["ttl_expired"] == 2


def test_repair_makes_an_expiry_cut_short_new_again(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("t", message_ttl=1)
    q.put(b"x")
    ring, groups = q.ring, q.consumer_groups  # type: ignore[attr-defined]
    lw = ring.slot_base(0) + L.S_GROUPS
    slot = clocked._att.client_slot()  # type: ignore[attr-defined]
    ring.w[lw] = L.DEADING | (slot << L.OWNER_SHIFT)  # as a deliverer killed at "ttl.expired" leaves it
    assert any("past the cursor" in p for p in check.check_instance(clocked.instance))
    with ring.clock:
        groups.repair()
    assert ring.w[lw] == L.NEW
    assert check.check_instance(clocked.instance) == []
    clock.advance(1)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert [m.payload for m in _dlq(clocked, "t")] == [b"x"]


def test_check_flags_an_undelivered_dead_letter_without_a_ttl(clocked: ShmBroker, instance: str) -> None:
    q = clocked.create_queue("plain")
    q.put(b"x")
    q.get(block=False)
    ring = q.ring  # type: ignore[attr-defined]
    lw = ring.slot_base(0) + L.S_GROUPS
    ring.w[lw] = L.DEADING | (clocked._att.client_slot() << L.OWNER_SHIFT)  # type: ignore[attr-defined]
    assert any("dead-lettered undelivered" in p for p in check.check_instance(instance))
    ring.w[lw] = L.DONE | (1 << L.DC_SHIFT)
    with ring.clock:
        q.consumer_groups.advance_floor(0)  # type: ignore[attr-defined]
    assert check.check_instance(instance) == []


def test_settings_on_both_transports(broker: shmq.Broker) -> None:
    broker.create_queue("t", message_ttl=2.5, expired_to_dlq=False)
    broker.create_queue("u")
    configs = {i.name: i.config for i in broker.list_queues()}
    assert (configs["t"].message_ttl, configs["t"].expired_to_dlq) == (2.5, False)
    assert (configs["u"].message_ttl, configs["u"].expired_to_dlq) == (0, True)


@pytest.mark.parametrize("bad", [{"message_ttl": -1}, {"message_ttl": math.nan}, {"message_ttl": math.inf},
                                 {"message_ttl": 366 * 86400}, {"message_ttl": "3"}, {"message_ttl": True},
                                 {"expired_to_dlq": 1}, {"expired_to_dlq": "no"}])
def test_bad_settings_are_invalid_and_create_nothing(broker: shmq.Broker, bad: dict[str, Any]) -> None:
    with pytest.raises(shmq.InvalidArgument):
        broker.create_queue("t", **bad)
    # (the tcp broker is the session's, shared: other tests' queues may be there)
    assert "t" not in [i.name for i in broker.list_queues()]


def test_expiry_over_tcp_on_the_real_clock(server: Any) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue("t", message_ttl=0.05)
        q.put(b"x", headers={"h": "1"})
        put_done = time.time_ns()
        wait_until(lambda: time.time_ns() > put_done + 60_000_000)  # the wall clock passes the TTL
        with pytest.raises(shmq.Empty):
            q.get(block=False)
        assert q.stats()["groups"]["default"]["ttl_expired"] == 1
        # (the broker's maintenance may have expired it: its copy follows the count)
        wait_until(lambda: "t.dlq" in {i.name for i in b.list_queues()})
        d = b.queue("t.dlq").get(timeout=5)
        assert (d.payload, d.headers) == (b"x", {"h": b"1"})
        assert d.origin is not None and d.origin.reason == "ttl_expired"


def test_cli_create_with_ttl(shm_broker: ShmBroker) -> None:
    out = CliRunner().invoke(app, ["create", "c", "--shm", shm_broker.instance, "--message-ttl", "30",
                                   "--no-expired-to-dlq"], prog_name="shmq")
    assert out.exit_code == 0, out.output
    (info,) = [i for i in shm_broker.list_queues() if i.name == "c"]
    assert (info.config.message_ttl, info.config.expired_to_dlq) == (30, False)
    out = CliRunner().invoke(app, ["create", "d", "--shm", shm_broker.instance, "--message-ttl", "-1"],
                             prog_name="shmq")
    assert out.exit_code != 0 and "message_ttl" in out.output
    assert "d" not in {i.name for i in shm_broker.list_queues()}


def test_a_journaled_queue_keeps_its_ttl_and_timestamps_across_recovery(durable: Durable) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("keep", durability="always", message_ttl=3600, expired_to_dlq=False)
        q.put(b"x")
        ts = q.get(timeout=1).timestamp_ns  # leased at the kill: given back by the recovery
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        (info,) = [i for i in b.list_queues() if i.name == "keep"]
        assert (info.config.message_ttl, info.config.expired_to_dlq) == (3600, False)
        again = b.queue("keep").get(timeout=1)  # the put's wall-clock time, which the TTL counts from
        assert (again.payload, again.timestamp_ns) == (b"x", ts)
    local = ShmBroker(durable.inst)
    try:
        ring = local.queue("keep").ring  # type: ignore[attr-defined]
        assert ring.w[L.Q_MESSAGE_TTL_MS] == 3_600_000 and ring.flags & L.F_TTL_DROP
    finally:
        local.close()
