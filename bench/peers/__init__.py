"""The peers of ``bench/bench_peers.py``: shmq and the systems users compare it with, one module
each, behind one small interface (``Peer``).

Each module holds one ``Peer`` subclass and exposes it as ``PEER``:

* ``available()``: None when the peer can be measured here, else why not (shown as "not
  measured: ..."); nothing is faked;
* ``version()``: its version (server and Python client), once its server runs;
* ``settings()``: its durability, puts and acks in words; each ``Variant`` says its own;
* ``server()``: a context manager that starts what the peer needs (a server on 127.0.0.1,
  an ephemeral port, its own temp data dir) and stops it by pid on the way out, removing
  the temp dir;
* ``work_queue(variant, n, size, batch=1)``: 1 producer process -> 1 consumer process, ``n``
  messages of ``size`` bytes, ``batch`` per call; the consumer acks each message (or batch) and
  waits for the ack where the peer can; msgs/s, from the producer's first put until the consumer
  has the last message;
* ``ping_pong(variant, n, size)``: ``n`` timed round trips (after ``common.PING_WARMUP`` untimed
  ones) between two processes: the round-trip times in ns, sorted (``p50_p99_us`` reads them).

The child processes are forked from the bench; a run that fails or takes longer than
``Peer.timeout`` raises ``common.TrialError``, and its processes are stopped.
"""

from __future__ import annotations

import importlib
import itertools
import multiprocessing as mp
import os
import re
import selectors
import shutil
import subprocess
import tempfile
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import bench_tcp
import common
from common import TrialError

CTX = mp.get_context("fork")  # the children use objects of the parent (events, shared values)
REGISTRY = ("peer_shmq", "peer_nats", "peer_rabbitmq", "peer_redis_streams", "peer_zmq", "peer_iceoryx2")
START_TIMEOUT = 120.0  # s a server may take to say it is ready (RabbitMQ takes about 5 s here)
STOP_TIMEOUT = 60.0

Ready = Callable[[], None]  # a consumer / ponger calls it once it can receive
Go = Callable[[], None]  # a producer / pinger calls it just before its first message


class SetupError(RuntimeError):
    """A peer's server could not be started: the peer is reported as not measured."""


@dataclass(frozen=True)
class Variant:
    """One way of running a peer, and what it promises."""

    name: str
    settings: str  # durability, puts and acks in words
    transport: str  # "tcp", "unix", "ipc", "shm"
    durability: str = "memory"  # "memory", "disk, interval", "disk, fsync", "none"
    acks: str = "waited"  # "waited", "not waited", "none"
    puts: str = "confirmed"  # "confirmed", "not confirmed"
    fast: bool = False  # hundreds of thousands of msgs/s: gets the larger message count


class Peer:
    """The interface every peer module implements (see the module's docstring)."""

    name = ""
    summary = ""  # what it is, and how its Python client limits it
    work_queue_variants: tuple[Variant, ...] = ()
    ping_variants: tuple[Variant, ...] = ()
    batch_variants: tuple[str, ...] = ()  # work-queue variants that take batch > 1
    no_batch = ""  # why there is no batch figure, when batch_variants is empty
    size_variants: tuple[str, ...] = ()  # work-queue variants of the throughput-vs-size figure
    timeout = 300.0

    def __init__(self) -> None:
        self.notes: list[str] = []  # warnings of its server's stop (leftovers, forced kills), for the report
        self._ids = itertools.count()  # numbers the queues, streams and services its runs make

    def available(self) -> str | None:
        return None

    def version(self) -> str:
        return "?"

    def settings(self) -> str:
        return self.summary

    @contextmanager
    def server(self) -> Iterator[None]:
        yield

    def variant(self, name: str) -> Variant:
        for v in (*self.work_queue_variants, *self.ping_variants):
            if v.name == name:
                return v
        raise KeyError(f"{self.name} has no variant {name!r}")

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        raise NotImplementedError

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        raise NotImplementedError

    def batch(self, variant: str, n: int, size: int, batch: int) -> float:
        return self.work_queue(variant, n, size, batch)


def load(module: str) -> Peer | str:
    """The ``PEER`` of ``peers.<module>``, or why it cannot be had (its client is missing, ...)."""
    try:
        mod = importlib.import_module(f"peers.{module}")
    except ImportError as e:
        return f"cannot import it ({e})"
    peer: Peer = mod.PEER
    why = peer.available()
    return peer if why is None else why


def dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


# =============================================================== measurements
def _consumer_main(fn: Callable[..., tuple[int, bytes]], args: tuple[Any, ...], ready: Any, end: Any,
                   n: int, size: int) -> None:
    got, last = fn(ready.set, *args)
    stamp = time.monotonic_ns()
    if got != n:
        raise TrialError(f"consumed {got} messages, expected {n}")
    if len(last) != size:
        raise TrialError(f"the last payload has {len(last)} bytes, expected {size}")
    end.value = stamp


def _producer_main(fn: Callable[..., None], args: tuple[Any, ...], ready: Any, start: Any) -> None:
    def go() -> None:
        common.wait_ready(ready)
        start.value = time.monotonic_ns()

    fn(go, *args)


def throughput(consumer: Callable[..., tuple[int, bytes]], producer: Callable[..., None],
               cargs: tuple[Any, ...], pargs: tuple[Any, ...], n: int, size: int, timeout: float) -> float:
    """Run ``consumer(ready, *cargs)`` and ``producer(go, *pargs)`` in two child processes: msgs/s
    from the producer's ``go()`` (its last call: one that must open what the consumer made may
    call it once before and once just before its first put) until the consumer returned ``n``
    messages, the last of ``size`` bytes, as ``(count, last payload)``."""
    ready = CTX.Event()
    start, end = CTX.RawValue("q", 0), CTX.RawValue("q", 0)
    children = common.Children(CTX)
    try:
        cons = children.start("consumer", _consumer_main, consumer, cargs, ready, end, n, size)
        prod = children.start("producer", _producer_main, producer, pargs, ready, start)
        children.wait([cons, prod], timeout)
    finally:
        children.stop_all()
    elapsed = end.value - start.value
    if start.value == 0 or elapsed <= 0:
        raise TrialError("no time measured")
    return n / (elapsed / 1e9)


def _pinger_main(fn: Callable[..., array[int]], args: tuple[Any, ...], ready: Any, conn: Any) -> None:
    try:
        lat = fn(lambda: common.wait_ready(ready), *args)
        conn.send_bytes(lat.tobytes())
    finally:
        conn.close()


def _ponger_main(fn: Callable[..., None], args: tuple[Any, ...], ready: Any) -> None:
    fn(ready.set, *args)


def ping_pong(ponger: Callable[..., None], pinger: Callable[..., array[int]], oargs: tuple[Any, ...],
              iargs: tuple[Any, ...], total: int, timeout: float) -> list[int]:
    """Run ``ponger(ready, *oargs)`` and ``pinger(go, *iargs)`` (which returns ``total`` round-trip
    times, ns) in two child processes: the times after the PING_WARMUP first, sorted."""
    ready = CTX.Event()
    recv_conn, send_conn = CTX.Pipe(duplex=False)
    children = common.Children(CTX)
    try:
        b = children.start("ponger", _ponger_main, ponger, oargs, ready)
        a = children.start("pinger", _pinger_main, pinger, iargs, ready, send_conn)
        send_conn.close()
        data = children.wait([b, a], timeout, recv_conn)
    finally:
        recv_conn.close()
        children.stop_all()
    return common.round_trips(data, total)


def p50_p99_us(lat: Sequence[int]) -> tuple[float, float]:
    return common.percentile(lat, 0.50) / 1000, common.percentile(lat, 0.99) / 1000


# =============================================================== server processes
class Daemon:
    """A server process started here, in its own session, stopped by its pid.  Its output (stdout
    and stderr) goes to ``log``; ``start`` reads it until ``ready`` matches (the server's own
    ready line, no polling), then a thread copies the rest into the log."""

    def __init__(self, name: str, cmd: Sequence[str], log: str, env: Mapping[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name, self.cmd, self.log, self.env, self.cwd = name, list(cmd), log, env, cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.output = b""  # what it printed until it was ready
        self.notes: list[str] = []
        self._drain: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0

    def start(self, ready: bytes, timeout: float = START_TIMEOUT) -> bytes:
        """Start it and wait for ``ready`` (a regex) in its output; what it printed until then.
        SetupError (the process stopped) when it exits first or takes longer than ``timeout``."""
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(self.env) if self.env is not None else None, cwd=self.cwd)
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pattern = re.compile(ready)
        buf = b""
        deadline = time.monotonic() + timeout
        log = open(self.log, "ab")  # handed to the drain thread, which closes it
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                while not pattern.search(buf):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SetupError(f"{self.name} was not ready in {timeout:g} s: {self._tail(buf)}")
                    if not sel.select(left):
                        continue
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        self.proc.wait()
                        raise SetupError(f"{self.name} exited with {self.proc.returncode} before it was "
                                         f"ready: {self._tail(buf)}")
                    buf += chunk
                    log.write(chunk)
        except BaseException:
            log.close()
            self.stop(10.0)
            raise
        self.output = buf
        self._drain = threading.Thread(target=self._copy, args=(fd, log), name=f"{self.name}-log",
                                       daemon=True)
        self._drain.start()
        return buf

    @staticmethod
    def _copy(fd: int, log: Any) -> None:
        try:
            while chunk := os.read(fd, 65536):
                log.write(chunk)
                log.flush()
        except OSError:
            pass
        finally:
            log.close()

    @staticmethod
    def _tail(buf: bytes, limit: int = 600) -> str:
        return buf.decode(errors="replace")[-limit:].strip() or "(no output)"

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """SIGTERM its pid, wait up to ``timeout`` (then SIGKILL), and clear its process group."""
        if self.proc is None:
            return
        self.notes += bench_tcp._stop_group(self.proc, timeout)
        if self._drain is not None:
            self._drain.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def log_tail(self, limit: int = 600) -> str:
        try:
            with open(self.log, "rb") as f:
                return self._tail(f.read(), limit)
        except OSError:
            return ""


free_port = bench_tcp._free_port


@contextmanager
def temp_dir(prefix: str) -> Iterator[str]:
    """A temp dir for one peer's data and logs, removed after."""
    path = tempfile.mkdtemp(prefix=f"shmq-bench-{prefix}-{os.getpid()}.")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
