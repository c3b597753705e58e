"""``shmq top``: a live terminal dashboard of a broker's queues.

One row per queue: messages in and acks out per second (the deltas of ``produced``
and of every group's ``acked`` between two readings), depth (the deepest group's)
with a sparkline of its recent readings, leases in flight, each group's lag (next
offset - floor: what it has not settled yet), the size of its dead-letter queue and
its durability mode.  A dead-letter queue is folded into its source queue's row (the
``dlq`` column); one whose source queue is gone gets a row of its own.  The header
is ``broker.info()``: version, owner pid and uptime, workers and connections (none
over ``shm://``, and it says so).

The parts that need no terminal -- :func:`rate`, :func:`sparkline`, :class:`Tracker`
(rows from ``stats()`` dicts), :class:`View` (sort, filter, and what each key does) and
:func:`screen` (one frame as a rich renderable) -- are tested as they are; :class:`Keys`
reads the keyboard in cbreak mode without blocking the refresh, and :func:`run` is the
loop of the command.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import termios
import time
import tty
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from shmq import options
from shmq.api import Broker, BrokerInfo
from shmq.errors import InvalidArgument, QueueNotFound
from shmq.text import plural

BLOCKS = "▁▂▃▄▅▆▇█"
ESC = "\x1b"


# ---------------------------------------------------------------- figures
def rate(before: int | None, after: int, seconds: float) -> float | None:
    """Per second, from two readings of a counter ``seconds`` apart; None without an
    earlier reading, over no time, or when the counter went back (the queue, or the
    group, was made again meanwhile)."""
    if before is None or seconds <= 0 or after < before:
        return None
    return (after - before) / seconds


def sparkline(values: Sequence[int], width: int = options.TOP_HISTORY) -> str:
    """The last ``width`` values as block characters, scaled to the largest of them: zero
    is the lowest block, anything above zero at least the second; right-aligned."""
    shown = list(values)[-width:] if width > 0 else []
    top = max(shown, default=0)
    line = "".join(BLOCKS[0] if v <= 0 else BLOCKS[max(1, round(v / top * (len(BLOCKS) - 1)))]
                   for v in shown)
    return line.rjust(width)


@dataclass(frozen=True)
class Row:
    """One queue's line of the table."""

    name: str
    rate_in: float | None  # messages produced per second
    rate_out: float | None  # acks per second, every group's together
    depth: int  # the deepest group's (ready + not yet delivered)
    history: tuple[int, ...]  # depth readings, oldest first
    in_flight: int  # leases held, every group's together
    lags: tuple[tuple[str, int], ...]  # (group, next offset - floor)
    dlq: int | None  # messages in <name>.dlq; None: it has none
    durability: str

    @property
    def lag(self) -> int:
        return max((lag for _, lag in self.lags), default=0)


@dataclass
class _Last:
    t: float
    produced: int
    acked: dict[str, int]
    depths: deque[int] = field(default_factory=deque)


class Tracker:
    """Rows from successive readings of ``stats()``: it keeps each queue's last counters
    and its recent depths.  A queue missing from a reading is forgotten."""

    def __init__(self, history: int = options.TOP_HISTORY) -> None:
        self.history = history
        self._last: dict[str, _Last] = {}

    def rows(self, stats: Iterable[dict[str, Any]], now: float) -> list[Row]:
        """The rows of one reading (every queue's ``stats()``, taken at ``now``, monotonic s)."""
        by_name = {st["name"]: st for st in stats}
        dlqs = {name[:-len(options.DLQ_SUFFIX)]: st["retained"] for name, st in by_name.items()
                if st["is_dlq"] and name[:-len(options.DLQ_SUFFIX)] in by_name}
        rows = []
        for name, st in by_name.items():
            if st["is_dlq"] and name[:-len(options.DLQ_SUFFIX)] in by_name:
                continue  # folded into its source queue's row
            groups = st["groups"]
            acked = {g: s["acked"] for g, s in groups.items()}
            depth = max((s["depth"] for s in groups.values()), default=0)
            last = self._last.get(name)
            if last is None:
                last = self._last[name] = _Last(now, st["produced"], acked, deque(maxlen=self.history))
                rate_in = rate_out = None
            else:
                dt = now - last.t
                rate_in = rate(last.produced, st["produced"], dt)
                outs = [rate(last.acked[g], n, dt) for g, n in acked.items() if g in last.acked]
                rate_out = None if not outs or None in outs else sum(r for r in outs if r is not None)
                last.t, last.produced, last.acked = now, st["produced"], acked
            last.depths.append(depth)
            rows.append(Row(name, rate_in, rate_out, depth, tuple(last.depths),
                            sum(s["in_flight"] for s in groups.values()),
                            tuple((g, st["next_offset"] - s["floor"]) for g, s in groups.items()),
                            dlqs.get(name), st["config"]["durability"]))
        for gone in set(self._last) - {r.name for r in rows}:
            del self._last[gone]
        return rows


# ---------------------------------------------------------------- sorting, filtering, keys
@dataclass(frozen=True)
class Column:
    name: str  # what --sort takes
    title: str
    descending: bool  # its first direction: biggest first, but for names


COLUMNS = (Column("queue", "queue", False), Column("in", "in/s", True), Column("out", "out/s", True),
           Column("depth", "depth", True), Column("inflight", "in flight", True),
           Column("lag", "groups: lag", True), Column("dlq", "dlq", True),
           Column("durability", "durability", False))
_NAMES = [c.name for c in COLUMNS]


def _sort_key(column: str, r: Row) -> Any:
    return {"queue": r.name, "in": r.rate_in or 0.0, "out": r.rate_out or 0.0, "depth": r.depth,
            "inflight": r.in_flight, "lag": r.lag, "dlq": -1 if r.dlq is None else r.dlq,
            "durability": r.durability}[column]


class View:
    """What is shown: the sort column and direction, the name filter, and the filter being
    typed (``draft``; None when not typing).  ``key`` applies one key press."""

    def __init__(self, sort: str = "queue", filter: str = "") -> None:
        if sort not in _NAMES:
            raise InvalidArgument(f"--sort must be one of {', '.join(_NAMES)}, not {sort!r}")
        self.sort = sort
        self.descending = COLUMNS[_NAMES.index(sort)].descending
        self.filter = filter
        self.draft: str | None = None

    def key(self, k: str) -> bool:
        """Apply key ``k`` (a character, or ESC); True when it asks to quit."""
        if self.draft is not None:  # typing a filter on the footer line
            if k in ("\r", "\n"):
                self.filter, self.draft = self.draft, None
            elif k == ESC:
                self.filter, self.draft = "", None
            elif k in ("\x7f", "\b"):
                self.draft = self.draft[:-1]
            elif k.isprintable():
                self.draft += k
            return False
        if k == "q":
            return True
        if k == "/":
            self.draft = ""
        elif k == ESC:
            self.filter = ""
        elif len(k) == 1 and "1" <= k <= "9" and int(k) <= len(COLUMNS):
            col = COLUMNS[int(k) - 1]
            if col.name == self.sort:
                self.descending = not self.descending
            else:
                self.sort, self.descending = col.name, col.descending
        return False

    def shown(self, rows: Iterable[Row]) -> list[Row]:
        """The rows that pass the filter (a part of the name, any case), sorted."""
        needle = self.filter.lower()
        kept = sorted((r for r in rows if needle in r.name.lower()), key=lambda r: r.name)
        return sorted(kept, key=lambda r: _sort_key(self.sort, r), reverse=self.descending)


def keys_of(text: str) -> list[str]:
    """The key presses in what a terminal sent: characters, ESC alone for the Escape key;
    escape sequences (arrows, function keys) are dropped."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == ESC and i + 1 < len(text) and text[i + 1] in "[O":
            i += 2
            while i < len(text) and not "\x40" <= text[i] <= "\x7e":
                i += 1
            i += 1  # the sequence's final byte
            continue
        out.append(c)
        i += 1
    return out


class Keys:
    """The keyboard, read without blocking the refresh: cbreak mode while open (each key
    as it is typed, no echo; Ctrl-C still interrupts), the terminal's settings restored
    on close however the dashboard ends.  Not a terminal: no keys, ``read`` only waits."""

    def __init__(self, stream: TextIO | None = None) -> None:
        stream = sys.stdin if stream is None else stream
        try:
            self.fd: int | None = stream.fileno() if stream.isatty() else None
        except (AttributeError, OSError, ValueError):  # closed, or no file at all
            self.fd = None
        self._saved: tuple[int, list[Any]] | None = None

    def __enter__(self) -> Keys:
        if self.fd is not None:
            self._saved = (self.fd, termios.tcgetattr(self.fd))
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            fd, attrs = self._saved
            self._saved = None
            try:
                termios.tcsetattr(fd, termios.TCSADRAIN, attrs)
            except termios.error:
                pass  # the terminal is gone (hung up): nothing to restore

    def read(self, timeout: float) -> list[str]:
        """The keys typed within ``timeout`` seconds (returns at the first of them)."""
        if self.fd is None:
            time.sleep(max(0.0, timeout))
            return []
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return []
        try:
            data = os.read(self.fd, 256)
        except OSError:  # EIO: hung up
            data = b""
        if not data:  # the terminal is gone: no more keys
            self.fd = None
        return keys_of(data.decode(errors="ignore"))


# ---------------------------------------------------------------- drawing
def duration(seconds: float) -> str:
    s = int(seconds)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60), ("m", 60, "s", 1)):
        if s >= size:
            return f"{s // size}{unit} {s % size // sub_size:02d}{sub}"
    return f"{s}s"


def header(about: BrokerInfo, url: str) -> str:
    """The broker's line: version, owner, uptime, workers and connections (and the replies
    dropped, once there are some)."""
    parts = [f"shmq top  {url}", f"shmq {about.version}"]
    who = "broker" if about.workers is not None else "owner"
    if about.pid is None:
        parts.append(f"{who}: gone")
    else:
        parts.append(f"{who} pid {about.pid}, up {duration(about.uptime or 0.0)}")
    if about.workers is None or about.connections is None:
        parts.append("workers –  connections – (shm://: no worker pool)")
    else:
        per = " + ".join(map(str, about.connections))
        parts.append(f"workers {about.workers}  connections {sum(about.connections)} ({per})")
    parts.append(f"registered processes {len(about.clients)}")
    if about.replication:
        from shmq.cli.health import replication_line
        parts.append(replication_line(about.replication))
    if about.replies_dropped and any(about.replies_dropped.values()):
        parts.append("replies dropped " + ", ".join(f"{k} {n}" for k, n in about.replies_dropped.items()))
    return "  ·  ".join(parts)


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:,.1f}"


def screen(rows: list[Row], about: BrokerInfo, view: View, url: str, interval: float,
           keys: bool = True) -> RenderableType:
    """One frame: the broker's header, the table of ``rows`` as ``view`` shows them, and
    the footer (the keys, or the filter being typed)."""
    shown = view.shown(rows)
    table = Table(box=box.MINIMAL, expand=False, pad_edge=False)
    for i, col in enumerate(COLUMNS, 1):
        arrow = (" ↓" if view.descending else " ↑") if col.name == view.sort else ""
        table.add_column(f"{i} {col.title}{arrow}", justify="left" if i in (1, 6, 8) else "right",
                         no_wrap=i != 6)
    for r in shown:
        table.add_row(r.name, _num(r.rate_in), _num(r.rate_out), f"{r.depth:,} {sparkline(r.history)}",
                      f"{r.in_flight:,}", " ".join(f"{g}:{lag:,}" for g, lag in r.lags),
                      "–" if r.dlq is None else f"{r.dlq:,}", r.durability)
    direction = "descending" if view.descending else "ascending"
    status = (f"{plural(len(rows), 'queue')} ({len(shown)} shown)  ·  sort: {view.sort} {direction}"
              f"{'  ·  filter: ' + view.filter if view.filter else ''}  ·  every {interval:g} s  ·  "
              f"{time.strftime('%H:%M:%S')}")
    parts: list[RenderableType] = [Text(header(about, url), style="bold"), Text(status), table]
    if view.draft is not None:
        parts.append(Text(f"filter: {view.draft}▏  (Enter apply, Esc clear)", style="reverse"))
    elif keys:
        parts.append(Text("q quit  ·  1-8 sort by that column (again: reverse)  ·  / filter  ·  "
                          "Esc clear the filter", style="dim"))
    return Group(*parts)


# ---------------------------------------------------------------- the loop
def _stats(broker: Broker, handles: dict[str, Any]) -> list[dict[str, Any]]:
    """Every queue's ``stats()``.  ``handles`` keeps each queue's handle between readings:
    opening one costs a request of its own over TCP (``TcpBroker.queue`` checks the queue
    is there), so a refresh asks once per queue, not twice."""
    out = []
    names = [info.name for info in broker.list_queues()]
    for name in set(handles) - set(names):
        del handles[name]  # deleted: a queue made again under its name gets a new handle
    for name in names:
        try:
            q = handles.get(name)
            if q is None:
                q = handles[name] = broker.queue(name)
            out.append(q.stats())
        except QueueNotFound:
            handles.pop(name, None)  # deleted since it was listed
    return out


class _Stopped(Exception):
    """SIGTERM: leave as Ctrl-C does, terminal restored."""


def _stop(signum: int, frame: Any) -> None:
    raise _Stopped


def run(broker: Broker, url: str, interval: float = options.TOP_INTERVAL, sort: str = "queue",
        filter: str = "", once: bool = False, console: Console | None = None) -> None:
    """The dashboard until ``q``, Ctrl-C or SIGTERM; ``once`` (or an output that is no
    terminal) prints frames instead of redrawing one, ``once`` a single frame with the
    rates over one interval.  A broker error (it went away) is raised, the terminal
    restored first."""
    if not options.TOP_MIN_INTERVAL <= interval <= options.TOP_MAX_INTERVAL:
        raise InvalidArgument(f"--interval must be between {options.TOP_MIN_INTERVAL:g} and "
                              f"{options.TOP_MAX_INTERVAL:g} seconds, not {interval:g}")
    console = console or Console(width=None if sys.stdout.isatty() else 160)  # pipes get whole rows
    view = View(sort, filter)
    tracker = Tracker()
    handles: dict[str, Any] = {}

    def sample() -> tuple[list[Row], BrokerInfo]:
        about = broker.info()  # first: a broker gone ends here, before its queues look empty
        return tracker.rows(_stats(broker, handles), time.monotonic()), about

    old_term = signal.signal(signal.SIGTERM, _stop)
    try:
        if once or not console.is_terminal:
            sample()  # the first readings: rates need two
            while True:
                time.sleep(interval)
                console.print(screen(*sample(), view, url, interval, keys=False))
                if once:
                    return
        _live(console, view, sample, url, interval)
    except (KeyboardInterrupt, _Stopped):
        return
    finally:
        signal.signal(signal.SIGTERM, old_term)


def _live(console: Console, view: View, sample: Callable[[], tuple[list[Row], BrokerInfo]], url: str,
          interval: float) -> None:
    """Redraw every ``interval`` seconds, and at once after a key (with the same readings)."""
    from rich.live import Live

    with Keys() as keys, Live(console=console, screen=True, auto_refresh=False) as live:
        due = time.monotonic() + interval
        rows, about = sample()
        while True:
            live.update(screen(rows, about, view, url, interval, keys=keys.fd is not None), refresh=True)
            for k in keys.read(due - time.monotonic()):
                if view.key(k):
                    return
            if time.monotonic() >= due:
                due = time.monotonic() + interval
                rows, about = sample()
