"""Celery and Dramatiq through shmq against the same through Redis: tasks per second.

Run from the repository root::

    python bench/bench_celery.py              # 10,000 tasks a run, 3 interleaved rounds
    python bench/bench_celery.py --quick      # 1,000 tasks, 1 round

Each run starts a worker on this host (Celery: ``celery worker --pool prefork -c 2``, with
``task_acks_late``; Dramatiq: ``dramatiq --processes 2 --threads 4``), waits until it has
run one warm-up task, then this process sends ``--tasks`` no-op tasks (``noop.delay()`` /
``noop_actor.send()``) and the clock runs from the first send until the worker has run
them all (each leaves a byte in a file: ``bench/bench_celery_app.py``).  Brokers:

* ``shmq tcp``: ``shmq serve --workers 2``, reached as ``shmq://127.0.0.1:PORT`` (Celery) or
  ``tcp://127.0.0.1:PORT`` (Dramatiq);
* ``shmq shm``: the same broker's instance attached directly (``shmq+shm://INSTANCE``,
  ``shm://INSTANCE``): no broker hop;
* ``redis``: ``redis-server`` on loopback, no persistence, with kombu's and Dramatiq's own
  Redis transports.

The rounds interleave the brokers (shmq tcp, shmq shm, redis, again), and the table gives
each one's median and shmq's ratio to Redis.  Issue 36's musts, for Celery: shmq over TCP
at least 1.0x Redis (aim 1.5x), co-located at least 1.3x (aim 2x); Dramatiq's are reported.
Every process and the shmq instance are stopped on the way out.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
from bench_tcp import RedisServer, ensure_redis
from common import Out, fmt_ratio, median, ratio

import shmq

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
READY_TIMEOUT = 120.0  # s a worker may take to run its warm-up task
TCP, SHM, REDIS = "shmq tcp", "shmq shm", "redis"


class RunError(RuntimeError):
    """One run failed (its worker died or did not finish in time)."""


def _count(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_count(path: Path, n: int, timeout: float, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while _count(path) < n:
        if worker.poll() is not None:
            raise RunError(f"the worker exited with {worker.returncode}")
        if time.monotonic() > deadline:
            raise RunError(f"{_count(path)} of {n} tasks ran in {timeout:g} s")
        time.sleep(0.002)  # a poll of a file's size: this is the measurement's own clock, not a sync


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    else:  # the group may outlive its leader
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_run(kind: str, url: str, tasks: int, timeout: float, tmp: str, seq: int) -> float:
    """Tasks per second of one run of ``kind`` (celery or dramatiq) through ``url``."""
    queue = f"bench{os.getpid()}x{seq}"
    done = Path(tmp) / f"done.{seq}"
    env = {**os.environ, "BENCH_KIND": kind, "BENCH_BROKER": url, "BENCH_QUEUE": queue,
           "BENCH_DONE": str(done), "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT)])}
    if kind == "celery":
        cmd = [sys.executable, "-m", "celery", "-A", "bench_celery_app", "worker", "--pool", "prefork",
               "-c", "2", "--loglevel", "warning", "--without-mingle", "--without-gossip",
               "--without-heartbeat", "-Q", queue]
    else:
        cmd = [sys.executable, "-m", "dramatiq", "bench_celery_app", "--processes", "2", "--threads", "4"]
    os.environ.update({k: env[k] for k in ("BENCH_KIND", "BENCH_BROKER", "BENCH_QUEUE", "BENCH_DONE")})
    app = _app()
    send = app.noop.delay if kind == "celery" else app.noop_actor.send
    worker = subprocess.Popen(cmd, cwd=BENCH, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        send()  # the warm-up: once it ran, the worker is consuming
        _wait_count(done, 1, READY_TIMEOUT, worker)
        t0 = time.perf_counter()
        for _ in range(tasks):
            send()
        _wait_count(done, tasks + 1, timeout, worker)
        return tasks / (time.perf_counter() - t0)
    finally:
        _stop(worker)
        _close(kind, app)


def _app() -> Any:
    """The bench's app module, loaded afresh for this run's broker (its settings are read at import)."""
    import importlib
    sys.modules.pop("bench_celery_app", None)
    return importlib.import_module("bench_celery_app")


def _close(kind: str, app: Any) -> None:
    (app.app if kind == "celery" else app.broker).close()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, default=None,
                   help="tasks per run (default 10000, or 1000 with --quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="interleaved rounds (default 3, or 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument("--only", choices=("celery", "dramatiq"), help="measure one of the two")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    a = p.parse_args(argv)
    a.tasks = a.tasks or (1000 if a.quick else 10_000)
    a.rounds = a.rounds or (1 if a.quick else 3)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Out(label_columns=1)
    kinds = [args.only] if args.only else ["celery", "dramatiq"]
    instance = f"bcel{os.getpid()}"
    tmp = tempfile.mkdtemp(prefix=f"{instance}.")
    binary, _ = ensure_redis(out, allow_install=True)
    srv, port, _line = common.serve(instance, tmp, 2)
    redis_srv = None
    runs: dict[tuple[str, str], list[float | None]] = {}
    try:
        urls = {("celery", TCP): f"shmq://127.0.0.1:{port}", ("celery", SHM): f"shmq+shm://{instance}",
                ("dramatiq", TCP): f"tcp://127.0.0.1:{port}", ("dramatiq", SHM): f"shm://{instance}"}
        systems = [TCP, SHM]
        if binary is not None:
            redis_srv = RedisServer(binary)
            redis_srv.start()
            for kind in ("celery", "dramatiq"):
                urls[(kind, REDIS)] = f"redis://127.0.0.1:{redis_srv.port}/0"
            systems.append(REDIS)
        out.line(f"shmq bench_celery: {args.tasks} tasks a run, {args.rounds} round(s), "
                 f"{os.cpu_count()} cpus; shmq serve --workers 2 on port {port}"
                 + (f", redis-server {redis_srv.version}" if redis_srv else ", no redis-server"))
        seq = 0
        for rnd in range(1, args.rounds + 1):
            for kind in kinds:
                for system in systems:
                    seq += 1
                    v: float | None
                    try:
                        v = one_run(kind, urls[(kind, system)], args.tasks, args.timeout, tmp, seq)
                        shown = f"{v:>10,.0f} tasks/s"
                    except (RunError, shmq.ShmqError) as e:
                        v, shown = None, f"FAILED: {e}"
                    runs.setdefault((kind, system), []).append(v)
                    out.line(f"  round {rnd}/{args.rounds}  {kind:<9} {system:<9} {shown}", style="dim")
                    if redis_srv is not None and system == REDIS:
                        redis_srv.client.flushall()
    finally:
        if redis_srv is not None:
            redis_srv.stop()
        srv.send_signal(signal.SIGTERM)
        srv.wait(30)
    med = {k: median(v) for k, v in runs.items()}
    rows = [[kind, *(common.fmt_rate(med.get((kind, s))) for s in systems),
             *(fmt_ratio(ratio(med.get((kind, s)), med.get((kind, REDIS)))) for s in systems if s != REDIS)]
            for kind in kinds]
    out.line()
    out.table(f"Tasks per second ({args.tasks} no-op tasks, worker on this host)",
              ["framework", *systems, *(f"{s}/redis" for s in systems if s != REDIS)], rows,
              f"median of {args.rounds} interleaved round(s); Celery: prefork -c 2, acks_late; "
              "Dramatiq: 2 processes x 4 threads")
    redis_med = med.get(("celery", REDIS))
    targets = [("Celery, shmq over TCP vs Redis", ratio(med.get(("celery", TCP)), redis_med), 1.0, 1.5),
               ("Celery, shmq co-located vs Redis", ratio(med.get(("celery", SHM)), redis_med), 1.3, 2.0)]
    out.targets_heading()
    for label, value, must, aim in targets:
        verdict, style = common.ratio_verdict(value, must, aim, "not measured")
        out.line(f"  {label:<40} {fmt_ratio(value):>7}  {verdict}", style=style)
    if args.json:
        common.write_json(out, args.json, {
            "config": {"tasks": args.tasks, "rounds": args.rounds, "python": sys.version,
                       "platform": platform.platform(), "cpus": os.cpu_count(),
                       "redis": redis_srv.version if redis_srv else None},
            "runs_tasks_per_s": {f"{k} {s}": v for (k, s), v in runs.items()},
            "median_tasks_per_s": {f"{k} {s}": v for (k, s), v in med.items()},
            "targets": [common.ratio_target_json(label, value, must, aim)
                        for label, value, must, aim in targets]})
    return common.check_clean(out, instance, 0)


if __name__ == "__main__":
    sys.exit(main())
