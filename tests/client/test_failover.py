"""A list of URLs fails over (``shmq.client.failover``): ``shmq.connect("tcp://a,tcp://b")``
finds the primary among them, passing standbys over, and its handle and queue handles follow
the primary when a standby is promoted.

Real brokers: a primary (``Server``) and a standby (``Standby``) as subprocesses, each with its
own instance, port and data dir; queues are ``durability="always"`` so that they are replicated.
"""

from __future__ import annotations

import inspect
import pickle
import re
import time

import psutil
import pytest

import shmq
from shmq import options
from shmq.client.failover import FailoverBroker, FailoverPublisher, FailoverQueue, split_urls
from shmq.client.tcp import TcpBroker
from tests.support.replication import TOKEN, Standby, promote, replication, wait_caught_up
from tests.support.server import Server, broker_pids, kill_broker
from tests.support.wait import wait_until


def fail_over(primary: Server, standby: Standby, queue: str, via: shmq.Broker) -> None:
    """Wait until the standby holds ``queue`` as the primary (``via``) does, SIGKILL the primary
    whole, and promote the standby over a handle of its own."""
    with shmq.connect(standby.url, token=TOKEN) as s:
        wait_caught_up(via, s, queue)
    kill_broker(primary)
    with shmq.connect(standby.url, token=TOKEN) as s:
        wait_until(lambda: not replication(s)["connected"], 20)  # it saw its primary go
        assert promote(s) == 2


def drain(q: shmq.Queue, n: int, timeout: float = 20) -> list[shmq.Message]:
    """Lease ``n`` messages (fewer if they do not come within ``timeout``), by offset."""
    got: list[shmq.Message] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        try:
            got += q.get_many(n - len(got), timeout=1)
        except (shmq.Empty, shmq.Timeout):
            pass
    return sorted(got, key=lambda m: m.offset)


def named(url: str, text: str) -> bool:
    return re.search(re.escape(url) + r"(?![0-9])", text) is not None


# ---------------------------------------------------------------------------- finding the primary
def test_a_list_whose_first_url_is_a_standby_connects_to_the_primary(primary: Server,
                                                                      standby: Standby) -> None:
    with shmq.connect(f"{standby.url},{primary.url}", token=TOKEN) as b:
        assert isinstance(b, FailoverBroker)
        assert b.url == f"{standby.url},{primary.url}"
        assert b.primary_url == primary.url
        assert replication(b)["role"] == "primary"
        q = b.create_queue("jobs", durability="always")
        assert isinstance(q, FailoverQueue)
        assert [q.put(b"a"), q.put(b"b")] == [0, 1]
        assert q.put_many([b"c", b"d"]) == [2, 3]
        with q.publisher() as p:
            p.put(b"e")
            p.put_many([b"f", b"g"])
        assert p.confirmed == 3 and p.last_offset == 6
        assert b.queue("jobs").stats()["next_offset"] == 7
        assert [i.name for i in b.list_queues()] == ["jobs"]
    with shmq.connect(primary.url, token=TOKEN) as direct:  # they went to the primary, in order
        assert [bytes(m.payload) for m in direct.queue("jobs").read(0, 10)] == [b"a", b"b", b"c", b"d", b"e",
                                                                               b"f", b"g"]


def test_a_bare_host_and_port_takes_the_scheme_before_it(primary: Server, standby: Standby) -> None:
    with shmq.connect(f"{standby.url}, 127.0.0.1:{primary.port}", token=TOKEN) as b:
        assert isinstance(b, FailoverBroker)
        assert b.url == f"{standby.url},{primary.url}"
        assert b.primary_url == primary.url


def test_a_single_url_is_still_a_tcp_broker(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        assert type(b) is TcpBroker
        b.create_queue("one").put(b"x")
    with shmq.connect(primary.url, token=TOKEN, failover_timeout=1.0) as b:  # asked for: a list of one
        assert isinstance(b, FailoverBroker) and b.primary_url == primary.url
        assert b.queue("one").get(timeout=5).payload == b"x"


def test_everything_down_is_connection_lost_naming_each_url() -> None:
    start = time.monotonic()
    with pytest.raises(shmq.ConnectionLost) as e:
        shmq.connect("tcp://127.0.0.1:1,tcp://127.0.0.1:2", failover_timeout=0.5)
    took = time.monotonic() - start
    assert 0.5 <= took < 5, took
    assert named("tcp://127.0.0.1:1", str(e.value)) and named("tcp://127.0.0.1:2", str(e.value)), e.value
    assert "cannot connect" in str(e.value)


def test_a_list_of_standbys_only_is_connection_lost_after_the_timeout(primary: Server,
                                                                      standby: Standby) -> None:
    other = Standby(primary.url)
    try:
        start = time.monotonic()
        with pytest.raises(shmq.ConnectionLost) as e:
            shmq.connect(f"{standby.url},{other.url}", token=TOKEN, failover_timeout=0.5)
        assert time.monotonic() - start >= 0.5
        text = str(e.value)
        assert named(standby.url, text) and named(other.url, text), text
        assert text.count(f"a standby (of {primary.url})") == 2, text
    finally:
        other.stop()


def test_bad_lists_are_refused_before_connecting() -> None:
    for bad in ("tcp://127.0.0.1:1,", "tcp://127.0.0.1:1,,tcp://127.0.0.1:2", "shm://default,tcp://127.0.0.1:1",
                "unix:///tmp/x.sock,127.0.0.1:2"):
        with pytest.raises(shmq.InvalidArgument):
            shmq.connect(bad, failover_timeout=0)
    with pytest.raises(shmq.InvalidArgument, match="failover_timeout"):
        FailoverBroker("tcp://127.0.0.1:1", failover_timeout=-1)
    assert split_urls("tcps://a:1?ca=/x,b:2, unix:///s") == ["tcps://a:1?ca=/x", "tcps://b:2", "unix:///s"]


# ---------------------------------------------------------------------------- fail-over
def test_the_handle_and_its_queue_follow_the_promoted_standby(primary: Server, standby: Standby) -> None:
    with shmq.connect(f"{standby.url},{primary.url}", token=TOKEN) as b:
        q = b.create_queue("orders", durability="always")
        for i in range(20):
            assert q.put(f"m{i}".encode()) == i
        fail_over(primary, standby, "orders", b)
        assert q.put(b"after") == 20  # the same queue handle, on the new primary
        assert isinstance(b, FailoverBroker) and b.primary_url == standby.url
        info = replication(b)
        assert info["role"] == "primary" and info["epoch"] == 2
        got = drain(q, 21)
        assert [(m.offset, bytes(m.payload)) for m in got] == (
            [(i, f"m{i}".encode()) for i in range(20)] + [(20, b"after")])
        q.ack_many(got)  # leased through the new connection: settled there
        assert q.stats()["next_offset"] == 21


def test_a_message_leased_before_the_failover_cannot_be_settled_after_it(primary: Server,
                                                                         standby: Standby) -> None:
    with shmq.connect(f"{primary.url},{standby.url}", token=TOKEN) as b:
        q = b.create_queue("jobs", durability="always")
        assert q.put_many([b"first", b"second"]) == [0, 1]
        m = q.get(timeout=5)
        assert (m.offset, m.payload) == (0, b"first")
        fail_over(primary, standby, "jobs", b)
        assert q.put(b"third") == 2  # fails over
        assert isinstance(b, FailoverBroker) and b.primary_url == standby.url
        with pytest.raises(shmq.ConnectionLost):  # its lease went with the old connection
            m.ack()
        with pytest.raises(shmq.ConnectionLost):
            q.ack_many([m])
        with pytest.raises(shmq.ConnectionLost):  # a get carrying it is not retried
            q.get(timeout=0, ack=m)
        got = drain(q, 3)
        assert [(g.offset, bytes(g.payload)) for g in got] == [(0, b"first"), (1, b"second"), (2, b"third")]
        for g in got:
            g.ack()
        with pytest.raises((shmq.Empty, shmq.Timeout)):  # all settled on the new primary
            q.get(timeout=0.2)


def test_a_failover_handle_pickles_as_its_url_list(primary: Server, standby: Standby) -> None:
    with shmq.connect(f"{standby.url},{primary.url}", token=TOKEN, failover_timeout=7.0) as b:
        q = b.create_queue("p", durability="always")
        q.put(b"x")
        b2 = pickle.loads(pickle.dumps(b))
        try:
            assert isinstance(b2, FailoverBroker) and b2 is not b
            assert (b2.url, b2.primary_url, b2.failover_timeout) == (b.url, primary.url, 7.0)
            assert b2.queue("p").read(0)[0].payload == b"x"
        finally:
            b2.close()
        q2 = pickle.loads(pickle.dumps(q))
        try:
            assert isinstance(q2, FailoverQueue) and q2.broker is not b and q2.name == "p"
            assert q2.put(b"y") == 1
        finally:
            q2.broker.close()
    default = inspect.signature(FailoverBroker).parameters["failover_timeout"].default
    assert default == options.FAILOVER_TIMEOUT


def test_a_closed_handle_does_not_look_for_a_primary(primary: Server, standby: Standby) -> None:
    b = shmq.connect(f"{standby.url},{primary.url}", token=TOKEN)
    q = b.create_queue("c")
    b.close()
    start = time.monotonic()
    with pytest.raises(shmq.ConnectionLost, match="closed"):
        q.put(b"x")
    assert time.monotonic() - start < 1


# ---------------------------------------------------------------------------- a publisher
def test_a_publisher_neither_loses_nor_duplicates_a_put_across_a_failover(primary: Server,
                                                                          standby: Standby) -> None:
    """200 values through one publisher (window 64) while the primary dies: every value is on
    the new primary once, at the offset of its turn.

    What can be asserted honestly: the queue replicates asynchronously (the default), so what
    the old primary confirmed may be missing on the standby when it dies; the test waits
    until the standby holds the first 132 values (100 confirmed, 32 stored but their
    confirmations not yet collected), then freezes the primary (SIGSTOP) so that the next 32
    puts reach its socket and are never stored, and SIGKILLs it with 64 puts unconfirmed.
    After the promote the publisher re-sends those 64 under its producer id: the 32 the
    standby holds are answered ``Duplicate`` (unless their confirmations had come before the
    connection went: then they are not re-sent), the 32 others are stored, and the last 36
    values go to the new primary after them."""
    values = [f"v{i}".encode() for i in range(200)]
    with shmq.connect(f"{standby.url},{primary.url}", token=TOKEN) as b:
        q = b.create_queue("pub", durability="always")
        p = q.publisher(window=64)
        assert isinstance(p, FailoverPublisher) and p.producer.startswith("pub-")
        for v in values[:100]:
            p.put(v)
        p.flush()
        for v in values[100:132]:
            p.put(v)  # stored, their confirmations not collected
        with shmq.connect(primary.url, token=TOKEN) as direct, shmq.connect(standby.url, token=TOKEN) as s:
            wait_until(lambda: direct.queue("pub").stats()["next_offset"] == 132, 20)
            wait_caught_up(direct, s, "pub")
        frozen = [psutil.Process(pid) for pid in broker_pids(primary)]
        for proc in frozen:
            proc.suspend()
        for v in values[132:164]:
            p.put(v)  # into the frozen broker's socket: never stored
        assert p.pending == 64
        kill_broker(primary)
        with shmq.connect(standby.url, token=TOKEN) as s:
            wait_until(lambda: not replication(s)["connected"], 20)
            assert promote(s) == 2
        for v in values[164:]:
            p.put(v)  # the first waits for the oldest confirmation: fails over, re-sends
        p.flush()
        assert (p.sent, p.confirmed, p.failed, p.pending) == (200, 200, 0, 0)
        assert p.resent == 32 + p.duplicates and p.duplicates <= 32, p
        assert p.last_offset == 199
        assert isinstance(b, FailoverBroker) and b.primary_url == standby.url
        got = drain(q, 200)
        assert [(m.offset, bytes(m.payload)) for m in got] == list(enumerate(values))
        assert q.stats()["next_offset"] == 200


def test_a_publishers_puts_stored_before_their_connection_went_are_stored_once(primary: Server) -> None:
    """The publisher's connection is lost (as when the broker went silent) after the broker
    stored ten puts and before their confirmations were read: another call of the handle
    fails over (to the same primary), and the next put first re-sends the ten, in order,
    which the broker answers ``Duplicate``: confirmed, with no offset, and stored once."""
    with shmq.connect(primary.url, token=TOKEN, failover_timeout=5.0, heartbeat=0) as b, \
            shmq.connect(primary.url, token=TOKEN) as other:
        assert isinstance(b, FailoverBroker)
        q = b.create_queue("once")
        with q.publisher(window=16) as p:
            p.put(b"a")
            p.put_many([b"b", b"c"])
        assert (p.confirmed, p.last_offset, p.duplicates) == (3, 2, 0)
        with pytest.raises(shmq.Duplicate):  # one seq per put: the batch was seq 2
            other.queue("once").put_many([b"x"], producer=p.producer, seq=2)
        for i in range(10):
            p.put(f"m{i}".encode())
        wait_until(lambda: other.queue("once").stats()["next_offset"] == 13, 10)
        assert b._state is not None
        b._state[0]._went("went silent (a test)")  # (heartbeat=0: nothing read their confirmations)
        assert q.stats()["next_offset"] == 13  # the handle fails over
        p.put(b"after")
        p.flush()
        assert (p.sent, p.confirmed, p.failed, p.resent, p.duplicates) == (14, 14, 0, 10, 10), p
        assert p.last_offset == 13  # the offsets of the duplicates are not known: not 12
        assert [bytes(m.payload) for m in q.read(0, 20)] == (
            [b"a", b"b", b"c"] + [f"m{i}".encode() for i in range(10)] + [b"after"])


def test_a_subscription_resumes_on_the_promoted_standby(primary: Server, standby: Standby) -> None:
    import threading

    seen: list[bytes] = []
    stop = threading.Event()
    with shmq.connect(f"{standby.url},{primary.url}", token=TOKEN, failover_timeout=30) as b:
        q = b.create_queue("pushed", durability="always")

        def consume() -> None:
            with shmq.connect(f"{standby.url},{primary.url}", token=TOKEN, failover_timeout=30) as c:
                fq = c.queue("pushed")
                assert isinstance(fq, FailoverQueue)
                for m in fq.subscribe(credit=8):
                    seen.append(bytes(m.payload))
                    try:
                        m.ack()
                    except shmq.ConnectionLost:  # leased by the connection the fail-over ended
                        pass
                    if stop.is_set():
                        return

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        q.put_many([f"a{i}".encode() for i in range(20)])
        wait_until(lambda: len(set(seen)) == 20, 20)
        fail_over(primary, standby, "pushed", b)
        q.put_many([f"b{i}".encode() for i in range(10)])  # (the handle follows the new primary)
        wait_until(lambda: {f"b{i}".encode() for i in range(10)} <= set(seen), 30)
        stop.set()
        q.put(b"last")  # wakes the consumer to see stop
        t.join(30)
        assert not t.is_alive()
    assert set(seen) >= {f"a{i}".encode() for i in range(20)} | {f"b{i}".encode() for i in range(10)}
