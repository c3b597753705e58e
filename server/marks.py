"""Replies held until the journal has what they confirm (``always`` queues).

A handler that changes an ``always`` queue gets a :class:`~shmq.core.durability.Mark`
back from ``shmq.core.serverqueue`` instead of waiting for it (the event loop must
not block).  It hands the reply to :meth:`HeldReplies.after`; one thread per
queue and mark word waits for the lowest value held, and each time the mark
moves, every reply it covers is released together: on the event loop (``post``),
one write per connection.  A journal that cannot be written fails every reply
held on that queue with its error instead.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from shmq.core.durability import Mark, Marks
from shmq.errors import ShmqError

from .connection import ServerConnection

log = logging.getLogger("shmq.worker")
Done = Callable[[ShmqError | None], None]  # sends a held reply (or the error that replaces it)
Post = Callable[..., object]  # runs a callable on the event loop's thread (loop.call_soon_threadsafe)


@dataclass(slots=True, eq=False)
class _Waiting:
    """The replies held on one queue's mark word: a heap of (value, tie, conn, done)."""

    mark: Mark  # the lowest held when the thread started (its queue and word)
    held: list[tuple[int, int, ServerConnection, Done]]


class HeldReplies:
    """Every reply of one worker held for a durable mark."""

    def __init__(self, post: Post) -> None:
        self._post = post
        self._waiting: dict[tuple[int, int], _Waiting] = {}  # (id of the Durability, word) -> replies
        self._lock = threading.Lock()
        self._tie = itertools.count()  # ties in the heap never compare the callbacks

    def after(self, mark: Mark | Marks, conn: ServerConnection, done: Done) -> None:
        """Call ``done`` on the loop once ``mark`` is reached (it sends ``conn`` a reply);
        ``Marks`` (a change in several queues): once each is, waited for one after the other."""
        if isinstance(mark, Marks):
            pending = [m for m in mark if not m.reached()]
            if not pending:
                done(None)
            elif len(pending) == 1:
                self.after(pending[0], conn, done)
            else:
                rest = Marks(pending[1:])
                self.after(pending[0], conn,
                           lambda err: done(err) if err is not None else self.after(rest, conn, done))
            return
        key = (id(mark.durability), mark.word)  # the _Waiting keeps it alive: the id is not reused
        with self._lock:
            mw = self._waiting.get(key)
            start = mw is None
            if mw is None:
                mw = self._waiting[key] = _Waiting(mark, [])
            heapq.heappush(mw.held, (mark.value, next(self._tie), conn, done))
        if start:
            threading.Thread(target=self._wait, args=(key, mw), daemon=True,
                             name=f"durable-{mark.durability.name}").start()

    def _wait(self, key: tuple[int, int], mw: _Waiting) -> None:
        dur, word = mw.mark.durability, mw.mark.word
        while True:
            with self._lock:
                if not mw.held:
                    del self._waiting[key]
                    return
                target = mw.held[0][0]
            err: ShmqError | None = None
            reached = 0
            try:  # (a settle mark is waived while the journal cannot write: every held reply goes)
                reached = dur.wait(word, target, None)
            except ShmqError as e:
                err = e  # the journal cannot write, or the queue is gone: every held reply fails
            except Exception as e:  # noqa: BLE001 - a reply must never be lost silently
                log.error("waiting for %s's durable mark failed", dur.name, exc_info=e)  # (INTERNAL)
                err = ShmqError(repr(e))
            with self._lock:
                ready = []
                while mw.held and (err is not None or mw.held[0][0] <= reached):
                    _, _, conn, done = heapq.heappop(mw.held)
                    ready.append((conn, done))
            self._post(release, ready, err)


def release(ready: list[tuple[ServerConnection, Done]], err: ShmqError | None) -> None:
    """Send the replies whose mark was reached: one write per connection."""
    holding = [conn for conn, _ in ready if conn.hold()]
    for _, done in ready:
        done(err)
    for conn in holding:
        conn.flush()
