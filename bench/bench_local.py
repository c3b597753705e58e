"""Co-located throughput and latency: shmq against multiprocessing.Queue and faster-fifo.

Run from the repository root::

    python bench/bench_local.py              # full run: 200k msgs (100 B), 50k (4 KiB), 3 rounds
    python bench/bench_local.py --quick      # smoke run: 20k msgs, 1 round, 2k pings
    python bench/bench_local.py --json out.json --rounds 5

Every measurement is one producer process and one consumer process (children of
this script; the parent only coordinates).  Workloads, each with 100 B and 4 KiB
payloads:

1. ``single``: one message per call.  shmq: ``put`` / ``get`` + ``msg.ack()``.
   Peers: ``multiprocessing.Queue`` and ``faster_fifo.Queue`` ``put`` / ``get``
   (they have no acknowledgement).
2. ``batch``: batches of 100.  shmq: ``put_many`` / ``get_many(100)`` + ``ack_many``.
   faster-fifo: ``put_many`` / ``get_many(max_messages_to_get=100)``.
   mp.Queue has no batch API: it puts one *list of 100 payloads* per call and
   the list counts as 100 messages (marked with a dagger in the table).
3. ``ping-pong``: round-trip latency over two queues (ping, pong); process A
   puts on ping, B gets (+acks) and puts the payload on pong, A gets (+acks).
   Each round trip is timed with ``time.perf_counter_ns``; p50 and p99 in µs.

Throughput is messages / seconds, timed from the moment the producer starts
(it stamps ``time.monotonic_ns`` into shared memory just before its first put,
once the consumer is attached and ready) until the consumer has received all N.

The box this runs on is small and shared, so the systems are interleaved: for
each workload and size, every round runs shmq, faster-fifo, mp.Queue in turn,
and the table reports each system's median over ``--rounds`` rounds together
with shmq's ratio to each peer.  faster-fifo uses its default (pickle)
serialisation, like mp.Queue; shmq moves raw bytes.  If faster_fifo is not
installed it is skipped with a message.

Every shmq instance is destroyed and every child process is stopped on the
way out (also on error or Ctrl-C); the script checks /dev/shm at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import signal
import statistics
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import shmq  # noqa: E402

try:
    import faster_fifo

    try:  # lets faster_fifo.Queue cross into "spawn" children
        import faster_fifo_reduction  # noqa: F401
    except ImportError:
        pass
except ImportError:
    faster_fifo = None

try:
    from rich.console import Console
    from rich.table import Table
except ImportError:
    Console = None  # type: ignore[assignment,misc]
    Table = None  # type: ignore[assignment,misc]


SHMQ, FF, MPQ = "shmq", "faster-fifo", "mp.Queue"
SIZES = (100, 4096)
BATCH = 100
WORKLOADS = {"single": 1, "batch": BATCH}
WORKLOAD_LABELS = {"single": "1 msg / call", "batch": f"batch of {BATCH}"}

SHMQ_CAPACITY = 65_536
SHMQ_MAX_BYTES = 64 << 20
FF_MAX_BYTES = 64 << 20
FF_PINGPONG_BYTES = 4 << 20
PEER_TIMEOUT = 3600.0  # faster-fifo's put/get need a timeout; hangs are caught by the parent
READY_TIMEOUT = 60.0
PING_WARMUP = 200

Handle = Any  # (url, queue name) for shmq, the queue object itself for the peers


class TrialError(RuntimeError):
    """One measurement failed (a child crashed or timed out)."""


# =============================================================== children (hot loops)
def _child_main(fn: Callable[..., None], args: tuple[Any, ...]) -> None:
    # Ctrl-C goes to the parent, which stops us; SIGTERM must kill us even under fork
    # (where we inherit the parent's handler).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    fn(*args)


def _open(system: str, handle: Handle) -> tuple[Any, Callable[[], None]]:
    if system == SHMQ:
        url, name = handle
        broker = shmq.connect(url)
        return broker.queue(name), broker.close
    return handle, lambda: None


def _wait_ready(ready: Any) -> None:
    if not ready.wait(READY_TIMEOUT):
        raise TrialError("the peer process never became ready")


def _producer(system: str, handle: Handle, n: int, size: int, batch: int, ready: Any, start: Any) -> None:
    q, close = _open(system, handle)
    try:
        payload = b"x" * size
        chunk = [payload] * batch
        _wait_ready(ready)
        start.value = time.monotonic_ns()
        if batch == 1:
            if system == FF:
                put = q.put
                for _ in range(n):
                    put(payload, True, PEER_TIMEOUT)
            else:  # shmq and mp.Queue: the plain blocking put
                put = q.put
                for _ in range(n):
                    put(payload)
        elif system == SHMQ:
            put_many = q.put_many
            for _ in range(n // batch):
                put_many(chunk)
        elif system == FF:
            put_many = q.put_many
            for _ in range(n // batch):
                put_many(chunk, True, PEER_TIMEOUT)
        else:  # mp.Queue: one list of `batch` payloads per item
            put = q.put
            for _ in range(n // batch):
                put(chunk)
    finally:
        close()


def _consumer(system: str, handle: Handle, n: int, batch: int, size: int, ready: Any, start: Any,
              result: Any) -> None:
    q, close = _open(system, handle)
    try:
        ready.set()
        got = 0
        last: Any = None
        if batch == 1:
            if system == SHMQ:
                get = q.get
                for _ in range(n):
                    last = get()
                    last.ack()
                last = last.payload
            elif system == FF:
                get = q.get
                for _ in range(n):
                    last = get(True, PEER_TIMEOUT)
            else:
                get = q.get
                for _ in range(n):
                    last = get()
            got = n
        elif system == SHMQ:
            get_many, ack_many = q.get_many, q.ack_many
            while got < n:
                msgs = get_many(batch)
                ack_many(msgs)
                got += len(msgs)
            last = msgs[-1].payload
        elif system == FF:
            get_many = q.get_many
            while got < n:
                msgs = get_many(block=True, timeout=PEER_TIMEOUT, max_messages_to_get=batch)
                got += len(msgs)
            last = msgs[-1]
        else:
            get = q.get
            while got < n:
                msgs = get()
                got += len(msgs)
            last = msgs[-1]
        end = time.monotonic_ns()
        if len(last) != size:
            raise TrialError(f"{system}: last payload has {len(last)} bytes, expected {size}")
        result[0] = end - start.value
        result[1] = got
    finally:
        close()


def _pinger(system: str, h_ping: Handle, h_pong: Handle, size: int, total: int, ready: Any,
            conn: Any) -> None:
    ping, close_ping = _open(system, h_ping)
    pong, close_pong = _open(system, h_pong)
    try:
        payload = b"p" * size
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        _wait_ready(ready)
        if system == SHMQ:
            put, get = ping.put, pong.get
            for i in range(total):
                t0 = clock()
                put(payload)
                get().ack()
                lat[i] = clock() - t0
        elif system == FF:
            put, get = ping.put, pong.get
            for i in range(total):
                t0 = clock()
                put(payload, True, PEER_TIMEOUT)
                get(True, PEER_TIMEOUT)
                lat[i] = clock() - t0
        else:
            put, get = ping.put, pong.get
            for i in range(total):
                t0 = clock()
                put(payload)
                get()
                lat[i] = clock() - t0
        conn.send_bytes(lat.tobytes())
    finally:
        conn.close()
        close_pong()
        close_ping()


def _ponger(system: str, h_ping: Handle, h_pong: Handle, total: int, ready: Any) -> None:
    ping, close_ping = _open(system, h_ping)
    pong, close_pong = _open(system, h_pong)
    try:
        ready.set()
        if system == SHMQ:
            get, put = ping.get, pong.put
            for _ in range(total):
                m = get()
                m.ack()
                put(m.payload)
        elif system == FF:
            get, put = ping.get, pong.put
            for _ in range(total):
                put(get(True, PEER_TIMEOUT), True, PEER_TIMEOUT)
        else:
            get, put = ping.get, pong.put
            for _ in range(total):
                put(get())
    finally:
        close_pong()
        close_ping()


# =============================================================== parent: process control
class Children:
    """Every child process this script started; all of them are stopped on the way out."""

    def __init__(self, ctx: mp.context.BaseContext) -> None:
        self.ctx = ctx
        self.procs: list[Any] = []

    def start(self, name: str, fn: Callable[..., None], *args: Any) -> Any:
        p = self.ctx.Process(target=_child_main, args=(fn, args), name=name, daemon=True)  # type: ignore[attr-defined]
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
        if p.is_alive():
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
        p.join()
        if p in self.procs:
            self.procs.remove(p)
        p.close()

    def stop_all(self) -> None:
        for p in list(self.procs):
            try:
                self.stop(p)
            except Exception as e:  # noqa: BLE001 - keep stopping the others
                print(f"warning: could not stop {p.name}: {e}", file=sys.stderr)


# =============================================================== parent: measurements
@dataclass
class Bench:
    ctx: mp.context.BaseContext
    children: Children
    broker: Any
    timeout: float

    def throughput(self, system: str, size: int, n: int, batch: int) -> float:
        """One run: messages per second seen by the consumer."""
        ctx = self.ctx
        ready = ctx.Event()  # type: ignore[attr-defined]
        start = ctx.RawValue("q", 0)  # type: ignore[attr-defined]
        result = ctx.RawArray("q", 2)  # type: ignore[attr-defined]
        handle: Handle
        if system == SHMQ:
            self.broker.create_queue("bench", capacity=SHMQ_CAPACITY, max_bytes=SHMQ_MAX_BYTES)
            handle = (self.broker.url, "bench")
        elif system == FF:
            handle = faster_fifo.Queue(max_size_bytes=FF_MAX_BYTES)
        else:
            handle = ctx.Queue()  # type: ignore[attr-defined]
        try:
            cons = self.children.start(f"{system}-consumer", _consumer, system, handle, n, batch, size,
                                       ready, start, result)
            prod = self.children.start(f"{system}-producer", _producer, system, handle, n, size, batch,
                                       ready, start)
            self.children.wait([cons, prod], self.timeout)
        finally:
            self._release(system, handle, ("bench",))
        elapsed_ns, got = result[0], result[1]
        if got < n or elapsed_ns <= 0:
            raise TrialError(f"consumer reported {got} of {n} messages in {elapsed_ns} ns")
        return n / (elapsed_ns / 1e9)

    def latency(self, system: str, size: int, pings: int) -> list[int]:
        """One run: ``pings`` round-trip times in ns (after PING_WARMUP untimed ones)."""
        ctx = self.ctx
        ready = ctx.Event()  # type: ignore[attr-defined]
        recv_conn, send_conn = ctx.Pipe(duplex=False)  # type: ignore[attr-defined]
        h_ping: Handle
        h_pong: Handle
        if system == SHMQ:
            for name in ("ping", "pong"):
                self.broker.create_queue(name, capacity=SHMQ_CAPACITY, max_bytes=SHMQ_MAX_BYTES)
            h_ping, h_pong = (self.broker.url, "ping"), (self.broker.url, "pong")
        elif system == FF:
            h_ping = faster_fifo.Queue(max_size_bytes=FF_PINGPONG_BYTES)
            h_pong = faster_fifo.Queue(max_size_bytes=FF_PINGPONG_BYTES)
        else:
            h_ping, h_pong = ctx.Queue(), ctx.Queue()  # type: ignore[attr-defined]
        total = PING_WARMUP + pings
        try:
            b = self.children.start(f"{system}-ponger", _ponger, system, h_ping, h_pong, total, ready)
            a = self.children.start(f"{system}-pinger", _pinger, system, h_ping, h_pong, size, total,
                                    ready, send_conn)
            send_conn.close()
            data = self.children.wait([b, a], self.timeout, recv_conn)
        finally:
            recv_conn.close()
            self._release(system, h_ping, ("ping", "pong"))
            if system != SHMQ:
                self._release(system, h_pong, ())
        lat = array("q")
        lat.frombytes(data or b"")
        if len(lat) != total:
            raise TrialError(f"got {len(lat)} round trips, expected {total}")
        return sorted(lat[PING_WARMUP:])

    def _release(self, system: str, handle: Handle, shmq_names: Sequence[str]) -> None:
        if system == SHMQ:
            for name in shmq_names:
                try:
                    self.broker.delete_queue(name)
                except shmq.QueueNotFound:
                    pass
        elif system == MPQ:
            handle.close()


def percentile(sorted_values: Sequence[int], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[idx])


def median(values: Sequence[float | None]) -> float | None:
    ok = [v for v in values if v is not None]
    return statistics.median(ok) if ok else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


# =============================================================== output
class Out:
    def __init__(self) -> None:
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
        if self.console is not None and Table is not None:
            t = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
            for i, h in enumerate(headers):
                t.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
            for r in rows:
                t.add_row(*r)
            self.console.print(t)
            return
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

        def fmt(cells: Sequence[str]) -> str:
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

        print(f"\n{title}")
        print(fmt(headers))
        print("  ".join("-" * w for w in widths))
        for r in rows:
            print(fmt(r))
        if caption:
            print(caption)
        print(flush=True)


def fmt_rate(v: float | None) -> str:
    return "failed" if v is None else f"{v:,.0f}"


def fmt_ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def fmt_us(ns: float | None) -> str:
    return "failed" if ns is None else f"{ns / 1000:.1f}"


def size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


# =============================================================== main
@dataclass
class Results:
    throughput: dict[tuple[str, int, str], list[float | None]] = field(default_factory=dict)
    counts: dict[tuple[str, int], int] = field(default_factory=dict)
    p50: dict[tuple[int, str], list[float | None]] = field(default_factory=dict)
    p99: dict[tuple[int, str], list[float | None]] = field(default_factory=dict)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=None,
                   help="messages per throughput run with 100 B payloads (4 KiB runs use n // 4); "
                        "default 200000, or 20000 with --quick")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per workload; "
                   "the median is reported (default 3, or 1 with --quick)")
    p.add_argument("--pings", type=int, default=None,
                   help="timed round trips per ping-pong run (default 10000, or 2000 with --quick)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--start-method", choices=("fork", "spawn", "forkserver"), default="fork",
                   help="multiprocessing start method for the children (default fork)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one run may take before it is stopped and counted as failed")
    a = p.parse_args(argv)
    a.n = a.n if a.n is not None else (20_000 if a.quick else 200_000)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    a.pings = a.pings if a.pings is not None else (2_000 if a.quick else 10_000)
    if a.n < BATCH or a.rounds < 1 or a.pings < 1:
        p.error(f"--n must be >= {BATCH}, --rounds and --pings >= 1")
    return a


def messages_for(n: int, size: int, batch: int) -> int:
    count = n if size < 1024 else max(batch, n // 4)
    return -(-count // batch) * batch  # whole batches


def run(args: argparse.Namespace, out: Out, bench: Bench, systems: list[str]) -> Results:
    res = Results()
    for workload, batch in WORKLOADS.items():
        for size in SIZES:
            n = messages_for(args.n, size, batch)
            res.counts[(workload, size)] = n
            for rnd in range(1, args.rounds + 1):
                for system in systems:
                    try:
                        v: float | None = bench.throughput(system, size, n, batch)
                        shown = f"{v:>12,.0f} msgs/s"
                    except TrialError as e:
                        v, shown = None, f"FAILED: {e}"
                    res.throughput.setdefault((workload, size, system), []).append(v)
                    out.line(f"  round {rnd}/{args.rounds}  {WORKLOAD_LABELS[workload]:<13} "
                             f"{size_label(size):>6}  n={n:<7} {system:<12} {shown}", style="dim")
    for size in SIZES:
        for rnd in range(1, args.rounds + 1):
            for system in systems:
                p50: float | None
                p99: float | None
                try:
                    lat = bench.latency(system, size, args.pings)
                    p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
                    shown = f"p50 {p50 / 1000:8.1f} us   p99 {p99 / 1000:8.1f} us"
                except TrialError as e:
                    p50 = p99 = None
                    shown = f"FAILED: {e}"
                res.p50.setdefault((size, system), []).append(p50)
                res.p99.setdefault((size, system), []).append(p99)
                out.line(f"  round {rnd}/{args.rounds}  {'ping-pong':<13} {size_label(size):>6}  "
                         f"x{args.pings:<7} {system:<12} {shown}", style="dim")
    return res


def report(args: argparse.Namespace, out: Out, res: Results, systems: list[str]) -> dict[str, Any]:
    peers = [s for s in systems if s != SHMQ]
    med = {k: median(v) for k, v in res.throughput.items()}
    rows = []
    for workload in WORKLOADS:
        for size in SIZES:
            row = [WORKLOAD_LABELS[workload], size_label(size)]
            for s in systems:
                cell = fmt_rate(med.get((workload, size, s)))
                row.append(cell + ("\u2020" if workload == "batch" and s == MPQ else ""))
            for s in peers:
                row.append(fmt_ratio(ratio(med.get((workload, size, SHMQ)), med.get((workload, size, s)))))
            rows.append(row)
    caption = (f"median of {args.rounds} interleaved round(s); msgs/s timed in the consumer; "
               "shmq acks every message, the peers have no ack")
    if MPQ in systems:
        caption += (f"\n\u2020 mp.Queue has no batch API: one list of {BATCH} payloads per put/get, "
                    f"counted as {BATCH} messages")
    out.line()
    out.table("Throughput, msgs/s (1 producer -> 1 consumer)",
              ["workload", "size", *systems, *(f"shmq/{s}" for s in peers)],
              rows, caption)

    m50 = {k: median(v) for k, v in res.p50.items()}
    m99 = {k: median(v) for k, v in res.p99.items()}
    rows = []
    for size in SIZES:
        row = ["ping-pong", size_label(size)]
        for s in systems:
            row.append(f"{fmt_us(m50.get((size, s)))} / {fmt_us(m99.get((size, s)))}")
        for s in peers:
            row.append(f"{fmt_ratio(ratio(m50.get((size, s)), m50.get((size, SHMQ))))} / "
                       f"{fmt_ratio(ratio(m99.get((size, s)), m99.get((size, SHMQ))))}")
        rows.append(row)
    out.line()
    out.table(f"Round-trip latency (p50 / p99 in us, {args.pings} round trips per run)",
              ["workload", "size", *systems, *(f"{s}/shmq" for s in peers)], rows,
              f"median of {args.rounds} round(s) of each run's percentile; "
              "ratio = peer latency / shmq latency (> 1: shmq is faster)")

    single = ratio(med.get(("single", 100, SHMQ)), med.get(("single", 100, FF)))
    batched = ratio(med.get(("batch", 100, SHMQ)), med.get(("batch", 100, FF)))
    targets = [
        ("single message + ack vs faster-fifo one-at-a-time (100 B)", single, 1.0, 1.75),
        ("batched vs faster-fifo get_many (100 B)", batched, 3.0, 5.0),
    ]
    out.line()
    out.line("Targets", style="bold")
    target_json = []
    for label, value, must, aim in targets:
        if value is None:
            why = "faster-fifo not measured" if FF not in systems else "a run failed"
            verdict, style = f"n/a ({why})", "yellow"
        elif value < must:
            verdict, style = f"FAIL (must >= {must:g}x)", "bold red"
        elif value < aim:
            verdict, style = f"pass (>= {must:g}x), below the aim of {aim:g}x", "yellow"
        else:
            verdict, style = f"pass, aim of {aim:g}x reached", "bold green"
        out.line(f"  {label:<58} {fmt_ratio(value):>7}  {verdict}", style=style)
        target_json.append({"target": label, "ratio": value, "must": must, "aim": aim,
                            "ok": None if value is None else value >= must,
                            "aim_reached": None if value is None else value >= aim})

    return {
        "config": {"n": args.n, "rounds": args.rounds, "pings": args.pings, "batch": BATCH,
                   "start_method": args.start_method, "systems": systems, "python": sys.version,
                   "platform": platform.platform(), "cpus": os.cpu_count(),
                   "shmq_version": getattr(shmq, "__version__", "?")},
        "throughput": [
            {"workload": w, "size": size, "system": s, "messages": res.counts[(w, size)],
             "runs_msgs_per_s": runs, "median_msgs_per_s": median(runs),
             "note": "list of 100 payloads per item" if w == "batch" and s == MPQ else None}
            for (w, size, s), runs in res.throughput.items()],
        "latency": [
            {"size": size, "system": s, "round_trips": args.pings,
             "runs_p50_us": [None if v is None else v / 1000 for v in res.p50[(size, s)]],
             "runs_p99_us": [None if v is None else v / 1000 for v in res.p99[(size, s)]],
             "median_p50_us": None if m50[(size, s)] is None else m50[(size, s)] / 1000,  # type: ignore[operator]
             "median_p99_us": None if m99[(size, s)] is None else m99[(size, s)] / 1000}  # type: ignore[operator]
            for (size, s) in res.p50],
        "ratios": {
            f"{w} {size_label(size)} shmq/{p}": ratio(med.get((w, size, SHMQ)), med.get((w, size, p)))
            for w in WORKLOADS for size in SIZES for p in peers},
        "targets": target_json,
    }


def leftovers(instance: str) -> list[str]:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    mine = (f"shmq.{instance}.", f"sem.shmq.{instance}.")
    return sorted(n for n in names if n.startswith(mine))


def _terminate(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Out()
    systems = [SHMQ]
    if faster_fifo is not None:
        systems.append(FF)
    else:
        out.line("faster_fifo is not importable: skipping faster-fifo (pip install faster-fifo)",
                 style="yellow")
    systems.append(MPQ)

    ctx = mp.get_context(args.start_method)
    instance = f"bench{os.getpid()}"
    out.line(f"shmq bench_local: instance shm://{instance}, {os.cpu_count()} cpus, "
             f"start method {args.start_method}, n={args.n} (100 B) / {messages_for(args.n, 4096, 1)} "
             f"(4 KiB), {args.rounds} round(s), {args.pings} pings", style="bold")

    previous = signal.signal(signal.SIGTERM, _terminate)
    children = Children(ctx)
    broker: Any = shmq.connect(f"shm://{instance}")  # an ShmBroker: destroy() is not on api.Broker
    code = 0
    try:
        bench = Bench(ctx, children, broker, args.timeout)
        res = run(args, out, bench, systems)
        data = report(args, out, res, systems)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=2)
            out.line(f"results written to {args.json}")
    except KeyboardInterrupt:
        out.line("interrupted", style="yellow")
        code = 130
    finally:
        children.stop_all()
        broker.destroy()
        signal.signal(signal.SIGTERM, previous)
        left = leftovers(instance)
        if left:
            out.line(f"warning: shared memory left behind: {', '.join(left)}", style="bold red")
            code = code or 1
        alive = mp.active_children()
        if alive:
            out.line(f"warning: child processes still alive: {alive}", style="bold red")
            code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
