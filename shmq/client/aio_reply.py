"""Request/reply for the asyncio client (``shmq.client.aio``): ``shmq.api.reply``'s, as coroutines.

One reply queue per :class:`~shmq.client.aio.AsyncBroker`, made on its first request; a reader
task gets from it while requests wait, and resolves each one's future by correlation id
(a reply nobody waits for any more is dropped and counted ``late``).  The reader waits
the way every asyncio get does: one CONSUME, parked at the broker until a reply comes
(its DELIVER resolves the get's future) or the last waiting request's deadline passes;
nothing is polled.  The reply queue goes when the connection closes: the worker deletes
the reply queues a connection made.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from typing import Any

from shmq import options
from shmq.api import reply as _reply
from shmq.errors import Empty, Full, QueueNotFound, ShmqError, Timeout
from shmq.names import new_reply_name


class AsyncRequester:
    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.name = new_reply_name()
        self._q: Any = None
        self._prefix = self.name[len(options.REPLY_PREFIX):][:12].encode()
        self._head = _reply.request_head(self.name)
        self._ids = itertools.count(1)
        self._waiting: dict[bytes, tuple[asyncio.Future[Any], float]] = {}  # id -> (reply, deadline)
        self._reader: asyncio.Task[None] | None = None
        self._made: asyncio.Lock = asyncio.Lock()

    async def request(self, queue: str, payload: Any, timeout: float,
                      headers: Mapping[str, str | bytes] | None) -> Any:
        timeout = _reply.check_timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        key = b"%b.%d" % (self._prefix, next(self._ids))  # the correlation id
        h = _reply.request_headers(headers, self._head, self.name, key)
        if self._q is None:
            async with self._made:
                if self._q is None:
                    self._q = await self.broker.create_queue(
                        self.name, capacity=options.REPLY_CAPACITY, max_bytes=options.REPLY_MAX_BYTES,
                        durability="memory")
        fut = loop.create_future()
        self._waiting[key] = (fut, deadline)
        try:
            await self.broker.queue(queue).put(payload, timeout=timeout, headers=h)
            if self._reader is None or self._reader.done():
                self._reader = loop.create_task(self._read(), name=f"shmq.client.aio replies {self.name}")
            try:
                return await asyncio.wait_for(fut, max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise Timeout(f"no reply from {queue!r} within the timeout") from None
        finally:
            del self._waiting[key]

    async def _read(self) -> None:
        """Get replies while requests wait for them: each get waits (parked at the broker)
        until a reply comes or the last deadline of the requests waiting passes."""
        loop = asyncio.get_running_loop()
        while True:
            deadlines = [d for fut, d in self._waiting.values() if not fut.done()]
            left = max(deadlines, default=0.0) - loop.time()
            if left <= 0:
                return
            try:
                msgs = await self._q.get_many(min(len(deadlines), options.REPLY_CAPACITY), timeout=left)
            except Empty:
                continue
            except ShmqError as e:  # the connection or the reply queue went: they all fail
                for fut, _ in self._waiting.values():
                    if not fut.done():
                        fut.set_exception(e)
                return
            try:
                await self._q.ack_many(msgs, wait=False)
            except ShmqError:
                pass
            for msg in msgs:
                waiter = self._waiting.get(msg.headers.get(_reply.CORRELATION_ID, b""))
                if waiter is not None and not waiter[0].done():
                    waiter[0].set_result(msg)
                elif msg.deliveries == 1:
                    _reply.count_dropped("late")

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


async def send_reply(broker: Any, name: str, payload: Any, headers: _reply.ReplyHeaders) -> bool:
    try:
        await broker.queue(name).put(payload, block=False, headers=headers)
    except QueueNotFound:
        _reply.count_dropped("gone")
        return False
    except Full:
        _reply.count_dropped("full")
        return False
    return True
