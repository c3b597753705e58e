"""What ``shmq serve --metrics`` costs: batch throughput with metrics on against off, interleaved.

    python bench/bench_metrics.py [--rounds 5] [--n 200000] [--scrape-interval 1]

Two brokers run side by side for the whole run, each with 2 workers: one with
``--metrics 127.0.0.1:0`` and one without.  Rounds alternate off, on, off, on, ...;
each round runs, on that broker:

* **TCP batch**: a producer process ``put_many`` 100 at a time over TCP, a consumer
  process ``get_many`` + ``ack_many`` 100 at a time over TCP (each on its own worker);
* **co-located batch**: the same through ``shm://`` (no worker on the path; the
  broker's supervisor, journal and metrics processes run beside it).

While a round runs on the metered broker, a thread of this process scrapes its
endpoint every ``--scrape-interval`` seconds (1 s: fifteen times Prometheus's default
rate), so "on" pays for the scrapes too.  It prints each side's median msgs/s over the
rounds (and the spread), on / off, and whether the cost is within 2 %.  The machine
this was written on is shared and noisy: read a ratio within the spread as parity.  The
broker's CPU per message (its processes' user + system time over the round, metrics
process included) is printed too: it moves less with the machine's load.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import psutil
from common import BATCH, REPO_ROOT, child_main, shmq_consume, shmq_produce

import shmq

PAYLOAD = b"x" * 100
START_TIMEOUT = 60.0
LIMIT = 0.02  # the cost metrics may have


class Broker:
    """``shmq serve --port 0 --workers 2 [--metrics 127.0.0.1:0]`` as a child process."""

    def __init__(self, metrics: bool) -> None:
        self.instance = f"bmet{os.getpid()}{'m' if metrics else 'p'}"
        self.tmp = tempfile.mkdtemp(prefix=f"{self.instance}.")
        cmd = [sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
               "--workers", "2", "--instance", self.instance, "--data-dir", os.path.join(self.tmp, "data"),
               *(["--metrics", "127.0.0.1:0"] if metrics else [])]
        out = os.path.join(self.tmp, "stdout")
        with open(out, "wb") as o, open(os.path.join(self.tmp, "stderr"), "wb") as e:
            self.proc = subprocess.Popen(cmd, stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=REPO_ROOT,
                                         start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with open(out, "rb") as f:
                line = f.read()
            m = re.search(rb"listening on (tcp://\S+)", line)
            if m:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"shmq serve did not start: {line!r}")
            time.sleep(0.05)
        self.url = m.group(1).decode()
        mm = re.search(rb"metrics on (http://\S+/metrics)", line)
        self.metrics_url = mm.group(1).decode() if mm else ""
        self.local = shmq.connect(f"shm://{self.instance}")  # this process's handle: queue set-up

    def cpu(self) -> float:
        """CPU seconds the broker's processes (supervisor, workers, journal, metrics) used so far."""
        total = 0.0
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children()]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def stop(self) -> None:
        if getattr(self, "local", None) is not None:
            self.local.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _produce(url: str, name: str, n: int, go: Any) -> None:
    q = shmq.connect(url).queue(name)
    go.wait()
    shmq_produce(q, PAYLOAD, n, BATCH)


def _consume(url: str, name: str, n: int, go: Any, ready: Any) -> None:
    q = shmq.connect(url).queue(name)
    ready.set()
    go.wait()
    shmq_consume(q, n, BATCH)


def one_round(b: Broker, url: str, n: int) -> tuple[float, float]:
    """(msgs/s, the broker's CPU µs per message) of one producer -> one consumer process,
    batches of 100, through ``url``."""
    ctx = mp.get_context("fork")
    b.local.create_queue("bm", capacity=65_536, max_bytes=64 << 20)
    go, ready = ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=child_main, args=(_consume, (url, "bm", n, go, ready))),
             ctx.Process(target=child_main, args=(_produce, (url, "bm", n, go)))]
    try:
        for p in procs:
            p.start()
        if not ready.wait(30):
            raise RuntimeError("the consumer never became ready")
        time.sleep(0.2)  # the producer connects meanwhile (it waits for `go` anyway)
        cpu0 = b.cpu()
        t0 = time.perf_counter()
        go.set()
        for p in procs:
            p.join(300)
        dt = time.perf_counter() - t0
        cpu = b.cpu() - cpu0
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"a child failed: {[p.exitcode for p in procs]}")
        return n / dt, 1e6 * cpu / n
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        b.local.delete_queue("bm")


class Scraper(threading.Thread):
    """Scrapes a metrics URL every ``interval`` seconds until stopped."""

    def __init__(self, url: str, interval: float) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.done = threading.Event()
        self.scrapes = 0
        self.seconds = 0.0

    def run(self) -> None:
        while not self.done.wait(self.interval):
            t = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=10) as r:
                r.read()
            self.seconds += time.perf_counter() - t
            self.scrapes += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per side, interleaved (default 5)")
    ap.add_argument("--n", type=int, default=200_000, help="messages per TCP round (co-located: 2x)")
    ap.add_argument("--scrape-interval", type=float, default=1.0, help="seconds between scrapes (default 1)")
    args = ap.parse_args()
    brokers = {"off": Broker(False), "on": Broker(True)}
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    scrapes, scrape_s = 0, 0.0
    try:
        for i in range(args.rounds):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                b = brokers[side]
                scraper = Scraper(b.metrics_url, args.scrape_interval) if b.metrics_url else None
                if scraper is not None:
                    scraper.start()
                try:
                    runs.setdefault(("TCP batch", side), []).append(one_round(b, b.url, args.n))
                    runs.setdefault(("co-located batch", side), []).append(
                        one_round(b, f"shm://{b.instance}", 2 * args.n))
                finally:
                    if scraper is not None:
                        scraper.done.set()
                        scraper.join()
                        scrapes, scrape_s = scrapes + scraper.scrapes, scrape_s + scraper.seconds
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for b in brokers.values():
            b.stop()
    print(f"python bench/bench_metrics.py --rounds {args.rounds} --n {args.n} --scrape-interval "
          f"{args.scrape_interval:g}: medians of {args.rounds} interleaved rounds per side, msgs/s")
    worst = 0.0
    for workload in ("TCP batch", "co-located batch"):
        off = [r for r, _ in runs[(workload, "off")]]
        on = [r for r, _ in runs[(workload, "on")]]
        mo, mn = statistics.median(off), statistics.median(on)
        worst = max(worst, 1 - mn / mo)
        print(f"  {workload:17s} off {mo:10,.0f} ({min(off):,.0f}-{max(off):,.0f})   on {mn:10,.0f} "
              f"({min(on):,.0f}-{max(on):,.0f})   on/off {mn / mo:.3f}")
        co = statistics.median(c for _, c in runs[(workload, "off")])
        cn = statistics.median(c for _, c in runs[(workload, "on")])
        ratio = f" (on/off {cn / co:.3f})" if co > 0 else ""  # co-located: the broker is not in the path
        print(f"  {'':17s} broker CPU per message: off {co:.2f} µs, on {cn:.2f} µs{ratio}")
    if scrapes:
        print(f"  {scrapes} scrapes while metered rounds ran, {1000 * scrape_s / scrapes:.1f} ms each "
              "on average")
    verdict = "within" if worst <= LIMIT else "OVER"
    print(f"  largest cost {100 * worst:.1f} % ({verdict} the {100 * LIMIT:.0f} % limit; a noisy machine "
          "moves these by several %: compare with the spread)")


if __name__ == "__main__":
    main()
