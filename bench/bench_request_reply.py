"""Request/reply round trips against plain ping-pong, co-located and over TCP, interleaved.

    python bench/bench_request_reply.py [--rounds 5] [--n 2000] [--against REV] [--no-tcp]

Each round runs, per transport and in alternating order, two pairs of fresh processes:

* ``ping-pong`` (as bench/bench_local.py and bench_tcp.py time it): A puts 100 B on
  ``ping``; B gets it, puts the payload on ``pong`` and acks; A gets from ``pong``
  (timed until here) and acks.
* ``request/reply``: A calls ``broker.request("svc", payload)``; B gets the request,
  ``msg.reply(payload)`` and acks it.  The reply comes back through A's reply queue,
  matched by correlation id (and acked by ``request``).

A times each of ``--n`` round trips (after 200 untimed ones) with
``time.perf_counter_ns``; the table gives each mode's median p50 and p99 over the
rounds, in µs, and request/reply ÷ ping-pong (the issue's target: co-located p50 at most
2x).  Each round's p50s go to stderr as it ends: on a loaded machine, a round where
ping-pong stayed near its quiet figure is one where nothing had to sleep.  TCP runs
against one ``shmq serve --workers 1``.

``--against REV`` adds a third mode to every round, ``request/reply`` with the client
library of commit ``REV`` (a temporary git worktree first on ``PYTHONPATH``; the TCP
server stays this tree's): an A/B of the same machine's minutes, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab import ROOT, checkout
from bench_tcp import ShmqServer  # shmq serve --port 0 as a child process

import shmq
from shmq.core.colocated import ShmBroker

WARM = 200

CHILD = r"""
import json, sys, time
import shmq
role, mode, url, tag = sys.argv[1:5]
n, warm = int(sys.argv[5]), int(sys.argv[6])
b = shmq.connect(url)
try:
    if role == "server":
        q = b.queue(("ping" if mode == "ping" else "svc") + tag)
        pong = b.queue("pong" + tag) if mode == "ping" else None
        for _ in range(n):
            m = q.get(timeout=60)
            if pong is not None:
                pong.put(m.payload)
            else:
                m.reply(m.payload)
            m.ack()
    else:
        payload = b"x" * 100
        times = []
        if mode == "ping":
            ping, pong = b.queue("ping" + tag), b.queue("pong" + tag)
            for i in range(n):
                t = time.perf_counter_ns()
                ping.put(payload)
                r = pong.get(timeout=60)
                times.append(time.perf_counter_ns() - t)
                r.ack()
        else:
            for i in range(n):
                t = time.perf_counter_ns()
                b.request("svc" + tag, payload, timeout=60)
                times.append(time.perf_counter_ns() - t)
        times = sorted(times[warm:])
        print(json.dumps({"p50": times[len(times) // 2] / 1e3, "p99": times[int(len(times) * 0.99)] / 1e3}))
finally:
    b.close()
"""


def run(url: str, mode: str, tag: str, n: int, tree: Path | None = None) -> dict[str, float]:
    """One pair of children; ``tree``: the source tree they import shmq from (None: this one).
    They run in it: ``python -c`` puts the current directory first on ``sys.path``."""
    env = {**os.environ, "PYTHONPATH": str(tree or ROOT)}

    def child(role: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", CHILD, role, mode, url, tag, str(n + WARM), str(WARM)],
                                stdout=subprocess.PIPE, text=True, env=env, cwd=tree or ROOT)
    server = child("server")
    client = child("client")
    try:
        out, _ = client.communicate(timeout=300)
        server.wait(60)
    finally:
        for p in (client, server):
            if p.poll() is None:
                p.kill()
                p.wait()
    if client.returncode or server.returncode:
        raise RuntimeError(f"{mode} on {url}: the children exited with {client.returncode}, "
                           f"{server.returncode}")
    return json.loads(out)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--against", metavar="REV", help="also time request/reply with commit REV's client")
    ap.add_argument("--no-tcp", action="store_true", help="co-located only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shmq-rr-") as tmp:
        old = checkout(args.against, Path(tmp)) if args.against else None
        try:
            res = rounds(args, old)
        finally:
            if old is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                               check=False)
    print(f"python bench/bench_request_reply.py --rounds {args.rounds} --n {args.n}"
          f"{f' --against {args.against}' if args.against else ''}{' --no-tcp' if args.no_tcp else ''}: "
          f"medians of {args.rounds} interleaved rounds, µs per round trip (100 B)")
    for where in ("co-located", "tcp"):
        for stat in ("p50", "p99"):
            if (where, "ping", stat) not in res:
                continue
            ping, rr = res[(where, "ping", stat)], res[(where, "rr", stat)]
            a, b2 = statistics.median(ping), statistics.median(rr)
            line = (f"  {where:10s} {stat}: ping-pong {a:7.1f} ({min(ping):.1f}-{max(ping):.1f})   "
                    f"request/reply {b2:7.1f} ({min(rr):.1f}-{max(rr):.1f})   ratio {b2 / a:.2f}")
            if (where, "rr-old", stat) in res:
                o = res[(where, "rr-old", stat)]
                c = statistics.median(o)
                line += f"   | {args.against}: {c:7.1f} ({min(o):.1f}-{max(o):.1f})   ratio {c / a:.2f}"
            print(line)


def rounds(args: argparse.Namespace, old: Path | None) -> dict[tuple[str, str, str], list[float]]:
    """Every round's figures: (where, mode, stat) -> one per round."""
    instance = f"rrb{os.getpid()}"
    local = ShmBroker(instance)
    srv = None if args.no_tcp else ShmqServer(1, "rr")
    targets: dict[str, tuple[str, shmq.Broker]] = {"co-located": (f"shm://{instance}", local)}
    modes = ["ping", "rr"] + (["rr-old"] if old is not None else [])
    res: dict[tuple[str, str, str], list[float]] = {}
    try:
        if srv is not None:
            srv.start()
            targets["tcp"] = (srv.url, shmq.connect(srv.url))
        for r in range(args.rounds):
            for where, (url, b) in targets.items():
                for mode in modes if r % 2 == 0 else modes[::-1]:
                    tag = f"{r}{mode.replace('-', '')}"
                    names = ["ping" + tag, "pong" + tag] if mode == "ping" else ["svc" + tag]
                    for name in names:
                        b.create_queue(name)
                    try:
                        figures = run(url, mode.removesuffix("-old"), tag, args.n,
                                      old if mode == "rr-old" else None)
                        for stat, us in figures.items():
                            res.setdefault((where, mode, stat), []).append(us)
                    finally:
                        for name in names:
                            b.delete_queue(name)
            p50s = "; ".join(f"{where} " + ", ".join(f"{m} {res[(where, m, 'p50')][-1]:.1f}" for m in modes)
                             for where in targets)
            print(f"round {r + 1}/{args.rounds}: p50 µs {p50s}", file=sys.stderr)
    finally:
        if srv is not None:
            if "tcp" in targets:
                targets["tcp"][1].close()
            srv.stop()
        local.destroy()
    return res


if __name__ == "__main__":
    main()
