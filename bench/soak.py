"""Soak: a broker under churn and load for N minutes, its resources sampled once a minute.

Starts ``shmq serve`` (2 workers, ``--metrics``, a data dir on the repository's disk)
and runs, until the time is up:

* **churn**: create a queue (``--queue-mb`` of ring, the durability modes in turn,
  over TCP and co-located in turn), fill it half, dead-letter one message (its DLQ is
  made), open a subscription and a blocked ``get`` on it, scrape the metrics, delete
  the queue and its DLQ while they wait, and check that the waiters get
  ``QueueNotFound``;
* **the durability bench's workloads**: a producer (one put per call, a publisher
  window of 64, batches of 100) and a consumer (``get_many`` + ack) on one long-lived
  queue per durability mode, over TCP and co-located.

Once a minute (``--every``) it prints the system's ``Shmem`` (``/proc/meminfo``), what
the instance's objects in ``/dev/shm`` hold of it, the rest ("unaccounted": a deleted
queue some process still maps is counted there), each broker process's anonymous RSS,
shared RSS and open descriptors, the supervisor's restarts, and the work done.  It
fails (exit 1) when something grew without bound: from the smallest sample after the
first minute (the warm-up) to the last, the unaccounted ``Shmem`` by more than one
queue's size, a process's anonymous RSS by more than ``--rss-slack-mb``, its
descriptors by more than 8, or any restart.

    python bench/soak.py [--minutes 10] [--every 60] [--queue-mb 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import psutil  # noqa: E402
from common import serve  # noqa: E402

import shmq  # noqa: E402
from shmq.core.segment import objects_of, shm_path  # noqa: E402

POLICIES = ("memory", "interval", "always")
MB = 1 << 20


def meminfo_mb(field_name: str = "Shmem") -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field_name)


def status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class Broker:
    """``shmq serve`` with metrics, on ephemeral ports, and its processes by role."""

    def __init__(self, data_dir: str, workers: int) -> None:
        self.instance = f"soak{os.getpid()}"
        self.log = tempfile.TemporaryFile()
        self.proc, port, line = serve(self.instance, data_dir, workers, "--metrics", "127.0.0.1:0",
                                      stderr=self.log)
        self.url = f"tcp://127.0.0.1:{port}"
        self.shm = f"shm://{self.instance}"
        m = re.search(r"metrics on https?://\S+?:(\d+)/metrics", line)
        self.metrics = f"http://127.0.0.1:{m.group(1)}/metrics" if m else ""
        m = re.search(r"\(writer pid (\d+)\)", line)
        self.journal_pid = int(m.group(1)) if m else 0

    def roles(self) -> dict[str, int]:
        """role -> pid: the supervisor, each worker, the journal and metrics processes."""
        out = {"supervisor": self.proc.pid}
        workers = 0
        for c in psutil.Process(self.proc.pid).children():
            try:
                name = c.name()
            except psutil.Error:
                continue
            if name == "shmq-metrics":
                out["metrics"] = c.pid
            elif c.pid == self.journal_pid:
                out["journal"] = c.pid
            else:
                out[f"worker{workers}"] = c.pid
                workers += 1
        return out

    def restarts(self) -> int:
        self.log.seek(0)
        return self.log.read().decode(errors="replace").count("restarting")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)


# ---------------------------------------------------------------- the work
def _blocked_get(q: Any, seen: list[str]) -> None:
    """A get that waits until its queue is deleted: what it ended with, in ``seen``."""
    try:
        q.get(group="waiting", timeout=30)
        seen.append("message")
    except shmq.ShmqError as e:
        seen.append(type(e).__name__)


def churn(url: str, shm: str, queue_mb: int, metrics: str, stop: Any, counts: Any) -> None:
    """Create, fill, wait on, delete: one queue at a time, each mode and transport in turn."""
    i = 0
    while not stop.is_set():
        target = url if i % 2 == 0 else shm
        policy = POLICIES[(i // 2) % len(POLICIES)]
        b = shmq.connect(target)
        admin = shmq.connect(url)  # a journaled queue is created through the broker either way
        name = "soak-churn"
        q = admin.create_queue(name, durability=policy, capacity=4096, max_bytes=queue_mb * MB,
                               max_message_size=1 * MB)
        q = b.queue(name)
        payload = b"c" * (256 << 10)
        for _ in range(queue_mb // 4):  # half the ring, in 256 KiB messages (2 MiB a frame)
            q.put_many([payload] * 8, timeout=30)
        q.get(timeout=10).dead_letter()  # makes <name>.dlq
        sub_b = shmq.connect(url)
        sub = sub_b.queue(name).subscribe(group="sub", credit=4)  # type: ignore[attr-defined]
        next(sub)  # the subscription is live on a worker
        waiter_b = shmq.connect(target)
        waiter_q = waiter_b.queue(name)
        waiter_q.create_group("waiting", start="latest")
        seen: list[str] = []
        t = threading.Thread(target=_blocked_get, args=(waiter_q, seen))
        t.start()
        if metrics:
            with urllib.request.urlopen(metrics, timeout=10) as r:
                r.read()
        admin.delete_queue(name)
        admin.delete_queue(f"{name}.dlq")
        t.join(30)
        if seen != ["QueueNotFound"]:
            raise SystemExit(f"churn: a get blocked on a deleted queue ended with {seen}")
        sub.close()
        for h in (waiter_b, sub_b, b, admin):
            h.close()
        with counts.get_lock():
            counts[0] += 1
        i += 1


def produce(target: str, policy: str, stop: Any, counts: Any) -> None:
    b = shmq.connect(target)
    q = b.queue(f"soak-{policy}")
    payload = b"p" * 100
    mode = 0
    while not stop.is_set():
        try:
            if mode == 0:
                for _ in range(100):
                    q.put(payload, timeout=5)
            elif mode == 1:
                with q.publisher(window=64) as p:
                    for _ in range(500):
                        p.put(payload)
            else:
                for _ in range(10):
                    q.put_many([payload] * 100, timeout=5)
        except shmq.Full:
            time.sleep(0.05)  # the consumer is behind: let it catch up
            continue
        with counts.get_lock():
            counts[1] += (100, 500, 1000)[mode]
        mode = (mode + 1) % 3


def consume(target: str, policy: str, stop: Any, counts: Any) -> None:
    b = shmq.connect(target)
    q = b.queue(f"soak-{policy}")
    while not stop.is_set():
        try:
            msgs = q.get_many(100, timeout=0.5)
        except shmq.Empty:
            continue
        q.ack_many(msgs)
        with counts.get_lock():
            counts[2] += len(msgs)


# ---------------------------------------------------------------- samples
@dataclass
class Sample:
    minute: float
    shmem: float  # the system's Shmem, MB
    instance: float  # MB of the instance's objects in /dev/shm
    unaccounted: float  # Shmem that no object in /dev/shm holds: deleted, still mapped (or not ours)
    anon: dict[str, float] = field(default_factory=dict)
    shared: dict[str, float] = field(default_factory=dict)
    fds: dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    cycles: int = 0
    produced: int = 0
    consumed: int = 0


def instance_mb(instance: str) -> float:
    size = 0
    for n in objects_of(instance):
        try:
            size += os.stat(shm_path(n)).st_blocks * 512
        except FileNotFoundError:
            pass
    return size / MB


def sample(b: Broker, t0: float, counts: Any) -> Sample:
    """One sample.  Shared memory is read 10 times over a second and the reading with the
    least unaccounted memory kept: a churned queue (and its DLQ) comes and goes within a
    cycle, and is let go of within a tick of its delete, so one reading swings by up to
    two queues; what stays across a second is what a leak would leave."""
    readings = []
    for _ in range(10):
        shm, inst = meminfo_mb(), instance_mb(b.instance)
        readings.append((shm - inst, shm, inst))
        time.sleep(0.1)
    unaccounted, shm, inst = min(readings)
    s = Sample((time.monotonic() - t0) / 60, shm, inst, unaccounted, restarts=b.restarts(),
               cycles=counts[0], produced=counts[1], consumed=counts[2])
    for role, pid in b.roles().items():
        try:
            s.anon[role] = status_mb(pid, "RssAnon")
            s.shared[role] = status_mb(pid, "RssShmem")
            s.fds[role] = len(os.listdir(f"/proc/{pid}/fd"))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return s


def show(s: Sample) -> None:
    procs = "  ".join(f"{r} {s.anon[r]:.0f}/{s.shared[r]:.0f}/{s.fds[r]}" for r in sorted(s.anon))
    print(f"{s.minute:5.1f} min  Shmem {s.shmem:6.0f} MB, of it in /dev/shm {s.instance:5.0f} MB, "
          f"unaccounted {s.unaccounted:4.0f} MB  restarts "
          f"{s.restarts}  cycles {s.cycles:5}  produced {s.produced:>10,}  consumed {s.consumed:>10,}\n"
          f"           anon RSS / shared RSS (MB) / fds: {procs}", flush=True)


def verdict(samples: list[Sample], queue_mb: int, rss_slack: float) -> list[str]:
    """What grew without bound: from the smallest value after the warm-up to the last."""
    after = samples[1:] or samples
    last = samples[-1]
    bad = []
    grew = last.unaccounted - min(s.unaccounted for s in after)
    if grew > queue_mb:  # (a leak leaves a queue's size per cycle: thousands of them)
        bad.append(f"Shmem held by no object in /dev/shm grew {grew:.0f} MB (> one queue)")
    for role in last.anon:
        low = min((s.anon[role] for s in after if role in s.anon), default=last.anon[role])
        if last.anon[role] - low > rss_slack:
            bad.append(f"{role}: anonymous RSS grew {last.anon[role] - low:.0f} MB")
        low_fd = min((s.fds[role] for s in after if role in s.fds), default=last.fds[role])
        if last.fds[role] - low_fd > 8:
            bad.append(f"{role}: descriptors grew {last.fds[role] - low_fd}")
    if last.restarts:
        bad.append(f"{last.restarts} broker processes restarted")
    if last.cycles < 2:
        bad.append("fewer than 2 churn cycles ran")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=60.0, help="seconds between samples (default 60)")
    ap.add_argument("--queue-mb", type=int, default=64, help="each churned queue's ring (default 64)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rss-slack-mb", type=float, default=32.0,
                    help="anonymous RSS a process may gain after the warm-up (default 32)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="shmq-soak-", dir=REPO)  # the repository's disk, not tmpfs
    b = Broker(os.path.join(work, "data"), a.workers)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    counts = ctx.Array("q", 3)  # churn cycles, messages produced, messages consumed
    procs: list[Any] = []
    samples: list[Sample] = []
    code = 1
    try:
        admin = shmq.connect(b.url)
        for policy in POLICIES:
            admin.create_queue(f"soak-{policy}", durability=policy, capacity=65536, max_bytes=32 * MB)
        admin.close()
        jobs: list[tuple[Any, tuple[Any, ...]]] = [
            (churn, (b.url, b.shm, a.queue_mb, b.metrics, stop, counts))]
        for i, policy in enumerate(POLICIES):
            target = b.url if i % 2 == 0 else b.shm
            jobs += [(produce, (target, policy, stop, counts)), (consume, (target, policy, stop, counts))]
        procs = [ctx.Process(target=fn, args=args) for fn, args in jobs]
        t0 = time.monotonic()
        samples.append(sample(b, t0, counts))
        show(samples[-1])
        for p in procs:
            p.start()
        end = t0 + a.minutes * 60
        while time.monotonic() < end:
            time.sleep(min(a.every, max(0.0, end - time.monotonic())))
            dead = [p for p in procs if not p.is_alive()]
            samples.append(sample(b, t0, counts))
            show(samples[-1])
            if dead:
                print(f"a workload process exited early: {[p.exitcode for p in dead]}")
                return 1
        bad = verdict(samples, a.queue_mb, a.rss_slack_mb)
        print("verdict:", "flat" if not bad else "GREW: " + "; ".join(bad))
        code = 0 if not bad else 1
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        rc = b.stop()
        shutil.rmtree(work, ignore_errors=True)
        left = objects_of(b.instance)
        if rc or left:
            print(f"shmq serve exited {rc}; left in /dev/shm: {left}")
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
