"""INFO (``broker.info()``): what a broker says about itself, on each client and in memory.

Over TCP it is the worker's answer (owner pid and uptime from the registry, connections
from the supervisor's count table, ``server.placement.Counts``); over ``shm://`` the
instance's own registry, with no worker pool to report."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import psutil
import pytest

import shmq
from shmq.api import BrokerInfo
from shmq.client import aio
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerBroker
from shmq.errors import InstanceError
from shmq.protocol.codec import FrameDecoder, T, decode_body, encode_frame, frame
from shmq.server import handlers
from shmq.server.core import Core
from shmq.server.placement import Counts
from tests.support.connect import connect_tcp
from tests.support.server import Server
from tests.support.wait import wait_until


def _age(pid: int) -> float:
    return time.time() - psutil.Process(pid).create_time()


def test_info_over_tcp(server: Server) -> None:
    tb = connect_tcp(server.url, server.token)
    with tb as b:
        about = b.info()
        assert about.version == shmq.__version__
        assert about.instance == server.instance
        assert about.pid == server.proc.pid  # the supervisor, not the worker that answered
        assert about.uptime is not None and abs(about.uptime - _age(server.proc.pid)) < 2
        assert about.workers == 2
        assert about.connections is not None and len(about.connections) == 2
        assert about.worker == tb.worker
        assert about.connections[tb.worker] >= 1  # this connection, at least
        q = b.create_queue(f"info{os.getpid()}")
        q.stats()  # the worker maintains the queue: it takes a client slot, if it had none
        clients = set(b.info().clients)
        b.delete_queue(q.name)
    broker_pids = {server.proc.pid, server.journal_pid, *(p.pid for p in server.workers())}
    assert clients and clients <= broker_pids  # a TCP client has no slot of its own


def test_info_counts_connections_as_they_come_and_go(server: Server) -> None:
    with connect_tcp(server.url, server.token) as b:
        def total() -> int:
            c = b.info().connections
            assert c is not None
            return sum(c)

        before = total()
        extra = [connect_tcp(server.url, server.token) for _ in range(3)]
        try:
            wait_until(lambda: total() == before + 3)
        finally:
            for e in extra:
                e.close()
        wait_until(lambda: total() == before)


def test_info_over_asyncio(server: Server) -> None:
    async def main() -> BrokerInfo:
        b = await aio.connect(server.url, token=server.token)
        try:
            return await b.info()
        finally:
            await b.close()

    about = asyncio.run(main())
    assert about.version == shmq.__version__
    assert about.pid == server.proc.pid
    assert about.workers == 2 and about.connections is not None and sum(about.connections) >= 1


def test_info_over_shm_has_no_worker_pool(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        about = b.info()
        assert about.instance == instance and about.version == shmq.__version__
        assert about.pid == os.getpid()  # no broker: the owner is the process that created it
        assert about.uptime is not None and abs(about.uptime - _age(os.getpid())) < 2
        assert about.clients == []  # a process takes a slot once it leases or maintains
        assert (about.workers, about.connections, about.worker) == (None, None, None)
        b.create_queue("q").stats()
        assert b.info().clients == [os.getpid()]
    finally:
        b.destroy()


def test_info_over_shm_of_a_served_instance_names_the_broker(server: Server) -> None:
    with shmq.connect(f"shm://{server.instance}") as b:
        about = b.info()
    assert about.pid == server.proc.pid
    assert about.workers is None and about.connections is None  # not known from the shared memory


def test_info_over_shm_after_the_broker_removed_the_instance() -> None:
    srv = Server(workers=1)
    try:
        b = shmq.connect(f"shm://{srv.instance}")
        assert b.info().pid == srv.proc.pid
        assert srv.stop() == 0
        with pytest.raises(InstanceError, match="removed"):
            b.info()
        b.close()
    finally:
        srv.stop()


@pytest.fixture
def core(instance: str) -> Iterator[Core]:
    sb = ServerBroker(instance)
    counts = Counts(3)
    for worker, n in enumerate((4, 0, 7)):
        counts.set(worker, n)
    yield Core(sb, worker_id=2, counts=counts)
    sb.close()
    ShmBroker(instance).destroy()


def test_the_handler_reads_every_workers_count(core: Core) -> None:
    sent: list[bytes] = []
    conn = core.connection(sink=sent.append)
    handlers.receive(core, conn, frame(T.HANDSHAKE, 1, token="", client="t", affinity="", heartbeat_ms=0))
    handlers.receive(core, conn, frame(T.INFO, 2))
    replies = FrameDecoder().feed(b"".join(sent))
    assert [(f.type, f.msg_id) for f in replies] == [(T.HANDSHAKE_ACK, 1), (T.INFO_OK, 2)]
    about = decode_body(T.INFO_OK, replies[1].body)["info"]
    assert about["workers"] == 3 and about["connections"] == [4, 0, 7] and about["worker"] == 2
    assert about["pid"] == os.getpid() and about["instance"] == core.broker.instance


def test_a_body_on_info_is_refused(core: Core) -> None:
    sent: list[bytes] = []
    conn = core.connection(sink=sent.append)
    handlers.receive(core, conn, frame(T.HANDSHAKE, 1, token="", client="t", affinity="", heartbeat_ms=0))
    handlers.receive(core, conn, encode_frame(T.INFO, 2, b"junk"))
    replies = FrameDecoder().feed(b"".join(sent))
    assert replies[-1].type == T.ERROR and replies[-1].msg_id == 2


def test_broker_info_ignores_members_it_does_not_know() -> None:
    about = BrokerInfo.of({"version": "9", "instance": "i", "pid": None, "uptime": None, "clients": [],
                           "workers": 1, "connections": [0], "worker": 0, "from_the_future": True})
    assert about == BrokerInfo("9", "i", None, None, [], 1, [0], 0)
