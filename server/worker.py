"""One broker worker process: an asyncio event loop serving clients on a SO_REUSEPORT socket.

Every worker opens its own listening socket on the same address, so the kernel
spreads connections between them; all of them operate on the same queues in
shared memory, so no state depends on which worker accepted a client.

Nothing here blocks the loop: a CONSUME or PRODUCE that has to wait is parked
and retried when the queue may have changed.  "May have changed" comes from
three places: a request handled by this worker (at once), the worker's
doorbell, read on the loop, which other workers and co-located producers ring
when a message arrives in a queue this worker has flagged (``shmq.core.doorbell``),
and a 50 ms tick (lease expiry, nack delays, room freed by others).

Leases are per connection: a connection that closes, or dies, gives its
unacknowledged messages back at once.

The worker that accepts a connection need not be the one that serves it: once its
HANDSHAKE is read, it may be handed to another worker (``server.placement``: the
fewest connections, or the worker of its affinity).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shmq import options
from shmq.core.doorbell import Bell
from shmq.core.serverqueue import ServerBroker, ServerQueue
from shmq.errors import ShmqError
from shmq.protocol.codec import Frame, encode_frame
from shmq.resources import fd_limits
from shmq.spin import Spin
from shmq.tls import ServerTls, server_context

from .connection import ServerConnection
from .core import Core
from .driver import Driver
from .parking import poke
from .placement import Counts, Handoff, choose
from .scoreboard import Scoreboard
from .spinner import Spinner
from .tls_listener import TlsListener

BIND_TRIES = 20  # x 50 ms: a restarted worker waits for its predecessor's doorbell and handoff sockets to go
log = logging.getLogger("shmq.worker")


def reuseport_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker is started with (``shmq serve``'s settings, and what the supervisor
    shares with every worker it forks), as one value: the supervisor makes one per worker
    (:meth:`Supervisor.worker_settings`), a test makes its own."""

    instance: str
    host: str
    port: int  # the TCP port every worker listens on (SO_REUSEPORT)
    worker_id: int
    token: str
    max_connections: int = options.MAX_CONNECTIONS  # --max-connections: held at once by this worker
    counts: Counts | None = None  # every worker's connection count (None: placement is the kernel's alone)
    unix_sock: socket.socket | None = None  # the supervisor's Unix-domain listener, shared by every worker
    tls: ServerTls | None = None  # the TCP port speaks TLS (the Unix socket never does)
    heartbeat: float = options.HEARTBEAT  # --heartbeat: seconds between heartbeats (0: none)
    board: Scoreboard | None = None  # --metrics: this worker's requests are counted in its row
    spin_us: float = options.WORKER_SPIN_US  # --spin-us: polling for the next request after a read
    replication: Callable[[], dict[str, Any]] | None = None  # INFO's replication (server.replication.Board)


class Worker:
    """One worker process: its event loop, listening socket, doorbell and placement,
    around a :class:`~shmq.server.core.Core` that handles the requests."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id
        self.tls_listener: TlsListener | None = None
        # connections held at once: --max-connections, or fewer when the descriptor limit
        # would run out first (the refusal then names it: ``cap``)
        asked = settings.max_connections
        fds = fd_limits()[0] - options.FD_RESERVE
        self.max_connections = max(1, min(asked, fds))
        self.cap = (f"{self.max_connections} connections already" if asked <= fds else
                    f"{self.max_connections} connections already, the most its descriptor limit allows "
                    f"(ulimit -n {fds + options.FD_RESERVE}; --max-connections is {asked})")
        self.drivers: dict[ServerConnection, Driver] = {}  # this worker's connections
        self.bell: Bell | None = None
        self.counts = settings.counts
        self.handoff: Handoff | None = None  # where other workers hand us connections (server.placement)
        self.flagged: dict[str, ServerQueue] = {}  # queues whose bell flag this worker has set
        self.flagged_ids: dict[int, str] = {}  # their ids (a doorbell datagram names the id)
        self.flag_needed: dict[str, float] = {}  # queue -> when the tick last saw someone wait there
        self.loop: asyncio.AbstractEventLoop
        self.spinner: Spinner
        self.broker: ServerBroker
        self.core: Core

    @property
    def stopping(self) -> bool:
        return self.core.stopping

    # ------------------------------------------------------------ life cycle
    def run(self, ready: Any = None) -> None:
        self.broker = ServerBroker(self.settings.instance)
        try:  # uvloop halves the event loop's cost per request; plain asyncio works too
            import uvloop
        except ImportError:
            asyncio.run(self._main(ready))
        else:
            uvloop.run(self._main(ready))

    async def _main(self, ready: Any) -> None:
        st = self.settings
        self.loop = asyncio.get_running_loop()
        self.spinner = Spinner(Spin(st.spin_us), self.loop.call_soon)
        self.core = Core(self.broker, self.worker_id, st.token, post=self.loop.call_soon_threadsafe,
                         flag=self._flag, place=self.place, heartbeat=st.heartbeat, counts=self.counts,
                         meter=None if st.board is None else st.board.worker(self.worker_id),
                         replication=st.replication)
        await self._open_bell()
        await self._open_handoff()
        sock = reuseport_socket(st.host, st.port)
        server: asyncio.AbstractServer | TlsListener
        if st.tls is None:
            server = await self.loop.create_server(lambda: Driver(self), sock=sock, backlog=4096)
        else:  # a silent peer is dropped after TLS_HANDSHAKE_TIMEOUT, before it counts as a connection
            server = self.tls_listener = TlsListener(self.loop, sock, lambda: Driver(self),
                                                     server_context(st.tls), place=self.place_tls)
        userver = None
        if st.unix_sock is not None:
            userver = await self.loop.create_unix_server(lambda: Driver(self), sock=st.unix_sock,
                                                         backlog=4096)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        tick = self.loop.create_task(self._tick())
        await stop.wait()
        # graceful: stop accepting, let requests in progress finish, give leases back
        self.core.stopping = True
        server.close()
        if userver is not None:
            userver.close()
        deadline = time.monotonic() + options.SHUTDOWN_GRACE
        while any(c.busy for c in self.drivers) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for d in list(self.drivers.values()):
            d.close()
        tick.cancel()
        for name in list(self.flagged):
            self._unflag(name)
        if self.bell is not None:
            self.loop.remove_reader(self.bell.fileno())
            self.bell.close()
        if self.handoff is not None:  # sockets still in flight to us are closed with it
            self.loop.remove_reader(self.handoff.fileno())
            self.handoff.close()
        self.broker.close()

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(options.WORKER_TICK)
            try:
                self._tock()
            except Exception:  # noqa: BLE001 - the tick must outlive any one queue's trouble
                log.exception("worker %d: tick failed", self.worker_id)

    def _tock(self) -> None:
        """One tick: let go of deleted queues, retry what waits (deadlines, expired leases,
        delays, room freed, subscriptions of deleted queues ended), keep the flags."""
        core = self.core
        self.broker.prune()  # a queue deleted by anyone: its memory goes from here too
        now = time.monotonic()
        for name in list(core.waiters) + list(core.subs):
            self._flag(name)  # the flag may be on a queue deleted and created again
            poke(core, name)
            if name in self.flagged:
                self.flag_needed[name] = now
        grace = options.WORKER_FLAG_GRACE
        for name in [n for n in self.flagged if now - self.flag_needed.get(n, 0.0) > grace]:
            self._unflag(name)

    # ------------------------------------------------------------ doorbell
    async def _open_bell(self) -> None:
        """Bind this worker's doorbell and clear the flags a predecessor of the same id
        may have left set in every queue (it died: nobody reads them)."""
        self.broker.serve_as(self.worker_id)
        self.bell = await _bind(Bell, self.broker.instance_uid, self.worker_id)
        if self.bell is None:
            log.warning("worker %d: doorbell address in use; waiting requests are retried on the "
                        "%d ms tick only", self.worker_id, options.WORKER_TICK * 1000)
        else:
            self.loop.add_reader(self.bell.fileno(), self._on_bell)
        for q in self.broker.queues():
            q.set_bell(self.worker_id, False)

    def _on_bell(self) -> None:
        assert self.bell is not None
        for qid in self.bell.drain():
            name = self.flagged_ids.get(qid)
            if name is not None:
                poke(self.core, name)

    def _flag(self, name: str) -> None:
        """Ask to be rung when a message arrives in the queue ``name`` (call once a request
        is parked on it, or a subscription made).  Setting the flag is followed by a retry
        of what waits: a message that came before the flag was seen is not missed."""
        try:
            q = self.core.queue(name)
        except ShmqError:
            return  # gone: the parked requests learn it on their next retry
        if self.flagged.get(name) is q and q.bell(self.worker_id):
            return
        old = self.flagged.get(name)
        if old is not None and old is not q:
            self._unflag(name)
        q.set_bell(self.worker_id, True)
        self.flagged[name] = q
        self.flagged_ids[q.queue_id] = name
        self.flag_needed[name] = time.monotonic()
        self.loop.call_soon(poke, self.core, name)

    def _unflag(self, name: str) -> None:
        q = self.flagged.pop(name, None)
        self.flag_needed.pop(name, None)
        if q is not None:
            self.flagged_ids.pop(q.queue_id, None)
            q.set_bell(self.worker_id, False)

    # ------------------------------------------------------------ placement
    async def _open_handoff(self) -> None:
        if self.counts is None:
            return
        self.count_changed()  # a predecessor's connections died with it
        self.handoff = await _bind(Handoff, self.broker.instance_uid, self.worker_id)
        if self.handoff is None:
            log.warning("worker %d: handoff address in use; this worker keeps the connections it "
                        "accepts and is handed none", self.worker_id)
        else:
            self.loop.add_reader(self.handoff.fileno(), self._on_handoff)

    def count_changed(self) -> None:
        if self.counts is not None:
            self.counts.set(self.worker_id, len(self.drivers))

    def _target(self, affinity: str, uncounted: int = 0) -> int | None:
        """The other worker a new connection should go to (``server.placement``), None: this
        one.  ``uncounted``: 1 for a connection not in this worker's count yet."""
        if self.handoff is None or self.counts is None or self.stopping or self.counts.workers < 2:
            return None
        counts = self.counts.snapshot()
        counts[self.worker_id] += uncounted
        target = choose(counts, self.worker_id, affinity)
        if target == self.worker_id or counts[target] >= self.max_connections:
            return None  # (a full worker would refuse it: it is served here instead)
        return target

    def place(self, conn: ServerConnection, f: Frame, affinity: str) -> bool:
        """Hand ``conn``, which has sent its HANDSHAKE ``f`` and nothing else, to the worker
        that should serve it.  True when it went."""
        target = self._target(affinity)
        if target is None:
            return False
        assert self.handoff is not None
        driver = self.drivers.get(conn)
        if driver is None or driver.transport is None or driver.transport.get_extra_info("sslcontext"):
            return False  # a TLS session lives in this process: only its socket could move
        sock = driver.transport.get_extra_info("socket")
        preface = encode_frame(f.type, f.msg_id, f.body)  # the HANDSHAKE as it came
        if sock is None or not self.handoff.send(target, sock.fileno(), preface):
            return False
        driver.leave()
        return True

    def place_tls(self, sock: socket.socket) -> bool:
        """Hand a new TLS connection, before its TLS handshake, to the worker with the fewest
        connections (with an empty preface: the TLS is still to come).  True when it went."""
        target = self._target("", uncounted=1)
        if target is None:
            return False
        assert self.handoff is not None
        return self.handoff.send(target, sock.fileno(), b"")

    def _on_handoff(self) -> None:
        assert self.handoff is not None
        for sock, preface in self.handoff.receive():
            self.loop.create_task(self._adopt(sock, preface))

    async def _adopt(self, sock: socket.socket, preface: bytes) -> None:
        if not preface:  # a TLS connection, handed over before its TLS handshake
            if self.tls_listener is None:
                sock.close()
            else:
                self.tls_listener.adopt(sock)
            return
        try:
            await self.loop.connect_accepted_socket(lambda: Driver(self, preface), sock)
        except (OSError, ValueError):  # the client went meanwhile, or it is no stream socket
            sock.close()


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the supervisor dies, however it dies (Linux prctl)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the supervisor died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


async def _bind(kind: Callable[[int, int], Any], instance_uid: int, worker_id: int) -> Any:
    """A worker's abstract-namespace socket (doorbell, handoff), bound; None when its address
    stays in use (a predecessor of the same id that is still exiting is waited for)."""
    for _ in range(BIND_TRIES):
        try:
            return kind(instance_uid, worker_id)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            await asyncio.sleep(options.WORKER_TICK)
    return None


def worker_main(settings: WorkerSettings, ready: Any) -> None:
    """Entry point of a worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; SIGTERM stops us
    _die_with_parent()
    sys.setswitchinterval(0.0005)  # a woken durable-mark thread gets the GIL in 0.5 ms, not 5 ms
    os.environ.pop(options.TOKEN_ENV, None)
    Worker(settings).run(ready)
