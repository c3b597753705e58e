"""The broker's request handling without sockets or processes: a worker's ``Core`` over a
real instance in shared memory, and connections whose bytes go to a list.

Each test plays the client's side with the codec and feeds the server's ``receive``
the bytes a socket would carry; the last one pairs the client's own state machine
and commands with the server's, as h11 pairs its two ends.  Time
is the test's: ``Core`` takes its clock, and a parked request is retried by
``poke``, as the worker's tick and doorbell do.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from shmq import options
from shmq.api import Message
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerBroker
from shmq.errors import Duplicate, Empty, ProtocolError, StaleAck, Status
from shmq.protocol import commands
from shmq.protocol.codec import Frame, T, decode_body, decode_deliver, encode_frame, frame
from shmq.protocol.commands import Batch
from shmq.protocol.connection import ClientConnection, Reply
from shmq.server import handlers
from shmq.server.connection import ServerConnection
from shmq.server.core import SERVER_NAME, Core
from shmq.server.parking import poke
from shmq.settle import Settle
from tests.support.clock import FakeClock
from tests.support.fakes import HeldMark
from tests.support.peer import Peer, status_of


@pytest.fixture
def timed(instance: str) -> Iterator[tuple[Core, FakeClock]]:
    """A core whose parked requests see the test's clock."""
    clock = FakeClock()
    sb = ServerBroker(instance)
    try:
        yield Core(sb, clock=clock), clock
    finally:
        sb.close()


# ---------------------------------------------------------------- the handshake
def test_the_first_frame_must_be_a_handshake(core: Core) -> None:
    p = Peer(core, handshake=False)
    f = p.call(T.STATS, queue="x")
    assert status_of(f) == Status.PROTOCOL_ERROR and p.conn.closed
    p.feed(frame(T.HANDSHAKE, 9, token="", client="late", affinity="",
                 heartbeat_ms=0))  # dropped: it is closed
    assert p.frames() == []


def test_a_wrong_token_is_refused_and_the_right_one_accepted(instance: str) -> None:
    sb = ServerBroker(instance)
    try:
        core = Core(sb, worker_id=1, token="s3cret")
        bad = Peer(core, handshake=False)
        f = bad.call(T.HANDSHAKE, token="nope", client="t", affinity="", heartbeat_ms=0)
        assert f.type == T.HANDSHAKE_NACK and bad.conn.closed
        good = Peer(core, token="s3cret")
        assert good.conn.ready
        assert good.ok(T.LIST_QUEUES, T.LIST_QUEUES_OK)["queues"] == []
    finally:
        sb.close()


def test_a_peer_that_keeps_failing_is_throttled_but_a_right_token_is_never_refused(
        instance: str, caplog: pytest.LogCaptureFixture) -> None:
    """AUTH_FAILURES_MAX wrong tokens from one address in AUTH_FAILURE_WINDOW: further wrong
    ones from there are refused unlogged until the window clears.  A right token from that
    address is accepted all along (every local client is 127.0.0.1: one misconfigured
    client must not lock the others out)."""
    clock = FakeClock()
    sb = ServerBroker(instance)
    try:
        core = Core(sb, token="s3cret", clock=clock)

        def attempt(peer: str, token: str) -> tuple[int, str]:
            p = Peer(core, handshake=False)
            p.conn.peer = peer
            f = p.call(T.HANDSHAKE, token=token, client="t", affinity="", heartbeat_ms=0)
            reason = decode_body(T.HANDSHAKE_NACK, f.body)["reason"] if f.type == T.HANDSHAKE_NACK else ""
            return f.type, reason

        def logged() -> int:
            return sum("refused a handshake from 10.0.0.9" in r.getMessage() for r in caplog.records)

        with caplog.at_level(logging.WARNING, logger="shmq.worker"):
            for _ in range(options.AUTH_FAILURES_MAX):
                assert attempt("10.0.0.9", "guess") == (T.HANDSHAKE_NACK, "bad or missing token")
                assert attempt("10.0.0.9", "s3cret")[0] == T.HANDSHAKE_ACK  # interleaved: accepted
            assert logged() == options.AUTH_FAILURES_MAX
            kind, reason = attempt("10.0.0.9", "guess")
            assert kind == T.HANDSHAKE_NACK and "too many failed handshakes from 10.0.0.9" in reason
            assert logged() == options.AUTH_FAILURES_MAX  # throttled: not logged again
            assert attempt("10.0.0.9", "s3cret")[0] == T.HANDSHAKE_ACK  # the right token: never refused
            clock.advance(options.AUTH_FAILURE_WINDOW - 1)
            assert "too many" in attempt("10.0.0.9", "guess")[1]  # still within the window
            clock.advance(1)
            assert attempt("10.0.0.9", "guess") == (T.HANDSHAKE_NACK, "bad or missing token")  # cleared
            assert logged() == options.AUTH_FAILURES_MAX + 1
    finally:
        sb.close()


def test_a_handshake_answers_with_the_worker_and_the_frame_limit(core: Core) -> None:
    p = Peer(core, handshake=False)
    d = p.ok(T.HANDSHAKE, T.HANDSHAKE_ACK, token="", client="t", affinity="", heartbeat_ms=0)
    assert d["worker"] == 3 and d["max_frame"] == options.MAX_FRAME and d["server"].startswith("shmq/")


def test_a_connection_that_pipelines_after_its_handshake_is_never_moved(core: Core) -> None:
    moved: list[str] = []

    def place(conn: ServerConnection, f: Frame, affinity: str) -> bool:
        moved.append(affinity)
        return True

    core.place = place
    p = Peer(core, handshake=False)
    p.feed(frame(T.HANDSHAKE, 1, token="", client="t", affinity="a", heartbeat_ms=0)
           + frame(T.LIST_QUEUES, 2))
    assert moved == [] and [f.type for f in p.frames()] == [T.HANDSHAKE_ACK, T.LIST_QUEUES_OK]
    alone = Peer(core, handshake=False)
    alone.feed(frame(T.HANDSHAKE, 1, token="", client="t", affinity="b", heartbeat_ms=0))
    assert moved == ["b"] and alone.frames() == []  # handed over: nothing said here


def test_malformed_input_is_a_typed_error_and_the_connection_carries_on(core: Core) -> None:
    p = Peer(core)
    assert status_of(p.call(T.PRODUCE_OK, offset=1)) == Status.INVALID_TYPE  # a reply is no request
    bad_body = encode_frame(T.STATS, 41, b"\xff\xff\xff")
    p.feed(bad_body)
    (f,) = p.frames()
    assert f.msg_id == 41 and status_of(f) == Status.PROTOCOL_ERROR
    assert status_of(p.call(T.STATS, queue="nope")) == Status.QUEUE_NOT_FOUND
    assert not p.conn.closed and p.ok(T.LIST_QUEUES, T.LIST_QUEUES_OK)["queues"] == []
    unknown = bytearray(encode_frame(T.LIST_QUEUES, 40))
    unknown[8] = 0x7E  # the type byte (header: magic, length, type, version, status, id)
    with pytest.raises(ProtocolError, match="unknown message type"):  # a broken stream: the driver
        p.feed(bytes(unknown))                                       # answers with ERROR 0 and closes


# ---------------------------------------------------------------- produce, consume, settle
def test_every_message_produced_is_delivered_once_and_acked(core: Core) -> None:
    p = Peer(core)
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    offsets = [p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"m%d" % i)["offset"]
               for i in range(5)]
    assert offsets == list(range(5))
    batch = p.ok(T.CONSUME_BATCH, T.DELIVER_BATCH, queue="q", group="default", max=10, timeout_ms=0,
                 visibility_ms=0)["records"]
    assert [(r[0], r[1], r[4]) for r in batch] == [(i, 1, b"m%d" % i) for i in range(5)]
    assert p.conn.leases.count == 5
    stale = p.ok(T.ACK_BATCH, T.ACK_BATCH_OK, queue="q", group="default",
                 settles=[(0, 1), (1, 1), (1, 1), (9, 1)])["stale"]
    assert stale == [1, 9]  # acked twice, never delivered
    p.ok(T.ACK_RANGE, T.ACK_BATCH_OK, queue="q", group="default", first=2, count=3, deliveries=1)
    assert p.conn.leases.count == 0
    st = p.ok(T.STATS, T.STATS_OK, queue="q")["stats"]
    assert st["retained"] == 0 and st["groups"]["default"]["acked"] == 5


def test_a_lease_is_only_its_connections_to_settle(core: Core) -> None:
    a, b = Peer(core), Peer(core)
    a.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    a.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"x")
    f = a.call(T.CONSUME, queue="q", group="default", timeout_ms=0, visibility_ms=0)
    off, dc, *_ = decode_deliver(f.body)
    lease = dict(queue="q", group="default", offset=off, deliveries=dc)
    assert status_of(b.call(T.ACK, **lease)) == Status.STALE_ACK  # b holds nothing
    assert status_of(a.call(T.ACK, **{**lease, "deliveries": 2})) == Status.STALE_ACK  # another delivery
    assert a.ok(T.ACK, T.ACK_OK, **lease) == {}
    assert status_of(a.call(T.ACK, **lease)) == Status.STALE_ACK  # settled already
    assert a.conn.leases.count == 0


def test_an_unwaited_ack_is_answered_only_when_it_fails(core: Core) -> None:
    p = Peer(core)
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"x")
    off, dc, *_ = decode_deliver(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                                        visibility_ms=0).body)
    lease: dict[str, Any] = dict(queue="q", group="default", offset=off, deliveries=dc)
    p.feed(frame(T.ACK_NO_REPLY, 0xFFFFFFFF, **lease))
    assert p.frames() == []
    p.feed(frame(T.ACK_NO_REPLY, 0xFFFFFFFF, **lease))
    (f,) = p.frames()
    assert f.msg_id == 0xFFFFFFFF and status_of(f) == Status.STALE_ACK


def test_a_nacked_message_comes_back_with_its_delivery_counted(core: Core) -> None:
    p = Peer(core)
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={"max_deliveries": 2})
    p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"x")
    for dc in (1, 2):
        off, got, *_ = decode_deliver(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                                             visibility_ms=0).body)
        assert (off, got) == (0, dc)
        p.ok(T.NACK, T.NACK_OK, queue="q", group="default", offset=0, deliveries=dc, delay_ms=0)
    assert status_of(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                          visibility_ms=0)) == Status.EMPTY
    dead = decode_deliver(p.call(T.CONSUME, queue="q.dlq", group="default", timeout_ms=0,
                                 visibility_ms=0).body)
    assert dead[4] == b"x" and json.loads(dead[3])["reason"] == "nack"


# ---------------------------------------------------------------- waiting
def test_a_parked_consume_is_served_by_another_connections_produce(core: Core) -> None:
    c, p = Peer(core), Peer(core)
    c.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    wait_id = c.send(T.CONSUME, queue="q", group="default", timeout_ms=60_000, visibility_ms=0)
    assert c.frames() == [] and len(core.waiters["q"]) == 1
    p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"hello")
    (f,) = c.frames()
    assert f.msg_id == wait_id and f.type == T.DELIVER and decode_deliver(f.body)[4] == b"hello"
    assert "q" not in core.waiters


def test_a_parked_request_fails_at_its_deadline(timed: tuple[Core, FakeClock]) -> None:
    core, clock = timed
    c = Peer(core)
    c.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={"capacity": 1})
    wait_id = c.send(T.CONSUME, queue="q", group="default", timeout_ms=500, visibility_ms=0)
    clock.advance(0.4)
    poke(core, "q")
    assert c.frames() == []
    clock.advance(0.2)
    poke(core, "q")
    (f,) = c.frames()
    assert f.msg_id == wait_id and status_of(f) == Status.EMPTY
    c.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"fills it")
    full_id = c.send(T.PRODUCE, queue="q", timeout_ms=100, payload=b"no room")
    clock.advance(0.2)
    poke(core, "q")
    (f,) = c.frames()
    assert f.msg_id == full_id and status_of(f) == Status.QUEUE_FULL


def test_produces_waiting_for_room_are_stored_in_their_order(core: Core) -> None:
    p, c = Peer(core), Peer(core)
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={"capacity": 1})
    p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"0")
    ids = [p.send(T.PRODUCE, queue="q", timeout_ms=60_000, payload=b"%d" % i) for i in (1, 2, 3)]
    assert p.frames() == [] and p.conn.parked_produces == {"q": 3}
    assert status_of(p.call(T.PRODUCE, queue="q", timeout_ms=0, payload=b"x")) == Status.QUEUE_FULL
    got = []
    for _ in range(4):
        f = c.call(T.CONSUME, queue="q", group="default", timeout_ms=0, visibility_ms=0)
        off, dc, _ts, _meta, payload = decode_deliver(f.body)
        got.append((off, payload))
        c.ok(T.ACK, T.ACK_OK, queue="q", group="default", offset=off, deliveries=dc)
        poke(core, "q")  # room: the worker's tick retries what waits, and the next goes in
    assert got == [(0, b"0"), (1, b"1"), (2, b"2"), (3, b"3")]
    answers = p.frames()
    assert [(f.msg_id, decode_body(T.PRODUCE_OK, f.body)["offset"]) for f in answers] == [
        (ids[0], 1), (ids[1], 2), (ids[2], 3)]
    assert p.conn.parked_produces == {}  # (a queue's entry goes with its last waiting produce)


def test_a_pipelined_run_of_produces_is_stored_in_order_and_each_answered(core: Core) -> None:
    p = Peer(core)
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={"capacity": 4})
    p.feed(b"".join(frame(T.PRODUCE, 100 + i, queue="q", timeout_ms=0, payload=b"%d" % i) for i in range(6)))
    got = [(f.msg_id, f.type) for f in p.frames()]
    # four fit: the run is all or none, so it falls back to one at a time, exactly as if alone
    assert got[:4] == [(100 + i, T.PRODUCE_OK) for i in range(4)]
    assert [(i, t) for i, t in got[4:]] == [(104, T.ERROR), (105, T.ERROR)]
    records = p.ok(T.READ, T.READ_OK, queue="q", offset=0, max=10)["records"]
    assert [r[4] for r in records] == [b"0", b"1", b"2", b"3"]


# ---------------------------------------------------------------- connections going
def test_a_closed_connections_leases_go_back_at_once(core: Core) -> None:
    a, waiting = Peer(core), Peer(core)
    a.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={"visibility_timeout": 3600})
    a.ok(T.PRODUCE_BATCH, T.PRODUCE_BATCH_OK, queue="q", timeout_ms=0, payloads=[b"a", b"b", b"c"])
    a.ok(T.CONSUME_BATCH, T.DELIVER_BATCH, queue="q", group="default", max=3, timeout_ms=0, visibility_ms=0)
    wait_id = waiting.send(T.CONSUME_BATCH, queue="q", group="default", max=10, timeout_ms=60_000,
                           visibility_ms=0)
    assert waiting.frames() == []
    handlers.end(core, a.conn)  # the socket closed: no DISCONNECT
    (f,) = waiting.frames()
    assert f.msg_id == wait_id
    assert [(r[0], r[1]) for r in decode_body(T.DELIVER_BATCH, f.body)["records"]] == [(0, 2), (1, 2), (2, 2)]


def test_disconnect_answers_then_closes_and_gives_back(core: Core) -> None:
    a, b = Peer(core), Peer(core)
    a.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    a.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"x")
    a.call(T.CONSUME, queue="q", group="default", timeout_ms=0, visibility_ms=0)
    assert a.ok(T.DISCONNECT, T.DISCONNECT_OK) == {} and a.conn.closed
    f = b.call(T.CONSUME, queue="q", group="default", timeout_ms=0, visibility_ms=0)
    assert decode_deliver(f.body)[:2] == (0, 2)


# ---------------------------------------------------------------- push mode
def test_a_subscription_is_pushed_up_to_its_credit(core: Core) -> None:
    s, p = Peer(core), Peer(core)
    s.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    p.ok(T.PRODUCE_BATCH, T.PRODUCE_BATCH_OK, queue="q", timeout_ms=0, payloads=[b"%d" % i for i in range(5)])
    sub = s.send(T.SUBSCRIBE, queue="q", group="default", credit=2, visibility_ms=0)
    ok, push = s.frames()
    assert (ok.msg_id, ok.type) == (sub, T.SUBSCRIBE_OK)
    assert (push.msg_id, push.type) == (sub, T.DELIVER_BATCH)
    assert [r[0] for r in decode_body(T.DELIVER_BATCH, push.body)["records"]] == [0, 1]
    s.send(T.CREDIT, subscription=sub, credit=1)
    (one,) = s.frames()  # a credit of one: a DELIVER
    assert (one.msg_id, one.type) == (sub, T.DELIVER) and decode_deliver(one.body)[0] == 2
    s.ok(T.UNSUBSCRIBE, T.UNSUBSCRIBE_OK, subscription=sub)
    p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"later")
    s.send(T.CREDIT, subscription=sub, credit=5)  # for a subscription that is gone: nothing
    assert s.frames() == [] and "q" not in core.subs
    assert s.conn.leases.count == 3  # pushed messages stay leased until settled or the connection goes


# ---------------------------------------------------------------- replies held for the journal
def test_a_reply_is_held_until_its_mark_is_reached(core: Core, held: HeldMark) -> None:
    p = Peer(core)
    core.answer(p.conn, 7, frame(T.ACK_OK, 7), held.mark())
    assert p.frames() == []  # held
    held.reach()
    (f,) = p.frames()
    assert (f.msg_id, f.type) == (7, T.ACK_OK)


def test_shared_memory_clients_and_the_handlers_see_one_queue(core: Core, instance: str) -> None:
    p = Peer(core)
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    local = ShmBroker(instance)
    try:
        local.queue("q").put(b"from shm")
        f = p.call(T.CONSUME, queue="q", group="default", timeout_ms=0, visibility_ms=0)
        assert decode_deliver(f.body)[4] == b"from shm"
    finally:
        local.close()


# ---------------------------------------------------------------- both ends, paired
class Pair:
    """A ClientConnection and a ServerConnection joined in memory, as h11 pairs its two ends:
    the clients' commands (``shmq.protocol.commands``) run through both state machines, no socket."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.client = ClientConnection()
        self.wire: list[bytes] = []  # server -> client
        self.server = core.connection(sink=self.wire.append)
        self.name = "paired"  # a queue handle of this "broker", as commands see one
        self.name_bytes = self.name.encode()
        self.broker = self
        self.message_class = Message

    def run(self, command: Any) -> Any:
        """One command: its frames through the server, the answers back through the client."""
        if isinstance(command, Batch):
            for data in command.nowait:
                handlers.receive(self.core, self.server, data)
            return command.combine([self.run(r) for r in command.requests])
        msg_id, data = self.client.send(command, waiter="w")
        handlers.receive(self.core, self.server, data)
        events = self.client.receive_data(b"".join(self.wire))
        self.wire.clear()
        assert len(events) == 1, events
        (reply,) = events
        assert isinstance(reply, Reply) and reply.msg_id == msg_id and reply.waiter == "w", reply
        return command.parse(reply.frame, command.ctx)


def test_the_clients_commands_and_the_handlers_agree(core: Core) -> None:
    p = Pair(core)
    assert p.run(commands.handshake("", "paired", "", 0.5)) == (3, SERVER_NAME, 0.5)  # the shorter
    p.run(commands.create_queue("paired", {"max_deliveries": 3}))
    assert [p.run(commands.put(p, b"m%d" % i, True, None)) for i in range(3)] == [0, 1, 2]
    assert p.run(commands.put_many(p, [b"m3", b"m4"], True, None, "prod", 1)) == [3, 4]
    with pytest.raises(Duplicate):
        p.run(commands.put_many(p, [b"again"], True, None, "prod", 1))
    got = p.run(commands.get_many(p, 10, "default", False, None, None))
    assert [(m.offset, m.deliveries, m.payload) for m in got] == [(i, 1, b"m%d" % i) for i in range(5)]
    p.run(commands.settle(p, got[4], Settle.NACK, 0.0))
    p.run(commands.ack_many(p, got[:4], True))  # one ACK_RANGE
    with pytest.raises(StaleAck):
        p.run(commands.ack_many(p, got[:1], True))
    again = p.run(commands.get(p, "default", False, None, None))
    assert (again.offset, again.deliveries) == (4, 2)
    p.run(commands.settle(p, again, Settle.ACK, 0.0))
    assert p.run(commands.stats(p))["retained"] == 0
    with pytest.raises(Empty):
        p.run(commands.get(p, "default", False, None, None))
    p.run(commands.disconnect())
    assert p.server.closed


def test_every_request_type_has_a_handler_and_a_decoder() -> None:
    """``DECODERS`` beside ``HANDLERS``: the same types; the flagged ones read their flags."""
    from shmq.protocol.consume_ack import decode_consume
    from shmq.server.parking import decode_produce

    assert handlers.DECODERS.keys() == handlers.HANDLERS.keys()
    for t in (T.PRODUCE, T.PRODUCE_BATCH, T.PRODUCE_IDEMPOTENT):
        assert handlers.DECODERS[t] is decode_produce
    assert handlers.DECODERS[T.CONSUME] is handlers.DECODERS[T.CONSUME_BATCH] is decode_consume
    from shmq.protocol.codec import encode_body

    f = Frame(T.STATS, 7, 0, encode_body(T.STATS, queue="q"))
    assert handlers.DECODERS[T.STATS](f) == {"queue": "q"}
