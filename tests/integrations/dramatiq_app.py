"""The actors a real ``dramatiq`` worker process runs in tests/integrations/test_dramatiq.py:
``python -m dramatiq tests.integrations.dramatiq_app``.  The broker's URL, token and queue
prefix come from the environment; each actor reports what it did to the shmq queue ``done``
(``<prefix>done``), so the test sees every message's fate."""

from __future__ import annotations

import os
import threading

import dramatiq

import shmq
from shmq.dramatiq import ShmqBroker

broker = ShmqBroker(url=os.environ["SHMQ_DRAMATIQ_URL"], token=os.environ.get("SHMQ_DRAMATIQ_TOKEN"),
                    prefix=os.environ.get("SHMQ_DRAMATIQ_PREFIX", ""))
dramatiq.set_broker(broker)
_never = threading.Event()


def done() -> shmq.Queue:
    """The queue the actors report to (made by the test)."""
    return broker.link.queue(broker.prefix + "done")


@dramatiq.actor(queue_name="squares", max_retries=0)
def square(i: int) -> None:
    done().put(f"{i}:{i * i}:{os.getpid()}")


@dramatiq.actor(queue_name="held", max_retries=0)
def held(i: int) -> None:
    """Reports that it started; with ``SHMQ_DRAMATIQ_HOLD=1`` it then never finishes (the
    test SIGKILLs the worker holding it)."""
    done().put(f"{i}:{os.getpid()}")
    if os.environ.get("SHMQ_DRAMATIQ_HOLD") == "1":
        _never.wait()
