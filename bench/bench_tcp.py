"""Over TCP: shmq (``shmq serve``) against Redis (lists and Streams, via redis-py).

Run from the repository root::

    python bench/bench_tcp.py              # full run: 50k msgs one at a time, 200k batched, 3 rounds
    python bench/bench_tcp.py --quick      # smoke run: 5k / 20k msgs, 1 round, 1k pings
    python bench/bench_tcp.py --json out.json --rounds 5 --workers 2

Every client is a child process of this script with its own connection (the
parent only coordinates); payloads are 100 B.  Workloads:

1. ``single``: one producer -> one consumer, one message per call.
   shmq: ``put`` / ``get`` + ``msg.ack()``.
   Redis lists: ``LPUSH`` / ``BRPOP`` (a list has no acknowledgement: the pop
   removes the message).  Redis Streams: ``XADD`` / ``XREADGROUP COUNT 1 BLOCK 0``
   + ``XACK`` of each entry.
   ``single-nowait`` ("1 / call, nowait"): the same, with shmq's
   ``msg.ack(wait=False)`` (the ack is sent and not waited for; the broker applies
   it before the connection's next request) and the Streams consumer pipelining the
   XACK of each entry with the next ``XREADGROUP``; Redis lists as in ``single``.
2. ``batch``: the same in batches of 100.  shmq: ``put_many`` / ``get_many(100)``
   + ``ack_many``.  Redis lists: one ``LPUSH`` of 100 values; the consumer
   pipelines ``BRPOP`` + ``RPOP key 99`` (one round trip per batch).  Redis
   Streams: a pipeline of 100 ``XADD``; ``XREADGROUP COUNT 100 BLOCK 0`` +
   one ``XACK`` with all the ids.
   ``batch-nowait``: the same with shmq's ``ack_many(msgs, wait=False)`` (one
   ACK_BATCH_NO_REPLY frame, sent with the next ``get_many``) and the Streams
   consumer pipelining its XACK with the next XREADGROUP; Redis lists as in ``batch``.
   ``batch-push``: shmq's consumer subscribes (push mode, ``q.subscribe(credit=1000)``,
   ``--credit``: the broker pushes what is ready in batches, without a request per
   batch, up to the credit ahead, as a RabbitMQ consumer's prefetch or a JetStream
   consumer's max_ack_pending lets its broker) and acks each 100 with
   ``ack_many(msgs, wait=False)``; the producer and the Redis consumers as in
   ``batch-nowait``.
   ``batch-stream`` ("batch 100, streamed"): no round trip waited at either end.
   shmq's producer starts each batch through a publisher
   (``q.publisher(window=1600).put_many``: up to 16 batches unconfirmed, their
   confirmations collected as they come) and its consumer is ``batch-push``'s.
   Redis gets the same depth: its producer pipelines 16 LPUSHes of 100 values per
   round trip (Streams: 1,600 XADDs) and its consumer takes up to ``--credit``
   messages per round trip (BRPOP + RPOP count credit - 1; Streams: XREADGROUP
   COUNT credit, the XACK pipelined with the next read).
   ``single-push`` ("1 / call, push"): one message per call in push mode, the way a
   RabbitMQ consumer with a prefetch works: shmq's consumer subscribes with the same
   credit and acks every message with ``msg.ack()``, waiting for each answer; the
   producer and the Redis consumers as in ``single``.
   ``single-chained`` / ``batch-chained`` ("ack on get"): shmq's consumer acks each
   message (batch) with its next get, ``m = q.get(ack=m)`` / ``q.get_many(100,
   ack=msgs)``: one request, one round trip, and the ack is still waited for (the get's
   answer confirms it; a stale one raises); the Redis consumers as in ``single`` /
   ``batch``.
3. ``ping-pong``: round-trip latency over two queues (ping, pong): A puts on
   ping and waits on pong, B gets ping, puts the payload on pong, then acks ping
   (an at-least-once pipeline acks its input once the output is stored).  A round trip
   is timed from A's put until A's get returns the answer; A acks the answer after
   that, before its next ping (a Redis list has no ack at all).  Redis: ``LPUSH`` /
   ``BRPOP`` pairs.  Each round trip is timed with ``time.perf_counter_ns``; p50 and p99
   in µs.  ``ping-pong, nowait``: the same with shmq's acks not waited for;
   ``ping-pong, ack on get``: each ack carried by the next get (A's inside the timed
   round trip).
4. ``scaling``: shmq alone, a broker with 1 worker against one with 2 workers,
   4 clients (2 producers + 2 consumers on one queue, one message per call,
   ack each); total msgs/s and the ratio 2w/1w.

Which worker serves a connection matters (clients on one worker share one Python
process).  By default (``--placement broker``) the broker decides, as it does for
any client: it balances connections across its workers, so the producer and the
consumer of workloads 1-2 get a worker each; the ping-pong's two clients connect
with one affinity (``shmq.connect(url, affinity=...)``), so one worker serves both,
as docs/operations.md advises for a request/reply pair (and as one process serves
both of Redis's).  ``--placement split`` (workers 0 and 1) or ``shared`` (both on
worker 0) puts every workload's two clients there, with an affinity that maps
there.  The placement of every shmq run is printed.

Throughput is messages / seconds, from the moment the (first) producer starts
(it stamps ``time.monotonic_ns`` just before its first put, once the consumers
are connected and ready) until the (last) consumer has received its last message.

The box this runs on is small and shared, so the systems are interleaved: every
round runs each system in turn, and the tables report each system's median over
``--rounds`` rounds with shmq's ratio to each peer.

The brokers are started here: ``shmq serve --port 0`` (one per worker count,
unique instance names) and ``redis-server`` on a free port with no persistence
(``--save "" --appendonly no``).  If ``redis-server`` is missing it is installed
with ``apt-get install -y redis-server``, and redis-py with pip; if either cannot
be had, the Redis columns are skipped with a message.  Every broker and every
child process is stopped on the way out (also on error or Ctrl-C), and the
script checks /dev/shm for shared memory left behind by its shmq instances.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
from common import BATCH, SHMQ, WORKLOAD_LABELS, Out, TrialError, fmt_ratio, fmt_us, median, ratio

import shmq
from shmq.server.placement import affinity_for

try:
    import redis
except ImportError:
    redis = None  # type: ignore[assignment]


RLIST, RSTREAM = "redis-lists", "redis-streams"
# the workloads of this bench: common's, each again with the acks not waited for, and in push mode
TCP_WORKLOADS = {"single": 1, "single-nowait": 1, "single-push": 1, "single-chained": 1, "batch": BATCH,
                 "batch-nowait": BATCH, "batch-push": BATCH, "batch-chained": BATCH, "batch-stream": BATCH}
TCP_LABELS = {**WORKLOAD_LABELS, "single-nowait": "1 / call, nowait", "single-push": "1 / call, push",
              "single-chained": "1 / call, ack on get", "batch-nowait": f"batch {BATCH}, nowait",
              "batch-push": f"batch {BATCH}, push", "batch-chained": f"batch {BATCH}, ack on get",
              "batch-stream": f"batch {BATCH}, streamed"}
NOWAIT = {"single-nowait", "batch-nowait", "batch-push", "batch-stream"}
PUSH = {"single-push", "batch-push", "batch-stream"}  # shmq's consumer subscribes instead of calling get_many
STREAM = {"batch-stream"}  # nothing waited: shmq's producer publishes, Redis pipelines to the same depth
STREAM_WINDOW = 16 * BATCH  # messages a streaming producer has unconfirmed (shmq) or in one pipeline (Redis)
CHAINED = {"single-chained", "batch-chained"}  # shmq's consumer acks with its next get: get(ack=...)
PING_VARIANTS = {"ping-pong": "wait", "ping-pong, nowait": "nowait",  # label -> how shmq acks
                 "ping-pong, ack on get": "chained"}
# issue 22's throughput targets, as ratios to the faster Redis variant: workload -> (label, must, aim)
TARGETS = {
    "batch": (f"batched (x{BATCH}) vs Redis pipelined", 2.8, 4.0),
    "batch-nowait": (f"batched (x{BATCH}), nowait vs Redis pipelined", 2.8, 4.0),
    "batch-push": (f"batched (x{BATCH}), push vs Redis pipelined", 2.8, 4.0),
    "batch-chained": (f"batched (x{BATCH}), ack on get vs Redis pipelined", 2.8, 4.0),
    "batch-stream": (f"batched (x{BATCH}), streamed vs Redis pipelined as deep", 2.8, 4.0),
    "single": ("one at a time, get + waited ack vs Redis", 0.8, 1.0),
    "single-chained": ("one at a time, get(ack=previous) vs Redis", 0.8, 1.0),
    "single-nowait": ("one at a time + ack(wait=False) vs Redis", 1.0, 1.6),
    "single-push": ("one at a time, push + ack each vs Redis", 2.0, 3.0),
}
PING_MUST, PING_AIM = 0.8, 0.6  # issue 22: shmq's ping-pong p50 / Redis's


def _ping_name(variant: str) -> str:
    """A ping-pong variant's name for --workloads ("ping-pong, nowait" -> "ping-pong-nowait")."""
    return variant.replace(", ", "-").replace(" ", "-")


ALL_WORKLOADS = [*TCP_WORKLOADS, *map(_ping_name, PING_VARIANTS)]  # --workloads names
SIZE = 100

SERVER_START_TIMEOUT = 60.0
SERVER_STOP_TIMEOUT = 30.0
STREAM_GROUP = "bench"
STREAM_FIELD = b"d"
PLACEMENTS = {"broker": None, "split": (0, 1), "shared": (0, 0)}  # workers of the two clients
PING_AFFINITY = "bench-ping-pong"  # --placement broker: the ping-pong pair shares a worker
PILL = b"STOP"  # scaling: the parent puts one per consumer once the producers are done

# Quoted for this 2-core machine (from the issue); printed next to the targets.
REF_REDIS_SINGLE = 18_000
REF_REDIS_BATCH = 179_000
REF_REDIS_PING_P50_US = 126.0
REF_REDIS_PING_P99_US = 207.0
REF_RABBIT_SINGLE = 15_000

Handle = Any  # shmq: (url, queue name); redis: (host, port, key)


class SetupError(RuntimeError):
    """A broker could not be started."""


# =============================================================== children (hot loops)
class _Client:
    """A child's own connection: a shmq queue or a redis client, and how to close it."""

    def __init__(self, system: str, handle: Handle, affinity: str = "") -> None:
        self.worker = -1
        if system == SHMQ:
            url, name = handle
            self.broker = shmq.connect(url, affinity=affinity)  # "": the broker balances
            self.worker = int(getattr(self.broker, "worker", -1))
            self.q = self.broker.queue(name)
            self.close = self.broker.close
        else:
            host, port, key = handle
            self.r: Any = redis.Redis(host=host, port=port)
            self.r.ping()  # redis-py connects lazily: connect now, before we say we are ready
            self.key = key
            self.close = self.r.close


def _stream_entries(resp: Any) -> list[Any]:
    """The (id, fields) entries of an XREADGROUP reply on one stream (RESP2 or RESP3)."""
    if not resp:
        return []
    if isinstance(resp, dict):  # RESP3: {key: [[(id, fields), ...]]}
        (value,) = resp.values()
        return list(value[0]) if value and isinstance(value[0], list) else list(value)
    return list(resp[0][1])  # RESP2: [[key, [(id, fields), ...]]]


def _producer(system: str, handle: Handle, n: int, size: int, batch: int, ready: Any, start: Any,
              workers: Any, affinity: str = "", stream: bool = False) -> None:
    c = _Client(system, handle, affinity)
    try:
        workers[0] = c.worker
        payload = b"x" * size
        chunk = [payload] * batch
        common.wait_ready(ready)
        start.value = time.monotonic_ns()
        per_trip = STREAM_WINDOW // batch if stream else 1  # Redis: batches per pipelined round trip
        if system == SHMQ:
            common.shmq_produce(c.q, payload, n, batch, STREAM_WINDOW if stream else 0)
        elif system == RLIST:
            key = c.key
            if batch == 1:
                lpush = c.r.lpush
                for _ in range(n):
                    lpush(key, payload)
            elif per_trip == 1:
                lpush = c.r.lpush
                for _ in range(n // batch):
                    lpush(key, *chunk)  # one LPUSH with 100 values
            else:
                for i in range(0, n // batch, per_trip):
                    pipe = c.r.pipeline(transaction=False)
                    for _ in range(min(per_trip, n // batch - i)):
                        pipe.lpush(key, *chunk)
                    pipe.execute()
        else:  # Streams
            key, fields = c.key, {STREAM_FIELD: payload}
            if batch == 1:
                xadd = c.r.xadd
                for _ in range(n):
                    xadd(key, fields)
            else:
                pipeline = c.r.pipeline
                for i in range(0, n // batch, per_trip):
                    pipe = pipeline(transaction=False)
                    for _ in range(batch * min(per_trip, n // batch - i)):
                        pipe.xadd(key, fields)
                    pipe.execute()
    finally:
        c.close()


def _consumer(system: str, handle: Handle, n: int, batch: int, size: int, ready: Any, start: Any,
              result: Any, workers: Any, nowait: bool = False, affinity: str = "",
              push: bool = False, credit: int = common.PUSH_CREDIT, chained: bool = False,
              stream: bool = False) -> None:
    c = _Client(system, handle, affinity)
    try:
        workers[1] = c.worker
        ready.set()
        got = 0
        last: Any = None
        if system == SHMQ:
            got, last = common.shmq_consume(c.q, n, batch, nowait, push, credit, chained)
        elif system == RLIST:
            key = c.key
            if batch == 1:
                brpop = c.r.brpop
                for _ in range(n):
                    last = brpop(key, 0)[1]
                got = n
            else:
                # one round trip per batch: BRPOP blocks for the first, RPOP with a count takes the rest
                # (streamed: up to the credit per round trip, as far ahead as shmq's push reaches)
                pipeline, depth = c.r.pipeline, credit if stream else batch
                while got < n:
                    pipe = pipeline(transaction=False)
                    pipe.brpop(key, 0)
                    pipe.rpop(key, depth - 1)
                    first, rest = pipe.execute()
                    got += 1
                    last = first[1]
                    if rest:
                        got += len(rest)
                        last = rest[-1]
        elif nowait:  # Streams, the XACK of each entry pipelined with the next XREADGROUP
            key, r = c.key, c.r
            streams = {key: ">"}
            acks: list[Any] = []
            while got < n:
                pipe = r.pipeline(transaction=False)
                if acks:
                    pipe.xack(key, STREAM_GROUP, *acks)
                pipe.xreadgroup(STREAM_GROUP, "c1", streams, count=credit if stream else batch, block=0)
                entries = _stream_entries(pipe.execute()[-1])
                acks = [e[0] for e in entries]
                got += len(entries)
                if entries:
                    last = entries[-1][1][STREAM_FIELD]
            if acks:
                r.xack(key, STREAM_GROUP, *acks)
        else:  # Streams: XREADGROUP + XACK
            key, r = c.key, c.r
            xreadgroup, xack = r.xreadgroup, r.xack
            streams = {key: ">"}
            while got < n:
                entries = _stream_entries(xreadgroup(STREAM_GROUP, "c1", streams, count=batch, block=0))
                if not entries:
                    continue
                xack(key, STREAM_GROUP, *[e[0] for e in entries])
                got += len(entries)
                last = entries[-1][1][STREAM_FIELD]
        end = time.monotonic_ns()
        if got != n:
            raise TrialError(f"{system}: consumed {got} messages, expected {n}")
        if len(last) != size:
            raise TrialError(f"{system}: last payload has {len(last)} bytes, expected {size}")
        result[0] = end - start.value
        result[1] = got
    finally:
        c.close()


def _pinger(system: str, h_ping: Handle, h_pong: Handle, size: int, total: int, ready: Any,
            conn: Any, workers: Any, acks: str = "wait", affinity: str = "") -> None:
    c = _Client(system, h_ping, affinity)  # one connection for both queues
    try:
        workers[0] = c.worker
        payload = b"p" * size
        if system == SHMQ:
            put, get = c.q.put, c.broker.queue(h_pong[1]).get
            common.wait_ready(ready)
            lat = common.shmq_ping(put, get, payload, total, acks == "nowait", acks == "chained")
        else:  # Redis lists: LPUSH / BRPOP
            lat = array("q", bytes(8 * total))
            clock = time.perf_counter_ns
            lpush, brpop, kping, kpong = c.r.lpush, c.r.brpop, h_ping[2], h_pong[2]
            common.wait_ready(ready)
            for i in range(total):
                t0 = clock()
                lpush(kping, payload)
                brpop(kpong, 0)
                lat[i] = clock() - t0
        conn.send_bytes(lat.tobytes())
    finally:
        conn.close()
        c.close()


def _ponger(system: str, h_ping: Handle, h_pong: Handle, total: int, ready: Any, workers: Any,
            acks: str = "wait", affinity: str = "") -> None:
    c = _Client(system, h_ping, affinity)  # one connection for both queues
    try:
        workers[1] = c.worker
        if system == SHMQ:
            get, put = c.q.get, c.broker.queue(h_pong[1]).put
            ready.set()
            common.shmq_pong(get, put, total, acks == "nowait", acks == "chained")
        else:
            brpop, lpush, kping, kpong = c.r.brpop, c.r.lpush, h_ping[2], h_pong[2]
            ready.set()
            for _ in range(total):
                lpush(kpong, brpop(kping, 0)[1])
    finally:
        c.close()


def _scale_producer(handle: Handle, n: int, size: int, ready: Sequence[Any], starts: Any, workers: Any,
                    idx: int, affinity: str) -> None:
    c = _Client(SHMQ, handle, affinity)
    try:
        workers[idx] = c.worker
        payload = b"x" * size
        for ev in ready:
            common.wait_ready(ev)
        starts[idx] = time.monotonic_ns()
        common.shmq_produce(c.q, payload, n, 1)
    finally:
        c.close()


def _scale_consumer(handle: Handle, ready: Any, ends: Any, counts: Any, workers: Any, idx: int,
                    affinity: str) -> None:
    c = _Client(SHMQ, handle, affinity)
    try:
        workers[2 + idx] = c.worker
        ready.set()
        get, pill = c.q.get, PILL
        got = 0
        end = 0
        while True:
            m = get()
            m.ack()
            if m.payload == pill:
                break
            got += 1
            end = time.monotonic_ns()
        ends[idx] = end
        counts[idx] = got
    finally:
        c.close()


# =============================================================== parent: the brokers
def _stop_group(proc: subprocess.Popen[bytes], timeout: float) -> list[str]:
    """SIGTERM ``proc`` (a session leader we started), wait, then clear its process group.
    Returns what had to be forced, for the report."""
    notes: list[str] = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            notes.append(f"pid {proc.pid} ignored SIGTERM for {timeout:g} s: killed")
            proc.kill()
            proc.wait()
    # Anything it started and left behind (same process group, which is its pid).
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            break
        notes.append(f"processes of group {proc.pid} outlived it: sent {signal.Signals(sig).name}")
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
    return notes


class ShmqServer:
    """``shmq serve --port 0 --workers N`` as a child process (its own session); ``unix``: with
    ``--unix`` too, on a socket in its temp dir (``unix_url``)."""

    def __init__(self, workers: int, tag: str, unix: bool = False) -> None:
        self.workers = workers
        self.instance = f"btcp{os.getpid()}{tag}"
        self.tmp = tempfile.mkdtemp(prefix=f"{self.instance}.")
        self.unix_path = os.path.join(self.tmp, "broker.sock") if unix else ""
        self.unix_url = f"unix://{self.unix_path}" if unix else ""
        self.out_path = os.path.join(self.tmp, "stdout")
        self.err_path = os.path.join(self.tmp, "stderr")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        # the parent's own handle (queue setup, pills): through shared memory, so it is none of
        # the connections the broker balances across its workers
        self.broker: Any = None
        self.exit_code: int | None = None
        self.notes: list[str] = []

    def start(self) -> None:
        cmd = [sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
               "--workers", str(self.workers), "--instance", self.instance,
               "--data-dir", os.path.join(self.tmp, "data")]
        if self.unix_path:
            cmd += ["--unix", self.unix_path]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         cwd=common.REPO_ROOT, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while True:
            with open(self.out_path, "rb") as f:
                m = re.search(rb"listening on (tcp://[^\s/]+)", f.read())
            if m:
                self.url = m.group(1).decode()
                break
            if self.proc.poll() is not None:
                raise SetupError(f"shmq serve exited with {self.proc.returncode} before it was ready: "
                                 f"{self.stderr_tail()}")
            if time.monotonic() > deadline:
                raise SetupError(f"shmq serve printed no 'listening' line in {SERVER_START_TIMEOUT:g} s")
            time.sleep(0.05)
        self.broker = shmq.connect(f"shm://{self.instance}")

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            with open(self.err_path, "rb") as f:
                return f.read().decode(errors="replace")[-limit:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.broker is not None:
            try:
                self.broker.close()
            except Exception as e:  # noqa: BLE001 - stopping anyway
                self.notes.append(f"closing the parent's connection failed: {e!r}")
            self.broker = None
        if self.proc is not None:
            self.notes += _stop_group(self.proc, SERVER_STOP_TIMEOUT)
            self.exit_code = self.proc.returncode
            if self.exit_code != 0:
                self.notes.append(f"shmq serve exited with code {self.exit_code} after SIGTERM")
            self.proc = None
        err = self.stderr_tail()
        if err:
            self.notes.append(f"shmq serve stderr: {err}")
        left = common.leftovers(self.instance)
        if left:
            self.notes.append(f"shared memory left behind (removed now): {', '.join(left)}")
            for name in left:
                try:
                    os.unlink(os.path.join("/dev/shm", name))
                except OSError:
                    pass
        shutil.rmtree(self.tmp, ignore_errors=True)


def stop_servers(out: Any, servers: dict[int, ShmqServer]) -> bool:
    """Stop every ``shmq serve`` of a run; True when one left a warning (each said on ``out``)."""
    warned = False
    for srv in servers.values():
        srv.stop()
        for note in srv.notes:
            out.line(f"warning (shmq serve, {srv.workers} worker(s)): {note}", style="bold red")
            warned = True
    return warned


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``redis-server`` on a free loopback port, no persistence, not daemonized."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.host = "127.0.0.1"
        self.port = 0
        self.tmp = tempfile.mkdtemp(prefix=f"btcp{os.getpid()}redis.")
        self.proc: subprocess.Popen[bytes] | None = None
        self.client: Any = None
        self.version = "?"
        self.notes: list[str] = []

    def start(self) -> None:
        last = ""
        for _ in range(3):  # the free port may be taken between probing and binding
            self.port = _free_port()
            cmd = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "",
                   "--appendonly", "no", "--daemonize", "no", "--dir", self.tmp]
            with open(os.path.join(self.tmp, "log"), "wb") as log:
                self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                             start_new_session=True)
            client = redis.Redis(host=self.host, port=self.port)
            deadline = time.monotonic() + 15
            while self.proc.poll() is None and time.monotonic() < deadline:
                try:
                    client.ping()
                    self.client = client
                    self.version = str(client.info("server").get("redis_version", "?"))
                    return
                except redis.exceptions.ConnectionError:
                    time.sleep(0.05)
            client.close()
            last = self._log_tail()
            _stop_group(self.proc, 5)
            self.proc = None
        raise SetupError(f"redis-server did not start: {last}")

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.tmp, "log"), "rb") as f:
                return f.read().decode(errors="replace")[-500:].strip()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is not None:
            self.notes += _stop_group(self.proc, 10)
            self.proc = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def ensure_redis(out: Out, allow_install: bool) -> tuple[str | None, list[str]]:
    """redis-server's path (None: skip Redis) and what was done to get it."""
    global redis
    done: list[str] = []
    if redis is None:
        if not allow_install:
            out.line("redis-py is not importable and --no-install was given: skipping Redis", style="yellow")
            return None, done
        out.line("redis-py is not importable: installing it with pip into this interpreter's environment",
                 style="yellow")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "redis"], capture_output=True,
                           text=True, timeout=600)
        importlib.invalidate_caches()
        try:
            redis = importlib.import_module("redis")
            done.append(f"pip install redis ({redis.__version__})")
            out.line(f"installed redis-py {redis.__version__}")
        except ImportError:
            out.line(f"could not install redis-py ({(r.stderr or r.stdout).strip()[-300:]}): skipping Redis",
                     style="yellow")
            return None, done
    binary = shutil.which("redis-server")
    if binary is None:
        if not allow_install:
            out.line("redis-server is missing and --no-install was given: skipping Redis", style="yellow")
            return None, done
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            out.line("redis-server is missing and cannot be installed here (needs root and apt-get): "
                     "skipping Redis", style="yellow")
            return None, done
        out.line("redis-server is missing: installing Debian's redis-server with apt-get", style="yellow")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        cmd = ["apt-get", "install", "-y", "-q", "redis-server"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if r.returncode != 0:  # stale package lists: refresh once and retry
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=900)
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        binary = shutil.which("redis-server")
        if r.returncode != 0 or binary is None:
            out.line(f"apt-get install redis-server failed ({(r.stderr or r.stdout).strip()[-300:]}): "
                     "skipping Redis", style="yellow")
            return None, done
        done.append("apt-get install -y redis-server")
        out.line(f"installed redis-server with apt-get: {binary}")
    return binary, done


# =============================================================== parent: measurements
@dataclass
class Bench:
    ctx: mp.context.BaseContext
    children: common.Children
    servers: dict[int, ShmqServer]  # by worker count
    main_workers: int
    redis: RedisServer | None
    timeout: float
    place: tuple[str, str] = ("", "")  # shmq affinities of (producer, consumer)
    ping_place: tuple[str, str] = ("", "")  # and of (pinger, ponger)
    credit: int = common.PUSH_CREDIT  # the push workloads' subscribe credit

    # ------------------------------------------------------------ per-run setup
    def _setup(self, system: str, names: Sequence[str], server: ShmqServer | None = None) -> list[Handle]:
        if system == SHMQ:
            srv = server or self.servers[self.main_workers]
            common.create_queues(srv.broker, names)
            return [(srv.url, name) for name in names]
        assert self.redis is not None
        r = self.redis.client
        keys = [f"btcp:{name}" for name in names]
        r.delete(*keys)
        if system == RSTREAM:
            for key in keys:
                r.xgroup_create(key, STREAM_GROUP, id="0", mkstream=True)
        return [(self.redis.host, self.redis.port, key) for key in keys]

    def _release(self, system: str, handles: Sequence[Handle], server: ShmqServer | None = None) -> None:
        if system == SHMQ:
            srv = server or self.servers[self.main_workers]
            common.delete_queues(srv.broker, [name for _url, name in handles])
        elif self.redis is not None and self.redis.client is not None:
            self.redis.client.delete(*[h[2] for h in handles])

    # ------------------------------------------------------------ workloads
    def throughput(self, system: str, n: int, batch: int, nowait: bool = False, push: bool = False,
                   size: int = SIZE, chained: bool = False, stream: bool = False
                   ) -> tuple[float, tuple[int, int]]:
        """One run: messages per second seen by the consumer, and the shmq workers (producer,
        consumer) the two connections landed on.  ``size``: payload bytes (bench/sweep.py varies it)."""
        ctx = self.ctx
        ready = ctx.Event()  # type: ignore[attr-defined]
        start = ctx.RawValue("q", 0)  # type: ignore[attr-defined]
        result = ctx.RawArray("q", 2)  # type: ignore[attr-defined]
        workers = ctx.RawArray("i", [-1, -1])  # type: ignore[attr-defined]
        (handle,) = self._setup(system, ("bench",))
        try:
            cons = self.children.start(f"{system}-consumer", _consumer, system, handle, n, batch, size,
                                       ready, start, result, workers, nowait, self.place[1], push,
                                       self.credit, chained, stream)
            prod = self.children.start(f"{system}-producer", _producer, system, handle, n, size, batch,
                                       ready, start, workers, self.place[0], stream)
            self.children.wait([cons, prod], self.timeout)
        finally:
            self._release(system, (handle,))
        return common.rate(result, n), (workers[0], workers[1])

    def latency(self, system: str, pings: int, acks: str = "wait") -> tuple[list[int], tuple[int, int]]:
        """One run: ``pings`` round-trip times in ns (after PING_WARMUP untimed ones), and the
        shmq workers (pinger, ponger) the two connections landed on."""
        ctx = self.ctx
        workers = ctx.RawArray("i", [-1, -1])  # type: ignore[attr-defined]
        ready = ctx.Event()  # type: ignore[attr-defined]
        recv_conn, send_conn = ctx.Pipe(duplex=False)  # type: ignore[attr-defined]
        h_ping, h_pong = self._setup(system, ("ping", "pong"))
        total = common.PING_WARMUP + pings
        try:
            b = self.children.start(f"{system}-ponger", _ponger, system, h_ping, h_pong, total, ready,
                                    workers, acks, self.ping_place[1])
            a = self.children.start(f"{system}-pinger", _pinger, system, h_ping, h_pong, SIZE, total,
                                    ready, send_conn, workers, acks, self.ping_place[0])
            send_conn.close()
            data = self.children.wait([b, a], self.timeout, recv_conn)
        finally:
            recv_conn.close()
            self._release(system, (h_ping, h_pong))
        return common.round_trips(data, total), (workers[0], workers[1])

    def scaling(self, workers_n: int, n: int, spread: bool) -> tuple[float, list[int]]:
        """One run against the ``workers_n``-worker broker: 2 producers (n/2 each, one per call)
        and 2 consumers (get + ack each); total msgs/s, and the worker each client landed on
        (producers first).  ``spread``: producer i and consumer i ask for worker i % workers_n
        (else the broker balances the four)."""
        ctx = self.ctx
        srv = self.servers[workers_n]
        ready = [ctx.Event(), ctx.Event()]  # type: ignore[attr-defined]
        starts = ctx.RawArray("q", 2)  # type: ignore[attr-defined]
        ends = ctx.RawArray("q", 2)  # type: ignore[attr-defined]
        counts = ctx.RawArray("q", 2)  # type: ignore[attr-defined]
        workers = ctx.RawArray("i", [-1] * 4)  # type: ignore[attr-defined]
        (handle,) = self._setup(SHMQ, ("scale",), srv)
        per = n // 2
        keys = [worker_key(i % workers_n, workers_n) if spread else "" for i in range(2)]
        try:
            cons = [self.children.start(f"shmq-{workers_n}w-consumer{i}", _scale_consumer, handle, ready[i],
                                        ends, counts, workers, i, keys[i])
                    for i in range(2)]
            prods = [self.children.start(f"shmq-{workers_n}w-producer{i}", _scale_producer, handle, per,
                                         SIZE, ready, starts, workers, i, keys[i])
                     for i in range(2)]
            try:
                deadline = time.monotonic() + self.timeout
                self.children.wait(prods, self.timeout)
                q = srv.broker.queue("scale")
                q.put_many([PILL, PILL])  # one per consumer, behind every real message
                self.children.wait(cons, max(1.0, deadline - time.monotonic()))
            finally:
                for p in cons + prods:
                    self.children.stop(p)
        finally:
            self._release(SHMQ, (handle,), srv)
        got = counts[0] + counts[1]
        if got != 2 * per:
            raise TrialError(f"consumers reported {got} of {2 * per} messages")
        elapsed_ns = max(ends[0], ends[1]) - min(starts[0], starts[1])
        if elapsed_ns <= 0:
            raise TrialError(f"bad timing: {elapsed_ns} ns")
        return got / (elapsed_ns / 1e9), list(workers)


def worker_key(worker: int, workers: int) -> str:
    """An affinity that the broker serves on ``worker`` ("" with one worker)."""
    return affinity_for(worker, workers) if workers > 1 else ""


def placement(name: str, workers: int) -> tuple[tuple[str, str], tuple[str, str]]:
    """The affinities of (producer, consumer) and of (pinger, ponger) for a --placement."""
    wanted = PLACEMENTS[name]
    if wanted is None or workers < 2:
        return ("", ""), ((PING_AFFINITY, PING_AFFINITY) if workers > 1 else ("", ""))
    keys = (worker_key(wanted[0], workers), worker_key(wanted[1], workers))
    return keys, keys


def fmt_workers(ws: Sequence[int]) -> str:
    return "/".join("?" if w < 0 else str(w) for w in ws)


# =============================================================== main
@dataclass
class Results:
    throughput: dict[tuple[str, str], list[float | None]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    placement: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    p50: dict[tuple[str, str], list[float | None]] = field(default_factory=dict)  # (variant, system)
    p99: dict[tuple[str, str], list[float | None]] = field(default_factory=dict)
    scaling: dict[int, list[float | None]] = field(default_factory=dict)
    scaling_placement: dict[int, list[str]] = field(default_factory=dict)


def _workers_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2,
                   help="shmq serve workers for workloads 1-3 (default 2; scaling always runs 1 and 2)")


def _workload_list(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in names if w not in ALL_WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {bad}; choose from {', '.join(ALL_WORKLOADS)}")
    return names


def _switches(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-redis", action="store_true", help="measure shmq alone")
    p.add_argument("--no-install", action="store_true",
                   help="do not install redis-server (apt-get) or redis-py (pip) when missing")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1-vs-2-worker runs")
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS), type=_workload_list,
                   help="comma-separated subset of workloads 1-3 to run: " + ", ".join(ALL_WORKLOADS)
                        + " (default: all)")
    p.add_argument("--placement", choices=list(PLACEMENTS), default="broker",
                   help="workloads 1-3: which shmq workers the two clients use: 'broker' (the default: "
                        "the broker balances the throughput clients across workers, and the ping-pong "
                        "pair shares one affinity, so one worker), 'split' (workers 0 and 1), 'shared' "
                        "(both on worker 0); the clients ask with an affinity that maps there")
    p.add_argument("--credit", type=int, default=common.PUSH_CREDIT,
                   help=f"the push workloads' subscribe credit (prefetch; default {common.PUSH_CREDIT})")
    p.add_argument("--no-spread", action="store_true",
                   help="scaling: let the broker balance the 4 clients (by default producer i and "
                        "consumer i ask for worker i %% 2 with an affinity)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p, a = common.parse_bench_args(argv, __doc__, n=(50_000, 5_000), pings=(5_000, 1_000),
                                   processes="client processes", after_pings=_workers_option,
                                   after_json=_switches,
                                   n_help="messages per one-at-a-time run (also the scaling runs' total); "
                                          "batched runs move 4 * n.  Default 50000, or 5000 with --quick")
    if a.n < BATCH or a.rounds < 1 or a.pings < 1 or a.workers < 1 or a.credit < 1:
        p.error(f"--n must be >= {BATCH}, --rounds, --pings, --workers and --credit >= 1")
    return a


def messages_for(n: int, batch: int) -> int:
    count = n if batch == 1 else 4 * n
    return -(-count // batch) * batch  # whole batches


def run(args: argparse.Namespace, out: Out, bench: Bench, systems: list[str]) -> Results:
    res = Results()
    for workload, batch in TCP_WORKLOADS.items():
        if workload not in args.workloads:
            continue
        n = messages_for(args.n, batch)
        res.counts[workload] = n
        for rnd in range(1, args.rounds + 1):
            for system in systems:
                where = ""
                try:
                    v, ws = bench.throughput(system, n, batch, workload in NOWAIT, workload in PUSH,
                                             chained=workload in CHAINED, stream=workload in STREAM)
                    shown = common.fmt_progress_rate(v)
                    if system == SHMQ:
                        where = f"   (producer/consumer on worker {fmt_workers(ws)})"
                        res.placement.setdefault((workload, system), []).append(fmt_workers(ws))
                except TrialError as e:
                    v, shown = None, f"FAILED: {e}"
                res.throughput.setdefault((workload, system), []).append(v)
                out.line(f"  round {rnd}/{args.rounds}  {TCP_LABELS[workload]:<13} n={n:<7} "
                         f"{system:<14} {shown}{where}", style="dim")
    lat_systems = [s for s in systems if s != RSTREAM]
    for rnd in range(1, args.rounds + 1):
        for variant, acks in PING_VARIANTS.items():
            if _ping_name(variant) not in args.workloads:
                continue
            for system in lat_systems:
                p50: float | None
                p99: float | None
                where = ""
                try:
                    lat, ws = bench.latency(system, args.pings, acks)
                    p50, p99, shown = common.p50_p99(lat)
                    if system == SHMQ:
                        where = f"   (pinger/ponger on worker {fmt_workers(ws)})"
                        res.placement.setdefault((variant, system), []).append(fmt_workers(ws))
                except TrialError as e:
                    p50 = p99 = None
                    shown = f"FAILED: {e}"
                res.p50.setdefault((variant, system), []).append(p50)
                res.p99.setdefault((variant, system), []).append(p99)
                out.line(f"  round {rnd}/{args.rounds}  {variant:<13} x{args.pings:<8} {system:<14} "
                         f"{shown}{where}", style="dim")
    if not args.no_scaling:
        n = -(-args.n // 2) * 2
        res.counts["scaling"] = n
        for rnd in range(1, args.rounds + 1):
            for w in (1, 2):
                where = ""
                try:
                    v, sws = bench.scaling(w, n, not args.no_spread)
                    shown = common.fmt_progress_rate(v)
                    where = f"   (producers/consumers on worker {fmt_workers(sws)})"
                    if w > 1 and len(set(sws)) == 1:
                        where += "  <- all on one worker"
                    res.scaling_placement.setdefault(w, []).append(fmt_workers(sws))
                except TrialError as e:
                    v, shown = None, f"FAILED: {e}"
                res.scaling.setdefault(w, []).append(v)
                out.line(f"  round {rnd}/{args.rounds}  {'2p + 2c':<13} n={n:<7} {f'shmq {w}w':<14} "
                         f"{shown}{where}", style="dim")
    return res


def report(args: argparse.Namespace, out: Out, res: Results, systems: list[str],
           redis_version: str | None) -> dict[str, Any]:
    peers = [s for s in systems if s != SHMQ]
    med = {k: median(v) for k, v in res.throughput.items()}
    rows = []
    for workload in [w for w in TCP_WORKLOADS if w in args.workloads]:
        rows.append([TCP_LABELS[workload],
                     *common.rate_cells(med, [(workload, s) for s in systems], (workload, SHMQ))])
    caption = (f"median of {args.rounds} interleaved round(s), {SIZE} B payloads, msgs/s timed in the "
               f"consumer; shmq over TCP with {args.workers} worker(s), acks every message; "
               "nowait: shmq's ack(wait=False) (no round trip of its own, applied in order before the "
               "connection's next request), Redis Streams' XACK pipelined with the next XREADGROUP")
    if PUSH & set(args.workloads):
        caption += f"; push: q.subscribe(credit={args.credit})"
    if STREAM & set(args.workloads):
        caption += (f"; streamed: the producer through q.publisher(window={STREAM_WINDOW}).put_many, "
                    f"Redis's pipelining {STREAM_WINDOW // BATCH} batches per round trip and its consumer "
                    f"taking up to {args.credit} per round trip")
    if CHAINED & set(args.workloads):
        caption += ("; ack on get: q.get(ack=m) / get_many(ack=msgs), the ack in the get's request, "
                    "confirmed by its answer")
    if RLIST in systems:
        caption += ("\nredis-lists: LPUSH / BRPOP, no ack exists (the pop removes the message); batched: "
                    f"one LPUSH of {BATCH} values, pipelined BRPOP + RPOP count {BATCH - 1}")
    if RSTREAM in systems:
        caption += (f"\nredis-streams: XADD / XREADGROUP + XACK each; batched: pipeline of {BATCH} XADD, "
                    f"XREADGROUP COUNT {BATCH} + one XACK of {BATCH} ids")
    placements = {w: res.placement.get((w, SHMQ), []) for w in TCP_WORKLOADS}
    if args.workers > 1 and any(placements.values()):
        caption += ("\nshmq connections (producer/consumer worker) per round: "
                    + "; ".join(f"{TCP_LABELS[w]}: {', '.join(p)}" for w, p in placements.items() if p))
    if rows:
        out.line()
        out.table("Throughput over TCP, msgs/s (1 producer -> 1 consumer)",
                  ["workload", *systems, *(f"shmq/{s}" for s in peers)], rows, caption)

    m50 = {k: median(v) for k, v in res.p50.items()}
    m99 = {k: median(v) for k, v in res.p99.items()}
    lat_systems = [s for s in systems if s != RSTREAM]
    lat_peers = [s for s in lat_systems if s != SHMQ]
    lat_rows = [[variant, *common.latency_cells(m50, m99, [(variant, s) for s in lat_systems],
                                                (variant, SHMQ))] for variant in PING_VARIANTS
                if (variant, SHMQ) in res.p50]
    caption = (f"median of {args.rounds} round(s) of each run's percentile, timed from the put until the "
               "answer is got; shmq acks ping and pong after (nowait: with ack(wait=False); ack on get: "
               "with the next get, get(ack=...))")
    if lat_peers:
        caption += "; redis: LPUSH / BRPOP; ratio = peer latency / shmq latency (> 1: shmq is faster)"
    pp_place = [p for v in PING_VARIANTS for p in res.placement.get((v, SHMQ), [])]
    if args.workers > 1 and pp_place:
        caption += ("\nshmq connections (pinger/ponger worker) per round: " + ", ".join(pp_place)
                    + "; a wake-up across workers rings the other worker's doorbell")
    if lat_rows:
        out.line()
        out.table(f"Round-trip latency over TCP (p50 / p99 in us, {args.pings} round trips per run, "
                  f"{SIZE} B)", ["workload", *lat_systems, *(f"{s}/shmq" for s in lat_peers)],
                  lat_rows, caption)

    ms = {w: median(v) for w, v in res.scaling.items()}
    scale_ratio = ratio(ms.get(2), ms.get(1))
    if res.scaling:
        out.line()
        out.table(f"shmq worker scaling: 2 producers + 2 consumers, 1 msg / call + ack, "
                  f"n={res.counts['scaling']}",
                  ["workload", "1 worker", "2 workers", "2w/1w"],
                  [["4 clients, total msgs/s", common.fmt_rate(ms.get(1)), common.fmt_rate(ms.get(2)),
                    fmt_ratio(scale_ratio)]],
                  f"median of {args.rounds} round(s); {os.cpu_count()} CPUs shared by the broker workers, "
                  "its supervisor and the 4 clients\n2-worker connections (producers/consumers worker) per "
                  "round: " + ", ".join(res.scaling_placement.get(2, []))
                  + ("; placed by the broker (--no-spread)" if args.no_spread else
                     "; producer i and consumer i asked for worker i % 2 with an affinity (--no-spread: "
                     "leave it to the broker)"))

    # ------------------------------------------------------------ targets
    def vs_best(workload: str) -> tuple[float | None, str]:
        ratios = {s: ratio(med.get((workload, SHMQ)), med.get((workload, s))) for s in peers}
        if not peers:
            return None, "Redis not measured"
        detail = ", ".join(f"vs {s} {fmt_ratio(v)}" for s, v in ratios.items())
        ok = [v for v in ratios.values() if v is not None]
        if len(ok) < len(ratios):
            return None, f"a run failed ({detail})"
        return min(ok), f"vs the faster Redis variant ({detail})"

    targets: list[tuple[str, float | None, float, float, str]] = []
    for workload, (label, must, aim) in TARGETS.items():
        if workload in args.workloads:
            value, note = vs_best(workload)
            targets.append((label, value, must, aim, note))
    out.targets_heading()
    target_json: list[dict[str, Any]] = []
    for label, value, must, aim, note in targets:
        verdict, style = common.ratio_verdict(value, must, aim, note, aim_on_fail=True)
        out.line(f"  {label:<42} {fmt_ratio(value):>7}  {verdict}", style=style)
        if value is not None:
            out.line(f"  {'':<42} {'':>7}  {note}", style="dim")
        target_json.append(common.ratio_target_json(label, value, must, aim, note=note))
    for variant in [v for v in PING_VARIANTS if (v, SHMQ) in res.p50]:
        target_json.append(_ping_target(out, variant, m50.get((variant, SHMQ)), m50.get((variant, RLIST)),
                                        RLIST in systems))
    s50 = m50.get(("ping-pong", SHMQ))
    s50_text = ("n/a" if ("ping-pong", SHMQ) not in res.p50 else "failed" if s50 is None
                else f"{fmt_us(s50)} us")
    out.line(f"  reference quoted for this 2-core machine: Redis ~{REF_REDIS_SINGLE / 1000:g}k msgs/s one "
             f"at a time, {REF_REDIS_BATCH / 1000:g}k pipelined in batches of {BATCH} (lists and Streams "
             f"alike), ping-pong {REF_REDIS_PING_P50_US:g}/{REF_REDIS_PING_P99_US:g} us; RabbitMQ via pika "
             f"{REF_RABBIT_SINGLE / 1000:g}k with ack each (not run here)", style="dim")
    out.line(f"  shmq measured here against those figures: one at a time "
             f"{fmt_ratio(ratio(med.get(('single', SHMQ)), REF_REDIS_SINGLE))} of Redis, "
             f"{fmt_ratio(ratio(med.get(('single', SHMQ)), REF_RABBIT_SINGLE))} of RabbitMQ; batched "
             f"{fmt_ratio(ratio(med.get(('batch', SHMQ)), REF_REDIS_BATCH))}; ping-pong p50 "
             f"{s50_text} vs {REF_REDIS_PING_P50_US:g}",
             style="dim")
    if res.scaling:
        out.line(f"  worker scaling (no target): 2 workers / 1 worker = {fmt_ratio(scale_ratio)} "
                 f"on {os.cpu_count()} CPUs", style="dim")

    return {
        "config": {"n_single": res.counts.get("single"), "n_batch": res.counts.get("batch"),
                   "n_scaling": res.counts.get("scaling"), "rounds": args.rounds, "pings": args.pings,
                   "batch": BATCH, "size": SIZE, "workers": args.workers, "start_method": args.start_method,
                   "push_credit": args.credit,
                   "systems": systems, "python": sys.version, "platform": platform.platform(),
                   "cpus": os.cpu_count(), "shmq_version": getattr(shmq, "__version__", "?"),
                   "redis_server_version": redis_version,
                   "redis_py_version": getattr(redis, "__version__", None) if redis is not None else None},
        "throughput": [
            {"workload": w, "system": s, "messages": res.counts[w], "runs_msgs_per_s": runs,
             "median_msgs_per_s": median(runs),
             "shmq_workers_producer_consumer": res.placement.get((w, s)) if s == SHMQ else None,
             "note": ("no ack (pop removes)" if s == RLIST else "XACK each" if s == RSTREAM else "ack each")}
            for (w, s), runs in res.throughput.items()],
        "latency": [
            {"variant": v, "system": s, "round_trips": args.pings,
             **common.latency_json(res.p50[(v, s)], res.p99[(v, s)]),
             "shmq_workers_pinger_ponger": res.placement.get((v, s)) if s == SHMQ else None}
            for v, s in res.p50],
        "scaling": {
            "messages": res.counts.get("scaling"),
            "runs_msgs_per_s": {f"{w}w": v for w, v in res.scaling.items()},
            "median_msgs_per_s": {f"{w}w": v for w, v in ms.items()},
            "placement_2w": res.scaling_placement.get(2),
            "spread": not args.no_spread,
            "ratio_2w_1w": scale_ratio},
        "ratios": {
            **{f"{w} shmq/{p}": ratio(med.get((w, SHMQ)), med.get((w, p)))
               for w in TCP_WORKLOADS for p in peers},
            **{f"{v} p50 {p}/shmq": ratio(m50.get((v, p)), m50.get((v, SHMQ)))
               for v in PING_VARIANTS for p in lat_peers}},
        "targets": target_json,
        "reference": {"redis_single": REF_REDIS_SINGLE, "redis_batch": REF_REDIS_BATCH,
                      "redis_ping_p50_us": REF_REDIS_PING_P50_US, "redis_ping_p99_us": REF_REDIS_PING_P99_US,
                      "rabbitmq_pika_single_ack": REF_RABBIT_SINGLE},
    }


def _ping_target(out: Out, variant: str, s50: float | None, r50: float | None,
                 redis_run: bool) -> dict[str, Any]:
    """The ping-pong target of issue 22 (p50 <= PING_MUST x Redis's, aim PING_AIM x) for one
    variant: printed, and its JSON."""
    label = f"{variant} p50 <= {PING_MUST:g}x Redis (aim {PING_AIM:g}x)"
    value = ratio(s50, r50)
    ok = aim_ok = None
    if value is None:
        why = "Redis not measured" if not redis_run else "a run failed"
        verdict, style = f"n/a ({why})", "yellow"
    else:
        ok, aim_ok = value <= PING_MUST, value <= PING_AIM
        if not ok:
            verdict, style = f"FAIL ({fmt_ratio(value)} of Redis's p50)", "bold red"
        elif not aim_ok:
            verdict, style = f"pass ({fmt_ratio(value)}), above the aim of {PING_AIM:g}x", "yellow"
        else:
            verdict, style = f"pass ({fmt_ratio(value)}), aim reached", "bold green"
    shown = ("failed" if s50 is None else f"{fmt_us(s50)} us") + (
        f" vs Redis {fmt_us(r50)} us" if r50 is not None else "")
    out.line(f"  {label:<42} {shown:>7}  {verdict}", style=style)
    return {"target": label, "shmq_p50_us": None if s50 is None else s50 / 1000,
            "redis_p50_us": None if r50 is None else r50 / 1000, "ratio": value, "must": PING_MUST,
            "aim": PING_AIM, "ok": ok, "aim_reached": aim_ok}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Out(label_columns=1)
    previous = signal.signal(signal.SIGTERM, common.terminate)

    systems = [SHMQ]
    redis_bin: str | None = None
    if args.no_redis:
        out.line("--no-redis: measuring shmq alone", style="yellow")
    else:
        redis_bin, _installed = ensure_redis(out, not args.no_install)

    ctx = mp.get_context(args.start_method)
    children = common.Children(ctx)
    servers: dict[int, ShmqServer] = {}
    rserver: RedisServer | None = None
    code = 0
    try:
        wanted = [args.workers] + ([] if args.no_scaling else [w for w in (1, 2) if w != args.workers])
        for w in wanted:
            srv = ShmqServer(w, f"w{w}")
            servers[w] = srv
            srv.start()
        if redis_bin is not None:
            rserver = RedisServer(redis_bin)
            try:
                rserver.start()
                systems += [RLIST, RSTREAM]
            except SetupError as e:
                out.line(f"{e}: skipping Redis", style="yellow")
                rserver.stop()
                rserver = None
        main_srv = servers[args.workers]
        out.line(f"shmq bench_tcp: {main_srv.url} ({args.workers} worker(s), instance {main_srv.instance})"
                 + (f", redis-server {rserver.version} on {rserver.host}:{rserver.port} "
                    f"(redis-py {redis.__version__})" if rserver else "")
                 + f"; {os.cpu_count()} cpus, start method {args.start_method}, n={args.n} one at a time / "
                 f"{messages_for(args.n, BATCH)} batched, {args.rounds} round(s), {args.pings} pings",
                 style="bold")
        bench = Bench(ctx, children, servers, args.workers, rserver, args.timeout,
                      *placement(args.placement, args.workers), credit=args.credit)
        res = run(args, out, bench, systems)
        data = report(args, out, res, systems, rserver.version if rserver else None)
        if args.json:
            common.write_json(out, args.json, data)
    except SetupError as e:
        out.line(f"error: {e}", style="bold red")
        code = 1
    except KeyboardInterrupt:
        out.line("interrupted", style="yellow")
        code = 130
    finally:
        children.stop_all()
        if rserver is not None:
            rserver.stop()
            for note in rserver.notes:
                out.line(f"warning (redis-server): {note}", style="yellow")
        if stop_servers(out, servers):
            code = code or 1
        signal.signal(signal.SIGTERM, previous)
        if common.warn_alive(out):
            code = code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
