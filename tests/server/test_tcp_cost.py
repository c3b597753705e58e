"""The TCP paths made cheaper per message (issue 22, part 2) mean what they meant before:
records read as columns, messages made from them, rings held until a worker's answers
are written, the worker's queue lookups cached per registry generation."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import shmq
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.doorbell import RINGER, Bell
from shmq.core.serverqueue import ServerBroker
from shmq.errors import ProtocolError, QueueNotFound, Status
from shmq.protocol import commands
from shmq.protocol.codec import (
    FrameDecoder,
    T,
    decode_body,
    encode_frame,
    frame,
    produce_frame,
    records_columns,
)
from shmq.protocol.consume_ack import rides
from shmq.protocol.subscription import Feed
from shmq.server import handlers
from shmq.server.core import Core
from shmq.server.driver import Driver
from shmq.server.spinner import Spinner
from shmq.spin import Spin
from tests.support.fakes import FakeHandle

RECORDS = [
    [],
    [(7, 1, 123, b"", b"a")],
    [(1, 2, 3, b"", b"xy"), (2, 1, 4, b"", b""), (3, 9, 5, b"", b"z" * 300)],
    [(10, 1, 6, b"\x01meta", b"p"), (11, 2, 7, b"", b"qq"), (12, 3, 8, b"m", b"")],  # with header blocks
]


@pytest.mark.parametrize("records", RECORDS)
@pytest.mark.parametrize("type_", [T.DELIVER_BATCH, T.READ_OK])
def test_records_as_columns_are_the_records_decoded(type_: T, records: list[tuple[Any, ...]]) -> None:
    body = frame(type_, 1, records=records)[16:]
    columns = records_columns(type_, body)
    assert list(zip(*columns, strict=True)) == decode_body(type_, body)["records"] == records
    assert records_columns(type_, memoryview(body)) == columns  # as a read hands it over


@pytest.mark.parametrize("cut", [1, 5, 40])
def test_malformed_records_fail_as_the_decoder_fails(cut: int) -> None:
    body = frame(T.DELIVER_BATCH, 1, records=RECORDS[3])[16:]
    for bad in (body[:-cut], body + b"x" * cut, (20_000).to_bytes(4, "big") + body[4:]):
        with pytest.raises(ProtocolError) as columns:
            records_columns(T.DELIVER_BATCH, bad)
        with pytest.raises(ProtocolError) as fields:
            decode_body(T.DELIVER_BATCH, bad)
        assert columns.value.code == fields.value.code == Status.PROTOCOL_ERROR
    with pytest.raises(ValueError):
        records_columns(T.DELIVER, body)  # no records body


def test_messages_of_a_batch_answer_and_of_a_read() -> None:
    q = FakeHandle()
    recs = RECORDS[3]
    got = commands.get_many(q, 3, "g", True, None, None).parse(  # type: ignore[arg-type]
        next(iter(FrameDecoder().feed(frame(T.DELIVER_BATCH, 1, records=recs)))), (q, "g"))
    assert [tuple(m) for m in got] == [(q, 0, "g", o, dc, p, m, ts) for o, dc, ts, m, p in recs]
    assert all(type(m) is shmq.Message for m in got)
    read = commands.read(q, 10, 3)  # type: ignore[arg-type]
    got = read.parse(next(iter(FrameDecoder().feed(frame(T.READ_OK, 1, records=recs)))), read.ctx)
    assert [(m[1], m[2], m[3]) for m in got] == [(-1, None, 10), (-1, None, 11), (-1, None, 12)]
    err = encode_frame(T.ERROR, 1, frame(T.ERROR, 1, message="nope")[16:], int(Status.EMPTY))
    with pytest.raises(shmq.Empty):
        read.parse(next(iter(FrameDecoder().feed(err))), read.ctx)


def test_a_push_of_one_and_of_many_make_the_same_messages() -> None:
    q = FakeHandle()
    one = Feed(q, "g", 10, None)  # type: ignore[arg-type]
    one.take(next(iter(FrameDecoder().feed(frame(T.SUBSCRIBE_OK, 1)))))
    one.take(next(iter(FrameDecoder().feed(frame(T.DELIVER, 1, offset=10, deliveries=1, timestamp_ns=6,
                                                 meta=b"\x01meta", payload=b"p")))))
    one.take(next(iter(FrameDecoder().feed(frame(T.DELIVER_BATCH, 1, records=RECORDS[3][1:])))))
    assert [tuple(m) for m in one.ready] == [(q, 0, "g", o, dc, p, m, ts) for o, dc, ts, m, p in RECORDS[3]]


def test_acks_ride_only_with_a_get_of_their_handle_and_group() -> None:
    q, same, other = FakeHandle(), FakeHandle(), FakeHandle()
    other.broker = object()
    msgs = [tuple.__new__(shmq.Message, (q, 0, "g", o, 1, b"", b"", 0)) for o in range(3)]
    assert rides(q, "g", msgs)
    assert not rides(q, "h", msgs)
    assert rides(same, "g", msgs)  # another handle of the queue on the same connection
    assert not rides(other, "g", msgs)  # another connection's handle
    assert not rides(q, "g", [*msgs, tuple.__new__(shmq.Message, (q, 0, "h", 9, 1, b"", b"", 0))])
    assert rides(q, "g", [])


# ---------------------------------------------------------------- rings held
def _flags(*workers: int) -> bytes:
    b = bytearray(L.Q_BELLS_SIZE)
    for i in workers:
        b[i] = 1
    return bytes(b)


@pytest.fixture
def bells() -> Iterator[tuple[int, list[Bell]]]:
    uid = secrets.randbits(64)
    bs = [Bell(uid, i) for i in range(3)]
    try:
        yield uid, bs
    finally:
        for b in bs:
            b.close()


def _received(bell: Bell) -> int:
    """Datagrams waiting on ``bell`` (drained)."""
    n = 0
    while True:
        try:
            bell.sock.recv(64)
        except BlockingIOError:
            return n
        n += 1


def test_rings_held_go_out_once_per_queue_when_the_block_ends(bells: tuple[int, list[Bell]]) -> None:
    uid, (b0, b1, b2) = bells
    assert RINGER.hold()
    try:
        RINGER.ring(_flags(0), uid, 7, skip=-1)
        RINGER.ring(_flags(1), uid, 7, skip=-1)  # flagged since: both hear it
        RINGER.ring(_flags(0), uid, 8, skip=-1)
        assert not RINGER.hold()  # held already: the first holder releases
        RINGER.ring(_flags(2), uid, 9, skip=2)  # the ringer itself: nobody
        assert _received(b0) == _received(b1) == 0
    finally:
        RINGER.release()
    assert _received(b1) == 1  # queue 7, once
    assert b0.drain() == {7, 8}
    RINGER.ring(_flags(0), uid, 7, skip=-1)
    assert b0.drain() == {7}
    assert _received(b2) == 0


def test_other_threads_ring_at_once_while_one_holds(bells: tuple[int, list[Bell]]) -> None:
    uid, (b0, b1, _) = bells
    RINGER.hold()
    try:
        RINGER.ring(_flags(0), uid, 3, skip=-1)
        t = threading.Thread(target=lambda: RINGER.ring(_flags(1), uid, 4, skip=-1))
        t.start()
        t.join()
        assert b1.drain() == {4}  # not held: it is another thread's
        assert b0.drain() == set()
    finally:
        RINGER.release()
    assert b0.drain() == {3}


@contextlib.contextmanager
def _driven(instance: str, monkeypatch: pytest.MonkeyPatch, log: list[str],
            ring: Callable[[Any], str]) -> Iterator[Driver]:
    """A worker's Driver over queue "q" of a fresh instance, past its handshake, with worker 1
    waiting on the queue: what it writes, and ``ring(flags)`` of each ring it sends, go to
    ``log``."""
    ShmBroker(instance).create_queue("q")
    sb = ServerBroker(instance)
    host = _Host(Core(sb))
    try:
        sb.serve_as(0)
        sb.queue("q").set_bell(1, True)  # worker 1 waits on the queue
        monkeypatch.setattr(RINGER, "_send", lambda flags, uid, qid, skip: log.append(ring(flags)))
        d = Driver(host)  # type: ignore[arg-type]
        d.connection_made(_Transport(log))
        d.data_received(frame(T.HANDSHAKE, 1, token="", client="t", affinity="", heartbeat_ms=0))
        yield d
    finally:
        host.loop.close()
        sb.close()


def test_a_read_that_fails_still_rings(instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    with _driven(instance, monkeypatch, log, lambda flags: "ring") as d:
        real = handlers.handle_frames

        def fails_after(*args: Any) -> None:  # a read that fails once its put is stored
            real(*args)
            raise ProtocolError("broken after the put", Status.PROTOCOL_ERROR)

        monkeypatch.setattr(handlers, "handle_frames", fails_after)
        d.data_received(produce_frame(2, b"q", 0, b"x"))
        assert log[1:] == ["write PRODUCE_OK", "write ERROR", "ring"]
        assert RINGER.hold()  # released
        RINGER.release()


class _Transport(asyncio.Transport):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.log.append(f"write {T(FrameDecoder().feed(bytes(data))[0].type).name}")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        pass


class _Host:
    def __init__(self, core: Core) -> None:
        self.core = core
        self.drivers: dict[Any, Driver] = {}
        self.max_connections = 10
        self.worker_id = 0
        self.loop = asyncio.new_event_loop()
        self.spinner = Spinner(Spin(0), self.loop.call_soon)
        self.stopping = False

    def count_changed(self) -> None:
        pass


def test_a_worker_answers_a_put_before_it_rings_the_other_workers(instance: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    with _driven(instance, monkeypatch, log, lambda flags: f"ring {flags[1]}") as d:
        d.data_received(produce_frame(2, b"q", 0, b"x") + produce_frame(3, b"q", 0, b"y"))
        assert log == ["write HANDSHAKE_ACK", "write PRODUCE_OK", "ring 1"]  # one write, then one ring
        d.close()


def test_a_queue_deleted_and_made_again_is_the_new_one(instance: str) -> None:
    b = ShmBroker(instance)
    b.create_queue("q")
    sb = ServerBroker(instance)
    try:
        first = sb.queue("q")
        assert sb.queue("q") is first  # cached
        b.delete_queue("q")
        with pytest.raises(QueueNotFound):
            sb.queue("q")
        b.create_queue("q")
        again = sb.queue("q")
        assert again is not first and again.queue_id != first.queue_id
        assert sb.queue("q") is again
    finally:
        sb.close()
