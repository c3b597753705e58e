"""What one broker worker knows, apart from its event loop and sockets.

:class:`Core` holds the worker's shared state: the instance (``ServerBroker``),
the requests parked per queue, the subscriptions per queue, and the replies held
for the journal.  The request handlers (``handlers``, ``parking``, ``leasing``)
work on it and on one :class:`~shmq.server.connection.ServerConnection`; the
worker (``worker``, ``driver``) adds the event loop, the listening socket, the
doorbell and placement.  Nothing here does I/O, so tests drive a ``Core`` in
memory (``tests/server/test_handlers.py``)::

    worker.py (process, loop, doorbell, placement)
       └─ driver.py (asyncio.Protocol: bytes in and out, timers)
            └─ handlers.py (dispatch; settle, admin, subscriptions)
                 └─ parking.py (produce and consume, waiting for their queue)
                      └─ leasing.py (leasing messages out: replies and pushes)
                           └─ core.py (this) · connection.py · marks.py
                                └─ shmq.core.serverqueue, shmq.core.durability
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from shmq import crashpoints, options
from shmq.core.durability import Mark, Marks
from shmq.core.serverqueue import ServerBroker, ServerQueue
from shmq.errors import ShmqError
from shmq.protocol.codec import Frame

from .connection import ServerConnection, Subscription
from .marks import HeldReplies, Post
from .placement import Counts
from .scoreboard import WorkerMeter

SERVER_NAME = "shmq/0.1"

@dataclass(slots=True, eq=False)
class Waiter:
    """A parked request: a CONSUME / CONSUME_BATCH / PRODUCE* that waits for its queue."""

    conn: ServerConnection
    frame: Frame
    fields: dict[str, Any]
    deadline: float | None  # monotonic s; None: for ever


def _noop(_name: str) -> None:
    pass


class Core:
    """One worker's state (see the module docstring).

    ``post`` runs a callable on the worker's event loop thread (held replies are
    released there); ``flag(queue)`` asks to be rung when a message arrives in a
    queue something waits on (``shmq.core.doorbell``); ``place(conn, frame, affinity)``
    may hand a new connection to another worker (True when it went); ``clock``
    is monotonic seconds, for the deadlines of parked requests; ``counts`` is every
    worker's connection count (``placement.Counts``; None: not known, as in tests)."""

    def __init__(self, broker: ServerBroker, worker_id: int = 0, token: str = "", *,
                 post: Post | None = None, flag: Callable[[str], None] = _noop,
                 place: Callable[[ServerConnection, Frame, str], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic, heartbeat: float = options.HEARTBEAT,
                 meter: WorkerMeter | None = None, counts: Counts | None = None,
                 replication: Callable[[], dict[str, Any]] | None = None) -> None:
        self.broker = broker
        self.replication = replication  # what INFO says of replication (server.replication.Board)
        self.meter = meter  # --metrics: requests and their time, counted per operation (server.scoreboard)
        self.counts = counts  # every worker's connections (INFO)
        self.heartbeat = heartbeat  # s: the longest heartbeat interval this worker agrees to (0: none)
        self.worker_id = worker_id
        self.token = token
        self.flag = flag
        self.place = place
        self.clock = clock
        self.stopping = False  # a graceful stop: nothing new parks
        self.waiters: dict[str, list[Waiter]] = {}  # queue -> parked requests, in arrival order
        self.subs: dict[str, list[Subscription]] = {}  # queue -> subscriptions, next to push first
        self.held = HeldReplies(post or _call)
        self.auth_failures: dict[str, deque[float]] = {}  # peer -> times of its recent failed handshakes

    # ------------------------------------------------------------ failed handshakes
    def auth_wait(self, peer: str) -> float:
        """Seconds before ``peer`` may try a handshake again (0: now).  A peer with
        ``options.AUTH_FAILURES_MAX`` failures in the last ``AUTH_FAILURE_WINDOW`` seconds
        is refused without its token being looked at, until the oldest falls out."""
        times = self.auth_failures.get(peer)
        if not times:
            return 0.0
        now = self.clock()
        while times and now - times[0] >= options.AUTH_FAILURE_WINDOW:
            times.popleft()
        if not times:
            del self.auth_failures[peer]
            return 0.0
        if len(times) < options.AUTH_FAILURES_MAX:
            return 0.0
        return times[0] + options.AUTH_FAILURE_WINDOW - now

    def auth_failed(self, peer: str) -> int:
        """Count a failed handshake of ``peer``; its failures in the window."""
        if len(self.auth_failures) >= options.MAX_CONNECTIONS and peer not in self.auth_failures:
            self.auth_failures.pop(next(iter(self.auth_failures)))  # bounded: the oldest peer goes
        times = self.auth_failures.setdefault(peer, deque())
        times.append(self.clock())
        while len(times) > options.AUTH_FAILURES_MAX:
            times.popleft()
        return len(times)

    def connection(self, sink: Callable[[bytes], None] | None = None, placed: bool = False
                   ) -> ServerConnection:
        """A new connection's protocol state."""
        return ServerConnection(self.token, sink, placed)

    def queue(self, name: str) -> ServerQueue:
        return self.broker.queue(name)

    # ------------------------------------------------------------ replies
    def answer(self, conn: ServerConnection, msg_id: int, data: bytes, mark: Mark | Marks | None) -> None:
        """Send the reply ``data`` now, or once the journal has what it confirms (``mark``)."""
        if mark is None or mark.reached():
            conn.send(data)
        else:
            self.held.after(mark, conn, partial(_send_or_fail, conn, data, msg_id))

    # ------------------------------------------------------------ parked requests, subscriptions
    def park(self, name: str, waiter: Waiter) -> None:
        self.waiters.setdefault(name, []).append(waiter)
        self.flag(name)

    def add_sub(self, s: Subscription) -> None:
        s.conn.subs[s.sub_id] = s
        self.subs.setdefault(s.queue, []).append(s)
        self.flag(s.queue)

    def drop_sub(self, s: Subscription) -> None:
        """A subscription ended (unsubscribed, or its connection closed).  The queue's entry
        goes with its last subscription: the tick flags every queue in ``subs``, and a
        stale empty entry would keep this worker rung by every put there for good."""
        lst = self.subs.get(s.queue)
        if lst is not None and s in lst:
            lst.remove(s)
            if not lst:
                del self.subs[s.queue]

    def rotate(self, s: Subscription) -> None:
        """``s`` was just pushed to: the next subscriber of its queue goes first next time."""
        lst = self.subs.get(s.queue)
        if lst and s in lst:
            lst.remove(s)
            lst.append(s)

    # ------------------------------------------------------------ connections going
    def give_back(self, conn: ServerConnection) -> set[str]:
        """Return every lease ``conn`` holds to its queue, at once; the queues touched."""
        touched = set()
        for q, ref, leases in conn.leases.drain():
            try:
                if q.give_back(ref, list(leases), list(leases.values())):
                    touched.add(q.name)
            except ShmqError:
                pass  # the queue is gone (leases expired and taken back already are skipped)
            if crashpoints.active:
                crashpoints.hit("worker.give_back.queue")
        return touched

    def release(self, conn: ServerConnection) -> set[str]:
        """``conn`` closes: its subscriptions end and its leases go back; the queues touched
        (the caller retries what waits on them).  Its parked requests are dropped as
        they come up (they see it closed)."""
        for s in conn.subs.values():
            self.drop_sub(s)
        conn.subs.clear()
        touched = self.give_back(conn)
        self.drop_reply_queues(conn)
        return touched

    def drop_reply_queues(self, conn: ServerConnection) -> None:
        """Delete the reply queues ``conn`` made (``names.is_reply_name``): they go with it."""
        for name in conn.reply_queues:
            try:
                self.broker.delete_queue(name)
            except ShmqError:
                pass  # deleted already (by the client, at its close)
        conn.reply_queues.clear()


def _call(fn: Callable[..., object], *args: Any) -> None:
    fn(*args)


def _send_or_fail(conn: ServerConnection, data: bytes, msg_id: int, err: ShmqError | None) -> None:
    if err is None:
        conn.send(data)
    else:
        conn.error(msg_id, err.code, str(err))
