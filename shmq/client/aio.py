"""An asyncio client for ``shmq serve``: the operations of ``shmq.client.tcp`` as coroutines.

    >>> from shmq import aio
    >>> async with await aio.connect("tcp://127.0.0.1:7878") as broker:
    ...     q = await broker.create_queue("orders")
    ...     await q.put(b"order #42")
    ...     msg = await q.get(timeout=1.0)
    ...     await msg.ack()

One connection per :class:`AsyncBroker`.  (A list of URLs, a primary and its standbys, gives a
handle that fails over: ``shmq.client.aio_failover``.)  A reader task feeds every byte that arrives
to the connection's protocol state (a :class:`~shmq.protocol.connection.ClientConnection`),
which files each frame by its message id: to the future of the request it answers, or
to the inbox of the subscription whose SUBSCRIBE had that id.  Requests are written as
soon as they are made, so any number of coroutines may share one broker and their
requests are pipelined.  When the connection goes, every request still waiting fails
with :class:`~shmq.errors.ConnectionLost`.

The arguments, the results and the typed errors are those of the blocking client
(``shmq.client.tcp``): both run the commands of ``shmq.protocol.commands``.

Cancelling a ``get``/``get_many`` (``asyncio.wait_for``, ``TaskGroup``, ...)
cannot take back a request already sent: should its messages still come, they
are given back to the queue (NACK) at once, which counts as a delivery.  Prefer
the ``timeout`` argument, which the broker enforces.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, overload

from shmq import options, tls
from shmq.api import (
    Broker,
    BrokerInfo,
    Headers,
    Message,
    Payload,
    Queue,
    QueueInfo,
    RecordColumns,
    group_as_block,
    shares_docs,
)
from shmq.api import reply as _reply
from shmq.client.aio_reply import AsyncRequester, send_reply
from shmq.errors import ConnectionLost, GroupExists, ProtocolError, ShmqError
from shmq.joined import Joined
from shmq.names import check_queue_name
from shmq.protocol import commands as cmd
from shmq.protocol import group_commands as gcmd
from shmq.protocol.codec import HEARTBEAT_FRAME, Frame
from shmq.protocol.commands import Batch, Command
from shmq.protocol.connection import ClientConnection, Event, Push, Reply, Request
from shmq.protocol.consume_ack import rides
from shmq.protocol.subscription import Feed
from shmq.seektime import Start, When
from shmq.settle import Settle
from shmq.urls import client_settings

if TYPE_CHECKING:
    from shmq.client.aio_failover import AsyncFailoverBroker

__all__ = ["AsyncBroker", "AsyncMessage", "AsyncQueue", "connect"]

R = TypeVar("R")
Inbox = asyncio.Queue[Frame | ShmqError]  # a subscription's frames, or the error that ended it


@overload
async def connect(url: str, token: str | None = None, *, connect_timeout: float = 10.0,
                  client: str = "shmq-python-asyncio", affinity: str = "",
                  heartbeat: float = options.HEARTBEAT) -> AsyncBroker: ...


@overload
async def connect(url: str, token: str | None = None, *, connect_timeout: float = 10.0,
                  client: str = "shmq-python-asyncio", affinity: str = "",
                  heartbeat: float = options.HEARTBEAT, failover_timeout: float) -> AsyncFailoverBroker: ...


async def connect(url: str, token: str | None = None, *, connect_timeout: float = 10.0,
                  client: str = "shmq-python-asyncio", affinity: str = "",
                  heartbeat: float = options.HEARTBEAT,
                  failover_timeout: float | None = None) -> AsyncBroker | AsyncFailoverBroker:
    """Connect to ``shmq serve`` at ``tcp://HOST:PORT``, ``tcps://HOST:PORT`` (TLS) or
    ``unix://PATH`` (``shmq serve --unix``), with the URL's parameters (``shmq.urls``), and
    handshake.

    ``token`` defaults to ``$SHMQ_TOKEN``, else to the token a broker on this host left
    for this user (``shmq.runtime``).  ``heartbeat``: the seconds between heartbeats
    this end proposes (0: none; the broker may agree to fewer); a broker silent for
    ``options.HEARTBEAT_MISSES`` intervals is taken for dead.  Raises ConnectionLost
    when the broker cannot be reached, AuthError when it refuses the token.

    A comma-separated list of such URLs (a primary and its standbys, as for
    ``shmq.connect``), or one URL with ``failover_timeout`` (seconds, default
    ``options.FAILOVER_TIMEOUT``), gives an ``AsyncFailoverBroker``
    (``shmq.client.aio_failover``): it finds the list's primary, passing standbys over, and
    follows it when a standby is promoted, as ``shmq.client.failover.FailoverBroker`` does.
    (A type checker sees an ``AsyncBroker`` unless ``failover_timeout`` is given: the
    handle has its methods, not its connection's attributes -- ``worker``, ``server``.)"""
    if "," in url or failover_timeout is not None:
        from shmq.client.aio_failover import AsyncFailoverBroker
        return await AsyncFailoverBroker.open(
            url, token, opener=_connect, connect_timeout=connect_timeout, client=client, affinity=affinity,
            heartbeat=heartbeat,
            failover_timeout=options.FAILOVER_TIMEOUT if failover_timeout is None else failover_timeout)
    return await _connect(url, token, connect_timeout=connect_timeout, client=client, affinity=affinity,
                          heartbeat=heartbeat)


async def _connect(url: str, token: str | None, *, connect_timeout: float, client: str, affinity: str,
                   heartbeat: float) -> AsyncBroker:
    """``connect`` of one URL: its connection."""
    u, token = client_settings(url, token)  # refused here: a token in clear text off loopback
    url = u.without_token()  # (in errors and logs)
    ctx = tls.client_context(u) if u.tls else None
    try:
        async with asyncio.timeout(connect_timeout):
            if u.scheme == "unix":
                reader, writer = await asyncio.open_unix_connection(u.path)
            else:
                reader, writer = await asyncio.open_connection(
                    u.host, u.port, ssl=ctx, server_hostname=u.host if ctx else None,
                    ssl_handshake_timeout=connect_timeout if ctx else None)
    except ssl.SSLError as e:
        raise ConnectionLost(f"cannot connect to {url}: {tls.describe(e, u)}") from None
    except (OSError, TimeoutError) as e:
        reason = getattr(e, "strerror", None) or str(e) or "timed out"
        raise ConnectionLost(f"cannot connect to {url}: {reason}") from None
    sock = writer.get_extra_info("socket")
    if sock is not None and u.scheme != "unix":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    broker = AsyncBroker(url, reader, writer)
    try:  # the handshake is bounded by connect_timeout too: a peer that never answers is no broker
        async with asyncio.timeout(connect_timeout):
            broker.worker, broker.server, broker.heartbeat = await broker._execute(
                cmd.handshake(token, client, affinity, heartbeat))
    except TimeoutError:
        await broker._shutdown("the handshake failed")
        raise ConnectionLost(f"connection to {url} did not answer the handshake within {connect_timeout} s: "
                             "is it a shmq broker?") from None
    except BaseException as e:
        await broker._shutdown("the handshake failed")
        if broker._malformed is not None and isinstance(e, ConnectionLost):
            raise broker._malformed from None  # no shmq broker: named for what it looks like, as by tcp's
        if u.tls and isinstance(e, ConnectionLost):  # closed during TLS: a client certificate?
            raise tls.handshake_lost(e, u) from None
        raise
    if broker.heartbeat:
        broker._beating = broker._loop.create_task(broker._beat(broker.heartbeat),
                                                   name=f"shmq.client.aio heartbeat {url}")
    return broker


@shares_docs(Broker)
class AsyncBroker:
    """A connection to ``shmq serve``; make one with :func:`connect`."""

    worker: int  # the broker worker serving this connection
    server: str  # the broker's name and version
    heartbeat: float  # seconds between heartbeats, agreed in the handshake (0: none)

    def __init__(self, url: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.url = url
        self._reader = reader
        self._writer = writer
        self._conn = ClientConnection(url)
        self.nowait_errors = self._conn.nowait_errors  # the latest errors of unwaited acks
        self._loop = asyncio.get_running_loop()
        self._received = 0  # bytes read so far: the heartbeat task's sign of life
        self._malformed: ProtocolError | None = None  # what the reader found, if the peer sent no frame
        self._beating: asyncio.Task[None] | None = None
        self._requester: AsyncRequester | None = None  # made on the first request
        self._reader_task = self._loop.create_task(self._read_loop(), name=f"shmq.client.aio reader {url}")

    def __repr__(self) -> str:
        return f"AsyncBroker({self.url!r})"

    async def __aenter__(self) -> AsyncBroker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ transport
    def _gone(self) -> bool:
        """Closed, or closing: the transport closes itself at EOF before the reader task
        has seen it, and what is written then would only be logged and dropped."""
        return self._conn.closed or self._writer.is_closing()

    def _send_frame(self, data: bytes) -> None:
        """Write a frame made already: an unwaited ack (ACK_NO_REPLY and the like, whose
        failure lands in ``nowait_errors``), a CREDIT."""
        if self._gone():
            raise self._conn.lost_error()
        self._writer.write(data)

    def _start(self, req: Request[Any]) -> tuple[int, asyncio.Future[Frame]]:
        """Send a request; the future gets its answer."""
        if self._writer.is_closing():
            raise self._conn.lost_error()
        fut = self._loop.create_future()
        msg_id, data = self._conn.send(req, fut)  # a bad argument raises here, before anything is sent
        self._writer.write(data)
        return msg_id, fut

    async def _execute(self, command: Command[R]) -> R:
        """Run a command of ``shmq.protocol.commands``: send it, await its answers, its result."""
        if isinstance(command, Batch):
            for data in command.nowait:
                self._send_frame(data)
            return command.combine(list(await asyncio.gather(*map(self._execute, command.requests))))
        msg_id, fut = self._start(command)
        try:
            try:
                await self._writer.drain()
            except OSError:
                pass  # the reader task sees it too, and fails the future
            f = await fut
        except asyncio.CancelledError:
            self._abandon(msg_id, fut, command)
            raise
        return command.parse(f, command.ctx)

    def _abandon(self, msg_id: int, fut: asyncio.Future[Frame], req: Request[Any]) -> None:
        """A request was cancelled after it was sent: messages it leases go back to the queue."""
        if not fut.done() or fut.cancelled():
            self._conn.abandon(msg_id, req)  # its answer comes to _dispatch, with req
        elif fut.exception() is None:  # answered, and nobody will look
            self._give_back(cmd.unclaimed(req, fut.result()))

    def _give_back(self, nacks: Batch[None]) -> None:
        """Send NACKs of leases nobody will see; their answers are not awaited."""
        for req in nacks.requests:
            if self._gone():  # a write failed meanwhile: the broker gives a lost connection's leases back
                return
            self._writer.write(self._conn.send(req)[1])

    def _dispatch(self, events: list[Event]) -> None:
        for ev in events:
            if ev.__class__ is Reply:
                w = ev.waiter  # type: ignore[union-attr]
                if w.__class__ is Request:  # the answer to a cancelled request
                    self._give_back(cmd.unclaimed(w, ev.frame))  # type: ignore[union-attr]
                elif w is not None and not w.done():  # None: a give-back NACK's answer
                    w.set_result(ev.frame)  # type: ignore[union-attr]
            elif ev.__class__ is Push:
                ev.waiter.put_nowait(ev.frame)  # type: ignore[union-attr]
            # NowaitFailed, Closing: the connection keeps them (nowait_errors, close_reason)

    async def _read_loop(self) -> None:
        reason = "closed by the broker"
        try:
            while True:
                data = await self._reader.read(1 << 20)
                if not data:
                    break
                self._received += len(data)
                self._dispatch(self._conn.receive_data(data))
        except ProtocolError as e:
            reason = f"closed: the broker sent a malformed frame ({e})"
            self._malformed = e
        except OSError as e:
            reason = f"lost: {e}"
        except Exception as e:  # noqa: BLE001 - whatever it was, the waiting requests must hear of it
            reason = f"closed: the client failed to read it ({type(e).__name__}: {e})"
        finally:
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        """The connection is gone: fail everything that waits on it."""
        for w in self._conn.lost(reason):
            if isinstance(w, asyncio.Future):
                if not w.done():
                    w.set_exception(self._conn.lost_error())
            elif isinstance(w, asyncio.Queue):
                w.put_nowait(self._conn.lost_error())
        self._writer.close()

    async def _beat(self, interval: float) -> None:
        """Every heartbeat interval, a HEARTBEAT out; a broker from which nothing came for
        ``options.HEARTBEAT_MISSES`` intervals in a row is dead or frozen: the connection
        is lost, and every request waiting on it raises ConnectionLost."""
        quiet, seen = 0, self._received
        while True:
            await asyncio.sleep(interval)
            if self._gone():
                return
            self._writer.write(HEARTBEAT_FRAME)
            if self._received != seen:
                quiet, seen = 0, self._received
                continue
            quiet += 1
            if quiet >= options.HEARTBEAT_MISSES:
                self._fail_all(f"went silent: no heartbeat from the broker for {quiet * interval:.3g} s")
                self._writer.transport.abort()
                return

    async def _shutdown(self, reason: str) -> None:
        if self._beating is not None:
            self._beating.cancel()
        self._fail_all(reason)
        self._reader_task.cancel()
        await asyncio.wait([self._reader_task])
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    # ------------------------------------------------------------ push mode
    async def _subscription(self, q: AsyncQueue, group: str, credit: int,
                            visibility_timeout: float | None) -> AsyncGenerator[AsyncMessage, None]:
        """``q.subscribe``'s generator (its arguments are checked at the first ``anext``)."""
        feed = Feed(q, group, credit, visibility_timeout)
        inbox: Inbox = asyncio.Queue()
        if self._writer.is_closing():
            raise self._conn.lost_error()
        sub, data = self._conn.subscribe(feed.request, feed.credit, inbox)
        handed_out = self._conn.handed_out_counter(sub)  # before a refusal can end it
        self._writer.write(data)
        ready = feed.ready
        try:
            while True:
                while not ready:
                    feed.take(await inbox.get())
                if handed_out():  # the message goes out: its credit comes back, in steps
                    self._send_frame(self._conn.grant(sub))
                yield ready.popleft()
        finally:
            if not feed.refused:  # also when SUBSCRIBE_OK is still to come: the broker answers in order
                await self._unsubscribe(sub, feed, inbox)

    async def _unsubscribe(self, sub: int, feed: Feed, inbox: Inbox) -> None:
        """UNSUBSCRIBE; once UNSUBSCRIBE_OK is in, nothing more comes for ``sub`` (the broker
        answers in order), and what came but was not handed out is given back: after, so
        that the broker cannot push it to this subscription again.  The cleanup runs even
        if the caller is cancelled meanwhile."""
        try:
            _, fut = self._start(cmd.unsubscribe(sub))
        except ConnectionLost:
            self._conn.end(sub)
            return

        def done(fut: asyncio.Future[Frame]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved: a lost connection is not worth a warning here
            self._conn.end(sub)
            left = [inbox.get_nowait() for _ in range(inbox.qsize())]
            self._give_back(feed.leftovers(left))

        fut.add_done_callback(done)
        try:
            await asyncio.shield(fut)
        except ConnectionLost:
            pass

    # ------------------------------------------------------------ broker
    async def create_queue(self, name: str, **limits: Any) -> AsyncQueue:
        await self._execute(cmd.create_queue(name, limits))
        return AsyncQueue(self, name)

    def queue(self, name: str) -> AsyncQueue:
        """A handle on an existing queue, without a round trip: a queue that does not
        exist raises QueueNotFound on first use."""
        return AsyncQueue(self, check_queue_name(name))

    async def list_queues(self) -> list[QueueInfo]:
        return await self._execute(cmd.list_queues())

    async def delete_queue(self, name: str) -> None:
        await self._execute(cmd.delete_queue(name))

    async def info(self) -> BrokerInfo:
        """The broker's version, owner, uptime, workers and connections per worker."""
        return await self._execute(cmd.info())

    async def promote(self, force: bool = False) -> int:
        """Make this broker, a standby (``shmq serve --replica-of``), the primary: its new epoch
        (``shmq promote``).  ``force``: even while its primary still streams to it."""
        epoch: int = await self._execute(cmd.promote(force))
        return epoch

    async def request(self, queue: str, payload: Payload, timeout: float = options.DEFAULT_REQUEST_TIMEOUT, *,
                      headers: Headers | None = None) -> AsyncMessage:
        """``shmq.Broker.request``, awaitable: the reply (it needs no ack), or ``Timeout``."""
        if self._requester is None:
            self._requester = AsyncRequester(self)
        r: AsyncMessage = await self._requester.request(queue, payload, timeout, headers)
        return r

    async def close(self, timeout: float = 5.0) -> None:
        """DISCONNECT (the broker gives this connection's leases back, and deletes its reply
        queue) and close.  Requests still waiting fail with ConnectionLost."""
        if self._requester is not None:
            self._requester.close()
        if self._conn.closed:
            await self._shutdown("is closed")
            return
        self._conn.close_reason = self._conn.close_reason or "was closed by the client"
        try:
            async with asyncio.timeout(timeout):
                await self._execute(cmd.disconnect())
        except (ShmqError, TimeoutError):
            pass
        await self._shutdown("is closed")

    @property
    def closed(self) -> bool:
        """True once the connection is closed (``close()``, or lost)."""
        return self._conn.closed


class AsyncMessage(Message):
    """A ``shmq.Message`` whose settle methods are coroutines."""

    __slots__ = ()

    async def ack(self, wait: bool = True) -> None:  # type: ignore[override]
        """Acknowledge.  ``wait=False``: without waiting for the broker's answer (as
        ``shmq.Message.ack``: a stale ack is then kept in ``broker.nowait_errors``)."""
        if wait:
            await self.queue_handle._settle(self, Settle.ACK, 0.0)
        else:
            self.queue_handle._ack_nowait(self)

    async def nack(self, delay: float = 0.0) -> None:  # type: ignore[override]
        """Give the message back; it is delivered again after ``delay`` seconds."""
        await self.queue_handle._settle(self, Settle.NACK, delay)

    async def touch(self, visibility_timeout: float | None = None) -> None:  # type: ignore[override]
        """Extend the lease by the visibility timeout (or the given seconds) from now."""
        await self.queue_handle._settle(self, Settle.TOUCH, visibility_timeout)

    async def dead_letter(self) -> None:  # type: ignore[override]
        """Send the message to the dead-letter queue now."""
        await self.queue_handle._settle(self, Settle.DEAD, 0.0)

    async def reply(self, payload: Payload, headers: Headers | None = None) -> bool:  # type: ignore[override]
        """``shmq.Message.reply``, awaitable."""
        name, h = _reply.reply_target(self.meta, headers)
        return await send_reply(self.queue_handle.broker, name, payload, h)

    def __repr__(self) -> str:
        return "Async" + super().__repr__()


@shares_docs(Queue)
class AsyncQueue:
    """A queue of an :class:`AsyncBroker`: the methods of ``shmq.Queue``, awaitable."""

    message_class = AsyncMessage  # what its messages are made of (shmq.protocol.commands)

    def __init__(self, broker: AsyncBroker, name: str) -> None:
        self.broker = broker
        self.name = name
        self.name_bytes = str.encode(name)  # the name on the wire, for the one-message frames

    def __repr__(self) -> str:
        return f"AsyncQueue({self.broker.url!r}, {self.name!r})"

    async def put(self, payload: Payload, block: bool = True, timeout: float | None = None, *,
                  headers: Headers | None = None, delay: float | None = None,
                  ttl: float | None = None, priority: int = 0) -> int:
        return await self.broker._execute(cmd.put(self, payload, block, timeout, headers, delay, ttl,
                                                  priority))

    async def put_many(self, payloads: Sequence[Payload], block: bool = True,
                       timeout: float | None = None, *, producer: str | None = None,
                       seq: int | None = None, headers: Sequence[Headers | None] | None = None,
                       delay: float | None = None, ttl: float | None = None,
                       priority: int = 0) -> list[int]:
        return await self.broker._execute(cmd.put_many(self, payloads, block, timeout, producer, seq, headers,
                                                    delay, ttl, priority))

    async def put_nowait(self, payload: Payload, *, headers: Headers | None = None,
                         delay: float | None = None, ttl: float | None = None, priority: int = 0) -> int:
        return await self.put(payload, False, headers=headers, delay=delay, ttl=ttl, priority=priority)

    async def get_nowait(self, *, group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                         ack: Message | None = None) -> AsyncMessage:
        return await self.get(False, group=group, visibility_timeout=visibility_timeout, ack=ack)

    async def get(self, block: bool = True, timeout: float | None = None, *,
                  group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                  ack: Message | None = None) -> AsyncMessage:
        if block.__class__ is str:  # get("billing"): the order before group became a keyword
            raise group_as_block("get", block)
        if ack is not None and not rides(self, group, (ack,)):
            await self._settle(ack, Settle.ACK, 0.0)  # not a lease of this queue and group here
            ack = None
        return await self.broker._execute(cmd.get(self, group, block, timeout, visibility_timeout, ack))

    async def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                       group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                       ack: Iterable[Message] = ()) -> list[AsyncMessage]:
        if block.__class__ is str:
            raise group_as_block("get_many", block)
        acks = list(ack)
        if acks and not rides(self, group, acks):
            await self.ack_many(acks)  # not all leases of this queue and group here: acked apart
            acks = []
        return await self.broker._execute(cmd.get_many(self, max_messages, group, block, timeout,
                                                   visibility_timeout, acks))

    async def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        """Ack many leases: one ACK_RANGE when they are one run, else one ACK_BATCH per group
        (pipelined; ``shmq.protocol.commands.batch_acks``).  Raises StaleAck, with ``.stale`` the offsets,
        if some were stale; the others are applied.  ``wait=False``: the NO_REPLY kinds, not
        waited for (stale ones are reported in ``broker.nowait_errors``).  A message of
        another queue is stale here, raised at once (``shmq.api.own_leases``)."""
        await self.broker._execute(cmd.ack_many(self, messages, wait))

    def _ack_nowait(self, msg: Message) -> None:
        self.broker._send_frame(cmd.ack_nowait_frame(self.name_bytes, msg))

    async def _settle(self, msg: Message, action: Settle, arg: float | None) -> None:
        await self.broker._execute(cmd.settle(self, msg, action, arg))

    async def read(self, offset: int, max_messages: int = 1) -> list[AsyncMessage]:
        """Messages from ``offset`` on, without leasing them (they cannot be settled)."""
        return await self.broker._execute(cmd.read(self, offset, max_messages))

    async def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        """``shmq.Queue.read_columns``: one READ, its answer as columns, no object per record."""
        return await self.broker._execute(cmd.read_columns(self, offset, max_messages))

    async def iter_columns(self, start: int, end: int) -> AsyncIterator[RecordColumns]:
        """``shmq.Queue.iter_columns``, ``async for``: one ``read_columns`` after another."""
        while start < end:
            c = await self.read_columns(start, end - start)
            yield c
            if not len(c):
                return
            start = c.offsets[-1] + 1

    async def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                         producer: str | None = None, seq: int | None = None, priority: int = 0) -> int:
        """``shmq.Queue.put_joined``: one produce made of the lengths and the bytes as they are."""
        return await self.broker._execute(cmd.put_joined(self, batch, block, timeout, producer, seq,
                                                         priority))

    async def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        try:
            await self.broker._execute(gcmd.create_group(self, name, start))
        except GroupExists:
            if not exist_ok:
                raise

    async def delete_group(self, name: str) -> None:
        await self.broker._execute(gcmd.delete_group(self, name))

    async def groups(self) -> list[str]:
        return await self.broker._execute(gcmd.groups(self))

    async def commit(self, group: str, offset: int) -> None:
        await self.broker._execute(gcmd.commit(self, group, offset))

    async def seek(self, group: str, when: When) -> int:
        return await self.broker._execute(gcmd.seek(self, group, when))

    async def purge(self) -> int:
        return await self.broker._execute(cmd.purge(self))

    async def stats(self) -> dict[str, Any]:
        return await self.broker._execute(cmd.stats(self))

    def subscribe(self, group: str = options.DEFAULT_GROUP, credit: int = options.DEFAULT_CREDIT,
                  visibility_timeout: float | None = None) -> AsyncGenerator[AsyncMessage, None]:
        """Push mode, ``async for msg in q.subscribe(...)``: the broker sends up to
        ``credit`` unacknowledged messages ahead (in batches when ``credit`` > 1); the
        messages handed out here return their credit in steps of half the window.

        Closing the iterator (``aclose()``, or ``contextlib.aclosing``; leaving an
        ``async for`` closes it once it is garbage) unsubscribes, and gives the
        messages received but not handed out back to the queue."""
        return self.broker._subscription(self, group, credit, visibility_timeout)
