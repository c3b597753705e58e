"""``ShmqResultBackend``: the store of Dramatiq's ``Results`` middleware, on one shmq queue.

A result is one message of the results queue (``namespace``, default ``dramatiq-results``):
its payload the encoded result, its headers the message's key and when the result expires;
it is put with the result's TTL and nobody consumes the queue, so the broker's maintenance
drops it when the TTL runs out (the queue is made with ``expired_to_dlq=False``).  A process
that looks results up reads the queue from where it left off (``read``: no lease, nothing
taken from others) and keeps what it read in an index by key, pruned as results expire;
``get_result(block=True)`` looks again with Dramatiq's backoff (from 100 ms) until the
result is there or the timeout passes.

What it costs: a store is one put; a lookup one read of what was stored since the last
(nothing when nothing was); each process that looks results up holds every result stored in
the last TTL (Dramatiq's default 10 minutes) in memory, and the queue must have room for them
all (``queue_options``: ``capacity``, ``max_bytes``; a store that finds no room raises
``shmq.Full``, which Dramatiq logs).  That suits thousands of results a minute; for many
more, or results far larger, use Dramatiq's Redis backend.  Expiry needs the broker's
maintenance: with ``shm://`` and no ``shmq serve`` running, nothing expires."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from dramatiq.encoder import Encoder
from dramatiq.errors import ConnectionClosed
from dramatiq.results import ResultBackend
from dramatiq.results.backend import Missing

import shmq
from shmq import options
from shmq.dramatiq.broker import ShmqBroker
from shmq.dramatiq.link import Link

KEY = "dramatiq-key"  # the header with the result's key
EXPIRES = "dramatiq-expires"  # the header with when it expires: ms since the epoch
READ_BATCH = 1000  # results one read takes at most


class ShmqResultBackend(ResultBackend):
    """Dramatiq results in shmq: ``Results(backend=ShmqResultBackend(broker=broker))``.

    ``broker``: a :class:`ShmqBroker` whose connection it shares; else ``url``, ``token``
    and other keywords as ``ShmqBroker``'s, for a connection of its own.  ``namespace``:
    the results queue's name (as it is: a broker's ``prefix`` is not put before it);
    ``queue_options``: ``create_queue`` limits for it."""

    def __init__(self, *, broker: ShmqBroker | None = None, url: str = options.DEFAULT_URL,
                 token: str | None = None, namespace: str = "dramatiq-results",
                 encoder: Encoder | None = None, queue_options: dict[str, Any] | None = None,
                 **connect_options: Any) -> None:
        super().__init__(namespace=namespace, encoder=encoder)
        self.link = broker.link if broker is not None else Link(url, token, connect_options, {})
        self.limits = {**(queue_options or {}), "expired_to_dlq": False}
        self._lock = threading.Lock()
        self._next = 0  # the offset the next read starts at
        self._generation = self.link.generation  # the connection the reads were made on
        self._index: dict[str, tuple[bytes, int]] = {}  # key -> (encoded result, expires: epoch ms)
        self._order: deque[tuple[int, str]] = deque()  # (expires, key), as read: to prune the index

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        ttl = max(1, int(ttl))
        expires = int(time.time() * 1000) + ttl
        data = self.encoder.encode(result)
        headers = {KEY: message_key, EXPIRES: str(expires)}
        self.link.put(self.namespace, data, self.limits, block=False, headers=headers,
                      ttl=min(ttl / 1000, options.MAX_MESSAGE_TTL))

    def _get(self, message_key: str) -> Any:
        with self._lock:
            now = int(time.time() * 1000)
            self._read_new(now)
            hit = self._index.get(message_key)
        if hit is None or hit[1] <= now:
            return Missing
        return self.encoder.decode(hit[0])

    def _read_new(self, now: int) -> None:
        """Index the results stored since the last read, and forget those expired."""
        link = self.link
        generation = link.generation
        try:
            q = link.queue(self.namespace, self.limits)
            if generation != self._generation:  # a new connection: the queue may be a new one too
                if q.stats()["next_offset"] < self._next:  # (a broker restarted without a journal)
                    self._next = 0
                self._generation = generation
            while True:
                got = q.read(self._next, READ_BATCH)
                for m in got:
                    h = m.headers
                    key, expires = h.get(KEY), h.get(EXPIRES)
                    if key is None or expires is None:
                        continue  # not a result: someone else's message
                    k, exp = key.decode(), int(expires)
                    self._index[k] = (bytes(m.payload), exp)
                    self._order.append((exp, k))
                if got:
                    self._next = got[-1].offset + 1
                if len(got) < READ_BATCH:
                    break
        except shmq.QueueNotFound:
            link.forget(self.namespace)
        except shmq.ConnectionLost as e:
            link.lost(generation)
            raise ConnectionClosed(e) from e
        order, index = self._order, self._index
        while order and order[0][0] <= now:
            exp, k = order.popleft()
            hit = index.get(k)
            if hit is not None and hit[1] <= now:
                del index[k]
