"""Progress of a long job: a big ``shmq produce``, ``shmq dlq --redrive``, the journal
recovery at broker start.

Where stderr is a terminal, a rich progress bar, shown once the job has run
``options.PROGRESS_DELAY`` (a short job shows nothing) and gone when it ends.  Elsewhere
(a log, a pipe), a line every ``options.PROGRESS_INTERVAL`` seconds::

    produced 120000 messages (40000/s)
    journal recovery: read 1.2 GiB of 3.0 GiB (40%, 310.5 MiB/s)

The job calls ``advance(n)`` as it goes, per batch or per message: that adds to a
counter and reads the clock; the bar is touched at most every ``PROGRESS_REFRESH``.
rich is imported only once a bar is shown.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from typing import Any

from shmq import options
from shmq.text import amount


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Progress:
    """The progress of one job (a context manager: the bar goes at the end).

    ``verb`` begins each line (``produced``), ``unit`` names what is counted (``bytes`` are
    shown as sizes), ``total`` is how many there will be when known.  ``emit`` takes the
    lines (default: stderr); ``terminal`` chooses the bar (default: whether stderr is a
    terminal); ``interval`` and ``clock`` are the line cadence and the time (monotonic s),
    for tests; ``enabled=False`` only counts."""

    def __init__(self, verb: str, unit: str = "messages", total: int | None = None, *,
                 emit: Callable[[str], None] | None = None, terminal: bool | None = None,
                 interval: float | None = None, clock: Callable[[], float] = time.monotonic,
                 enabled: bool = True) -> None:
        self.verb, self.unit, self.total = verb, unit, total
        self.emit = emit or _stderr_line
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.interval = options.PROGRESS_INTERVAL if interval is None else interval
        self.clock = clock
        self.count = 0
        self.lines = 0  # progress lines emitted
        self.start = clock()
        self._due = self.start + (options.PROGRESS_DELAY if self.terminal else self.interval)
        if not enabled:
            self._due = math.inf  # counts, shows nothing
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def advance(self, n: int = 1) -> None:
        self.count += n
        now = self.clock()
        if now >= self._due:
            self._show(now)

    def line(self, now: float) -> str:
        """The progress line at ``now``: what was done, of how many, and how fast."""
        rate = self.count / max(now - self.start, 1e-9)
        speed = f"{amount(rate, self.unit)}/s" if self.unit == "bytes" else f"{rate:.0f}/s"
        if not self.total:
            return f"{self.verb} {amount(self.count, self.unit)} ({speed})"
        done = (f"{amount(self.count, self.unit)} of {amount(self.total, self.unit)}" if self.unit == "bytes"
                else f"{self.count} of {self.total} {self.unit}")
        return f"{self.verb} {done} ({100 * self.count // self.total}%, {speed})"

    def _show(self, now: float) -> None:
        if not self.terminal:
            self.emit(self.line(now))
            self.lines += 1
            self._due = now + self.interval
            return
        if self._bar is None:
            self._bar, self._task = _start_bar(self.verb, self.unit, self.total)
        self._bar.update(self._task, completed=self.count)
        self._due = now + options.PROGRESS_REFRESH

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _start_bar(verb: str, unit: str, total: int | None) -> tuple[Any, Any]:
    """A rich progress bar on stderr (transient), and its one task."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        ProgressColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TransferSpeedColumn,
    )
    from rich.progress import Progress as Bar
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(f"{task.speed or 0:.0f}/s")

    columns: list[Any] = [TextColumn("{task.description}"), BarColumn()]
    if unit == "bytes":
        columns += [DownloadColumn(binary_units=True), TransferSpeedColumn()]
    else:
        columns += [TextColumn(f"{{task.completed:.0f}}{' of {task.total:.0f}' if total else ''} {unit}"),
                    Rate()]
    if total:
        columns.append(TaskProgressColumn())
    columns.append(TimeElapsedColumn())
    bar = Bar(*columns, console=Console(stderr=True), transient=True)
    bar.start()
    return bar, bar.add_task(verb, total=total)
