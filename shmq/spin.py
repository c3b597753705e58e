"""Polling before sleeping: how long a waiter spins, and when it does not bother.

A loopback round trip costs less in work than in wake-ups: a process asleep in ``recv``
or ``epoll_wait`` is woken by the kernel, and on a virtual machine each wake-up costs
tens of microseconds (docs/benchmarks.md measures a bare Python socket's round trip at
about 100 µs with both ends asleep, 25 µs with one end polling).  A waiter that polls
its socket for a while instead of sleeping is still running when its answer comes.

:class:`Spin` is the policy both ends share -- the blocking TCP client
(:func:`recv_into`, used by ``shmq.client.tcp``) and each broker worker (``server.spinner``):

* poll for at most ``spin_us`` microseconds, giving the core to anyone else runnable
  between two polls (``sched_yield``), so a spinner never starves the process it waits
  for on a busy machine;
* after a poll that ran its whole window and found nothing, sleep at once for the next
  ``backoff`` waits: a waiter whose answers come slower than the window (large batches,
  an idle queue, a consumer waiting for messages) pays at most one window in
  ``backoff + 1`` waits;
* ``spin_us = 0`` never polls.

The clock is a parameter, so tests drive the window without waiting.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from shmq import options
from shmq.errors import InvalidArgument

MSG_DONTWAIT = socket.MSG_DONTWAIT


def check_spin_us(spin_us: float, what: str = "spin_us") -> float:
    """``spin_us`` if it is a number of microseconds in [0, MAX_SPIN_US], else InvalidArgument."""
    if isinstance(spin_us, bool) or not isinstance(spin_us, (int, float)) or not (
            0 <= spin_us <= options.MAX_SPIN_US):
        raise InvalidArgument(f"{what} must be a number of microseconds in [0, {options.MAX_SPIN_US:g}] "
                              f"(0: never poll), not {spin_us!r}")
    return float(spin_us)


class Spin:
    """One waiter's polling policy: a broker handle's (used by whichever thread reads its
    socket, one at a time) or a worker loop's."""

    __slots__ = ("window", "backoff", "clock", "skip")

    def __init__(self, spin_us: float, backoff: int = options.SPIN_BACKOFF,
                 clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.window = int(check_spin_us(spin_us) * 1000)  # ns
        self.backoff = backoff
        self.clock = clock
        self.skip = 0  # waits left that sleep at once

    def deadline(self) -> int:
        """When a wait that starts now stops polling (the clock's ns); 0: sleep at once."""
        if not self.window:
            return 0
        if self.skip:
            self.skip -= 1
            return 0
        return self.clock() + self.window

    def missed(self) -> None:
        """A poll ran its whole window and found nothing: the next waits sleep at once."""
        self.skip = self.backoff


def recv_into(sock: Any, buf: bytearray, spin: Spin) -> int:
    """``sock.recv_into(buf)``, polling first as ``spin`` says (``sock``: a blocking socket,
    without a timeout, that takes ``MSG_DONTWAIT``; a TLS stream does not)."""
    deadline = spin.deadline()
    if deadline:
        clock = spin.clock
        while True:
            try:
                return sock.recv_into(buf, 0, MSG_DONTWAIT)  # type: ignore[no-any-return]
            except BlockingIOError:
                if clock() >= deadline:
                    spin.missed()
                    break
                os.sched_yield()
    return sock.recv_into(buf)  # type: ignore[no-any-return]
