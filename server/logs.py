"""One logging set-up for every process of a broker: the supervisor, its workers and its
journal writer.

Each process calls ``setup(role, level, fmt)`` once, first thing (a forked child again,
with its own role), and then logs through ``logging.getLogger("shmq.<something>")``.
Every line goes to stderr and names the process's role and pid:

* ``text`` (default): ``shmq supervisor[1234] WARNING: worker 1 (pid 1240) exited with -9; restarting``
* ``json``: one object a line, with ``time``, ``level``, ``role``, ``pid``, ``logger`` and
  ``message`` (and ``exception`` when there is one)
"""

from __future__ import annotations

import json
import logging
import sys
import time

from shmq import options

LEVELS = options.LOG_LEVELS
FORMATS = options.LOG_FORMATS
DEFAULT_LEVEL = options.DEFAULT_LOG_LEVEL
DEFAULT_FORMAT = options.DEFAULT_LOG_FORMAT


class _Json(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname, "role": self.role,
               "pid": record.process, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup(role: str, level: str = DEFAULT_LEVEL, fmt: str = DEFAULT_FORMAT) -> None:
    """Send every log line of this process to stderr, naming ``role`` and the pid.
    Replaces whatever an earlier call (the parent, before a fork) installed."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level must be one of {LEVELS} and format one of {FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_Json(role))
    else:
        handler.setFormatter(logging.Formatter(f"shmq {role}[%(process)d] %(levelname)s: %(message)s"))
    root = logging.getLogger("shmq")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class Throttle:
    """At most one log line per ``every`` seconds for one kind of trouble (a flood of
    refused connections, say, logs a line a second, not a line each)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._last = float("-inf")

    def ready(self, now: float) -> bool:
        """May a line be logged at ``now`` (seconds, any clock)?  Yes: it counts as logged."""
        if now - self._last < self.every:
            return False
        self._last = now
        return True
