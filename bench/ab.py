"""A/B of two commits on the co-located hot paths, interleaved in one run.

    python bench/ab.py OLD [NEW] [--rounds 8]

Each commit is checked out in a temporary git worktree (NEW defaults to the
working tree as it is) and imported through ``PYTHONPATH`` by this same Python,
so only the code differs (each side's ``shmq/_speedups*.c`` compiled in place with
``cc -O2``, the working tree's too).  The rounds alternate OLD, NEW, NEW, OLD, OLD, NEW, ... (neither side
always runs first); each
round runs, in a fresh process:

* **per op**: ``put``, ``get`` and ``ack`` of 100 B in one process, 4,000 each,
  best of 7 (ns per call);
* **ping-pong**: two processes, a put and a blocking get each way, 10,000 timed
  round trips (p50 and p99, µs);
* **one way**: a producer process puts 100,000 messages of 100 B while this one
  gets and acks them, best of 3 (msgs/s);
* **TCP batches**: a ``shmq serve`` of the same tree (one worker); 400 rounds of
  ``put_many`` of 100 × 100 B, then ``get_many(100)`` and ``ack_many``, best of 5 (msgs/s).

It prints each side's median over the rounds (and the spread) and NEW / OLD.
The machine is shared and noisy: read a ratio within the spread as parity.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, re, subprocess, sys, tempfile, time
import shmq
inst = f"ab{os.getpid()}"
url = f"shm://{inst}"  # shmq.connect: the same call on either side of the package move
b = shmq.connect(url)
try:
    q = b.create_queue("p", capacity=8192, max_bytes=1 << 24)
    payload, n, best = b"x" * 100, 4000, {"put": 1e12, "get": 1e12, "ack": 1e12}
    for _ in range(7):
        t = time.perf_counter_ns()
        for _ in range(n):
            q.put(payload)
        best["put"] = min(best["put"], (time.perf_counter_ns() - t) / n)
        t = time.perf_counter_ns()
        msgs = [q.get() for _ in range(n)]
        best["get"] = min(best["get"], (time.perf_counter_ns() - t) / n)
        t = time.perf_counter_ns()
        for m in msgs:
            m.ack()
        best["ack"] = min(best["ack"], (time.perf_counter_ns() - t) / n)
    a2b, b2a = b.create_queue("a2b"), b.create_queue("b2a")
    pings, warm = 10000, 500
    pid = os.fork()
    if pid == 0:
        c = shmq.connect(url)
        i, o = c.queue("a2b"), c.queue("b2a")
        for _ in range(pings + warm):
            m = i.get(); m.ack(); o.put(m.payload)
        os._exit(0)
    lat = []
    for k in range(pings + warm):
        t = time.perf_counter_ns()
        a2b.put(payload)
        m = b2a.get(); m.ack()
        if k >= warm:
            lat.append(time.perf_counter_ns() - t)
    os.waitpid(pid, 0)
    total, rate = 100000, 0.0
    for _ in range(3):  # best of 3
        pid = os.fork()
        if pid == 0:
            o = shmq.connect(url).queue("a2b")
            for _ in range(total):
                o.put(payload)
            os._exit(0)
        t = time.perf_counter()
        for _ in range(total):
            a2b.get().ack()
        rate = max(rate, total / (time.perf_counter() - t))
        os.waitpid(pid, 0)
    lat.sort()
finally:
    b.destroy()
# TCP batches: a broker of this tree (1 worker), 100 x 100 B put_many, then get_many + ack_many
CLI = ("try:\n    from shmq.cli.app import app\nexcept ImportError:\n    from shmq.cli import app\n"
       "app()")
with tempfile.TemporaryDirectory() as data:
    srv = subprocess.Popen([sys.executable, "-c", CLI, "serve", "--port", "0", "--workers", "1",
                            "--instance", inst + "t", "--data-dir", data],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for line in srv.stdout:
            m = re.search(r"listening on tcp://[0-9.]+:(\d+)", line.decode())
            if m:
                break
            print(line.decode(), end="", file=sys.stderr)
        else:
            raise SystemExit("shmq serve did not start")
        port = int(m.group(1))
        t = shmq.connect(f"tcp://127.0.0.1:{port}")
        tq = t.create_queue("tb", capacity=8192, max_bytes=1 << 24)
        batch, rounds, tcp_rate = [payload] * 100, 400, 0.0
        for _ in range(5):  # best of 5
            start = time.perf_counter()
            for _ in range(rounds):
                tq.put_many(batch)
                ms = tq.get_many(100, timeout=5)
                tq.ack_many(ms)
            tcp_rate = max(tcp_rate, rounds * 100 / (time.perf_counter() - start))
        t.close()
    finally:
        srv.terminate()
        srv.wait(60)
print(json.dumps({**{k + " ns": v for k, v in best.items()},
                  "ping-pong p50 us": lat[len(lat) // 2] / 1000,
                  "ping-pong p99 us": lat[len(lat) * 99 // 100] / 1000, "one way msgs/s": rate,
                  "tcp batch msgs/s": tcp_rate}))
"""


def checkout(rev: str, where: Path) -> Path:
    """A detached git worktree of ``rev`` under ``where`` (``git worktree remove`` it after),
    with its compiled accelerator built (else that side would run pure Python)."""
    path = where / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), rev], check=True)
    link = path / "shmq" / "server"  # its server/ as shmq.server (else the installed checkout's would load)
    if not link.exists():
        link.symlink_to("../server")
    build_speedups(path)
    return path


def build_speedups(tree: Path) -> None:
    """Compile ``tree``'s shmq/_speedups*.c in place, as setup.py does (-O2), when it has them."""
    srcs = sorted(str(p) for p in (tree / "shmq").glob("_speedups*.c"))
    if not srcs:
        return
    out = tree / "shmq" / f"_speedups{sysconfig.get_config_var('EXT_SUFFIX')}"
    tmp = out.with_suffix(".new")
    subprocess.run(["cc", "-O2", "-fPIC", "-shared", f"-I{sysconfig.get_paths()['include']}", *srcs,
                    "-o", str(tmp)], check=True)
    os.replace(tmp, out)  # a rename: a process that has the old one loaded keeps it


def _round(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    # run in the tree: `python -c` puts the working directory first on sys.path, ahead of PYTHONPATH
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=tree, capture_output=True, text=True,
                         timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"a round of {tree} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", help="the commit to compare against")
    ap.add_argument("new", nargs="?", help="the new commit (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per side, interleaved (default 8)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shmq-ab-") as tmp:
        trees = {"old": checkout(args.old, Path(tmp))}
        trees["new"] = checkout(args.new, Path(tmp)) if args.new else ROOT
        if not args.new:
            build_speedups(ROOT)
        try:
            runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
            for i in range(args.rounds):
                for side in (("old", "new") if i % 2 == 0 else ("new", "old")):  # ABBA: no side always first
                    runs[side].append(_round(trees[side]))
                print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   check=False)
    print(f"old = {args.old}, new = {args.new or 'working tree'}; "
          f"{args.rounds} interleaved rounds each, medians")
    for key in runs["old"][0]:
        o = [r[key] for r in runs["old"]]
        n = [r[key] for r in runs["new"]]
        mo, mn = statistics.median(o), statistics.median(n)
        print(f"  {key:18s} old {mo:10.1f} ({min(o):.1f}-{max(o):.1f})   new {mn:10.1f} "
              f"({min(n):.1f}-{max(n):.1f})   new/old {mn / mo:.3f}")


if __name__ == "__main__":
    main()
