"""``await aio.connect("tcp://h1:7878,h2:7878")``: the asyncio client's handle over a primary and
its standbys, that fails over.

The asyncio twin of ``shmq.client.failover`` (its doc says what is retried and what is not,
and holds the same here): ``shmq.client.aio.connect`` gives an :class:`AsyncFailoverBroker` for
a comma-separated list of URLs (or for one URL with ``failover_timeout``).  It talks to the
list's primary through one ``AsyncBroker`` connection, found as ``FailoverBroker`` finds it
(``failover.Search``: each URL connected to and asked ``info()``, standbys passed over, the
list tried again, backing off, until ``failover_timeout`` seconds have passed since the
failure; then ``ConnectionLost`` names each URL and why it was not used; ``AuthError`` and
``InvalidArgument`` at once), and its queue handles (:class:`AsyncFailoverQueue`) through that
connection's ``AsyncQueue``.

Fail-over: a call that raises ``ConnectionLost`` or ``NotPrimary`` closes that connection,
finds the primary again and is made once more on it; what it raises then is raised (a
retried put may store its messages twice: at-least-once, unless ``put_many(producer=,
seq=)`` makes it idempotent).  Not retried: settling a message (its ``queue_handle`` is the
``AsyncQueue`` of the connection that leased it, and its lease went with that connection:
``ConnectionLost``), a ``get`` or ``get_many`` that carries acks, and a subscription (one
connection's: it ends with ``ConnectionLost``).  Like ``AsyncQueue``, a queue has no
``publisher()``: asyncio pipelines by itself.

Coroutines of one event loop may share a handle: one of them searches for the primary at a
time, the others wait for the connection it found.

This module does not import ``shmq.client.aio``, which imports it: the connections are made
by the ``opener`` each handle is given (``aio.connect`` gives its own, of one URL), and are
typed ``Any`` here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from shmq import options
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
from shmq.client.aio_reply import AsyncRequester
from shmq.client.failover import FAILS_OVER, Search, check_failover_timeout, not_primary, url_list
from shmq.errors import ConnectionLost, Timeout
from shmq.joined import Joined
from shmq.names import check_queue_name
from shmq.seektime import Start, When

__all__ = ["AsyncFailoverBroker", "AsyncFailoverQueue"]

R = TypeVar("R")
Conn = Any  # a connection: a shmq.client.aio.AsyncBroker
Opener = Callable[..., Awaitable[Conn]]  # connects to one URL: opener(url, token, **settings)


@shares_docs(Broker)
class AsyncFailoverBroker:
    """A broker handle over a list of URLs: the primary's, failing over (see the module's doc).
    Made by ``await shmq.client.aio.connect(URLS, ...)`` (or ``await AsyncFailoverBroker.open``).

    ``urls``: the list; ``token``: presented to each; ``opener``: connects to one URL;
    ``failover_timeout``: seconds a search for the primary goes on from its first failure;
    the other keywords are the opener's, for each connection.  ``url`` is the list as text
    (without tokens), ``urls`` its entries; ``primary_url`` the entry in use now ("" while
    none is)."""

    def __init__(self, urls: str | Sequence[str], token: str | None = None, *, opener: Opener,
                 failover_timeout: float = options.FAILOVER_TIMEOUT, connect_timeout: float = 10.0,
                 client: str = "shmq-python-asyncio", affinity: str = "",
                 heartbeat: float = options.HEARTBEAT) -> None:
        self._entries, self.urls = url_list(urls, token)  # (entries as given: with their tokens)
        self.failover_timeout = check_failover_timeout(failover_timeout)
        self._token = token
        self._opener = opener
        self._settings: dict[str, Any] = {"connect_timeout": connect_timeout, "client": client,
                                          "affinity": affinity, "heartbeat": heartbeat}
        self.url = ",".join(self.urls)
        self.primary_url = ""
        self._lock = asyncio.Lock()  # one search at a time; the others wait for its primary
        self._state: tuple[Conn, int] | None = None  # the primary's connection, its generation
        self._generations = 0
        self._closing = False
        self._requester: AsyncRequester | None = None  # made on the first request
        self._conn_types: tuple[type, ...] = ()  # what its connections are (AsyncBroker)

    @classmethod
    async def open(cls, urls: str | Sequence[str], token: str | None = None, *, opener: Opener,
                   **settings: Any) -> AsyncFailoverBroker:
        """A handle whose primary was found (else ``ConnectionLost`` after ``failover_timeout``)."""
        b = cls(urls, token, opener=opener, **settings)
        await b._primary()
        return b

    def __repr__(self) -> str:
        return f"AsyncFailoverBroker({self.url!r}, primary={self.primary_url!r})"

    async def __aenter__(self) -> AsyncFailoverBroker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ the primary
    async def _primary(self) -> tuple[Conn, int]:
        """The primary's connection and its generation (searched for when there is none)."""
        state = self._state
        if state is not None:
            return state
        async with self._lock:
            return self._state or await self._new(None)

    async def _failover(self, generation: int, since: float) -> tuple[Conn, int]:
        """The call on connection ``generation`` failed at ``since``: that connection is
        closed (unless another coroutine did so already), and the primary searched for."""
        async with self._lock:
            state = self._state
            if state is not None and state[1] == generation:
                self._state = None
                self.primary_url = ""
                await state[0].close()  # (a lost connection's close only ends its tasks)
            return self._state or await self._new(since)

    async def _new(self, since: float | None) -> tuple[Conn, int]:
        if self._closing:
            raise ConnectionLost(f"{self.url} is closed")
        b = await self._find(since)
        if not isinstance(b, self._conn_types):
            self._conn_types += (type(b),)
        self._generations += 1
        self._state = state = (b, self._generations)
        return state

    async def _find(self, since: float | None) -> Conn:
        """Try the URLs in order, round after round, until one is the primary (``Search``)."""
        search = Search(self.url, self.failover_timeout, since)
        while True:
            for entry, shown in zip(self._entries, self.urls, strict=True):
                b, reason = await self._try(entry)
                if b is not None:
                    self.primary_url = shown
                    return b
                search.passed(shown, reason)
            await asyncio.sleep(search.pause(self._closing))

    async def _try(self, entry: str) -> tuple[Conn | None, str]:
        """A connection to ``entry`` when it is the primary, else None and why not."""
        try:
            b = await self._opener(entry, self._token, **self._settings)
        except (ConnectionLost, Timeout) as e:
            return None, str(e)
        try:
            why = not_primary(await b.info())
        except (*FAILS_OVER, Timeout) as e:
            await b.close()
            return None, str(e)
        except BaseException:
            await b.close()
            raise
        if not why:
            return b, ""
        await b.close()
        return None, why

    async def _run(self, op: Callable[[Conn, int], Awaitable[R]], retry: bool = True) -> R:
        """``op`` on the primary's connection (and its generation); after ``ConnectionLost``
        or ``NotPrimary``, once more on the primary found again, when ``retry``."""
        b, generation = await self._primary()
        try:
            return await op(b, generation)
        except FAILS_OVER as e:
            if not retry or self._closing:
                raise
            try:
                b, generation = await self._failover(generation, time.monotonic())
            except ConnectionLost as lost:
                raise lost from e
        return await op(b, generation)

    # ------------------------------------------------------------ broker
    async def create_queue(self, name: str, **limits: Any) -> AsyncFailoverQueue:
        """``AsyncBroker.create_queue``; retried after a fail-over, it may raise ``QueueExists``
        when the first try had created the queue."""
        async def create(b: Conn, generation: int) -> tuple[int, Any]:
            return generation, await b.create_queue(name, **limits)

        return AsyncFailoverQueue(self, name, await self._run(create))

    def queue(self, name: str) -> AsyncFailoverQueue:
        """A handle on an existing queue, without a round trip (as ``AsyncBroker.queue``)."""
        return AsyncFailoverQueue(self, check_queue_name(name))

    async def list_queues(self) -> list[QueueInfo]:
        return await self._run(lambda b, _: b.list_queues())

    async def delete_queue(self, name: str) -> None:
        await self._run(lambda b, _: b.delete_queue(name))

    async def info(self) -> BrokerInfo:
        """The primary's ``info()``."""
        return await self._run(lambda b, _: b.info())

    async def request(self, queue: str, payload: Payload, timeout: float = options.DEFAULT_REQUEST_TIMEOUT, *,
                      headers: Headers | None = None) -> Message:
        """``AsyncBroker.request`` through this handle: its reply queue is one of this handle's
        queues, on the primary (a fail-over while a request waits loses its reply)."""
        if self._requester is None:
            self._requester = AsyncRequester(self)
        r: Message = await self._requester.request(queue, payload, timeout, headers)
        return r

    async def close(self, timeout: float = 5.0) -> None:
        """Close the primary's connection (``AsyncBroker.close``; ``timeout``: the seconds a
        broker that does not answer is waited for).  Nothing is retried or searched for
        from here on: every call raises ``ConnectionLost``."""
        if self._closing:
            return
        self._closing = True
        if self._requester is not None:
            self._requester.close()
        async with self._lock:
            state, self._state = self._state, None
            self.primary_url = ""
        if state is not None:
            await state[0].close(timeout)

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closing


@shares_docs(Queue)
class AsyncFailoverQueue:
    """A queue of an :class:`AsyncFailoverBroker`: each call goes to the ``AsyncQueue`` of the
    primary's connection, made again after a fail-over (what is retried: the module's doc)."""

    def __init__(self, broker: AsyncFailoverBroker, name: str, at: tuple[int, Any] | None = None) -> None:
        self.broker = broker
        self.name = name
        self._at = at  # (the connection's generation, its AsyncQueue of this name)

    def __repr__(self) -> str:
        return f"AsyncFailoverQueue({self.broker.url!r}, {self.name!r})"

    def _on(self, b: Conn, generation: int) -> Any:
        at = self._at
        if at is None or at[0] != generation:
            at = self._at = (generation, b.queue(self.name))
        return at[1]

    async def _call(self, op: Callable[[Any], Awaitable[R]], retry: bool = True) -> R:
        return await self.broker._run(lambda b, g: op(self._on(b, g)), retry)

    async def put(self, payload: Payload, block: bool = True, timeout: float | None = None, *,
                  headers: Headers | None = None, delay: float | None = None,
                  ttl: float | None = None, priority: int = 0) -> int:
        """``AsyncQueue.put``; retried after a fail-over: at-least-once."""
        return await self._call(lambda q: q.put(payload, block, timeout, headers=headers, delay=delay,
                                                ttl=ttl, priority=priority))

    async def put_many(self, payloads: Sequence[Payload], block: bool = True,
                       timeout: float | None = None, *, producer: str | None = None,
                       seq: int | None = None, headers: Sequence[Headers | None] | None = None,
                       delay: float | None = None, ttl: float | None = None,
                       priority: int = 0) -> list[int]:
        """``AsyncQueue.put_many``; retried after a fail-over: at-least-once, unless ``producer``
        and ``seq`` make it idempotent (then ``Duplicate`` when the first try was stored)."""
        return await self._call(lambda q: q.put_many(payloads, block, timeout, producer=producer, seq=seq,
                                                     headers=headers, delay=delay, ttl=ttl,
                                                     priority=priority))

    async def put_nowait(self, payload: Payload, *, headers: Headers | None = None,
                         delay: float | None = None, ttl: float | None = None, priority: int = 0) -> int:
        return await self.put(payload, False, headers=headers, delay=delay, ttl=ttl, priority=priority)

    async def get_nowait(self, *, group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                         ack: Message | None = None) -> Message:
        return await self.get(False, group=group, visibility_timeout=visibility_timeout, ack=ack)

    async def put_joined(self, batch: Joined, block: bool = True, timeout: float | None = None, *,
                         producer: str | None = None, seq: int | None = None, priority: int = 0) -> int:
        return await self._call(lambda q: q.put_joined(batch, block, timeout, producer=producer, seq=seq,
                                                       priority=priority))

    async def get(self, block: bool = True, timeout: float | None = None, *,
                  group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                  ack: Message | None = None) -> Message:
        """``AsyncQueue.get``: the message's ``queue_handle`` is the ``AsyncQueue`` of the
        connection that leased it, which settles it.  Retried after a fail-over unless ``ack``."""
        if block.__class__ is str:  # get("billing"): the order before group became a keyword
            raise group_as_block("get", block)
        return await self._call(lambda q: q.get(block, timeout, group=group,
                                                visibility_timeout=visibility_timeout, ack=ack),
                                retry=ack is None)

    async def get_many(self, max_messages: int, block: bool = True, timeout: float | None = None, *,
                       group: str = options.DEFAULT_GROUP, visibility_timeout: float | None = None,
                       ack: Iterable[Message] = ()) -> list[Message]:
        """``AsyncQueue.get_many``, as ``get``: retried after a fail-over unless it carries acks."""
        if block.__class__ is str:
            raise group_as_block("get_many", block)
        acks = list(ack)
        return await self._call(lambda q: q.get_many(max_messages, block, timeout, group=group,
                                                     visibility_timeout=visibility_timeout, ack=acks),
                                retry=not acks)

    async def ack_many(self, messages: Iterable[Message], wait: bool = True) -> None:
        """``AsyncQueue.ack_many`` over the connection that leased the messages, never retried:
        after a fail-over their leases are gone (``ConnectionLost``; mixed with others,
        ``StaleAck``)."""
        msgs = list(messages)
        if not msgs:
            return
        conns = {getattr(m.queue_handle, "broker", None) for m in msgs}
        conn: Any = conns.pop() if len(conns) == 1 else None
        one_conn = isinstance(conn, self.broker._conn_types)  # one connection (AsyncBroker) leased all
        if one_conn:
            await conn.queue(self.name).ack_many(msgs, wait)  # (even if it is gone: its leases are too)
        else:  # of several connections, or none: on the primary's, where the others are stale
            await self._call(lambda q: q.ack_many(msgs, wait), retry=False)

    async def read(self, offset: int, max_messages: int = 1) -> list[Message]:
        return await self._call(lambda q: q.read(offset, max_messages))

    async def read_columns(self, offset: int, max_messages: int = 1) -> RecordColumns:
        return await self._call(lambda q: q.read_columns(offset, max_messages))

    async def iter_columns(self, start: int, end: int) -> AsyncIterator[RecordColumns]:
        """``AsyncQueue.iter_columns``: one ``read_columns`` (each failing over) after another."""
        while start < end:
            c = await self.read_columns(start, end - start)
            yield c
            if not len(c):
                return
            start = c.offsets[-1] + 1

    async def create_group(self, name: str, start: Start = "earliest", exist_ok: bool = False) -> None:
        await self._call(lambda q: q.create_group(name, start, exist_ok))

    async def seek(self, group: str, when: When) -> int:
        return await self._call(lambda q: q.seek(group, when))

    async def delete_group(self, name: str) -> None:
        await self._call(lambda q: q.delete_group(name))

    async def groups(self) -> list[str]:
        return await self._call(lambda q: q.groups())

    async def commit(self, group: str, offset: int) -> None:
        await self._call(lambda q: q.commit(group, offset))

    async def purge(self) -> int:
        return await self._call(lambda q: q.purge())

    async def stats(self) -> dict[str, Any]:
        return await self._call(lambda q: q.stats())

    def subscribe(self, group: str = options.DEFAULT_GROUP, credit: int = options.DEFAULT_CREDIT,
                  visibility_timeout: float | None = None) -> AsyncGenerator[Message, None]:
        """``AsyncQueue.subscribe`` on the primary's connection at the first ``anext``, that
        resumes on the new primary after a fail-over (found within ``failover_timeout``, else
        ``ConnectionLost``): the messages it delivered before were leased by the old
        connection, so settling one raises and the new primary delivers it again.  Closing it
        closes the subscription."""
        return self._subscription(group, credit, visibility_timeout)

    async def _subscription(self, group: str, credit: int,
                            visibility_timeout: float | None) -> AsyncGenerator[Message, None]:
        broker = self.broker
        while True:
            b, generation = await broker._primary()
            sub = self._on(b, generation).subscribe(group, credit, visibility_timeout)
            try:
                async for msg in sub:
                    yield msg
                return
            except FAILS_OVER as e:
                if broker._closing:
                    raise
                try:
                    await broker._failover(generation, time.monotonic())
                except ConnectionLost as lost:
                    raise lost from e
            finally:
                await sub.aclose()
