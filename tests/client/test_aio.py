"""shmq.client.aio, the asyncio client, against a real ``shmq serve``.

pytest-asyncio is not a dependency: every test is a plain function that runs
its coroutine with ``asyncio.run`` (under a deadline, so a hang fails fast).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as stdlib_queue
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

import shmq
from shmq.client import aio
from tests.support.server import Server

DEADLINE = 15.0


class _Complaints(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not record.getMessage().startswith("Executing "):  # debug mode's slow-callback notes
            self.records.append(record.getMessage())


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    """Run the test's coroutine in debug mode; anything the loop would report (an
    exception nobody retrieved, a task destroyed while pending, a write to a closed
    transport, ...) fails the test."""
    problems: list[Any] = []
    complaints = _Complaints()
    log = logging.getLogger("asyncio")

    async def guarded() -> Any:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: problems.append(ctx))
        async with asyncio.timeout(DEADLINE):
            return await main()

    log.addHandler(complaints)
    try:
        result = asyncio.run(guarded(), debug=True)
    finally:
        log.removeHandler(complaints)
    assert not problems, problems
    assert not complaints.records, complaints.records
    return result


def qname(request: pytest.FixtureRequest) -> str:
    """A queue name of the test's own (a parametrized test's id made a valid name)."""
    return "aio_" + re.sub(r"[^A-Za-z0-9._-]", "_", request.node.name.removeprefix("test_"))[:150]


@contextlib.asynccontextmanager
async def fresh_queue(server: Server, name: str, **limits: Any) -> AsyncIterator[tuple[aio.AsyncBroker,
                                                                                       aio.AsyncQueue]]:
    """A broker connection and a new queue, both gone afterwards (the queue's DLQ too)."""
    b = await aio.connect(server.url)
    try:
        q = await b.create_queue(name, **limits)
        try:
            yield b, q
        finally:
            await b.delete_queue(name)
            with contextlib.suppress(shmq.QueueNotFound):
                await b.delete_queue(name + ".dlq")
    finally:
        await b.close()


def test_put_get_ack_round_trip(server: Server, request: pytest.FixtureRequest) -> None:
    name = qname(request)

    async def main() -> None:
        async with await aio.connect(server.url) as b:
            assert isinstance(b.worker, int) and b.server
            q = await b.create_queue(name)
            try:
                assert name in [i.name for i in await b.list_queues()]
                before = time.time()
                off = await q.put("héllo")
                m = await q.get(timeout=5)
                assert isinstance(m, aio.AsyncMessage) and isinstance(m, shmq.Message)
                assert (m.queue, m.group, m.offset, m.deliveries) == (name, "default", off, 1)
                assert m.payload == "héllo".encode() and m.text == "héllo"
                assert not m.redelivered and m.origin is None and m.meta == b""
                assert before - 1 <= m.timestamp <= time.time() + 1
                assert m.timestamp == m.timestamp_ns / 1e9
                assert repr(m).startswith("AsyncMessage(")
                await m.touch(10.0)
                await m.ack()
                with pytest.raises(shmq.StaleAck):
                    await m.ack()
                with pytest.raises(shmq.Empty):
                    await q.get(block=False)
                assert (await q.stats())["retained"] == 0
            finally:
                await b.delete_queue(name)
        assert b.closed
        with pytest.raises(shmq.ConnectionLost):
            await q.put(b"after close")

    run(main)


def test_acks_without_waiting_are_applied_before_the_next_request(server: Server,
                                                                   request: pytest.FixtureRequest) -> None:
    """ack(wait=False) / ack_many(wait=False): no answer awaited; the broker applies them
    in order before the connection's next request, and reports stale ones in
    ``nowait_errors`` (the rest of a batch is applied)."""
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (b, q):
            await q.put_many([b"%d" % i for i in range(6)])
            read = (await q.read(0))[0]
            with pytest.raises(shmq.StaleAck):  # read() is not a lease: known at once
                await read.ack(wait=False)
            one, two = await q.get(timeout=5), await q.get(timeout=5)
            await one.ack(wait=False)
            rest = await q.get_many(10, timeout=5)
            assert len(rest) == 4
            await q.ack_many(rest, wait=False)
            st = await q.stats()
            assert st["groups"]["default"]["acked"] == 5 and st["groups"]["default"]["in_flight"] == 1
            assert not b.nowait_errors
            await one.ack(wait=False)  # stale: settled already
            await q.ack_many([two, rest[0]], wait=False)  # one stale, one applied
            st = await q.stats()  # the errors come before this answer
            errs = list(b.nowait_errors)
            assert [type(e) for e in errs] == [shmq.StaleAck, shmq.StaleAck] and "1 of 2" in str(errs[1])
            assert st["groups"]["default"]["acked"] == 6 and st["retained"] == 0

    run(main)


def test_put_many_get_many_ack_many(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            assert await q.put_many([]) == []
            offs = await q.put_many([f"m{i}".encode() for i in range(10)])
            assert offs == list(range(offs[0], offs[0] + 10))
            msgs = await q.get_many(100, timeout=5)
            assert [m.offset for m in msgs] == offs
            assert [m.payload for m in msgs] == [f"m{i}".encode() for i in range(10)]
            await q.ack_many(msgs[:7])
            with pytest.raises(shmq.StaleAck) as e:
                await q.ack_many(msgs[5:])  # 5 and 6 are acked already; 7..9 are applied
            assert e.value.stale == offs[5:7]  # type: ignore[attr-defined]
            assert (await q.stats())["retained"] == 0
            with pytest.raises(shmq.InvalidArgument):
                await q.get_many(0)
            with pytest.raises(shmq.LimitExceeded):
                await q.put_many([b"x"] * 10_001)

    run(main)


def test_concurrent_requests_are_pipelined_on_one_connection(server: Server,
                                                             request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            offs = await asyncio.gather(*(q.put(f"{i}".encode()) for i in range(100)))
            assert len(set(offs)) == 100
            assert sorted(offs) == list(range(min(offs), min(offs) + 100))
            # 100 concurrent gets on the same connection: each gets its own message
            msgs = await asyncio.gather(*(q.get(timeout=5) for _ in range(100)))
            assert sorted(m.payload for m in msgs) == sorted(f"{i}".encode() for i in range(100))
            await asyncio.gather(*(m.ack() for m in msgs))
            assert (await q.stats())["retained"] == 0

    run(main)


def test_blocked_get_is_woken_by_a_put_from_another_connection(server: Server,
                                                               request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (b, q):
            getter = asyncio.create_task(q.get(timeout=10))
            await asyncio.sleep(0.2)
            assert not getter.done()
            # a request sent after the parked get is answered meanwhile (no head-of-line blocking)
            assert (await q.stats())["retained"] == 0
            async with await aio.connect(server.url) as other:
                t0 = time.monotonic()
                await other.queue(q.name).put(b"wake up")
                m = await getter
                assert time.monotonic() - t0 < 2.0
            assert m.payload == b"wake up"
            await m.ack()

    run(main)


def test_get_times_out_with_empty(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            t0 = time.monotonic()
            with pytest.raises(shmq.Empty) as e:
                await q.get(timeout=0.3)
            assert 0.25 <= time.monotonic() - t0 < 3.0
            assert isinstance(e.value, stdlib_queue.Empty)
            with pytest.raises(shmq.Empty):
                await q.get(block=False)
            with pytest.raises(shmq.Empty):
                await q.get_many(5, timeout=0.05)
            with pytest.raises(shmq.InvalidArgument):
                await q.get(timeout=-1)

    run(main)


def test_full_queue_put_times_out(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request), capacity=2) as (_, q):
            await q.put_many([b"a", b"b"])
            with pytest.raises(shmq.Full):
                await q.put(b"c", block=False)
            with pytest.raises(shmq.Full):
                await q.put(b"c", timeout=0.1)

    run(main)


def test_stale_ack_after_nack(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            await q.put(b"x")
            m = await q.get(timeout=5)
            await m.nack()
            for settle in (m.ack, m.nack, m.touch, m.dead_letter):
                with pytest.raises(shmq.StaleAck):
                    await settle()
            again = await q.get(timeout=5)
            assert again.offset == m.offset and again.deliveries == 2
            await again.ack()

    run(main)


@pytest.mark.parametrize("wait", [True, False])
def test_ack_many_of_another_queues_message_settles_nothing_here(
        server: Server, request: pytest.FixtureRequest, wait: bool) -> None:
    """As the sync clients: a lease of queue A in queue B's ack_many is stale there, raised
    at once, and B's delivery of the same offset, group and count stays leased."""
    async def main() -> None:
        async with fresh_queue(server, qname(request) + "a") as (b, qa), \
                   fresh_queue(server, qname(request) + "b") as (_, qb):
            qb_here = b.queue(qb.name)  # the same connection as qa's messages
            await qa.put_many([b"a0", b"a1"])
            await qb_here.put_many([b"b0", b"b1"])
            ma, mb = await qa.get_many(2, timeout=5), await qb_here.get_many(2, timeout=5)
            assert [(m.offset, m.deliveries) for m in ma] == [(m.offset, m.deliveries) for m in mb]
            with pytest.raises(shmq.StaleAck) as e:
                await qb_here.ack_many([ma[0], mb[1]], wait=wait)
            assert e.value.stale == [0]  # type: ignore[attr-defined]
            st = (await qb_here.stats())["groups"]["default"]
            assert (st["acked"], st["in_flight"]) == (1, 1)
            await mb[0].ack()
            await qa.ack_many(ma)
            assert not b.nowait_errors

    run(main)


def test_nack_with_delay_redelivers_later(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            off = await q.put(b"later")
            m = await q.get(timeout=5)
            t0 = time.monotonic()
            await m.nack(delay=0.4)
            with pytest.raises(shmq.Empty):
                await q.get(block=False)
            again = await q.get(timeout=5)
            assert time.monotonic() - t0 >= 0.35
            assert (again.offset, again.deliveries, again.redelivered) == (off, 2, True)
            await again.ack()
            with pytest.raises(shmq.InvalidArgument):
                await again.nack(delay=-1)

    run(main)


def test_typed_errors(server: Server, request: pytest.FixtureRequest) -> None:
    name = qname(request)

    async def main() -> None:
        async with await aio.connect(server.url) as b:
            missing = b.queue(name + "_missing")  # no round trip: fails on first use
            with pytest.raises(shmq.QueueNotFound):
                await missing.put(b"x")
            with pytest.raises(shmq.QueueNotFound):
                await missing.get(block=False)
            with pytest.raises(shmq.QueueNotFound):
                await missing.stats()
            with pytest.raises(shmq.QueueNotFound):
                await b.delete_queue(name + "_missing")
            with pytest.raises(shmq.InvalidName):
                b.queue("no/slashes")
            with pytest.raises(shmq.InvalidName):
                await b.create_queue("..")
            await b.create_queue(name)
            try:
                with pytest.raises(shmq.QueueExists):
                    await b.create_queue(name)
                # the connection is still good after errors
                assert await b.queue(name).put(b"ok") == 0
            finally:
                await b.delete_queue(name)
        with pytest.raises(shmq.InvalidArgument):
            await aio.connect("shm://default")
        with pytest.raises(shmq.ConnectionLost):
            await aio.connect("tcp://127.0.0.1:1")

    run(main)


def test_groups_read_commit_purge_dead_letter(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request), max_groups=4) as (b, q):
            await q.put_many([b"a", b"b", b"c"])
            await q.create_group("g2")
            assert sorted(await q.groups()) == ["default", "g2"]
            with pytest.raises(shmq.InvalidArgument):
                await q.create_group("g3", start="middle")
            recs = await q.read(0, max_messages=10)
            assert [m.payload for m in recs] == [b"a", b"b", b"c"] and recs[0].group is None
            with pytest.raises(shmq.StaleAck):
                await recs[0].ack()  # read() is not a lease
            await q.commit("g2", 2)
            assert (await q.get(timeout=5, group="g2")).payload == b"c"
            m = await q.get(timeout=5)
            await m.dead_letter()
            dlq = b.queue(q.name + ".dlq")
            dead = await dlq.get(timeout=5)
            assert dead.payload == b"a" and dead.origin is not None
            assert (dead.origin.queue, dead.origin.offset) == (q.name, m.offset)
            await dead.ack()
            await q.delete_group("g2")
            assert await q.groups() == ["default"]
            assert await q.purge() >= 0
            assert (await q.stats())["name"] == q.name

    run(main)


def test_subscribe_with_credit_delivers_in_order(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (b, q):
            sent = [f"{i}".encode() for i in range(50)]
            await q.put_many(sent)
            got = []
            async with contextlib.aclosing(q.subscribe(credit=10)) as sub:
                async for m in sub:
                    assert m.group == "default" and m.deliveries == 1
                    got.append(m.payload)
                    await m.ack()
                    if len(got) == 50:
                        break
            assert got == sent
            assert not b._conn.subscriptions  # unsubscribed
            assert (await q.stats())["retained"] == 0
            with pytest.raises(shmq.Empty):
                await q.get(block=False)

    run(main)


def test_subscribe_gives_back_what_it_did_not_hand_out(server: Server,
                                                      request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            await q.put_many([f"{i}".encode() for i in range(20)])
            async with await aio.connect(server.url) as sb:
                sub = sb.queue(q.name).subscribe(credit=10)
                first = await anext(sub)
                await first.ack()
                await sub.aclose()  # 9 or 10 more were pushed ahead: they go back at once
                assert not sb._conn.subscriptions
                rest: list[aio.AsyncMessage] = []
                while len(rest) < 19:  # far sooner than the 30 s visibility timeout
                    rest += await q.get_many(19 - len(rest), timeout=5)
            assert sorted(int(m.payload) for m in rest) == list(range(1, 20))
            await q.ack_many(rest)

    run(main)


def test_leaving_async_for_unsubscribes_even_when_the_broker_closes_at_once(
        server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            await q.put_many([b"x"] * 300)
            async with await aio.connect(server.url) as sb:
                async for m in sb.queue(q.name).subscribe(credit=200):
                    await m.ack()
                    break  # no aclose(): the loop closes the generator once it is garbage
                await sb.list_queues()  # meanwhile the generator sends UNSUBSCRIBE
            # the connection's leases came back with it
            msgs = await q.get_many(1000, timeout=5)
            while len(msgs) < 299:
                msgs += await q.get_many(1000, timeout=5)
            assert len(msgs) == 299
            await q.ack_many(msgs)

    run(main)


def test_subscribe_to_a_missing_queue_raises(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with await aio.connect(server.url) as b:
            with pytest.raises(shmq.QueueNotFound):
                async for _ in b.queue(qname(request)).subscribe():
                    pass
            assert not b._conn.subscriptions

    run(main)


def test_close_fails_a_pending_get(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            b = await aio.connect(server.url)
            mine = b.queue(q.name)
            getter = asyncio.create_task(mine.get())  # waits forever
            sub = mine.subscribe()
            subscriber = asyncio.create_task(anext(sub))
            await asyncio.sleep(0.2)
            assert not getter.done() and not subscriber.done()
            await b.close()
            with pytest.raises(shmq.ConnectionLost):
                await getter
            with pytest.raises(shmq.ConnectionLost):
                await subscriber
            with pytest.raises(shmq.ConnectionLost):
                await mine.put(b"x")
            await b.close()  # twice is fine
            assert (await q.stats())["retained"] == 0

    run(main)


def test_cancelled_get_gives_its_message_back(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request)) as (_, q):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(q.get(), 0.2)  # the CONSUME stays parked at the broker
            await q.put(b"x")  # taken by the orphaned CONSUME, which the client gives back
            m = await q.get(timeout=5)
            assert m.payload == b"x" and m.deliveries == 2
            await m.ack()

    run(main)


def test_bad_token_is_an_auth_error() -> None:
    srv = Server(workers=1, token="s3cret")
    try:
        async def main() -> None:
            with pytest.raises(shmq.AuthError):
                await aio.connect(srv.url, token="wrong")
            async with await aio.connect(srv.url, token="s3cret") as b:
                assert await b.list_queues() == []

        run(main)
    finally:
        assert srv.stop() == 0


def test_idempotent_producer_and_always_queue(server: Server, request: pytest.FixtureRequest) -> None:
    async def main() -> None:
        async with fresh_queue(server, qname(request), durability="always") as (_b, q):
            assert await q.put_many([b"a", b"b"], producer="p", seq=1) == [0, 1]
            with pytest.raises(shmq.Duplicate):
                await q.put_many([b"a", b"b"], producer="p", seq=1)
            assert await q.put(b"c") == 2  # confirmed once journaled
            m = await q.get(timeout=5)
            await m.ack()
            assert (await q.stats())["durable_offset"] == 3
    run(main)
