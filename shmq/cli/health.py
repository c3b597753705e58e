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
from typing import Any

from shmq.api import Broker
from shmq.errors import ShmqError


def check(connect: Callable[[], Broker], shm: str | None, timeout: float,
          about: list[dict[str, Any]] | None = None) -> str:
    """"" when the broker answers within ``timeout`` seconds, else why not.  ``about``: where a
    ready broker's ``info().replication`` goes, when it has one."""
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
                if about is not None and not shm:
                    repl = b.info().replication
                    if repl:
                        about.append(repl)
            finally:
                b.close()
            answer.append("")
        except (ShmqError, OSError) as e:
            answer.append(str(e) or type(e).__name__)

    t = threading.Thread(target=ask, name="shmq status", daemon=True)
    t.start()
    t.join(timeout)
    return answer[0] if answer else f"no answer within {timeout:g} s"


def replication_line(repl: dict[str, Any]) -> str:
    """A node's role, epoch and lag in words (``broker.info().replication``)."""
    if repl.get("role") == "standby":
        state = ("caught up" if repl.get("caught_up") else "catching up") if repl.get("connected") else (
            f"not connected: {repl.get('error') or 'connecting'}")
        return f"standby of {repl.get('primary')}, epoch {repl.get('epoch')}, {state}"
    standbys = repl.get("standbys") or []
    lags = "; ".join(f"{sb.get('node') or sb.get('peer')}: lag {sb.get('lag_records', 0)} messages, "
                     f"{sb.get('lag_bytes', 0)} bytes, {sb.get('lag_seconds', 0.0):g} s" for sb in standbys)
    n = len(standbys)
    line = f"primary, epoch {repl.get('epoch')}, {n} standby{'' if n == 1 else 's'}"
    return line + (f" ({lags})" if lags else "")


__all__ = ["check", "replication_line"]
