"""Seek by time: ``create_group(start=<time>)`` and ``q.seek(group, time)`` on both transports,
the asyncio client, the command line, and a journaled queue across kill -9."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from typer.testing import CliRunner

import shmq
from shmq.cli.app import app
from shmq.client import aio
from shmq.core import layout as L
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.seektime import parse_time, to_ns
from tests.support.durable import Durable
from tests.support.seek import between, spaced
from tests.support.server import Server


def offsets(msgs: Sequence[shmq.Message]) -> list[int]:
    return [m.offset for m in msgs]


def positions(q: Any) -> dict[str, tuple[int, int]]:
    return {g: (s["floor"], s["cursor"]) for g, s in q.stats()["groups"].items()}


# ---------------------------------------------------------------- both transports
def test_group_created_at_a_time_sees_the_messages_from_then_on(broker: shmq.Broker) -> None:
    q = broker.create_queue("at")
    ts = spaced(q, 5)
    q.create_group("from2", start=between(ts, 2))
    q.create_group("from4", start=datetime.fromtimestamp(between(ts, 4), UTC))  # an aware datetime
    q.create_group("exact3", start=datetime.fromtimestamp(ts[3] // 1000 / 1e6, UTC))  # µs floor of #3
    assert offsets(q.get_many(10, group="from2", block=False)) == [2, 3, 4]
    assert offsets(q.get_many(10, group="from4", block=False)) == [4]
    assert offsets(q.get_many(10, group="exact3", block=False)) == [3, 4]
    assert q.put(b"later") == 5
    assert offsets(q.get_many(10, group="from4", block=False)) == [5]
    assert offsets(q.get_many(10, block=False)) == [0, 1, 2, 3, 4, 5]  # the default group saw all


def test_seek_forward_skips_the_older_messages_for_that_group_only(broker: shmq.Broker) -> None:
    q = broker.create_queue("fwd")
    q.create_group("other")
    ts = spaced(q, 5)
    held = q.get()  # offset 0, leased by the default group
    assert q.seek("default", between(ts, 3)) == 3
    with pytest.raises(shmq.StaleAck):
        held.ack()  # the seek settled it for this group
    assert offsets(q.get_many(10, block=False)) == [3, 4]
    assert q.stats()["groups"]["default"]["floor"] == 3
    assert offsets(q.get_many(10, group="other", block=False)) == [0, 1, 2, 3, 4]  # untouched


def test_seek_before_the_oldest_and_after_the_newest(broker: shmq.Broker) -> None:
    q = broker.create_queue("ends")
    ts = spaced(q, 4)
    q.ack_many(q.get_many(2))  # 0 and 1 freed: the default group is the only one
    assert q.stats()["first_offset"] == 2
    assert q.seek("default", 0.0) == 2  # before everything: the oldest retained
    assert q.seek("default", ts[0] / 1e9 - 3600) == 2
    assert offsets(q.get_many(10, block=False)) == [2, 3]
    assert q.seek("default", time.time() + 3600) == 4  # after the newest: the next offset
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert q.stats()["retained"] == 0  # the group passed them all: freed
    q.put(b"new")
    assert q.get(block=False).offset == 4
    q.create_group("future", start=time.time() + 3600)
    assert q.stats()["groups"]["future"]["floor"] == 5


def test_seek_back_delivers_the_retained_messages_again(broker: shmq.Broker) -> None:
    q = broker.create_queue("back", max_deliveries=3)
    q.create_group("lag")  # keeps 0..4 retained
    ts = spaced(q, 5)
    q.ack_many(q.get_many(4))  # 0..3 acked by the default group
    held = q.get()  # 4 leased
    assert q.seek("default", between(ts, 2)) == 2
    with pytest.raises(shmq.StaleAck):
        held.ack()  # its lease turned stale: 4 is delivered again
    again = q.get_many(10, block=False)
    assert [(m.offset, m.deliveries) for m in again] == [(2, 2), (3, 2), (4, 2)]
    q.ack_many(again)
    assert q.stats()["groups"]["default"]["floor"] == 5
    q.ack_many(q.get_many(2, group="lag"))  # 0, 1 freed
    assert q.stats()["first_offset"] == 2
    assert q.seek("default", 0.0) == 2  # back only as far as retained messages
    assert offsets(q.get_many(10, block=False)) == [2, 3, 4]
    assert offsets(q.get_many(10, group="lag", block=False)) == [2, 3, 4]  # the other group is as it was


def test_seek_inside_the_leased_window_settles_below_and_redelivers_above(broker: shmq.Broker) -> None:
    q = broker.create_queue("mid")
    ts = spaced(q, 5)
    held = q.get_many(5)  # 0..4 leased: floor 0, cursor 5
    assert q.seek("default", between(ts, 2)) == 2
    for m in held:  # every lease turned stale: 0, 1 settled, 2..4 delivered again
        with pytest.raises(shmq.StaleAck):
            m.ack()
    st = q.stats()["groups"]["default"]
    assert (st["floor"], st["cursor"], st["ready"], st["in_flight"]) == (2, 5, 3, 0)
    again = q.get_many(10, block=False)
    assert [(m.offset, m.deliveries) for m in again] == [(2, 2), (3, 2), (4, 2)]
    q.ack_many(again)
    assert q.stats()["retained"] == 0


def test_a_message_that_had_its_last_delivery_is_not_sought_back(broker: shmq.Broker) -> None:
    q = broker.create_queue("last", max_deliveries=1)
    q.create_group("lag")
    spaced(q, 2)
    first = q.get()
    first.ack()  # offset 0 had its one delivery
    assert q.seek("default", 0.0) == 0
    assert offsets(q.get_many(10, block=False)) == [1]  # 0 stays settled
    assert q.stats()["groups"]["default"]["dead_lettered"] == 0


@pytest.mark.parametrize("bad", [datetime(2026, 11, 24, 10, 0), "yesterday", float("nan"), -1.0, True,
                                 b"1", None, 2.0 ** 64])
def test_a_bad_time_is_a_typed_error_and_changes_nothing(broker: shmq.Broker, bad: Any) -> None:
    q = broker.create_queue("bad")
    q.create_group("g")
    q.put_many([b"a", b"b"])
    q.get()
    before = positions(q)
    with pytest.raises(shmq.InvalidArgument):
        q.seek("g", bad)
    with pytest.raises(shmq.InvalidArgument):
        q.create_group("new", start=bad)
    assert positions(q) == before and sorted(q.groups()) == ["default", "g"]


def test_an_unknown_group_or_a_taken_name_is_a_typed_error(broker: shmq.Broker) -> None:
    q = broker.create_queue("names")
    q.put(b"a")
    before = positions(q)
    with pytest.raises(shmq.GroupNotFound):
        q.seek("nope", 0.0)
    with pytest.raises(shmq.QueueExists):
        q.create_group("default", start=0.0)
    with pytest.raises(shmq.InvalidName):
        q.create_group("bad name", start=0.0)
    assert positions(q) == before and q.groups() == ["default"]


# ---------------------------------------------------------------- the search itself
def test_out_of_order_timestamps_and_tombstones_give_a_boundary(shm_broker: ShmBroker) -> None:
    """The search assumes timestamps rise with offsets; when they do not it finds *a*
    boundary (a record at or after the time, its predecessor before it).  A tombstone
    (timestamp 0) counts as the record after it."""
    q = shm_broker.create_queue("order")
    q.put_many([b"x"] * 6)
    ring, groups = q.ring, q.consumer_groups  # type: ignore[attr-defined]

    def stamp(*secs: int) -> None:
        for o, s in enumerate(secs):
            ring.w[ring.slots_w + o * ring.slot_words + L.S_TIMESTAMP] = s * 10**9

    stamp(10, 20, 0, 40, 50, 60)  # offset 2: a tombstone
    assert [groups.offset_at(s * 10**9) for s in (5, 10, 15, 25, 40, 45, 60, 61)] == [0, 0, 1, 3, 3, 4, 5, 6]
    stamp(10, 50, 20, 60, 30, 70)  # two producers' clocks interleaved
    for s in (15, 25, 55, 65):
        o = groups.offset_at(s * 10**9)
        ts = [ring.record(i)[2] for i in range(6)]
        assert (o == 6 or ts[o] >= s * 10**9) and (o == 0 or ts[o - 1] < s * 10**9), (s, o)


def test_times_and_the_command_line_forms() -> None:
    assert to_ns(1.5) == 1_500_000_000 and to_ns(2) == 2_000_000_000
    assert to_ns(datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=UTC)) == 1_000_005_000
    assert to_ns(datetime(1970, 1, 1, 1, tzinfo=UTC).astimezone()) == 3600 * 10**9  # any timezone
    assert parse_time("2026-11-24T10:00:00Z", 0) == datetime(2026, 11, 24, 10, tzinfo=UTC).timestamp()
    assert parse_time("2026-11-24T11:00:00+01:00", 0) == datetime(2026, 11, 24, 10, tzinfo=UTC).timestamp()
    assert parse_time("-5m", 1000.0) == 700.0 and parse_time("-1h", 7200.0) == 3600.0
    assert parse_time("-1.5s", 10.0) == 8.5 and parse_time(" -2d ", 2 * 86400.0) == 0.0
    for bad in ("2026-11-24T10:00:00", "yesterday", "-5y", "5m", ""):
        with pytest.raises(shmq.InvalidArgument):
            parse_time(bad, 0)
    assert math.isclose(datetime.now(UTC).timestamp() - 300, parse_time("-5m", time.time()), abs_tol=5)


def test_cli_seek_moves_a_group_and_can_create_one(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("q")
    ts = spaced(q, 3)
    at = datetime.fromtimestamp(between(ts, 2), UTC).isoformat().replace("+00:00", "Z")
    run = CliRunner().invoke
    out = run(app, ["seek", "q", "-g", "new", "--create", "-t", "-1h", "--shm", shm_broker.instance],
              prog_name="shmq")
    assert out.exit_code == 0, out.output
    assert "group new of q starts offset 0" in out.stdout
    out = run(app, ["seek", "q", "--time", at, "--shm", shm_broker.instance, "--json"], prog_name="shmq")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == {"group": "default", "offset": 2}
    assert offsets(q.get_many(10, block=False)) == [2]
    assert offsets(q.get_many(10, group="new", block=False)) == [0, 1, 2]
    out = run(app, ["seek", "q", "-t", "2026-11-24T10:00:00", "--shm", shm_broker.instance], prog_name="shmq")
    assert out.exit_code == 1 and "has no timezone" in out.stderr and "Traceback" not in out.output
    out = run(app, ["seek", "q", "-g", "nope", "-t", "-1h", "--shm", shm_broker.instance], prog_name="shmq")
    assert out.exit_code == 1 and "no group 'nope'" in out.stderr


# ---------------------------------------------------------------- asyncio, durability
def test_asyncio_client_seeks_and_creates_at_a_time(server: Server) -> None:
    async def main() -> None:
        async with await aio.connect(server.url) as b:
            q = await b.create_queue("aio_seek")
            try:
                for i in range(3):
                    await q.put(b"m%d" % i)
                    now = time.time_ns()
                    while time.time_ns() <= now + 1_000_000:  # the clock moves on (not a sync)
                        await asyncio.sleep(0)
                ts = [m.timestamp_ns for m in await q.read(0, 3)]
                await q.create_group("late", start=between(ts, 1))
                assert offsets(await q.get_many(10, group="late", block=False)) == [1, 2]
                assert await q.seek("default", between(ts, 2)) == 2
                assert offsets(await q.get_many(10, block=False)) == [2]
                with pytest.raises(shmq.InvalidArgument):
                    await q.seek("default", datetime(2026, 1, 1))
            finally:
                await b.delete_queue("aio_seek")

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.slow
def test_a_journaled_seek_survives_kill9_and_recovery(durable: Durable) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("seekd", durability="always")
        q.create_group("lag")
        ts = spaced(q, 6)
        q.ack_many(q.get_many(6))  # the default group acked everything; lag keeps it retained
        assert q.seek("default", between(ts, 2)) == 2  # back: 2..5 delivered again
        assert q.seek("lag", between(ts, 4)) == 4  # forward: 0..3 settled for lag
        q.create_group("late", start=between(ts, 5))
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("seekd")
        assert offsets(q.get_many(10, block=False)) == [2, 3, 4, 5]
        assert offsets(q.get_many(10, group="lag", block=False)) == [4, 5]
        assert offsets(q.get_many(10, group="late", block=False)) == [5]
        assert q.stats()["first_offset"] == 2



def test_a_message_reopened_by_a_seek_is_not_taken_for_a_delayed_one(shm_broker: ShmBroker) -> None:
    """Found by the model: a group made at "latest" settles a message it never had; a seek
    back reopens it (READY, 0 deliveries), which looked like a delayed message, so a group
    made again at that index kept it waiting for a due time no put ever gave it (and the
    checker saw a delay past Q_DELAY_MAX).  It is due at once now."""
    q = shm_broker.create_queue("q")
    off = q.put(b"x")
    q.create_group("g", start="latest")
    assert q.seek("g", 0) == off
    q.delete_group("g")
    q.create_group("g", start="earliest")
    assert check_instance(shm_broker.instance) == []
    m = q.get(group="g", block=False)
    assert (m.offset, m.payload, m.deliveries) == (off, b"x", 1)
