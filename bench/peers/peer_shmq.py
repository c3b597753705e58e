"""shmq itself, as bench_tcp.py, bench_unix.py and bench_local.py run it: ``shmq serve --workers 2
--port 0 --unix PATH`` of this checkout for tcp:// and unix://, and an instance of its own for
co-located shm:// (no broker).  Puts are confirmed; every message is acked and the ack waited
for, unless the variant says otherwise."""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import bench_tcp
import common

import peers
import shmq
import shmq.accel
from peers import Go, Ready, Variant

WORKERS = 2
PING_AFFINITY = bench_tcp.PING_AFFINITY  # the ping-pong pair on one worker, as bench_tcp.py places it
_PUT = "put waited for its confirmation"
_ACK = "get, then msg.ack() waited for"
TCP, CHAINED, INTERVAL, ALWAYS = ("tcp, get + ack", "tcp, get(ack=previous)", "tcp, get + ack, interval",
                                  "tcp, get + ack, always")
UNIX, SHM = "unix, get + ack", "shm, get + ack"


def _consume(ready: Ready, url: str, name: str, n: int, batch: int, chained: bool,
             affinity: str) -> tuple[int, bytes]:
    b = shmq.connect(url, affinity=affinity) if affinity else shmq.connect(url)
    try:
        q = b.queue(name)
        ready()
        return common.shmq_consume(q, n, batch, chained=chained)
    finally:
        b.close()


def _produce(go: Go, url: str, name: str, n: int, size: int, batch: int) -> None:
    b = shmq.connect(url)
    try:
        q = b.queue(name)
        go()
        common.shmq_produce(q, b"x" * size, n, batch)
    finally:
        b.close()


def _pong(ready: Ready, url: str, names: tuple[str, str], total: int, affinity: str) -> None:
    b = shmq.connect(url, affinity=affinity) if affinity else shmq.connect(url)
    try:
        ping, pong = b.queue(names[0]), b.queue(names[1])
        ready()
        common.shmq_pong(ping.get, pong.put, total)
    finally:
        b.close()


def _ping(go: Go, url: str, names: tuple[str, str], size: int, total: int, affinity: str) -> array[int]:
    b = shmq.connect(url, affinity=affinity) if affinity else shmq.connect(url)
    try:
        ping, pong = b.queue(names[0]), b.queue(names[1])
        go()
        return common.shmq_ping(ping.put, pong.get, b"p" * size, total)
    finally:
        b.close()


class ShmqPeer(peers.Peer):
    name = "shmq"
    summary = (f"shmq serve --workers {WORKERS} of this checkout (tcp://, unix://), or co-located (shm://); "
               "queues of durability 'memory' unless the variant says otherwise; the Python client")
    work_queue_variants = (
        Variant(TCP, f"durability memory; {_PUT}; {_ACK}", "tcp"),
        Variant(CHAINED, f"durability memory; {_PUT}; each get carries the ack of the message before "
                "(one round trip a message, the ack still confirmed by the get's answer)", "tcp"),
        Variant(INTERVAL, f"durability interval (journal fsync'd at least every 1 s); {_PUT}; {_ACK}", "tcp",
                durability="disk, interval"),
        Variant(ALWAYS, f"durability always (fsync'd before the put / ack is confirmed, group commit); "
                f"{_PUT}; {_ACK}", "tcp", durability="disk, fsync"),
        Variant(UNIX, f"durability memory; {_PUT}; {_ACK}", "unix"),
        Variant(SHM, f"co-located, no broker; durability memory; {_PUT}; {_ACK}", "shm", fast=True),
    )
    ping_variants = (
        Variant("tcp", "A puts on ping and gets from pong, B gets ping, puts pong, acks ping; every ack "
                "waited (A acks after its timing); both on one broker worker", "tcp"),
        Variant("unix", "as tcp, over the broker's Unix socket", "unix"),
        Variant("shm", "as tcp, co-located (no broker)", "shm", fast=True),
    )
    batch_variants = (TCP, SHM)
    size_variants = (TCP, SHM)

    def __init__(self) -> None:
        super().__init__()
        self.srv: bench_tcp.ShmqServer | None = None
        self.local: Any = None
        self.instance = f"bpeers{os.getpid()}"

    def version(self) -> str:
        return f"{getattr(shmq, '__version__', '?')} ({shmq.accel.describe()})"

    @contextmanager
    def server(self) -> Iterator[None]:
        srv = bench_tcp.ShmqServer(WORKERS, "peers", unix=True)
        try:
            try:
                srv.start()
            except bench_tcp.SetupError as e:
                raise peers.SetupError(str(e)) from None
            self.srv = srv
            self.local = shmq.connect(f"shm://{self.instance}")
            yield
        finally:
            if self.local is not None:
                self.local.destroy()
                self.local = None
            srv.stop()
            self.srv = None
            self.notes += srv.notes
            left = common.leftovers(self.instance)
            if left:
                self.notes.append(f"shared memory of shm://{self.instance} left behind: {', '.join(left)}")

    def _where(self, transport: str) -> tuple[Any, str]:
        """The handle that creates the queues, and the URL the children connect to."""
        assert self.srv is not None
        if transport == "shm":
            return self.local, f"shm://{self.instance}"
        return self.srv.broker, self.srv.unix_url if transport == "unix" else self.srv.url

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        v = self.variant(variant)
        admin, url = self._where(v.transport)
        durability = {"disk, interval": "interval", "disk, fsync": "always"}.get(v.durability, "memory")
        name = f"wq{next(self._ids)}"
        admin.create_queue(name, capacity=common.SHMQ_CAPACITY, max_bytes=common.SHMQ_MAX_BYTES,
                           durability=durability)
        try:
            return peers.throughput(_consume, _produce, (url, name, n, batch, variant == CHAINED, ""),
                                    (url, name, n, size, batch), n, size, self.timeout)
        finally:
            common.delete_queues(admin, [name])

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        v = self.variant(variant)
        admin, url = self._where(v.transport)
        k = next(self._ids)
        names = (f"ping{k}", f"pong{k}")
        common.create_queues(admin, names)
        affinity = "" if v.transport == "shm" else PING_AFFINITY
        total = n + common.PING_WARMUP
        try:
            return peers.ping_pong(_pong, _ping, (url, names, total, affinity),
                                   (url, names, size, total, affinity), total, self.timeout)
        finally:
            common.delete_queues(admin, names)


PEER = ShmqPeer()
