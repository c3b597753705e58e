"""Messages spaced in time, and times between them, for the tests of seek by time."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from tests.support.wait import wait_until


def spaced(q: Any, n: int) -> list[int]:
    """Produce ``n`` messages at least a millisecond apart (so a time between two of them is
    exact in a float); their producer timestamps, in ns, as the queue holds them."""
    first = q.offsets()[1] if hasattr(q, "offsets") else q.stats()["next_offset"]
    for i in range(n):
        q.put(b"m%d" % i)
        wait_until(partial(_past, time.time_ns() + 1_000_000))  # the clock moved on (not a sync)
    msgs = q.read(first, n)
    assert [m.offset for m in msgs] == list(range(first, first + n))
    stamps = [m.timestamp_ns for m in msgs]
    assert stamps == sorted(stamps) and len(set(stamps)) == n
    return stamps


def _past(ns: int) -> bool:
    return time.time_ns() > ns


def between(stamps: list[int], i: int) -> float:
    """A time (s) after message i-1 and before message i."""
    return (stamps[i - 1] + stamps[i]) / 2e9
