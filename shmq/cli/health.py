"""Is a broker up?  The check behind ``shmq status``, a service manager's health check.

A broker is *ready* when it answers: a handshake and a cheap request (``list_queues``)
over the connection the CLI would use.  For ``--shm INSTANCE``, when a live ``shmq
serve`` holds the instance's broker lock (and only then is the shared memory attached:
asking never creates an instance).  The answer comes within the timeout whatever the
other end does: the asking runs in a daemon thread that is left behind if it hangs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from shmq.api import Broker
from shmq.errors import ShmqError


def check(connect: Callable[[], Broker], shm: str | None, timeout: float) -> str:
    """"" when the broker answers within ``timeout`` seconds, else why not."""
    answer: list[str] = []

    def ask() -> None:
        try:
            if shm:
                from shmq.server.brokerlock import is_served
                if not is_served(shm):
                    answer.append(f"no broker serves instance {shm!r}")
                    return
            b = connect()
            try:
                b.list_queues()
            finally:
                b.close()
            answer.append("")
        except (ShmqError, OSError) as e:
            answer.append(str(e) or type(e).__name__)

    t = threading.Thread(target=ask, name="shmq status", daemon=True)
    t.start()
    t.join(timeout)
    return answer[0] if answer else f"no answer within {timeout:g} s"


__all__ = ["check"]
