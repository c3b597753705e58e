"""One request, one answer, over loopback TCP: what a round trip costs on this machine, and
what shmq and Redis add to it.

    python bench/bench_rtt.py [--rounds 5] [--n 3000]

Each round times, in turn, ``--n`` sequential round trips (median, µs) of:

* ``raw socket``: a Python client sends 40 bytes to a Python echo server (a child
  process, TCP_NODELAY both ways) and reads them back, both ends asleep in ``recv``
  while they wait: the floor of a Python client and server that sleep, the kernel's
  wake-ups included;
* ``redis PING``: redis-py's ``ping()`` against ``redis-server`` (no persistence);
* ``shmq put``: a blocking TCP client's ``q.put(100 B)`` against ``shmq serve --workers 1``
  (memory-only queue, purged between rounds), both ends polling before they sleep, as
  they do by default (``shmq.spin``);
* ``shmq put, spin_us=0``: the same from a client that sleeps at once (the worker still
  polls);
* ``shmq stats``: the first client's ``q.stats()``, a request that touches no message.

Then the medians over the rounds, each as a multiple of the raw socket's.  The
throughput benches (``bench_tcp.py``) run client and server at the same time on the
same 2 cores, where a round trip costs less than here (no core is idle to wake), so read
these as the floor of a request that waits for its answer, not as throughput.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time
from collections.abc import Callable

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
from bench_tcp import RedisServer, ShmqServer, redis
from common import Out

import shmq


def _echo(listener: socket.socket) -> None:
    try:
        conn, _ = listener.accept()
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := conn.recv(4096):
            conn.sendall(data)
    finally:
        os._exit(0)


def timed(n: int, call: Callable[[], object]) -> float:
    """The median of ``n`` sequential calls, µs."""
    lat = []
    for _ in range(n):
        t = time.perf_counter_ns()
        call()
        lat.append(time.perf_counter_ns() - t)
    return statistics.median(lat) / 1000


def raw_socket(n: int) -> float:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(30)  # the echo child never outlives a parent that failed to connect
    address = listener.getsockname()
    pid = os.fork()
    if pid == 0:
        _echo(listener)
    listener.close()
    s = socket.create_connection(address)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"x" * 40
    try:
        def once() -> None:
            s.sendall(msg)
            got = 0
            while got < len(msg):
                got += len(s.recv(4096))
        return timed(n, once)
    finally:
        s.close()
        os.waitpid(pid, 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--n", type=int, default=3000, help="round trips per series per round (default 3000)")
    a = p.parse_args(argv)
    out = Out(label_columns=1)
    binary = shutil.which("redis-server")
    rs = RedisServer(binary) if binary and redis is not None else None
    server = ShmqServer(1, "rtt")
    results: dict[str, list[float]] = {}
    try:
        server.start()
        if rs is not None:
            rs.start()
        b = shmq.connect(server.url)
        q = b.create_queue("rtt")
        sleeper = shmq.connect(server.url, spin_us=0)
        q0 = sleeper.queue("rtt")
        series: list[tuple[str, Callable[[], float]]] = [("raw socket", lambda: raw_socket(a.n))]
        if rs is not None:
            series.append(("redis PING", lambda: timed(a.n, rs.client.ping)))
        payload = b"x" * 100
        series += [("shmq put", lambda: timed(a.n, lambda: q.put(payload))),
                   ("shmq put, spin_us=0", lambda: timed(a.n, lambda: q0.put(payload))),
                   ("shmq stats", lambda: timed(a.n, q.stats))]
        for r in range(a.rounds):
            for name, fn in series:
                v = fn()
                results.setdefault(name, []).append(v)
                out.line(f"round {r + 1}: {name:<20} {v:8.1f} µs")
            q.purge()
        sleeper.close()
        b.close()
    finally:
        if rs is not None:
            rs.stop()
        server.stop()
        if common.leftovers(server.instance):
            out.line("warning: shared memory left behind", style="bold red")
    med = {k: statistics.median(v) for k, v in results.items()}
    floor = med["raw socket"]
    out.table(f"Round trip p50 over loopback TCP, medians of {a.rounds} rounds x {a.n}",
              ["request", "µs", "vs raw socket"],
              [[k, f"{v:.1f}", f"{v / floor:.2f}x"] for k, v in med.items()])
    if rs is None:
        out.line("redis PING not measured: no redis-server or redis-py here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
