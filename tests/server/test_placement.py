"""Which worker serves a connection (server/placement.py): the rule, the handoff socket,
the shared count table, and a real ``shmq serve`` balancing and honouring affinities."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import zlib
from collections.abc import Iterator

import pytest

import shmq
import shmq.client.aio
from shmq.protocol.codec import FrameDecoder, T, decode_body, encode_body, encode_frame
from shmq.server.placement import MAX_PREFACE, Counts, Handoff, address, affinity_for, choose
from tests.support.connect import connect_tcp
from tests.support.server import Server
from tests.support.wait import wait_until

CTX = mp.get_context("fork")


def _key(worker: int, workers: int) -> str:
    key = affinity_for(worker, workers)
    assert zlib.crc32(key.encode()) % workers == worker
    return key


# ---------------------------------------------------------------- the rule
@pytest.mark.parametrize(("counts", "me", "want"), [
    ([1, 0], 0, 0),  # one connection each way is as balanced as it gets: it stays
    ([2, 0], 0, 1),  # this one would make it 2:0, so it goes
    ([1, 1], 1, 1),
    ([1, 2], 1, 1),  # a tie after the move would only swap sides
    ([3, 1, 0], 0, 2),  # the fewest wins
    ([3, 1, 1], 0, 1),  # the lowest id among the fewest
    ([5, 4], 0, 0),
])
def test_choose_balances_and_never_moves_a_tie(counts: list[int], me: int, want: int) -> None:
    assert choose(counts, me, "") == want


def test_choose_maps_an_affinity_to_one_worker_whoever_accepted() -> None:
    for name in ("rpc", "orders", "x" * 300, "ünïcode"):
        want = zlib.crc32(name.encode()) % 3
        assert {choose(c, me, name) for c in ([0, 0, 0], [9, 0, 0], [0, 0, 9]) for me in range(3)} == {want}


# ---------------------------------------------------------------- the handoff socket
@pytest.fixture()
def uid() -> int:
    """A fresh instance uid: the handoff addresses of these tests are nobody else's."""
    return int.from_bytes(os.urandom(8), "little")


@pytest.fixture()
def workers_0_1(uid: int) -> Iterator[tuple[Handoff, Handoff]]:
    a, b = Handoff(uid, 0), Handoff(uid, 1)
    yield a, b
    a.close()
    b.close()


@pytest.fixture()
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair: the first end is the one handed over (closing it twice is fine)."""
    mine, theirs = socket.socketpair()
    yield mine, theirs
    mine.close()
    theirs.close()


def test_a_handed_socket_arrives_with_its_bytes_and_still_talks(
        workers_0_1: tuple[Handoff, Handoff], pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = workers_0_1
    mine, theirs = pair
    assert a.send(1, mine.fileno(), b"hello")
    mine.close()  # ours to close: the kernel passed a duplicate
    (got, preface), = b.receive()
    assert preface == b"hello"
    got.sendall(b"ping")
    assert theirs.recv(4) == b"ping"
    got.close()
    assert b.receive() == []


def test_a_handoff_to_nobody_or_too_long_fails_and_keeps_nothing(
        uid: int, workers_0_1: tuple[Handoff, Handoff], pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = workers_0_1
    mine, theirs = pair
    assert not a.send(5, mine.fileno(), b"x")  # no worker 5 is listening
    b = Handoff(uid, 5)
    assert not a.send(5, mine.fileno(), b"x" * (MAX_PREFACE + 1))
    assert b.receive() == []
    b.close()
    mine.sendall(b"still mine")
    assert theirs.recv(10) == b"still mine"


def test_a_datagram_without_exactly_one_socket_is_dropped_and_its_descriptors_closed(
        uid: int, workers_0_1: tuple[Handoff, Handoff]) -> None:
    _, b = workers_0_1
    stranger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    x1, y1 = socket.socketpair()
    x2, y2 = socket.socketpair()
    try:
        stranger.sendto(b"no descriptor", address(uid, 1))
        stranger.connect(address(uid, 1))
        socket.send_fds(stranger, [b"two"], [x1.fileno(), x2.fileno()])
        x1.close()
        x2.close()
        assert b.receive() == []
        # both passed descriptors were closed on receipt: their peers read end-of-file
        assert y1.recv(1) == b"" and y2.recv(1) == b""
    finally:
        for s in (stranger, y1, y2):
            s.close()


def test_a_socket_from_another_user_is_refused_and_closed(
        workers_0_1: tuple[Handoff, Handoff], pair: tuple[socket.socket, socket.socket]) -> None:
    """The kernel stamps each datagram with its sender's credentials (SCM_CREDENTIALS): a
    worker takes sockets only from its own user's processes.  (Here the receiver is told
    its user is another one, so that no second user is needed to send.)"""
    a, b = workers_0_1
    b.user = os.getuid() + 1
    mine, theirs = pair
    assert a.send(1, mine.fileno(), b"hello")
    mine.close()
    assert b.receive() == []
    assert theirs.recv(1) == b""  # the descriptor that came was closed: nobody holds it now


def test_the_count_table_is_shared_with_forked_workers() -> None:
    counts = Counts(3)

    def child() -> None:
        counts.set(2, 7)

    p = CTX.Process(target=child)
    p.start()
    p.join(10)
    assert p.exitcode == 0
    assert counts.snapshot() == [0, 0, 7]


# ---------------------------------------------------------------- a real broker
@pytest.fixture()
def two_workers() -> Iterator[Server]:
    srv = Server(workers=2)
    yield srv
    assert srv.stop() == 0


def _connections(srv: Server) -> list[int]:
    """The client sockets each worker process holds open, fewest first.  A worker closes a
    socket after it has counted the connection gone, so when this shows a close, the
    broker's placement sees it too."""
    return sorted(sum(1 for c in p.net_connections() if c.laddr.port == srv.port and c.raddr)
                  for p in srv.workers())


def _lands_on(srv: Server, affinity: str) -> int:
    b = connect_tcp(srv.url, affinity=affinity)
    b.close()
    return b.worker


def test_connections_are_balanced_across_workers_and_work_wherever_they_land(two_workers: Server) -> None:
    srv = two_workers
    brokers = [connect_tcp(srv.url) for _ in range(6)]
    try:
        assert sorted(b.worker for b in brokers) == [0, 0, 0, 1, 1, 1]
        wait_until(lambda: _connections(srv) == [3, 3])  # the sockets really live there
        q = brokers[0].create_queue("spread")
        for i, b in enumerate(brokers):
            b.queue("spread").put(b"m%d" % i)
        got = []
        for b in reversed(brokers):
            m = b.queue("spread").get(timeout=5)
            m.ack()
            got.append(m.payload)
        assert sorted(got) == [b"m%d" % i for i in range(6)]
        assert q.stats()["groups"]["default"]["depth"] == 0
        # a freed place is filled first
        leaving = [b for b in brokers if b.worker == 1][:2]
        for b in leaving:
            b.close()
            brokers.remove(b)
        wait_until(lambda: _connections(srv) == [1, 3])
        brokers += [connect_tcp(srv.url) for _ in range(2)]
        assert [b.worker for b in brokers[-2:]] == [1, 1]
    finally:
        for b in brokers:
            b.close()


def test_connections_with_one_affinity_share_a_worker(two_workers: Server) -> None:
    srv = two_workers
    key = _key(1, 2)
    brokers = [connect_tcp(srv.url, affinity=key) for _ in range(4)]
    other = connect_tcp(srv.url, affinity=_key(0, 2))

    async def aio_worker() -> int:
        b = await shmq.client.aio.connect(srv.url, affinity=key)
        try:
            q = b.queue("aff")
            await q.put(b"from asyncio")
            return b.worker
        finally:
            await b.close()

    try:
        assert [b.worker for b in brokers] == [1, 1, 1, 1]
        assert other.worker == 0
        other.create_queue("aff")
        assert asyncio.run(aio_worker()) == 1
        m = brokers[2].queue("aff").get(timeout=5)
        assert m.payload == b"from asyncio"
        m.ack()
    finally:
        for b in [*brokers, other]:
            b.close()


def test_a_client_that_pipelines_after_its_handshake_stays_where_it_landed(two_workers: Server) -> None:
    """Bytes after the HANDSHAKE in the same read: nothing is moved, everything answered."""
    srv = two_workers
    first = connect_tcp(srv.url)  # worker A has one connection; the raw one may land beside it
    first.create_queue("piped")
    try:
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            hello = encode_body(T.HANDSHAKE, token=srv.token, client="raw",
                                affinity=_key(1 - first.worker, 2), heartbeat_ms=0)
            s.sendall(encode_frame(T.HANDSHAKE, 1, hello)
                      + encode_frame(T.PRODUCE, 2, encode_body(T.PRODUCE, queue="piped", timeout_ms=0,
                                                               payload=b"p")))
            dec = FrameDecoder()
            frames: list = []
            while len(frames) < 2:
                chunk = s.recv(65536)
                assert chunk, "the broker closed a pipelining client"
                frames += dec.feed(chunk)
            assert [f.type for f in frames] == [T.HANDSHAKE_ACK, T.PRODUCE_OK]
            s.close()
        assert first.queue("piped").stats()["produced"] == 6
    finally:
        first.close()


def test_a_killed_worker_is_handed_nothing_and_its_successor_takes_connections_again(
        two_workers: Server) -> None:
    srv = two_workers
    key = _key(1, 2)
    b = connect_tcp(srv.url, affinity=key)
    assert b.worker == 1
    b.create_queue("k")
    victim = next(p for p in srv.workers() if any(
        c.laddr.port == srv.port and c.raddr for c in p.net_connections()))
    b.close()
    victim.kill()
    victim.wait(10)
    # worker 1 is dead or restarting: a connection for it is served by whoever can
    late = [connect_tcp(srv.url, affinity=key) for _ in range(5)]
    for i, c in enumerate(late):
        c.queue("k").put(b"%d" % i)
    wait_until(lambda: len(srv.workers()) == 2 and victim.pid not in {p.pid for p in srv.workers()})
    wait_until(lambda: _lands_on(srv, key) == 1, timeout=10)
    again = connect_tcp(srv.url, affinity=key)
    try:
        assert again.worker == 1
        got = sorted(again.queue("k").get(timeout=5).payload for _ in range(5))
        assert got == [b"%d" % i for i in range(5)]
    finally:
        again.close()
        for c in late:
            c.close()


def test_a_connection_is_not_handed_to_a_full_worker() -> None:
    """Worker 1 holds its limit of connections: one more asking for it is served where it
    landed (worker 0), or refused by worker 1 if that is where it landed, never lost."""
    srv = Server(workers=2, extra=["--max-connections", "2"])
    key = _key(1, 2)
    full = [connect_tcp(srv.url, affinity=key) for _ in range(2)]
    try:
        assert [b.worker for b in full] == [1, 1]
        for _ in range(8):
            try:
                b = connect_tcp(srv.url, affinity=key)
            except shmq.LimitExceeded as e:  # it landed on worker 1, which is full and says so
                assert "worker 1 holds 2 connections already" in str(e)
                continue
            assert b.worker == 0
            assert b.list_queues() == []  # and it is served
            b.close()
    finally:
        for b in full:
            b.close()
        assert srv.stop() == 0


def test_the_handshake_answer_names_the_serving_worker(two_workers: Server) -> None:
    srv = two_workers
    hold = connect_tcp(srv.url)
    try:
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        hello = encode_body(T.HANDSHAKE, token=srv.token, client="raw", affinity=_key(1 - hold.worker, 2),
                            heartbeat_ms=0)
        s.sendall(encode_frame(T.HANDSHAKE, 9, hello))
        dec = FrameDecoder()
        frames: list = []
        while not frames:
            frames = dec.feed(s.recv(65536))
        assert frames[0].type == T.HANDSHAKE_ACK and frames[0].msg_id == 9
        assert decode_body(T.HANDSHAKE_ACK, frames[0].body)["worker"] == 1 - hold.worker
        s.close()
    finally:
        hold.close()
