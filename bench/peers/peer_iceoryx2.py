"""iceoryx2: zero-copy publish/subscribe in shared memory, no broker, no storage, no acks.  One
publish/subscribe service of byte slices per run (history 0, no safe overflow: the publisher's
backpressure strategy is RetryUntilDelivered, so nothing is dropped); each sample is written with
one copy into the loaned slice and read with one copy out of it.

iceoryx2 has no blocking receive.  ``polling``: the subscriber calls ``receive()`` in a loop
without sleeping (a core stays busy while it waits: iceoryx2's fastest way, and what its own
benchmarks do); ``event``: the publisher also notifies an event service after each sample and
the subscriber sleeps in the listener's ``blocking_wait`` when nothing is there."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import time
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import common
from common import TrialError

import peers
from peers import Go, Ready, Variant

try:
    import iceoryx2 as iox2  # type: ignore[import-untyped,import-not-found]
except ImportError:  # reported by available()
    iox2 = None

BUFFER = 256  # samples a subscriber buffers (the publisher waits when it is full)
POLL, EVENT = "pub/sub, polling", "pub/sub + event"
PROBE = 0  # the first byte of a probe sample (the payloads are b"x..." / b"p...")
PROBE_EVERY = 0.002  # s between probes while the connection is not there
HANDSHAKE_TIMEOUT = 30.0
WAKE_EVERY = iox2.Duration.from_millis(100) if iox2 is not None else None  # the event variant's longest sleep
_NO_ACK = "no broker, no storage, no ack"


def _node() -> Any:
    # no signal handlers of iceoryx2's own: the bench stops its children with SIGTERM
    return (iox2.NodeBuilder.new().signal_handling_mode(iox2.SignalHandlingMode.Disabled)
            .create(iox2.ServiceType.Ipc))


def _pubsub(node: Any, name: str) -> Any:
    return (node.service_builder(iox2.ServiceName.new(name)).publish_subscribe(iox2.Slice[ctypes.c_uint8])
            .enable_safe_overflow(False).history_size(0).subscriber_max_buffer_size(BUFFER)
            .max_publishers(1).max_subscribers(1).open_or_create())


def _event(node: Any, name: str) -> Any:
    return node.service_builder(iox2.ServiceName.new(name + "/event")).event().open_or_create()


class _Sub:
    """A subscriber: ``get()`` waits for the next sample and returns a copy of its payload."""

    def __init__(self, node: Any, name: str, event: bool) -> None:
        self.sub = _pubsub(node, name).subscriber_builder().buffer_size(BUFFER).create()
        self.listener = _event(node, name).listener_builder().create() if event else None

    def get(self, probes: bool = False) -> bytes:
        """The next payload; probes are dropped unless ``probes``."""
        recv = self.sub.receive
        listener = self.listener
        while True:
            while (s := recv()) is None:
                if listener is not None:  # a notification lost would only cost WAKE_EVERY
                    listener.timed_wait(WAKE_EVERY)
            data = ctypes.string_at(s.payload_ptr, s.header.number_of_elements)
            s.delete()  # give the sample back
            if probes or data[0] != PROBE:
                return data

    def poll(self, timeout: float) -> bytes | None:
        """A payload (probes too) that comes within ``timeout`` s, else None."""
        deadline = time.monotonic() + timeout
        while (s := self.sub.receive()) is None:
            if time.monotonic() > deadline:
                return None
        data = ctypes.string_at(s.payload_ptr, s.header.number_of_elements)
        s.delete()
        return data

    def close(self) -> None:
        if self.listener is not None:
            self.listener.delete()
        self.sub.delete()


class _Pub:
    """A publisher: ``put(payload)`` copies it into a loaned sample and sends it (and notifies)."""

    def __init__(self, node: Any, name: str, size: int, event: bool) -> None:
        self.pub = (_pubsub(node, name).publisher_builder().initial_max_slice_len(size)
                    .backpressure_strategy(iox2.BackpressureStrategy.RetryUntilDelivered).create())
        self.notifier = _event(node, name).notifier_builder().create() if event else None
        self.size = size
        self.probe = bytes([PROBE]) * size

    def put(self, payload: bytes) -> None:
        s = self.pub.loan_slice_uninit(self.size)
        ctypes.memmove(s.payload_ptr, payload, self.size)
        s.assume_init().send()
        if self.notifier is not None:
            self.notifier.notify()

    def probe_until(self, delivered: Callable[[float], bool]) -> None:
        """Send probes until ``delivered(wait_s)`` says one arrived.  A publisher here does not always
        reach a subscriber that is already there, even after ``update_connections()`` (iceoryx2
        issues 129, 923 and 1641): its samples are dropped, so the runs begin with a handshake."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        while True:
            self.pub.update_connections()
            self.put(self.probe)
            if delivered(PROBE_EVERY):
                return
            if time.monotonic() > deadline:
                raise TrialError(f"iceoryx2: no probe reached the subscriber in {HANDSHAKE_TIMEOUT:g} s")

    def close(self) -> None:
        if self.notifier is not None:
            self.notifier.delete()
        self.pub.delete()


def _consume(ready: Ready, name: str, n: int, event: bool, probed: Any) -> tuple[int, bytes]:
    node = _node()
    sub = _Sub(node, name, event)
    try:
        ready()
        if sub.poll(HANDSHAKE_TIMEOUT) is None:  # the first probe
            raise TrialError("iceoryx2: no probe came")
        probed.set()
        get = sub.get
        last = b""
        for _ in range(n):
            last = get()
        return n, last
    finally:
        sub.close()


def _produce(go: Go, name: str, n: int, size: int, event: bool, probed: Any) -> None:
    go()  # once the consumer made the service and subscribed
    node = _node()
    pub = _Pub(node, name, size, event)
    try:
        pub.probe_until(probed.wait)
        payload = b"x" * size
        put = pub.put
        go()  # again: the start is stamped just before the first put
        for _ in range(n):
            put(payload)
    finally:
        pub.close()


def _pong(ready: Ready, name: str, size: int, total: int, event: bool) -> None:
    """Echo every ping, probes too (those are not counted; before echoing one, connect again)."""
    node = _node()
    sub = _Sub(node, name + "/ping", event)
    pub = _Pub(node, name + "/pong", size, event)
    try:
        ready()
        get, put = sub.get, pub.put
        done = 0
        while done < total:
            data = get(probes=True)
            if data[0] == PROBE:
                pub.pub.update_connections()
            else:
                done += 1
            put(data)
    finally:
        pub.close()
        sub.close()


def _ping(go: Go, name: str, size: int, total: int, event: bool) -> array[int]:
    go()
    node = _node()
    pub = _Pub(node, name + "/ping", size, event)
    sub = _Sub(node, name + "/pong", event)
    try:
        pub.probe_until(lambda wait: sub.poll(wait) is not None)  # a probe came back: both ways connected
        payload = b"p" * size
        put, get = pub.put, sub.get
        lat = array("q", bytes(8 * total))
        clock = time.perf_counter_ns
        for i in range(total):
            t0 = clock()
            put(payload)
            get()
            lat[i] = clock() - t0
        return lat
    finally:
        sub.close()
        pub.close()


class Iceoryx2Peer(peers.Peer):
    name = "iceoryx2"
    summary = (f"iceoryx2's Python bindings, no server; {_NO_ACK}; a sample is loaned, filled, sent, "
               "received and given back through the bindings, one Python call at a time")
    work_queue_variants = (
        Variant(POLL, f"publish/subscribe, the subscriber polls receive() (a busy core); {_NO_ACK}", "shm",
                durability="none", acks="none", puts="not confirmed", fast=True),
        Variant(EVENT, f"publish/subscribe, each sample notified through an event service, the subscriber "
                f"sleeps when there is none; {_NO_ACK}", "shm", durability="none", acks="none",
                puts="not confirmed", fast=True),
    )
    ping_variants = (
        Variant(POLL, "two publish/subscribe services (ping, pong), both sides polling receive()", "shm",
                durability="none", acks="none", puts="not confirmed", fast=True),
        Variant(EVENT, "two publish/subscribe services with events, both sides sleeping while they wait",
                "shm", durability="none", acks="none", puts="not confirmed", fast=True),
    )
    no_batch = "no batch call: each sample is loaned and sent on its own"
    size_variants = (POLL,)

    def __init__(self) -> None:
        super().__init__()
        self._before: set[str] = set()
        self._tmp_root_existed = True

    def available(self) -> str | None:
        return "iceoryx2 is not installed (pip install iceoryx2, or make bench)" if iox2 is None else None

    def version(self) -> str:
        return f"iceoryx2 {peers.dist_version('iceoryx2')} (Python bindings)"

    @contextmanager
    def server(self) -> Iterator[None]:
        iox2.set_log_level(iox2.LogLevel.Error)
        self._before = set(glob.glob("/dev/shm/iox2_*"))
        self._tmp_root_existed = os.path.exists("/tmp/iceoryx2")
        try:
            yield
        finally:
            self._clean()

    def _clean(self) -> None:
        """Remove what the runs' nodes left (a child stopped by SIGTERM does not drop its node)."""
        try:
            node = _node()
            node.try_cleanup_dead_nodes()
            del node
        except Exception as e:  # noqa: BLE001 - a warning, the figures stand
            self.notes.append(f"iceoryx2's cleanup of dead nodes failed: {e!r}")
        left = sorted(set(glob.glob("/dev/shm/iox2_*")) - self._before)
        services = [p for p in left if not p.endswith(".global_mgmt")]
        if services:
            self.notes.append(f"iceoryx2 left shared memory behind: {', '.join(services)}")
        elif left and not self._before:  # only iceoryx2's global registry, made by these runs
            for p in left:
                os.unlink(p)
            if not self._tmp_root_existed:
                shutil.rmtree("/tmp/iceoryx2", ignore_errors=True)

    def _name(self) -> str:
        return f"shmq-bench/{os.getpid()}/{next(self._ids)}"

    def work_queue(self, variant: str, n: int, size: int, batch: int = 1) -> float:
        if batch != 1:
            raise common.TrialError(self.no_batch)
        name = self._name()
        event = variant == EVENT
        probed = peers.CTX.Event()
        return peers.throughput(_consume, _produce, (name, n, event, probed), (name, n, size, event, probed),
                                n, size, self.timeout)

    def ping_pong(self, variant: str, n: int, size: int) -> list[int]:
        name = self._name()
        total = n + common.PING_WARMUP
        event = variant == EVENT
        return peers.ping_pong(_pong, _ping, (name, size, total, event), (name, size, total, event), total,
                               self.timeout)


PEER = Iceoryx2Peer()
