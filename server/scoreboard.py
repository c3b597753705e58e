"""The scoreboard: the figures only one of the broker's processes knows, for its metrics.

Requests and their latency are known to the worker that handled them, fsync times
and write failures to the journal process, restarts to the supervisor.  With
``shmq serve --metrics`` the supervisor maps one table before it forks anybody
(anonymous shared memory, inherited by every child; nothing in /dev/shm), and the
metrics process reads it at each scrape (``server.collector``).  Each row is
written by one process only, with plain 8-byte stores, so nobody takes a lock and
a reader sees figures a moment old, never torn ones.  Without ``--metrics`` there
is no table and nothing is recorded.

One 64-bit word each (``B`` = ``len(options.REQUEST_LATENCY_BUCKETS)``, ``F`` =
``len(options.FSYNC_LATENCY_BUCKETS)``, ``O`` = ``len(OPS)``)::

    word  0                      64                 65               66
          +----------------------+------------------+----------------+
    super | restarts of worker i | journal restarts | (reserved)     |   supervisor
          +----------------------+------------------+----------------+
          +----------------+---------------------------+-----------+
    journ | storage errors | fsyncs per bucket (F + 1) | fsync ns  |   journal process (threads: a lock)
          +----------------+---------------------------+-----------+
          +-----------------------------+---------------+-----+-----------------
    wkr i | op 0: requests per bucket   | op 0: sum, ns | ... | op O-1         |   worker i
          |  (B + 1: the last is +Inf)  |               |     |                |
          +-----------------------------+---------------+-----+-----------------

A bucket word counts the observations that fell in it (not cumulative: one store
per observation); the reader sums them into Prometheus's cumulative buckets.  A
restarted worker keeps adding to its row, so the counters never go back.
"""

from __future__ import annotations

import mmap
import threading
from bisect import bisect_left

from shmq import options
from shmq.protocol.codec import T

_RESPONSES = ("_OK", "_ACK", "_NACK")
#: the operations a worker meters: every request type, and ``OTHER`` for anything else
OPS: tuple[str, ...] = tuple(t.name.lower() for t in T if not t.name.endswith(_RESPONSES)
                             and t not in (T.DELIVER, T.DELIVER_BATCH, T.ERROR)) + ("other",)
OTHER = len(OPS) - 1
_OP_OF = [OTHER] * 256  # frame type byte -> op index
for _i, _name in enumerate(OPS[:OTHER]):
    _OP_OF[T[_name.upper()]] = _i


def _ns(bounds: tuple[float, ...]) -> list[int]:
    return [round(b * 1e9) for b in bounds]


REQUEST_BOUNDS_NS = _ns(options.REQUEST_LATENCY_BUCKETS)
FSYNC_BOUNDS_NS = _ns(options.FSYNC_LATENCY_BUCKETS)
OP_WORDS = len(REQUEST_BOUNDS_NS) + 2  # buckets, +Inf, sum
SUPER_WORDS = options.MAX_WORKERS + 2
JOURNAL_RESTARTS = options.MAX_WORKERS
J_ERRORS = SUPER_WORDS
J_BUCKETS = J_ERRORS + 1
J_SUM = J_BUCKETS + len(FSYNC_BOUNDS_NS) + 1
WORKERS_AT = J_SUM + 1
ROW_WORDS = len(OPS) * OP_WORDS


class Histogram:
    """One histogram as the reader sees it: cumulative counts per bound, then the total."""

    __slots__ = ("bounds", "cumulative", "sum_seconds")

    def __init__(self, bounds: tuple[float, ...], counts: list[int], sum_ns: int) -> None:
        self.bounds = bounds
        acc = 0
        self.cumulative = []
        for c in counts:
            acc += c
            self.cumulative.append(acc)
        self.sum_seconds = sum_ns / 1e9

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Scoreboard:
    """The table (see the module docstring), mapped before the supervisor forks."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._mm = mmap.mmap(-1, 8 * (WORKERS_AT + options.MAX_WORKERS * ROW_WORDS))  # MAP_SHARED
        self.words = memoryview(self._mm).cast("Q")

    # ------------------------------------------------------------ writers
    def restarted(self, worker: int) -> None:
        """The supervisor restarted worker ``worker`` (-1: the journal process)."""
        self.words[JOURNAL_RESTARTS if worker < 0 else worker] += 1

    def worker(self, worker: int) -> WorkerMeter:
        return WorkerMeter(self, worker)

    def journal(self) -> JournalMeter:
        return JournalMeter(self)

    # ------------------------------------------------------------ reader
    def restarts(self) -> tuple[list[int], int]:
        """(restarts of each worker, restarts of the journal process)."""
        return self.words[:self.workers].tolist(), self.words[JOURNAL_RESTARTS]

    def journal_figures(self) -> tuple[int, Histogram]:
        """(storage errors, the fsync histogram)."""
        w = self.words
        return w[J_ERRORS], Histogram(options.FSYNC_LATENCY_BUCKETS, w[J_BUCKETS:J_SUM].tolist(), w[J_SUM])

    def requests(self, worker: int) -> dict[str, Histogram]:
        """Worker ``worker``'s request-duration histogram of every op it has seen."""
        at = WORKERS_AT + worker * ROW_WORDS
        row = self.words[at:at + ROW_WORDS].tolist()
        out = {}
        for i, op in enumerate(OPS):
            block = row[i * OP_WORDS:(i + 1) * OP_WORDS]
            if any(block):
                out[op] = Histogram(options.REQUEST_LATENCY_BUCKETS, block[:-1], block[-1])
        return out


class WorkerMeter:
    """Worker ``worker``'s row: :meth:`record` is the whole per-request cost of metrics."""

    __slots__ = ("words", "_at", "_sum")

    def __init__(self, board: Scoreboard, worker: int) -> None:
        if not 0 <= worker < board.workers:
            raise ValueError(f"worker {worker} is not one of the {board.workers}")
        self.words = board.words
        row = WORKERS_AT + worker * ROW_WORDS
        self._at = [row + op * OP_WORDS for op in _OP_OF]  # frame type byte -> its op's first word
        self._sum = OP_WORDS - 1

    def record(self, frame_type: int, n: int, ns: int) -> None:
        """``n`` requests of this type were handled in ``ns`` nanoseconds each."""
        at = self._at[frame_type]
        w = self.words
        w[at + bisect_left(REQUEST_BOUNDS_NS, ns)] += n
        w[at + self._sum] += ns * n


class JournalMeter:
    """The journal process's row; its writer threads share it through a lock (an fsync
    costs far more than taking it)."""

    __slots__ = ("words", "_lock")

    def __init__(self, board: Scoreboard) -> None:
        self.words = board.words
        self._lock = threading.Lock()

    def fsync(self, ns: int) -> None:
        with self._lock:
            self.words[J_BUCKETS + bisect_left(FSYNC_BOUNDS_NS, ns)] += 1
            self.words[J_SUM] += ns

    def failed(self) -> None:
        with self._lock:
            self.words[J_ERRORS] += 1


__all__ = ["OPS", "Histogram", "JournalMeter", "Scoreboard", "WorkerMeter"]
