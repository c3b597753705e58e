"""Heartbeats: agreed in the handshake, sent both ways, and a peer that goes silent
(dead, or frozen by SIGSTOP) is noticed within HEARTBEAT_MISSES intervals.

A frozen broker: every waiting call of either client ends with ConnectionLost, and an
idle handle notices too.  A frozen client: the broker closes its connection and gives
its leases back at once, long before their visibility timeout."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

import shmq
from shmq import options
from shmq.client import aio
from shmq.errors import ConnectionLost, Status
from shmq.protocol.codec import HEARTBEAT_FRAME, FrameDecoder, T, decode_body, encode_body, encode_frame
from shmq.server.connection import agree_heartbeat
from tests.support.connect import connect_tcp
from tests.support.server import Server
from tests.support.wait import wait_until

HB = 0.5  # s: the interval these tests agree on (3 silent ones: 1.5 s; room for a loaded CI machine)
BOUND = 15.0  # s: every silent peer must be noticed well within this


@pytest.fixture
def hb_server() -> Iterator[Server]:
    srv = Server(workers=1, extra=["--heartbeat", str(HB)])
    yield srv
    assert srv.stop() == 0


def _broker_processes(srv: Server) -> list[psutil.Process]:
    top = psutil.Process(srv.proc.pid)
    return [top, *top.children(recursive=True)]


def _freeze(srv: Server) -> list[psutil.Process]:
    procs = _broker_processes(srv)
    for p in procs:
        p.send_signal(signal.SIGSTOP)
    return procs


def _thaw(procs: list[psutil.Process]) -> None:
    for p in procs:
        p.send_signal(signal.SIGCONT)


@pytest.mark.parametrize(("server_s", "client_ms", "agreed"), [
    (5.0, 200, 200), (0.2, 5000, 200), (5.0, 0, 0), (0.0, 200, 0), (0.0, 0, 0), (5.0, 5000, 5000),
])
def test_the_interval_agreed_is_the_shorter_and_none_when_either_wants_none(
        server_s: float, client_ms: int, agreed: int) -> None:
    assert agree_heartbeat(server_s, client_ms) == agreed


def test_both_clients_learn_the_agreed_interval(hb_server: Server) -> None:
    b = connect_tcp(hb_server.url, heartbeat=5.0)
    off = connect_tcp(hb_server.url, heartbeat=0)
    try:
        assert (b.heartbeat, off.heartbeat) == (HB, 0.0)
    finally:
        b.close()
        off.close()

    async def run() -> tuple[float, float]:
        a = await aio.connect(hb_server.url, heartbeat=1.0)
        a_off = await aio.connect(hb_server.url, heartbeat=0)
        try:
            return a.heartbeat, a_off.heartbeat
        finally:
            await a.close()
            await a_off.close()
    assert asyncio.run(run()) == (HB, 0.0)


def test_an_idle_connection_stays_up_on_heartbeats_alone(hb_server: Server) -> None:
    """Nobody calls for many intervals: the heartbeats keep both ends content."""
    b = connect_tcp(hb_server.url, heartbeat=HB)
    try:
        q = b.create_queue("idle")
        time.sleep(6 * HB)  # the idle period under test: 6 intervals, 3 silent ones would close it
        q.put(b"still here")
        assert q.get(timeout=5).payload == b"still here"
    finally:
        b.close()


def test_a_frozen_broker_ends_a_waiting_get_and_an_idle_handle(hb_server: Server) -> None:
    waiting = connect_tcp(hb_server.url, heartbeat=HB)
    idle = connect_tcp(hb_server.url, heartbeat=HB)
    q = waiting.create_queue("frozen")
    procs = _freeze(hb_server)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionLost, match="no heartbeat from the broker"):
            q.get()  # waits for ever by itself: only the heartbeat ends it
        assert time.monotonic() - t0 < BOUND
        deadline = time.monotonic() + BOUND  # the idle handle's heartbeat thread noticed on its own
        while not idle._conn.closed and time.monotonic() < deadline:
            time.sleep(HB)
        with pytest.raises(ConnectionLost, match="no heartbeat from the broker"):
            idle.list_queues()
    finally:
        _thaw(procs)
        waiting.close()
        idle.close()


def test_a_frozen_broker_ends_every_waiting_asyncio_call(hb_server: Server) -> None:
    async def run() -> None:
        b = await aio.connect(hb_server.url, heartbeat=HB)
        q = await b.create_queue("frozen-aio")
        procs = _freeze(hb_server)
        try:
            t0 = time.monotonic()
            results = await asyncio.gather(q.get(), q.get_many(10), return_exceptions=True)
            assert time.monotonic() - t0 < BOUND
            assert all(isinstance(r, ConnectionLost) and "no heartbeat" in str(r) for r in results), results
        finally:
            _thaw(procs)
            await b.close()
    asyncio.run(run())


def test_closing_a_handle_of_a_frozen_broker_takes_no_longer_than_its_timeout(hb_server: Server) -> None:
    """close() says goodbye (the reply queue's delete, DISCONNECT) and waits for the answers;
    a frozen broker never answers, and with heartbeats off nothing else would end the wait:
    the close's timeout does, and the handle is closed all the same.  With another thread
    reading (for ever) when the close begins, the heartbeat, still beating, frees both."""
    b = connect_tcp(hb_server.url, heartbeat=0)
    b.create_queue("frozen-close")
    procs = _freeze(hb_server)
    try:
        t0 = time.monotonic()
        closer = threading.Thread(target=b.close, kwargs={"timeout": 1.0}, daemon=True)
        closer.start()
        closer.join(BOUND)
        assert not closer.is_alive(), "close() still waits on a frozen broker"
        assert time.monotonic() - t0 < BOUND
        with pytest.raises(ConnectionLost, match="was closed by the client"):
            b.list_queues()
        _thaw(procs)
        b = connect_tcp(hb_server.url, heartbeat=HB)
        q = b.create_queue("frozen-close-2")
        got: list[BaseException] = []

        def get() -> None:
            try:
                q.get()
            except BaseException as e:  # noqa: BLE001  (checked below)
                got.append(e)
        getter = threading.Thread(target=get, daemon=True)
        getter.start()
        wait_until(lambda: b._reading)  # type: ignore[attr-defined]
        procs[:] = _freeze(hb_server)
        closer = threading.Thread(target=b.close, kwargs={"timeout": 1.0}, daemon=True)
        closer.start()
        closer.join(BOUND)
        getter.join(BOUND)
        assert not closer.is_alive() and not getter.is_alive(), "a close and a get wait on a frozen broker"
        assert [type(e) for e in got] == [ConnectionLost], got

        async def run() -> None:  # the asyncio client's close, the same
            _thaw(procs)
            a = await aio.connect(hb_server.url, heartbeat=0)
            procs[:] = _freeze(hb_server)
            t1 = time.monotonic()
            await asyncio.wait_for(a.close(timeout=1.0), BOUND)
            assert time.monotonic() - t1 < BOUND and a.closed
        asyncio.run(run())
    finally:
        _thaw(procs)


def _consume_then_wait(url: str, token: str, got: Any) -> None:
    b = shmq.connect(url, token, heartbeat=HB)
    q = b.queue("leased")
    msg = q.get(timeout=10, visibility_timeout=600)
    got.send((msg.offset, msg.deliveries, msg.payload))
    while True:  # holds the lease until it is frozen (and then killed)
        time.sleep(1)


def test_a_frozen_client_loses_its_leases_to_others_at_once(hb_server: Server) -> None:
    """A client SIGSTOPped while it holds a lease: the broker closes its connection after
    3 silent intervals and the message goes to another consumer, long before its 600 s
    visibility timeout."""
    b = connect_tcp(hb_server.url)
    q = b.create_queue("leased")
    q.put(b"only one")
    ours, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_consume_then_wait,
                                           args=(hb_server.url, hb_server.token, theirs))
    child.start()
    assert child.pid is not None
    try:
        assert ours.poll(BOUND), "the child took no message"
        offset, deliveries, payload = ours.recv()
        assert (deliveries, payload) == (1, b"only one")
        os.kill(child.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        again = q.get(timeout=BOUND)
        assert time.monotonic() - t0 < BOUND
        assert (again.offset, again.deliveries, again.payload) == (offset, 2, b"only one")
        again.ack()
        assert q.stats()["groups"]["default"]["depth"] == 0
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        b.close()


def test_a_silent_raw_client_is_told_and_closed(hb_server: Server) -> None:
    """A client that agrees to heartbeats and then sends nothing: ERROR UNAVAILABLE for
    message id 0, then the close."""
    s = socket.create_connection(("127.0.0.1", hb_server.port), timeout=BOUND)
    try:
        s.sendall(encode_frame(T.HANDSHAKE, 1, encode_body(T.HANDSHAKE, token=hb_server.token, client="mute",
                                                            affinity="", heartbeat_ms=500)))
        dec = FrameDecoder()
        frames = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            frames += dec.feed(data)
        types = [f.type for f in frames]
        assert types[0] == T.HANDSHAKE_ACK and types[-1] == T.ERROR, types
        assert set(types[1:-1]) <= {T.HEARTBEAT}  # it heard heartbeats meanwhile
        assert frames[-1].status == Status.UNAVAILABLE and frames[-1].msg_id == 0
    finally:
        s.close()


def test_a_client_that_beats_is_never_closed_for_silence(hb_server: Server) -> None:
    """The same raw client, sending a HEARTBEAT now and then, is kept."""
    s = socket.create_connection(("127.0.0.1", hb_server.port), timeout=BOUND)
    try:
        s.sendall(encode_frame(T.HANDSHAKE, 1, encode_body(T.HANDSHAKE, token=hb_server.token, client="beats",
                                                            affinity="", heartbeat_ms=500)))
        for _ in range(8):  # 4 intervals of 0.5 s, two heartbeats in each
            time.sleep(0.25)
            s.sendall(HEARTBEAT_FRAME)
        s.sendall(encode_frame(T.LIST_QUEUES, 2))
        dec = FrameDecoder()
        frames: list[Any] = []
        while not any(f.msg_id == 2 for f in frames):
            data = s.recv(65536)
            assert data, [f.type for f in frames]
            frames += dec.feed(data)
        assert [f.type for f in frames if f.msg_id == 2] == [T.LIST_QUEUES_OK]
        # the broker's own heartbeats may come before or after the answer, in the same read
        assert all(f.type in (T.HANDSHAKE_ACK, T.HEARTBEAT, T.LIST_QUEUES_OK) for f in frames), frames
    finally:
        s.close()


def test_heartbeats_are_off_when_the_broker_says_zero() -> None:
    srv = Server(workers=1, extra=["--heartbeat", "0"])
    try:
        b = connect_tcp(srv.url, heartbeat=HB)
        try:
            assert b.heartbeat == 0.0
        finally:
            b.close()
    finally:
        assert srv.stop() == 0


def test_the_defaults_are_stated() -> None:
    assert options.HEARTBEAT > 0 and options.HEARTBEAT_MISSES >= 2


def test_a_handshake_from_before_heartbeats_is_accepted_without_them(hb_server: Server) -> None:
    """The old HANDSHAKE body ends after ``affinity``: it reads as heartbeat_ms 0."""
    old = encode_body(T.HANDSHAKE, token=hb_server.token, client="old", affinity="", heartbeat_ms=0)[:-4]
    with socket.create_connection(("127.0.0.1", hb_server.port), timeout=BOUND) as s:
        s.sendall(encode_frame(T.HANDSHAKE, 1, old) + encode_frame(T.LIST_QUEUES, 2))
        dec = FrameDecoder()
        frames: list[Any] = []
        while len(frames) < 2:
            data = s.recv(65536)
            assert data
            frames += dec.feed(data)
    assert [f.type for f in frames] == [T.HANDSHAKE_ACK, T.LIST_QUEUES_OK]
    assert decode_body(T.HANDSHAKE_ACK, frames[0].body)["heartbeat_ms"] == 0
