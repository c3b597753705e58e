"""The bindings kombu's exchanges route by, shared by every process of a broker.

kombu's virtual transports emulate exchanges in the client: a publish looks up the
queues bound to the exchange and puts a copy into each.  The in-memory transport keeps
that table in the process; so a queue bound in one process (a Celery worker's
``<host>.celery.pidbox`` on the fan-out exchange ``celery.pidbox``, a
``celery inspect``'s reply queue on ``reply.celery.pidbox``, an event receiver's queue on
the topic exchange ``celeryev``) would get nothing published by another.  Redis keeps the
table in Redis; shmq keeps it in a queue of its own, ``shmq-kombu.bindings``:

* each ``queue_bind`` appends a record ``{"op": "bind", "x": exchange, "t": type,
  "k": routing key, "q": queue}``; ``queue_unbind`` and a queue's deletion append
  ``"op": "unbind"`` records;
* a process folds the records, in order, into its table (:meth:`Bindings.table`).  It reads
  those it has not seen (one ``read`` from where it stopped) when its table is older than
  ``refresh`` seconds (``transport_options["binding_refresh"]``, default 1 s) when it
  publishes to an exchange, and at once when a publish finds no queue (a reply to a queue
  bound a moment ago): so a queue bound in another process gets what is published there
  within ``refresh`` seconds at the latest;
* the records are never consumed, only read: they stay until a process that read them
  all finds more than ``2 x live + COMPACT_SLACK`` of them, and compacts: it appends the
  live bindings again, then commits the default group past the old ones (``commit``),
  which frees them.  An unbind that lands while it does so is appended again after the
  copies, so the copies never bring back a binding that was taken away.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import shmq
from shmq import options
from shmq.api import ensure_queue
from shmq.kombu.naming import RESERVED

QUEUE = f"{RESERVED}.bindings"
LIMITS: dict[str, Any] = {"capacity": 65_536, "max_bytes": 16 * 1024 * 1024, "max_message_size": 4096}
COMPACT_SLACK = 512
_PAGE = 1000

Key = tuple[str, str, str]  # (exchange, routing key, queue)


def _record(op: str, exchange: str, type_: str, routing_key: str, queue: str) -> bytes:
    return json.dumps({"op": op, "x": exchange, "t": type_, "k": routing_key, "q": queue},
                      separators=(",", ":")).encode()


class Bindings:
    """One broker handle's view of the shared binding table (thread-safe)."""

    def __init__(self, broker: shmq.Broker, refresh: float = 1.0,
                 limits: dict[str, Any] | None = None) -> None:
        self.broker = broker
        self.refresh_interval = refresh
        self.limits = {**LIMITS, **(limits or {})}
        self._lock = threading.RLock()
        self._q: shmq.Queue | None = None
        self._live: dict[Key, str] = {}  # -> exchange type
        self._by_exchange: dict[str, dict[tuple[str, str], None]] = {}  # exchange -> (key, queue)s, in order
        self._types: dict[str, str] = {}  # exchange -> type, as the last record of it said
        self._next = 0  # the offset of the first record not read yet
        self._first = 0  # the first record retained when the table was (re)built
        self._read_at = -1e18  # monotonic time of the last read

    # ------------------------------------------------------------ reading
    def _queue(self) -> shmq.Queue:
        if self._q is None:
            try:
                self._q = self.broker.queue(QUEUE)
            except shmq.QueueNotFound:
                self._q = ensure_queue(self.broker, QUEUE, self.limits)
        return self._q

    def refresh(self, older_than: float | None = None) -> None:
        """Read the records not seen yet if the last read is older than ``older_than``
        seconds (default ``refresh``; 0: now)."""
        limit = self.refresh_interval if older_than is None else older_than
        with self._lock:
            now = time.monotonic()
            if now - self._read_at < limit:
                return
            self._read_at = now
            self._read()

    def _read(self) -> None:
        q = self._queue()
        while True:
            try:
                msgs = q.read(self._next, _PAGE)
            except shmq.QueueNotFound:  # deleted (a broker restarted with memory queues): start over
                self._q, self._next = None, 0
                self._clear()
                return
            if not msgs:
                break
            if msgs[0].offset > self._next and self._next > self._first:  # compacted past us: start over
                self._clear()
                self._next = self._first = 0
                continue
            if self._next == 0:
                self._first = msgs[0].offset
            for m in msgs:
                self._apply(m.payload)
            self._next = msgs[-1].offset + 1
            if len(msgs) < _PAGE:
                break
        if self._next - self._first > 2 * len(self._live) + COMPACT_SLACK:
            self._compact(q)

    def _apply(self, payload: Any) -> None:
        try:
            r = json.loads(bytes(payload))
            key = (r["x"], r["k"], r["q"])
        except (ValueError, KeyError, TypeError):
            return  # not a record of ours
        if r.get("op") == "bind":
            self._add(key, r.get("t") or "direct")
        else:
            self._drop(key)

    def _add(self, key: Key, type_: str) -> None:
        self._live[key] = type_
        self._types[key[0]] = type_
        self._by_exchange.setdefault(key[0], {})[key[1:]] = None

    def _drop(self, key: Key) -> None:
        if self._live.pop(key, None) is not None:
            self._by_exchange[key[0]].pop(key[1:], None)

    def _clear(self) -> None:
        self._live.clear()
        self._types.clear()
        self._by_exchange.clear()

    def _compact(self, q: shmq.Queue) -> None:
        upto = self._next
        live = list(self._live.items())
        if live:
            records = [_record("bind", x, t, k, qn) for (x, k, qn), t in live]
            first = q.put_many(records[:_PAGE])[0]
            for i in range(_PAGE, len(records), _PAGE):
                q.put_many(records[i:i + _PAGE])
            again = [m for m in q.read(upto, max(first - upto, 1)) if m.offset < first]
            undo = []
            for m in again:  # unbinds that landed meanwhile: after the copies too
                try:
                    r = json.loads(bytes(m.payload))
                except ValueError:
                    continue
                if r.get("op") == "unbind" and (r["x"], r["k"], r["q"]) in self._live:
                    undo.append(bytes(m.payload))
            if undo:
                q.put_many(undo)
        try:
            q.commit(options.DEFAULT_GROUP, upto)
        except shmq.ShmqError:  # another process compacted further meanwhile
            pass
        self._first = upto

    # ------------------------------------------------------------ writing
    def bind(self, exchange: str, type_: str, routing_key: str, queue: str) -> None:
        with self._lock:
            key = (exchange, routing_key, queue)
            if self._live.get(key) == type_:
                self.refresh(0)  # (another process may have taken it back since this view read)
                if self._live.get(key) == type_:
                    return  # known already: no record more
            self._queue().put(_record("bind", exchange, type_, routing_key, queue))
            self._add(key, type_)

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        with self._lock:
            self.refresh(0)
            if (exchange, routing_key, queue) in self._live:
                self._queue().put(_record("unbind", exchange, "", routing_key, queue))
                self._drop((exchange, routing_key, queue))

    def unbind_queue(self, queue: str) -> None:
        """Take back every binding of ``queue`` (it was deleted)."""
        with self._lock:
            self.refresh(0)
            keys = [k for k in self._live if k[2] == queue]
            if keys:
                self._queue().put_many([_record("unbind", x, "", k, qn) for x, k, qn in keys])
                for key in keys:
                    self._drop(key)

    # ------------------------------------------------------------ looking up
    def table(self, exchange: str) -> list[tuple[str, str]]:
        """The (routing key, queue) pairs bound to ``exchange``."""
        with self._lock:
            return list(self._by_exchange.get(exchange, ()))

    def __len__(self) -> int:
        """How many bindings are live (as far as this view has read)."""
        with self._lock:
            return len(self._live)

    def type_of(self, exchange: str) -> str | None:
        with self._lock:
            return self._types.get(exchange)
