"""Polling another process's state, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> None:
    """Poll a condition (for observing other processes, never as a substitute for a result)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)
