"""ZeroMQ through pyzmq: a raw transport, no broker, no storage, no acks.  PUSH/PULL for the work
queue (the consumer binds, the producer connects; a message sits in the sender's or receiver's
buffer until it is read, and dies with its process), REQ/REP for the ping-pong; over ipc://
(a Unix socket in a temp dir) or tcp://127.0.0.1 on a free port."""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import common

import peers
from peers import Go, Ready, Variant

try:
    import zmq  # type: ignore[import-not-found]  # (not installed by make test: the peers extra)
except ImportError:  # reported by available()
    zmq = None  # type: ignore[assignment]

PUSH_IPC, PUSH_TCP, REQ_IPC, REQ_TCP = "PUSH/PULL ipc", "PUSH/PULL tcp", "REQ/REP ipc", "REQ/REP tcp"
_NO_ACK = "no broker, no storage, no ack: a message in a buffer of a process that dies is lost"


def _consume(ready: Ready, endpoint: str, n: int) -> tuple[int, bytes]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    try:
        s.bind(endpoint)
        ready()
        recv = s.recv
        last = b""
        for _ in range(n):
            last = recv()
        return n, last
    finally:
        s.close(linger=0)
        ctx.term()


def _produce(go: Go, endpoint: str, n: int, size: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    try:
        s.connect(endpoint)
        payload = b"x" * size
        send = s.send
        go()
        for _ in range(n):
            send(payload)
    finally:
        s.close()  # the default linger: what is queued is delivered first
        ctx.term()


def _pong(ready: Ready, endpoint: str, total: int) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.REP)
    try:
        s.bind(endpoint)
        ready()
        recv, send = s.recv, s.send
        for _ in range(total):
            send(recv())
    finally:
        s.close()
        ctx.term()


def _ping(go: Go, endpoint: str, size: int, total: int) -> array[int]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    try:
        s.connect(endpoint)
        payload = b"p" * size
        send, recv = s.send, s.recv
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        go()
        for i in range(total):
            t0 = clock()
            send(payload)
            recv()
            lat[i] = clock() - t0
        return lat
    finally:
        s.close()
        ctx.term()


class ZmqPeer(peers.Peer):
    name = "pyzmq"
    summary = f"pyzmq (libzmq), no server; {_NO_ACK}; each send / recv is one call into libzmq from Python"
    work_queue_variants = (
        Variant(PUSH_IPC, f"PUSH -> PULL over ipc://; {_NO_ACK}", "ipc", durability="none", acks="none",
                puts="not confirmed", fast=True),
        Variant(PUSH_TCP, f"PUSH -> PULL over tcp://127.0.0.1; {_NO_ACK}", "tcp", durability="none",
                acks="none", puts="not confirmed", fast=True),
    )
    ping_variants = (
        Variant(REQ_IPC, "REQ sends, REP sends the payload back, over ipc://", "ipc", durability="none",
                acks="none", puts="not confirmed", fast=True),
        Variant(REQ_TCP, "REQ sends, REP sends the payload back, over tcp://127.0.0.1", "tcp",
                durability="none", acks="none", puts="not confirmed", fast=True),
    )
    no_batch = "no batch call: each message is its own send (send_multipart makes one message of many frames)"
    size_variants = (PUSH_IPC,)

    def __init__(self) -> None:
        super().__init__()
        self.tmp = ""

    def available(self) -> str | None:
        return "pyzmq is not installed (pip install pyzmq, or make bench)" if zmq is None else None

    def version(self) -> str:
        return f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}"

    @contextmanager
    def server(self) -> Iterator[None]:
        with peers.temp_dir("zmq") as tmp:  # the ipc:// sockets
            self.tmp = tmp
            yield

    def _endpoint(self, transport: str) -> str:
        if transport == "ipc":
            return f"ipc://{os.path.join(self.tmp, f's{next(self._ids)}')}"
        return f"tcp://127.0.0.1:{peers.free_port()}"

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        if batch != 1:
            raise common.TrialError(self.no_batch)
        endpoint = self._endpoint(self.variant(variant).transport)
        return peers.throughput(_consume, _produce, (endpoint, n), (endpoint, n, size), n, size, self.timeout)

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        endpoint = self._endpoint(self.variant(variant).transport)
        total = n + common.PING_WARMUP
        return peers.ping_pong(_pong, _ping, (endpoint, total), (endpoint, size, total), total, self.timeout)


PEER = ZmqPeer()
