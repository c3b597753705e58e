"""A worker's event loop kept polling for a while after each read (``shmq.spin``'s policy).

A request that arrives while the worker sleeps in ``epoll_wait`` waits for the kernel to
wake it.  After each read the :class:`Spinner` keeps one callback in the loop's ready
queue for ``--spin-us``: while a callback is ready, the loop polls its sockets without
sleeping, so the client's next request is read as it comes.  Timers and other sockets
are served as usual in between (the callback is one turn of the loop, and yields the
core).  A window in which nothing was read makes the next ``SPIN_BACKOFF`` reads start
none: an idle or slow peer costs the worker at most one window in ``SPIN_BACKOFF + 1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from shmq.spin import Spin


class Spinner:
    __slots__ = ("spin", "call_soon", "until", "reads")

    def __init__(self, spin: Spin, call_soon: Callable[[Callable[[], Any]], Any]) -> None:
        self.spin = spin
        self.call_soon = call_soon  # the loop's
        self.until = 0  # the clock's ns at which the window ends; 0: not polling
        self.reads = 0  # reads during the window

    def read(self) -> None:
        """The worker read a request (any connection's): poll for the next one."""
        if self.until:
            self.reads += 1
            self.until = self.spin.clock() + self.spin.window
            return
        until = self.spin.deadline()
        if until:
            self.until, self.reads = until, 0
            self.call_soon(self._poll)

    def _poll(self) -> None:
        if self.spin.clock() < self.until:
            os.sched_yield()
            self.call_soon(self._poll)
            return
        self.until = 0
        if not self.reads:
            self.spin.missed()
