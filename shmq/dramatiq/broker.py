"""``ShmqBroker``: Dramatiq's broker interface on shmq queues.

What maps to what (docs/celery.md, "Dramatiq"):

* a Dramatiq queue ``q`` is the shmq queue ``q`` (``prefix + q``), made at its declaration;
  a message is one shmq message, its payload Dramatiq's encoding (``Message.encode``);
* ``enqueue(message, delay=ms)`` is one ``put(delay=seconds)``: shmq keeps a delayed message
  in the queue itself, out of sight until due, so there is no ``q.DQ`` delay queue (none is
  declared, and no worker holds delayed messages in memory or re-enqueues them);
* a consumer leases with ``get_many`` (up to the prefetch not yet settled, waiting in the
  broker up to Dramatiq's idle timeout: no polling); ``ack`` is shmq's ack, sent without
  waiting for the answer (over TCP it rides with the connection's next request);
* ``nack`` (Dramatiq: the message failed for good) is ``dead_letter()``: the message moves to
  ``q.dlq``, payload intact and its origin noted; the ``Retries`` middleware retries by
  enqueueing again with a delay, which is the ``put(delay=)`` above;
* ``requeue`` (a worker stopping) is shmq's nack: delivered again at once;
* a worker that dies (SIGKILL) gives its leases back, over TCP as its connection drops and
  co-located within the broker's reaper tick (0.25 s): its messages are delivered again.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

import dramatiq
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import ConnectionClosed, DecodeError, QueueJoinTimeout
from dramatiq.logging import get_logger
from dramatiq.middleware import Middleware

import shmq
from shmq import options
from shmq.dramatiq.link import Link, check_delay

#: the seconds a lease lasts unless settled (shmq's longest).  Dramatiq's own brokers never
#: take a message from a live worker, however long its actor runs; shmq gives a worker's
#: leases back at once when its connection drops or its process dies, so this is only the
#: backstop for a worker that is alive but stuck, and a long actor (queued behind others
#: in the worker's prefetch, too) is not run twice.
VISIBILITY_TIMEOUT = options.MAX_VISIBILITY_TIMEOUT
#: deliveries of one message (each lease given back counts: a worker killed while holding it,
#: a worker stopping with it prefetched) before shmq dead-letters it: Dramatiq retries by
#: enqueueing anew, so this only stops a message that keeps killing its workers.
MAX_DELIVERIES = 20
#: seconds ``enqueue`` waits for room in a full queue before it raises ``shmq.Full``
ENQUEUE_TIMEOUT = 30.0


class ShmqBroker(dramatiq.Broker):
    """A Dramatiq broker on shmq: ``ShmqBroker(url="tcp://127.0.0.1:7878")``.

    ``url``: as ``shmq.connect``'s (``tcp://``, ``tcps://``, ``unix://``, a fail-over list,
    or ``shm://INSTANCE`` for a worker on the broker's host, which attaches the instance
    ``shmq serve`` serves and never creates one); ``token``: as ``shmq.connect``'s.  It
    connects at once: a wrong token is ``shmq.AuthError`` here.  ``prefix``: put before
    each queue's name in shmq.  ``queue_options``: ``create_queue`` limits for the queues
    it makes (``capacity``, ``max_bytes``, ``max_message_size``, ``durability``, ...;
    by default ``visibility_timeout`` :data:`VISIBILITY_TIMEOUT` and ``max_deliveries``
    :data:`MAX_DELIVERIES`); ``visibility_timeout``: the seconds each lease lasts (every
    get asks for it, whatever the queue was made with); ``enqueue_timeout``: seconds an
    enqueue waits for room (then ``shmq.Full``).  Other keywords go to ``shmq.connect``.

    A message above the queue's ``max_message_size`` is ``shmq.MessageTooLarge`` at
    ``send``; a delay above a week is ``ValueError``."""

    def __init__(self, *, url: str = options.DEFAULT_URL, token: str | None = None,
                 middleware: list[Middleware] | None = None, prefix: str = "",
                 queue_options: dict[str, Any] | None = None,
                 visibility_timeout: float = VISIBILITY_TIMEOUT,
                 enqueue_timeout: float | None = ENQUEUE_TIMEOUT, **connect_options: Any) -> None:
        if not 0 < visibility_timeout <= options.MAX_VISIBILITY_TIMEOUT:
            raise ValueError(f"visibility_timeout must be in (0, {options.MAX_VISIBILITY_TIMEOUT:g}] s, "
                             f"not {visibility_timeout!r}")
        super().__init__(middleware=middleware)
        limits = {"visibility_timeout": visibility_timeout, "max_deliveries": MAX_DELIVERIES,
                  **(queue_options or {})}
        self.link = Link(url, token, connect_options, limits)
        self.prefix = prefix
        self.visibility_timeout = visibility_timeout
        self.enqueue_timeout = enqueue_timeout
        self.queues: set[str] = set()

    def __repr__(self) -> str:
        return f"ShmqBroker({self.link.url!r})"

    def close(self) -> None:
        """Close the connection: over TCP what it still leases goes back to the queues."""
        self.link.close()

    # ------------------------------------------------------------ declaring
    def declare_queue(self, queue_name: str) -> None:
        """Declare ``queue_name``: its shmq queue is made now if it is not there (idempotent).
        No delay queue is declared: delays are shmq's own."""
        if queue_name in self.queues:
            return
        self.emit_before("declare_queue", queue_name)
        self.link.queue(self.prefix + queue_name)
        self.queues.add(queue_name)
        self.emit_after("declare_queue", queue_name)

    def get_declared_queues(self) -> set[str]:
        return self.queues.copy()

    # ------------------------------------------------------------ producing
    def enqueue(self, message: dramatiq.Message[Any], *, delay: int | None = None) -> dramatiq.Message[Any]:
        """Put ``message`` on its queue, to be delivered after ``delay`` milliseconds (at
        most a week: ``ValueError``).  ``shmq.MessageTooLarge`` above the queue's
        ``max_message_size``, ``shmq.Full`` when the queue has no room within
        ``enqueue_timeout``, ``dramatiq.errors.ConnectionClosed`` when the broker cannot be
        reached (the put is tried once more on a new connection first)."""
        seconds = check_delay(delay)
        queue_name = message.queue_name
        if queue_name not in self.queues:
            self.declare_queue(queue_name)
        self.logger.debug("Enqueueing message %r on queue %r.", message.message_id, queue_name)
        self.emit_before("enqueue", message, delay)
        self.link.put(self.prefix + queue_name, message.encode(), timeout=self.enqueue_timeout, delay=seconds)
        self.emit_after("enqueue", message, delay)
        return message

    # ------------------------------------------------------------ consuming
    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> Consumer:
        """A consumer of ``queue_name`` that leases up to ``prefetch`` messages not yet
        settled and waits up to ``timeout`` ms for one before ``next`` gives None."""
        return _ShmqConsumer(self, queue_name, prefetch, timeout)

    # ------------------------------------------------------------ tests and operations
    def flush(self, queue_name: str) -> None:
        """Drop every message of ``queue_name``, delayed ones too, and of its dead-letter queue."""
        for name in (queue_name, queue_name + options.DLQ_SUFFIX):
            with contextlib.suppress(shmq.QueueNotFound):
                self.link.broker().queue(self.prefix + name).purge()

    def flush_all(self) -> None:
        """``flush`` every declared queue."""
        for queue_name in self.queues:
            self.flush(queue_name)

    def join(self, queue_name: str, *, timeout: int | None = None) -> None:
        """Wait until ``queue_name`` holds no message: none waiting, none delayed, none
        leased (every one acked or dead-lettered), by shmq's own counts.  Meant for tests.
        ``QueueJoinTimeout`` after ``timeout`` ms."""
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        q = self.link.queue(self.prefix + queue_name)
        pause = 0.001
        while True:
            g = q.stats()["groups"][options.DEFAULT_GROUP]
            if g["depth"] == 0 and g["in_flight"] == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(pause)  # another process's progress: looked at again, a little later each time
            pause = min(pause * 2, 0.05)

    def dead_letters(self, queue_name: str, max_messages: int = 1000) -> list[dramatiq.Message[Any]]:
        """Up to ``max_messages`` of the messages ``queue_name`` dead-lettered (its shmq
        queue ``<queue>.dlq``), oldest first, as Dramatiq messages; they stay there."""
        try:
            dlq = self.link.broker().queue(self.prefix + queue_name + options.DLQ_SUFFIX)
        except shmq.QueueNotFound:
            return []
        out: list[dramatiq.Message[Any]] = []
        offset = 0
        while len(out) < max_messages:
            got = dlq.read(offset, min(max_messages - len(out), options.MAX_BATCH))
            if not got:
                break
            out += [dramatiq.Message.decode(bytes(m.payload)) for m in got]
            offset = got[-1].offset + 1
        return out


class _ShmqProxy(MessageProxy):
    """A delivered message, with the shmq lease it settles."""

    def __init__(self, message: dramatiq.Message[Any], lease: shmq.Message, consumer: _ShmqConsumer,
                 generation: int) -> None:
        super().__init__(message)
        self._shmq_lease = lease
        self._shmq_consumer = consumer
        self._shmq_generation = generation


class _ShmqConsumer(Consumer):
    """Leases of one queue for a Dramatiq worker: ``next`` runs in its consumer thread,
    ``ack`` and ``nack`` in its worker threads (each settles through the message's own
    lease, so a message fetched by a consumer that was closed since is settled too)."""

    def __init__(self, broker: ShmqBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.logger = get_logger(__name__, type(self))
        self.link = broker.link
        self.queue_name = queue_name
        self.name = broker.prefix + queue_name  # its shmq queue
        self.prefetch = max(1, prefetch)
        self.timeout = max(0, timeout) / 1000
        self.visibility_timeout = broker.visibility_timeout
        self._fetched: deque[shmq.Message] = deque()  # leased, not handed out yet
        self._generation = self.link.generation  # the connection those leases are good on
        self._unsettled = 0  # handed out, not acked, nacked or requeued yet
        self._room = threading.Condition()
        self._waiting = False
        self._closed = False
        self.link.queue(self.name)  # made now if it is not there

    # ------------------------------------------------------------ the consumer thread
    def __next__(self) -> MessageProxy | None:
        while True:
            if not self._fetched and not self._fetch():
                return None
            lease = self._fetched.popleft()
            try:
                message = dramatiq.Message.decode(bytes(lease.payload))
            except DecodeError:
                self.logger.exception("Failed to decode message %d of queue %r: dead-lettered.",
                                      lease.offset, self.queue_name)
                self._settle(lease, self._generation, dead=True)
                continue
            with self._room:
                self._unsettled += 1
            return _ShmqProxy(message, lease, self, self._generation)

    def _fetch(self) -> bool:
        """Lease what the prefetch allows, waiting up to the timeout for the first message
        (or for room); False when nothing came."""
        room = self.prefetch - self._unsettled
        if room <= 0:
            with self._room:
                self._waiting = True
                self._room.wait_for(lambda: self._unsettled < self.prefetch, self.timeout)
                self._waiting = False
                room = self.prefetch - self._unsettled
            if room <= 0:
                return False
        link = self.link
        generation = link.generation
        try:
            got = link.queue(self.name).get_many(min(room, options.MAX_BATCH), timeout=self.timeout,
                                                 visibility_timeout=self.visibility_timeout)
        except shmq.Empty:
            return False
        except shmq.QueueNotFound:  # deleted under us: made again on the next call
            link.forget(self.name)
            return False
        except shmq.ConnectionLost as e:
            link.lost(generation)
            raise ConnectionClosed(e) from e
        self._generation = generation
        self._fetched.extend(got)
        return True

    # ------------------------------------------------------------ the worker threads
    def ack(self, message: MessageProxy) -> None:
        self._done(message, dead=False)

    def nack(self, message: MessageProxy) -> None:
        """Dramatiq's nack: the message failed for good; it goes to ``<queue>.dlq``."""
        self._done(message, dead=True)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Give messages handed out but not processed back: delivered again at once."""
        for message in messages:
            self._done(message, dead=False, back=True)

    def _done(self, message: MessageProxy, dead: bool, back: bool = False) -> None:
        assert isinstance(message, _ShmqProxy), message
        try:
            self._settle(message._shmq_lease, message._shmq_generation, dead, back)
        finally:
            message._shmq_consumer._settled()

    def _settled(self) -> None:
        with self._room:
            self._unsettled -= 1
            if self._waiting:
                self._room.notify()

    def _settle(self, lease: shmq.Message, generation: int, dead: bool, back: bool = False) -> None:
        """Ack, dead-letter or give back ``lease``.  Never raises: a lease lost with its
        connection or past its visibility timeout is the broker's again, which delivers the
        message again (at least once), and Dramatiq could do nothing better with an error."""
        link = self.link
        if generation != link.generation:
            self.logger.warning("Message %d of queue %r was leased on a connection since lost: the broker "
                                "delivers it again.", lease.offset, self.queue_name)
            return
        try:
            if dead:
                lease.dead_letter()
            elif back:
                lease.nack()
            else:
                lease.ack(wait=False)
        except shmq.StaleAck:
            self.logger.warning("The lease of message %d of queue %r ran out (visibility timeout %g s): "
                                "it was delivered again.", lease.offset, self.queue_name,
                                self.visibility_timeout)
        except shmq.ConnectionLost:  # (the consumer's next get finds out, and connects again)
            self.logger.warning("The connection was lost settling message %d of queue %r: the broker "
                                "delivers it again.", lease.offset, self.queue_name)
        except shmq.ShmqError:
            self.logger.exception("Failed to settle message %d of queue %r.", lease.offset, self.queue_name)

    def close(self) -> None:
        """Give back what was leased and not handed out; what was handed out is still
        settled when its worker thread is done with it."""
        if self._closed:
            return
        self._closed = True
        while self._fetched:
            self._settle(self._fetched.popleft(), self._generation, dead=False, back=True)
