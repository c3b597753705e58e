"""Request/reply (``broker.request``, ``Message.reply``) on both transports."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

import shmq
from shmq.api import reply as shmq_reply
from shmq.core.colocated import ShmBroker
from shmq.names import is_reply_name
from tests.support.server import Server
from tests.support.wait import wait_until


def _names(b: shmq.Broker) -> set[str]:
    return {i.name for i in b.list_queues()}


def _dropped(b: shmq.Broker) -> dict[str, int]:
    """The instance's dropped replies, by reason (``broker.info()``)."""
    d = b.info().replies_dropped
    assert d is not None and set(d) == {"late", "gone", "full"}
    return d


def _other(b: shmq.Broker) -> shmq.Broker:
    """A second handle on the same broker (a second connection over TCP)."""
    return shmq.connect(b.url)


class Echo:
    """A replier thread: answers each request on ``queue`` with ``b"re:" + payload`` and
    the request's ``x`` header, then acks it, until ``stop``."""

    def __init__(self, b: shmq.Broker, queue: str) -> None:
        self.b = _other(b)
        self.q = self.b.queue(queue)
        self.stop = threading.Event()
        self.seen: list[dict[str, bytes]] = []
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                m = self.q.get(timeout=0.05)
            except shmq.Empty:
                continue
            self.seen.append(dict(m.headers))
            m.reply(b"re:" + bytes(m.payload), headers={"x": m.headers.get("x", b"-")})
            m.ack()

    def close(self) -> None:
        self.stop.set()
        self.t.join(10)
        self.b.close()


@pytest.fixture
def echo(broker: shmq.Broker) -> Iterator[Echo]:
    broker.create_queue("svc")
    e = Echo(broker, "svc")
    yield e
    e.close()


def test_round_trip(broker: shmq.Broker, echo: Echo) -> None:
    r = broker.request("svc", b"hello", timeout=10, headers={"x": "1"})
    assert r.payload == b"re:hello"
    assert r.headers["x"] == b"1"
    (sent,) = echo.seen
    reply_to = sent["reply-to"].decode()
    assert is_reply_name(reply_to) and reply_to in _names(broker)
    (info,) = [i for i in broker.list_queues() if i.name == reply_to]
    assert (info.config.capacity, info.config.durability) == (1024, "memory")  # small, never journaled
    assert r.headers["correlation-id"] == sent["correlation-id"]
    assert r.queue == reply_to
    r2 = broker.request("svc", "again", timeout=10)  # the same reply queue, a new correlation id
    assert r2.payload == b"re:again"
    assert echo.seen[1]["reply-to"] == sent["reply-to"]
    assert echo.seen[1]["correlation-id"] != sent["correlation-id"]
    # the requester acks each reply at its next read (off the round trip): one left leased
    assert broker.queue(reply_to).stats()["groups"]["default"]["in_flight"] == 1


def test_concurrent_requests_each_get_their_own_answer(broker: shmq.Broker, echo: Echo) -> None:
    wrong: list[tuple[bytes, bytes]] = []
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            for j in range(25):
                want = f"{i}-{j}".encode()
                got = bytes(broker.request("svc", want, timeout=20).payload)
                if got != b"re:" + want:
                    wrong.append((want, got))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not wrong
    assert len(echo.seen) == 200
    assert len({h["correlation-id"] for h in echo.seen}) == 200
    assert len({h["reply-to"] for h in echo.seen}) == 1


def test_timeout_and_late_reply_dropped(broker: shmq.Broker) -> None:
    svc = broker.create_queue("svc")
    before, wide = shmq_reply.stats(), _dropped(broker)
    with pytest.raises(shmq.Timeout):
        broker.request("svc", b"first", timeout=0.2)
    m = svc.get(timeout=5)  # answered only now
    assert m.reply(b"too late") is True  # delivered to the reply queue ...
    m.ack()
    e = Echo(broker, "svc")
    try:
        r = broker.request("svc", b"second", timeout=10)
    finally:
        e.close()
    assert r.payload == b"re:second"  # ... but never to the next request
    after = shmq_reply.stats()
    assert after["late"] == before["late"] + 1
    # the instance counts a co-located requester's; a TCP requester's stay its own
    late = wide["late"] + (1 if isinstance(broker, ShmBroker) else 0)
    assert _dropped(broker) == {**wide, "late": late}


def test_bad_arguments(broker: shmq.Broker) -> None:
    q = broker.create_queue("plain")
    q.put(b"no reply-to")
    q.put(b"to a plain queue", headers={"reply-to": "plain", "correlation-id": "1"})
    q.put(b"no correlation id", headers={"reply-to": "reply." + "0" * 24})
    for _ in range(3):
        m = q.get(timeout=5)
        with pytest.raises(shmq.InvalidArgument):
            m.reply(b"x")
        m.ack()
    assert q.stats()["produced"] == 3  # nothing was sent (to "plain" either)
    with pytest.raises(shmq.InvalidArgument):
        broker.request("plain", b"x", timeout=0)
    with pytest.raises(shmq.InvalidArgument):
        broker.request("plain", b"x", headers={"reply-to": "mine"})
    with pytest.raises(shmq.QueueNotFound):
        broker.request("nosuch", b"x", timeout=1)


def test_reply_queue_gone_after_close_and_reply_dropped(broker: shmq.Broker) -> None:
    svc = broker.create_queue("svc")
    requester = _other(broker)
    with pytest.raises(shmq.Timeout):
        requester.request("svc", b"x", timeout=0.05)
    m = svc.get(timeout=5)
    name = m.headers["reply-to"].decode()
    assert name in _names(broker)
    requester.close()
    assert name not in _names(broker)
    before, wide = shmq_reply.stats(), _dropped(broker)
    assert m.reply(b"to nobody") is False
    assert shmq_reply.stats()["gone"] == before["gone"] + 1
    # counted once in the instance: by this process (shm://), or by the worker that refused it
    assert _dropped(broker) == {**wide, "gone": wide["gone"] + 1}
    m.ack()


def _request_forever(url: str, queue: str) -> None:
    shmq.connect(url).request(queue, b"ping", timeout=60)


def _reply_to_of_killed_requester(broker: shmq.Broker) -> str:
    """Start a requester process, read its request's reply-to, SIGKILL it: that name."""
    svc = broker.create_queue("svc")
    p = mp.get_context("fork").Process(target=_request_forever, args=(broker.url, "svc"))
    p.start()
    try:
        m = svc.get(timeout=20)
        name = m.headers["reply-to"].decode()
        assert name in _names(broker)
    finally:
        assert p.pid is not None
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    m.ack()
    return name


def test_killed_requester_reply_queue_reaped(broker: shmq.Broker) -> None:
    name = _reply_to_of_killed_requester(broker)
    if isinstance(broker, ShmBroker):
        broker.reap()  # co-located: the reaper finds its creator dead
        assert name not in _names(broker)
    else:  # over TCP: its connection closed, and the worker deleted it
        wait_until(lambda: name not in _names(broker))


def _request_once(url: str, queue: str) -> None:
    with pytest.raises(shmq.Timeout):
        shmq.connect(url).request(queue, b"ping", timeout=0.05)  # and no close: the exit deletes it


@pytest.mark.parametrize("how", ["multiprocessing", "python"])
def test_exiting_requester_deletes_its_reply_queue(shm_broker: ShmBroker, how: str) -> None:
    svc = shm_broker.create_queue("svc")
    if how == "multiprocessing":  # ends with os._exit: multiprocessing's finalizers, not atexit
        p = mp.get_context("fork").Process(target=_request_once, args=(shm_broker.url, "svc"))
        p.start()
        p.join(30)
        assert p.exitcode == 0
    else:
        code = (f"import shmq\ntry: shmq.connect({shm_broker.url!r}).request('svc', b'ping', timeout=0.05)\n"
                "except shmq.Timeout: pass\n")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    name = svc.get(timeout=5).headers["reply-to"].decode()
    assert name not in _names(shm_broker)  # gone without a reaper


def test_killed_worker_reply_queues_reaped() -> None:
    srv = Server(workers=1)
    try:
        b: Any = shmq.connect(srv.url)
        with pytest.raises(shmq.Timeout):
            b.request(b.create_queue("svc").name, b"x", timeout=0.05)
        name = b._requester.name
        local = ShmBroker(srv.instance, create=False)
        try:
            assert name in _names(local)
            (worker,) = srv.workers()
            worker.kill()  # no clean-up in the worker: the supervisor's reaper deletes it
            wait_until(lambda: name not in _names(local), timeout=20)
        finally:
            local.close()
            b.close()
    finally:
        assert srv.stop() == 0


def test_asyncio_requests_and_replies(server: Server) -> None:
    import asyncio

    from shmq.client import aio

    async def main() -> None:
        async with await aio.connect(server.url) as b, await aio.connect(server.url) as other:
            svc = await b.create_queue("aio_svc")
            try:
                async def serve(n: int) -> None:
                    for _ in range(n):
                        m = await other.queue("aio_svc").get(timeout=10)
                        assert await m.reply(b"re:" + bytes(m.payload)) is True
                        await m.ack()

                server_task = asyncio.create_task(serve(20))
                got = await asyncio.gather(*(b.request("aio_svc", f"r{i}", timeout=10) for i in range(20)))
                await server_task
                assert [bytes(m.payload) for m in got] == [f"re:r{i}".encode() for i in range(20)]
                name = got[0].queue
                assert is_reply_name(name) and name in {i.name for i in await other.list_queues()}
                before = shmq_reply.stats()
                with pytest.raises(shmq.Timeout):
                    await b.request("aio_svc", b"late", timeout=0.05)
                m = await svc.get(timeout=5)
                assert await m.reply(b"too late") is True
                await m.ack()
                await svc.put(b"no request")
                plain = await svc.get(timeout=5)
                with pytest.raises(shmq.InvalidArgument):
                    await plain.reply(b"no")
                await plain.ack()
                late = asyncio.create_task(serve(1))
                assert (await b.request("aio_svc", b"next", timeout=10)).payload == b"re:next"
                await late
                assert shmq_reply.stats()["late"] == before["late"] + 1
            finally:
                await b.delete_queue("aio_svc")
            await b.close()
            with shmq.connect(server.url) as s:
                assert name not in _names(s)  # the worker deleted it at the close

    asyncio.run(main())


def test_reply_to_a_full_reply_queue_is_dropped(broker: shmq.Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shmq.options, "REPLY_CAPACITY", 2)  # read when the reply queue is made
    svc = broker.create_queue("svc")
    requester = _other(broker)
    try:
        for _ in range(3):
            with pytest.raises(shmq.Timeout):
                requester.request("svc", b"x", timeout=0.05)
        before, wide = shmq_reply.stats(), _dropped(broker)
        got = []
        for _ in range(3):
            m = svc.get(timeout=5)
            got.append(m.reply(b"late"))  # nobody reads them: the third finds the queue full
            m.ack()
        assert got == [True, True, False]
        assert shmq_reply.stats()["full"] == before["full"] + 1
        assert _dropped(broker) == {**wide, "full": wide["full"] + 1}
    finally:
        requester.close()


def test_dropped_replies_are_a_metric(shm_broker: ShmBroker) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from shmq.core.serverqueue import ServerBroker
    from shmq.server.collector import BrokerCollector

    svc = shm_broker.create_queue("svc")
    requester = _other(shm_broker)
    with pytest.raises(shmq.Timeout):
        requester.request("svc", b"x", timeout=0.05)
    requester.close()
    m = svc.get(timeout=5)
    assert m.reply(b"to nobody") is False and m.reply(b"again") is False
    m.ack()
    sb = ServerBroker(shm_broker.instance)
    try:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(BrokerCollector(sb))
        (fam,) = [f for f in text_string_to_metric_families(generate_latest(reg).decode())
                  if f.name == "shmq_replies_dropped"]
        got = {s.labels["reason"]: s.value for s in fam.samples if s.name == "shmq_replies_dropped_total"}
    finally:
        sb.close()
    assert got == {"late": 0, "gone": 2, "full": 0}


def test_asyncio_reader_waits_in_one_parked_get(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader asks the broker once for as long as the request may wait (its CONSUME is
    parked there, and the reply's DELIVER wakes it): no get is sent again on a timer."""
    import asyncio

    from shmq.client import aio

    asked: list[float | None] = []
    get_many = aio.AsyncQueue.get_many

    async def spy(self: aio.AsyncQueue, max_messages: int, *args: Any, **kw: Any) -> Any:
        if is_reply_name(self.name):
            asked.append(kw.get("timeout"))
        return await get_many(self, max_messages, *args, **kw)

    monkeypatch.setattr(aio.AsyncQueue, "get_many", spy)

    async def main() -> None:
        async with await aio.connect(server.url) as b, await aio.connect(server.url) as other:
            await b.create_queue("aio_wait")
            pending = asyncio.create_task(b.request("aio_wait", b"q", timeout=30))
            m = await other.queue("aio_wait").get(timeout=10)
            for _ in range(1000):  # until the reader's get is out (a deadline, not a pause)
                if asked:
                    break
                await asyncio.sleep(0.005)
            assert len(asked) == 1 and asked[0] is not None and asked[0] > 25  # the request's time, at once
            assert await m.reply(b"answer") is True
            await m.ack()
            assert (await pending).payload == b"answer"
            assert len(asked) == 1  # that one get brought the reply
            await b.delete_queue("aio_wait")

    asyncio.run(main())


def test_reply_target_reads_a_request_as_decoding_would() -> None:
    from shmq import headers as H

    name = "reply." + "ab" * 12
    head = shmq_reply.request_head(name)
    block = shmq_reply.request_headers(None, head, name, b"abababababab.7")
    assert isinstance(block, H.Block)
    assert H.decode(block) == {"reply-to": name.encode(), "correlation-id": b"abababababab.7"}
    one = H.encode({"correlation-id": b"abababababab.7"})
    to, h = shmq_reply.reply_target(block, None)  # the shape a requester makes: read, not decoded
    assert (to, H.encode(h)) == (name, one)
    to, h = shmq_reply.reply_target(memoryview(block), {"x": "1"})  # the reply's own headers: decoded
    assert (to, H.decode(H.encode(h))) == (name, {"x": b"1", "correlation-id": b"abababababab.7"})
    for other in ({"correlation-id": "c", "reply-to": name},  # another order
                  {"reply-to": name, "correlation-id": "c", "z": "1"}):  # another header
        to, h = shmq_reply.reply_target(H.encode(other), None)
        assert (to, H.encode(h)) == (name, H.encode({"correlation-id": "c"}))
    origin = block + b'{"queue": "svc"}'  # a dead letter's origin after the block
    assert shmq_reply.reply_target(origin, None)[0] == name
    not_reply = H.encode({"reply-to": "reply." + "AB" * 12, "correlation-id": "c"})  # same shape
    for meta in (not_reply, block[:-1], b""):
        with pytest.raises(shmq.InvalidArgument):
            shmq_reply.reply_target(meta, None)


def _child_request(b: shmq.Broker, parent_reply_queue: str, out: Any) -> None:
    r = b.request("svc", b"from the child", timeout=20)
    out.send((bytes(r.payload), r.queue != parent_reply_queue))


def test_a_forked_child_asks_through_a_reply_queue_of_its_own(shm_broker: ShmBroker) -> None:
    shm_broker.create_queue("svc")
    echo = Echo(shm_broker, "svc")
    try:
        first = shm_broker.request("svc", b"parent", timeout=10)
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_child_request, args=(shm_broker, first.queue, theirs))
        p.start()
        try:
            assert mine.poll(30)
            assert mine.recv() == (b"re:from the child", True)  # its own requester, not the parent's
        finally:
            p.join(30)
        assert p.exitcode == 0
        assert shm_broker.request("svc", b"parent again", timeout=10).queue == first.queue
    finally:
        echo.close()
