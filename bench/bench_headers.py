"""What message headers cost: put and get of 100 B without headers against the same with
3 small headers, co-located and over TCP, interleaved in one run.

    python bench/bench_headers.py [--rounds 8]

Each round runs, in a fresh process per side (none, then 3 headers, then the other way
round in the next round), ``put`` of 4,000 messages, then ``get`` of each and a look at
``msg.headers``, best of 7, in ns per call; then ``ack_many``.  Over TCP the same runs
against one ``shmq serve --workers 1``, 1,000 messages a pass.  It prints each side's
median over the rounds (and the spread) and 3 headers / none.  The headers are a trace
id, a content type and a bytes value, as a traced JSON message would carry.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench_tcp import ShmqServer  # shmq serve --port 0 as a child process

CHILD = r"""
import json, os, sys, time
import shmq
mode, url, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
H = {"trace-id": "4bf92f3577b34da6", "content-type": "application/json", "attempt": b"1"}
if url.startswith("shm://"):
    from shmq.core.colocated import ShmBroker
    b = ShmBroker(url[len("shm://"):])
else:
    b = shmq.connect(url)  # loopback: this user's broker's token is found
name = f"h{os.getpid()}"
try:
    q = b.create_queue(name, capacity=8192, max_bytes=1 << 24)
    payload = b"x" * 100
    best = {"put": 1e12, "get": 1e12}
    for _ in range(7):
        t = time.perf_counter_ns()
        if mode == "none":
            for _ in range(n):
                q.put(payload)
        else:
            for _ in range(n):
                q.put(payload, headers=H)
        best["put"] = min(best["put"], (time.perf_counter_ns() - t) / n)
        t = time.perf_counter_ns()
        msgs = [q.get() for _ in range(n)]
        hs = [m.headers for m in msgs]  # the reader looks at them
        best["get"] = min(best["get"], (time.perf_counter_ns() - t) / n)
        assert (hs[0].get("attempt") == b"1") == (mode == "headers")
        q.ack_many(msgs)
    b.delete_queue(name)
    print(json.dumps(best))
finally:
    if url.startswith("shm://"):
        b.destroy()
    else:
        b.close()
"""


def run(side: str, url: str, n: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, side, url, str(n)], capture_output=True,
                         text=True, check=True, timeout=300)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    srv = ShmqServer(1, "h")
    srv.start()
    targets = {"co-located": (f"shm://hb{os.getpid()}", 4000), "tcp": (srv.url, 1000)}
    res: dict[tuple[str, str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for where, (url, n) in targets.items():
                for side in (("none", "headers") if r % 2 == 0 else ("headers", "none")):
                    for op, ns in run(side, url, n).items():
                        res.setdefault((where, op, side), []).append(ns)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        srv.stop()
    print(f"python bench/bench_headers.py --rounds {args.rounds}: medians of {args.rounds} interleaved "
          "rounds, ns per call (best of 7 passes each)")
    for where in targets:
        for op in ("put", "get"):
            none, hdr = res[(where, op, "none")], res[(where, op, "headers")]
            a, b = statistics.median(none), statistics.median(hdr)
            print(f"  {where:10s} {op}: none {a:8,.0f} ({min(none):,.0f}-{max(none):,.0f})   3 headers "
                  f"{b:8,.0f} ({min(hdr):,.0f}-{max(hdr):,.0f})   3 headers / none {b / a:.2f}")


if __name__ == "__main__":
    main()
