"""Two transport workloads the transport benches share (bench_unix, bench_tls): a
ping-pong round trip and batches of 100, each against one broker URL."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import shmq

CTX = mp.get_context("fork")


def _ponger(url: str, total: int, ready: Any) -> None:
    b = shmq.connect(url)
    ping, pong = b.queue("ping"), b.queue("pong")
    ready.set()
    for _ in range(total):
        m = ping.get()
        m.ack()
        pong.put(m.payload)
    b.close()


def ping_pong(url: str, pings: int) -> tuple[float, float]:
    warm = 200
    ready = CTX.Event()
    p = CTX.Process(target=_ponger, args=(url, pings + warm, ready))
    p.start()
    ready.wait(30)
    b = shmq.connect(url)
    ping, pong = b.queue("ping"), b.queue("pong")
    lat = []
    for k in range(pings + warm):
        t = time.perf_counter_ns()
        ping.put(b"x" * 100)
        m = pong.get()
        m.ack()
        if k >= warm:
            lat.append(time.perf_counter_ns() - t)
    p.join(30)
    b.close()
    lat.sort()
    return lat[len(lat) // 2] / 1000, lat[len(lat) * 99 // 100] / 1000


def _producer(url: str, n: int, size: int, ready: Any) -> None:
    b = shmq.connect(url)
    q = b.queue("batch")
    batch = [b"y" * size] * 100
    ready.set()
    for _ in range(n // 100):
        q.put_many(batch)
    b.close()


def batch(url: str, n: int, size: int = 100) -> float:
    ready = CTX.Event()
    p = CTX.Process(target=_producer, args=(url, n, size, ready))
    b = shmq.connect(url)
    q = b.queue("batch")
    p.start()
    ready.wait(30)
    t = time.perf_counter()
    got = 0
    while got < n:
        msgs = q.get_many(100, timeout=30)
        q.ack_many(msgs)
        got += len(msgs)
    rate = n / (time.perf_counter() - t)
    p.join(30)
    b.close()
    return rate


def arguments(doc: str | None) -> argparse.Namespace:
    """The command line both transport benches take: --rounds, --pings, --n."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pings", type=int, default=3000)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2, help="worker processes of each broker")
    return ap.parse_args()
