"""An asyncio client for ``shmq serve``: the operations of ``shmq.tcp`` as coroutines.

    >>> from shmq import aio
    >>> async with await aio.connect("tcp://127.0.0.1:7878") as broker:
    ...     q = await broker.create_queue("orders")
    ...     await q.put(b"order #42")
    ...     msg = await q.get(timeout=1.0)
    ...     await msg.ack()

One connection per :class:`AsyncBroker`.  A reader task files every frame that
arrives by its message id: to the future of the request it answers, or to the
inbox of the subscription whose SUBSCRIBE had that id.  Requests are written as
soon as they are made, so any number of coroutines may share one broker and
their requests are pipelined.  When the connection goes, every request still
waiting fails with :class:`~shmq.errors.ConnectionLost`.

The arguments, the results and the typed errors are those of the blocking
client (``shmq.tcp``), whose helpers this module reuses.

Cancelling a ``get``/``get_many`` (``asyncio.wait_for``, ``TaskGroup``, ...)
cannot take back a request already sent: should its messages still come, they
are given back to the queue (NACK) at once, which counts as a delivery.  Prefer
the ``timeout`` argument, which the broker enforces.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections import deque
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import Any

from . import options
from .api import Message, Payload, QueueConfig, QueueInfo, as_bytes, own_leases
from .codec import Frame, FrameDecoder, T, decode_body, error_of, frame
from .errors import (
    AuthError,
    ConnectionLost,
    InvalidArgument,
    ProtocolError,
    ShmqError,
    StaleAck,
)
from .names import check_queue_name
from .settle import Settle
from .tcp import (
    NO_REPLY_ID,
    _ms,
    _pushed,
    _timeout_ms,
    _vis,
    ack_batch_nowait_frames,
    ack_nowait_frame,
    batch_acks,
    parse_tcp_url,
    produce_request,
)

__all__ = ["AsyncBroker", "AsyncMessage", "AsyncQueue", "connect"]

_CONSUMES = (T.CONSUME, T.CONSUME_BATCH)
_MAX_ID = NO_REPLY_ID - 1  # ids 1 .. 2**32-2, wrapping: 0xFFFFFFFF is the unwaited acks'


async def connect(url: str, token: str | None = None, *, connect_timeout: float = 10.0,
                  client: str = "shmq-python-asyncio", affinity: str = "") -> AsyncBroker:
    """Connect to ``shmq serve`` at ``tcp://HOST:PORT`` and handshake.

    ``token`` defaults to ``$SHMQ_TOKEN``.  Raises ConnectionLost when the broker
    cannot be reached, AuthError when it refuses the token."""
    if not url.startswith("tcp://"):
        raise InvalidArgument(f"unsupported url {url!r}: shmq.aio speaks tcp://HOST:PORT only")
    host, port = parse_tcp_url(url)
    token = token if token is not None else os.environ.get(options.TOKEN_ENV, "")
    try:
        async with asyncio.timeout(connect_timeout):
            reader, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError) as e:
        reason = getattr(e, "strerror", None) or str(e) or "timed out"
        raise ConnectionLost(f"cannot connect to {url}: {reason}") from None
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    broker = AsyncBroker(url, reader, writer)
    try:
        await broker._handshake(token, client, affinity)
    except BaseException:
        await broker._shutdown("the handshake failed")
        raise
    return broker


class AsyncBroker:
    """A connection to ``shmq serve``; make one with :func:`connect`."""

    worker: int  # the broker worker serving this connection
    server: str  # the broker's name and version

    def __init__(self, url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.url = url
        self._reader = reader
        self._writer = writer
        self._decoder = FrameDecoder()
        self._last_id = 0
        self._pending: dict[int, asyncio.Future[Frame]] = {}  # requests waiting for their answer
        self._subs: dict[int, asyncio.Queue[Frame | ShmqError]] = {}  # subscription id -> its frames
        self._orphans: dict[int, tuple[str, str]] = {}  # cancelled consumes -> (queue, group)
        self._closed = False
        self._close_reason = ""
        self.nowait_errors: deque[ShmqError] = deque(maxlen=100)  # the latest errors of unwaited acks
        self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(),
                                                                   name=f"shmq.aio reader {url}")

    def __repr__(self) -> str:
        return f"AsyncBroker({self.url!r})"

    async def __aenter__(self) -> AsyncBroker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ transport
    def _lost(self) -> ConnectionLost:
        return ConnectionLost(f"connection to {self.url} {self._close_reason or 'is closed'}")

    def _new_id(self) -> int:
        """The next message id (1 .. 2**32-1, wrapping), skipping ids still in use."""
        while True:
            self._last_id = self._last_id % _MAX_ID + 1
            i = self._last_id
            if i not in self._pending and i not in self._subs and i not in self._orphans:
                return i

    def _gone(self) -> bool:
        """Closed, or closing: the transport closes itself at EOF before the reader task
        has seen it, and what is written then would only be logged and dropped."""
        return self._closed or self._writer.is_closing()

    def _send(self, type_: int, msg_id: int, **fields: Any) -> None:
        self._send_frame(frame(type_, msg_id, **fields))

    def _send_frame(self, data: bytes) -> None:
        """Write a frame already made: a request (``_send``), or an unwaited ack (ACK_NO_REPLY
        and the like, whose failure lands in ``nowait_errors``)."""
        if self._gone():
            raise self._lost()
        self._writer.write(data)

    def _start(self, type_: int, **fields: Any) -> tuple[int, asyncio.Future[Frame]]:
        """Send a request; the future gets its answer."""
        if self._gone():
            raise self._lost()
        msg_id = self._new_id()
        data = frame(type_, msg_id, **fields)  # a bad argument raises here, before anything is sent
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg_id] = fut
        self._writer.write(data)
        return msg_id, fut

    async def _call(self, type_: int, **fields: Any) -> Frame:
        msg_id, fut = self._start(type_, **fields)
        try:
            try:
                await self._writer.drain()
            except OSError:
                pass  # the reader task sees it too, and fails the future
            f = await fut
        except asyncio.CancelledError:
            self._abandon(msg_id, fut, type_, fields)
            raise
        if f.type == T.ERROR:
            raise error_of(f)
        return f

    async def _request(self, type_: int, reply: int, **fields: Any) -> dict[str, Any]:
        f = await self._call(type_, **fields)
        if f.type != reply:
            raise ShmqError(f"unexpected reply type 0x{f.type:02x} to 0x{type_:02x}")
        return decode_body(reply, f.body)

    def _abandon(self, msg_id: int, fut: asyncio.Future[Frame], type_: int, fields: dict[str, Any]) -> None:
        """A request was cancelled after it was sent: messages it leases go back to the queue."""
        self._pending.pop(msg_id, None)
        if type_ not in _CONSUMES:
            return
        where = (fields["queue"], fields["group"])
        if fut.done() and not fut.cancelled():
            if fut.exception() is None:
                self._give_back(where, fut.result())
        elif not self._closed:
            self._orphans[msg_id] = where

    def _give_back(self, where: tuple[str, str], f: Frame) -> None:
        """NACK the leases of a DELIVER / DELIVER_BATCH nobody will see (the answers are not awaited)."""
        if f.type in (T.DELIVER, T.DELIVER_BATCH):
            self._give_back_records(where, _pushed(f))

    def _give_back_records(self, where: tuple[str, str], recs: Iterable[Sequence[Any]]) -> None:
        for r in recs:
            if self._gone():  # a write failed meanwhile: the broker gives a lost connection's leases back
                return
            self._send(T.NACK, self._new_id(), queue=where[0], group=where[1], offset=r[0],
                       deliveries=r[1], delay_ms=0)

    def _dispatch(self, f: Frame) -> None:
        if f.msg_id == NO_REPLY_ID:  # an unwaited ack (ACK_NO_REPLY, ACK_*_NO_REPLY) failed
            if f.type == T.ERROR:
                self.nowait_errors.append(error_of(f))
            return
        inbox = self._subs.get(f.msg_id)
        if inbox is not None:
            inbox.put_nowait(f)
            return
        fut = self._pending.pop(f.msg_id, None)
        if fut is not None:
            if not fut.done():
                fut.set_result(f)
            return
        where = self._orphans.pop(f.msg_id, None)
        if where is not None:
            self._give_back(where, f)
        elif f.msg_id == 0 and f.type == T.ERROR:  # about the connection: it closes next
            self._close_reason = f"closed by the broker: {error_of(f)}"
        # else: the answer to a NACK of _give_back, or a CREDIT-less push after UNSUBSCRIBE_OK

    async def _read_loop(self) -> None:
        reason = "closed by the broker"
        try:
            while True:
                data = await self._reader.read(1 << 20)
                if not data:
                    break
                for f in self._decoder.feed(data):
                    self._dispatch(f)
        except ProtocolError as e:
            reason = f"closed: the broker sent a malformed frame ({e})"
        except OSError as e:
            reason = f"lost: {e}"
        except Exception as e:  # noqa: BLE001 - whatever it was, the waiting requests must hear of it
            reason = f"closed: the client failed to read it ({type(e).__name__}: {e})"
        finally:
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        """The connection is gone: fail everything that waits on it."""
        if not self._close_reason:
            self._close_reason = reason
        self._closed = True
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(self._lost())
        for inbox in self._subs.values():
            inbox.put_nowait(self._lost())
        self._orphans.clear()
        self._writer.close()

    async def _shutdown(self, reason: str) -> None:
        self._fail_all(reason)
        self._reader_task.cancel()
        await asyncio.wait([self._reader_task])
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def _handshake(self, token: str, client: str, affinity: str) -> None:
        f = await self._call(T.HANDSHAKE, token=token, client=client, affinity=affinity)
        if f.type == T.HANDSHAKE_NACK:
            raise AuthError(decode_body(T.HANDSHAKE_NACK, f.body)["reason"])
        info = decode_body(T.HANDSHAKE_ACK, f.body)
        self.worker = info["worker"]
        self.server = info["server"]

    async def _unsubscribe(self, sub: int, where: tuple[str, str],
                           unread: Sequence[Sequence[Any]] = ()) -> None:
        """UNSUBSCRIBE; once UNSUBSCRIBE_OK is in, nothing more comes for ``sub`` (the broker
        answers in order), and what came but was not handed out (``unread``: records of
        frames taken from the inbox already) is given back: after, so that the broker
        cannot push it to this subscription again.  The cleanup runs even if the caller
        is cancelled meanwhile."""
        try:
            _, fut = self._start(T.UNSUBSCRIBE, subscription=sub)
        except ConnectionLost:
            self._subs.pop(sub, None)
            return

        def done(fut: asyncio.Future[Frame]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved: a lost connection is not worth a warning here
            inbox = self._subs.pop(sub, None)
            self._give_back_records(where, unread)
            while inbox is not None and not inbox.empty():
                f = inbox.get_nowait()
                if isinstance(f, Frame):
                    self._give_back(where, f)

        fut.add_done_callback(done)
        try:
            await asyncio.shield(fut)
        except ConnectionLost:
            pass

    # ------------------------------------------------------------ broker
    async def create_queue(self, name: str, **limits: Any) -> AsyncQueue:
        check_queue_name(name)
        await self._request(T.CREATE_QUEUE, T.CREATE_QUEUE_OK, queue=name, config=limits)
        return AsyncQueue(self, name)

    def queue(self, name: str) -> AsyncQueue:
        """A handle on an existing queue, without a round trip: a queue that does not
        exist raises QueueNotFound on first use."""
        return AsyncQueue(self, check_queue_name(name))

    async def list_queues(self) -> list[QueueInfo]:
        out = (await self._request(T.LIST_QUEUES, T.LIST_QUEUES_OK))["queues"]
        return [QueueInfo(d["name"], d["is_dlq"], QueueConfig(**d["config"])) for d in out]

    async def delete_queue(self, name: str) -> None:
        await self._request(T.DELETE_QUEUE, T.DELETE_QUEUE_OK, queue=name)

    async def close(self, timeout: float = 5.0) -> None:
        """DISCONNECT (the broker gives this connection's leases back) and close.
        Requests still waiting fail with ConnectionLost."""
        if self._closed:
            await self._shutdown("is closed")
            return
        self._close_reason = self._close_reason or "was closed by the client"
        try:
            async with asyncio.timeout(timeout):
                await self._request(T.DISCONNECT, T.DISCONNECT_OK)
        except (ShmqError, TimeoutError):
            pass
        await self._shutdown("is closed")

    @property
    def closed(self) -> bool:
        return self._closed


class AsyncMessage(Message):
    """A ``shmq.Message`` whose settle methods are coroutines."""

    __slots__ = ()

    async def ack(self, wait: bool = True) -> None:  # type: ignore[override]
        """Acknowledge.  ``wait=False``: without waiting for the broker's answer (as
        ``shmq.Message.ack``: a stale ack is then kept in ``broker.nowait_errors``)."""
        if wait:
            await self[0]._settle(self, Settle.ACK, 0.0)
        else:
            self[0]._ack_nowait(self)

    async def nack(self, delay: float = 0.0) -> None:  # type: ignore[override]
        """Give the message back; it is delivered again after ``delay`` seconds."""
        await self[0]._settle(self, Settle.NACK, delay)

    async def touch(self, visibility_timeout: float | None = None) -> None:  # type: ignore[override]
        """Extend the lease by the visibility timeout (or the given seconds) from now."""
        await self[0]._settle(self, Settle.TOUCH, visibility_timeout)

    async def dead_letter(self) -> None:  # type: ignore[override]
        """Send the message to the dead-letter queue now."""
        await self[0]._settle(self, Settle.DEAD, 0.0)

    def __repr__(self) -> str:
        return "Async" + super().__repr__()


class AsyncQueue:
    """A queue of an :class:`AsyncBroker`: the methods of ``shmq.Queue``, awaitable."""

    def __init__(self, broker: AsyncBroker, name: str) -> None:
        self._b = broker
        self.name = name

    def __repr__(self) -> str:
        return f"AsyncQueue({self._b.url!r}, {self.name!r})"

    def _msg(self, group: str | None, rec: Sequence[Any]) -> AsyncMessage:
        offset, deliveries, ts, meta, payload = rec
        return tuple.__new__(AsyncMessage, (self, 0 if group is not None else -1, group, offset, deliveries,
                                            payload, meta, ts))

    @staticmethod
    def _rec(d: dict[str, Any]) -> tuple[Any, ...]:
        return d["offset"], d["deliveries"], d["timestamp_ns"], d["meta"], d["payload"]

    async def put(self, payload: Payload, block: bool = True, timeout: float | None = None) -> int:
        r = await self._b._request(T.PRODUCE, T.PRODUCE_OK, queue=self.name,
                                   timeout_ms=_timeout_ms(block, timeout), payload=bytes(as_bytes(payload)))
        return int(r["offset"])

    async def put_many(self, payloads: Sequence[Payload], block: bool = True,
                       timeout: float | None = None, *, producer: str | None = None,
                       seq: int | None = None) -> list[int]:
        req = produce_request(self.name, payloads, block, timeout, producer, seq)
        if req is None:
            return []
        r = await self._b._request(req[0], T.PRODUCE_BATCH_OK, **req[1])
        return list(range(r["first"], r["first"] + r["count"]))

    async def get(self, group: str = options.DEFAULT_GROUP, block: bool = True, timeout: float | None = None,
                  visibility_timeout: float | None = None) -> AsyncMessage:
        d = await self._b._request(T.CONSUME, T.DELIVER, queue=self.name, group=group,
                                   timeout_ms=_timeout_ms(block, timeout),
                                   visibility_ms=_vis(visibility_timeout))
        return self._msg(group, self._rec(d))

    async def get_many(self, max_messages: int, group: str = options.DEFAULT_GROUP, block: bool = True,
                       timeout: float | None = None,
                       visibility_timeout: float | None = None) -> list[AsyncMessage]:
        if max_messages < 1:
            raise InvalidArgument("max_messages must be >= 1")
        r = await self._b._request(T.CONSUME_BATCH, T.DELIVER_BATCH, queue=self.name, group=group,
                                   max=min(max_messages, options.MAX_BATCH),
                                   timeout_ms=_timeout_ms(block, timeout),
                                   visibility_ms=_vis(visibility_timeout))
        return [self._msg(group, rec) for rec in r["records"]]

    async def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        """Ack many leases: one ACK_RANGE when they are one run, else one ACK_BATCH per group
        (pipelined; ``shmq.tcp.batch_acks``).  Raises StaleAck, with ``.stale`` the offsets, if
        some were stale; the others are applied.  ``wait=False``: the NO_REPLY kinds, not
        waited for (stale ones are reported in ``broker.nowait_errors``).  A message of
        another queue is stale here, raised at once (``shmq.api.own_leases``)."""
        msgs, stale, total = own_leases(self, messages)
        if not wait:
            for data in ack_batch_nowait_frames(self.name, msgs):
                self._b._send_frame(data)
        else:
            replies = await asyncio.gather(*(self._b._request(kind, T.ACK_BATCH_OK, queue=self.name, **fields)
                                             for kind, fields in batch_acks(msgs)))
            stale += [off for r in replies for off in r["stale"]]
        if stale:
            raise StaleAck.of_batch(stale, total)

    def _ack_nowait(self, msg: Message) -> None:
        self._b._send_frame(ack_nowait_frame(self.name.encode(), msg))

    async def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        if msg.group is None:
            raise StaleAck(f"message {msg.offset} was read, not leased: it cannot be settled")
        common = dict(queue=self.name, group=msg.group, offset=msg.offset, deliveries=msg.deliveries)
        if action == Settle.ACK:
            await self._b._request(T.ACK, T.ACK_OK, **common)
        elif action == Settle.NACK:
            await self._b._request(T.NACK, T.NACK_OK, delay_ms=_ms(arg or 0.0), **common)
        elif action == Settle.TOUCH:
            await self._b._request(T.TOUCH, T.TOUCH_OK, visibility_ms=_vis(arg), **common)
        else:
            await self._b._request(T.DEAD_LETTER, T.DEAD_LETTER_OK, **common)

    async def read(self, offset: int, max_messages: int = 1) -> list[AsyncMessage]:
        """Messages from ``offset`` on, without leasing them (they cannot be settled)."""
        r = await self._b._request(T.READ, T.READ_OK, queue=self.name, offset=offset, max=max_messages)
        return [self._msg(None, rec) for rec in r["records"]]

    async def create_group(self, name: str, start: str = "earliest") -> None:
        if start not in ("earliest", "latest"):
            raise InvalidArgument("start must be 'earliest' or 'latest'")
        await self._b._request(T.GROUP_JOIN, T.GROUP_JOIN_OK, queue=self.name, group=name,
                               start=0 if start == "earliest" else 1)

    async def delete_group(self, name: str) -> None:
        await self._b._request(T.GROUP_DELETE, T.GROUP_DELETE_OK, queue=self.name, group=name)

    async def groups(self) -> list[str]:
        return list((await self._b._request(T.GROUP_LIST, T.GROUP_LIST_OK, queue=self.name))["groups"])

    async def commit(self, group: str, offset: int) -> None:
        await self._b._request(T.GROUP_COMMIT, T.GROUP_COMMIT_OK, queue=self.name, group=group, offset=offset)

    async def purge(self) -> int:
        return int((await self._b._request(T.PURGE, T.PURGE_OK, queue=self.name))["purged"])

    async def stats(self) -> dict[str, Any]:
        return dict((await self._b._request(T.STATS, T.STATS_OK, queue=self.name))["stats"])

    async def subscribe(self, group: str = options.DEFAULT_GROUP, credit: int = options.DEFAULT_CREDIT,
                        visibility_timeout: float | None = None) -> AsyncGenerator[AsyncMessage, None]:
        """Push mode, ``async for msg in q.subscribe(...)``: the broker sends up to
        ``credit`` unacknowledged messages ahead (in batches when ``credit`` > 1); the
        messages handed out here return their credit in steps of half the window.

        Closing the iterator (``aclose()``, or ``contextlib.aclosing``; leaving an
        ``async for`` closes it once it is garbage) unsubscribes, and gives the
        messages received but not handed out back to the queue."""
        b = self._b
        vis = _vis(visibility_timeout)
        sub = b._new_id()
        inbox: asyncio.Queue[Frame | ShmqError] = asyncio.Queue()
        b._send(T.SUBSCRIBE, sub, queue=self.name, group=group, credit=credit, visibility_ms=vis)
        b._subs[sub] = inbox
        subscribed = refused = False
        step = max(1, credit // 2)
        owed = 0
        ready: deque[Sequence[Any]] = deque()  # received, not handed out yet
        try:
            while True:
                if not ready:
                    f = await inbox.get()
                    if isinstance(f, ShmqError):
                        raise f
                    if f.type == T.ERROR:  # only the SUBSCRIBE is answered with one
                        refused = True
                        raise error_of(f)
                    if not subscribed:
                        if f.type != T.SUBSCRIBE_OK:
                            raise ShmqError(f"unexpected reply type 0x{f.type:02x} to SUBSCRIBE")
                        subscribed = True
                        continue
                    ready.extend(_pushed(f))
                    continue
                owed += 1
                if owed >= step:
                    b._send(T.CREDIT, b._new_id(), subscription=sub, credit=owed)
                    owed = 0
                yield self._msg(group, ready.popleft())
        finally:
            if refused:
                b._subs.pop(sub, None)
            else:  # also when SUBSCRIBE_OK is still to come: the broker answers in order
                await b._unsubscribe(sub, (self.name, group), list(ready))

