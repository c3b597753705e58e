"""Times a group is placed at (``create_group(start=...)``, ``seek``), as nanoseconds since the epoch.

A time is a number of seconds since the epoch (``time.time()``'s scale; int or float) or a
``datetime`` with a timezone; both clients turn it into the u64 nanoseconds a record's
producer timestamp holds (``layout.S_TIMESTAMP``), so a bad time is refused before anything
is sent.  :func:`parse_time` reads the command line's forms (ISO 8601, ``-5m``).
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

from shmq.errors import InvalidArgument

When = float | datetime  # what seek and create_group(start=...) take
Start = str | float | datetime  # create_group's start: "earliest", "latest" or a time

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_NS = (1 << 64) - 1
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_RELATIVE = re.compile(r"-(\d+(?:\.\d+)?)([smhdw])\Z")


def to_ns(when: object) -> int:
    """``when`` (seconds since the epoch, or an aware datetime) in ns since the epoch;
    InvalidArgument for anything else (a naive datetime, a bool, NaN, a time before 1970)."""
    if isinstance(when, datetime):
        if when.tzinfo is None or when.utcoffset() is None:
            raise InvalidArgument(f"the time {when.isoformat()} has no timezone: give one "
                                  "(datetime.now(UTC), or ...+00:00)")
        ns = (when - _EPOCH) // timedelta(microseconds=1) * 1000
    elif isinstance(when, (int, float)) and not isinstance(when, bool):
        if not math.isfinite(when):
            raise InvalidArgument(f"the time must be a finite number of seconds, not {when!r}")
        ns = when * 1_000_000_000 if isinstance(when, int) else round(when * 1e9)
    else:
        raise InvalidArgument("the time must be seconds since the epoch (a number) or a datetime with "
                              f"a timezone, not {type(when).__name__}")
    if not 0 <= ns <= _MAX_NS:
        raise InvalidArgument(f"the time {when!r} is outside 1970..2554")
    return int(ns)


def start_ns(start: object) -> int | None:
    """A group's start: None for ``"earliest"`` / ``"latest"``, else the time in ns (``to_ns``)."""
    if isinstance(start, str):
        if start not in ("earliest", "latest"):
            raise InvalidArgument("start must be 'earliest', 'latest' or a time (seconds since the "
                                  "epoch, or a datetime with a timezone)")
        return None
    return to_ns(start)


def parse_time(text: str, now: float) -> float:
    """A command line's time, in seconds since the epoch: ISO 8601 with a timezone
    (``2026-11-24T10:00:00Z``, ``...+01:00``), or a time relative to ``now`` (``-90s``,
    ``-5m``, ``-1h``, ``-2d``, ``-1w``)."""
    text = text.strip()
    rel = _RELATIVE.match(text)
    if rel:
        return now - float(rel.group(1)) * _UNITS[rel.group(2)]
    try:
        at = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise InvalidArgument(f"cannot read the time {text!r}: give ISO 8601 with a timezone "
                              "(2026-11-24T10:00:00Z) or a relative time (-5m, -1h, -2d)") from None
    if at.tzinfo is None:
        raise InvalidArgument(f"the time {text!r} has no timezone: add Z (UTC) or an offset (+01:00)")
    return at.timestamp()
