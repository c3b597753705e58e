"""The Unix-domain socket against loopback TCP, side by side on one broker.

    python bench/bench_unix.py [--rounds 5] [--pings 3000] [--n 100000]

Starts ``shmq serve --workers 2 --unix PATH`` and alternates, each round, the same two
workloads over ``tcp://127.0.0.1:PORT`` and ``unix://PATH``:

* **ping-pong**: a pinger process puts one message and waits for its echo, which a
  ponger process gets, acks and puts back (p50 and p99 of the round trips, µs);
* **batch**: a producer process puts batches of 100 (100 B each) while a consumer
  process gets batches of 100 and acks them (msgs/s).

Medians over the rounds, and UNIX / TCP.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile

from common import serve
from transport import arguments, batch, ping_pong

import shmq


def main() -> None:
    args = arguments(__doc__)
    with tempfile.TemporaryDirectory(prefix="shmq-bench-unix-") as tmp:
        path = os.path.join(tmp, "broker.sock")
        instance = f"bunix{os.getpid()}"
        proc, port, _ = serve(instance, os.path.join(tmp, "data"), args.workers, "--unix", path)
        try:
            urls = {"tcp": f"tcp://127.0.0.1:{port}", "unix": f"unix://{path}"}
            b = shmq.connect(urls["unix"])
            for name in ("ping", "pong", "batch"):
                b.create_queue(name, capacity=65536, max_bytes=64 << 20)
            b.close()
            res: dict[str, dict[str, list[float]]] = {t: {"p50": [], "p99": [], "batch": []} for t in urls}
            for r in range(args.rounds):
                for t, url in urls.items():
                    p50, p99 = ping_pong(url, args.pings)
                    res[t]["p50"].append(p50)
                    res[t]["p99"].append(p99)
                    res[t]["batch"].append(batch(url, args.n))
                done = ", ".join(f"{t} p50 {res[t]['p50'][-1]:.1f} us, "
                                 f"batch {res[t]['batch'][-1]:,.0f} msgs/s" for t in urls)
                print(f"round {r + 1}/{args.rounds}: {done}", file=sys.stderr)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    med = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in res.items()}
    print(f"shmq over unix:// vs tcp://127.0.0.1, one broker (workers: {args.workers}), "
          f"{args.rounds} interleaved rounds, medians")
    print(f"  ping-pong p50   tcp {med['tcp']['p50']:8.1f} us   unix {med['unix']['p50']:8.1f} us   "
          f"unix/tcp {med['unix']['p50'] / med['tcp']['p50']:.2f}")
    print(f"  ping-pong p99   tcp {med['tcp']['p99']:8.1f} us   unix {med['unix']['p99']:8.1f} us   "
          f"unix/tcp {med['unix']['p99'] / med['tcp']['p99']:.2f}")
    print(f"  batches of 100  tcp {med['tcp']['batch']:8,.0f}/s   unix {med['unix']['batch']:8,.0f}/s   "
          f"unix/tcp {med['unix']['batch'] / med['tcp']['batch']:.2f}")


if __name__ == "__main__":
    main()
