"""shmq.kombu against a real ``shmq serve``: kombu's own integration suite (its base classes,
vendored in ``kombu_common.py``), as kombu runs it for every transport, over TCP and over a
co-located attachment of the same instance; then what the transport adds or maps
(``x-max-priority`` M as a queue of M + 1 priority levels, at most 10: ``BasePriority``)."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from typing import Any
from urllib.parse import urlparse

import kombu
import pytest

import shmq
import shmq.kombu
from shmq import options, runtime
from shmq.kombu import address
from shmq.kombu import bindings as kbindings
from shmq.kombu.naming import queue_name
from tests.integrations.conftest import TlsBroker, dead_port
from tests.integrations.kombu_common import (
    BaseEventLoop,
    BaseExchangeTypes,
    BaseFailover,
    BaseMessage,
    BasePriority,
    BaseTimeToLive,
    BasicFunctionality,
)
from tests.support.server import Server


def _url(srv: Server, kind: str) -> str:
    return f"shmq://127.0.0.1:{srv.port}" if kind == "tcp" else f"shmq+shm://{srv.instance}"


@pytest.fixture(params=["tcp", "shm"])
def connection(request: pytest.FixtureRequest, own_server: Server) -> Iterator[kombu.Connection]:
    conn = kombu.Connection(_url(own_server, request.param))
    yield conn
    conn.release()


@pytest.fixture(params=[pytest.param("no broker on the port", marks=pytest.mark.slow), "a wrong token"])
def invalid_connection(request: pytest.FixtureRequest, own_server: Server) -> Iterator[kombu.Connection]:
    """kombu's suite uses a port nothing listens on (kombu retries after 2 s, then raises:
    slow); a wrong token is refused at once (``AuthError``: not an error kombu retries)."""
    if request.param == "a wrong token":
        conn = kombu.Connection(f"shmq://127.0.0.1:{own_server.port}?token=wrong")
    else:
        conn = kombu.Connection(f"shmq://127.0.0.1:{dead_port()}", connect_timeout=2)
    yield conn
    conn.release()


@pytest.fixture
def failover_connection(own_server: Server) -> Iterator[kombu.Connection]:
    conn = kombu.Connection(f"shmq://127.0.0.1:{dead_port()};shmq://127.0.0.1:{own_server.port}")
    yield conn
    conn.release()


class TestShmqBasicFunctionality(BasicFunctionality):
    pass


class TestShmqExchangeTypes(BaseExchangeTypes):
    pass


class TestShmqMessage(BaseMessage):
    pass


@pytest.mark.slow
class TestShmqTimeToLive(BaseTimeToLive):
    pass


class TestShmqEventLoop(BaseEventLoop):
    pass


class TestShmqPriority(BasePriority):
    """(AMQP's order: a higher number goes first.)  kombu's requeue test leaves its four
    messages unacked, so they stay in its queue, given back when the connection closes:
    each test here starts with kombu's queues of the suite gone, so the second transport's
    run does not find the first one's messages."""

    @pytest.fixture(autouse=True)
    def _fresh_queues(self, own_server: Server) -> None:
        with shmq.connect(own_server.url) as b:
            for name in ("priority_test", "priority_requeue_test", "priority_simple_queue_test",
                         "priority_simple_buffer_test"):
                try:
                    b.delete_queue(queue_name(name))
                except shmq.QueueNotFound:
                    pass


class TestShmqFailover(BaseFailover):
    def test_failover_switches_to_alternate_url(self, failover_connection: kombu.Connection) -> None:
        """As kombu's, but for the first URL's port: shmq's transport reads its URL itself
        (``can_parse_url``, so that ``?token=`` and ``shmq+unix://`` reach it; kombu's own
        parser would pass a query's parameters to ``Connection()`` as keywords and fail),
        so kombu leaves ``Connection.port`` unset until it switches to an alternate, which
        it parses itself.  The first URL is checked as the connection's hostname instead."""
        conn = failover_connection
        assert len(conn.alt) > 1
        dead, live = urlparse(conn.alt[0]), urlparse(conn.alt[-1])
        assert dead.port != live.port
        assert conn.hostname == conn.alt[0]  # (kombu's: conn.port == dead.port)
        assert conn.connect()
        assert conn.connected
        assert conn.port == live.port
        assert conn.transport_cls == live.scheme
        conn.close()


# ---------------------------------------------------------------------------- what the transport maps
def _name() -> str:
    return f"kq-{uuid.uuid4().hex[:12]}"


def _stats(srv: Server, kombu_queue: str) -> dict[str, Any]:
    with shmq.connect(srv.url) as b:
        return b.queue(queue_name(kombu_queue)).stats()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_properties_headers_content_type_and_encoding_round_trip(own_server: Server, kind: str) -> None:
    name = _name()
    headers = {"k": "v", "n": 7, "f": 1.5, "none": None, "yes": True, "list": [1, "two", None],
               "nested": {"a": {"b": [3]}}, "unicode": "ünï €"}
    props = dict(correlation_id="c-1", reply_to="somewhere", message_id="m-1", type="kind",
                 app_id="app", user_id="me", timestamp=1234567890, priority=7)
    body = bytes(range(256)) * 3
    with kombu.Connection(_url(own_server, kind)) as conn, closing(conn.SimpleQueue(name)) as q:
        q.producer.publish(body, routing_key=name, headers=headers, content_type="application/x-custom",
                           content_encoding="binary", delivery_mode=1, expiration=60, **props)
        m = q.get(timeout=5)
        assert m.body == body
        assert m.headers == headers
        assert (m.content_type, m.content_encoding) == ("application/x-custom", "binary")
        for k, v in props.items():
            assert m.properties[k] == v, k
        assert m.properties["delivery_mode"] == 1 and m.properties["expiration"] == "60000"
        assert m.delivery_info["routing_key"] == name and m.delivery_info["exchange"] == name
        assert m.delivery_info["redelivered"] is False
        m.ack()


def test_metadata_too_large_for_a_header_block_travels_in_the_payload(own_server: Server) -> None:
    name = _name()
    big = {f"h{i}": "x" * 200 for i in range(60)}  # about 12 KiB of headers: over a header block's 8 KiB
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"hello": "world"}, headers=big)
        m = q.get(timeout=5)
        assert m.payload == {"hello": "world"} and m.headers == big
        m.ack()


def test_max_priority_maps_to_levels_and_a_priority_property_round_trips(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        with pytest.raises(shmq.InvalidArgument, match="x-max-priority must be an int in 1..255"):
            kombu.Queue(name, routing_key=name, max_priority=0)(conn.default_channel).declare()
        with shmq.connect(own_server.url) as b, pytest.raises(shmq.QueueNotFound):
            b.queue(queue_name(name))  # nothing was made
        queue = kombu.Queue(name, routing_key=name, max_priority=255)
        with closing(conn.SimpleQueue(queue)) as q:
            for n, prio in ((1, 0), (2, 200), (3, 9), (4, 8)):
                q.put({"n": n}, priority=prio)
            got = []
            for _ in range(4):
                m = q.get(timeout=5)
                got.append((m.payload["n"], m.properties["priority"]))
                m.ack()
            # 10 levels: 200 and 9 share the top one (FIFO there), then 8, then 0
            assert got == [(2, 200), (3, 9), (4, 8), (1, 0)]
        with shmq.connect(own_server.url) as b:
            assert [i.config.priorities for i in b.list_queues() if i.name == queue_name(name)] == [10]


def test_reject_without_requeue_dead_letters_and_the_dlq_is_a_kombu_queue(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"poison": True})
        q.get(timeout=5).reject(requeue=False)
        with pytest.raises(q.Empty):
            q.get_nowait()
        dlq = kombu.Queue(f"{name}.dlq", no_declare=True)
        m = dlq(conn.default_channel).get(no_ack=False)
        assert m is not None and m.payload == {"poison": True}
        m.ack()


def test_requeue_delivers_again_marked_redelivered(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"n": 1})
        first = q.get(timeout=5)
        assert first.delivery_info["redelivered"] is False
        first.requeue()
        again = q.get(timeout=5)
        assert again.payload == {"n": 1} and again.delivery_info["redelivered"] is True
        again.ack()


def test_prefetch_bounds_the_leases_a_channel_holds(own_server: Server) -> None:
    name = _name()
    got: list[kombu.Message] = []
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        queue = kombu.Queue(name, routing_key=name)
        with conn.channel() as ch:
            producer = kombu.Producer(ch)
            for i in range(5):
                producer.publish({"i": i}, routing_key=name, declare=[queue])
        with kombu.Consumer(conn, [queue], callbacks=[lambda body, m: got.append(m)], prefetch_count=2):
            conn.drain_events(timeout=5)
            with pytest.raises(socket.timeout):
                while True:  # what the credit allows, then nothing more
                    conn.drain_events(timeout=0.3)
            assert [m.payload["i"] for m in got] == [0, 1]
            assert _stats(own_server, name)["groups"]["default"]["in_flight"] == 2
            got[0].ack()
            conn.drain_events(timeout=5)
            assert [m.payload["i"] for m in got] == [0, 1, 2]
            for m in got[1:]:
                m.ack()


def test_leases_not_settled_go_back_when_the_connection_closes(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"n": 1})
        assert q.get(timeout=5).payload == {"n": 1}  # not acked
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        m = q.get(timeout=5)
        assert m.payload == {"n": 1} and m.delivery_info["redelivered"] is True
        m.ack()


def test_a_queue_that_goes_with_its_consumer_is_made_small_and_goes(own_server: Server) -> None:
    """Celery's reply, event and broadcast queues are auto_delete: a few MiB each, not a work
    queue's 18 MiB, and gone once their consumer is cancelled."""
    name, work = _name(), _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        ch = conn.channel()
        transient = kombu.Queue(name, kombu.Exchange(name, "fanout"), auto_delete=True)
        consumer = kombu.Consumer(ch, [transient, kombu.Queue(work)], callbacks=[lambda body, m: m.ack()])
        consumer.consume()
        small, big = _stats(own_server, name), _stats(own_server, work)
        assert (small["capacity"], small["max_bytes"]) == (4096, 4 * 1024 * 1024)
        assert (big["capacity"], big["max_bytes"]) == (options.DEFAULT_CAPACITY, options.DEFAULT_MAX_BYTES)
        consumer.cancel()
        with shmq.connect(own_server.url) as b, pytest.raises(shmq.QueueNotFound):
            b.queue(queue_name(name))
        ch.close()


@pytest.mark.parametrize("kind", ["fanout", "topic", "direct"])
def test_a_queue_bound_on_another_connection_gets_what_is_published(own_server: Server, kind: str) -> None:
    """The binding table is the broker's: a publisher that never declared the queue (another
    connection here, another process for Celery) routes to it."""
    name = _name()
    ex = kombu.Exchange(f"{name}-ex", type=kind)
    key = {"fanout": "", "topic": "a.*.c", "direct": "k"}[kind]
    sent_key = {"fanout": "any", "topic": "a.b.c", "direct": "k"}[kind]
    queue = kombu.Queue(name, exchange=ex, routing_key=key)
    got: list[Any] = []

    def take(body: Any, message: kombu.Message) -> None:
        got.append(body)
        message.ack()

    with kombu.Connection(_url(own_server, "tcp")) as consumer_conn:
        with kombu.Consumer(consumer_conn, [queue], callbacks=[take]):
            with kombu.Connection(_url(own_server, "shm")) as producer_conn:
                producer = kombu.Producer(producer_conn.default_channel, exchange=ex)
                producer.publish({"kind": kind}, routing_key=sent_key, declare=[ex])
                if kind != "fanout":
                    producer.publish({"unroutable": True}, routing_key="x.y")
            consumer_conn.drain_events(timeout=5)
            assert got == [{"kind": kind}]
            if kind != "fanout":
                with pytest.raises(socket.timeout):
                    consumer_conn.drain_events(timeout=0.3)


def test_queue_message_ttl_drops_and_dead_letter_exchange_keeps(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        dropped = kombu.Queue(f"{name}-drop", routing_key=f"{name}-drop", message_ttl=0.2)
        kept = kombu.Queue(f"{name}-keep", routing_key=f"{name}-keep", message_ttl=0.2,
                           queue_arguments={"x-dead-letter-exchange": "dlx"})
        producer = kombu.Producer(conn.default_channel)
        for q in (dropped, kept):
            producer.publish({"q": q.name}, routing_key=q.name, declare=[q])
        deadline = time.monotonic() + 10
        while _stats(own_server, kept.name)["retained"] or _stats(own_server, dropped.name)["retained"]:
            assert time.monotonic() < deadline, "the messages did not expire"
            time.sleep(0.05)
        m = kombu.Queue(f"{kept.name}.dlq", no_declare=True)(conn.default_channel).get()
        assert m is not None and m.payload == {"q": kept.name}
        m.ack()
        with shmq.connect(own_server.url) as b, pytest.raises(shmq.QueueNotFound):
            b.queue(queue_name(dropped.name) + ".dlq")


def test_names_kombu_allows_and_shmq_does_not_are_mapped(own_server: Server) -> None:
    name = f"celery@host {uuid.uuid4().hex}.celery.pidbox"
    assert queue_name(name) != name and queue_name(name) == queue_name(name)
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"n": 1})
        m = q.get(timeout=5)
        assert m.payload == {"n": 1}
        m.ack()


# ---------------------------------------------------------------------------- bad input
def test_a_wrong_token_is_refused_at_once_and_not_retried(own_server: Server) -> None:
    conn = kombu.Connection(f"shmq://127.0.0.1:{own_server.port}?token=wrong")
    t = time.monotonic()
    with pytest.raises(shmq.AuthError):
        conn.connect()
    assert time.monotonic() - t < 1.5  # kombu waits 2 s before a retry: there was none
    conn.release()


def test_an_unknown_url_parameter_is_refused_naming_it(own_server: Server) -> None:
    conn = kombu.Connection(f"shmq://127.0.0.1:{own_server.port}?tokn=abc")
    with pytest.raises(shmq.InvalidArgument, match="tokn"):
        conn.connect()
    conn.release()
    with pytest.raises(shmq.InvalidArgument, match="takes no parameters"):
        kombu.Connection(f"shmq+shm://{own_server.instance}?create=1").connect()


def test_a_message_too_large_is_refused_at_the_caller_and_the_broker_serves_on(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn, closing(conn.SimpleQueue(name)) as q:
        with pytest.raises(shmq.MessageTooLarge):
            q.put(b"x" * (2 * 1024 * 1024), serializer=None, content_type="application/data",
                  content_encoding="binary")
        q.put({"small": True})
        m = q.get(timeout=5)
        assert m.payload == {"small": True}
        m.ack()


def test_the_token_is_masked_where_the_url_is_shown(own_server: Server) -> None:
    conn = kombu.Connection(f"shmq://127.0.0.1:{own_server.port}?token=secret")
    assert "secret" not in conn.as_uri() and "token=**" in conn.as_uri()
    assert "secret" in conn.as_uri(include_password=True)


def test_the_binding_records_are_compacted(own_server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """40 queues bound and 30 of them deleted write 70 records; what is retained stays within
    twice the live bindings and the slack, and a new reader folds them into the same table."""
    monkeypatch.setattr(kbindings, "COMPACT_SLACK", 8)
    name = _name()
    ex = kombu.Exchange(f"{name}-ex", type="direct")
    with shmq.connect(own_server.url) as b:
        try:
            produced_before = b.queue(kbindings.QUEUE).stats()["next_offset"]
        except shmq.QueueNotFound:
            produced_before = 0
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        ch = conn.default_channel
        ex(ch).declare()
        for i in range(40):
            q = kombu.Queue(f"{name}-{i}", exchange=ex, routing_key=f"k{i}")(ch)
            q.declare()
            if i % 4:
                q.delete()
        conn.transport.bindings.refresh(0)
    with kombu.Connection(_url(own_server, "tcp")) as fresh:  # a new reader sees the same table
        table = fresh.default_channel.get_table(ex.name)
        assert sorted(q for _, _, q in table) == sorted(f"{name}-{i}" for i in range(0, 40, 4))
        live = len(fresh.transport.bindings)
    with shmq.connect(own_server.url) as b:
        stats = b.queue(kbindings.QUEUE).stats()
    assert stats["next_offset"] - produced_before >= 70
    assert stats["retained"] <= 2 * live + kbindings.COMPACT_SLACK + 2


def test_a_full_queue_stalls_a_direct_publish_and_drops_a_fanout_copy(own_server: Server) -> None:
    name = _name()
    opts = {"queue_limits": {"capacity": 2}}
    with kombu.Connection(_url(own_server, "tcp"), transport_options=opts) as conn:
        ex = kombu.Exchange(f"{name}-fan", type="fanout")
        fan = kombu.Queue(f"{name}-f", exchange=ex)
        direct = kombu.Queue(f"{name}-d", routing_key=f"{name}-d")
        producer = kombu.Producer(conn.default_channel)
        for i in range(3):  # the third copy finds the queue full: dropped, the publisher goes on
            producer.publish({"i": i}, exchange=ex, declare=[fan])
        for i in range(2):
            producer.publish({"i": i}, routing_key=direct.name, declare=[direct])
        t = time.monotonic()
        with pytest.raises(shmq.Full):
            producer.publish({"i": 2}, routing_key=direct.name, timeout=0.3)
        assert time.monotonic() - t >= 0.25
        assert _stats(own_server, fan.name)["retained"] == 2
        assert _stats(own_server, direct.name)["retained"] == 2


def test_x_delivery_limit_dead_letters_a_message_given_back_too_often(own_server: Server) -> None:
    name = _name()
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        queue = kombu.Queue(name, routing_key=name, queue_arguments={"x-delivery-limit": 1})
        kombu.Producer(conn.default_channel).publish({"n": 1}, routing_key=name, declare=[queue])
        bound = queue(conn.default_channel)
        for _ in range(2):  # delivered, given back; delivered again (the limit), given back
            m = bound.get()
            assert m is not None and m.payload == {"n": 1}
            m.requeue()
        assert bound.get() is None
        dead = kombu.Queue(f"{name}.dlq", no_declare=True)(conn.default_channel).get()
        assert dead is not None and dead.payload == {"n": 1}
        dead.ack()


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_forked_child_letting_go_of_a_connection_leaves_the_parent_s_alone(own_server: Server,
                                                                             kind: str) -> None:
    """Celery's pool processes let go of the connections they inherit (kombu's ``collect``):
    not a word to the broker, whose connection and leases are the parent's."""
    name = _name()
    with kombu.Connection(_url(own_server, kind)) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"n": 1})
        held = q.get(timeout=5)
        pid = os.fork()
        if pid == 0:  # the child: let go, the way kombu's pools do after a fork
            code = 1
            try:
                conn.collect()
                conn.release()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert _stats(own_server, name)["groups"]["default"]["in_flight"] == 1  # still the parent's
        held.ack()
        q.put({"n": 2})
        m = q.get(timeout=5)
        assert m.payload == {"n": 2} and m.delivery_info["redelivered"] is False
        m.ack()


# ---------------------------------------------------------------------------- URL spellings
def _round_trip(url: str, **kwargs: Any) -> None:
    name = _name()
    with kombu.Connection(url, **kwargs) as conn, closing(conn.SimpleQueue(name)) as q:
        q.put({"url": url})
        m = q.get(timeout=5)
        assert m.payload == {"url": url}
        m.ack()


def test_tls_unix_and_token_spellings_reach_the_broker(tls_broker: TlsBroker, own_server: Server) -> None:
    srv, ca, token = tls_broker.server, tls_broker.ca, tls_broker.token
    _round_trip(f"shmq+tcps://127.0.0.1:{srv.port}?ca={ca}&token={token}")
    _round_trip(f"shmq+unix://{runtime.socket_path(srv.port)}")  # the broker's own user: no token
    _round_trip(f"shmq://:{own_server.token}@127.0.0.1:{own_server.port}")
    _round_trip(f"shmq://127.0.0.1:{own_server.port}", transport_options={"token": own_server.token})
    _round_trip(f"shmq+tcp://127.0.0.1:{own_server.port}?token={own_server.token}")
    with pytest.raises(shmq.AuthError):
        kombu.Connection(f"shmq+tcps://127.0.0.1:{srv.port}?ca={ca}&token=wrong").connect()


@pytest.mark.parametrize(("url", "want"), [
    ("shmq://", ("tcp://127.0.0.1:7878", None)),
    ("shmq://localhost", ("tcp://localhost:7878", None)),
    ("shmq://127.0.0.1:7000//", ("tcp://127.0.0.1:7000", None)),  # kombu's virtual host, as Celery prints it
    ("shmq://:s%40cret@127.0.0.1:7000", ("tcp://127.0.0.1:7000", "s@cret")),
    ("shmq://127.0.0.1:7000?token=t", ("tcp://127.0.0.1:7000?token=t", None)),
    ("shmq://h1:7000,h2:7001", ("tcp://h1:7000,h2:7001", None)),
    ("shmq://[::1]", ("tcp://[::1]:7878", None)),
    ("shmq+tcps://h:7000?ca=/x.pem", ("tcps://h:7000?ca=/x.pem", None)),
    ("shmq+unix:///run/shmq.sock", ("unix:///run/shmq.sock", None)),
    ("shmq+shm://inst", ("shm://inst", None)),
    ("shmq+shm://", ("shm://default", None)),
])
def test_what_each_spelling_connects_to(url: str, want: tuple[str, str | None]) -> None:
    assert address.broker_url(kombu.Connection(url)) == want


@pytest.mark.parametrize("url", ["shmq://127.0.0.1:7000/vhost", "shmq+shm://inst?x=1", "shmq+http://h:1"])
def test_a_spelling_that_means_nothing_is_refused(url: str) -> None:
    with pytest.raises((shmq.InvalidArgument, KeyError)):
        address.broker_url(kombu.Connection(url))


def test_an_alternate_kombu_parsed_is_read_back_from_its_fields() -> None:
    conn = kombu.Connection("shmq://127.0.0.1:1;shmq://:tok@127.0.0.1:2")
    conn.switch(conn.alt[1])  # what kombu does when the first cannot be reached
    assert address.broker_url(conn) == ("tcp://127.0.0.1:2", "tok")
    conn.switch("shmq+unix:///run/x.sock")
    assert address.broker_url(conn) == ("unix:///run/x.sock", None)


def test_a_plain_shmq_message_is_read_and_a_garbled_one_is_set_aside(own_server: Server) -> None:
    name = _name()
    got: list[kombu.Message] = []
    with kombu.Connection(_url(own_server, "tcp")) as conn:
        queue = kombu.Queue(name, routing_key=name)
        queue(conn.default_channel).declare()
        with shmq.connect(own_server.url) as b:
            q = b.queue(queue_name(name))
            q.put(b"raw bytes", headers={"who": "shmq"})  # a plain shmq producer's
            q.put(b"{}", headers={"kombu": b"not json"})
            q.put(b"after")
        with kombu.Consumer(conn, [queue], callbacks=[lambda body, m: got.append(m)]):
            while len(got) < 2:
                conn.drain_events(timeout=5)
        assert [m.body for m in got] == [b"raw bytes", b"after"]
        assert got[0].headers == {"who": "shmq"} and got[0].content_type == "application/data"
        assert got[0].payload == b"raw bytes"
        for m in got:
            m.ack()
        with shmq.connect(own_server.url) as b:
            dead = b.queue(queue_name(name) + ".dlq").get(timeout=5)
            assert dead.headers["kombu"] == b"not json"
            dead.ack()
