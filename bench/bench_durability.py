"""Durability benchmark: what each policy costs, beside Redis's AOF policies, in one run.

Producers (1 and 4 processes) send 100-byte messages for a fixed time into a
fresh queue of each policy -- ``always`` (a put is confirmed once fsynced;
concurrent producers share fsyncs), ``interval`` (fsync every second) and
``memory`` -- through shared memory (co-located) and over TCP, three ways:

* ``1``: one message per call, each put waiting for its confirmation;
* ``1, window 64``: one message per call through a ``Publisher`` (publisher
  confirms): up to 64 puts unconfirmed at once, every confirmation collected;
* ``batch 100``: ``put_many`` of 100.

Beside them, Redis via redis-py with ``appendfsync always`` / ``everysec`` / no
AOF: LPUSH one per call; a pipeline of 64 single LPUSH commands (64 in flight,
every reply read); a pipeline of 100.  Ratios are computed within this run only:
the machine is shared and noisy.

    python bench/bench_durability.py [--seconds 2] [--rounds 1] [--json out.json]

Starts ``shmq serve`` (2 workers, a temporary data dir on the repository's
disk) and ``redis-server`` (installed with apt-get if missing; skipped with a
message if that is impossible).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from common import serve  # noqa: E402

import shmq  # noqa: E402

POLICIES = ("always", "interval", "memory")
REDIS_POLICY = {"always": "always", "interval": "everysec", "memory": None}
RABBITMQ_CONFIRMS = 5_700  # msgs/s: RabbitMQ with publisher confirms here (issue 4's figure, not measured)
SIZE = 100
MAX_PER_PRODUCER = 400_000
WINDOW = 64
MODES = ((1, 0), (1, WINDOW), (100, 0))  # (messages per call, publisher window); 0: wait for each call


def mode_label(batch: int, window: int) -> str:
    return f"1, window {window}" if window else ("1" if batch == 1 else f"batch {batch}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _produce(kind: str, target: str, batch: int, window: int, seconds: float, start: Any, out: Any) -> None:
    payload = b"x" * SIZE
    if kind == "redis":
        import redis
        r = redis.Redis(port=int(target), protocol=2)
        per = window or batch  # a pipeline of single-message LPUSH commands
        start.wait()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds and n < MAX_PER_PRODUCER:
            if per == 1:
                r.lpush("bench", payload)
            else:
                p = r.pipeline(transaction=False)
                for _ in range(per):
                    p.lpush("bench", payload)
                p.execute()
            n += per
        out.put((n, time.perf_counter() - t0))
        return
    b = shmq.connect(target)
    q = b.queue("bench")
    items = [payload] * batch
    start.wait()
    n, t0 = 0, time.perf_counter()
    if window:
        with q.publisher(window=window) as pub:  # leaving the block waits for every confirmation
            while time.perf_counter() - t0 < seconds and n < MAX_PER_PRODUCER:
                pub.put(payload)
                n += 1
    else:
        while time.perf_counter() - t0 < seconds and n < MAX_PER_PRODUCER:
            if batch == 1:
                q.put(payload)
            else:
                q.put_many(items)
            n += batch
    out.put((n, time.perf_counter() - t0))
    b.close()


def run(kind: str, target: str, producers: int, batch: int, window: int, seconds: float) -> float:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=_produce, args=(kind, target, batch, window, seconds, start, out))
          for _ in range(producers)]
    for p in ps:
        p.start()
    time.sleep(0.3)  # let the children connect; only the timed loop counts
    start.set()
    results = [out.get(timeout=seconds * 10 + 60) for _ in ps]
    for p in ps:
        p.join()
    total = sum(n for n, _ in results)
    return total / max(dt for _, dt in results)


class Shmq:
    def __init__(self, data_dir: str) -> None:
        self.instance = f"bench{os.getpid()}"
        self.proc, port, _ = serve(self.instance, data_dir, 2, stderr=subprocess.DEVNULL)
        self.url = f"tcp://127.0.0.1:{port}"
        self.admin = shmq.connect(self.url)

    def fresh(self, policy: str) -> None:
        try:
            self.admin.delete_queue("bench")
        except shmq.QueueNotFound:
            pass
        self.admin.create_queue("bench", durability=policy, capacity=1 << 21, max_bytes=512 << 20)

    def stop(self) -> None:
        self.admin.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


class Redis:
    def __init__(self, binary: str, policy: str | None, workdir: str) -> None:
        self.port = free_port()
        d = tempfile.mkdtemp(dir=workdir)
        aof = ["--appendonly", "yes", "--appendfsync", policy] if policy else ["--appendonly", "no"]
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--save", "", "--dir", d, *aof],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def redis_binary() -> str | None:
    binary = shutil.which("redis-server")
    if binary is None and shutil.which("apt-get") and os.geteuid() == 0:
        print("redis-server is missing: installing Debian's redis-server with apt-get")
        subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], capture_output=True)
        binary = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        print("redis-py is missing: skipping Redis (pip install redis)")
        return None
    if binary is None:
        print("redis-server is not available: skipping Redis")
    return binary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="timed seconds per run (default 2)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the median is kept")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset (default: all)")
    a = ap.parse_args()
    policies = [p for p in POLICIES if p in a.policies.split(",")]
    work = tempfile.mkdtemp(prefix="shmq-bench-", dir=REPO)  # the repository's disk, not tmpfs
    binary = redis_binary()
    res: dict[tuple[str, str, int, int, int], list[float]] = {}
    srv = Shmq(os.path.join(work, "data"))
    try:
        for _ in range(a.rounds):
            for policy in policies:
                for transport in ("shm", "tcp"):
                    target = srv.url if transport == "tcp" else f"shm://{srv.instance}"
                    for producers in (1, 4):
                        for batch, window in MODES:
                            srv.fresh(policy)
                            r = run("shmq", target, producers, batch, window, a.seconds)
                            key = (f"shmq {transport}", policy, producers, batch, window)
                            res.setdefault(key, []).append(r)
                            print(f"shmq {transport:3} {policy:8} producers={producers} "
                                  f"{mode_label(batch, window):12}: {r:10,.0f} msgs/s", flush=True)
                if binary is None:
                    continue
                red = Redis(binary, REDIS_POLICY[policy], work)
                try:
                    for producers in (1, 4):
                        for batch, window in MODES:
                            r = run("redis", str(red.port), producers, batch, window, a.seconds)
                            res.setdefault(("redis", policy, producers, batch, window), []).append(r)
                            print(f"redis     {policy:8} producers={producers} "
                                  f"{mode_label(batch, window):12}: {r:10,.0f} msgs/s", flush=True)
                finally:
                    red.stop()
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"durability: msgs/s, {SIZE} B, {a.seconds:g} s per run, median of {a.rounds} "
                    f"(Redis: appendfsync always / everysec / no AOF)")
    for col in ("policy", "producers", "per call", "shmq shm", "shmq tcp", "redis", "shm/redis", "tcp/redis"):
        t.add_column(col, justify="right")
    for policy in policies:
        for producers in (1, 4):
            for batch, window in MODES:
                s = med[("shmq shm", policy, producers, batch, window)]
                c = med[("shmq tcp", policy, producers, batch, window)]
                rd = med.get(("redis", policy, producers, batch, window))
                t.add_row(policy, str(producers), mode_label(batch, window),
                          f"{s:,.0f}", f"{c:,.0f}", f"{rd:,.0f}" if rd else "-",
                          f"{s / rd:.2f}x" if rd else "-", f"{c / rd:.2f}x" if rd else "-")
    Console(width=130).print(t)
    print(f"the issue's RabbitMQ figure: {RABBITMQ_CONFIRMS:,} msgs/s with publisher confirms "
          "(must 3x, aim 5x)")
    for batch, window in MODES[:2] if "always" in policies else ():
        a4s = med[("shmq shm", "always", 4, batch, window)]
        a4t = med[("shmq tcp", "always", 4, batch, window)]
        print(f"`always`, 4 producers, {mode_label(batch, window)}: shm {a4s:,.0f} msgs/s = "
              f"{a4s / RABBITMQ_CONFIRMS:.2f}x, tcp {a4t:,.0f} msgs/s = {a4t / RABBITMQ_CONFIRMS:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{"system": k[0], "policy": k[1], "producers": k[2], "batch": k[3], "window": k[4],
                        "msgs_per_s": v} for k, v in med.items()], f, indent=1)


if __name__ == "__main__":
    main()
