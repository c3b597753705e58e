"""``tcp://``: the same ``api.Broker`` interface over the wire protocol (``codec``).

One socket per broker handle, one request at a time per handle (a lock makes a
handle safe to share between threads); the message id correlates responses,
and pushes of a subscription are told apart by the SUBSCRIBE's id.  A handle
pickles as its URL and reconnects in the child.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from collections import deque
from collections.abc import Generator, Iterable, Sequence
from operator import itemgetter
from typing import Any

from . import options
from .api import Broker, Message, Payload, Queue, QueueConfig, QueueInfo, as_bytes, check_producer, own_leases
from .codec import (
    NO_REPLY_ID,
    WAIT_FOREVER,
    Frame,
    FrameDecoder,
    T,
    consume_frame,
    decode_body,
    decode_deliver,
    error_of,
    frame,
    produce_frame,
    settle_frame,
)
from .errors import (
    AuthError,
    ConnectionLost,
    InvalidArgument,
    LimitExceeded,
    ShmqError,
    StaleAck,
)
from .names import check_queue_name
from .settle import Settle

RECV_SIZE = 1 << 18  # bytes one read takes at most
MSG_MORE = getattr(socket, "MSG_MORE", 0)  # Linux: hold a frame for the next send
MAX_ID = 0x7FFFFFFF  # other requests' ids are 1 .. MAX_ID, wrapping


def _timeout_ms(block: bool, timeout: float | None) -> int:
    if not block:
        return 0
    if timeout is None:
        return WAIT_FOREVER
    if timeout < 0:
        raise InvalidArgument("timeout must be >= 0")
    return min(int(timeout * 1000), WAIT_FOREVER - 1)


def parse_tcp_url(url: str) -> tuple[str, int]:
    rest = url[len("tcp://"):] if url.startswith("tcp://") else url
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"bad tcp url {url!r}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


class TcpBroker(Broker):
    """A broker handle talking to ``shmq serve``."""

    def __init__(self, url: str, token: str | None = None, *, connect_timeout: float = 10.0,
                 client: str = "shmq-python", affinity: str = "") -> None:
        self.url = url
        self.affinity = affinity
        self._token = token if token is not None else os.environ.get(options.TOKEN_ENV, "")
        self._host, self._port = parse_tcp_url(url)
        self._lock = threading.Lock()  # one sender at a time
        self._cond = threading.Condition(threading.Lock())  # guards _inbox and _reading
        self._reading = False
        self._waiting = 0  # threads waiting on the condition for another's read
        self._inbox: dict[int, deque[Any]] = {}  # frames read, by message id
        self._ids = itertools.count(1)  # an id is next() % MAX_ID + 1: it wraps below NO_REPLY_ID
        self._decoder = FrameDecoder()
        self._rbuf = bytearray(RECV_SIZE)  # reused by every read: no allocation per recv
        self._rview = memoryview(self._rbuf)
        self._closed = False
        self._close_reason = ""  # what the broker said before it closed the connection
        self.nowait_errors: deque[ShmqError] = deque(maxlen=100)  # the latest errors of unwaited acks
        try:
            self._sock = socket.create_connection((self._host, self._port), timeout=connect_timeout)
        except OSError as e:
            raise ConnectionLost(f"cannot connect to {url}: {e.strerror or e} (is `shmq serve` running?)"
                                 ) from None
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        f = self._call(T.HANDSHAKE, token=self._token, client=client, affinity=affinity)
        if f.type == T.HANDSHAKE_NACK:
            self._sock.close()
            raise AuthError(decode_body(T.HANDSHAKE_NACK, f.body)["reason"])
        info = decode_body(T.HANDSHAKE_ACK, f.body)
        self.worker = info["worker"]
        self.server = info["server"]

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_reconnect, (self.url, self._token, self.affinity))

    def __repr__(self) -> str:
        return f"TcpBroker({self.url!r})"

    # ------------------------------------------------------------ transport
    def _send(self, data: bytes, flags: int = 0) -> None:
        try:
            self._sock.sendall(data, flags)
        except OSError as e:
            self._closed = True
            raise ConnectionLost(f"connection to {self.url} lost: {e}") from None

    def _read_some(self) -> None:
        """Read from the socket and file the frames by message id (the reader lock is held)."""
        try:
            n = self._sock.recv_into(self._rbuf)
        except OSError as e:
            self._closed = True
            raise ConnectionLost(f"connection to {self.url} lost: {e}") from None
        if not n:
            self._closed = True
            raise ConnectionLost(f"connection to {self.url} closed by the broker{self._close_reason}")
        for f in self._decoder.feed(self._rview[:n]):
            if f.msg_id == NO_REPLY_ID:  # an unwaited ack (ACK_NO_REPLY, ACK_*_NO_REPLY) failed
                if f.type == T.ERROR:
                    self.nowait_errors.append(error_of(f))
                continue
            if f.msg_id == 0 and f.type == T.ERROR:  # about the connection: it closes next
                self._close_reason = f": {error_of(f)}"
                continue
            self._inbox.setdefault(f.msg_id, deque()).append(f)

    def _wait_for(self, msg_id: int) -> Any:
        """The next frame with this id.  Threads share the socket: whoever holds the
        reader lock reads for everyone, the others wait on the condition."""
        with self._cond:
            while True:
                box = self._inbox.get(msg_id)
                if box:
                    f = box.popleft()
                    if not box:
                        del self._inbox[msg_id]
                    return f
                if self._closed:
                    raise ConnectionLost(f"connection to {self.url} is closed")
                if self._reading:
                    self._waiting += 1
                    try:
                        self._cond.wait()
                    finally:
                        self._waiting -= 1
                    continue
                self._reading = True
                self._cond.release()
                try:
                    self._read_some()
                finally:
                    self._cond.acquire()
                    self._reading = False
                    if self._waiting:  # the common case, one thread, skips notify_all's cost
                        self._cond.notify_all()

    def _next_id(self) -> int:
        return next(self._ids) % MAX_ID + 1  # next() is atomic; ids only correlate

    def _start(self, type_: int, **fields: Any) -> int:
        """Send a request; its message id."""
        msg_id = self._next_id()
        self._send_frame(frame(type_, msg_id, **fields))  # a bad argument raises before sending
        return msg_id

    def _send_no_reply(self, data: bytes) -> None:
        """Send a request frame (message id NO_REPLY_ID) that is answered only if it fails
        (ACK_NO_REPLY, ACK_BATCH_NO_REPLY, ACK_RANGE_NO_REPLY; the reader keeps such errors
        in ``nowait_errors``).  The kernel may hold the frame back (``MSG_MORE``) until this
        connection's next request, its close, or its cork timer (about 200 ms on Linux),
        whichever comes first: the next request then carries it in the same segment, and
        the broker reads both at once and applies them in order."""
        self._send_frame(data, MSG_MORE)

    def _send_frame(self, data: bytes, flags: int = 0) -> None:
        if self._closed:
            raise ConnectionLost(f"connection to {self.url} is closed")
        with self._lock:
            self._send(data, flags)

    def _answer(self, msg_id: int) -> Any:
        """The answer to a request started with _start (an ERROR raises as its typed error)."""
        f = self._wait_for(msg_id)
        if f.type == T.ERROR:
            raise error_of(f)
        return f

    def _call(self, type_: int, **fields: Any) -> Any:
        return self._answer(self._start(type_, **fields))

    def _request(self, type_: int, reply: int, **fields: Any) -> dict[str, Any]:
        return self._decoded(self._call(type_, **fields), type_, reply)

    @staticmethod
    def _decoded(f: Any, type_: int, reply: int) -> dict[str, Any]:
        if f.type != reply:
            raise ShmqError(f"unexpected reply type 0x{f.type:02x} to 0x{type_:02x}")
        return decode_body(reply, f.body)

    # ------------------------------------------------------------ Broker
    def create_queue(self, name: str, **limits: Any) -> TcpQueue:
        check_queue_name(name)
        self._request(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue=name, config=limits)
        return TcpQueue(self, name)

    def queue(self, name: str) -> TcpQueue:
        q = TcpQueue(self, name)
        q.stats()  # raises QueueNotFound now rather than on first use
        return q

    def list_queues(self) -> list[QueueInfo]:
        out = self._request(T.LIST_QUEUES, T.LIST_QUEUES_OK)["queues"]
        return [QueueInfo(d["name"], d["is_dlq"], QueueConfig(**d["config"])) for d in out]

    def delete_queue(self, name: str) -> None:
        self._request(T.DELETE_QUEUE, T.DELETE_QUEUE_OK, queue=name)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._request(T.DISCONNECT, T.DISCONNECT_OK)
        except ShmqError:
            pass
        self._closed = True
        self._sock.close()
        with self._cond:
            self._cond.notify_all()


class TcpQueue(Queue):
    def __init__(self, broker: TcpBroker, name: str) -> None:
        self._b = broker
        self.name = name
        self._qb = str.encode(name)  # the name on the wire, for the one-message frames

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_tcp_queue, (self._b.url, self._b._token, self.name, self._b.affinity))

    def __repr__(self) -> str:
        return f"TcpQueue({self._b.url!r}, {self.name!r})"

    def put(self, payload: Payload, block: bool = True, timeout: float | None = None) -> int:
        b = self._b
        if type(payload) is not bytes:
            payload = bytes(as_bytes(payload))
        msg_id = b._next_id()
        b._send_frame(produce_frame(msg_id, self._qb, _timeout_ms(block, timeout), payload))
        return int(b._decoded(b._answer(msg_id), T.PRODUCE, T.PRODUCE_OK)["offset"])

    def put_many(self, payloads: Sequence[Payload], block: bool = True,
                 timeout: float | None = None, *, producer: str | None = None,
                 seq: int | None = None) -> list[int]:
        req = produce_request(self.name, payloads, block, timeout, producer, seq)
        if req is None:
            return []
        r = self._b._request(req[0], T.PRODUCE_BATCH_OK, **req[1])
        return list(range(r["first"], r["first"] + r["count"]))

    def _publish(self, payload: Payload, block: bool, timeout: float | None) -> int:
        return self._b._start(T.PRODUCE, queue=self.name, timeout_ms=_timeout_ms(block, timeout),
                              payload=bytes(as_bytes(payload)))

    def _confirm(self, token: int) -> int:
        return int(self._b._decoded(self._b._answer(token), T.PRODUCE, T.PRODUCE_OK)["offset"])

    def _msg(self, group: str, rec: Sequence[Any]) -> Message:
        offset, deliveries, ts, meta, payload = rec
        return tuple.__new__(Message, (self, 0, group, offset, deliveries, payload, meta, ts))

    def get(self, group: str = options.DEFAULT_GROUP, block: bool = True, timeout: float | None = None,
            visibility_timeout: float | None = None) -> Message:
        b = self._b
        msg_id = b._next_id()
        b._send_frame(consume_frame(msg_id, self._qb, str.encode(group), _timeout_ms(block, timeout),
                                    _vis(visibility_timeout)))
        f = b._answer(msg_id)
        if f.type != T.DELIVER:
            b._decoded(f, T.CONSUME, T.DELIVER)  # raises
        return self._msg(group, decode_deliver(f.body))

    def get_many(self, max_messages: int, group: str = options.DEFAULT_GROUP, block: bool = True,
                 timeout: float | None = None, visibility_timeout: float | None = None) -> list[Message]:
        if max_messages < 1:
            raise InvalidArgument("max_messages must be >= 1")
        max_messages = min(max_messages, options.MAX_BATCH)
        recs = self._b._request(T.CONSUME_BATCH, T.DELIVER_BATCH, queue=self.name, group=group,
                                max=max_messages, timeout_ms=_timeout_ms(block, timeout),
                                visibility_ms=_vis(visibility_timeout))["records"]
        new = tuple.__new__  # as _msg, inlined: a batch makes 100 of them
        return [new(Message, (self, 0, group, o, dc, p, m, ts)) for o, dc, ts, m, p in recs]

    def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        msgs, stale, total = own_leases(self, messages)
        if not wait:  # ACK_(BATCH|RANGE)_NO_REPLY, riding with the next request as ack(wait=False) does
            for data in ack_batch_nowait_frames(self.name, msgs):
                self._b._send_no_reply(data)
        else:
            for kind, fields in batch_acks(msgs):
                stale += self._b._request(kind, T.ACK_BATCH_OK, queue=self.name, **fields)["stale"]
        if stale:
            raise StaleAck.of_batch(stale, total)

    def _ack_nowait(self, msg: Message) -> None:
        self._b._send_no_reply(ack_nowait_frame(self._qb, msg))

    def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        if msg.group is None:
            raise StaleAck(f"message {msg.offset} was read, not leased: it cannot be settled")
        common = dict(queue=self.name, group=msg.group, offset=msg.offset, deliveries=msg.deliveries)
        if action == Settle.ACK:
            self._b._request(T.ACK, T.ACK_OK, **common)
        elif action == Settle.NACK:
            self._b._request(T.NACK, T.NACK_OK, delay_ms=_ms(arg or 0.0), **common)
        elif action == Settle.TOUCH:
            self._b._request(T.TOUCH, T.TOUCH_OK, visibility_ms=_vis(arg), **common)
        else:
            self._b._request(T.DEAD_LETTER, T.DEAD_LETTER_OK, **common)

    def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        recs = self._b._request(T.READ, T.READ_OK, queue=self.name, offset=offset,
                                max=max_messages)["records"]
        return [tuple.__new__(Message, (self, -1, None, o, dc, p, m, ts)) for o, dc, ts, m, p in recs]

    def create_group(self, name: str, start: str = "earliest") -> None:
        if start not in ("earliest", "latest"):
            raise InvalidArgument("start must be 'earliest' or 'latest'")
        self._b._request(T.GROUP_JOIN, T.GROUP_JOIN_OK, queue=self.name, group=name,
                         start=0 if start == "earliest" else 1)

    def delete_group(self, name: str) -> None:
        self._b._request(T.GROUP_DELETE, T.GROUP_DELETE_OK, queue=self.name, group=name)

    def groups(self) -> list[str]:
        return list(self._b._request(T.GROUP_LIST, T.GROUP_LIST_OK, queue=self.name)["groups"])

    def commit(self, group: str, offset: int) -> None:
        self._b._request(T.GROUP_COMMIT, T.GROUP_COMMIT_OK, queue=self.name, group=group, offset=offset)

    def purge(self) -> int:
        return int(self._b._request(T.PURGE, T.PURGE_OK, queue=self.name)["purged"])

    def stats(self) -> dict[str, Any]:
        return dict(self._b._request(T.STATS, T.STATS_OK, queue=self.name)["stats"])

    def subscribe(self, group: str = options.DEFAULT_GROUP, credit: int = options.DEFAULT_CREDIT,
                  visibility_timeout: float | None = None) -> Generator[Message, None, None]:
        """Push mode: the broker sends up to ``credit`` unacknowledged messages ahead
        (in batches when ``credit`` > 1); the messages handed out here return their
        credit in steps of half the window.  Use a dedicated broker handle.  Closing
        the iterator unsubscribes, and gives the messages received but not handed out
        back to the queue."""
        b = self._b
        sub = b._call(T.SUBSCRIBE, queue=self.name, group=group, credit=credit,
                      visibility_ms=_vis(visibility_timeout)).msg_id
        step = max(1, credit // 2)
        owed = 0
        ready: deque[Message] = deque()  # received, not handed out yet
        try:
            while True:
                if not ready:
                    ready.extend(self._pushed_msgs(group, b._wait_for(sub)))
                owed += 1
                if owed >= step:
                    b._send_frame(frame(T.CREDIT, b._next_id(), subscription=sub, credit=owed))
                    owed = 0
                yield ready.popleft()
        finally:
            if not b._closed:
                b._request(T.UNSUBSCRIBE, T.UNSUBSCRIBE_OK, subscription=sub)
                # nothing comes for ``sub`` after UNSUBSCRIBE_OK (the broker answers in order),
                # so what is given back now cannot be pushed to it again
                with b._cond:
                    for f in b._inbox.pop(sub, ()):
                        ready.extend(self._pushed_msgs(group, f))
                try:
                    self._give_back(ready)
                except ConnectionLost:
                    pass  # the broker gives a lost connection's leases back itself

    def _pushed_msgs(self, group: str, f: Frame) -> list[Message]:
        new = tuple.__new__  # as _msg, inlined: a push brings up to MAX_BATCH
        return [new(Message, (self, 0, group, o, dc, p, m, ts)) for o, dc, ts, m, p in _pushed(f)]

    def _give_back(self, msgs: Iterable[Message]) -> None:
        """NACK leases received but never handed out (pipelined; stale ones are ignored)."""
        b = self._b
        ids = [b._start(T.NACK, queue=self.name, group=m[2], offset=m[3], deliveries=m[4], delay_ms=0)
               for m in msgs]
        for msg_id in ids:
            b._wait_for(msg_id)


def _pushed(f: Frame) -> list[Sequence[Any]]:
    """The records (offset, deliveries, timestamp_ns, meta, payload) of a pushed frame."""
    if f.type == T.DELIVER_BATCH:
        return decode_body(T.DELIVER_BATCH, f.body)["records"]  # type: ignore[no-any-return]
    if f.type == T.DELIVER:
        return [decode_deliver(f.body)]
    if f.type == T.ERROR:
        raise error_of(f)
    raise ShmqError(f"unexpected frame type 0x{f.type:02x} on a subscription")


def produce_request(queue: str, payloads: Sequence[Payload], block: bool, timeout: float | None,
                    producer: str | None, seq: int | None) -> tuple[T, dict[str, Any]] | None:
    """The frame type and fields of a batch produce (both clients); None for no payloads."""
    items = batch_payloads(payloads)
    if not items:
        return None
    fields: dict[str, Any] = {"queue": queue, "timeout_ms": _timeout_ms(block, timeout), "payloads": items}
    if producer is None and seq is None:
        return T.PRODUCE_BATCH, fields
    check_producer(producer, seq)
    return T.PRODUCE_IDEMPOTENT, {**fields, "producer": producer, "seq": seq}


def ack_nowait_frame(queue: bytes, msg: Message) -> bytes:
    """The ACK_NO_REPLY frame of ``msg.ack(wait=False)`` (both clients); ``queue`` in UTF-8."""
    if msg[2] is None:
        raise StaleAck(f"message {msg[3]} was read, not leased: it cannot be settled")
    return settle_frame(T.ACK_NO_REPLY, NO_REPLY_ID, queue, str.encode(msg[2]), msg[3], msg[4])


def ack_batch_nowait_frames(queue: str, msgs: list[Message]) -> list[bytes]:
    """The frames of ``ack_many(msgs, wait=False)`` (both clients): ``batch_acks``'
    requests as their NO_REPLY kinds."""
    return [frame(NO_REPLY_KIND[kind], NO_REPLY_ID, queue=queue, **fields)
            for kind, fields in batch_acks(msgs)]


NO_REPLY_KIND = {T.ACK_BATCH: T.ACK_BATCH_NO_REPLY, T.ACK_RANGE: T.ACK_RANGE_NO_REPLY}


def batch_acks(msgs: list[Message]) -> list[tuple[T, dict[str, Any]]]:
    """The requests that ack ``msgs`` (both clients), as (type, fields but the queue).
    One ACK_RANGE when they are one run: one group, consecutive offsets in order, one
    delivery count (what one push or one get_many of new messages brings), so the frame
    is the same few bytes however many they are; otherwise one ACK_BATCH per group."""
    n = len(msgs)
    if n > 1:
        first, dc, group = msgs[0][3], msgs[0][4], msgs[0][2]
        if (msgs[-1][3] == first + n - 1 and list(map(_offset_of, msgs)) == list(range(first, first + n))
                and list(map(_dc_of, msgs)).count(dc) == n and list(map(_group_of, msgs)).count(group) == n):
            return [(T.ACK_RANGE, {"group": group or "", "first": first, "count": n, "deliveries": dc})]
    return [(T.ACK_BATCH, {"group": group, "settles": settles}) for group, settles in settles_by_group(msgs)]


def settles_by_group(msgs: list[Message]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(group, [(offset, deliveries), ...]) of each group of ``msgs``, for ACK_BATCH (both clients)."""
    groups = set(map(_group_of, msgs))
    if len(groups) == 1:  # the usual case: one get_many's messages, at C speed
        return [(groups.pop() or "", list(map(_settle_of, msgs)))]
    by_group: dict[str, list[tuple[int, int]]] = {}
    for m in msgs:
        by_group.setdefault(m[2] or "", []).append((m[3], m[4]))
    return list(by_group.items())


_group_of = itemgetter(2)
_offset_of = itemgetter(3)
_dc_of = itemgetter(4)
_settle_of = itemgetter(3, 4)  # (offset, deliveries)


def batch_payloads(payloads: Sequence[Payload]) -> list[bytes]:
    """The payloads of one PRODUCE_BATCH frame, checked against MAX_BATCH."""
    items: list[bytes]
    if set(map(type, payloads)) == {bytes}:  # the usual case, checked at C speed
        items = list(payloads)  # type: ignore[arg-type]
    else:
        items = [bytes(as_bytes(p)) for p in payloads]
    if len(items) > options.MAX_BATCH:
        raise LimitExceeded(f"{len(items)} messages in one batch; the limit over TCP is "
                            f"{options.MAX_BATCH}")
    return items


def _ms(seconds: float) -> int:
    if not 0 <= seconds <= options.MAX_VISIBILITY_TIMEOUT:
        raise InvalidArgument(f"must be between 0 and {options.MAX_VISIBILITY_TIMEOUT} s")
    return int(seconds * 1000)


def _vis(seconds: float | None) -> int:
    return 0 if seconds is None else max(1, _ms(seconds))


def _reconnect(url: str, token: str, affinity: str) -> TcpBroker:
    return TcpBroker(url, token, affinity=affinity)


def _tcp_queue(url: str, token: str, name: str, affinity: str = "") -> TcpQueue:
    return TcpQueue(_reconnect(url, token, affinity), name)


__all__ = ["TcpBroker", "TcpQueue", "batch_acks", "batch_payloads", "parse_tcp_url", "settles_by_group"]
