"""GroupExists: a group that exists already is told apart from a queue that does, on every
transport -- shared memory, the blocking TCP client and the asyncio one -- though the wire
has one status code, QUEUE_EXISTS, for both (the group commands tell them apart)."""

from __future__ import annotations

import asyncio
import pickle
import time
from typing import Any

import pytest

import shmq
from shmq.client import aio
from shmq.errors import Status
from tests.support.server import Server


def test_group_exists_is_public_and_a_queue_exists() -> None:
    assert "GroupExists" in shmq.__all__
    assert issubclass(shmq.GroupExists, shmq.QueueExists) and issubclass(shmq.GroupExists, shmq.ShmqError)
    err = shmq.GroupExists("group 'g' exists on queue 'q'")
    assert err.code == Status.QUEUE_EXISTS
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is shmq.GroupExists and str(copy) == str(err)


@pytest.mark.parametrize("start", ["earliest", "latest", "a time"])
def test_creating_a_group_that_exists_raises_group_exists(broker: shmq.Broker, start: str) -> None:
    q = broker.create_queue("ge")
    q.create_group("g")
    at: Any = time.time() if start == "a time" else start  # a time: GROUP_SEEK (create 1) over TCP
    with pytest.raises(shmq.GroupExists) as e:
        q.create_group("g", at)
    assert e.value.code == Status.QUEUE_EXISTS
    assert "group 'g' exists" in str(e.value) and "'ge'" in str(e.value)
    assert q.groups().count("g") == 1


def test_code_that_catches_queue_exists_still_catches_a_group_that_exists(broker: shmq.Broker) -> None:
    q = broker.create_queue("ge")
    q.create_group("g")
    try:
        q.create_group("g")
    except shmq.QueueExists as e:
        assert isinstance(e, shmq.GroupExists)
    else:
        pytest.fail("no error for a group that exists")


def test_a_queue_that_exists_is_no_group_exists(broker: shmq.Broker) -> None:
    q = broker.create_queue("ge")
    q.create_group("g")
    with pytest.raises(shmq.QueueExists) as e:
        broker.create_queue("ge")
    assert type(e.value) is shmq.QueueExists
    q.delete_group("g")
    q.create_group("g")  # free again: no error


def test_the_asyncio_client_raises_group_exists_too(server: Server) -> None:
    async def main() -> None:
        async with await aio.connect(server.url) as b:
            q = await b.create_queue("ge_aio")
            try:
                await q.create_group("g")
                for start in ("earliest", "latest", time.time()):
                    with pytest.raises(shmq.GroupExists) as e:
                        await q.create_group("g", start)
                    assert e.value.code == Status.QUEUE_EXISTS and "group 'g' exists" in str(e.value)
                with pytest.raises(shmq.QueueExists) as qe:
                    await b.create_queue("ge_aio")
                assert type(qe.value) is shmq.QueueExists
            finally:
                await b.delete_queue("ge_aio")

    asyncio.run(asyncio.wait_for(main(), 15))
