"""shmq.mp against multiprocessing.Queue and faster-fifo: the drop-in, object for object.

Run from the repository root::

    python bench/bench_mp.py              # full run: 200k objects per run, 5 rounds
    python bench/bench_mp.py --quick      # smoke run: 20k objects, 1 round

One producer process puts ``--n`` objects (``bytes`` of 100 B; ``--object dict`` puts a
small dict instead), one consumer process gets them; both are children of this script.
Every system pickles as multiprocessing does (faster-fifo's default).  Two workloads:

1. ``single``: one object per ``put`` / ``get`` (``shmq.mp.Queue``, ``multiprocessing.Queue``,
   ``faster_fifo.Queue``).
2. ``batch``: ``put_many`` / ``get_many`` of 100 (shmq.mp and faster-fifo; mp.Queue has no
   batch call and is left out of that row).

Throughput is objects / second timed in the consumer from its first get until it holds
all N.  The rounds interleave the systems (shmq.mp, faster-fifo, mp.Queue, again), and
the table gives each one's median and shmq.mp's ratio to each peer: the box is shared and
noisy, so only the ratios of one run are compared.  Every shmq.mp queue is removed on the
way out and the script checks that /dev/shm holds none.
"""

from __future__ import annotations

import argparse
import multiprocessing as mpm
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
from common import Out, TrialError, fmt_ratio, median, ratio

import shmq
from shmq import mp

try:
    import faster_fifo
    try:  # lets faster_fifo.Queue cross into "spawn" children
        import faster_fifo_reduction  # noqa: F401
    except ImportError:
        pass
except ImportError:  # pragma: no cover - faster-fifo is in the bench extra
    faster_fifo = None

SHMQ, FF, MPQ = "shmq.mp", "faster-fifo", "mp.Queue"
BATCH = 100
TIMEOUT = 3600.0  # faster-fifo's get needs one; a hang is caught by the parent's run timeout
OBJECTS = {"bytes": b"x" * 100, "dict": {"id": 12345, "user": "alice", "tags": ["a", "b"], "v": 1.5}}


# ------------------------------------------------------------------ children
def _producer(system: str, q: Any, n: int, obj: Any, batch: int, ready: Any) -> None:
    common.wait_ready(ready)
    if batch > 1:
        chunk = [obj] * batch
        for _ in range(n // batch):
            q.put_many(chunk, True, TIMEOUT) if system == FF else q.put_many(chunk)
    elif system == FF:
        for _ in range(n):
            q.put(obj, True, TIMEOUT)
    else:
        put = q.put
        for _ in range(n):
            put(obj)


def _consumer(system: str, q: Any, n: int, batch: int, ready: Any, result: Any) -> None:
    ready.set()
    got = 0
    if batch > 1:
        many = q.get_many
        first = many(max_messages_to_get=batch, timeout=TIMEOUT) if system == FF else many(max_messages=batch)
        t0 = time.perf_counter()
        got = len(first)
        while got < n:
            got += len(many(max_messages_to_get=batch, timeout=TIMEOUT) if system == FF
                       else many(max_messages=batch))
    else:
        get = q.get
        if system == FF:
            get(True, TIMEOUT)
            t0 = time.perf_counter()
            for _ in range(n - 1):
                get(True, TIMEOUT)
        else:
            get()
            t0 = time.perf_counter()
            for _ in range(n - 1):
                get()
        got = n
    result.value = (got - 1) / (time.perf_counter() - t0) if got > 1 else 0.0


# ------------------------------------------------------------------ parent
def _make(system: str) -> Any:
    if system == SHMQ:
        return mp.Queue()
    if system == FF:
        return faster_fifo.Queue(max_size_bytes=16 << 20)
    return mpm.Queue()


def throughput(children: common.Children, ctx: Any, system: str, n: int, obj: Any, batch: int,
               timeout: float) -> float:
    ready = ctx.Event()
    result = ctx.Value("d", 0.0)
    q = _make(system)
    try:
        cons = children.start(f"{system}-consumer", _consumer, system, q, n, batch, ready, result)
        prod = children.start(f"{system}-producer", _producer, system, q, n, obj, batch, ready)
        children.wait([cons, prod], timeout)
    finally:
        if system != FF:
            q.close()
    return float(result.value)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def own(p: argparse.ArgumentParser) -> None:
        p.add_argument("--object", choices=sorted(OBJECTS), default="bytes",
                       help="what is put: 100 bytes (default) or a small dict")
    p, a = common.parse_bench_args(argv, __doc__, n=(200_000, 20_000), pings=(0, 0), processes="children",
                                   n_help="objects per run (default 200000, or 20000 with --quick)",
                                   after_json=own)
    if a.n < BATCH or a.rounds < 1:
        p.error(f"--n must be >= {BATCH} and --rounds >= 1")
    a.n -= a.n % BATCH
    if not a.quick and "--rounds" not in " ".join(argv or sys.argv):
        a.rounds = 5
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Out(label_columns=1)
    systems = [SHMQ] + ([FF] if faster_fifo is not None else []) + [MPQ]
    if faster_fifo is None:
        out.line("faster_fifo is not importable: skipping faster-fifo (pip install faster-fifo)",
                 style="yellow")
    ctx = mpm.get_context(args.start_method)
    mpm.set_start_method(args.start_method, force=True)  # the queues' own context
    children = common.Children(ctx)
    obj = OBJECTS[args.object]
    out.line(f"shmq bench_mp: {args.n} objects ({args.object}) per run, {args.rounds} round(s), "
             f"{os.cpu_count()} cpus, start method {args.start_method}")
    runs: dict[tuple[str, str], list[float | None]] = {}
    try:
        for rnd in range(1, args.rounds + 1):
            for workload, batch in (("single", 1), ("batch", BATCH)):
                for system in systems:
                    if batch > 1 and system == MPQ:
                        continue
                    v: float | None
                    try:
                        v = throughput(children, ctx, system, args.n, obj, batch, args.timeout)
                        shown = common.fmt_progress_rate(v)
                    except TrialError as e:
                        v, shown = None, f"FAILED: {e}"
                    runs.setdefault((workload, system), []).append(v)
                    out.line(f"  round {rnd}/{args.rounds}  {workload:<7} {system:<12} {shown}", style="dim")
    finally:
        children.stop_all()
    med = {k: median(v) for k, v in runs.items()}
    peers = [s for s in systems if s != SHMQ]
    rows = []
    for workload in ("single", "batch"):
        rows.append([workload, *(common.fmt_rate(med.get((workload, s))) if (workload, s) in med else "-"
                                 for s in systems),
                     *(fmt_ratio(ratio(med.get((workload, SHMQ)), med.get((workload, p))))
                       if (workload, p) in med else "-" for p in peers)])
    out.line()
    out.table(f"Throughput, objects/s (1 producer -> 1 consumer, {args.object})",
              ["workload", *systems, *(f"shmq.mp/{p}" for p in peers)], rows,
              f"median of {args.rounds} interleaved round(s); objects/s timed in the consumer")
    vs_mp = ratio(med.get(("single", SHMQ)), med.get(("single", MPQ)))
    vs_ff = ratio(med.get(("single", SHMQ)), med.get(("single", FF)))
    out.targets_heading()
    targets = [("one object per call vs multiprocessing.Queue (must 2x)", vs_mp, 2.0, 2.0),
               ("one object per call vs faster-fifo (aim: at least as fast)", vs_ff, 1.0, 1.0)]
    failed = False
    for label, value, must, aim in targets:
        verdict, style = common.ratio_verdict(value, must, aim, "not measured")
        failed |= value is not None and value < must
        out.line(f"  {label:<60} {fmt_ratio(value):>7}  {verdict}", style=style)
    if args.json:
        common.write_json(out, args.json, {
            "config": {"n": args.n, "rounds": args.rounds, "object": args.object, "systems": systems,
                       "start_method": args.start_method, "python": sys.version,
                       "platform": platform.platform(), "cpus": os.cpu_count(),
                       "shmq_version": shmq.__version__},
            "runs_objects_per_s": {f"{w} {s}": v for (w, s), v in runs.items()},
            "median_objects_per_s": {f"{w} {s}": v for (w, s), v in med.items()},
            "targets": [common.ratio_target_json(label, value, must, aim)
                        for label, value, must, aim in targets]})
    left = [n for n in os.listdir("/dev/shm") if f".{mp.INSTANCE_PREFIX}{os.getpid()}-" in n]
    if left:
        out.line(f"left in /dev/shm: {left}", style="bold red")
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
