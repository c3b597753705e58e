"""One shmq broker handle for a process's threads: what the Dramatiq broker and the result
backend talk through.

It connects at once, so a bad URL or a wrong token fails where the broker is made; again in
a forked child (a handle is never shared across a fork), and again after its connection was
lost (:meth:`Link.lost`).  Queue handles are kept per connection; a queue that is not there
(yet, or any more: a broker restarted without a journal) is created with the limits given."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

from dramatiq.errors import ConnectionClosed

import shmq
from shmq import options
from shmq.api import ensure_queue


class Link:
    """A shared shmq broker handle, made again after a fork or a lost connection."""

    def __init__(self, url: str, token: str | None, connect_options: dict[str, Any],
                 limits: dict[str, Any]) -> None:
        """``limits``: ``create_queue``'s keywords for the queues made here (unless a call
        names others)."""
        self.url = url
        self._token = token
        self._connect_options = dict(connect_options)
        self._limits = dict(limits)
        self._lock = threading.Lock()
        self._broker: shmq.Broker | None = None
        self._pid = 0
        self._queues: dict[str, shmq.Queue] = {}
        self.generation = 0  # one more per connection made: a lease is only good on its own
        self.broker()

    def _connect(self) -> shmq.Broker:
        if self.url.startswith("shm://"):  # co-located: attach the instance a broker serves, never make one
            return shmq.connect(self.url, create=False, **self._connect_options)
        return shmq.connect(self.url, token=self._token, **self._connect_options)

    def broker(self) -> shmq.Broker:
        """The handle of this process's current connection (made now when there is none)."""
        b = self._broker
        if b is not None and self._pid == os.getpid():
            return b
        with self._lock:
            if self._broker is None or self._pid != os.getpid():
                # after a fork the parent's handle is left alone: closing it here would end the
                # parent's connection (its leases with it)
                self._broker = self._connect()
                self._pid = os.getpid()
                self._queues = {}
                self.generation += 1
            return self._broker

    def queue(self, name: str, limits: dict[str, Any] | None = None) -> shmq.Queue:
        """A handle on shmq queue ``name``, created with the link's limits (or ``limits``)
        if it is not there."""
        q = self._queues.get(name)
        if q is not None and self._pid == os.getpid():
            return q
        b = self.broker()
        q = ensure_queue(b, name, self._limits if limits is None else limits)
        if b is self._broker:
            self._queues[name] = q
        return q

    def put(self, name: str, data: bytes, limits: dict[str, Any] | None = None, **put_options: Any) -> None:
        """``put`` to queue ``name``, tried once more when the queue was not found
        (it is made again) or the connection was lost (on a new one: so a message may be
        stored twice, at least once).  ``dramatiq.errors.ConnectionClosed`` when the second
        try finds no broker either; the put's own errors (``MessageTooLarge``, ``Full``) as
        they are."""
        for attempt in (1, 2):
            generation = self.generation
            try:
                self.queue(name, limits).put(data, **put_options)
                return
            except shmq.QueueNotFound:  # deleted, or a broker restarted without a journal
                self.forget(name)
                if attempt == 2:
                    raise
            except shmq.ConnectionLost as e:
                self.lost(generation)
                if attempt == 2:
                    raise ConnectionClosed(e) from e

    def forget(self, name: str) -> None:
        """Queue ``name`` was not found: the next :meth:`queue` makes it again."""
        self._queues.pop(name, None)

    def lost(self, generation: int) -> None:
        """Connection ``generation`` was lost: the next call connects again (unless that
        happened already).  Its leases are gone: the broker delivers their messages again."""
        with self._lock:
            if self.generation == generation and self._broker is not None and self._pid == os.getpid():
                b, self._broker = self._broker, None
                self._queues = {}
                with contextlib.suppress(shmq.ShmqError, OSError):
                    b.close()

    def close(self) -> None:
        """Close this process's connection (over TCP its leases go back to the broker)."""
        with self._lock:
            b, self._broker = self._broker, None
            self._queues = {}
            if b is not None and self._pid == os.getpid():
                b.close()


def check_delay(delay_ms: int | float | None) -> float | None:
    """Dramatiq's ``delay`` (milliseconds) as shmq's (seconds); ``ValueError`` past shmq's
    longest (``options.MAX_DELAY``, a week) or below 0."""
    if delay_ms is None:
        return None
    seconds = delay_ms / 1000
    if not 0 <= seconds <= options.MAX_DELAY:
        raise ValueError(f"delay must be 0 to {int(options.MAX_DELAY * 1000)} ms (a week), not {delay_ms!r}")
    return seconds
