"""Publisher confirms: a producer's puts and batches started without waiting for each
confirmation, collected later in order (``Queue.publisher()``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from shmq import options
from shmq.errors import InvalidArgument, ShmqError


class Publishing(Protocol):
    """What a Publisher needs of a queue (``api.Queue`` has it): each put started, its
    confirmation waited for apart.  Payloads and headers go through as ``Queue.put`` and
    ``Queue.put_many`` take them, and are checked there."""

    name: str

    def _publish(self, payload: Any, block: bool, timeout: float | None, headers: Any = None,
                 delay: float | None = None, ttl: float | None = None) -> Any: ...

    def _confirm(self, token: Any) -> int: ...

    def _publish_many(self, payloads: Sequence[Any], block: bool, timeout: float | None, headers: Any = None,
                      delay: float | None = None, ttl: float | None = None) -> Any: ...

    def _confirm_many(self, token: Any) -> list[int]: ...


class Publisher:
    """Publisher confirms: puts and batches without a round trip waited for each.

    ``put()`` and ``put_many()`` start the put and return; the confirmation (the offset,
    or the error ``Queue.put`` / ``Queue.put_many`` would have raised) is collected
    later.  At most ``window`` messages are unconfirmed at once: a call that would
    exceed it first waits for the oldest (a batch larger than the window waits until
    nothing else is pending, then goes alone).  ``flush()`` waits for all.  A
    confirmation means what ``Queue.put`` returning means for the queue's durability
    policy (with ``always``: the record is fsynced), so nothing is confirmed early; only
    the waiting is overlapped, like RabbitMQ's publisher confirms or a Kafka producer.

    Puts are stored in the order they were made (over TCP too, also while the queue is
    full and puts wait for room).  A failed put raises its error (``Full`` after
    ``timeout``, ``StorageError``, ...) from the call or ``flush()`` that collected it,
    with ``error.index`` set to that put's number (0 for this publisher's first
    message; a batch fails whole, numbered by its first message); the puts after it are
    unaffected and are still confirmed.  Use a ``with`` block, or call ``flush()``
    before relying on what was sent.

        with q.publisher(window=256) as p:
            for line in lines:
                p.put(line)
        # here every line is confirmed (or an error was raised)
    """

    def __init__(self, queue: Publishing, window: int = options.DEFAULT_PUBLISH_WINDOW, block: bool = True,
                 timeout: float | None = None) -> None:
        if not isinstance(window, int) or not 1 <= window <= options.MAX_PUBLISH_WINDOW:
            raise InvalidArgument(f"window must be 1..{options.MAX_PUBLISH_WINDOW}, not {window!r}")
        self.queue = queue
        self.window = window
        self._block = block
        self._timeout = timeout
        # (number of the first message, messages, transport token, a batch?), oldest first
        self._pending: deque[tuple[int, int, Any, bool]] = deque()
        self._unconfirmed = 0  # messages in _pending
        self.sent = 0  # messages started
        self.confirmed = 0  # messages confirmed
        self.failed = 0  # messages whose error was raised
        self.last_offset = -1  # the offset of the latest confirmed message

    @property
    def pending(self) -> int:
        """Messages started and not yet confirmed."""
        return self._unconfirmed

    def put(self, payload: Any, headers: Any = None, *, delay: float | None = None,
            ttl: float | None = None) -> None:
        """Start one put; ``headers``, ``delay`` and ``ttl`` as for ``Queue.put`` (checked
        here: a bad one raises at once, and nothing is sent)."""
        while self._unconfirmed >= self.window:
            self._collect()
        token = self.queue._publish(payload, self._block, self._timeout, headers, delay, ttl)
        self._started(1, token, False)

    def put_many(self, payloads: Sequence[Any], headers: Any = None, *,
                 delay: float | None = None, ttl: float | None = None) -> None:
        """Start one atomic batch, as ``Queue.put_many`` stores it (``headers``: one mapping
        or None per payload; ``delay``, ``ttl``: for each; all checked here).  It counts
        ``len(payloads)`` messages in the window and is confirmed, or fails, whole."""
        n = len(payloads)
        if not n:
            return
        while self._pending and self._unconfirmed + n > self.window:
            self._collect()
        token = self.queue._publish_many(payloads, self._block, self._timeout, headers, delay, ttl)
        self._started(n, token, True)

    def _started(self, n: int, token: Any, many: bool) -> None:
        self._pending.append((self.sent, n, token, many))
        self._unconfirmed += n
        self.sent += n

    def flush(self) -> None:
        """Wait until every put so far is confirmed (raises the first error met; call
        again to go on collecting the rest)."""
        while self._pending:
            self._collect()

    def _collect(self) -> None:
        index, n, token, many = self._pending.popleft()
        self._unconfirmed -= n
        try:
            if many:
                self.last_offset = self.queue._confirm_many(token)[-1]
            else:
                self.last_offset = self.queue._confirm(token)
        except ShmqError as e:
            self.failed += n
            e.index = index  # type: ignore[attr-defined]
            raise
        self.confirmed += n

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.flush()

    def __repr__(self) -> str:
        return (f"Publisher({self.queue.name!r}, window={self.window}, sent={self.sent}, "
                f"confirmed={self.confirmed}, failed={self.failed})")
