"""A get that acks first (``q.get(ack=msg)``, ``q.get_many(n, ack=msgs)``; ``shmq.protocol.consume_ack``).

The frames are the documented bytes; the broker acks before it gets, refuses the whole
request when a lease is stale (nothing delivered), holds the get until the journal has
the acks; every client keeps ``ack`` meaning ``msg.ack()`` then ``get()``.
"""

from __future__ import annotations

import asyncio
import re

import pytest

import shmq
from shmq.client import aio
from shmq.core.durability import Mark
from shmq.core.serverqueue import ServerQueue
from shmq.errors import ProtocolError, StaleAck, Status, StorageError
from shmq.protocol import commands
from shmq.protocol.codec import FrameDecoder, T, decode_body, decode_deliver, encode_frame, frame
from shmq.protocol.consume_ack import (
    ACK_FLAG,
    acking_batch_frame,
    decode_consume,
    lease_suffix,
    settles_suffix,
)
from shmq.server.core import Core
from tests.support.fakes import HeldMark
from tests.support.paths import PROTOCOL_DOC as DOC
from tests.support.peer import Peer, status_of
from tests.support.server import Server


def _doc_frame(name: str) -> bytes:
    m = re.search(rf"^{name}: (.*)$", DOC.read_text(encoding="utf-8"), re.M)
    assert m, f"{name} is not in {DOC.name}"
    return bytes.fromhex(re.sub(r"[\s|]", "", m.group(1)))


class _Q:
    name, name_bytes, broker, message_class = "orders", b"orders", None, shmq.Message


# ---------------------------------------------------------------- frames
def test_the_documented_frames_are_what_the_clients_send_and_the_broker_reads() -> None:
    lease = tuple.__new__(shmq.Message, (_Q, 0, "default", 41, 1, b"", b"", 0))
    req = commands.get(_Q(), "default", True, 1.0, None, lease)  # type: ignore[arg-type]
    wire = _doc_frame("consume_ack")
    assert req.encode(21, *req.args) == wire
    (f,) = FrameDecoder().feed(wire)
    assert (f.type, f.status) == (T.CONSUME, ACK_FLAG)
    assert decode_consume(f) == {"queue": "orders", "group": "default", "timeout_ms": 1000,
                                 "visibility_ms": 0, "acks": [(41, 1)]}

    class Q:
        name, name_bytes, broker, message_class = "q", b"q", None, shmq.Message

    acks = [tuple.__new__(shmq.Message, (Q, 0, "default", o, dc, b"", b"", 0)) for o, dc in ((1, 1), (2, 3))]
    batch = commands.get_many(Q(), 100, "default", True, 1.0, None, acks)  # type: ignore[arg-type]
    wire = _doc_frame("consume_batch_ack")
    assert batch.encode(22, *batch.args) == wire
    (f,) = FrameDecoder().feed(wire)
    assert decode_consume(f) == {"queue": "q", "group": "default", "max": 100, "timeout_ms": 1000,
                                 "visibility_ms": 0, "acks": [(1, 1), (2, 3)]}


def test_a_frame_without_the_flag_is_read_as_before_and_an_old_broker_refuses_one_with_it() -> None:
    plain = frame(T.CONSUME, 3, queue="q", group="g", timeout_ms=0, visibility_ms=5)
    (f,) = FrameDecoder().feed(plain)
    assert decode_consume(f) == decode_body(T.CONSUME, f.body)
    assert "acks" not in decode_consume(f)
    # a broker from before the flag decodes the body alone: the lease is bytes left over
    (f,) = FrameDecoder().feed(encode_frame(T.CONSUME, 3, f.body + lease_suffix(7, 1), ACK_FLAG))
    with pytest.raises(ProtocolError) as e:
        decode_body(T.CONSUME, f.body)
    assert e.value.code == Status.PROTOCOL_ERROR
    fields = {"queue": "q", "group": "g", "max": 5, "timeout_ms": 0, "visibility_ms": 0}
    (f,) = FrameDecoder().feed(acking_batch_frame(4, fields, settles_suffix([(1, 1)])))
    with pytest.raises(ProtocolError):
        decode_body(T.CONSUME_BATCH, f.body)


@pytest.mark.parametrize("body", [b"", b"\x00\x01q", b"\x00\x01q\x00\x00" + bytes(11)])
def test_a_truncated_acking_consume_is_a_protocol_error(body: bytes) -> None:
    for t in (T.CONSUME, T.CONSUME_BATCH):
        (f,) = FrameDecoder().feed(encode_frame(t, 1, body, ACK_FLAG))
        with pytest.raises(ProtocolError) as e:
            decode_consume(f)
        assert e.value.code == Status.PROTOCOL_ERROR


def test_a_lease_out_of_range_is_refused_before_anything_is_sent() -> None:
    lease = tuple.__new__(shmq.Message, (_Q, 0, "default", 2**64, 1, b"", b"", 0))
    with pytest.raises(ValueError):
        commands.get(_Q(), "default", True, None, None, lease)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the broker, in memory
def _consume_acking(p: Peer, acks: list[tuple[int, int]], batch: bool = False, timeout_ms: int = 0) -> int:
    """Send a CONSUME (CONSUME_BATCH) of "q" that acks ``acks`` first; its message id."""
    msg_id = next(p._ids)
    if batch:
        p.feed(acking_batch_frame(msg_id, {"queue": "q", "group": "default", "max": 10,
                                           "timeout_ms": timeout_ms, "visibility_ms": 0},
                                  settles_suffix(acks)))
    else:
        (off, dc), = acks
        p.feed(encode_frame(T.CONSUME, msg_id, encode_body_consume(timeout_ms) + lease_suffix(off, dc),
                            ACK_FLAG))
    return msg_id


def encode_body_consume(timeout_ms: int) -> bytes:
    return frame(T.CONSUME, 0, queue="q", group="default", timeout_ms=timeout_ms, visibility_ms=0)[16:]


def _setup(p: Peer, n: int) -> None:
    p.ok(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue="q", config={})
    for i in range(n):
        p.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"m%d" % i)


def test_the_ack_is_applied_before_the_get_and_one_answer_confirms_both(core: Core) -> None:
    p = Peer(core)
    _setup(p, 3)
    off, dc, *_ = decode_deliver(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                                        visibility_ms=0).body)
    got = []
    for _ in range(2):
        msg_id = _consume_acking(p, [(off, dc)])
        (f,) = p.frames()
        assert (f.msg_id, f.type) == (msg_id, T.DELIVER)
        off, dc, _, _, payload = decode_deliver(f.body)
        got.append(payload)
        assert p.conn.leases.count == 1  # the one just delivered: the acked one is gone
    assert got == [b"m1", b"m2"]
    st = p.ok(T.STATS, T.STATS_OK, queue="q")["stats"]["groups"]["default"]
    assert st["acked"] == 2 and st["in_flight"] == 1
    # the queue is empty now: the last ack is applied and the get still fails as a get does
    msg_id = _consume_acking(p, [(off, dc)])
    (f,) = p.frames()
    assert f.msg_id == msg_id and status_of(f) == Status.EMPTY
    assert p.ok(T.STATS, T.STATS_OK, queue="q")["stats"]["groups"]["default"]["acked"] == 3


def test_a_parked_get_has_acked_already(core: Core) -> None:
    p = Peer(core)
    _setup(p, 1)
    off, dc, *_ = decode_deliver(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                                        visibility_ms=0).body)
    msg_id = _consume_acking(p, [(off, dc)], timeout_ms=60_000)
    assert p.frames() == []  # parked: nothing to deliver yet
    assert p.ok(T.STATS, T.STATS_OK, queue="q")["stats"]["groups"]["default"]["acked"] == 1
    other = Peer(core)
    other.ok(T.PRODUCE, T.PRODUCE_OK, queue="q", timeout_ms=0, payload=b"later")
    (f,) = p.frames()
    assert (f.msg_id, decode_deliver(f.body)[4]) == (msg_id, b"later")


def test_a_stale_ack_fails_the_get_and_delivers_nothing(core: Core) -> None:
    p = Peer(core)
    _setup(p, 2)
    off, dc, *_ = decode_deliver(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                                        visibility_ms=0).body)
    msg_id = _consume_acking(p, [(off, dc + 1)])  # another delivery than ours
    (f,) = p.frames()
    assert f.msg_id == msg_id and status_of(f) == Status.STALE_ACK
    assert p.conn.leases.count == 1  # ours is still ours, and nothing more was leased
    st = p.ok(T.STATS, T.STATS_OK, queue="q")["stats"]["groups"]["default"]
    assert st["acked"] == 0 and st["in_flight"] == 1


def test_a_batch_with_a_stale_lease_acks_the_others_and_delivers_nothing(core: Core) -> None:
    p = Peer(core)
    _setup(p, 5)
    recs = p.ok(T.CONSUME_BATCH, T.DELIVER_BATCH, queue="q", group="default", max=3, timeout_ms=0,
                visibility_ms=0)["records"]
    msg_id = _consume_acking(p, [(r[0], r[1]) for r in recs] + [(99, 1)], batch=True)
    (f,) = p.frames()
    assert f.msg_id == msg_id and status_of(f) == Status.STALE_ACK
    assert "99" in decode_body(T.ERROR, f.body)["message"]
    assert p.conn.leases.count == 0
    st = p.ok(T.STATS, T.STATS_OK, queue="q")["stats"]["groups"]["default"]
    assert st["acked"] == 3 and st["in_flight"] == 0
    msg_id = _consume_acking(p, [], batch=True)  # nothing to ack: a plain get
    (f,) = p.frames()
    assert f.msg_id == msg_id and [r[4] for r in decode_body(T.DELIVER_BATCH, f.body)["records"]] == [
        b"m3", b"m4"]


@pytest.mark.parametrize("fails", [False, True])
def test_the_get_waits_for_the_journal_to_have_the_ack(core: Core, monkeypatch: pytest.MonkeyPatch,
                                                       fails: bool, held: HeldMark) -> None:
    p = Peer(core)
    _setup(p, 2)
    off, dc, *_ = decode_deliver(p.call(T.CONSUME, queue="q", group="default", timeout_ms=0,
                                        visibility_ms=0).body)
    real_ack = ServerQueue.ack

    def ack(self: ServerQueue, ref: int, offset: int, deliveries: int) -> Mark | None:
        real_ack(self, ref, offset, deliveries)
        return held.mark()  # as an ``always`` queue's: to wait for

    monkeypatch.setattr(ServerQueue, "ack", ack)
    if fails:
        def wait(word: int, end: int, deadline: float | None) -> int:
            raise StorageError("disk full")
        held.wait = wait  # type: ignore[method-assign]
    msg_id = _consume_acking(p, [(off, dc)])
    assert p.frames() == []  # held until the journal has the ack
    assert p.conn.leases.count == 0  # applied, though: nothing leased yet
    held.reach()
    (f,) = p.frames()
    if fails:
        assert f.msg_id == msg_id and status_of(f) == Status.STORAGE
        assert p.conn.leases.count == 0  # nothing was got
    else:
        assert (f.msg_id, f.type, decode_deliver(f.body)[4]) == (msg_id, T.DELIVER, b"m1")
        assert p.conn.leases.count == 1


# ---------------------------------------------------------------- the clients
def test_a_tcp_consumer_acks_each_message_with_its_next_get(server: Server) -> None:
    b = shmq.connect(server.url)
    try:
        q = b.create_queue("ackget")
        q.put_many([b"a", b"b", b"c"])
        m = q.get(timeout=5)
        seen = [m.payload]
        for _ in range(2):
            m = q.get(timeout=5, ack=m)
            seen.append(m.payload)
        assert seen == [b"a", b"b", b"c"]
        g = q.stats()["groups"]["default"]
        assert g["acked"] == 2 and g["in_flight"] == 1
        with pytest.raises(shmq.Empty):
            q.get(timeout=0, ack=m)  # the last ack is applied; nothing more to get
        assert q.stats()["groups"]["default"]["acked"] == 3
        with pytest.raises(StaleAck):
            q.get(timeout=0, ack=m)  # acked already: stale, and nothing got
        # a batch consumer
        q.put_many([b"%d" % i for i in range(6)])
        msgs = q.get_many(3, timeout=5)
        msgs = q.get_many(3, timeout=5, ack=msgs)
        assert [m.payload for m in msgs] == [b"3", b"4", b"5"]
        assert q.stats()["groups"]["default"]["acked"] == 6
        q.ack_many(msgs)
        # a lease of another group or queue does not ride: it is acked apart, all the same
        other = b.create_queue("ackget2")
        other.put(b"x")
        q.put(b"y")
        x = other.get(timeout=5)
        assert q.get(timeout=5, ack=x).payload == b"y"
        assert other.stats()["groups"]["default"]["acked"] == 1
        b.delete_queue("ackget2")
        b.delete_queue("ackget")
    finally:
        b.close()


def test_the_asyncio_client_and_shared_memory_take_ack_too(server: Server) -> None:
    async def main() -> list[bytes]:
        b = await aio.connect(server.url)
        try:
            q = await b.create_queue("ackget_aio")
            await q.put_many([b"a", b"b", b"c", b"d"])
            m = await q.get(timeout=5)
            m = await q.get(timeout=5, ack=m)
            msgs = await q.get_many(2, timeout=5, ack=[m])
            stats = await q.stats()
            assert stats["groups"]["default"]["acked"] == 2
            await q.ack_many(msgs)
            await b.delete_queue("ackget_aio")
            return [m.payload, *(x.payload for x in msgs)]
        finally:
            await b.close()

    assert asyncio.run(main()) == [b"b", b"c", b"d"]
    local = shmq.connect(f"shm://{server.instance}")
    try:
        q = local.create_queue("ackget_shm")
        q.put_many([b"a", b"b", b"c"])
        m = q.get(timeout=5)
        m = q.get(timeout=5, ack=m)
        msgs = q.get_many(5, timeout=5, ack=[m])
        assert [x.payload for x in msgs] == [b"c"]
        assert q.stats()["groups"]["default"]["acked"] == 2
        with pytest.raises(StaleAck):
            q.get(timeout=0, ack=m)
        q.ack_many(msgs)
        local.delete_queue("ackget_shm")
    finally:
        local.close()
