"""Every test of shmq.mp leaves none of its queues behind: a queue this process made is
gone once the test let go of it (and every child that held it has ended)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from tests.support.instances import leftovers


@pytest.fixture(autouse=True)
def no_queue_left() -> Iterator[None]:
    yield
    gc.collect()  # a queue dropped by the test is let go of when it is collected
    assert leftovers(f"mp-{os.getpid()}-") == []
