"""The broker server as a real subprocess: mixed transports, kills, bad input, auth, scale, CLI."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shmq
from shmq.client.tcp import TcpQueue
from shmq.core.colocated import ShmBroker
from shmq.errors import Status
from shmq.protocol.codec import Frame, FrameDecoder, T, decode_body, encode_body, encode_frame
from tests.support.connect import connect_tcp
from tests.support.instances import objects
from tests.support.server import Server
from tests.support.wait import wait_until

CTX = mp.get_context("fork")


def _raw(server: Server, handshake: bool = True) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if handshake:
        s.sendall(encode_frame(T.HANDSHAKE, 1, encode_body(T.HANDSHAKE, token=server.token, client="raw",
                                                            affinity="", heartbeat_ms=0)))
        assert _recv_frame(s).type == T.HANDSHAKE_ACK
    return s


def _recv_frame(s: socket.socket) -> Frame:
    dec = FrameDecoder()
    while True:
        data = s.recv(65536)
        if not data:
            raise ConnectionError("closed")
        frames = dec.feed(data)
        if frames:
            return frames[0]


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_shared_memory_and_tcp_interoperate(server: Server) -> None:
    tcp = shmq.connect(server.url)
    local = ShmBroker(server.instance)  # a co-located process attaches the broker's memory
    try:
        q = tcp.create_queue("mixed")
        lq = local.queue("mixed")
        lq.put(b"from shm")
        assert q.get(timeout=5).payload == b"from shm"  # a waiting TCP consumer is woken
        q.put(b"from tcp")
        m = lq.get(timeout=5)
        assert m.payload == b"from tcp"
        m.ack()
    finally:
        tcp.delete_queue("mixed")
        tcp.close()
        local.close()


def test_blocked_tcp_consumer_wakes_for_a_shm_producer(server: Server) -> None:
    tcp = shmq.connect(server.url)
    local = ShmBroker(server.instance)
    try:
        q = tcp.create_queue("wake")
        result: list[bytes] = []
        import threading

        t = threading.Thread(target=lambda: result.append(q.get(timeout=10).payload))
        t.start()
        time.sleep(0.05)  # let the consumer park (not a synchronisation: the test passes either way)
        t0 = time.monotonic()
        local.queue("wake").put(b"hello")
        t.join(10)
        assert result == [b"hello"] and time.monotonic() - t0 < 1.0
    finally:
        tcp.delete_queue("wake")
        tcp.close()
        local.close()


def _bells(q: object) -> bytes:
    from shmq.core import layout as L
    return q._mm[L.Q_BELLS:L.Q_BELLS + L.Q_BELLS_SIZE]  # type: ignore[attr-defined,no-any-return]


def test_a_parked_get_flags_its_worker_and_a_colocated_put_rings_it(server: Server) -> None:
    """A get parked over TCP sets its worker's byte in the queue's bell table; a put from
    another process rings the doorbell and the get returns; once nobody waits there any
    more the worker clears its flag (after a grace of WORKER_FLAG_GRACE)."""
    import threading

    tcp = connect_tcp(server.url)
    local = ShmBroker(server.instance)
    try:
        q = tcp.create_queue("bell")
        lq = local.queue("bell")
        assert _bells(lq) == bytes(64)
        result: list[bytes] = []
        t = threading.Thread(target=lambda: result.append(q.get(timeout=10).payload))
        t.start()
        wait_until(lambda: _bells(lq)[tcp.worker] == 1, timeout=5)
        assert sum(_bells(lq)) == 1  # only the worker that parks the get
        lq.put(b"ring")
        t.join(10)
        assert result == [b"ring"]
        wait_until(lambda: _bells(lq) == bytes(64), timeout=5)
    finally:
        tcp.delete_queue("bell")
        tcp.close()
        local.close()


def test_a_subscription_flags_its_worker_until_it_ends(server: Server) -> None:
    """A push subscription sets its worker's bell flag on the queue; once it is
    unsubscribed, and once its connection is closed, the flag is cleared (after
    WORKER_FLAG_GRACE): a worker nobody waits on is not rung by every put there."""
    local = ShmBroker(server.instance)
    try:
        local.create_queue("subbell")
        lq = local.queue("subbell")
        for how in ("unsubscribe", "close"):
            tcp = connect_tcp(server.url)
            sub = tcp.queue("subbell").subscribe(credit=5)
            lq.put(how.encode())
            msg = next(sub)
            assert msg.payload == how.encode()
            msg.ack()
            assert _bells(lq)[tcp.worker] == 1
            if how == "unsubscribe":
                sub.close()  # the connection stays open
            else:
                tcp.close()
            wait_until(lambda: _bells(lq) == bytes(64), timeout=5)
            tcp.close()
    finally:
        local.delete_queue("subbell")
        local.close()


def test_worker_flags_a_queue_deleted_and_created_again(server: Server) -> None:
    """A worker's bell flag follows a queue name to a new queue of that name while a
    request stays parked on the name.  (Without it, wake-ups for the new queue would
    wait for the 50 ms tick.)"""
    import threading

    tcp = connect_tcp(server.url)
    local = ShmBroker(server.instance)
    try:
        q = tcp.create_queue("again")
        result: list[bytes] = []

        def consume() -> None:
            while True:
                try:
                    result.append(q.get(timeout=10).payload)
                    return
                except shmq.QueueNotFound:  # the retry fell between the delete and the create
                    continue

        t = threading.Thread(target=consume)
        t.start()
        wait_until(lambda: _bells(local.queue("again"))[tcp.worker] == 1, timeout=5)
        local.delete_queue("again")  # while the get is parked
        local.create_queue("again")
        wait_until(lambda: _bells(local.queue("again"))[tcp.worker] == 1, timeout=5)
        local.queue("again").put(b"new")
        t.join(10)
        assert result == [b"new"]
    finally:
        tcp.delete_queue("again")
        tcp.close()
        local.close()


def test_a_restarted_worker_clears_the_bell_flags_of_its_predecessor() -> None:
    """A worker killed while its flag is set leaves it set (producers would send to a dead
    doorbell on every put); the worker that replaces it clears its byte in every queue."""
    from shmq.core import layout as L

    srv = Server(workers=2)
    local = ShmBroker(srv.instance)
    try:
        b = connect_tcp(srv.url)
        b.create_queue("stale")
        lq = local.queue("stale")
        victim = next(p for p in srv.workers() if any(
            c.laddr.port == srv.port and c.raddr and c.status == psutil.CONN_ESTABLISHED
            for c in p.net_connections()))
        lq._mm[L.Q_BELLS + b.worker] = 1  # as if it had a request parked here when it died
        victim.kill()
        wait_until(lambda: len(srv.workers()) == 2 and victim.pid not in {p.pid for p in srv.workers()},
                   timeout=5)
        wait_until(lambda: _bells(lq) == bytes(64), timeout=5)
        lq.put(b"after")  # rings nobody, and is there
        b2 = shmq.connect(srv.url)
        assert b2.queue("stale").get(timeout=5).payload == b"after"
        b2.close()
    finally:
        local.close()
        assert srv.stop() == 0


def test_an_unwaited_ack_reaches_the_broker_with_no_later_request(server: Server) -> None:
    """ack(wait=False) may ride with the connection's next request (MSG_MORE); when none
    comes, the kernel still sends it (its cork timer): the ack is applied, not held."""
    tcp = shmq.connect(server.url)
    local = ShmBroker(server.instance)
    try:
        q = tcp.create_queue("corked")
        q.put(b"x")
        q.get(timeout=5).ack(wait=False)
        lq = local.queue("corked")
        wait_until(lambda: lq.stats()["groups"]["default"]["acked"] == 1, timeout=5)
        assert lq.stats()["groups"]["default"]["in_flight"] == 0
        assert not tcp.nowait_errors  # type: ignore[attr-defined]
    finally:
        tcp.delete_queue("corked")
        tcp.close()
        local.close()


def _take_and_hang(url: str, n: int, ready: Event) -> None:
    b = shmq.connect(url)
    b.queue("lease").get_many(n)
    ready.set()
    time.sleep(60)


def test_killed_clients_leases_come_back_at_once(server: Server) -> None:
    b = shmq.connect(server.url)
    try:
        q = b.create_queue("lease", visibility_timeout=300)
        q.put_many([b"a", b"b", b"c"])
        ready = CTX.Event()
        p = CTX.Process(target=_take_and_hang, args=(server.url, 3, ready))
        p.start()
        assert ready.wait(10)
        with pytest.raises(shmq.Empty):
            q.get(block=False)
        os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
        p.join()
        t0 = time.monotonic()
        got = q.get_many(3, timeout=5)
        got += q.get_many(3, timeout=5) if len(got) < 3 else []
        assert time.monotonic() - t0 < 1.0  # the connection dropped: no visibility timeout
        assert sorted((m.payload, m.deliveries) for m in got) == [(b"a", 2), (b"b", 2), (b"c", 2)]
    finally:
        b.delete_queue("lease")
        b.close()


def test_sigkilled_worker_is_restarted_and_nothing_is_lost() -> None:
    srv = Server(workers=2)
    try:
        b = shmq.connect(srv.url)
        q = b.create_queue("w", visibility_timeout=300)
        q.put_many([f"{i}".encode() for i in range(100)])
        held = q.get_many(10)  # leased through the worker that serves this connection
        workers = srv.workers()
        assert len(workers) == 2
        victim = next(p for p in workers if any(
            c.laddr.port == srv.port and c.raddr and c.status == psutil.CONN_ESTABLISHED
            for c in p.net_connections()))
        victim.kill()
        wait_until(lambda: len(srv.workers()) == 2 and victim.pid not in {p.pid for p in srv.workers()},
                   timeout=5)
        with pytest.raises(shmq.ConnectionLost):
            held[0].ack()
        b2 = shmq.connect(srv.url)
        q2 = b2.queue("w")
        got: list[bytes] = []
        while len(got) < 100:
            ms = q2.get_many(100, timeout=2)
            q2.ack_many(ms)
            got += [m.payload for m in ms]
        assert sorted(got) == sorted(f"{i}".encode() for i in range(100))
        assert sum(1 for m in got if m in {h.payload for h in held}) == 10
        b2.close()
    finally:
        assert srv.stop() == 0


def test_graceful_shutdown_returns_leases() -> None:
    srv = Server(workers=2, extra=["--keep"])  # keep the memory, to look at it afterwards
    b = shmq.connect(srv.url)
    q = b.create_queue("g")
    q.put(b"x")
    q.get()
    local = ShmBroker(srv.instance)
    lq = local.queue("g")
    assert lq.stats()["groups"]["default"]["in_flight"] == 1
    assert srv.stop() == 0
    assert lq.stats()["groups"]["default"]["in_flight"] == 0  # the lease was given back
    assert lq.get(block=False).deliveries == 2
    local.destroy()
    with pytest.raises(shmq.ConnectionLost):
        q.put(b"y")


def test_shutdown_removes_the_shared_memory_and_the_processes() -> None:
    srv = Server(workers=2)
    pids = [p.pid for p in srv.workers()]
    assert srv.stop() == 0
    assert not objects(srv.instance)
    assert not [pid for pid in pids if psutil.pid_exists(pid) and
                psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("junk,status", [
    (b"\x00" * 16, Status.BAD_MAGIC),
    (struct.pack(">IIBBHI", 0xDEADBEEF, 1 << 30, 0x21, 1, 0, 5), Status.PAYLOAD_TOO_LARGE),
    (struct.pack(">IIBBHI", 0xDEADBEEF, 0, 0x99, 1, 0, 5), Status.INVALID_TYPE),
    (struct.pack(">IIBBHI", 0xDEADBEEF, 0, 0x21, 9, 0, 5), Status.VERSION_MISMATCH),
])
def test_malformed_frames_get_an_error_and_a_close(server: Server, junk: bytes, status: int) -> None:
    s = _raw(server)
    s.sendall(junk)
    f = _recv_frame(s)
    assert (f.type, f.status) == (T.ERROR, status)
    assert _closed(s)
    s.close()
    b = shmq.connect(server.url)  # everyone else carries on
    assert b.list_queues() is not None
    b.close()


def test_bad_request_bodies_and_unknown_queues_keep_the_connection(server: Server) -> None:
    s = _raw(server)
    s.sendall(encode_frame(T.PRODUCE, 2, b"\x00\x05ab"))  # truncated body
    f = _recv_frame(s)
    assert (f.type, f.status, f.msg_id) == (T.ERROR, Status.PROTOCOL_ERROR, 2)
    s.sendall(encode_frame(T.PRODUCE, 3, encode_body(T.PRODUCE, queue="nope", timeout_ms=0, payload=b"x")))
    f = _recv_frame(s)
    assert (f.type, f.status, f.msg_id) == (T.ERROR, Status.QUEUE_NOT_FOUND, 3)
    s.sendall(encode_frame(T.DELIVER, 4, b""))  # a response type sent as a request
    assert _recv_frame(s).status == Status.INVALID_TYPE
    s.sendall(encode_frame(T.LIST_QUEUES, 5))
    assert _recv_frame(s).type == T.LIST_QUEUES_OK
    s.close()


def test_frame_before_handshake_and_truncated_frame(server: Server) -> None:
    s = _raw(server, handshake=False)
    s.sendall(encode_frame(T.LIST_QUEUES, 1))
    f = _recv_frame(s)
    assert (f.type, f.status) == (T.ERROR, Status.PROTOCOL_ERROR)
    assert _closed(s)
    s.close()
    s = _raw(server)
    s.sendall(encode_frame(T.LIST_QUEUES, 1)[:10])  # half a header, then the client goes away
    s.close()
    b = shmq.connect(server.url)
    b.list_queues()
    b.close()


def test_ack_range_acks_what_it_holds_reports_the_rest_and_refuses_too_many(server: Server) -> None:
    """ACK_RANGE (what ack_many sends for a run): the offsets this connection holds with that
    delivery count are acked, the others come back stale; over MAX_BATCH is refused, and the
    connection carries on."""
    b = shmq.connect(server.url)
    q = b.create_queue("ranged")
    s = _raw(server)
    try:
        first = q.put_many([b"%d" % i for i in range(6)])[0]
        s.sendall(encode_frame(T.CONSUME_BATCH, 2, encode_body(
            T.CONSUME_BATCH, queue="ranged", group="default", max=4, timeout_ms=1000, visibility_ms=0)))
        assert _recv_frame(s).type == T.DELIVER_BATCH
        # it holds the first 4 (delivery 1) and asks for all 6: the last 2 were never its own
        s.sendall(encode_frame(T.ACK_RANGE, 3, encode_body(T.ACK_RANGE, queue="ranged", group="default",
                                                           first=first, count=6, deliveries=1)))
        f = _recv_frame(s)
        assert f.type == T.ACK_BATCH_OK
        assert decode_body(T.ACK_BATCH_OK, f.body)["stale"] == [first + 4, first + 5]
        g = q.stats()["groups"]["default"]
        assert g["acked"] == 4 and g["in_flight"] == 0
        s.sendall(encode_frame(T.ACK_RANGE_NO_REPLY, 4, encode_body(
            T.ACK_RANGE_NO_REPLY, queue="ranged", group="default", first=0, count=10_001, deliveries=1)))
        f = _recv_frame(s)
        assert (f.type, f.status, f.msg_id) == (T.ERROR, Status.LIMIT_EXCEEDED, 4)
        s.sendall(encode_frame(T.LIST_QUEUES, 5))
        assert _recv_frame(s).type == T.LIST_QUEUES_OK
        assert [m.payload for m in q.get_many(10, timeout=5)] == [b"4", b"5"]  # nothing else was touched
    finally:
        s.close()
        b.delete_queue("ranged")
        b.close()


def test_batch_acks_sends_a_range_only_for_a_run() -> None:
    from shmq.api import Message
    from shmq.client.tcp import batch_acks

    def msgs(*spec: tuple[str, int, int]) -> list[Message]:
        return [tuple.__new__(Message, (None, 0, g, o, dc, b"", b"", 0)) for g, o, dc in spec]

    run = msgs(("g", 5, 2), ("g", 6, 2), ("g", 7, 2))
    assert batch_acks(run) == [(T.ACK_RANGE, {"group": "g", "first": 5, "count": 3, "deliveries": 2})]
    for not_a_run in (msgs(("g", 5, 1), ("g", 7, 1), ("g", 7, 1)),  # same ends, not consecutive
                      msgs(("g", 6, 1), ("g", 5, 1), ("g", 7, 1)),  # out of order
                      msgs(("g", 5, 1), ("g", 6, 2), ("g", 7, 1)),  # two delivery counts
                      msgs(("g", 5, 1), ("h", 6, 1), ("g", 7, 1)),  # two groups
                      msgs(("g", 5, 1))):  # one message
        kinds = batch_acks(not_a_run)
        assert {k for k, _ in kinds} == {T.ACK_BATCH}
        assert sorted(o for _, f in kinds for o, _ in f["settles"]) == sorted(m[3] for m in not_a_run)


def test_byte_at_a_time_client(server: Server) -> None:
    s = _raw(server)
    for byte in encode_frame(T.LIST_QUEUES, 9):
        s.send(bytes([byte]))
    f = _recv_frame(s)
    assert (f.type, f.msg_id) == (T.LIST_QUEUES_OK, 9)
    s.close()


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(
    st.binary(min_size=1, max_size=200),
    st.tuples(st.sampled_from(list(T)), st.binary(max_size=64), st.integers(0, 40),
              st.binary(max_size=3)).map(lambda t: bytearray(encode_frame(t[0], 7, t[1]))[:16 + t[2]] + t[3]),
))
def test_fuzzed_frames_never_hurt_the_broker(server: Server, data: bytes) -> None:
    s = _raw(server)
    s.sendall(bytes(data))
    s.settimeout(0.2)
    try:
        while s.recv(65536):
            pass
    except (TimeoutError, ConnectionResetError):
        pass
    s.close()
    b = shmq.connect(server.url)
    assert isinstance(b.list_queues(), list)
    b.close()


# ---------------------------------------------------------------- auth, limits, scale
def test_token_is_checked() -> None:
    srv = Server(workers=1, token="s3cret")
    try:
        with pytest.raises(shmq.AuthError):
            shmq.connect(srv.url, token="wrong")
        with pytest.raises(shmq.AuthError):
            shmq.connect(srv.url, token="")
        b = shmq.connect(srv.url, token="s3cret")
        assert b.list_queues() == []
        b.close()
    finally:
        assert srv.stop() == 0


def test_non_loopback_needs_a_token() -> None:
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--host",
                          "0.0.0.0", "--port", "0", "--instance", "nolo"], capture_output=True, timeout=60)
    assert out.returncode == 1 and b"token" in out.stderr


def test_a_thousand_idle_connections(server: Server) -> None:
    socks = [_raw(server) for _ in range(1000)]
    try:
        b = shmq.connect(server.url)
        q = b.create_queue("busy")
        q.put(b"still served")
        assert q.get(timeout=5).payload == b"still served"
        b.delete_queue("busy")
        b.close()
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def _twenty_to_push(server: Server, name: str, **limits: Any) -> Iterator[tuple[shmq.Queue, TcpQueue]]:
    """A queue holding b"0" .. b"19": its handle, and the handle of a second connection
    (the subscriber's); both connections and the queue are gone afterwards."""
    b = shmq.connect(server.url)
    sub_b = connect_tcp(server.url)
    try:
        q = b.create_queue(name, **limits)
        q.put_many([f"{i}".encode() for i in range(20)])
        yield q, sub_b.queue(name)
    finally:
        b.delete_queue(name)
        sub_b.close()
        b.close()


@pytest.mark.parametrize("credit", [1, 5])
def test_push_subscription_with_credit(server: Server, credit: int) -> None:
    with _twenty_to_push(server, "push") as (q, sq):
        it = sq.subscribe(credit=credit)
        got = []
        for m in it:
            got.append(m.payload)
            m.ack()
            if len(got) == 20:
                break
        it.close()
        assert got == [f"{i}".encode() for i in range(20)]
        assert q.stats()["retained"] == 0


def test_push_subscription_sends_at_most_its_credit_and_gives_back_the_rest(server: Server) -> None:
    """The broker pushes what is ready up to the credit (a batch), and no more until the
    client grants some back; closing the iterator gives back at once what was pushed
    but never handed out (not after the visibility timeout)."""
    with _twenty_to_push(server, "pushback", visibility_timeout=30) as (q, sq):
        it = sq.subscribe(credit=4)
        first = next(it)  # the first push came with 4: one handed out, no credit back yet
        assert q.stats()["groups"]["default"]["in_flight"] == 4
        first.ack()
        assert q.stats()["groups"]["default"]["in_flight"] == 3
        second = next(it)  # two handed out: half the window goes back, two more come
        wait_until(lambda: q.stats()["groups"]["default"]["in_flight"] == 5, timeout=5)
        it.close()  # 4 pushed and not handed out: given back now
        assert q.stats()["groups"]["default"]["in_flight"] == 1  # only `second`, still held
        rest = q.get_many(20, timeout=5)
        assert sorted(int(m.payload) for m in rest) == list(range(2, 20))
        assert all(m.deliveries == (2 if int(m.payload) < 6 else 1) for m in rest)
        second.ack()  # a lease is its connection's
        q.ack_many(rest)
        assert q.stats()["retained"] == 0


def test_closing_with_leases_on_deleted_and_recreated_queues(server: Server) -> None:
    """A connection closes holding leases of a queue deleted since, and of one deleted and
    created again: the worker gives back what still exists (nothing of the old queue
    reaches the new one) and keeps serving."""
    b = shmq.connect(server.url)
    holder = shmq.connect(server.url)
    try:
        gone = b.create_queue("gone")
        again = b.create_queue("again")
        gone.put(b"x")
        again.put_many([b"old1", b"old2"])
        hq_gone, hq_again = holder.queue("gone"), holder.queue("again")
        assert hq_gone.get(timeout=5).payload == b"x"
        assert len(hq_again.get_many(2, timeout=5)) == 2
        b.delete_queue("gone")
        b.delete_queue("again")
        again = b.create_queue("again")
        again.put(b"new")
        holder.close()  # gives back: nothing of "gone", nothing of the old "again"
        got = again.get_many(10, timeout=5)
        assert [(m.payload, m.deliveries) for m in got] == [(b"new", 1)]
        got[0].ack()
        assert again.stats()["groups"]["default"]["in_flight"] == 0
    finally:
        b.delete_queue("again")
        b.close()


def test_batch_and_inflight_limits(server: Server) -> None:
    b = shmq.connect(server.url)
    try:
        q = b.create_queue("limit", capacity=20000)
        with pytest.raises(shmq.LimitExceeded):
            q.put_many([b"x"] * 10_001)  # one frame holds at most MAX_BATCH
        q.put_many([b"x"] * 10_000)
        q.put(b"x")
        q.get_many(10_000)
        with pytest.raises(shmq.LimitExceeded):
            q.get()
    finally:
        b.delete_queue("limit")
        b.close()


# ---------------------------------------------------------------- the CLI
def _cli(server: Server, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", *args],
                          input=stdin, capture_output=True, timeout=120,
                          env={**os.environ, "SHMQ_URL": server.url})


@pytest.mark.slow
def test_cli_end_to_end(server: Server) -> None:
    assert _cli(server, "create", "cli", "--max-deliveries", "2").returncode == 0
    out = _cli(server, "produce", "cli", "--json", stdin=b"one\ntwo\nthree\n")
    assert out.returncode == 0 and b'"produced": 3' in out.stdout
    assert b"cli" in _cli(server, "list", "--json").stdout
    out = _cli(server, "peek", "cli", "--raw")
    assert out.stdout.split() == [b"one", b"two", b"three"]
    out = _cli(server, "consume", "cli", "-n", "1", "--json")
    assert b'"payload": "one"' in out.stdout
    out = _cli(server, "stats", "cli", "--json")
    assert b'"retained": 2' in out.stdout
    b = shmq.connect(server.url)
    q = b.queue("cli")
    for _ in range(2):
        q.get().nack()  # "two" reaches its 2 deliveries and is dead-lettered
    b.close()
    assert b"two" in _cli(server, "dlq", "cli", "--json").stdout
    assert _cli(server, "dlq", "cli", "--redrive").returncode == 0
    assert b'"retained": 2' in _cli(server, "stats", "cli", "--json").stdout
    assert _cli(server, "purge", "cli").returncode == 0
    out = _cli(server, "consume", "cli", "--timeout", "0.1")
    assert out.returncode == 2
    bad = _cli(server, "stats", "missing")
    assert bad.returncode == 1 and b"QUEUE_NOT_FOUND" in bad.stderr and len(bad.stderr.splitlines()) == 1
    out = _cli(server, "bench", "-n", "300", "--producers", "1", "--consumers", "1", "--json",
               "--queue", "clibench")
    assert out.returncode == 0 and b'"lost": 0' in out.stdout
    assert b"clibench" not in _cli(server, "list").stdout  # made for the run, gone with it
    _cli(server, "create", "kept")
    assert _cli(server, "bench", "-n", "100", "--producers", "1", "--consumers", "1", "--json",
                "--queue", "kept").returncode == 0
    assert b"kept" in _cli(server, "list").stdout  # there before: left there
    for name in ("cli", "cli.dlq", "kept"):
        assert _cli(server, "delete", name).returncode == 0
    for cmd in ("serve", "create", "produce", "consume", "peek", "stats", "purge", "dlq", "doctor", "bench"):
        assert b"Example" in _cli(server, cmd, "--help").stdout


_ = random


def test_workers_follow_a_killed_supervisor_and_restart_reattaches() -> None:
    srv = Server(workers=2, extra=["--keep"])
    b = shmq.connect(srv.url)
    b.create_queue("survive").put(b"kept")
    b.close()
    workers = srv.workers()
    srv.proc.kill()  # SIGKILL: no clean-up at all
    srv.proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, "workers outlived their supervisor"
    # the memory of the crashed broker is still there; a new broker on it re-attaches it
    again = Server(workers=1, extra=["--instance", srv.instance])
    try:
        b = shmq.connect(again.url)
        assert b.queue("survive").get(timeout=5).payload == b"kept"
        b.close()
    finally:
        assert again.stop() == 0
    for stream in (srv.proc.stdout, srv.proc.stderr):
        if stream:
            stream.close()


def test_keep_leaves_memory_queues_to_the_next_start() -> None:
    srv = Server(workers=1, extra=["--keep"])
    try:
        with shmq.connect(srv.url, token=srv.token) as b:
            q = b.create_queue("kept")
            q.put_many([b"a", b"b"])
            q.get(timeout=5).ack()  # a is settled; b stays
    finally:
        assert srv.stop() == 0
    assert objects(srv.instance), "--keep removed the shared memory"
    again = Server(workers=1, extra=["--instance", srv.instance])
    try:
        with shmq.connect(again.url, token=again.token) as b:
            q = b.queue("kept")
            m = q.get(timeout=5)
            assert (m.offset, m.payload) == (1, b"b")
            m.ack()
            with pytest.raises(shmq.Empty):
                q.get(block=False)
    finally:
        assert again.stop() == 0
    assert not objects(srv.instance)  # the second broker had no --keep


def test_a_taken_port_is_refused(server: Server) -> None:
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port",
                          str(server.port), "--instance", "taken"], capture_output=True, timeout=60)
    assert out.returncode == 1 and b"in use" in out.stderr.lower()
    assert not objects("taken")


def test_read_reply_never_outgrows_a_frame(server: Server) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue("bigread", max_bytes=64 << 20, max_message_size=1 << 20)
        for i in range(20):  # 20 MiB retained
            q.put(bytes([i]) * (1 << 20))
        first = q.read(0, 20)
        assert 0 < len(first) < 20  # capped below the 16 MiB frame limit, connection intact
        rest = q.read(first[-1].offset + 1, 20)
        assert [m.offset for m in first + rest] == list(range(20))
        assert all(m.payload == bytes([m.offset]) * (1 << 20) for m in first + rest)
        b.delete_queue("bigread")


@pytest.mark.parametrize("varied", [False, True], ids=["back-to-back", "with-a-redelivery"])
def test_batch_get_never_outgrows_a_frame(server: Server, varied: bool) -> None:
    """get_many(20) of 1 MiB messages: the answer stops at the 16 MiB frame limit (the
    rest stays for the next call) instead of breaking the connection."""
    with shmq.connect(server.url) as b:
        q = b.create_queue("bigget", max_bytes=64 << 20, max_message_size=1 << 20)
        for i in range(20):
            q.put(bytes([i]) * (1 << 20))
        if varied:  # the general path: a redelivery first
            q.get(timeout=5).nack()
        first = q.get_many(20, timeout=5)
        assert 0 < len(first) < 20
        rest = q.get_many(20, timeout=5)
        got = first + rest
        assert sorted(m.offset for m in got) == list(range(20))
        assert all(m.payload == bytes([m.offset]) * (1 << 20) for m in got)
        q.ack_many(got)
        assert q.stats()["retained"] == 0
        b.delete_queue("bigget")


def test_the_cli_reads_a_token_file_and_warns_of_a_token_in_argv(tmp_path: Any) -> None:
    srv = Server(workers=1, token="s3cret")
    try:
        good = tmp_path / "token"
        good.write_text("s3cret\n")
        out = _cli(srv, "list", "--url", srv.url, "--token-file", str(good))
        assert out.returncode == 0 and b"warning" not in out.stderr
        out = _cli(srv, "list", "--url", srv.url, "--token", "s3cret")
        assert out.returncode == 0 and b"visible to every local user" in out.stderr
        out = _cli(srv, "list", "--url", srv.url, "--token-file", str(tmp_path / "missing"))
        assert out.returncode == 1 and b"cannot read the token file" in out.stderr
        bad = tmp_path / "bad"
        bad.write_text("wrong\n")
        out = _cli(srv, "list", "--url", srv.url, "--token-file", str(bad))
        assert out.returncode == 1 and b"AUTH_FAILED" in out.stderr
    finally:
        assert srv.stop() == 0
