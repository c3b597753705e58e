"""A message's own TTL: ``put(ttl=)``, ``put_many(ttl=)``, ``Publisher.put(ttl=)`` and
``shmq produce --ttl``, on both transports, on the wire and in the journal.

The ``clocked`` broker's timestamps and TTL clock move with the test's FakeClock, so the
fates below are exact; over TCP the broker's real clock runs.  Expiry by the broker's
maintenance, with no consumer, is in ``test_ttl_sweep``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import shmq
from shmq.cli.app import app
from shmq.core import check
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.errors import InvalidArgument
from shmq.journal import Journal
from shmq.protocol.codec import FrameDecoder, T
from shmq.protocol.commands import put, put_many
from shmq.protocol.produce import DELAY_FLAG, TTL_FLAG, split_prefixes
from shmq.server.parking import decode_produce
from tests.support.clock import FakeClock
from tests.support.vectors import NamedQueue, doc_vectors
from tests.support.wait import wait_until


def _dlq(b: shmq.Broker, name: str) -> list[Any]:
    try:
        return b.queue(f"{name}.dlq").get_many(100, block=False)
    except (shmq.Empty, shmq.QueueNotFound):
        return []


def _fates(dead: list[Any]) -> list[tuple[bytes, str, int, str, int]]:
    """(payload, origin group, origin offset, reason, deliveries) of dead letters, sorted."""
    out = []
    for d in dead:
        assert d.origin is not None
        out.append((bytes(d.payload), d.origin.group, d.origin.offset, d.origin.reason, d.origin.deliveries))
    return sorted(out)


def _dlq_queue(b: shmq.Broker, name: str) -> Any:
    """``name``'s dead-letter queue, once it exists (the broker's maintenance may have
    counted an expiry an instant before its copy made the queue)."""
    names = lambda: {i.name for i in b.list_queues()}  # noqa: E731
    wait_until(lambda: f"{name}.dlq" in names())
    return b.queue(f"{name}.dlq")


def _expires(q: Any, offset: int) -> int:
    ring = q.ring
    return int(ring.w[ring.slot_base(offset) + L.S_EXPIRES])


# ---------------------------------------------------------------- fates, co-located, exact clock
def test_every_message_meets_its_own_fate_in_each_group(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("m")  # no queue TTL: only the messages' own
    q.create_group("audit")
    assert q.put(b"a", ttl=10, headers={"k": "a"}) == 0
    assert q.put(b"b") == 1
    assert q.put(b"c", ttl=5) == 2
    assert q.put_many([b"d", b"e"], ttl=20) == [3, 4]
    (a,) = q.get_many(1, block=False)  # the default group gets "a" in time
    a.ack()
    clock.advance(6)  # "c" (5 s) is past its TTL, the others are not
    assert [m.payload for m in q.get_many(10, block=False)] == [b"b", b"d", b"e"]
    clock.advance(9)  # t = 15: "a" (10 s) too
    assert [m.payload for m in q.get_many(10, group="audit", block=False)] == [b"b", b"d", b"e"]
    dead = _dlq(clocked, "m")
    assert _fates(dead) == [(b"a", "audit", 0, "ttl_expired", 0), (b"c", "audit", 2, "ttl_expired", 0),
                            (b"c", "default", 2, "ttl_expired", 0)]
    assert {bytes(d.payload): dict(d.headers) for d in dead}[b"a"] == {"k": b"a"}
    groups = q.stats()["groups"]
    assert (groups["default"]["ttl_expired"], groups["audit"]["ttl_expired"]) == (1, 2)
    assert (groups["default"]["dead_lettered"], groups["audit"]["dead_lettered"]) == (1, 2)
    assert check.check_instance(clocked.instance) == []


def test_the_shorter_of_the_queue_ttl_and_the_message_ttl_counts(clocked: ShmBroker,
                                                                 clock: FakeClock) -> None:
    q = clocked.create_queue("m", message_ttl=10)
    q.put(b"long", ttl=20)  # the queue's 10 s count
    q.put(b"short", ttl=3)  # its own 3 s count
    q.put(b"plain")
    clock.advance(3)
    got = q.get_many(1, block=False)  # "long" is live
    assert [m.payload for m in got] == [b"long"]
    assert [m.payload for m in q.get_many(10, block=False)] == [b"plain"]
    q.put(b"late", ttl=20)
    clock.advance(9.999)
    q.put(b"next", ttl=1)
    clock.advance(0.001)  # "late" is 10 s old: the queue's TTL
    assert [m.payload for m in q.get_many(10, block=False)] == [b"next"]
    assert [(f[0], f[2]) for f in _fates(_dlq(clocked, "m"))] == [(b"late", 3), (b"short", 1)]


def test_dropped_when_the_queue_says_so(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("m", expired_to_dlq=False)  # no queue TTL, but it drops expired ones
    q.put_many([b"a", b"b"], ttl=1)
    q.put(b"c")
    clock.advance(1)
    (c,) = q.get_many(10, block=False)
    assert c.payload == b"c"
    c.ack()
    st = q.stats()
    assert (st["groups"]["default"]["ttl_expired"], st["groups"]["default"]["dead_lettered"]) == (2, 0)
    assert _dlq(clocked, "m") == []
    assert st["first_offset"] == 3  # settled: their room is free
    assert check.check_instance(clocked.instance) == []


def test_a_leased_message_is_kept_and_a_given_back_one_never_expires(clocked: ShmBroker,
                                                                      clock: FakeClock) -> None:
    q = clocked.create_queue("m", visibility_timeout=60)
    q.put_many([b"a", b"b"], ttl=2)
    a, b = q.get_many(2, block=False)
    clock.advance(10)
    a.ack()  # still its lease
    b.nack()  # given back after its TTL: it was delivered in time
    again = q.get(block=False)
    assert (again.offset, again.deliveries) == (b.offset, 2)
    clock.advance(61)  # its lease runs out: given back again, still not expired
    assert q.get(block=False).deliveries == 3
    assert q.stats()["groups"]["default"]["ttl_expired"] == 0


def test_a_delayed_message_keeps_its_ttl_from_the_put(clocked: ShmBroker, clock: FakeClock) -> None:
    q = clocked.create_queue("m")
    q.put(b"kept", delay=5, ttl=10)
    q.put(b"lost", delay=5, ttl=6)
    q.put_many([b"x"], delay=2, ttl=3)
    clock.advance(5)  # all three due; "x" (3 s from its put) expired at 3
    (kept,) = q.get_many(1, block=False)
    assert (kept.payload, kept.deliveries, kept.redelivered) == (b"kept", 1, False)
    clock.advance(1)  # t = 6: "lost" expires undelivered
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    assert [(f[0], f[3]) for f in _fates(_dlq(clocked, "m"))] == [(b"lost", "ttl_expired"),
                                                                  (b"x", "ttl_expired")]
    clock.advance(10)
    kept.nack()  # given back past its TTL: delivered once already, so it does not expire
    assert q.get(block=False).payload == b"kept"
    st = q.stats()["groups"]["default"]
    assert (st["ttl_expired"], st["delayed"]) == (2, 0)
    assert check.check_instance(clocked.instance) == []


def test_the_slot_and_header_words(clocked: ShmBroker, clock: FakeClock, instance: str) -> None:
    q = clocked.create_queue("m")
    q.put(b"plain")
    assert (_expires(q, 0), q.words[L.Q_EXPIRES_MAX]) == (0, 0)  # type: ignore[attr-defined]
    q.put(b"timed", ttl=30)
    ts = q.read(1)[0].timestamp_ns
    assert _expires(q, 1) == ts + 30 * 10**9 == q.words[L.Q_EXPIRES_MAX]  # type: ignore[attr-defined]
    assert check.check_instance(instance) == []
    q.words[L.Q_EXPIRES_MAX] = ts  # type: ignore[attr-defined]  # a bound that lies
    assert any("Q_EXPIRES_MAX" in p for p in check.check_instance(instance))
    q.words[L.Q_EXPIRES_MAX] = ts + 30 * 10**9  # type: ignore[attr-defined]
    ring = q.ring  # type: ignore[attr-defined]
    ring.w[ring.slot_base(1) + L.S_EXPIRES] = ts  # expiring at its own put
    assert any("within a year" in p for p in check.check_instance(instance))
    ring.w[ring.slot_base(1) + L.S_EXPIRES] = ts + 30 * 10**9
    assert check.check_instance(instance) == []


def test_a_dead_letter_queue_takes_no_ttl(clocked: ShmBroker) -> None:
    clocked.create_queue("m")
    dlq = clocked.create_queue("m.dlq", dead_letter=True)
    with pytest.raises(shmq.InvalidArgument):
        dlq.put(b"x", ttl=5)
    assert dlq.stats()["next_offset"] == 0


# ---------------------------------------------------------------- both transports
BAD = [-1, 0, 0.0, math.nan, math.inf, -math.inf, 366 * 86400, "3", True, b"1"]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_bad_ttl_is_invalid_and_stores_nothing(broker: shmq.Broker, bad: Any) -> None:
    q = broker.create_queue("bad")
    with pytest.raises(shmq.InvalidArgument):
        q.put(b"x", ttl=bad)
    with pytest.raises(shmq.InvalidArgument):
        q.put_many([b"x", b"y"], ttl=bad)
    with pytest.raises(shmq.InvalidArgument), q.publisher() as p:
        p.put(b"x", ttl=bad)
    assert q.stats()["next_offset"] == 0


@pytest.mark.parametrize(("delay", "ttl"), [(5, 5), (5, 4.9), (0.002, 0.0015)])
def test_a_ttl_not_longer_than_the_delay_is_invalid(broker: shmq.Broker, delay: float, ttl: float) -> None:
    q = broker.create_queue("bad")
    with pytest.raises(shmq.InvalidArgument, match="longer than the delay"):
        q.put(b"x", delay=delay, ttl=ttl)
    with pytest.raises(shmq.InvalidArgument):
        q.put_many([b"x"], delay=delay, ttl=ttl)
    with pytest.raises(shmq.InvalidArgument), q.publisher() as p:
        p.put(b"x", delay=delay, ttl=ttl)
    assert q.stats()["next_offset"] == 0


def test_expiry_on_the_real_clock(broker: shmq.Broker) -> None:
    q = broker.create_queue("real")
    q.put(b"gone", ttl=0.05, headers={"h": "1"})
    q.put_many([b"kept"], ttl=3600)
    put_done = time.time_ns()
    wait_until(lambda: time.time_ns() > put_done + 60_000_000)  # the wall clock passes the TTL
    (m,) = q.get_many(10, timeout=1)
    assert m.payload == b"kept"
    assert q.stats()["groups"]["default"]["ttl_expired"] == 1
    d = _dlq_queue(broker, "real").get(timeout=5)
    assert (d.payload, d.headers) == (b"gone", {"h": b"1"})
    assert d.origin is not None and (d.origin.reason, d.origin.offset) == ("ttl_expired", 0)


def test_the_publisher_takes_delay_and_ttl(broker: shmq.Broker) -> None:
    q = broker.create_queue("pub")
    with q.publisher(window=2) as p:
        p.put(b"gone", ttl=0.05)
        p.put(b"later", delay=3600, ttl=7200, headers={"k": "v"})
        p.put(b"now")
        p.put(b"delayed", delay=3600)
        p.put_many([b"batch gone", b"batch gone too"], ttl=0.05)
        p.put_many([b"batch delayed"], delay=3600)
    assert (p.confirmed, p.last_offset) == (7, 6)
    put_done = time.time_ns()
    wait_until(lambda: time.time_ns() > put_done + 60_000_000)
    (m,) = q.get_many(10, timeout=1)
    assert m.payload == b"now"
    st = q.stats()["groups"]["default"]
    assert (st["delayed"], st["ttl_expired"]) == (3, 3)
    dlq, got = _dlq_queue(broker, "pub"), list[Any]()
    while len(got) < 3:  # (copies made by two processes may land apart: Empty after 5 s without one)
        got += dlq.get_many(10, timeout=5)
    assert sorted(d.payload for d in got) == [b"batch gone", b"batch gone too", b"gone"]


async def _aio(url: str) -> tuple[list[int], int]:
    import asyncio

    from shmq.client import aio

    async with await aio.connect(url) as b:
        q = await b.create_queue("aio-ttl")
        offs = [await q.put(b"x", ttl=0.05), *await q.put_many([b"y"], ttl=3600)]
        with pytest.raises(shmq.InvalidArgument):
            await q.put(b"z", ttl=0)
        put_done = time.time_ns()
        while time.time_ns() < put_done + 60_000_000:
            await q.stats()  # (a round trip; the wall clock passes the TTL meanwhile)
        got = await q.get_many(10, timeout=1)
        assert [m.payload for m in got] == [b"y"]
        stats = await q.stats()
        async with asyncio.timeout(10):  # (the expiry may be counted an instant before its copy lands)
            while "aio-ttl.dlq" not in {i.name for i in await b.list_queues()}:
                await asyncio.sleep(0.005)
        dead = await b.queue("aio-ttl.dlq").get_many(10, timeout=5)
        assert [m.payload for m in dead] == [b"x"]  # the expired one's fate
        await b.delete_queue("aio-ttl")
        await b.delete_queue("aio-ttl.dlq")
        return offs, stats["groups"]["default"]["ttl_expired"]


def test_the_asyncio_client_puts_with_a_ttl(server: Any) -> None:
    import asyncio

    assert asyncio.run(_aio(server.url)) == ([0, 1], 1)


# ---------------------------------------------------------------- the wire
def test_the_documented_ttl_frames_are_what_clients_send_and_the_broker_reads() -> None:
    docs = doc_vectors("prefixed")
    assert sorted(docs) == ["produce_batch_ttl", "produce_delay_ttl_headers", "produce_ttl"]
    sent = {
        "produce_ttl": put(NamedQueue("orders"), b"hi", False, None, None, None, 60),  # type: ignore[arg-type]
        "produce_delay_ttl_headers": put(NamedQueue("orders"), b"hi", False, None, {"k": "v"}, 1.5,  # type: ignore[arg-type]
                                         60),
        "produce_batch_ttl": put_many(NamedQueue("q"), [b"a", b"bc"], False, None, None, None, ttl=60),  # type: ignore[arg-type]
    }
    ids = {"produce_ttl": 21, "produce_delay_ttl_headers": 22, "produce_batch_ttl": 23}
    for name, req in sent.items():
        assert req.encode(ids[name], *req.args) == docs[name], name  # type: ignore[union-attr]
    read = {name: FrameDecoder().feed(raw)[0] for name, raw in docs.items()}
    assert read["produce_ttl"].status == TTL_FLAG
    assert decode_produce(read["produce_ttl"]) == {"queue": "orders", "timeout_ms": 0, "payload": b"hi",
                                                   "delay_ms": 0, "ttl_ms": 60_000, "priority": 0}
    both = decode_produce(read["produce_delay_ttl_headers"])
    assert (both["delay_ms"], both["ttl_ms"], both["payload"], bytes(both["meta"])) == (
        1500, 60_000, b"hi", bytes.fromhex("01 0001 0001 6b 0001 76"))
    batch = decode_produce(read["produce_batch_ttl"])
    assert (batch["ttl_ms"], batch["payloads"]) == (60_000, [b"a", b"bc"])
    assert read["produce_batch_ttl"].type == T.PRODUCE_BATCH


REST = "0006 6f7264657273 00000000 6869"  # queue "orders", timeout_ms 0, payload "hi"


@pytest.mark.parametrize(("status", "body"), [
    (TTL_FLAG, "0000000000000000" + REST),  # a TTL of 0
    (TTL_FLAG, f"{366 * 86400 * 1000:016x}" + REST),  # past a year
    (TTL_FLAG, "000000000000ea"),  # shorter than its prefix
    (DELAY_FLAG | TTL_FLAG, "000005dc 000000000000ea60"),  # no room for both prefixes' rest: fine
    (DELAY_FLAG | TTL_FLAG, "000005dc 00000000000005dc" + REST),  # not longer than the delay
])
def test_the_broker_refuses_a_bad_ttl_prefix(status: int, body: str) -> None:
    raw = bytes.fromhex(body.replace(" ", ""))
    if len(raw) == 12:  # both prefixes and an empty rest: read, the rest left to the body decoder
        assert split_prefixes(status, raw) == (1500, 60_000, b"")
        return
    with pytest.raises(InvalidArgument):
        split_prefixes(status, raw)


def test_a_bad_ttl_frame_gets_an_error_and_stores_nothing(instance: str) -> None:
    from shmq.core.serverqueue import ServerBroker
    from shmq.errors import Status
    from shmq.protocol.codec import encode_body, encode_frame
    from shmq.server.core import Core
    from tests.support.peer import Peer

    sb = ServerBroker(instance)
    try:
        p = Peer(Core(sb, worker_id=3, token=""))
        p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="w", config={})
        body = encode_body(T.PRODUCE, queue="w", timeout_ms=0, payload=b"x")
        p.feed(encode_frame(T.PRODUCE, 50, bytes(8) + body, TTL_FLAG))
        p.feed(encode_frame(T.PRODUCE, 51, (5000).to_bytes(8, "big") + body, TTL_FLAG))
        (bad, good) = p.frames()
        assert (bad.msg_id, bad.type, bad.status) == (50, T.ERROR, Status.INVALID_ARGUMENT)
        assert (good.msg_id, good.type) == (51, T.PRODUCE_OK)
        q = sb.broker.queue("w")
        assert q.stats()["next_offset"] == 1
        assert _expires(q, 0) == q.read(0)[0].timestamp_ns + 5 * 10**9
    finally:
        sb.close()


# ---------------------------------------------------------------- the journal and the CLI
def test_the_journal_keeps_each_message_expiry(tmp_path: Path) -> None:
    j = Journal(tmp_path, "q")
    j.append_messages([(0, 10, b"a"), (1, 11, b"b", b"", 5_000), (2, 12, b"c", b"\x01m", 0)])
    j.append_messages([(3, 13, b"d", b"m")])  # no expiry in this record: the format before
    j.sync()
    j.close()
    j = Journal(tmp_path, "q")
    try:
        rec = j.recover()
        assert [(o, ts, bytes(p)) for o, ts, p in rec.messages] == [(0, 10, b"a"), (1, 11, b"b"),
                                                                   (2, 12, b"c"), (3, 13, b"d")]
        assert rec.expires == {1: 5_000}
        assert {o: bytes(m) for o, m in rec.metas.items()} == {2: b"\x01m", 3: b"m"}
        assert rec.problems == []
    finally:
        j.close()


def test_cli_produce_with_ttl(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("c")
    run = CliRunner()
    out = run.invoke(app, ["produce", "c", "a", "b", "--ttl", "30", "--shm", shm_broker.instance],
                     prog_name="shmq")
    assert out.exit_code == 0, out.output
    for o in (0, 1):
        assert _expires(q, o) == q.read(o)[0].timestamp_ns + 30 * 10**9
    for bad in (["--ttl", "0"], ["--ttl", "-3"], ["--ttl", "5", "--delay", "5"], ["--ttl", "nan"]):
        out = run.invoke(app, ["produce", "c", "x", *bad, "--shm", shm_broker.instance], prog_name="shmq")
        assert out.exit_code != 0 and "ttl" in out.output, (bad, out.output)
    assert q.stats()["next_offset"] == 2
