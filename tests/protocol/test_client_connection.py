"""The client's protocol state (shmq/protocol/connection.py) and the shared commands
(shmq/protocol/commands.py), without a socket: bytes in, events and frames out."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmq
from shmq.api import Message
from shmq.client import aio
from shmq.errors import Status
from shmq.protocol import commands as cmd
from shmq.protocol import group_commands as gcmd
from shmq.protocol.codec import (
    NO_REPLY_ID,
    Frame,
    FrameDecoder,
    T,
    decode_body,
    encode_body,
    encode_frame,
    frame,
)
from shmq.protocol.connection import (
    HANDSHAKE_ID,
    MAX_ID,
    ClientConnection,
    Closing,
    NowaitFailed,
    Push,
    Reply,
)
from shmq.protocol.subscription import Feed
from shmq.settle import Settle
from tests.support.connect import connect_tcp
from tests.support.server import Server

LIST = cmd.list_queues()  # a request with no argument: its frame differs only by the id


def answer(type_: T, msg_id: int, status: int = 0, **fields: Any) -> bytes:
    """A frame as the broker would send it."""
    return frame(type_, msg_id, status, **fields)


def error(msg_id: int, status: Status, message: str) -> bytes:
    return encode_frame(T.ERROR, msg_id, encode_body(T.ERROR, message=message), status)


def sent(data: bytes) -> Frame:
    (f,) = FrameDecoder().feed(data)
    return f


# ---------------------------------------------------------------- message ids
def test_ids_count_up_from_one_and_each_send_makes_its_request_pending() -> None:
    """The handshake has its own id, whose bytes end its header in CRLF (a line-reading peer
    answers it at once); the requests count up from 1."""
    conn = ClientConnection()
    first, data = conn.send(cmd.handshake("t", "c", ""), "w1")
    want = encode_body(T.HANDSHAKE, token="t", client="c", affinity="", heartbeat_ms=0)
    assert first == HANDSHAKE_ID and sent(data) == Frame(T.HANDSHAKE, HANDSHAKE_ID, 0, want)
    assert data[:16].endswith(b"\r\n")  # a line ends with the header, whatever the body holds
    assert [conn.send(LIST)[0] for _ in range(3)] == [1, 2, 3]
    assert set(conn.pending) == {HANDSHAKE_ID, 1, 2, 3} and not conn.subscriptions


def test_ids_wrap_below_no_reply_id_and_skip_ids_in_use() -> None:
    conn = ClientConnection()
    assert conn.send(LIST)[0] == 1  # pending
    assert conn.subscribe(LIST, 10)[0] == 2  # a live subscription
    answered = conn.send(LIST)[0]
    conn.receive_data(answer(T.LIST_QUEUES_OK, answered, queues=[]))  # 3 is free again
    conn.last_id = MAX_ID - 2
    ids = [conn.send(LIST)[0] for _ in range(4)]
    assert ids == [MAX_ID - 1, MAX_ID, 3, 4]  # not NO_REPLY_ID, not 0; 1 and 2 are in use
    assert MAX_ID == NO_REPLY_ID - 1


def test_an_id_stays_in_use_until_answered_abandoned_or_not() -> None:
    conn = ClientConnection()
    conn.send(LIST, "mine")
    conn.abandon(1, "given up")
    conn.last_id = MAX_ID
    assert conn.send(LIST)[0] == 2  # 1 is still in use: its answer is to come
    (ev,) = conn.receive_data(answer(T.LIST_QUEUES_OK, 1, queues=[]))
    assert ev == Reply(1, Frame(T.LIST_QUEUES_OK, 1, 0, encode_body(T.LIST_QUEUES_OK, queues=[])), "given up")
    conn.last_id = MAX_ID
    assert conn.send(LIST)[0] == 1
    conn.abandon(12345, "unknown")  # no such request: nothing happens
    assert 12345 not in conn.pending


def test_a_bad_argument_raises_before_anything_is_pending() -> None:
    conn = ClientConnection()
    with pytest.raises(ValueError):
        conn.send(gcmd.commit(_handle(), "g", -1))  # a u64 cannot be negative
    assert not conn.pending and not conn.closed


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["send", "subscribe", "answer", "end", "credit"]),
                              st.integers(0, 1000)), max_size=60),
       start=st.integers(0, MAX_ID))
def test_no_id_in_use_is_given_out_again(ops: list[tuple[str, int]], start: int) -> None:
    """Whatever is sent, answered and ended, near the wrap or not: a new id is 1 .. MAX_ID
    and is neither pending nor a live subscription."""
    conn = ClientConnection()
    conn.last_id = start
    for op, n in ops:
        in_use = set(conn.pending) | set(conn.subscriptions)
        if op in ("send", "subscribe"):
            i = conn.send(LIST)[0] if op == "send" else conn.subscribe(LIST, 2)[0]
            assert 1 <= i <= MAX_ID and i not in in_use
        elif op == "answer" and conn.pending:
            i = sorted(conn.pending)[n % len(conn.pending)]
            (ev,) = conn.receive_data(answer(T.LIST_QUEUES_OK, i, queues=[]))
            assert ev.__class__ is Reply and i not in conn.pending
        elif op == "end" and conn.subscriptions:
            conn.end(sorted(conn.subscriptions)[n % len(conn.subscriptions)])
        elif op == "credit" and conn.subscriptions:
            sub = sorted(conn.subscriptions)[0]
            assert conn.handed_out_counter(sub)()  # a credit of 2: a CREDIT for every message
            assert sent(conn.grant(sub)).msg_id not in in_use


# ---------------------------------------------------------------- bytes to events
def _conversation() -> tuple[ClientConnection, bytes, list[Any]]:
    """A connection with requests 1 and 3 pending and subscription 2 live, the bytes the
    broker answers with, and the events they make."""
    conn = ClientConnection("tcp://here:1")
    conn.send(cmd.stats(_handle()), "stats waiter")
    conn.subscribe(Feed(_handle(), "g", 4, None).request, 4, "inbox")
    conn.send(LIST, "list waiter")
    frames = [
        answer(T.SUBSCRIBE_OK, 2),
        frame(T.DELIVER_BATCH, 2, records=[(0, 1, 7, b"", b"a"), (1, 1, 7, b"", b"b")]),
        error(NO_REPLY_ID, Status.STALE_ACK, "1 of 1 acks were stale"),
        answer(T.LIST_QUEUES_OK, 3, queues=[]),
        answer(T.CREDIT, 99, subscription=2, credit=1),  # an id nobody uses: dropped
        error(1, Status.QUEUE_NOT_FOUND, "no queue"),
        error(0, Status.INTERNAL, "going down"),
    ]
    fs = [sent(f) for f in frames]
    events = [Push(2, fs[0], "inbox"), Push(2, fs[1], "inbox"), "nowait", Reply(3, fs[3], "list waiter"),
              Reply(1, fs[5], "stats waiter"), Closing("closed by the broker: going down")]
    return conn, b"".join(frames), events


def _same(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want), got
    for g, w in zip(got, want, strict=True):
        if w == "nowait":
            assert isinstance(g, NowaitFailed) and isinstance(g.error, shmq.StaleAck)
        else:
            assert g == w


@pytest.mark.parametrize("chunk", [None, 1, 3, 16, 17, 100])
def test_events_are_the_same_however_the_bytes_are_cut(chunk: int | None) -> None:
    conn, data, want = _conversation()
    got: list[Any] = []
    step = chunk or len(data)
    for i in range(0, len(data), step):
        got += conn.receive_data(memoryview(data)[i:i + step] if chunk == 3 else data[i:i + step])
    _same(got, want)
    assert not conn.pending and conn.subscriptions == {2}
    assert conn.close_reason == "closed by the broker: going down" and not conn.closed


def test_a_trailing_partial_frame_waits_for_its_rest() -> None:
    conn, data, want = _conversation()
    nxt = conn.send(LIST, "next")[0]
    more = answer(T.LIST_QUEUES_OK, nxt, queues=[])
    stream = data + more
    for cut in (len(data) + 1, len(data) + 5, len(data) + 16, len(stream) - 1):
        conn, data, want = _conversation()
        assert conn.send(LIST, "next")[0] == nxt
        _same(conn.receive_data(stream[:cut]), want)  # the next answer is not whole yet
        assert nxt in conn.pending
        assert conn.receive_data(stream[cut:]) == [Reply(nxt, sent(more), "next")]
        assert not conn.pending


def test_a_malformed_frame_raises_and_so_does_every_later_read() -> None:
    conn = ClientConnection()
    conn.send(LIST)
    with pytest.raises(shmq.ProtocolError):
        conn.receive_data(b"\x00\x01garbage")
    with pytest.raises(shmq.ProtocolError):
        conn.receive_data(answer(T.LIST_QUEUES_OK, 1, queues=[]))
    assert conn.lost("closed: the broker sent a malformed frame") == [None]


# ---------------------------------------------------------------- unwaited requests, closing
def test_failed_unwaited_requests_are_kept_the_latest_hundred() -> None:
    conn = ClientConnection()
    data = b"".join(error(NO_REPLY_ID, Status.STALE_ACK, f"stale {i}") for i in range(150))
    events = conn.receive_data(data)
    assert len(events) == 150 and all(isinstance(e, NowaitFailed) for e in events)
    assert len(conn.nowait_errors) == 100
    assert [str(e) for e in conn.nowait_errors] == [f"stale {i}" for i in range(50, 150)]
    assert all(type(e) is shmq.StaleAck for e in conn.nowait_errors)
    assert conn.receive_data(answer(T.ACK_OK, NO_REPLY_ID)) == []  # not an error: nothing to keep


def test_closing_reason_outlives_the_loss_that_follows() -> None:
    conn = ClientConnection("tcp://h:7")
    conn.send(LIST, "w")
    (ev,) = conn.receive_data(error(0, Status.LIMIT_EXCEEDED, "too many connections"))
    assert ev == Closing("closed by the broker: too many connections") and not conn.closed
    assert conn.lost("closed by the broker") == ["w"]
    assert conn.closed and conn.close_reason == "closed by the broker: too many connections"
    err = conn.lost_error()  # refused for want of room: typed as such, not as a lost connection
    assert isinstance(err, shmq.LimitExceeded)
    assert str(err) == "connection to tcp://h:7 closed by the broker: too many connections"
    other = ClientConnection("tcp://h:7")
    other.receive_data(error(0, Status.PROTOCOL_ERROR, "no handshake"))
    other.lost("closed by the broker")
    assert isinstance(other.lost_error(), shmq.ConnectionLost)  # any other close: lost


def test_loss_fails_every_pending_request_and_subscription_once() -> None:
    conn = ClientConnection("tcp://h:7")
    conn.send(LIST, "a")
    conn.send(LIST, "b")
    conn.subscribe(LIST, 5, "inbox")
    conn.send(LIST, "c")
    conn.receive_data(answer(T.LIST_QUEUES_OK, 2, queues=[]))  # b is answered
    assert sorted(conn.lost("lost: reset")) == ["a", "c", "inbox"]
    assert conn.closed and not conn.pending and not conn.subscriptions
    assert conn.lost("again") == [] and conn.close_reason == "lost: reset"
    with pytest.raises(shmq.ConnectionLost, match="connection to tcp://h:7 lost: reset"):
        conn.send(LIST)
    with pytest.raises(shmq.ConnectionLost):
        conn.subscribe(LIST, 1)
    assert conn.grant(3) == b""
    with pytest.raises(KeyError):
        conn.handed_out_counter(3)
    assert "closed: lost: reset" in repr(conn)


# ---------------------------------------------------------------- subscriptions
@pytest.mark.parametrize(("credit", "step"), [(1, 1), (2, 1), (3, 1), (10, 5), (1000, 500)])
def test_credit_goes_back_in_steps_of_half_the_window(credit: int, step: int) -> None:
    conn = ClientConnection()
    sub, _ = conn.subscribe(LIST, credit)
    handed_out = conn.handed_out_counter(sub)
    grants = [sent(conn.grant(sub)) if handed_out() else None for _ in range(3 * step)]
    for n, f in enumerate(grants, 1):
        if n % step:
            assert f is None
        else:
            assert f is not None and f.type == T.CREDIT and f.msg_id not in (0, NO_REPLY_ID, sub)
            assert decode_body(T.CREDIT, f.body) == {"subscription": sub, "credit": step}
            assert f.msg_id not in conn.pending  # a CREDIT is never answered
    assert conn.end(sub) is None and conn.grant(sub) == b""  # no waiter; over


def test_a_refused_subscription_ends_at_once_and_an_ended_one_hears_nothing() -> None:
    conn = ClientConnection()
    sub, _ = conn.subscribe(LIST, 4, "inbox")
    (ev,) = conn.receive_data(error(sub, Status.QUEUE_NOT_FOUND, "no queue"))
    assert ev.__class__ is Push and ev.waiter == "inbox" and sub not in conn.subscriptions
    sub2, _ = conn.subscribe(LIST, 4, "inbox2")
    assert sub2 == 2
    conn.receive_data(answer(T.SUBSCRIBE_OK, sub2))
    # a later ERROR on a live subscription is only a push: it stays until ended
    assert conn.receive_data(error(sub2, Status.INTERNAL, "hiccup"))[0].__class__ is Push
    assert conn.end(sub2) == "inbox2" and conn.end(sub2) is None
    assert conn.receive_data(frame(T.DELIVER_BATCH, sub2, records=[(0, 1, 0, b"", b"x")])) == []


# ---------------------------------------------------------------- the shared commands
class _Queue:
    """A queue handle as the commands see it."""

    message_class = Message

    def __init__(self, name: str = "q") -> None:
        self.name, self.name_bytes, self.broker = name, name.encode(), object()


def _handle(name: str = "q") -> Any:
    return _Queue(name)


def run(conn: ClientConnection, command: Any, broker: Callable[[Frame], bytes]) -> Any:
    """A driver in miniature: send ``command`` (its requests pipelined, each its own
    waiter), let ``broker`` answer each frame, and parse the answers."""
    reqs = command.requests if isinstance(command, cmd.Batch) else [command]
    frames = [conn.send(r, r)[1] for r in reqs]
    events = conn.receive_data(b"".join(broker(sent(f)) for f in frames))
    assert [ev.__class__ for ev in events] == [Reply] * len(reqs)
    results = [ev.waiter.parse(ev.frame, ev.waiter.ctx) for ev in events]  # type: ignore[union-attr]
    return command.combine(results) if isinstance(command, cmd.Batch) else results[0]


def test_one_message_commands_use_the_hot_encoders_and_parse_answers() -> None:
    conn, q = ClientConnection(), _handle()

    def broker(f: Frame) -> bytes:
        if f.type == T.PRODUCE:
            assert decode_body(T.PRODUCE, f.body) == {"queue": "q", "timeout_ms": 0, "payload": b"h\xc3\xa9"}
            return answer(T.PRODUCE_OK, f.msg_id, offset=41)
        if f.type == T.CONSUME:
            assert decode_body(T.CONSUME, f.body) == {"queue": "q", "group": "g", "timeout_ms": 1500,
                                                      "visibility_ms": 2000}
            return frame(T.DELIVER, f.msg_id, offset=41, deliveries=2, timestamp_ns=9, meta=b"", payload=b"p")
        assert f.type == T.ACK
        assert decode_body(T.ACK, f.body) == {"queue": "q", "group": "g", "offset": 41, "deliveries": 2}
        return error(f.msg_id, Status.STALE_ACK, "stale")

    assert run(conn, cmd.put(q, "hé", False, None), broker) == 41
    m = run(conn, cmd.get(q, "g", True, 1.5, 2.0), broker)
    assert type(m) is Message and (m[0], m.group, m.offset, m.deliveries, m.payload) == (q, "g", 41, 2, b"p")
    with pytest.raises(shmq.StaleAck):
        run(conn, cmd.settle(q, m, Settle.ACK, 0.0), broker)
    assert not conn.pending


def test_argument_checks_raise_before_anything_is_sent() -> None:
    q = _handle()
    for make in (lambda: cmd.put(q, 42, True, None),  # type: ignore[arg-type]
                 lambda: cmd.get(q, "g", True, -1, None),
                 lambda: cmd.get_many(q, 0, "g", True, None, None),
                 lambda: cmd.put_many(q, [b"x"] * 10_001, True, None, None, None),
                 lambda: cmd.put_many(q, [b"x"], True, None, "p", None),
                 lambda: gcmd.create_group(q, "g", "middle"),
                 lambda: cmd.create_queue("no/slash", {}),
                 lambda: cmd.settle(q, _msg(q, None, 1, 1), Settle.NACK, 0.0),
                 lambda: cmd.settle(q, _msg(q, "g", 1, 1), Settle.NACK, -1.0)):
        with pytest.raises(shmq.ShmqError):
            make()


def _msg(q: Any, group: str | None, offset: int, deliveries: int) -> Message:
    return tuple.__new__(Message, (q, 0, group, offset, deliveries, b"", b"", 0))


def test_ack_many_combines_its_batches_and_the_leases_of_other_queues() -> None:
    conn, q, other = ClientConnection(), _handle(), _handle("other")
    msgs = [_msg(q, "g", 5, 1), _msg(other, "g", 6, 1), _msg(q, "h", 7, 1)]
    seen: list[int] = []

    def broker(f: Frame) -> bytes:
        seen.append(f.type)
        stale = [7] if decode_body(f.type, f.body)["group"] == "h" else []
        return answer(T.ACK_BATCH_OK, f.msg_id, stale=stale)

    with pytest.raises(shmq.StaleAck) as e:
        run(conn, cmd.ack_many(q, msgs, True), broker)
    assert e.value.stale == [6, 7] and "2 of 3" in str(e.value)  # type: ignore[attr-defined]
    assert seen == [T.ACK_BATCH, T.ACK_BATCH]  # one per group
    batch = cmd.ack_many(q, [_msg(q, "g", o, 1) for o in range(10, 20)], False)
    (only,) = batch.nowait
    assert sent(only).type == T.ACK_RANGE_NO_REPLY and sent(only).msg_id == NO_REPLY_ID
    assert not batch.requests and batch.combine([]) is None
    assert run(conn, cmd.put_many(q, [], True, None, None, None), broker) == []


def test_a_feed_takes_the_subscribe_answer_then_pushes_and_gives_back_the_rest() -> None:
    conn, q = ClientConnection(), _handle()
    feed = Feed(q, "g", 4, None)
    sub, data = conn.subscribe(feed.request, feed.credit, "inbox")
    assert decode_body(T.SUBSCRIBE, sent(data).body) == {"queue": "q", "group": "g", "credit": 4,
                                                        "visibility_ms": 0}
    events = conn.receive_data(answer(T.SUBSCRIBE_OK, sub)
                               + frame(T.DELIVER_BATCH, sub, records=[(o, 1, 0, b"", b"%d" % o)
                                                                      for o in range(3)])
                               + frame(T.DELIVER, sub, offset=3, deliveries=1, timestamp_ns=0, meta=b"",
                                       payload=b"3"))
    for ev in events[:2]:
        feed.take(ev.frame)  # type: ignore[union-attr]
    assert feed.subscribed and not feed.refused and len(feed.ready) == 3
    first = feed.ready.popleft()
    assert type(first) is Message and (first.offset, first.payload, first.group) == (0, b"0", "g")
    nacks = feed.leftovers([events[2].frame, shmq.ConnectionLost("gone")])  # type: ignore[union-attr]
    offsets = [decode_body(T.NACK, sent(r.encode(1, *r.args)).body)["offset"] for r in nacks.requests]
    assert offsets == [1, 2, 3]
    assert not feed.ready
    refused = Feed(q, "g", 4, None)
    with pytest.raises(shmq.QueueNotFound):
        refused.take(sent(error(9, Status.QUEUE_NOT_FOUND, "no queue")))
    assert refused.refused
    with pytest.raises(shmq.ConnectionLost):
        feed.take(shmq.ConnectionLost("gone"))


def test_an_unclaimed_answer_gives_its_leases_back() -> None:
    q = _handle()
    req = cmd.get_many(q, 10, "g", True, None, None)
    batch = frame(T.DELIVER_BATCH, 1, records=[(4, 2, 0, b"", b"x"), (5, 1, 0, b"", b"y")])
    nacks = cmd.unclaimed(req, sent(batch))
    assert [decode_body(T.NACK, r.encode(1, *r.args)[16:]) for r in nacks.requests] == [
        {"queue": "q", "group": "g", "offset": 4, "deliveries": 2, "delay_ms": 0},
        {"queue": "q", "group": "g", "offset": 5, "deliveries": 1, "delay_ms": 0}]
    assert not cmd.unclaimed(req, sent(error(1, Status.EMPTY, "empty"))).requests
    assert not cmd.unclaimed(cmd.stats(q), sent(answer(T.STATS_OK, 1, stats={}))).requests


# ---------------------------------------------------------------- the two drivers, over a real broker
def test_threads_sharing_a_blocking_handle_each_get_their_own_answers(server: Server) -> None:
    """One TcpBroker, eight threads: one reads for all, the others wait; every put gets its
    own offset, across the wrap of the message ids."""
    b = connect_tcp(server.url)
    try:
        q = b.create_queue("threads_share")
        b._conn.last_id = MAX_ID - 50  # the wrap falls in the middle of the run
        offsets: list[list[int]] = [[] for _ in range(8)]

        def work(mine: list[int]) -> None:
            for _ in range(50):
                mine.append(q.put(b"x"))
                q.stats()

        threads = [threading.Thread(target=work, args=(mine,)) for mine in offsets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        every = sorted(o for mine in offsets for o in mine)
        assert every == list(range(400))
        assert b._conn.last_id < 1000 and not b._conn.pending
        assert len(q.get_many(1000, timeout=5)) == 400
    finally:
        b.delete_queue("threads_share")
        b.close()


def test_asyncio_requests_wrap_around_a_parked_get(server: Server) -> None:
    """The asyncio driver takes its ids from the connection: after the wrap, the id of a
    get still parked at the broker is skipped, and each answer finds its request."""
    async def main() -> None:
        async with await aio.connect(server.url) as b:
            q = await b.create_queue("aio_wrap")
            try:
                b._conn.last_id = MAX_ID - 1
                getter = asyncio.create_task(q.get(timeout=10))
                await asyncio.sleep(0)  # one step of the task: the CONSUME is sent, with id MAX_ID
                assert set(b._conn.pending) == {MAX_ID}
                b._conn.last_id = MAX_ID - 1  # so the next id would be the parked get's
                offs = await asyncio.gather(*(q.put(b"%d" % i) for i in range(30)))
                assert sorted(offs) == list(range(30)) and b._conn.last_id == 30  # 1 .. 30
                m = await getter
                assert int(m.payload) in range(30)
                await m.ack()
                assert not b._conn.pending
            finally:
                await b.delete_queue("aio_wrap")

    asyncio.run(main())
