"""Redis Streams: redis-server (bench_tcp.py's: a free loopback port, no persistence, its own temp
dir) and redis-py.  The producer's XADD is answered (a confirmed put; batches: a pipeline of XADDs,
as bench_tcp.py's); the consumer reads with XREADGROUP (COUNT 1, or the batch; BLOCK 0) and acks
with XACK, whose answer it waits for (batches: one XACK with every id)."""

from __future__ import annotations

import shutil
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import bench_tcp
import common

import peers
from peers import Go, Ready, Variant

try:
    import redis
except ImportError:  # reported by available()
    redis = None  # type: ignore[assignment]

GROUP, FIELD = b"bench", b"d"
XACK_EACH = "XADD / XREADGROUP + XACK"


def _client(port: int) -> Any:
    r = redis.Redis(host="127.0.0.1", port=port)
    r.ping()  # redis-py connects lazily: connect now
    return r


def _consume(ready: Ready, port: int, key: str, n: int, batch: int) -> tuple[int, bytes]:
    r = _client(port)
    try:
        xreadgroup, xack = r.xreadgroup, r.xack
        streams = {key: ">"}
        ready()
        got = 0
        last = b""
        while got < n:
            entries = bench_tcp._stream_entries(xreadgroup(GROUP, "c1", streams, count=batch, block=0))
            if not entries:
                continue
            xack(key, GROUP, *[e[0] for e in entries])
            got += len(entries)
            last = entries[-1][1][FIELD]
        return got, last
    finally:
        r.close()


def _produce(go: Go, port: int, key: str, n: int, size: int, batch: int) -> None:
    r = _client(port)
    try:
        fields = {FIELD: b"x" * size}
        go()
        if batch == 1:
            xadd = r.xadd
            for _ in range(n):
                xadd(key, fields)
            return
        for _ in range(n // batch):
            pipe = r.pipeline(transaction=False)
            for _ in range(batch):
                pipe.xadd(key, fields)
            pipe.execute()
    finally:
        r.close()


def _pong(ready: Ready, port: int, keys: tuple[str, str], total: int) -> None:
    r = _client(port)
    try:
        streams = {keys[0]: ">"}
        ready()
        for _ in range(total):
            reply = r.xreadgroup(GROUP, "c1", streams, count=1, block=0)
            ((entry_id, fields),) = bench_tcp._stream_entries(reply)
            r.xadd(keys[1], {FIELD: fields[FIELD]})
            r.xack(keys[0], GROUP, entry_id)
    finally:
        r.close()


def _ping(go: Go, port: int, keys: tuple[str, str], size: int, total: int) -> array[int]:
    r = _client(port)
    try:
        streams = {keys[1]: ">"}
        fields = {FIELD: b"p" * size}
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        go()
        for i in range(total):
            t0 = clock()
            r.xadd(keys[0], fields)
            reply = r.xreadgroup(GROUP, "c1", streams, count=1, block=0)
            ((entry_id, _f),) = bench_tcp._stream_entries(reply)
            lat[i] = clock() - t0
            r.xack(keys[1], GROUP, entry_id)
        return lat
    finally:
        r.close()


class RedisStreamsPeer(peers.Peer):
    name = "Redis Streams"
    summary = ("redis-server on 127.0.0.1, no persistence (--save '' --appendonly no); redis-py, one "
               "command a round trip unless pipelined")
    work_queue_variants = (
        Variant(XACK_EACH, "memory (no RDB, no AOF); XADD answered (confirmed put); XREADGROUP COUNT 1 "
                "BLOCK 0, then XACK each, its answer waited for", "tcp"),
    )
    ping_variants = (
        Variant(XACK_EACH, "two streams (ping, pong), a group each: A XADDs ping and XREADGROUPs pong, B "
                "XREADGROUPs ping, XADDs pong, XACKs ping; A XACKs after its timing", "tcp"),
    )
    batch_variants = (XACK_EACH,)
    size_variants = (XACK_EACH,)

    def __init__(self) -> None:
        super().__init__()
        self.rs: bench_tcp.RedisServer | None = None

    def available(self) -> str | None:
        if redis is None:
            return "redis-py is not installed (pip install redis, or make bench)"
        if shutil.which("redis-server") is None:
            return "no redis-server (apt-get install redis-server, or make bench as root)"
        return None

    def version(self) -> str:
        return f"redis-server {self.rs.version if self.rs else '?'}, redis-py {peers.dist_version('redis')}"

    @contextmanager
    def server(self) -> Iterator[None]:
        binary = shutil.which("redis-server")
        assert binary is not None
        rs = bench_tcp.RedisServer(binary)
        try:
            try:
                rs.start()
            except bench_tcp.SetupError as e:
                raise peers.SetupError(str(e)) from None
            self.rs = rs
            yield
        finally:
            rs.stop()
            self.notes += rs.notes

    def _make(self, *keys: str) -> None:
        assert self.rs is not None
        for key in keys:
            self.rs.client.xgroup_create(key, GROUP, id="0", mkstream=True)

    def _delete(self, *keys: str) -> None:
        if self.rs is not None and self.rs.client is not None:
            self.rs.client.delete(*keys)

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        assert self.rs is not None
        key = f"wq{next(self._ids)}"
        self._make(key)
        try:
            return peers.throughput(_consume, _produce, (self.rs.port, key, n, batch),
                                    (self.rs.port, key, n, size, batch), n, size, self.timeout)
        finally:
            self._delete(key)

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        assert self.rs is not None
        k = next(self._ids)
        keys = (f"ping{k}", f"pong{k}")
        self._make(*keys)
        total = n + common.PING_WARMUP
        try:
            return peers.ping_pong(_pong, _ping, (self.rs.port, keys, total),
                                   (self.rs.port, keys, size, total), total, self.timeout)
        finally:
            self._delete(*keys)


PEER = RedisStreamsPeer()
