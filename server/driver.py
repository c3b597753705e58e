"""The asyncio side of one client connection: bytes in and out, timers, back-pressure.

A :class:`Driver` is the ``asyncio.Protocol`` of one socket.  It feeds what it
reads to the connection's protocol state (``ServerConnection``) and the handlers,
writes what they send, and closes the socket once the connection is CLOSED.
It owns what needs the event loop: the handshake timer, refusing a connection
the worker has no room for, and pausing reads while the client does not read its
replies (so a worker's memory per connection stays bounded by the transport's
buffer limits).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
from typing import Protocol

from shmq import options
from shmq.core.doorbell import RINGER
from shmq.errors import ProtocolError, Status
from shmq.protocol.codec import HEARTBEAT_FRAME

from . import handlers
from .connection import ServerConnection
from .core import Core
from .logs import Throttle
from .spinner import Spinner

log = logging.getLogger("shmq.worker")
_refusals = Throttle()  # a refused connection logs a line a second at most


def _refused(w: Host) -> None:
    if _refusals.ready(w.loop.time()):
        log.warning("worker %d: refused a connection (LIMIT_EXCEEDED): it holds %s", w.worker_id, w.cap)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix-domain socket (SO_PEERCRED: the
    kernel's word, not the peer's), -1 when it cannot be had."""
    try:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return -1
    return int(uid)


class Host(Protocol):
    """What a driver needs of its worker (``worker.Worker``, which makes the drivers)."""

    core: Core
    drivers: dict[ServerConnection, Driver]  # the worker's connections
    max_connections: int
    cap: str  # what a connection refused for want of room is told the worker holds
    worker_id: int
    loop: asyncio.AbstractEventLoop
    spinner: Spinner  # told of every read

    @property
    def stopping(self) -> bool: ...
    def count_changed(self) -> None: ...


class Driver(asyncio.Protocol):
    def __init__(self, worker: Host, preface: bytes = b"") -> None:
        """``preface``: a connection handed over by another worker, and the bytes that worker
        read from it (its HANDSHAKE): handled first, and the connection stays here."""
        self.w = worker
        self.core = worker.core
        self.conn = worker.core.connection(placed=bool(preface))
        self._preface = preface
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._gone = False  # forgotten by the worker: closed, or handed to another worker
        self._reads = 0  # reads so far: the heartbeat timer's sign of life
        self._seen = 0  # ..._reads when the timer last looked
        self._quiet = 0  # heartbeat intervals in a row without a read
        self._unsent = 0  # bytes waiting to be written when the timer last looked

    # ------------------------------------------------------------ asyncio
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.conn.sink = transport.write  # type: ignore[attr-defined]
        w = self.w
        if len(w.drivers) >= w.max_connections or w.stopping:
            self.conn.refuse(Status.LIMIT_EXCEEDED, f"worker {w.worker_id} holds {w.cap}")
            self._refuse()
            if not w.stopping:
                _refused(w)
            return
        w.drivers[self.conn] = self
        w.count_changed()
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            uid = peer_uid(sock)
            self.conn.trusted = uid == os.geteuid()  # our own user: no token needed
            self.conn.peer = f"uid {uid}"
        elif sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = transport.get_extra_info("peername")
            self.conn.peer = str(peer[0]) if peer else ""
        self._timer = w.loop.call_later(options.HANDSHAKE_TIMEOUT, self._no_handshake)
        if self._preface:  # before anything is read from the socket itself
            preface, self._preface = self._preface, b""
            self.data_received(preface)

    def _refuse(self) -> None:
        """A connection refused as it arrives, after its ERROR: our side ends with a FIN, so
        that the error reaches the client (a close with its handshake unread here would
        reset the connection, and the error with it).  What it sends meanwhile is dropped;
        the connection goes when the client closes it, or after HANDSHAKE_TIMEOUT."""
        self._gone = True
        assert self.transport is not None
        if self.transport.can_write_eof():
            self.transport.write_eof()
            # (the handshake timer's slot: connection_lost cancels it)
            self._timer = self.w.loop.call_later(options.HANDSHAKE_TIMEOUT, self.transport.abort)
        else:
            self.transport.close()

    def _no_handshake(self) -> None:
        if not self.conn.ready:
            self.conn.error(0, Status.PROTOCOL_ERROR, "no handshake")
            self.close()

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn.closed:  # refused, or closing: what comes is dropped
            return
        self._reads += 1
        self.w.spinner.read()  # keep polling for the next request a while (server.spinner)
        held = RINGER.hold()  # other workers' doorbells are rung once our answers are written
        try:
            handlers.receive(self.core, conn, data)
        except ProtocolError as e:
            conn.error(0, e.code, str(e))
            self.close()
            return
        finally:
            if held:
                RINGER.release()
        if conn.ready and self._timer is not None and not self._seen:  # the handshake's timer
            self._timer.cancel()
            self._timer = None
            self._seen = self._reads
            if conn.heartbeat:
                self._timer = self.w.loop.call_later(conn.heartbeat, self._beat)
        if conn.closed and not self._gone:  # it asked to go (DISCONNECT), or was refused
            self._forget()
            if self.transport is not None:
                self.transport.close()

    def _beat(self) -> None:
        """Every heartbeat interval: a HEARTBEAT out, and a look for a sign of life in.  A
        peer silent for ``options.HEARTBEAT_MISSES`` intervals in a row is dead or frozen:
        the connection is closed, and its leases go back.  (While reads are paused because
        the peer does not read our replies, its reading them counts as life.)"""
        conn, t = self.conn, self.transport
        if conn.closed or t is None:
            return
        unsent = t.get_write_buffer_size()
        if self._reads != self._seen or (not t.is_reading() and unsent < self._unsent):
            self._quiet = 0
        else:
            self._quiet += 1
        self._seen, self._unsent = self._reads, unsent
        if self._quiet >= options.HEARTBEAT_MISSES:
            log.warning("worker %d: closing the connection from %s: no heartbeat for %.3g s",
                        self.w.worker_id, conn.peer or "an unknown peer", self._quiet * conn.heartbeat)
            silent = self._quiet * conn.heartbeat
            conn.error(0, Status.UNAVAILABLE, f"no heartbeat from the client for {silent:.3g} s")
            self.close()
            return
        conn.send(HEARTBEAT_FRAME)
        self._timer = self.w.loop.call_later(conn.heartbeat, self._beat)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.close()

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.conn.closed:
            self.transport.resume_reading()

    # ------------------------------------------------------------ ending
    def close(self) -> None:
        """Close the connection (its leases go back at once) and the socket."""
        handlers.end(self.core, self.conn)
        if not self._gone:
            self._forget()
            if self.transport is not None:
                self.transport.close()

    def leave(self) -> None:
        """Handed to another worker (``Worker.place``): forgotten here without a word to the
        client, whose socket lives on there.  It holds nothing yet (only its HANDSHAKE came)."""
        self.conn.close()
        self._forget()
        if self.transport is not None:
            self.transport.abort()  # closes our descriptor only: the one in flight keeps the connection

    def _forget(self) -> None:
        """No longer this worker's: its timer stopped, out of the count."""
        self._gone = True
        if self._timer is not None:
            self._timer.cancel()
        self.w.drivers.pop(self.conn, None)
        self.w.count_changed()
