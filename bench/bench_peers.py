"""shmq against the brokers users compare it with (NATS JetStream, RabbitMQ, Redis Streams) and the
raw transports (ZeroMQ, iceoryx2), every peer interleaved in rounds, in one run.

Run from the repository root (``make bench`` installs the peers first)::

    python bench/bench_peers.py              # 3 rounds: 5,000 msgs a broker run, 200,000 a co-located one
    python bench/bench_peers.py --quick      # smoke run: 1 round, small counts
    python bench/bench_peers.py --peers nats,zmq --rounds 5

Every figure is one producer process -> one consumer process (or a pinger and a ponger), children
of this script, on this host; the servers run on 127.0.0.1 (bench/peers/: one module a peer, each
started and stopped here by pid, its data in a temp dir).  shmq runs as ``shmq serve --workers 2``
over tcp:// and unix://, and co-located over shm:// (no broker), with the shapes of
bench_tcp.py and bench_local.py: ``put`` / ``get`` + ``msg.ack()``, every put and ack waited for.

Workloads (100 B unless the size says otherwise):

1. work queue: one message a call, each acked (and the ack waited for where the peer can: an AMQP
   ack has no answer, and the raw transports have no ack at all); every variant of every peer,
   the table saying its durability, puts and acks;
2. throughput vs payload size (100 B, 4 KiB, 64 KiB), one variant a peer;
3. throughput vs batch size (1, 10, 100 messages a call) where the peer has batches;
4. ping-pong: A sends, B answers, A waits; p50 and p99 of the round trips (µs), after 200 untimed.

For each point, every round runs each series in turn; the tables show medians over the rounds.
The must-reach targets of issue 37 come last, each with the peer variant it was measured against
(the fastest of that peer's variants that fit it).  A peer that cannot be had is reported as
"not measured: <why>", never faked.  The results are written in bench/resultfile.py's format
(``bench/results/<date>-<host>-peers.json``, with the plots beside it), with each peer's version
and settings.  The peers' Python clients limit them as much as their servers do (and shmq's
client is Python too): the figures compare Python programs using each system.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
import peers
import plot
import resultfile
from common import Out, TrialError, fmt_ratio, median, ratio
from peers import Peer, Variant
from sweep import LEVELS, _series

SIZE = 100
SIZES = (100, 4096, 65536)
BATCHES = (1, 10, 100)
SHMQ = "shmq"
SHMQ_TCP, SHMQ_CHAINED, SHMQ_SHM = "tcp, get + ack", "tcp, get(ack=previous)", "shm, get + ack"
SHMQ_PING = {"tcp": "tcp", "unix": "unix", "ipc": "unix", "shm": "shm"}  # a peer's transport -> shmq's
CLIENTS = ("every system through its Python client (shmq's, nats-py on asyncio, pika's BlockingConnection, "
           "redis-py, pyzmq, iceoryx2's bindings): the clients limit these figures as much as the servers do")

Point = tuple[str, int, int]  # ("wq", size, batch) or ("ping", size, 0)
Key = tuple[Point, str, str]  # point, peer name, variant


# =============================================================== options
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, 1 with --quick)")
    p.add_argument("--n-tcp", type=int, default=None, help="messages a broker run (TCP / unix://) of 100 B "
                   "(default 5000, 500 with --quick); 4 KiB runs n // 4, 64 KiB n // 32, batched runs 2n")
    p.add_argument("--n-local", type=int, default=None, help="messages a co-located or raw-transport run "
                   "(default 200000, 20000 with --quick)")
    p.add_argument("--pings", type=int, default=None, help="timed round trips a ping-pong run "
                   "(default 2000, 300 with --quick)")
    p.add_argument("--sizes", default=None, help="payload sizes of the size figure (default 100,4096,65536; "
                   "100,4096 with --quick)")
    p.add_argument("--batches", default=None, help="batch sizes of the batch figure (default 1,10,100; 1,100 "
                   "with --quick)")
    names = ", ".join(m.removeprefix("peer_") for m in peers.REGISTRY)
    p.add_argument("--peers", default=None, help=f"comma-separated subset of: {names} (default: all)")
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--out", help="the results file (default bench/results/<date>-<host>-peers.json)")
    p.add_argument("--plots", help="folder for the PNGs (default: beside the results file, named like it)")
    p.add_argument("--no-plots", action="store_true", help="write the results file, draw no PNGs")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one run may take")
    a = p.parse_args(argv)
    q = a.quick
    a.rounds = a.rounds if a.rounds is not None else (1 if q else 3)
    a.n_tcp = a.n_tcp if a.n_tcp is not None else (500 if q else 5000)
    a.n_local = a.n_local if a.n_local is not None else (20_000 if q else 200_000)
    a.pings = a.pings if a.pings is not None else (300 if q else 2000)
    a.sizes = _ints(p, a.sizes, "100,4096" if q else "100,4096,65536", "--sizes")
    a.batches = _ints(p, a.batches, "1,100" if q else "1,10,100", "--batches")
    wanted = [f"peer_{s.strip()}" for s in (a.peers or "").split(",") if s.strip()]
    bad = [w for w in wanted if w not in peers.REGISTRY]
    if bad:
        p.error(f"unknown peer(s): {', '.join(b.removeprefix('peer_') for b in bad)} (known: {names})")
    a.modules = ["peer_shmq"] + [m for m in peers.REGISTRY[1:] if not wanted or m in wanted]
    if min(a.rounds, a.n_tcp, a.n_local, a.pings) < 1:
        p.error("--rounds, --n-tcp, --n-local and --pings must be >= 1")
    return a


def _ints(p: argparse.ArgumentParser, text: str | None, default: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in (text or default).split(",") if v.strip()})
    except ValueError:
        p.error(f"{what}: comma-separated integers")
    if not values or values[0] < 1:
        p.error(f"{what}: at least one value, each >= 1")
    if SIZE not in values and what == "--sizes":
        values = sorted({SIZE, *values})  # the work-queue table is at 100 B
    if 1 not in values and what == "--batches":
        values = [1, *values]
    return values


def messages(a: argparse.Namespace, v: Variant, size: int, batch: int) -> int:
    """Messages of one run: the variant's base count, fewer for large payloads, twice as many for
    batches over the network; whole batches."""
    n = a.n_local if v.fast else a.n_tcp
    n = n if size <= 1024 else n // 4 if size <= 4096 else n // 32
    if batch > 1 and not v.fast:
        n *= 2
    n = max(n, 100, batch)
    return -(-n // batch) * batch


# =============================================================== measuring
@dataclass
class Series:
    point: Point
    peer: Peer
    variant: Variant
    count: int
    run: Callable[[], Any]  # msgs/s, or the sorted round trips (ns)

    @property
    def label(self) -> str:
        return f"{self.peer.name} {self.variant.name}"


@dataclass
class Results:
    runs: dict[Key, list[Any]] = field(default_factory=dict)  # msgs/s | (p50 ns, p99 ns, quantiles µs) | None
    counts: dict[Key, int] = field(default_factory=dict)


def plan(a: argparse.Namespace, live: list[Peer]) -> list[list[Series]]:
    """Every point to measure, each with its series, in the order they run."""
    points: list[list[Series]] = []

    def wq(p: Peer, v: Variant, size: int, batch: int) -> Series:
        n = messages(a, v, size, batch)
        return Series(("wq", size, batch), p, v, n, lambda: p.work_queue(v.name, n, size, batch))

    points.append([wq(p, v, SIZE, 1) for p in live for v in p.work_queue_variants])
    for size in a.sizes:
        if size != SIZE:
            points.append([wq(p, p.variant(name), size, 1) for p in live for name in p.size_variants])
    for batch in a.batches:
        if batch != 1:
            points.append([wq(p, p.variant(name), SIZE, batch) for p in live for name in p.batch_variants])
    def ping(p: Peer, v: Variant) -> Series:
        return Series(("ping", SIZE, 0), p, v, a.pings, lambda: p.ping_pong(v.name, a.pings, SIZE))

    points.append([ping(p, v) for p in live for v in p.ping_variants])
    return [pt for pt in points if pt]


def measure(a: argparse.Namespace, out: Out, points: list[list[Series]]) -> Results:
    res = Results()
    for series in points:
        for rnd in range(1, a.rounds + 1):
            for s in series:
                key = (s.point, s.peer.name, s.variant.name)
                res.counts[key] = s.count
                value: Any
                try:
                    got = s.run()
                    if s.point[0] == "ping":
                        p50, p99, shown = common.p50_p99(got)
                        value = (p50, p99, [common.percentile(got, q) / 1000 for q in LEVELS])
                    else:
                        value, shown = got, common.fmt_progress_rate(got)
                except TrialError as e:
                    value, shown = None, f"FAILED: {e}"
                res.runs.setdefault(key, []).append(value)
                kind, size, batch = s.point
                where = f"{size} B" + (f" x{batch}" if batch > 1 else "")
                out.line(f"  round {rnd}/{a.rounds}  {kind:<4} {where:>10}  n={s.count:<7} {s.label:<42} "
                         f"{shown}", style="dim")
    return res


# =============================================================== report
class Medians:
    def __init__(self, res: Results) -> None:
        self.res = res

    def rate(self, point: Point, peer: str, variant: str) -> float | None:
        return median(self.res.runs.get((point, peer, variant), []))

    def lat(self, peer: str, variant: str, which: int) -> float | None:
        """Median p50 (which=0) or p99 (1) of a ping-pong variant, ns."""
        runs = self.res.runs.get((("ping", SIZE, 0), peer, variant), [])
        return median([r[which] if r is not None else None for r in runs])

    def spread(self, key: Key) -> str:
        ok = [v for v in self.res.runs.get(key, []) if v is not None]
        return f"{min(ok):,.0f}-{max(ok):,.0f}" if len(ok) > 1 else ""


def _us(ns: float | None) -> str:
    return "failed" if ns is None else f"{ns / 1000:.1f}"


def report(a: argparse.Namespace, out: Out, res: Results, live: list[Peer], missing: dict[str, str]
           ) -> dict[str, Any]:
    m = Medians(res)
    wq_point: Point = ("wq", SIZE, 1)
    out.line()
    shmq_tcp, shmq_chained, shmq_shm = (m.rate(wq_point, SHMQ, v) for v in (SHMQ_TCP, SHMQ_CHAINED, SHMQ_SHM))
    for title, fast, base, base_name in (
            ("Work queues over the network (brokers)", False, shmq_tcp, f"shmq {SHMQ_TCP}"),
            ("Co-located and raw transports", True, shmq_shm, f"shmq {SHMQ_SHM}")):
        rows = []
        for p in live:
            for v in p.work_queue_variants:
                if v.fast != fast:
                    continue
                key = (wq_point, p.name, v.name)
                r = m.rate(*key)
                row = [p.name, v.name, v.transport, v.durability, v.puts, v.acks, common.fmt_rate(r),
                       m.spread(key), fmt_ratio(ratio(base, r))]
                if not fast:
                    row.append(fmt_ratio(ratio(shmq_chained, r)))
                rows.append(row)
        headers = ["system", "variant", "via", "durability", "puts", "acks", "msgs/s", "min-max", "shmq/this"]
        if not fast:
            headers.append("get(ack=prev)/this")
        out.line()
        out.label_columns = 6
        out.table(f"{title}: {SIZE} B, 1 producer process -> 1 consumer process, one message a call",
                  headers, rows, f"median of {a.rounds} interleaved round(s); shmq/this: {base_name} over "
                  "this"
                  + ("; get(ack=prev)/this: shmq's consumer acking each message with its next get" if not fast
                     else "") + f"; {CLIENTS}")

    ping_rows = []
    for p in live:
        for v in p.ping_variants:
            via = SHMQ_PING.get(v.transport, "tcp")
            b50, b99 = m.lat(SHMQ, via, 0), m.lat(SHMQ, via, 1)
            p50, p99 = m.lat(p.name, v.name, 0), m.lat(p.name, v.name, 1)
            ping_rows.append([p.name, v.name, v.transport, _us(p50), _us(p99),
                              "" if p.name == SHMQ else f"shmq {via}",
                              "" if p.name == SHMQ else fmt_ratio(ratio(b50, p50)),
                              "" if p.name == SHMQ else fmt_ratio(ratio(b99, p99))])
    out.line()
    out.label_columns = 3
    out.table(f"Ping-pong round trips, {SIZE} B, {a.pings:,} timed a run (µs)",
              ["system", "variant", "via", "p50", "p99", "shmq's", "shmq/this p50", "shmq/this p99"],
              ping_rows,
              f"median of {a.rounds} round(s) of each run's percentiles; shmq/this < 1: shmq's round trip is "
              f"shorter; {CLIENTS}")

    out.line()
    out.line("Settings of each variant (durability, puts, acks)", style="bold")
    for p in live:
        for v in (*p.work_queue_variants, *p.ping_variants):
            kind = "ping-pong" if v in p.ping_variants else "work queue"
            out.line(f"  {p.name} {v.name} ({kind}): {v.settings}", style="dim")
    out.line(f"  {CLIENTS}", style="dim")

    out.label_columns = 2
    for kind, xs, fig_rows in (("size", a.sizes, "size_variants"), ("batch", a.batches, "batch_variants")):
        cols = [(p, name) for p in live for name in getattr(p, fig_rows)]
        if not cols:
            continue
        points: list[Point] = [("wq", x, 1) if kind == "size" else ("wq", SIZE, x) for x in xs]
        rows = [[p.name, name, *(common.fmt_rate(m.rate(pt, p.name, name)) for pt in points)]
                for p, name in cols]
        out.line()
        out.table(f"Throughput vs {kind} (msgs/s)",
                  ["system", "variant", *(f"{x:,} B" if kind == "size" else f"x{x:,}" for x in xs)], rows,
                  f"median of {a.rounds} round(s); " + ("one message a call" if kind == "size"
                                                        else f"{SIZE} B, x messages a put / get call"))

    return {"targets": musts(out, m, live, wq_point, missing)}


def _best(m: Medians, live: list[Peer], peer: str, point: Point,
          fit: Callable[[Variant], bool]) -> tuple[float | None, str]:
    """The fastest of ``peer``'s work-queue variants that ``fit``: its median and its name."""
    for p in live:
        if p.name == peer:
            found = [(m.rate(point, peer, v.name), v.name) for v in p.work_queue_variants if fit(v)]
            found = [f for f in found if f[0] is not None]
            if found:
                return max(found, key=lambda f: f[0] or 0.0)
            return None, "every run failed"
    return None, ""


def _best_lat(m: Medians, live: list[Peer], peer: str, which: int,
              fit: Callable[[Variant], bool]) -> tuple[float | None, str]:
    for p in live:
        if p.name == peer:
            found = [(m.lat(peer, v.name, which), v.name) for v in p.ping_variants if fit(v)]
            found = [f for f in found if f[0] is not None]
            if found:
                return min(found, key=lambda f: f[0] or 0.0)
            return None, "every run failed"
    return None, ""


def musts(out: Out, m: Medians, live: list[Peer], wq_point: Point, missing: dict[str, str]
          ) -> list[dict[str, Any]]:
    """Issue 37's must-reach table, each target against the peer variant that fits it best."""
    names = {p.name for p in live}
    rows: list[dict[str, Any]] = []

    def target(label: str, ours: float | None, ours_name: str, peer: str, theirs: tuple[float | None, str],
               bound: float, higher_better: bool, unit: str) -> None:
        value, variant = theirs
        r = ratio(ours, value)
        if peer not in names:
            why = f"not measured: {missing[peer]}" if peer in missing else "not run (--peers)"
            out.line(f"  {label:<58} n/a     {peer} {why}", style="yellow")
            rows.append({"target": label, "ratio": None, "bound": bound, "higher_is_better": higher_better,
                         "shmq": ours, "shmq_variant": ours_name, "peer": peer, "peer_variant": None,
                         "peer_value": None, "unit": unit, "ok": None, "why": why})
            return
        if r is None:
            verdict, style = f"n/a ({variant or 'a run failed'})", "yellow"
        elif (r >= bound) if higher_better else (r <= bound):
            verdict, style = "pass", "bold green"
        else:
            verdict, style = "FAIL", "bold red"
        bound_text = f"{'>=' if higher_better else '<='} {bound:g}x"
        shown = (f"{fmt_ratio(r)} ({bound_text}): shmq {ours_name} {_fmt(ours, unit)} vs {peer} {variant} "
                 f"{_fmt(value, unit)}")
        out.line(f"  {label:<58} {verdict:<7} {shown}", style=style)
        rows.append({"target": label, "ratio": r, "bound": bound, "higher_is_better": higher_better,
                     "shmq": ours, "shmq_variant": ours_name, "peer": peer, "peer_variant": variant,
                     "peer_value": value, "unit": unit, "ok": None if r is None else verdict == "pass"})

    out.targets_heading()
    out.line("  (issue 37's must-reach table; each against the fastest variant of the peer that fits it)",
             style="dim")
    shmq_tcp = m.rate(wq_point, SHMQ, SHMQ_TCP)
    for peer, fit in (("NATS JetStream", lambda v: v.acks == "waited"),
                      ("RabbitMQ", lambda v: v.puts == "confirmed"),
                      ("Redis Streams", lambda v: True)):
        target(f"TCP acked work queue, get + waited ack, vs {peer}", shmq_tcp, SHMQ_TCP, peer,
               _best(m, live, peer, wq_point, fit), 2.0, True, "msgs/s")
    for via, zvar, bound in (("unix", "REQ/REP ipc", 1.2), ("tcp", "REQ/REP tcp", 1.5)):
        target(f"ping-pong p50 over {via}:// vs pyzmq {zvar}", m.lat(SHMQ, via, 0), via, "pyzmq",
               (m.lat("pyzmq", zvar, 0), zvar), bound, False, "ns")
    shm_p99, shm_p50 = m.lat(SHMQ, "shm", 1), m.lat(SHMQ, "shm", 0)
    target("co-located ping-pong p99 vs iceoryx2", shm_p99, "shm", "iceoryx2",
           _best_lat(m, live, "iceoryx2", 1, lambda v: True), 1.0, False, "ns")
    target("co-located ping-pong p50 vs iceoryx2", shm_p50, "shm", "iceoryx2",
           _best_lat(m, live, "iceoryx2", 0, lambda v: True), 1.0, False, "ns")
    target("co-located, ack each, vs iceoryx2 publish/subscribe", m.rate(wq_point, SHMQ, SHMQ_SHM), SHMQ_SHM,
           "iceoryx2", _best(m, live, "iceoryx2", wq_point, lambda v: True), 1.5, True, "msgs/s")
    out.line(f"  not a target: with its consumer acking by its next get, shmq {SHMQ_CHAINED} "
             f"{_fmt(m.rate(wq_point, SHMQ, SHMQ_CHAINED), 'msgs/s')}", style="dim")
    for ours, peer, theirs in (("tcp, get + ack, always", "RabbitMQ", "quorum, confirms"),
                               ("tcp, get + ack, interval", "NATS JetStream", "file, ack_sync")):
        if peer in names:
            r = ratio(m.rate(wq_point, SHMQ, ours), m.rate(wq_point, peer, theirs))
            out.line(f"  durable pair, not a target: shmq {ours} / {peer} {theirs} = {fmt_ratio(r)}",
                     style="dim")
    return rows


def _fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "failed"
    return f"{v / 1000:.1f} us" if unit == "ns" else f"{v:,.0f} msgs/s"


# =============================================================== results file
def figures(a: argparse.Namespace, res: Results, live: list[Peer], missing: dict[str, str]) -> dict[str, Any]:
    def tput(kind: str, xs: Sequence[int], attr: str) -> list[dict[str, Any]]:
        out = []
        for p in live:
            for name in getattr(p, attr):
                keys: list[Key] = [((("wq", x, 1) if kind == "size" else ("wq", SIZE, x)), p.name, name)
                                   for x in xs]
                out.append(_series(f"{p.name} {name}", xs, [res.runs.get(k, []) for k in keys],
                                   [res.counts.get(k, 0) for k in keys]))
        return out

    no_batch = {**missing, **{p.name: p.no_batch for p in live if not p.batch_variants and p.no_batch}}
    lat = []
    for p in live:
        for v in p.ping_variants:
            runs = res.runs.get((("ping", SIZE, 0), p.name, v.name), [])
            quantiles = [[r[2][i] if r is not None else None for r in runs] for i in range(len(LEVELS))]
            lat.append(_series(f"{p.name} {v.name}", LEVELS, quantiles))
    return {
        "throughput_vs_size": {
            "title": "Throughput vs payload size: shmq and its peers (1 producer -> 1 consumer, one a call)",
            "x_label": "payload size (bytes, log scale)", "y_label": "throughput (msgs/s, log scale)",
            "note": f"median of {a.rounds} interleaved round(s), bars: min-max; each acked where the peer "
                    "has acks (pyzmq and iceoryx2 have none); each series' settings: the file's 'peers'; "
                    "each system through its Python client, which limits it as much as its server",
            "series": tput("size", a.sizes, "size_variants"), "not_measured": dict(missing)},
        "throughput_vs_batch": {
            "title": f"Throughput vs batch size: shmq and its peers ({SIZE} B, 1 producer -> 1 consumer)",
            "x_label": "messages a put / get call (log scale; 1: one at a time)",
            "y_label": "throughput (msgs/s, log scale)",
            "note": f"median of {a.rounds} interleaved round(s), bars: min-max; shmq put_many / get_many + "
                    "ack_many; NATS publish_async + fetch(batch); RabbitMQ a transaction a batch, basic.ack "
                    "multiple; Redis pipelined XADD, XREADGROUP COUNT + XACK",
            "series": tput("batch", a.batches, "batch_variants"), "not_measured": no_batch},
        "latency_cdf": {
            "title": f"Ping-pong round-trip latency, CDF: shmq and its peers ({SIZE} B, {a.pings:,} a run)",
            "x_label": "round-trip time (µs, log scale)", "y_label": "fraction of round trips at or below",
            "note": f"per quantile the median of {a.rounds} interleaved round(s), band: min-max; each system "
                    "through its Python client, which limits it as much as its server",
            "series": lat, "not_measured": dict(missing)},
    }


def tables(res: Results, live: list[Peer]) -> dict[str, Any]:
    wq, ping = [], []
    for (point, peer, variant), runs in res.runs.items():
        kind, size, batch = point
        if kind == "wq":
            wq.append({"peer": peer, "variant": variant, "size": size, "batch": batch,
                       "messages": res.counts.get((point, peer, variant)), "runs_msgs_per_s": runs,
                       "median_msgs_per_s": median(runs)})
        else:
            ping.append({"peer": peer, "variant": variant, "size": size, "round_trips": res.counts.get(
                (point, peer, variant)), **common.latency_json([r[0] if r else None for r in runs],
                                                               [r[1] if r else None for r in runs])})
    return {"work_queue": wq, "ping_pong": ping}


def describe(live: list[Peer], missing: dict[str, str]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for p in live:
        d[p.name] = {"version": p.version(), "summary": p.summary,
                     "variants": {v.name: {"settings": v.settings, "transport": v.transport,
                                           "durability": v.durability, "puts": v.puts, "acks": v.acks}
                                  for v in (*p.work_queue_variants, *p.ping_variants)},
                     "no_batch": p.no_batch or None}
    for name, why in missing.items():
        d[name] = {"not_measured": why}
    return d


# =============================================================== main
def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out = Out(label_columns=2)
    started, machine, path = resultfile.begin(a.out, "peers")
    previous = signal.signal(signal.SIGTERM, common.terminate)
    missing: dict[str, str] = {}
    live: list[Peer] = []
    code = 0
    with ExitStack() as stack:
        try:
            for module in a.modules:
                loaded = peers.load(module)
                mod_name = module.removeprefix("peer_")
                if isinstance(loaded, str):
                    name = getattr(sys.modules.get(f"peers.{module}"), "PEER", None)
                    missing[name.name if name is not None else mod_name] = loaded
                    continue
                loaded.timeout = a.timeout
                try:
                    stack.enter_context(loaded.server())
                except peers.SetupError as e:
                    missing[loaded.name] = f"its server did not start: {e}"
                    continue
                live.append(loaded)
            if not live or live[0].name != SHMQ:
                out.line(f"error: shmq could not be measured: {missing.get(SHMQ, '?')}", style="bold red")
                return 1
            out.line(f"shmq bench_peers: {os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}, {a.rounds} "
                     f"round(s), n {a.n_tcp} (brokers) / {a.n_local} (co-located, raw), {a.pings} pings "
                     f"-> {path}", style="bold")
            for p in live:
                out.line(f"  {p.name}: {p.version()}; {p.summary}")
            for name, why in missing.items():
                out.line(f"  {name}: not measured: {why}", style="yellow")
            res = measure(a, out, plan(a, live))
            data = report(a, out, res, live, missing)
            for name, why in missing.items():
                out.line(f"  {name}: not measured: {why}", style="yellow")
            machine["load_avg_end"] = [round(v, 2) for v in os.getloadavg()]
            machine["versions"] = {p.name: p.version() for p in live}
            command = ["python", "bench/bench_peers.py", *(sys.argv[1:] if argv is None else argv)]
            config = {"rounds": a.rounds, "n_tcp": a.n_tcp, "n_local": a.n_local, "pings": a.pings,
                      "sizes": a.sizes, "batches": a.batches, "size": SIZE, "start_method": "fork"}
            results = {"schema": resultfile.SCHEMA, "date": started,
                       "command": shlex.join(command), "machine": machine, "config": config,
                       "figures": figures(a, res, live, missing), "peers": describe(live, missing),
                       **tables(res, live), **data}
            resultfile.write(path, results)
            out.line(f"results written to {path}")
            if not a.no_plots:
                for png in plot.render(results, a.plots or path.with_suffix("")):
                    out.line(f"plot written to {png}")
        except KeyboardInterrupt:
            out.line("interrupted", style="yellow")
            code = 130
        finally:
            try:
                stack.close()  # every server, by pid
            finally:
                signal.signal(signal.SIGTERM, previous)
                for p in live:
                    for note in p.notes:
                        out.line(f"warning ({p.name}): {note}", style="bold red")
                        code = code or 1
                if common.warn_alive(out):
                    code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
