"""What bench_local.py and bench_tcp.py share: constants, options, child processes, statistics, output.

Both scripts are run as ``python bench/bench_x.py``, so this folder is ``sys.path[0]`` and
``from common import ...`` finds this module from any working directory.  Importing it puts the
repository root on ``sys.path`` too, so ``import shmq`` finds the checkout.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import shmq  # noqa: E402
from shmq.core.segment import objects_of  # noqa: E402

try:
    from rich.console import Console
    from rich.table import Table
except ImportError:
    Console = None  # type: ignore[assignment,misc]
    Table = None  # type: ignore[assignment,misc]


SHMQ = "shmq"
BATCH = 100
PUSH_CREDIT = 10 * BATCH  # push-mode consumers' credit (prefetch): messages the broker may send ahead
WORKLOADS = {"single": 1, "batch": BATCH}
WORKLOAD_LABELS = {"single": "1 msg / call", "batch": f"batch of {BATCH}"}

SHMQ_CAPACITY = 65_536
SHMQ_MAX_BYTES = 64 << 20
READY_TIMEOUT = 60.0
PING_WARMUP = 200

K = TypeVar("K")  # a results key: the system, or a tuple with it


class TrialError(RuntimeError):
    """One measurement failed (a child crashed or timed out)."""


# =============================================================== options
def parse_bench_args(argv: Sequence[str] | None, doc: str, *, n_help: str, n: tuple[int, int],
                     pings: tuple[int, int], processes: str,
                     after_pings: Callable[[argparse.ArgumentParser], None] | None = None,
                     after_json: Callable[[argparse.ArgumentParser], None] | None = None,
                     ) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The options both scripts take, with a script's own ones added by ``after_pings`` and
    ``after_json`` (in that place of the help).  ``n`` and ``pings`` are the defaults
    (full run, --quick); ``processes`` names the child processes in the help.  Returns the
    parser too, for the script's own checks."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None, help=n_help)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per workload; "
                   "the median is reported (default 3, or 1 with --quick)")
    p.add_argument("--pings", type=int, default=None, help=f"timed round trips per ping-pong run "
                   f"(default {pings[0]}, or {pings[1]} with --quick)")
    if after_pings is not None:
        after_pings(p)
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    if after_json is not None:
        after_json(p)
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork",
                   help=f"multiprocessing start method for the {processes} (default fork)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one run may take before it is stopped and counted as failed")
    a = p.parse_args(argv)
    a.n = a.n if a.n is not None else n[a.quick]
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    a.pings = a.pings if a.pings is not None else pings[a.quick]
    return p, a


# =============================================================== children (hot loops)
def child_main(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    # Ctrl-C goes to the parent, which stops us; SIGTERM must kill us even under fork
    # (where we inherit the parent's handler).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fn(*args)


def wait_ready(ready: Any) -> None:
    if not ready.wait(READY_TIMEOUT):
        raise TrialError("the peer process never became ready")


def shmq_produce(q: Any, payload: bytes, n: int, batch: int, window: int = 0) -> None:
    """``n`` puts of ``payload`` on the shmq queue ``q``, ``batch`` per call; ``window``: batches
    through a publisher, up to that many messages unconfirmed (no round trip waited per batch)."""
    if window:
        chunk = [payload] * batch
        with q.publisher(window=window) as p:
            for _ in range(n // batch):
                p.put_many(chunk)
        return
    if batch == 1:
        put = q.put
        for _ in range(n):
            put(payload)
    else:
        put_many, chunk = q.put_many, [payload] * batch
        for _ in range(n // batch):
            put_many(chunk)


def shmq_consume(q: Any, n: int, batch: int, nowait: bool = False, push: bool = False,
                 credit: int = PUSH_CREDIT, chained: bool = False) -> tuple[int, bytes]:
    """Get and ack ``n`` messages from the shmq queue ``q``, ``batch`` per call: the count and
    the last payload.  ``nowait``: ``ack(wait=False)`` (no round trip of its own).  ``push``:
    subscribe (with ``credit``) and ack each ``batch`` messages as one (one message:
    ``msg.ack``).  ``chained``: each get acks what the one before got (``get(ack=...)``)."""
    if chained:
        return _shmq_consume_chained(q, n, batch)
    if push:
        return _shmq_consume_pushed(q, n, batch, not nowait, credit)
    if batch == 1:
        get, wait = q.get, not nowait
        for _ in range(n):
            m = get()
            m.ack(wait)
        return n, m.payload
    get_many, ack_many, wait = q.get_many, q.ack_many, not nowait
    got = 0
    while got < n:
        msgs = get_many(batch)
        ack_many(msgs, wait)
        got += len(msgs)
    return got, msgs[-1].payload


def _shmq_consume_chained(q: Any, n: int, batch: int) -> tuple[int, bytes]:
    """Each get carries the ack of what the get before it got (over TCP in the same request:
    one round trip per get, each ack confirmed by the next get's answer); the last is acked
    on its own."""
    if batch == 1:
        get = q.get
        m = get()
        for _ in range(n - 1):
            m = get(ack=m)
        m.ack()
        return n, m.payload
    get_many = q.get_many
    msgs = get_many(batch)
    got = len(msgs)
    while got < n:
        msgs = get_many(batch, ack=msgs)
        got += len(msgs)
    q.ack_many(msgs)
    return got, msgs[-1].payload


def _shmq_consume_pushed(q: Any, n: int, batch: int, wait: bool, credit: int) -> tuple[int, bytes]:
    sub = q.subscribe(credit=credit)
    ack_many = q.ack_many
    got = 0
    msgs: list[Any] = []
    try:
        if batch == 1:  # each message acked on its own
            for m in sub:
                m.ack(wait)
                got += 1
                if got == n:
                    return got, m.payload
        for m in sub:
            msgs.append(m)
            if len(msgs) == batch or got + len(msgs) == n:
                ack_many(msgs, wait)
                got += len(msgs)
                last = m.payload
                msgs = []
                if got == n:
                    break
    finally:
        sub.close()
    return got, last


def shmq_ping(put: Callable[[bytes], Any], get: Callable[..., Any], payload: bytes, total: int,
              nowait: bool = False, chained: bool = False) -> array[int]:
    """``total`` timed round trips (ns): from ``put`` of the payload until ``get`` has the
    answer; the answer is acked after that (``nowait``: ``ack(wait=False)``), before the
    next ping (``chained``: by the next ping's get, ``get(ack=...)``, inside its timing)."""
    lat = array("q", bytes(8 * total))
    clock = time.perf_counter_ns
    wait = not nowait
    m = None
    for i in range(total):
        t0 = clock()
        put(payload)
        if chained:
            m = get(ack=m)
            lat[i] = clock() - t0
            continue
        m = get()
        lat[i] = clock() - t0
        m.ack(wait)
    if chained and m is not None:
        m.ack()
    return lat


def shmq_pong(get: Callable[..., Any], put: Callable[[bytes], Any], total: int, nowait: bool = False,
              chained: bool = False) -> None:
    """Answer ``total`` pings: ``get`` each, ``put`` its payload back, then ack it (the order
    of an at-least-once pipeline: the input is acked once its output is stored; ``chained``:
    by the next get, ``get(ack=...)``)."""
    wait = not nowait
    m = None
    for _ in range(total):
        if chained:
            m = get(ack=m)
            put(m.payload)
            continue
        m = get()
        put(m.payload)
        m.ack(wait)
    if chained and m is not None:
        m.ack()


# =============================================================== parent: process control
class Children:
    """Every child process a script started; all of them are stopped on the way out."""

    def __init__(self, ctx: mp.context.BaseContext) -> None:
        self.ctx = ctx
        self.procs: list[Any] = []

    def start(self, name: str, fn: Callable[..., None], *args: Any) -> Any:
        p = self.ctx.Process(target=child_main, args=(fn, args), name=name, daemon=True)  # type: ignore[attr-defined]
        self.procs.append(p)
        p.start()
        return p

    def wait(self, procs: Sequence[Any], timeout: float, conn: Any = None) -> bytes | None:
        """Join ``procs`` (reading ``conn``'s one message on the way); stop them all on any failure."""
        deadline = time.monotonic() + timeout
        pending = {p.sentinel: p for p in procs}
        waitables: list[Any] = list(pending) + ([conn] if conn is not None else [])
        data: bytes | None = None
        try:
            while pending or (conn is not None and data is None):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TrialError(f"timed out after {timeout:g} s")
                for obj in mpc.wait(waitables, remaining):
                    waitables.remove(obj)
                    if obj is conn:
                        try:
                            data = conn.recv_bytes()  # type: ignore[union-attr]
                        except EOFError:
                            raise TrialError("the measuring process sent no result") from None
                        continue
                    p = pending.pop(obj)
                    p.join()
                    if p.exitcode != 0:
                        raise TrialError(f"{p.name} exited with code {p.exitcode}")
                if not pending and conn is not None and data is None:
                    if not conn.poll(0):
                        raise TrialError("the measuring process exited without a result")
                    data = conn.recv_bytes()
        finally:
            for p in procs:
                self.stop(p)
        return data

    def stop(self, p: Any) -> None:
        if p not in self.procs:
            return  # already stopped and closed
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
        p.join()
        self.procs.remove(p)
        p.close()

    def stop_all(self) -> None:
        for p in list(self.procs):
            try:
                self.stop(p)
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: could not stop {p.name}: {e}", file=sys.stderr)


def terminate(signum: int, _frame: Any) -> NoReturn:
    """SIGTERM handler for the parent: unwind like Ctrl-C does, so everything is stopped."""
    raise SystemExit(128 + signum)


def serve(instance: str, data_dir: str, workers: int, *extra: str, stderr: Any = subprocess.PIPE
          ) -> tuple[subprocess.Popen[bytes], int, str]:
    """``shmq serve`` on an ephemeral port, of this checkout: the process, its port and its
    start line (which names the journal's and the metrics' pids, ...).  SystemExit, the
    broker killed, when it does not start."""
    proc = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()",
                             "serve", "--port", "0",
                             "--workers", str(workers), "--instance", instance, "--data-dir", data_dir,
                             *extra], stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    m = re.search(r"tcps?://[0-9.]+:(\d+)", line)
    if m is None:
        proc.kill()
        proc.wait()
        raise SystemExit(f"shmq serve did not start: {line!r}")
    return proc, int(m.group(1)), line


def leftovers(instance: str) -> list[str]:
    """The shared-memory files of shmq ``instance`` (of this user) still in /dev/shm."""
    return objects_of(instance)


def create_queues(broker: Any, names: Sequence[str]) -> None:
    """Create the shmq queues ``names`` for one run (deep enough for every workload)."""
    for name in names:
        broker.create_queue(name, capacity=SHMQ_CAPACITY, max_bytes=SHMQ_MAX_BYTES)


def delete_queues(broker: Any, names: Sequence[str]) -> None:
    """Delete the shmq queues ``names`` after a run; one that is gone already is fine."""
    for name in names:
        try:
            broker.delete_queue(name)
        except shmq.QueueNotFound:
            pass


def warn_alive(out: Out) -> bool:
    """Say so if any child process is still alive (True then)."""
    alive = mp.active_children()
    if alive:
        out.line(f"warning: child processes still alive: {alive}", style="bold red")
    return bool(alive)


def check_clean(out: Out, instance: str, code: int) -> int:
    """A run's exit code once it has stopped everything: ``code``, or 1 when shared memory
    of ``instance`` or a child process is left behind (each said on ``out``)."""
    left = leftovers(instance)
    if left:
        out.line(f"warning: shared memory left behind: {', '.join(left)}", style="bold red")
        code = code or 1
    if warn_alive(out):
        code = code or 1
    return code


# =============================================================== parent: measurements
def rate(result: Any, n: int) -> float:
    """Messages per second from a consumer's ``result`` (elapsed ns, messages received)."""
    elapsed_ns, got = result[0], result[1]
    if got < n or elapsed_ns <= 0:
        raise TrialError(f"consumer reported {got} of {n} messages in {elapsed_ns} ns")
    return n / (elapsed_ns / 1e9)


def round_trips(data: bytes | None, total: int) -> list[int]:
    """The pinger's ``total`` round-trip times (ns) less the PING_WARMUP first ones, sorted."""
    lat = array("q")
    lat.frombytes(data or b"")
    if len(lat) != total:
        raise TrialError(f"got {len(lat)} round trips, expected {total}")
    return sorted(lat[PING_WARMUP:])


def percentile(sorted_values: Sequence[int], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[idx])


def p50_p99(lat: Sequence[int]) -> tuple[float, float, str]:
    """p50 and p99 of sorted round-trip times (ns), and how the progress line shows them."""
    p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
    return p50, p99, f"p50 {p50 / 1000:8.1f} us   p99 {p99 / 1000:8.1f} us"


def median(values: Sequence[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def us(ns: float | None) -> float | None:
    return None if ns is None else ns / 1000


def latency_json(runs_p50: Sequence[float | None], runs_p99: Sequence[float | None]) -> dict[str, Any]:
    """A latency entry's per-run and median percentiles, in µs."""
    return {"runs_p50_us": [us(v) for v in runs_p50], "runs_p99_us": [us(v) for v in runs_p99],
            "median_p50_us": us(median(runs_p50)), "median_p99_us": us(median(runs_p99))}


# =============================================================== output
class Out:
    """Progress lines and tables, with rich when it is installed.  The first ``label_columns``
    columns of a table are left-aligned labels, the others right-aligned figures."""

    def __init__(self, label_columns: int) -> None:
        self.label_columns = label_columns
        # a pipe or a file gets rich's 80 columns by default: too narrow for the tables
        width = None if sys.stdout.isatty() else 160
        self.console = Console(highlight=False, width=width) if Console is not None else None

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.console is not None:
            self.console.print(text, style=style, markup=False)
        else:
            print(text, flush=True)

    def table(self, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
              caption: str | None = None) -> None:
        labels = self.label_columns
        if self.console is not None and Table is not None:
            t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
            for i, h in enumerate(headers):
                t.add_column(h, justify="left" if i < labels else "right", no_wrap=True)
            for r in rows:
                t.add_row(*r)
            self.console.print(t)
            return
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

        def fmt(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(w) if i < labels else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

        print(f"\n{title}")
        print(fmt(headers))
        print("  ".join("-" * w for w in widths))
        for r in rows:
            print(fmt(r))
        if caption:
            print(caption)
        print(flush=True)

    def targets_heading(self) -> None:
        self.line()
        self.line("Targets", style="bold")


def fmt_rate(v: float | None) -> str:
    return "failed" if v is None else f"{v:,.0f}"


def fmt_progress_rate(v: float) -> str:
    return f"{v:>12,.0f} msgs/s"


def fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_us(ns: float | None) -> str:
    return "failed" if ns is None else f"{ns / 1000:.1f}"


def rate_cells(med: Mapping[K, float | None], keys: Sequence[K], shmq_key: K) -> list[str]:
    """A throughput table row's figures: the median msgs/s of each of ``keys``, then shmq's ratio
    to each of the others (the peers)."""
    return ([fmt_rate(med.get(k)) for k in keys]
            + [fmt_ratio(ratio(med.get(shmq_key), med.get(k))) for k in keys if k != shmq_key])


def latency_cells(m50: Mapping[K, float | None], m99: Mapping[K, float | None], keys: Sequence[K],
                  shmq_key: K) -> list[str]:
    """A latency table row's figures: the median p50 / p99 (us) of each of ``keys``, then each
    peer's ratio to shmq's."""
    return ([f"{fmt_us(m50.get(k))} / {fmt_us(m99.get(k))}" for k in keys]
            + [f"{fmt_ratio(ratio(m50.get(k), m50.get(shmq_key)))} / "
               f"{fmt_ratio(ratio(m99.get(k), m99.get(shmq_key)))}" for k in keys if k != shmq_key])


def write_json(out: Out, path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    out.line(f"results written to {path}")


# =============================================================== targets
def ratio_verdict(value: float | None, must: float, aim: float, why_na: str,
                  aim_on_fail: bool = False) -> tuple[str, str]:
    """A ratio target's verdict and its style: ``value`` must reach ``must`` and aims at ``aim``;
    ``why_na`` says why there is no value; ``aim_on_fail``: name the aim in a failure too."""
    if value is None:
        return f"n/a ({why_na})", "yellow"
    if value < must:
        return f"FAIL (must >= {must:g}x" + (f"; aim {aim:g}x)" if aim_on_fail else ")"), "bold red"
    if value < aim:
        return f"pass (>= {must:g}x), below the aim of {aim:g}x", "yellow"
    return f"pass, aim of {aim:g}x reached", "bold green"


def ratio_target_json(label: str, value: float | None, must: float, aim: float,
                      **extra: Any) -> dict[str, Any]:
    """A ratio target in the JSON; ``extra`` keys go before the verdicts."""
    return {"target": label, "ratio": value, "must": must, "aim": aim, **extra,
            "ok": None if value is None else value >= must,
            "aim_reached": None if value is None else value >= aim}
