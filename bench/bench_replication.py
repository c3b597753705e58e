"""Replication benchmark: what a standby costs the primary, how far an async one lags, and
how long a promote takes, in one run.

Three primaries run side by side (2 workers each, temporary data dirs on the
repository's disk, so every fsync of all of them shares one disk, as a standby on the
same host must):

* ``none``: no standby;
* ``sync``: one standby; the queue says ``replication="sync"`` (a put is confirmed once the
  primary's fsync *and* the standby's are done);
* ``async``: one standby; ``replication="async"`` (the primary's fsync alone confirms).

Each round runs the same workload on each of them in turn: 4 producer processes, each
putting 100-byte messages through a ``Publisher`` (window 64: publisher confirms) into
an ``always`` queue for ``--seconds``.  Throughput is every confirmed message over the
time; the ratios are of medians over the rounds.  During every run the primary's INFO is
read every 50 ms; in the ``async`` runs, the standby's ``lag_seconds`` (the age of the
oldest round it has not confirmed) gives the lag's p99.  Each round starts with another
mode, so that none is favoured by going first.

Then the promote: a primary with ``--retained`` (100,000) messages in an ``always`` queue,
a standby caught up, the primary SIGKILLed; the time from ``shmq promote`` (the PROMOTE
request) to the first put confirmed by the new primary, over ``--promotes`` tries.

    python bench/bench_replication.py [--seconds 3] [--rounds 5] [--promotes 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
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
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench_durability import run as durability_run  # noqa: E402
from common import serve  # noqa: E402

import shmq  # noqa: E402

SIZE = 100
WINDOW = 64
PRODUCERS = 4
MUST = {"sync": 0.5, "async": 0.9, "lag_p99_s": 1.0, "promote_s": 2.0}


def run(url: str, seconds: float) -> float:
    """Messages confirmed per second, PRODUCERS processes at once, each through a Publisher
    (the durability benchmark's workload, one message per call with a window)."""
    return durability_run("shmq", url, PRODUCERS, 1, WINDOW, seconds)


class Node:
    """``shmq serve`` (a primary, or with ``replica_of`` a standby) of this checkout."""

    def __init__(self, root: str, name: str, replica_of: str | None = None, port: int = 0) -> None:
        self.instance = f"bench{os.getpid()}{name}"
        self.data_dir = os.path.join(root, name)
        extra = ["--unix", "off", "--no-auth"] + (["--replica-of", replica_of] if replica_of else [])
        if replica_of is None:
            self.proc, self.port, self.line = serve(self.instance, self.data_dir, 2, *extra,
                                                    stderr=subprocess.DEVNULL)
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", str(port),
                 "--workers", "2", "--instance", self.instance, "--data-dir", self.data_dir, *extra],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert self.proc.stdout is not None
            self.line = self.proc.stdout.readline().decode()
            m = re.search(r"serving reads on tcps?://[0-9.]+:(\d+)", self.line)
            if m is None:
                self.kill()
                raise SystemExit(f"the standby did not start: {self.line!r}")
            self.port = int(m.group(1))
        self.url = f"tcp://127.0.0.1:{self.port}"

    def next_line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def remove_memory(self) -> None:
        from shmq.core.cleanup import scan
        if any(r.instance == self.instance for r in scan()):
            from shmq.core.colocated import ShmBroker
            ShmBroker(self.instance).destroy()

    def kill(self) -> None:
        import psutil
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait()


def wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def caught_up(primary: Any, standby: Any, queue: str) -> bool:
    end = primary.queue(queue).stats()["next_offset"]
    return bool((standby.info().replication or {}).get("queues", {}).get(queue) == end)


def fresh(admin: Any, mode: str | None) -> None:
    try:
        admin.delete_queue("bench")
    except shmq.QueueNotFound:
        pass
    admin.create_queue("bench", durability="always", capacity=1 << 21, max_bytes=512 << 20,
                       **({"replication": mode} if mode else {}))


class LagSampler(threading.Thread):
    """The standby's lag_seconds from the primary's INFO, every 50 ms, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.b = shmq.connect(url)
        self.samples: list[float] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            standbys = (self.b.info().replication or {}).get("standbys") or []
            if standbys:
                self.samples.append(float(standbys[0]["lag_seconds"]))

    def stop(self) -> list[float]:
        self.halt.set()
        self.join()
        self.b.close()
        return self.samples


def throughput(root: str, seconds: float, rounds: int, log: Any) -> dict[str, Any]:
    nodes: dict[str, tuple[Node, Node | None]] = {}
    try:
        for mode in ("none", "sync", "async"):
            p = Node(root, f"p-{mode}")
            s = Node(root, f"s-{mode}", replica_of=p.url) if mode != "none" else None
            nodes[mode] = (p, s)
        rates: dict[str, list[float]] = {m: [] for m in nodes}
        lags: list[float] = []
        order = list(nodes)
        for r in range(rounds):
            for mode in order[r % 3:] + order[:r % 3]:  # each mode first in turn: no order favoured
                p, s = nodes[mode]
                with shmq.connect(p.url) as admin:
                    fresh(admin, None if mode == "none" else mode)
                    if s is not None:
                        with shmq.connect(s.url) as sb:
                            wait(lambda: caught_up(admin, sb, "bench"), 30, f"the {mode} standby")
                sampler = LagSampler(p.url)  # (every mode pays for the INFO requests alike)
                sampler.start()
                rates[mode].append(run(p.url, seconds))
                samples = sampler.stop()
                if mode == "async":
                    lags += samples
                log(f"round {r + 1}/{rounds} {mode:>5}: {rates[mode][-1]:,.0f} msgs/s")
        med = {m: statistics.median(v) for m, v in rates.items()}
        lags.sort()
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None
        return {"rates": rates, "median": med, "sync_ratio": med["sync"] / med["none"],
                "async_ratio": med["async"] / med["none"], "lag_p99_s": p99,
                "lag_max_s": lags[-1] if lags else None, "lag_samples": len(lags)}
    finally:
        for p, s in nodes.values():
            for n in (s, p):
                if n is not None:
                    n.stop()


def promote_time(root: str, retained: int, tries: int, log: Any) -> dict[str, Any]:
    times = []
    for t in range(tries):
        p = Node(root, f"pp{t}")
        s = Node(root, f"ps{t}", replica_of=p.url)
        try:
            with shmq.connect(p.url) as admin, shmq.connect(s.url) as sb:
                admin.create_queue("bench", durability="always", capacity=1 << 18, max_bytes=256 << 20)
                q = admin.queue("bench")
                for _ in range(retained // 1000):
                    q.put_many([b"x" * SIZE] * 1000)
                wait(lambda: caught_up(admin, sb, "bench"), 120, "the standby to catch up")
            p.kill()
            with shmq.connect(s.url) as sb:
                wait(lambda: not (sb.info().replication or {}).get("connected"), 30, "the link to drop")
                t0 = time.perf_counter()
                sb.promote()  # type: ignore[attr-defined]  # (a TcpBroker: shmq promote's request)
            while True:  # the first put the new primary confirms
                try:
                    with shmq.connect(s.url, connect_timeout=1) as np:
                        np.queue("bench").put(b"first")
                    break
                except (shmq.ConnectionLost, shmq.NotPrimary, shmq.QueueNotFound):
                    time.sleep(0.005)
            times.append(time.perf_counter() - t0)
            log(f"promote {t + 1}/{tries}: {times[-1]:.3f} s to the first confirmed put "
                f"({retained:,} retained)")
        finally:
            s.stop()
            p.kill()
            p.remove_memory()  # (SIGKILLed: what it had in /dev/shm is ours to remove)
    return {"seconds": times, "median_s": statistics.median(times), "retained": retained}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--promotes", type=int, default=3)
    ap.add_argument("--retained", type=int, default=100_000)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    root = tempfile.mkdtemp(prefix=".bench-repl-", dir=REPO)  # the repository's disk, as the durability bench
    log = lambda s: print(s, flush=True)  # noqa: E731
    try:
        tp = throughput(root, a.seconds, a.rounds, log)
        pr = promote_time(root, a.retained, a.promotes, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med, lag = tp["median"], tp["lag_p99_s"]
    rows = [
        ("always, 4 producers with publisher confirms, sync standby / none", f"{tp['sync_ratio']:.2f}x",
         f">= {MUST['sync']}x", tp["sync_ratio"] >= MUST["sync"]),
        ("the same, async standby / none", f"{tp['async_ratio']:.2f}x", f">= {MUST['async']}x",
         tp["async_ratio"] >= MUST["async"]),
        ("async standby's lag under that load, p99", "n/a" if lag is None else f"{lag:.3f} s",
         f"< {MUST['lag_p99_s']} s", lag is not None and lag < MUST["lag_p99_s"]),
        (f"shmq promote to the first confirmed put, {a.retained:,} retained (median)",
         f"{pr['median_s']:.3f} s", f"< {MUST['promote_s']} s", pr["median_s"] < MUST["promote_s"]),
    ]
    print(f"\nmsgs/s (medians of {a.rounds} rounds of {a.seconds:g} s): none {med['none']:,.0f}, "
          f"sync {med['sync']:,.0f}, async {med['async']:,.0f}; lag samples {tp['lag_samples']}, "
          f"max {tp['lag_max_s']}")
    print("| workload | measured | must | |\n|---|---|---|---|")
    for label, v, must, ok in rows:
        print(f"| {label} | {v} | {must} | {'met' if ok else 'NOT MET'} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"throughput": tp, "promote": pr, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
