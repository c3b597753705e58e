"""TLS (``tcps://``) against plain TCP, side by side, on two brokers of the same config.

    python bench/bench_tls.py [--rounds 5] [--pings 3000] [--n 100000]

Makes a throw-away CA and server certificate (the ``openssl`` command), starts two
``shmq serve --workers 2`` -- one plain, one with ``--tls-cert/--tls-key`` -- and
alternates, each round, the same workloads over ``tcp://127.0.0.1`` and ``tcps://127.0.0.1``:

* **ping-pong**: a pinger process puts one message (100 B) and waits for its echo,
  which a ponger process gets, acks and puts back (p50 and p99 of the round trips, µs);
* **batch**: a producer process puts batches of 100 (``put_many``) while a consumer
  process gets batches of 100 (``get_many``) and acks them (``ack_many``), msgs/s, with
  64 B and 4 KiB payloads.

Medians over the rounds, and TLS / TCP.  The issue's target: TLS costs at most 20 % of
batch throughput.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile

from common import serve
from transport import arguments, batch, ping_pong

import shmq

SIZES = (64, 4096)


def make_certs(d: str) -> None:
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=bench-ca")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "1", "-extfile", "san.ext")


def start(tmp: str, name: str, extra: list[str], workers: int = 2
          ) -> tuple[subprocess.Popen[bytes], int]:
    proc, port, _ = serve(f"btls{name}{os.getpid()}", os.path.join(tmp, f"data-{name}"), workers, *extra)
    return proc, port


def main() -> None:
    args = arguments(__doc__)
    procs = []
    with tempfile.TemporaryDirectory(prefix="shmq-bench-tls-") as tmp:
        make_certs(tmp)
        try:
            plain, pport = start(tmp, "plain", [], args.workers)
            procs.append(plain)
            tls, tport = start(tmp, "tls", ["--tls-cert", os.path.join(tmp, "server.pem"),
                                            "--tls-key", os.path.join(tmp, "server.key")], args.workers)
            procs.append(tls)
            urls = {"tcp": f"tcp://127.0.0.1:{pport}", "tls": f"tcps://127.0.0.1:{tport}?ca={tmp}/ca.pem"}
            for url in urls.values():
                b = shmq.connect(url)
                for name in ("ping", "pong", "batch"):
                    b.create_queue(name, capacity=65536, max_bytes=64 << 20)
                b.close()
            keys = ["p50", "p99", *(f"batch{s}" for s in SIZES)]
            res: dict[str, dict[str, list[float]]] = {t: {k: [] for k in keys} for t in urls}
            for r in range(args.rounds):
                for t, url in urls.items():
                    p50, p99 = ping_pong(url, args.pings)
                    res[t]["p50"].append(p50)
                    res[t]["p99"].append(p99)
                    for s in SIZES:
                        res[t][f"batch{s}"].append(batch(url, args.n, s))
                done = "; ".join(f"{t} p50 {res[t]['p50'][-1]:.1f} us, " + ", ".join(
                    f"batch {s} B {res[t][f'batch{s}'][-1]:,.0f}/s" for s in SIZES) for t in urls)
                print(f"round {r + 1}/{args.rounds}: {done}", file=sys.stderr)
        finally:
            for p in procs:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
    med = {t: {k: statistics.median(v) for k, v in d.items()} for t, d in res.items()}
    print(f"shmq over tcps:// vs tcp://127.0.0.1, two brokers (workers: {args.workers} each), "
          f"{args.rounds} interleaved rounds, medians")
    for k, label, unit in [("p50", "ping-pong p50", "us"), ("p99", "ping-pong p99", "us"),
                           *((f"batch{s}", f"batch 100x{s} B", "msgs/s") for s in SIZES)]:
        a, b_ = med["tcp"][k], med["tls"][k]
        print(f"  {label:16} tcp {a:10,.1f} {unit}   tls {b_:10,.1f} {unit}   tls/tcp {b_ / a:.2f}")


if __name__ == "__main__":
    main()
