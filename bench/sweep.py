"""The sweeps behind the benchmark plots, interleaved, written as one results file, then plotted.

Run from the repository root (``make bench`` runs it last)::

    python bench/sweep.py            # 3 rounds -> bench/results/<date>-<host>.json and its PNGs
    python bench/sweep.py --quick    # 1 round, a fifth of the messages: a smoke run
    python bench/sweep.py --rounds 5 --out R.json --plots DIR

Four figures; each point is the median of ``--rounds`` rounds, and every round runs each
series of a figure in turn at that point, so what one figure compares is interleaved:

1. ``throughput_vs_size``: payloads of 64 B ... 64 KiB in batches of 100, one producer
   process -> one consumer process.  shmq shm (co-located: ``put_many`` / ``get_many`` +
   ``ack_many`` on the shared memory), shmq tcp (the same through ``shmq serve --workers 2``
   on loopback), faster-fifo (``put_many`` / ``get_many``, pickled), and Redis lists (one
   LPUSH of 100 values; pipelined BRPOP + RPOP 99) when a ``redis-server`` binary is on
   PATH (or given with ``--redis-server``); without one the figure says Redis was not
   measured.  Nothing is installed.
2. ``throughput_vs_batch``: 100 B in batches of 1 ... 1000 (1: ``put`` / ``get`` + ``ack``),
   shmq shm and shmq tcp.
3. ``latency_cdf``: ping-pong round trips of 100 B (bench_local's and bench_tcp's ping-pong):
   shmq shm, shmq tcp, faster-fifo, mp.Queue (and Redis lists with a redis-server); each
   run's quantiles, the median over the rounds.
4. ``throughput_vs_workers``: ``shmq serve --workers W`` for W = 1 ... the CPU count, 2
   producers + 2 consumers, one message per call + ack (bench_tcp's scaling workload).

The measurements are bench_local.py's and bench_tcp.py's own (the same child processes and
timing).  The results file's schema is in bench/resultfile.py; bench/plot.py redraws the
plots from it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import bench_local
import bench_tcp
import common
import plot
import resultfile
from common import SHMQ, Out, TrialError, median

import shmq

SIZES = (64, 256, 1024, 4096, 16384, 65536)
SIZE_BATCH = 100
BATCHES = (1, 10, 100, 1000)
LAT_SIZE = 100
LEVELS = (0.001, 0.005, 0.01, 0.02, 0.05, *(k / 20 for k in range(2, 19)), 0.95, 0.98, 0.99, 0.995, 0.999)
REDIS_LABEL = "Redis lists"
NO_REDIS = {"Redis": "no redis-server"}


def _round_up(n: float, step: int) -> int:
    return max(step, -(-int(n) // step) * step)


def size_messages(size: int, scale: float) -> int:
    """Messages per run of the size sweep: about 64 MiB of payload, 1,000 to 200,000 messages."""
    return _round_up(scale * min(200_000, max(1_000, (64 << 20) // size)), SIZE_BATCH)


def batch_messages(batch: int, tcp: bool, scale: float) -> int:
    """Messages per run of the batch sweep: a number of calls, capped (tcp is ~10x slower per call)."""
    calls, cap = (3_000, 200_000) if tcp else (30_000, 400_000)
    return _round_up(scale * min(cap, calls * batch), batch)


# =============================================================== sweeps
Series = dict[str, Callable[[int], float]]


def sweep(out: Out, what: str, xs: Sequence[int], series: Series, rounds: int,
          counts: Callable[[str, int], int]) -> list[dict[str, Any]]:
    """Run every series at every x, ``rounds`` times, interleaved; their JSON entries."""
    runs: dict[str, dict[int, list[float | None]]] = {name: {x: [] for x in xs} for name in series}
    for x in xs:
        for rnd in range(1, rounds + 1):
            for name, fn in series.items():
                v: float | None
                try:
                    v = fn(x)
                    shown = common.fmt_progress_rate(v)
                except TrialError as e:
                    v, shown = None, f"FAILED: {e}"
                runs[name][x].append(v)
                out.line(f"  {what:<8} x={x:<6} round {rnd}/{rounds}  {name:<14} n={counts(name, x):<7} "
                         f"{shown}", style="dim")
    return [_series(name, xs, [runs[name][x] for x in xs], [counts(name, x) for x in xs]) for name in series]


def _series(name: str, xs: Sequence[float], runs: Sequence[Sequence[float | None]],
            messages: Sequence[int] | None = None) -> dict[str, Any]:
    ok = [[v for v in r if v is not None] for r in runs]
    s: dict[str, Any] = {"name": name, "x": list(xs), "median": [median(r) for r in runs],
                         "min": [min(o) if o else None for o in ok],
                         "max": [max(o) if o else None for o in ok],
                         "runs": [list(r) for r in runs]}
    if messages is not None:
        s["messages"] = list(messages)
    return s


def latency_sweep(out: Out, systems: dict[str, Callable[[], list[int]]], rounds: int) -> list[dict[str, Any]]:
    """Every system's ping-pong, ``rounds`` times interleaved; per system the round-trip time (µs)
    at each of LEVELS: the median over the rounds, and the spread."""
    per: dict[str, list[list[float | None]]] = {name: [] for name in systems}
    for rnd in range(1, rounds + 1):
        for name, fn in systems.items():
            try:
                lat = fn()
                qs: list[float | None] = [common.percentile(lat, q) / 1000 for q in LEVELS]
                shown = common.p50_p99(lat)[2]
            except TrialError as e:
                qs, shown = [None] * len(LEVELS), f"FAILED: {e}"
            per[name].append(qs)
            out.line(f"  ping-pong round {rnd}/{rounds}  {name:<14} {shown}", style="dim")
    return [_series(name, LEVELS, [[r[i] for r in per[name]] for i in range(len(LEVELS))])
            for name in systems]


# =============================================================== main
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds per point (default 3, 1 with --quick)")
    p.add_argument("--scale", type=float, default=None,
                   help="multiply every message count (default 1, 0.2 with --quick)")
    p.add_argument("--pings", type=int, default=None, help="timed round trips per ping-pong run "
                   "(default 5000, 1000 with --quick)")
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--workers", type=int, default=2, help="shmq serve workers for figures 1-3 (default 2)")
    p.add_argument("--max-workers", type=int, default=os.cpu_count() or 1,
                   help="figure 4 runs 1 ... this many workers (default: the CPU count)")
    p.add_argument("--redis-server", default=shutil.which("redis-server"),
                   help="the redis-server binary (default: the one on PATH, if any); none: no Redis series")
    p.add_argument("--figures", default=",".join(resultfile.FIGURES),
                   help="comma-separated subset of: " + ", ".join(resultfile.FIGURES))
    p.add_argument("--out", help="the results file (default bench/results/<date>-<host>.json)")
    p.add_argument("--plots", help="folder for the PNGs (default: beside the results file, named like it)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    a = p.parse_args(argv)
    a.rounds = a.rounds if a.rounds is not None else (1 if a.quick else 3)
    a.scale = a.scale if a.scale is not None else (0.2 if a.quick else 1.0)
    a.pings = a.pings if a.pings is not None else (1000 if a.quick else 5000)
    a.figures = [f.strip() for f in a.figures.split(",") if f.strip()]
    bad = [f for f in a.figures if f not in resultfile.FIGURES]
    if bad or a.rounds < 1 or a.scale <= 0 or a.pings < 1 or a.workers < 1 or a.max_workers < 1:
        p.error(f"unknown figure(s) {bad}" if bad else "--rounds, --pings, --workers, --max-workers >= 1, "
                "--scale > 0")
    return a


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def measure(a: argparse.Namespace, out: Out, local: bench_local.Bench, tcp: bench_tcp.Bench,
            has_redis: bool) -> dict[str, Any]:
    figs: dict[str, Any] = {}
    ff = bench_local.faster_fifo is not None
    nm = {} if has_redis else dict(NO_REDIS)
    if not ff:
        nm["faster-fifo"] = "faster_fifo not importable"
    tcp_note = f"shmq tcp: shmq serve --workers {a.workers} on 127.0.0.1"
    if "throughput_vs_size" in a.figures:
        series: Series = {
            "shmq shm": lambda s: local.throughput(SHMQ, s, size_messages(s, a.scale), SIZE_BATCH),
            "shmq tcp": lambda s: tcp.throughput(SHMQ, size_messages(s, a.scale), SIZE_BATCH, size=s)[0]}
        if ff:
            series["faster-fifo"] = lambda s: local.throughput(bench_local.FF, s, size_messages(s, a.scale),
                                                               SIZE_BATCH)
        if has_redis:
            series[REDIS_LABEL] = lambda s: tcp.throughput(bench_tcp.RLIST, size_messages(s, a.scale),
                                                           SIZE_BATCH, size=s)[0]
        figs["throughput_vs_size"] = {
            "title": f"Throughput vs payload size (batches of {SIZE_BATCH}, 1 producer -> 1 consumer)",
            "x_label": "payload size (bytes, log scale)", "y_label": "throughput (msgs/s, log scale)",
            "note": f"median of {a.rounds} interleaved round(s), bars: min-max; shmq acks every message "
                    f"(ack_many), the peers have no ack; {tcp_note}"
                    + ("; Redis lists: LPUSH of 100 values, pipelined BRPOP + RPOP 99" if has_redis else ""),
            "series": sweep(out, "size", SIZES, series, a.rounds, lambda _n, s: size_messages(s, a.scale)),
            "not_measured": nm}
    if "throughput_vs_batch" in a.figures:
        series = {"shmq shm": lambda b: local.throughput(SHMQ, 100, batch_messages(b, False, a.scale), b),
                  "shmq tcp": lambda b: tcp.throughput(SHMQ, batch_messages(b, True, a.scale), b)[0]}
        figs["throughput_vs_batch"] = {
            "title": "shmq throughput vs batch size (100 B, 1 producer -> 1 consumer)",
            "x_label": "messages per put_many / get_many + ack_many call (log scale; 1: put / get + ack)",
            "y_label": "throughput (msgs/s, log scale)",
            "note": f"median of {a.rounds} interleaved round(s), bars: min-max; {tcp_note}",
            "series": sweep(out, "batch", BATCHES, series, a.rounds,
                            lambda name, b: batch_messages(b, name == "shmq tcp", a.scale)),
            "not_measured": {}}
    if "latency_cdf" in a.figures:
        systems: dict[str, Callable[[], list[int]]] = {
            "shmq shm": lambda: local.latency(SHMQ, LAT_SIZE, a.pings),
            "shmq tcp": lambda: tcp.latency(SHMQ, a.pings)[0]}
        if ff:
            systems["faster-fifo"] = lambda: local.latency(bench_local.FF, LAT_SIZE, a.pings)
        systems["mp.Queue"] = lambda: local.latency(bench_local.MPQ, LAT_SIZE, a.pings)
        if has_redis:
            systems[REDIS_LABEL] = lambda: tcp.latency(bench_tcp.RLIST, a.pings)[0]
        figs["latency_cdf"] = {
            "title": f"Ping-pong round-trip latency, CDF ({LAT_SIZE} B, {a.pings:,} round trips per run)",
            "x_label": "round-trip time (µs, log scale)", "y_label": "fraction of round trips at or below",
            "note": f"per quantile the median of {a.rounds} interleaved round(s), band: min-max; shmq acks "
                    f"ping and pong; {tcp_note}, pinger and ponger on one worker"
                    + ("; Redis lists: LPUSH / BRPOP" if has_redis else ""),
            "series": latency_sweep(out, systems, a.rounds), "not_measured": nm}
    if "throughput_vs_workers" in a.figures:
        n = _round_up(20_000 * a.scale, 2)
        ws = list(range(1, a.max_workers + 1))
        cpus = os.cpu_count()
        series = {"shmq tcp (2 producers + 2 consumers)": lambda w: tcp.scaling(w, n, True)[0]}
        figs["throughput_vs_workers"] = {
            "title": "shmq TCP throughput vs broker workers (1 msg / call + ack, 100 B)",
            "x_label": f"shmq serve --workers (1 ... {a.max_workers}; this machine has {cpus} CPUs)",
            "y_label": "total throughput (msgs/s)",
            "note": f"limited to 1 ... {a.max_workers} workers: this machine has {cpus} CPUs, shared by the "
                    f"workers, the supervisor and the 4 client processes; median of {a.rounds} "
                    "interleaved round(s), bars: min-max; producer i and consumer i on worker i % W",
            "series": sweep(out, "workers", ws, series, a.rounds, lambda _n, _w: n), "not_measured": {}}
    return figs


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = Out(label_columns=1)
    started, machine, path = resultfile.begin(a.out)
    has_redis = bool(a.redis_server) and bench_tcp.redis is not None
    if not has_redis:
        out.line("no redis-server (or no redis-py): the Redis series are left out and the plots say so",
                 style="yellow")
    previous = signal.signal(signal.SIGTERM, common.terminate)
    ctx = mp.get_context("fork")
    children = common.Children(ctx)
    instance = f"sweep{os.getpid()}"
    broker: Any = shmq.connect(f"shm://{instance}")
    servers: dict[int, bench_tcp.ShmqServer] = {}
    rserver: bench_tcp.RedisServer | None = None
    code = 0
    try:
        wanted = set(range(1, a.max_workers + 1)) if "throughput_vs_workers" in a.figures else set()
        for w in sorted(wanted | {a.workers}):
            servers[w] = bench_tcp.ShmqServer(w, f"s{w}")
            servers[w].start()
        if has_redis:
            rserver = bench_tcp.RedisServer(a.redis_server)
            rserver.start()
        out.line(f"shmq sweep: {os.cpu_count()} cpus, {a.rounds} round(s), scale {a.scale:g}, "
                 f"{a.pings} pings, figures {', '.join(a.figures)} -> {path}", style="bold")
        local = bench_local.Bench(ctx, children, broker, a.timeout)
        tcp = bench_tcp.Bench(ctx, children, servers, a.workers, rserver, a.timeout,
                              *bench_tcp.placement("broker", a.workers))
        figures = measure(a, out, local, tcp, has_redis)
        machine["load_avg_end"] = [round(v, 2) for v in os.getloadavg()]
        machine["versions"] = {"faster-fifo": _version("faster-fifo"), "redis-py": _version("redis"),
                               "redis-server": rserver.version if rserver else None}
        command = ["python", "bench/sweep.py", *(sys.argv[1:] if argv is None else argv)]
        data = {"schema": resultfile.SCHEMA, "date": started, "command": shlex.join(command),
                "machine": machine,
                "config": {"rounds": a.rounds, "scale": a.scale, "pings": a.pings, "workers": a.workers,
                           "max_workers": a.max_workers, "sizes": list(SIZES), "size_batch": SIZE_BATCH,
                           "batches": list(BATCHES), "latency_size": LAT_SIZE, "start_method": "fork"},
                "figures": figures}
        resultfile.write(path, data)
        out.line(f"results written to {path}")
        for p in plot.render(data, a.plots or path.with_suffix("")):
            out.line(f"plot written to {p}")
    except bench_tcp.SetupError as e:
        out.line(f"error: {e}", style="bold red")
        code = 1
    except KeyboardInterrupt:
        out.line("interrupted", style="yellow")
        code = 130
    finally:
        children.stop_all()
        broker.destroy()
        if rserver is not None:
            rserver.stop()
        if bench_tcp.stop_servers(out, servers):
            code = code or 1
        signal.signal(signal.SIGTERM, previous)
        code = common.check_clean(out, instance, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
