"""`shmq serve` killed at the points that matter, as real processes.

* One instance has one broker: a second ``shmq serve`` on a served instance is refused
  without touching it; a SIGKILLed supervisor's instance is taken over at once.
* Every server-side crash point (``worker.*``, ``journal.*``, ``recovery.*`` in
  ``shmq.crashpoints``): the broker is started with the point armed, TCP clients drive it
  through the point, the process dies there (the supervisor restarts it, disarmed), and
  every message's fate is checked: a put the client saw confirmed is delivered, an ack
  it saw confirmed is never undone, a lease the dead process held comes back, and the
  broker keeps serving.

Every test leaves no process and nothing in /dev/shm behind (``nothing_left_behind``).
"""

from __future__ import annotations

import os
import re
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

import shmq
from shmq import crashpoints
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.segment import objects_of, queue_id_of
from tests.support.instances import leftovers, mp_helper, objects, reg_path, unique_instance
from tests.support.server import Server
from tests.support.wait import wait_until

pytestmark = pytest.mark.crash

CLI = [sys.executable, "-c", "from shmq.cli.app import app; app()"]
RESTARTED = "exited with -9; restarting"  # the supervisor's line for a SIGKILLed worker or journal process


# ---------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """After each test: no process it started is running, nothing new is in /dev/shm."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    shm_before = set(leftovers())
    yield
    new = [p for p in me.children(recursive=True) if p.pid not in before and not mp_helper(p)]
    _, alive = psutil.wait_procs(new, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"processes of this test are still running: {alive}"
    assert set(leftovers()) - shm_before == set(), "this test left shared memory behind"


def armed(monkeypatch: pytest.MonkeyPatch, point: str, **kw: object) -> Server:
    """``shmq serve`` (tests.support.server.Server) whose processes die at ``point`` (``NAME[:N]``).
    Only the broker inherits the setting: it is unset again once the broker has started."""
    with monkeypatch.context() as m:
        m.setenv(crashpoints.ENV, point)
        return Server(**kw)  # type: ignore[arg-type]


@contextmanager
def dies_once(monkeypatch: pytest.MonkeyPatch, point: str, **kw: object) -> Iterator[tuple[Server, Stderr]]:
    """An ``armed`` broker and its stderr; afterwards exactly one of its processes was
    restarted (its replacement passes the point too, disarmed) and the broker stops cleanly."""
    srv = armed(monkeypatch, point, **kw)
    err = Stderr(srv)
    try:
        yield srv, err
        assert err.read().count(RESTARTED) == 1
    finally:
        assert srv.stop() == 0


class Stderr:
    """A broker's stderr, accumulated (``Server.stderr_so_far`` hands out each byte once)."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.text = ""

    def read(self) -> str:
        self.text += self.srv.stderr_so_far()
        return self.text

    def wait_for(self, needle: str, count: int = 1, timeout: float = 10) -> None:
        try:
            wait_until(lambda: self.read().count(needle) >= count, timeout=timeout)
        except AssertionError:
            raise AssertionError(f"{needle!r} x{count} not in the broker's stderr: {self.text!r}") from None


def connect_when_up(url: str, timeout: float = 10) -> shmq.Broker:
    """A connection once a worker listens again (a dead single worker's port refuses until
    its replacement is up)."""
    got: list[shmq.Broker] = []

    def up() -> bool:
        try:
            got.append(shmq.connect(url))
        except shmq.ConnectionLost:
            return False
        return True

    wait_until(up, timeout=timeout, interval=0.02)
    return got[0]


def take(q: shmq.Queue, n: int) -> list[shmq.Message]:
    """Exactly ``n`` messages, and proof that nothing else is deliverable now."""
    got: list[shmq.Message] = []
    while len(got) < n:
        got += q.get_many(n - len(got), timeout=5)
    with pytest.raises(shmq.Empty):
        q.get(block=False)
    return got


def drain(q: shmq.Queue) -> list[shmq.Message]:
    """Every message deliverable now (none is leased or delayed: all are ready at once)."""
    got: list[shmq.Message] = []
    while True:
        try:
            got += q.get_many(100, block=False)
        except shmq.Empty:
            return got


def registry_owner(instance: str) -> int:
    """The owner pid recorded in the instance's registry, read without attaching to it."""
    with open(reg_path(instance), "rb") as f:
        return int(struct.unpack_from("<Q", f.read(L.R_HEADER_SIZE), L.R_OWNER_PID * L.WORD)[0])


def queue_segments(instance: str) -> list[str]:
    """The queue segments of an instance in /dev/shm (read without attaching)."""
    return [n for n in objects_of(instance) if queue_id_of(instance, n) is not None]


def still_serves(b: shmq.Broker) -> None:
    """The broker answers a whole round: create, put, get, ack, delete."""
    q = b.create_queue("after")
    q.put(b"alive")
    m = q.get(timeout=5)
    assert m.payload == b"alive"
    m.ack()
    b.delete_queue("after")


def ofd_locks(pid: int) -> int:
    """How many OFD locks the open files of ``pid`` hold (``/proc/<pid>/fdinfo``)."""
    n = 0
    base = f"/proc/{pid}/fdinfo"
    for fd in os.listdir(base):
        try:
            with open(f"{base}/{fd}") as f:
                n += sum(1 for line in f if line.startswith("lock:") and "OFDLCK" in line)
        except FileNotFoundError:
            pass  # closed meanwhile
    return n


def close_streams(srv: Server) -> None:
    """The pipes of a broker that was killed (``Server.stop`` is not called on it: it would
    remove the instance that its successor serves)."""
    for stream in (srv.proc.stdout, srv.proc.stderr):
        if stream:
            stream.close()


# ---------------------------------------------------------------- one instance, one broker
@pytest.mark.parametrize("same_port", [False, True])
def test_a_second_serve_on_a_live_instance_is_refused_and_changes_nothing(tmp_path: Path,
                                                                          same_port: bool) -> None:
    srv = Server(workers=2)
    try:
        b = shmq.connect(srv.url)
        q = b.create_queue("kept", visibility_timeout=60)
        q.put_many([b"a", b"b", b"c"])
        held = q.get(timeout=5)  # a lease, which a take-over would disturb
        # only the supervisor holds the broker lock: its workers and journal process do not
        assert ofd_locks(srv.proc.pid) == 1
        children = [p for p in psutil.Process(srv.proc.pid).children() if not mp_helper(p)]
        assert len(children) == 3 and all(ofd_locks(p.pid) == 0 for p in children)

        data_dir = tmp_path / "second"
        port = str(srv.port) if same_port else "0"
        out = subprocess.run([*CLI, "serve", "--port", port, "--workers", "1", "--instance", srv.instance,
                              "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert out.stdout == ""
        assert out.stderr.splitlines() == [
            f"shmq: instance {srv.instance!r} is already served by pid {srv.proc.pid} "
            f"(tcp://127.0.0.1:{srv.port})"]
        assert not data_dir.exists()  # refused before recovery looked at its data dir

        # the live broker is untouched: its queue, its messages, its lease, its ownership
        assert srv.proc.poll() is None
        assert registry_owner(srv.instance) == srv.proc.pid
        held.ack()
        assert [m.payload for m in take(q, 2)] == [b"b", b"c"]
        still_serves(b)
        b.close()
    finally:
        assert srv.stop() == 0


def test_a_sigkilled_supervisor_is_taken_over_at_once(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    srv = Server(workers=2, data_dir=data)
    b = shmq.connect(srv.url)
    b.create_queue("mem").put_many([b"m1", b"m2"])
    b.create_queue("dur", durability="always").put_many([b"d1", b"d2"])
    b.close()
    family = [p for p in psutil.Process(srv.proc.pid).children() if not mp_helper(p)]
    assert len(family) == 3  # two workers, the journal process
    srv.proc.kill()  # SIGKILL: no clean-up at all, the broker lock goes with the process
    srv.proc.wait()
    _, alive = psutil.wait_procs(family, timeout=10)  # they die with their parent
    assert not alive, f"outlived their supervisor: {alive}"
    again = None
    try:
        started = time.monotonic()
        again = Server(workers=1, instance=srv.instance, data_dir=data)
        assert time.monotonic() - started < 10  # no waiting for a lock or a timeout
        assert ofd_locks(again.proc.pid) == 1
        b = shmq.connect(again.url)
        # the memory-only queue outlived the crash (shared memory re-attached), and so did
        # the journaled one: the new broker serves both and journals the durable one on
        assert [m.payload for m in take(b.queue("mem"), 2)] == [b"m1", b"m2"]
        dur = b.queue("dur")
        assert dur.put(b"d3") == 2
        got = take(dur, 3)
        assert [m.payload for m in got] == [b"d1", b"d2", b"d3"]
        dur.ack_many(got[:1])
        still_serves(b)
        b.close()
        assert again.stop() == 0
        # the journaled queue comes back once more from its journal, as acknowledged
        again = Server(workers=1, instance=srv.instance, data_dir=data)
        with shmq.connect(again.url) as b:
            assert [m.payload for m in take(b.queue("dur"), 2)] == [b"d2", b"d3"]
    finally:
        if again is not None:
            assert again.stop() == 0
        close_streams(srv)
        if os.path.exists(reg_path(srv.instance)):
            ShmBroker(srv.instance).destroy()


def test_two_serves_racing_for_a_fresh_instance_one_wins(tmp_path: Path) -> None:
    instance = unique_instance()
    procs = [subprocess.Popen([*CLI, "serve", "--port", "0", "--workers", "1", "--instance", instance,
                               "--data-dir", str(tmp_path / f"d{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    try:
        # the loser exits at once; the winner serves until it is stopped
        wait_until(lambda: any(p.poll() is not None for p in procs), timeout=30, interval=0.02)
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        assert loser.returncode == 1
        err = loser.communicate()[1].splitlines()
        # (the address is named when the winner's workers listened already: not always, here)
        assert len(err) == 1 and err[0].startswith(
            f"shmq: instance {instance!r} is already served by pid {winner.pid}"), err
        assert winner.stdout is not None
        m = re.search(r"tcp://127\.0\.0\.1:(\d+)", winner.stdout.readline())
        assert m, "the winner did not announce itself"
        with shmq.connect(f"tcp://127.0.0.1:{m[1]}") as b:
            still_serves(b)
        winner.send_signal(signal.SIGTERM)
        assert winner.wait(20) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for s in (p.stdout, p.stderr):
                if s:
                    s.close()
    assert not os.path.exists(reg_path(instance))


# ---------------------------------------------------------------- worker crash points
@pytest.mark.parametrize("how", ["put", "put_many", "publisher"])
def test_worker_dies_after_storing_a_produce(monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """``worker.produce.unanswered``: stored, not answered.  Every confirmed put is delivered
    once; the unanswered one is delivered too (at-least-once: a retry would duplicate it);
    nothing the worker never got is invented."""
    # the publisher's 5th store: a few runs confirmed before it (a reply is flushed once per read)
    point = f"worker.produce.unanswered:{5 if how == 'publisher' else 3}"
    with dies_once(monkeypatch, point, workers=1) as (srv, err):
        b = shmq.connect(srv.url)
        q = b.create_queue("p")
        if how == "put":
            sent = [b"0", b"1", b"2"]
            assert [q.put(sent[0]), q.put(sent[1])] == [0, 1]
            with pytest.raises(shmq.ConnectionLost):
                q.put(sent[2])
            confirmed, stored = 2, 3
        elif how == "put_many":
            sent = [b"0", b"1", b"2", b"3", b"4", b"5"]
            assert q.put_many(sent[:2]) == [0, 1]
            assert q.put_many(sent[2:4]) == [2, 3]
            with pytest.raises(shmq.ConnectionLost):
                q.put_many(sent[4:])
            confirmed, stored = 4, 6
        else:  # a pipeline: the worker stores a run of puts read together, then dies
            sent = [f"{i}".encode() for i in range(300)]
            p = q.publisher(window=64)
            with pytest.raises(shmq.ConnectionLost):
                for m in sent:
                    p.put(m)
                p.flush()
            confirmed, stored = p.confirmed, -1
        err.wait_for(RESTARTED)
        b2 = connect_when_up(srv.url)
        got = [m.payload for m in drain(b2.queue("p"))]
        if stored >= 0:
            assert got == sent[:stored]
        else:  # some prefix was stored: every confirmed put, in order, nothing twice or invented
            assert confirmed <= len(got) and got == sent[:len(got)], (confirmed, len(got))
        still_serves(b2)
        b2.close()
        b.close()


def test_worker_dies_with_leases_it_never_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker.deliver.unsent``: the leases of a DELIVER never sent come back at once
    (the supervisor reaps the dead worker's client slot), counted as a delivery; an
    acknowledged message is not redelivered."""
    with dies_once(monkeypatch, "worker.deliver.unsent:2", workers=1) as (srv, err):
        b = shmq.connect(srv.url)
        q = b.create_queue("d", visibility_timeout=300)  # an expiry must not be what brings them back
        q.put_many([b"a", b"b", b"c", b"d"])
        m = q.get(timeout=5)  # pass 1: sent
        assert m.payload == b"a"
        m.ack()
        with pytest.raises(shmq.ConnectionLost):
            q.get_many(2, timeout=5)  # pass 2: b and c leased, then the worker dies
        err.wait_for(RESTARTED)
        b2 = connect_when_up(srv.url)
        got = take(b2.queue("d"), 3)
        assert [(m.payload, m.deliveries) for m in got] == [(b"b", 2), (b"c", 2), (b"d", 1)]
        b2.queue("d").ack_many(got)
        still_serves(b2)
        b2.close()
        b.close()


def test_worker_dies_in_a_push_with_leases_it_never_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker.deliver.unsent`` in push mode: a subscription's batch leased, not pushed."""
    with dies_once(monkeypatch, "worker.deliver.unsent", workers=1) as (srv, err):
        b = shmq.connect(srv.url)
        q = b.create_queue("s", visibility_timeout=300)
        q.put_many([b"a", b"b", b"c"])
        sub = q.subscribe(credit=10)  # type: ignore[attr-defined]
        with pytest.raises(shmq.ConnectionLost):
            next(sub)  # SUBSCRIBE is answered, then its first push leases a, b, c and the worker dies
        err.wait_for(RESTARTED)
        b2 = connect_when_up(srv.url)
        got = take(b2.queue("s"), 3)
        assert [(m.payload, m.deliveries) for m in got] == [(b"a", 2), (b"b", 2), (b"c", 2)]
        still_serves(b2)
        b2.close()
        b.close()


def test_worker_dies_giving_back_a_closed_connections_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker.give_back.queue``: a closing connection's leases went back in one queue, the
    worker died before the other; those come back when the supervisor reaps the worker."""
    with dies_once(monkeypatch, "worker.give_back.queue", workers=1) as (srv, err):
        b = shmq.connect(srv.url)
        q1 = b.create_queue("g1", visibility_timeout=300)
        q2 = b.create_queue("g2", visibility_timeout=300)
        q1.put_many([b"x1", b"y1"])
        q2.put_many([b"x2", b"y2"])
        done = q1.get(timeout=5)
        done.ack()  # settled before the crash: never redelivered
        assert q1.get(timeout=5).payload == b"y1"
        assert [m.payload for m in q2.get_many(2, timeout=5)] == [b"x2", b"y2"]
        b.close()  # DISCONNECT: the worker gives back g1's lease, then dies
        err.wait_for(RESTARTED)
        b2 = connect_when_up(srv.url)
        assert [(m.payload, m.deliveries) for m in take(b2.queue("g1"), 1)] == [(b"y1", 2)]
        assert [(m.payload, m.deliveries) for m in take(b2.queue("g2"), 2)] == [(b"x2", 2), (b"y2", 2)]
        still_serves(b2)
        b2.close()


def test_worker_dies_after_applying_an_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker.ack.unanswered``: the ack took effect although its reply never came; the
    message is never redelivered, the connection's other lease comes back."""
    with dies_once(monkeypatch, "worker.ack.unanswered", workers=1) as (srv, err):
        b = shmq.connect(srv.url)
        q = b.create_queue("k", visibility_timeout=300)
        q.put_many([b"a", b"b"])
        a, _ = q.get_many(2, timeout=5)
        with pytest.raises(shmq.ConnectionLost):
            a.ack()
        err.wait_for(RESTARTED)
        b2 = connect_when_up(srv.url)
        assert [(m.payload, m.deliveries) for m in take(b2.queue("k"), 1)] == [(b"b", 2)]
        still_serves(b2)
        b2.close()
        b.close()


# ---------------------------------------------------------------- journal crash points
@pytest.mark.parametrize("point", ["journal.round.appended", "journal.round.published"])
def test_journal_process_dies_in_a_round(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, point: str) -> None:
    """The journal process dies in the round that journals an `always` put: the put is
    confirmed (by the restarted journal process, or by the mark published before the
    death), nothing is journaled twice or lost, and the journal rebuilds the queue as
    acknowledged after a stop."""
    data = str(tmp_path / "data")
    srv = armed(monkeypatch, point, workers=1, data_dir=data)
    err = Stderr(srv)
    again = None
    try:
        b = shmq.connect(srv.url)
        q = b.create_queue("j", durability="always")  # rounds without messages do not count
        assert q.put(b"a", timeout=20) == 0  # its round kills the journal process
        err.wait_for("the journal process " + RESTARTED)
        assert q.put_many([b"b", b"c"], timeout=20) == [1, 2]
        m = q.get(timeout=5)
        assert (m.payload, m.offset) == (b"a", 0)
        m.ack()
        b.close()
        assert err.read().count(RESTARTED) == 1  # its replacement journaled b and c, disarmed
        assert srv.stop() == 0  # the shared memory goes; the journal stays
        assert not objects(srv.instance)
        again = Server(workers=1, instance=srv.instance, data_dir=data)
        with shmq.connect(again.url) as b:
            got = take(b.queue("j"), 2)
            assert [(m.payload, m.offset) for m in got] == [(b"b", 1), (b"c", 2)]
            assert b.queue("j").put(b"d") == 3
            still_serves(b)
    finally:
        if again is not None:
            assert again.stop() == 0
        if srv.proc.poll() is None:
            srv.stop()


def test_supervisor_dies_in_recovery_after_one_queue(tmp_path: Path) -> None:
    """``recovery.rebuilt``: the supervisor rebuilt one journaled queue and died before the
    others (before forking anything); the next ``shmq serve`` takes the instance over, keeps
    the rebuilt queue and rebuilds the rest, acknowledged messages staying acknowledged."""
    data = str(tmp_path / "data")
    srv = Server(workers=1, data_dir=data)
    with shmq.connect(srv.url) as b:
        r1 = b.create_queue("r1", durability="always")
        r2 = b.create_queue("r2", durability="always")
        r1.put_many([b"a1", b"a2"])
        r2.put_many([b"b1", b"b2"])
        r1.get(timeout=5).ack()
    assert srv.stop() == 0
    again = None
    try:
        out = subprocess.run([*CLI, "serve", "--port", "0", "--workers", "1", "--instance", srv.instance,
                              "--data-dir", data], capture_output=True, text=True, timeout=60,
                             env={**os.environ, crashpoints.ENV: "recovery.rebuilt"})
        assert out.returncode == -signal.SIGKILL, out.stderr
        assert len(queue_segments(srv.instance)) == 1  # one queue rebuilt, the other not
        again = Server(workers=1, instance=srv.instance, data_dir=data)
        with shmq.connect(again.url) as b:
            assert [(m.payload, m.deliveries) for m in take(b.queue("r1"), 1)] == [(b"a2", 1)]
            assert [m.payload for m in take(b.queue("r2"), 2)] == [b"b1", b"b2"]
            still_serves(b)
    finally:
        if again is not None:
            assert again.stop() == 0
        if os.path.exists(reg_path(srv.instance)):
            ShmBroker(srv.instance).destroy()


def test_every_server_point_is_tested_here() -> None:
    server_points = {n for n in crashpoints.POINTS if n.startswith(("worker.", "journal.", "recovery."))}
    text = Path(__file__).read_text()
    assert {n for n in server_points if f'"{n}' not in text} == set()
