"""A list of URLs fails over with the asyncio client too (``shmq.client.aio_failover``):
``await aio.connect("tcp://a,tcp://b")`` finds the primary among them, passing standbys over,
and its handle and queue handles follow the primary when a standby is promoted.

Real brokers, as in ``test_failover``: a primary (``Server``) and a standby (``Standby``) as
subprocesses; queues are ``durability="always"`` so that they are replicated.  pytest-asyncio
is not a dependency: each test runs its coroutine with ``asyncio.run``, under a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

import shmq
from shmq import aio
from shmq.client.aio_failover import AsyncFailoverBroker, AsyncFailoverQueue
from tests.client.test_failover import fail_over, named
from tests.support.replication import TOKEN, Standby
from tests.support.server import Server

R = TypeVar("R")
DEADLINE = 90.0




def run(main: Callable[[], Awaitable[R]]) -> R:
    """Run the test's coroutine under a deadline; anything the loop would report (an exception
    nobody retrieved, a task destroyed while pending, ...) fails the test."""
    problems: list[dict[str, Any]] = []

    async def guarded() -> R:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: problems.append(ctx))
        async with asyncio.timeout(DEADLINE):
            return await main()

    result = asyncio.run(guarded())
    assert not problems, problems
    return result


async def drain(q: AsyncFailoverQueue, n: int, timeout: float = 20) -> list[shmq.Message]:
    """Lease ``n`` messages (fewer if they do not come within ``timeout``), by offset."""
    got: list[shmq.Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        try:
            got += await q.get_many(n - len(got), timeout=1)
        except (shmq.Empty, shmq.Timeout):
            pass
    return sorted(got, key=lambda m: m.offset)


def respond_once(url: str, queue: str) -> threading.Thread:
    """A thread that answers one request of ``queue`` (blocking client) with its payload, upper-cased."""
    def serve() -> None:
        with shmq.connect(url, token=TOKEN) as b:
            m = b.queue(queue).get(timeout=20)
            m.reply(bytes(m.payload).upper())
            m.ack()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


# ---------------------------------------------------------------------------- finding the primary
def test_a_list_whose_first_url_is_a_standby_connects_to_the_primary(primary: Server,
                                                                      standby: Standby) -> None:
    async def main() -> None:
        async with await aio.connect(f"{standby.url},{primary.url}", token=TOKEN) as b:
            assert isinstance(b, AsyncFailoverBroker)
            assert (b.url, b.primary_url) == (f"{standby.url},{primary.url}", primary.url)
            assert ((await b.info()).replication or {})["role"] == "primary"
            q = await b.create_queue("jobs", durability="always")
            assert isinstance(q, AsyncFailoverQueue)
            assert [await q.put(b"a"), await q.put(b"b")] == [0, 1]
            assert await q.put_many([b"c", b"d"]) == [2, 3]
            assert (await b.queue("jobs").stats())["next_offset"] == 4
            assert [i.name for i in await b.list_queues()] == ["jobs"]
            with shmq.connect(primary.url, token=TOKEN) as direct:  # they went to the primary, in order
                stored = direct.queue("jobs").read(0, 10)
            assert [bytes(r.payload) for r in stored] == [b"a", b"b", b"c", b"d"]
            m = await q.get(timeout=5)
            assert (m.offset, m.payload) == (0, b"a")
            await m.ack()
            async with contextlib.aclosing(q.subscribe(credit=2)) as sub:
                m = await anext(sub)
                assert (m.offset, m.payload) == (1, b"b")
                await m.ack()
            await b.create_queue("svc")
            responder = await asyncio.to_thread(respond_once, primary.url, "svc")
            r = await b.request("svc", b"ping", timeout=20)
            assert r.payload == b"PING"
            await asyncio.to_thread(responder.join, 20)
        assert b.closed

    run(main)


def test_a_single_url_is_still_an_async_broker(primary: Server) -> None:
    async def main() -> None:
        async with await aio.connect(primary.url, token=TOKEN) as b:
            assert type(b) is aio.AsyncBroker
            await (await b.create_queue("one")).put(b"x")
        async with await aio.connect(primary.url, token=TOKEN, failover_timeout=1.0) as fb:  # a list of one
            assert isinstance(fb, AsyncFailoverBroker) and fb.primary_url == primary.url
            assert fb.failover_timeout == 1.0
            assert (await fb.queue("one").get(timeout=5)).payload == b"x"

    run(main)


def test_everything_down_is_connection_lost_naming_each_url() -> None:
    async def main() -> None:
        start = time.monotonic()
        with pytest.raises(shmq.ConnectionLost) as e:
            await aio.connect("tcp://127.0.0.1:1,tcp://127.0.0.1:2", failover_timeout=0.5)
        took = time.monotonic() - start
        assert 0.5 <= took < 5, took
        text = str(e.value)
        assert named("tcp://127.0.0.1:1", text) and named("tcp://127.0.0.1:2", text), text
        assert "cannot connect" in text
        for bad in ("tcp://127.0.0.1:1,", "shm://default,tcp://127.0.0.1:1"):
            with pytest.raises(shmq.InvalidArgument):
                await aio.connect(bad, failover_timeout=0)
        with pytest.raises(shmq.InvalidArgument, match="failover_timeout"):
            await aio.connect("tcp://127.0.0.1:1", failover_timeout=-1)

    run(main)


# ---------------------------------------------------------------------------- fail-over
def test_the_handle_and_its_queue_follow_the_promoted_standby(primary: Server, standby: Standby) -> None:
    async def main() -> None:
        async with await aio.connect(f"{standby.url},{primary.url}", token=TOKEN) as b:
            assert isinstance(b, AsyncFailoverBroker)
            q = await b.create_queue("orders", durability="always")
            for i in range(20):
                assert await q.put(f"m{i}".encode()) == i
            leased = await q.get(timeout=5)
            assert leased.offset == 0
            with shmq.connect(primary.url, token=TOKEN) as via:  # (killed with the primary)
                await asyncio.to_thread(fail_over, primary, standby, "orders", via)
            assert await q.put(b"after") == 20  # the same queue handle, on the new primary
            assert b.primary_url == standby.url
            info = (await b.info()).replication or {}
            assert info["role"] == "primary" and info["epoch"] == 2
            with pytest.raises(shmq.ConnectionLost):  # its lease went with the old connection
                await leased.ack()
            with pytest.raises(shmq.ConnectionLost):
                await q.ack_many([leased])
            with pytest.raises(shmq.StaleAck):  # a get carrying it: acked on the primary's (AsyncQueue.get)
                await q.get(timeout=0, ack=leased)
            got = await drain(q, 21)
            assert [(m.offset, bytes(m.payload)) for m in got] == (
                [(i, f"m{i}".encode()) for i in range(20)] + [(20, b"after")])
            await q.ack_many(got)  # leased through the new connection: settled there
            with pytest.raises((shmq.Empty, shmq.Timeout)):
                await q.get(timeout=0.2)
            assert (await q.stats())["next_offset"] == 21

    run(main)


def test_a_closed_handle_does_not_look_for_a_primary(primary: Server, standby: Standby) -> None:
    async def main() -> None:
        b = await aio.connect(f"{standby.url},{primary.url}", token=TOKEN)
        q = await b.create_queue("c")
        await b.close()
        start = time.monotonic()
        with pytest.raises(shmq.ConnectionLost, match="closed"):
            await q.put(b"x")
        assert time.monotonic() - start < 1

    run(main)


def test_an_async_subscription_resumes_on_the_promoted_standby(primary: Server, standby: Standby) -> None:
    async def main() -> list[bytes]:
        seen: list[bytes] = []
        async with await aio.connect(f"{standby.url},{primary.url}", token=TOKEN, failover_timeout=30) as b:
            q = await b.create_queue("pushed", durability="always")
            await q.put_many([f"a{i}".encode() for i in range(5)])
            async with contextlib.aclosing(q.subscribe(credit=4)) as sub:
                while len(seen) < 5:
                    m: Any = await anext(sub)  # (an asyncio message: its ack is awaited)
                    seen.append(bytes(m.payload))
                    await m.ack()
                with shmq.connect(primary.url, token=TOKEN) as via:  # (killed with the primary)
                    await asyncio.to_thread(fail_over, primary, standby, "pushed", via)
                await q.put_many([b"b0", b"b1"])  # on the new primary
                while not {b"b0", b"b1"} <= set(seen):
                    m = await anext(sub)  # the same subscription, subscribed again there
                    seen.append(bytes(m.payload))
                    with contextlib.suppress(shmq.ConnectionLost, shmq.StaleAck):
                        await m.ack()
        return seen

    seen = run(main)
    assert set(seen) == {f"a{i}".encode() for i in range(5)} | {b"b0", b"b1"}
