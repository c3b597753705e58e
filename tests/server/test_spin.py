"""Polling before sleeping (``shmq.spin``, ``server.spinner``): the policy with a clock the
test moves, the client's read against sockets that say exactly when data comes, the
worker's spinner against a loop the test turns, and both ends on a real broker, polling
and not."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable
from typing import Any

import pytest
from typer.testing import CliRunner

import shmq
from shmq import options
from shmq.cli.app import app
from shmq.errors import InvalidArgument
from shmq.server.spinner import Spinner
from shmq.spin import MSG_DONTWAIT, Spin, check_spin_us, recv_into
from tests.support.connect import connect_tcp
from tests.support.instances import objects, unique_instance
from tests.support.server import Server


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


# ---------------------------------------------------------------- the policy
def test_a_wait_polls_for_its_window_and_sleeps_at_once_after_a_miss() -> None:
    clock = Clock()
    spin = Spin(100, backoff=3, clock=clock)
    assert spin.deadline() == clock.now + 100_000  # ns
    spin.missed()
    assert [spin.deadline() for _ in range(3)] == [0, 0, 0]  # the next 3 waits sleep at once
    clock.now += 5
    assert spin.deadline() == clock.now + 100_000  # then it polls again


def test_no_window_never_polls() -> None:
    spin = Spin(0)
    assert [spin.deadline() for _ in range(3)] == [0, 0, 0]


@pytest.mark.parametrize("bad", [-1, options.MAX_SPIN_US + 1, float("nan"), True, "100", None])
def test_a_window_out_of_range_is_refused(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"spin_us must be a number of microseconds in \[0, 10000\]"):
        check_spin_us(bad)
    with pytest.raises(InvalidArgument):
        Spin(bad)


def test_the_bounds_are_allowed() -> None:
    assert check_spin_us(0) == 0.0 and check_spin_us(options.MAX_SPIN_US) == options.MAX_SPIN_US


# ---------------------------------------------------------------- the client's read
class Sock:
    """``recv_into`` that has nothing for the first ``empty`` polls, then ``data``; a
    blocking read gets ``data`` at once (the test decides when it comes)."""

    def __init__(self, empty: int, data: bytes, clock: Clock, tick: int) -> None:
        self.empty, self.data, self.clock, self.tick = empty, data, clock, tick
        self.calls: list[str] = []

    def recv_into(self, buf: bytearray, nbytes: int = 0, flags: int = 0) -> int:
        if flags & MSG_DONTWAIT:
            self.calls.append("poll")
            self.clock.now += self.tick  # each poll takes a while
            if self.empty:
                self.empty -= 1
                raise BlockingIOError
        else:
            self.calls.append("block")
        buf[:len(self.data)] = self.data
        return len(self.data)


def test_an_answer_within_the_window_is_read_without_sleeping() -> None:
    clock = Clock()
    spin = Spin(100, backoff=4, clock=clock)
    sock = Sock(empty=5, data=b"answer", clock=clock, tick=10_000)  # the 6th poll, 60 µs in
    buf = bytearray(16)
    assert recv_into(sock, buf, spin) == 6 and buf[:6] == b"answer"
    assert sock.calls == ["poll"] * 6
    assert spin.skip == 0  # a hit: the next wait polls too


def test_an_answer_after_the_window_is_slept_for_and_the_next_waits_do_not_poll() -> None:
    clock = Clock()
    spin = Spin(100, backoff=2, clock=clock)
    sock = Sock(empty=1000, data=b"late", clock=clock, tick=30_000)
    buf = bytearray(16)
    assert recv_into(sock, buf, spin) == 4 and buf[:4] == b"late"
    assert sock.calls == ["poll"] * 4 + ["block"]  # 0, 30, 60, 90 µs polled; 120 µs: past the window
    assert spin.skip == 2
    sock.calls.clear()
    recv_into(sock, buf, spin)
    recv_into(sock, buf, spin)
    assert sock.calls == ["block", "block"]  # the backoff: straight to sleep
    sock.empty = 0
    recv_into(sock, buf, spin)
    assert sock.calls[-1:] == ["poll"]  # and then polling again


def test_a_real_socket_polls_its_data_and_its_close() -> None:
    a, b = socket.socketpair()
    try:
        spin = Spin(options.MAX_SPIN_US)
        buf = bytearray(64)
        a.sendall(b"frame")
        assert recv_into(b, buf, spin) == 5 and buf[:5] == b"frame"
        a.close()
        assert recv_into(b, buf, spin) == 0  # the peer's close, seen while polling
        assert spin.skip == 0
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------- the worker's spinner
class Loop:
    """``call_soon`` that keeps the callbacks for the test to run."""

    def __init__(self) -> None:
        self.ready: list[Callable[[], Any]] = []

    def call_soon(self, cb: Callable[[], Any]) -> None:
        self.ready.append(cb)

    def turn(self) -> int:
        """Run what is ready (one turn of the loop); how many ran."""
        ready, self.ready = self.ready, []
        for cb in ready:
            cb()
        return len(ready)


def test_the_worker_polls_after_a_read_until_its_window_ends() -> None:
    clock, loop = Clock(), Loop()
    spinner = Spinner(Spin(100, backoff=2, clock=clock), loop.call_soon)
    spinner.read()
    assert len(loop.ready) == 1  # one callback keeps the loop from sleeping
    clock.now += 60_000
    assert loop.turn() == 1 and len(loop.ready) == 1  # still within the window
    spinner.read()  # the next request, read while polling: the window starts again
    assert len(loop.ready) == 1  # no second callback
    clock.now += 60_000
    assert loop.turn() == 1 and len(loop.ready) == 1  # 120 µs after the first read, 60 after the second
    clock.now += 50_000
    assert loop.turn() == 1 and loop.ready == []  # the window ran out: the loop may sleep
    assert spinner.spin.skip == 0  # it read something in that window: no backoff


def test_a_window_with_nothing_read_makes_the_next_reads_start_none() -> None:
    clock, loop = Clock(), Loop()
    spinner = Spinner(Spin(100, backoff=2, clock=clock), loop.call_soon)
    spinner.read()
    clock.now += 200_000
    loop.turn()
    assert loop.ready == [] and spinner.spin.skip == 2
    spinner.read()
    spinner.read()
    assert loop.ready == []  # two reads, no polling
    spinner.read()
    assert len(loop.ready) == 1  # then it polls again


def test_a_worker_without_a_window_never_polls() -> None:
    loop = Loop()
    spinner = Spinner(Spin(0), loop.call_soon)
    for _ in range(3):
        spinner.read()
    assert loop.ready == []


# ---------------------------------------------------------------- on a real broker
@pytest.mark.parametrize("worker_spin", ["0", "100"])
@pytest.mark.parametrize("client_spin", [0, 100])
def test_every_message_comes_through_polling_or_not(worker_spin: str, client_spin: int) -> None:
    srv = Server(workers=1, extra=["--spin-us", worker_spin])
    try:
        b = connect_tcp(srv.url, srv.token, spin_us=client_spin, heartbeat=0)  # (no read but ours)
        q = b.create_queue("spin")
        sent = [f"m{i}".encode() for i in range(200)]
        for p in sent:
            q.put(p)
        got = []
        for _ in sent:
            m = q.get(timeout=5)
            got.append(m.payload)
            m.ack()
        assert got == sent
        b._spin.skip = 0  # a round trip above slower than the window (a busy machine) left a backoff running
        with pytest.raises(shmq.Empty):
            q.get(timeout=0.05)  # answered after the window: slept for
        assert b._spin.skip == (options.SPIN_BACKOFF if client_spin else 0)
        g = q.stats()["groups"]["default"]
        assert (g["depth"], g["in_flight"], g["acked"]) == (0, 0, 200)
        b.close()
    finally:
        assert srv.stop() == 0


def test_a_client_window_out_of_range_is_refused_before_connecting() -> None:
    with pytest.raises(InvalidArgument, match="spin_us"):
        shmq.connect("tcp://127.0.0.1:1", spin_us=-5)  # nothing listens there: refused first


def test_a_pickled_handle_keeps_its_window(server: Server) -> None:
    b = connect_tcp(server.url, server.token, spin_us=0)
    q = b.create_queue("spin-pickled")
    try:
        copy = pickle.loads(pickle.dumps(q))
        assert copy.broker.spin_us == 0 and copy.broker._spin.window == 0
        copy.broker.close()
    finally:
        b.delete_queue("spin-pickled")
        b.close()


def test_serve_refuses_a_window_out_of_range_before_it_makes_anything() -> None:
    instance = unique_instance()
    out = CliRunner().invoke(app, ["serve", "--port", "0", "--workers", "1", "--instance", instance,
                                   "--spin-us", str(options.MAX_SPIN_US * 2)], env={"SHMQ_SPIN_US": None})
    assert out.exit_code == 1, out.output
    assert "error: --spin-us must be a number of microseconds in [0, 10000]" in out.stderr
    assert objects(instance) == []
