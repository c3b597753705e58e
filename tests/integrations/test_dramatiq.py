"""``shmq.dramatiq``: Dramatiq's broker and result backend on shmq, against a real ``shmq serve``
(over TCP and co-located over ``shm://``), with real Dramatiq workers: in this process
(``dramatiq.Worker``) and the ``dramatiq`` command line's worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dramatiq
import dramatiq.worker
import psutil
import pytest
from dramatiq.middleware import Middleware
from dramatiq.results import ResultFailure, ResultMissing, Results

import shmq
from shmq.dramatiq import ShmqBroker, ShmqResultBackend
from tests.support.instances import unique_instance
from tests.support.proxy import CutProxy
from tests.support.server import Server, kill_tree
from tests.support.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- fixtures
@pytest.fixture
def prefix(server: Server) -> Iterator[str]:
    """A prefix of this test's own for its queues' names; they are deleted after it."""
    p = f"{unique_instance()}."
    yield p
    b = shmq.connect(server.url, token=server.token)
    try:
        for info in b.list_queues():
            if info.name.startswith(p):
                try:
                    b.delete_queue(info.name)
                except shmq.QueueNotFound:
                    pass
    finally:
        b.close()


@pytest.fixture(params=["tcp", "shm"])
def url(request: pytest.FixtureRequest, server: Server) -> str:
    """The broker over TCP, and co-located (attaching the instance it serves)."""
    return server.url if request.param == "tcp" else f"shm://{server.instance}"


@pytest.fixture
def make_broker(server: Server, url: str, prefix: str) -> Iterator[Callable[..., ShmqBroker]]:
    made: list[ShmqBroker] = []

    def make(**kw: Any) -> ShmqBroker:
        b = ShmqBroker(url=url, token=server.token, prefix=prefix, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.fixture
def broker(make_broker: Callable[..., ShmqBroker]) -> ShmqBroker:
    return make_broker()


@pytest.fixture
def plain(server: Server) -> Iterator[shmq.Broker]:
    """A plain shmq handle on the broker, to look at the queues."""
    b = shmq.connect(server.url, token=server.token)
    yield b
    b.close()


@pytest.fixture
def raw(plain: shmq.Broker, prefix: str) -> Callable[[str], shmq.Queue]:
    """A plain shmq handle on one of this test's queues (by its Dramatiq name)."""
    return lambda name: plain.queue(prefix + name)


@contextmanager
def working(broker: ShmqBroker, threads: int = 4) -> Iterator[dramatiq.Worker]:
    """A Dramatiq worker in this process (its consumers wake every 100 ms to see a stop)."""
    w = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    w.start()
    try:
        yield w
    finally:
        w.stop(timeout=20_000)


def actor(broker: ShmqBroker, fn: Callable[..., Any], **options: Any) -> dramatiq.Actor[Any, Any]:
    """``fn`` as an actor of ``broker`` (``options``: the actor's)."""
    return dramatiq.actor(broker=broker, **options)(fn)


def depth(q: shmq.Queue) -> tuple[int, int, int]:
    """(depth, in flight, delayed) of the default group."""
    g = q.stats()["groups"]["default"]
    return g["depth"], g["in_flight"], g["delayed"]


class Recorder(Middleware):
    """What the broker was asked to enqueue (and the delay), and when each message began."""

    def __init__(self) -> None:
        self.enqueued: list[tuple[float, int | None]] = []
        self.started: list[tuple[float, int]] = []  # (when, retries so far)

    def before_enqueue(self, broker: Any, message: Any, delay: int | None) -> None:
        self.enqueued.append((time.monotonic(), delay))

    def before_process_message(self, broker: Any, message: Any) -> None:
        self.started.append((time.monotonic(), message.options.get("retries", 0)))


# ---------------------------------------------------------------- consuming
def test_a_worker_processes_every_message_once(broker: ShmqBroker, raw: Callable[[str], shmq.Queue]) -> None:
    seen: list[int] = []
    lock = threading.Lock()

    def record(i: int) -> None:
        with lock:
            seen.append(i)

    act = actor(broker, record, queue_name="work", actor_name="record")
    assert broker.get_declared_queues() == {"work"}
    assert broker.get_declared_delay_queues() == set()  # delays are shmq's: no DQ
    for i in range(300):
        act.send(i)
    assert depth(raw("work"))[0] == 300
    with working(broker):
        broker.join("work", timeout=30_000)
        assert sorted(seen) == list(range(300))  # each once
        assert depth(raw("work")) == (0, 0, 0)
        act.send(300)
        broker.join("work", timeout=30_000)
    assert sorted(seen) == list(range(301))
    assert broker.dead_letters("work") == []


def test_a_stopping_worker_gives_back_what_it_did_not_run(broker: ShmqBroker,
                                                          raw: Callable[[str], shmq.Queue]) -> None:
    release = threading.Event()
    ran: list[int] = []

    def slow(i: int) -> None:
        ran.append(i)
        assert release.wait(30)

    act = actor(broker, slow, queue_name="slow", actor_name="slow")
    for i in range(5):
        act.send(i)
    q = raw("slow")
    w = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    w.start()
    wait_until(lambda: len(ran) == 1 and depth(q)[1] == 2, timeout=10)  # one runs, one waits (prefetch 2)
    stopping = threading.Thread(target=w.stop, kwargs={"timeout": 20_000})
    stopping.start()
    wait_until(lambda: not any(t.running for t in w.workers), timeout=10)
    release.set()  # the running one finishes; the prefetched one is given back
    stopping.join(30)
    assert not stopping.is_alive()
    assert ran == [0]
    assert depth(q) == (4, 0, 0)
    assert q.stats()["groups"]["default"]["acked"] == 1


# ---------------------------------------------------------------- delays, retries, dead letters
def test_a_delay_is_shmqs_own(broker: ShmqBroker, raw: Callable[[str], shmq.Queue], plain: shmq.Broker,
                              prefix: str) -> None:
    act = actor(broker, lambda: None, queue_name="later", actor_name="later")
    act.send_with_options(delay=60_000)
    q = raw("later")
    assert depth(q) == (1, 0, 1)  # in the queue itself, out of sight until due
    with pytest.raises(shmq.Empty):
        q.get_nowait()
    assert {i.name for i in plain.list_queues() if i.name.startswith(prefix)} == {prefix + "later"}  # no DQ
    with pytest.raises(ValueError, match="a week"):
        act.send_with_options(delay=8 * 86_400_000)
    assert depth(q) == (1, 0, 1)
    broker.flush("later")
    assert depth(q) == (0, 0, 0)


def test_retries_back_off_through_shmq_delays(make_broker: Callable[..., ShmqBroker],
                                              raw: Callable[[str], shmq.Queue]) -> None:
    rec = Recorder()
    broker = make_broker()
    broker.add_middleware(rec)
    done: list[str] = []

    def flaky(x: str) -> None:
        if len(rec.started) < 3:
            raise ValueError(f"attempt {len(rec.started)} fails")
        done.append(x)

    act = actor(broker, flaky, queue_name="flaky", actor_name="flaky", max_retries=5,
                         min_backoff=150, max_backoff=2000)
    act.send("payload")
    with working(broker):
        broker.join("flaky", timeout=30_000)
    assert done == ["payload"]
    assert [r for _, r in rec.started] == [0, 1, 2]  # failed twice, then succeeded
    assert [d for _, d in rec.enqueued][0] is None
    delays = [d or 0 for _, d in rec.enqueued[1:]]
    assert len(delays) == 2 and 150 <= delays[0] <= 300 and 300 <= delays[1] <= 600  # Dramatiq's backoff
    for (put_at, delay), (began, _) in zip(rec.enqueued[1:], rec.started[1:], strict=True):
        assert delay is not None
        assert began >= put_at + delay / 1000 - 0.002, "delivered before it was due"
    assert depth(raw("flaky")) == (0, 0, 0)
    assert broker.dead_letters("flaky") == []
    assert raw("flaky").stats()["groups"]["default"]["dead_lettered"] == 0


def test_a_poison_message_ends_in_the_dead_letter_queue(broker: ShmqBroker,
                                                         raw: Callable[[str], shmq.Queue]) -> None:
    attempts: list[int] = []

    def poison(doc: dict[str, Any]) -> None:
        attempts.append(doc["n"])
        raise RuntimeError("always")

    act = actor(broker, poison, queue_name="poison", actor_name="poison", max_retries=2,
                         min_backoff=10, max_backoff=50)
    doc = {"n": 7, "blob": "x" * 5000, "text": "naïve ✓"}
    sent = act.send(doc)
    with working(broker):
        broker.join("poison", timeout=30_000)
    assert attempts == [7, 7, 7]  # the first try and max_retries retries
    dead = broker.dead_letters("poison")
    assert len(dead) == 1
    assert (dead[0].message_id, dead[0].actor_name, dead[0].args, dead[0].kwargs) == \
        (sent.message_id, "poison", (doc,), {})
    [m] = raw("poison.dlq").read(0, 10)  # shmq's own dead-letter queue, the message's origin noted
    assert m.origin is not None and m.origin.queue == raw("poison").name
    assert dramatiq.Message.decode(bytes(m.payload)).args == (doc,)
    assert depth(raw("poison")) == (0, 0, 0)
    broker.flush("poison")  # flush empties the dead-letter queue too
    assert broker.dead_letters("poison") == []


# ---------------------------------------------------------------- bad input
def test_a_wrong_token_is_an_auth_error_and_the_broker_keeps_serving(server: Server, prefix: str) -> None:
    with pytest.raises(shmq.AuthError):
        ShmqBroker(url=server.url, token="not-the-token", prefix=prefix)
    good = ShmqBroker(url=server.url, token=server.token, prefix=prefix)
    try:
        got: list[int] = []
        act = actor(good, got.append, queue_name="after", actor_name="after")
        act.send(1)
        with working(good):
            good.join("after", timeout=30_000)
        assert got == [1]
    finally:
        good.close()


def test_no_instance_is_a_clear_error_and_none_is_made() -> None:
    name = unique_instance()
    with pytest.raises(shmq.InstanceNotFound):
        ShmqBroker(url=f"shm://{name}")
    assert not [f for f in os.listdir("/dev/shm") if name in f]


def test_a_message_too_large_is_refused_at_send_and_the_broker_keeps_serving(
        make_broker: Callable[..., ShmqBroker]) -> None:
    broker = make_broker(queue_options={"max_message_size": 4096})
    got: list[int] = []

    def take(s: str) -> None:
        got.append(len(s))

    act = actor(broker, take, queue_name="small", actor_name="take")
    with pytest.raises(shmq.MessageTooLarge):
        act.send("x" * 8000)
    act.send("x" * 100)
    with working(broker):
        broker.join("small", timeout=30_000)
    assert got == [100]


def test_a_message_dramatiq_cannot_decode_is_dead_lettered_and_the_worker_goes_on(
        broker: ShmqBroker, raw: Callable[[str], shmq.Queue]) -> None:
    got: list[int] = []
    act = actor(broker, got.append, queue_name="mixed", actor_name="keep")
    raw("mixed").put(b"\xff not a dramatiq message")
    act.send(1)
    with working(broker):
        broker.join("mixed", timeout=30_000)
    assert got == [1]
    assert [m.payload for m in raw("mixed.dlq").read(0, 10)] == [b"\xff not a dramatiq message"]


def test_bad_settings_are_refused_at_once(server: Server) -> None:
    with pytest.raises(ValueError, match="visibility_timeout"):
        ShmqBroker(url=server.url, token=server.token, visibility_timeout=13 * 3600)


def test_a_lost_connection_is_made_again(server: Server, prefix: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dramatiq.worker, "CONSUMER_RESTART_DELAY_SECS", 0.05)
    proxy = CutProxy(("127.0.0.1", server.port))
    broker = ShmqBroker(url=f"tcp://127.0.0.1:{proxy.port}", token=server.token, prefix=prefix)
    try:
        got: list[int] = []
        act = actor(broker, got.append, queue_name="flaky-net", actor_name="keep")
        with working(broker):
            act.send(1)
            broker.join("flaky-net", timeout=30_000)
            generation = broker.link.generation
            proxy.drop()  # the broker's connection closes under the worker's consumer and the producer
            act.send(2)  # made again for this put
            broker.join("flaky-net", timeout=30_000)
            assert broker.link.generation > generation
        assert got == [1, 2]
    finally:
        broker.close()
        proxy.close()


# ---------------------------------------------------------------- results
def test_results_are_stored_and_found(make_broker: Callable[..., ShmqBroker], server: Server, url: str,
                                      prefix: str) -> None:
    broker = make_broker()
    backend = ShmqResultBackend(broker=broker, namespace=f"{prefix}results")
    broker.add_middleware(Results(backend=backend))

    def double(x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    act = actor(broker, double, queue_name="math", actor_name="double", store_results=True,
                         max_retries=0)
    msgs = [act.send(i) for i in range(20)]
    bad = act.send(-1)
    with pytest.raises(ResultMissing):
        msgs[0].get_result(backend=backend)
    with working(broker):
        assert [m.get_result(backend=backend, block=True, timeout=20_000) for m in msgs] == \
            [2 * i for i in range(20)]
        with pytest.raises(ResultFailure, match="negative"):
            bad.get_result(backend=backend, block=True, timeout=20_000)
    # another process's backend (its own connection) finds them too, as often as asked
    other = ShmqResultBackend(url=url, token=server.token, namespace=f"{prefix}results")
    try:
        assert other.get_result(msgs[5]) == 10 and other.get_result(msgs[5]) == 10
    finally:
        other.link.close()


def test_results_expire_with_their_ttl(make_broker: Callable[..., ShmqBroker], prefix: str,
                                       raw: Callable[[str], shmq.Queue], plain: shmq.Broker) -> None:
    broker = make_broker()
    backend = ShmqResultBackend(broker=broker, namespace=f"{prefix}results")
    broker.add_middleware(Results(backend=backend))
    act = actor(broker, lambda: "soon gone", queue_name="ttl", actor_name="gone",
                         store_results=True, result_ttl=2000)
    m = act.send()
    with working(broker):
        assert m.get_result(backend=backend, block=True, timeout=20_000) == "soon gone"
    results = raw("results")
    wait_until(lambda: results.stats()["retained"] == 0, timeout=15)  # the broker dropped it
    assert results.stats()["groups"]["default"]["ttl_expired"] == 1
    with pytest.raises(ResultMissing):
        m.get_result(backend=backend)
    assert {i.name for i in plain.list_queues() if i.name.startswith(prefix)} == \
        {prefix + "ttl", prefix + "results"}  # an expired result is dropped, not dead-lettered


# ---------------------------------------------------------------- the dramatiq command line
def _cli(server: Server, prefix: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "tests.integrations.dramatiq_app", "--processes", "1",
         "--threads", "4"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "SHMQ_DRAMATIQ_URL": server.url, "SHMQ_DRAMATIQ_TOKEN": server.token,
             "SHMQ_DRAMATIQ_PREFIX": prefix, "dramatiq_worker_timeout": "100", **env})


def _send(server: Server, prefix: str, queue_name: str, actor_name: str, n: int) -> None:
    """Send ``actor_name(i)`` for i below ``n``, as a process that only produces (it declares
    no actor: the queue is made at the first enqueue if the worker has not made it)."""
    producer = ShmqBroker(url=server.url, token=server.token, prefix=prefix)
    try:
        for i in range(n):
            producer.enqueue(dramatiq.Message(queue_name=queue_name, actor_name=actor_name, args=(i,),
                                              kwargs={}, options={}))
    finally:
        producer.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
    assert proc.stderr is not None
    proc.stderr.close()


def _reports(done: shmq.Queue, n: int) -> list[str]:
    out: list[str] = []
    deadline = time.monotonic() + 60
    while len(out) < n and time.monotonic() < deadline:
        try:
            out += [m.text for m in done.get_many(n - len(out), timeout=1.0)]
        except shmq.Empty:
            pass
    return out


@pytest.mark.slow
def test_the_dramatiq_command_line_worker_runs_1000_messages_each_once(server: Server, prefix: str) -> None:
    b = shmq.connect(server.url, token=server.token)
    try:
        done = b.create_queue(prefix + "done")
        _send(server, prefix, "squares", "square", 1000)
        proc = _cli(server, prefix)
        try:
            reports = _reports(done, 1000)
            with pytest.raises(shmq.Empty):  # nothing more: each ran once
                done.get(timeout=0.3)
        finally:
            _stop(proc)
        assert len(reports) == 1000
        results = {int(i): int(sq) for i, sq, _ in (r.split(":") for r in reports)}
        assert results == {i: i * i for i in range(1000)}
        assert len({pid for *_, pid in (r.split(":") for r in reports)}) == 1  # one worker process
        squares = b.queue(prefix + "squares")
        wait_until(lambda: depth(squares) == (0, 0, 0), timeout=10)  # (the last acks ride unwaited)
    finally:
        b.close()


@pytest.mark.slow
def test_a_sigkilled_workers_messages_are_delivered_again(server: Server, prefix: str) -> None:
    b = shmq.connect(server.url, token=server.token)
    try:
        done = b.create_queue(prefix + "done")
        _send(server, prefix, "held", "held", 6)
        q = b.queue(prefix + "held")
        first = _cli(server, prefix, SHMQ_DRAMATIQ_HOLD="1")
        try:
            started = _reports(done, 4)  # 4 threads each hold one, 2 more wait prefetched
            assert len(started) == 4
            wait_until(lambda: depth(q)[1] == 6, timeout=30)
            pids = {int(r.split(":")[1]) for r in started}
            assert len(pids) == 1 and psutil.Process(pids.pop()).ppid() == first.pid
            kill_tree(first.pid)  # SIGKILL: the worker's connection drops, its leases go back at once
            wait_until(lambda: depth(q) == (6, 0, 0), timeout=10)
        finally:
            _stop(first)
        second = _cli(server, prefix, SHMQ_DRAMATIQ_HOLD="0")
        try:
            again = _reports(done, 6)
        finally:
            _stop(second)
        assert sorted(int(r.split(":")[0]) for r in again) == list(range(6))
        wait_until(lambda: depth(q) == (0, 0, 0), timeout=10)
        assert q.stats()["groups"]["default"]["redelivered"] >= 6
    finally:
        b.close()
