"""The stdlib's shape, for real: ``get(block, timeout)`` first as ``queue.Queue.get`` (the group
a keyword), ``put_nowait`` / ``get_nowait``, ``shmq.Empty`` / ``shmq.Full`` caught as the
stdlib's, a clear error for the old ``get("billing")``, and ``create_group(exist_ok=True)``;
on shared memory, over TCP, through a fail-over handle and with the asyncio clients.

(The parameters of every client against ``shmq.api.Queue`` are ``test_signatures``'.)"""

from __future__ import annotations

import asyncio
import itertools
import os
import queue as stdlib_queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shmq
from shmq.client import aio
from shmq.core.colocated import ShmBroker
from tests.support.server import Server

_names = itertools.count()


@pytest.fixture(params=["shm", "tcp", "failover"])
def q(request: pytest.FixtureRequest, instance: str) -> Iterator[shmq.Queue]:
    """A fresh queue with room for two messages: co-located, over TCP, and through a fail-over
    handle (a list of one URL)."""
    if request.param == "shm":
        sb = ShmBroker(instance)
        yield sb.create_queue("shape", capacity=2)
        sb.destroy()
        return
    srv: Server = request.getfixturevalue("server")
    kw: dict[str, Any] = {"failover_timeout": 5.0} if request.param == "failover" else {}
    name = f"shape_{os.getpid()}_{next(_names)}"
    with shmq.connect(srv.url, **kw) as b:
        yield b.create_queue(name, capacity=2)
        b.delete_queue(name)


def test_get_false_on_an_empty_queue_raises_empty_at_once_and_it_is_the_stdlibs(q: shmq.Queue) -> None:
    with pytest.raises(shmq.Empty):
        q.get(False)
    with pytest.raises(stdlib_queue.Empty):  # ``except queue.Empty`` works
        q.get_nowait()
    with pytest.raises(shmq.Empty):
        q.get_many(5, False)
    assert issubclass(shmq.Empty, stdlib_queue.Empty) and issubclass(shmq.Full, stdlib_queue.Full)


def test_get_true_with_a_timeout_waits_that_long_then_raises_empty(q: shmq.Queue) -> None:
    t0 = time.monotonic()
    with pytest.raises(shmq.Empty):
        q.get(True, 0.05)
    assert time.monotonic() - t0 >= 0.05
    t0 = time.monotonic()
    with pytest.raises(shmq.Empty):
        q.get_many(3, True, 0.05)
    assert time.monotonic() - t0 >= 0.05


def test_put_nowait_and_get_nowait(q: shmq.Queue) -> None:
    a = q.put_nowait(b"a", headers={"k": "v"})
    b = q.put_nowait("b")
    with pytest.raises(stdlib_queue.Full):  # capacity 2: no room, and no wait
        q.put_nowait(b"c")
    with pytest.raises(shmq.Full):
        q.put(b"c", False)
    m = q.get_nowait()
    assert (m.offset, bytes(m.payload), m.headers["k"], m.deliveries) == (a, b"a", b"v", 1)
    m2 = q.get_nowait(visibility_timeout=30, ack=m)  # the first one acked with it
    assert (m2.offset, bytes(m2.payload)) == (b, b"b")
    with pytest.raises(shmq.StaleAck):
        m.ack()  # it was acked by the get_nowait
    with pytest.raises(shmq.Empty):
        q.get_nowait()  # b is leased, nothing else
    m2.ack()
    assert q.put_nowait(b"c") == b + 1  # room again


def test_the_group_is_a_keyword(q: shmq.Queue) -> None:
    q.create_group("billing")
    off = q.put(b"x")
    m = q.get(False, group="billing")
    assert (m.offset, m.group) == (off, "billing")
    m.ack()
    msgs = q.get_many(10, False)  # the default group's
    assert [(x.offset, x.group) for x in msgs] == [(off, "default")]
    q.ack_many(msgs)


@pytest.mark.parametrize("call", ["get", "get_many", "get_nowait"])
def test_a_group_given_where_block_goes_is_a_type_error_that_names_the_fix(q: shmq.Queue, call: str) -> None:
    q.create_group("billing")
    off = q.put(b"x")
    with pytest.raises(TypeError) as e:
        if call == "get":
            q.get("billing")  # type: ignore[arg-type]
        elif call == "get_many":
            q.get_many(10, "billing")  # type: ignore[arg-type]
        else:
            q.get_nowait("billing")  # type: ignore[misc]
    if call == "get":
        assert str(e.value) == ("get(): group is keyword-only (block and timeout come first, as in "
                                "queue.Queue.get): use get(group='billing')")
    elif call == "get_many":
        assert "use get_many(max_messages, group='billing')" in str(e.value)
    # nothing was leased, from either group: each still gets the message, as a first delivery
    for group in ("billing", "default"):
        m = q.get(False, group=group)
        assert (m.offset, m.deliveries) == (off, 1)
        m.ack()


def test_a_second_create_group_raises_group_exists_unless_exist_ok_and_keeps_the_group(q: shmq.Queue) -> None:
    offs = [q.put(b"m0"), q.put(b"m1")]
    q.create_group("g")  # earliest: both
    first = q.get(False, group="g")
    assert first.offset == offs[0]
    with pytest.raises(shmq.GroupExists) as e:
        q.create_group("g")
    assert "'g'" in str(e.value) and isinstance(e.value, shmq.QueueExists)
    for start in ("earliest", "latest", time.time()):
        q.create_group("g", start, exist_ok=True)  # left as it is: no error, no move
    assert q.groups().count("g") == 1
    first.ack()  # its lease was kept: not stale
    second = q.get(False, group="g")
    assert (second.offset, second.deliveries) == (offs[1], 1)
    second.ack()
    with pytest.raises(shmq.Empty):  # each delivered once: nothing comes again
        q.get(False, group="g")
    q.create_group("h", exist_ok=True)  # a new one: made as usual
    assert [m.offset for m in q.get_many(10, False, group="h")] == offs


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 15))


@pytest.mark.parametrize("failover", [False, True], ids=["aio", "aio_failover"])
def test_the_asyncio_clients_have_the_same_shape(server: Server, failover: bool) -> None:
    async def main() -> None:
        b: Any = await (aio.connect(server.url, failover_timeout=5.0) if failover
                        else aio.connect(server.url))
        name = f"shape_aio_{os.getpid()}_{next(_names)}"
        try:
            q = await b.create_queue(name, capacity=1)
            with pytest.raises(stdlib_queue.Empty):
                await q.get(False)
            with pytest.raises(shmq.Empty):
                await q.get_nowait()
            t0 = time.monotonic()
            with pytest.raises(shmq.Empty):
                await q.get(True, 0.05)
            assert time.monotonic() - t0 >= 0.05
            off = await q.put_nowait(b"a")
            with pytest.raises(stdlib_queue.Full):
                await q.put_nowait(b"b")
            with pytest.raises(TypeError, match=r"use get\(group='default'\)"):
                await q.get("default")
            with pytest.raises(TypeError, match=r"use get_many\(max_messages, group='g'\)"):
                await q.get_many(3, "g")
            await q.create_group("g")
            with pytest.raises(shmq.GroupExists):
                await q.create_group("g")
            await q.create_group("g", "latest", exist_ok=True)  # kept at the earliest: it has "a"
            m = await q.get_nowait(group="g")
            assert (m.offset, m.group, m.deliveries) == (off, "g", 1)
            await m.ack()
            m = await q.get_nowait()
            assert (m.offset, m.group) == (off, "default")
            await m.ack()
        finally:
            await b.delete_queue(name)
            await b.close()

    run(main())
