"""Co-located throughput and latency: shmq against multiprocessing.Queue and faster-fifo.

Run from the repository root::

    python bench/bench_local.py              # full run: 200k msgs (100 B), 50k (4 KiB), 6250 (64 KiB)
    python bench/bench_local.py --quick      # smoke run: 20k msgs, 1 round, 2k pings
    python bench/bench_local.py --json out.json --rounds 5

Every measurement is one producer process and one consumer process (children of
this script; the parent only coordinates).  Workloads:

Payloads of 100 B, 4 KiB and 64 KiB (a large message is one copy each way: its row shows
the memcpy, not a loop over chunks).

1. ``single``: one message per call.  shmq: ``put`` / ``get`` + ``msg.ack()``.
   Peers: ``multiprocessing.Queue`` and ``faster_fifo.Queue`` ``put`` / ``get``
   (they have no acknowledgement).
2. ``batch``: batches of 100.  shmq: ``put_many`` / ``get_many(100)`` + ``ack_many``.
   faster-fifo: ``put_many`` / ``get_many(max_messages_to_get=100)``.
   mp.Queue has no batch API: it puts one *list of 100 payloads* per call and
   the list counts as 100 messages (marked with a dagger in the table).
3. ``ping-pong``: round-trip latency over two queues (ping, pong); process A
   puts on ping, B gets, puts the payload on pong and acks ping, A gets; timed from
   A's put until its get returns (shmq's A acks the answer after that).
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
import multiprocessing as mp
import os
import platform
import signal
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
from common import BATCH, SHMQ, WORKLOAD_LABELS, WORKLOADS, Out, TrialError, fmt_ratio, median, ratio

import shmq
import shmq.accel

try:
    import faster_fifo

    try:  # lets faster_fifo.Queue cross into "spawn" children
        import faster_fifo_reduction  # noqa: F401
    except ImportError:
        pass
except ImportError:
    faster_fifo = None


FF, MPQ = "faster-fifo", "mp.Queue"
SIZES = (100, 4096, 65536)

FF_MAX_BYTES = 64 << 20
FF_PINGPONG_BYTES = 4 << 20
PEER_TIMEOUT = 3600.0  # faster-fifo's put/get need a timeout; hangs are caught by the parent

Handle = Any  # (url, queue name) for shmq, the queue object itself for the peers


# =============================================================== children (hot loops)
def _open(system: str, handle: Handle) -> tuple[Any, Callable[[], None]]:
    if system == SHMQ:
        url, name = handle
        broker = shmq.connect(url)
        return broker.queue(name), broker.close
    return handle, lambda: None


def _producer(system: str, handle: Handle, n: int, size: int, batch: int, ready: Any, start: Any) -> None:
    q, close = _open(system, handle)
    try:
        payload = b"x" * size
        chunk = [payload] * batch
        common.wait_ready(ready)
        start.value = time.monotonic_ns()
        if system == SHMQ:
            common.shmq_produce(q, payload, n, batch)
        elif system == FF:
            if batch == 1:
                put = q.put
                for _ in range(n):
                    put(payload, True, PEER_TIMEOUT)
            else:
                put_many = q.put_many
                for _ in range(n // batch):
                    put_many(chunk, True, PEER_TIMEOUT)
        else:  # mp.Queue: the plain blocking put, of one list of `batch` payloads per item when batched
            put = q.put
            item = payload if batch == 1 else chunk
            for _ in range(n // batch):
                put(item)
    finally:
        close()


def _consumer(system: str, handle: Handle, n: int, batch: int, size: int, ready: Any, start: Any,
              result: Any) -> None:
    q, close = _open(system, handle)
    try:
        ready.set()
        got = 0
        last: Any = None
        if system == SHMQ:
            got, last = common.shmq_consume(q, n, batch)
        elif batch == 1:
            get = q.get
            if system == FF:
                for _ in range(n):
                    last = get(True, PEER_TIMEOUT)
            else:
                for _ in range(n):
                    last = get()
            got = n
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
        put, get = ping.put, pong.get
        common.wait_ready(ready)
        if system == SHMQ:
            lat = common.shmq_ping(put, get, payload, total)
        else:
            lat = array("q", bytes(8 * total))
            clock = time.perf_counter_ns
            if system == FF:
                for i in range(total):
                    t0 = clock()
                    put(payload, True, PEER_TIMEOUT)
                    get(True, PEER_TIMEOUT)
                    lat[i] = clock() - t0
            else:
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
        get, put = ping.get, pong.put
        if system == SHMQ:
            common.shmq_pong(get, put, total)
        elif system == FF:
            for _ in range(total):
                put(get(True, PEER_TIMEOUT), True, PEER_TIMEOUT)
        else:
            for _ in range(total):
                put(get())
    finally:
        close_pong()
        close_ping()


# =============================================================== parent: measurements
@dataclass
class Bench:
    ctx: mp.context.BaseContext
    children: common.Children
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
            common.create_queues(self.broker, ("bench",))
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
        return common.rate(result, n)

    def latency(self, system: str, size: int, pings: int) -> list[int]:
        """One run: ``pings`` round-trip times in ns (after PING_WARMUP untimed ones)."""
        ctx = self.ctx
        ready = ctx.Event()  # type: ignore[attr-defined]
        recv_conn, send_conn = ctx.Pipe(duplex=False)  # type: ignore[attr-defined]
        h_ping: Handle
        h_pong: Handle
        if system == SHMQ:
            common.create_queues(self.broker, ("ping", "pong"))
            h_ping, h_pong = (self.broker.url, "ping"), (self.broker.url, "pong")
        elif system == FF:
            h_ping = faster_fifo.Queue(max_size_bytes=FF_PINGPONG_BYTES)
            h_pong = faster_fifo.Queue(max_size_bytes=FF_PINGPONG_BYTES)
        else:
            h_ping, h_pong = ctx.Queue(), ctx.Queue()  # type: ignore[attr-defined]
        total = common.PING_WARMUP + pings
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
        return common.round_trips(data, total)

    def _release(self, system: str, handle: Handle, shmq_names: Sequence[str]) -> None:
        if system == SHMQ:
            common.delete_queues(self.broker, shmq_names)
        elif system == MPQ:
            handle.close()


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
    p, a = common.parse_bench_args(argv, __doc__, n=(200_000, 20_000), pings=(10_000, 2_000),
                                   processes="children",
                                   n_help="messages per throughput run with 100 B payloads (4 KiB runs use "
                                          "n // 4, 64 KiB runs n // 32); default 200000, or 20000 with "
                                          "--quick")
    if a.n < BATCH or a.rounds < 1 or a.pings < 1:
        p.error(f"--n must be >= {BATCH}, --rounds and --pings >= 1")
    return a


def messages_for(n: int, size: int, batch: int) -> int:
    count = n if size < 1024 else max(batch, n // 4 if size <= 4096 else n // 32)
    return -(-count // batch) * batch  # whole batches


def run(args: argparse.Namespace, out: Out, bench: Bench, systems: list[str]) -> Results:
    res = Results()
    for workload, batch in WORKLOADS.items():
        for size in SIZES:
            n = messages_for(args.n, size, batch)
            res.counts[(workload, size)] = n
            for rnd in range(1, args.rounds + 1):
                for system in systems:
                    v: float | None
                    try:
                        v = bench.throughput(system, size, n, batch)
                        shown = common.fmt_progress_rate(v)
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
                    p50, p99, shown = common.p50_p99(bench.latency(system, size, args.pings))
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
            cells = common.rate_cells(med, [(workload, size, s) for s in systems], (workload, size, SHMQ))
            if workload == "batch" and MPQ in systems:
                cells[systems.index(MPQ)] += "\u2020"
            rows.append([WORKLOAD_LABELS[workload], size_label(size), *cells])
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
    rows = [["ping-pong", size_label(size),
             *common.latency_cells(m50, m99, [(size, s) for s in systems], (size, SHMQ))] for size in SIZES]
    out.line()
    out.table(f"Round-trip latency (p50 / p99 in us, {args.pings} round trips per run)",
              ["workload", "size", *systems, *(f"{s}/shmq" for s in peers)], rows,
              f"median of {args.rounds} round(s) of each run's percentile; "
              "ratio = peer latency / shmq latency (> 1: shmq is faster)")

    single = ratio(med.get(("single", 100, SHMQ)), med.get(("single", 100, FF)))
    batched = ratio(med.get(("batch", 100, SHMQ)), med.get(("batch", 100, FF)))
    targets = [
        # issue 22's targets (must, aim)
        ("single message + ack vs faster-fifo one-at-a-time (100 B)", single, 1.75, 2.5),
        ("batched vs faster-fifo get_many (100 B)", batched, 5.0, 8.0),
    ]
    out.targets_heading()
    why_na = "faster-fifo not measured" if FF not in systems else "a run failed"
    target_json = []
    for label, value, must, aim in targets:
        verdict, style = common.ratio_verdict(value, must, aim, why_na)
        out.line(f"  {label:<58} {fmt_ratio(value):>7}  {verdict}", style=style)
        target_json.append(common.ratio_target_json(label, value, must, aim))

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
             **common.latency_json(res.p50[(size, s)], res.p99[(size, s)])}
            for (size, s) in res.p50],
        "ratios": {
            f"{w} {size_label(size)} shmq/{p}": ratio(med.get((w, size, SHMQ)), med.get((w, size, p)))
            for w in WORKLOADS for size in SIZES for p in peers},
        "targets": target_json,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Out(label_columns=2)
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
             f"(4 KiB) / {messages_for(args.n, 65536, 1)} (64 KiB), {args.rounds} round(s), "
             f"{args.pings} pings; {shmq.accel.describe()}", style="bold")

    previous = signal.signal(signal.SIGTERM, common.terminate)
    children = common.Children(ctx)
    broker: Any = shmq.connect(f"shm://{instance}")  # an ShmBroker: destroy() is not on api.Broker
    code = 0
    try:
        bench = Bench(ctx, children, broker, args.timeout)
        res = run(args, out, bench, systems)
        data = report(args, out, res, systems)
        if args.json:
            common.write_json(out, args.json, data)
    except KeyboardInterrupt:
        out.line("interrupted", style="yellow")
        code = 130
    finally:
        children.stop_all()
        broker.destroy()
        signal.signal(signal.SIGTERM, previous)
        code = common.check_clean(out, instance, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
