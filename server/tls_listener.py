"""A worker's TLS listener (``shmq serve --tls-cert``): TLS on the TCP port, and a clear
answer to a client that speaks plain shmq to it.

asyncio's own TLS server drops a connection whose first bytes are no TLS without a
word, which a plaintext client could only report as "closed by the broker".  So each
accepted connection is first peeked at (``MSG_PEEK``: its bytes stay for the TLS layer):
a shmq frame's magic is answered, in plain shmq, by an ERROR naming ``tcps://``; anything
else goes to TLS, with ``TLS_HANDSHAKE_TIMEOUT`` for the peek and the TLS handshake each
(a silent peer cannot hold a slot).

A TLS session lives in the process that made it, so a connection is balanced across the
workers as it arrives, before its TLS handshake (``place``: by count; its affinity is
inside the TLS, so it is not honoured), and never handed on afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable

from shmq import options
from shmq.errors import Status
from shmq.protocol.codec import MAGIC, T, encode_body, encode_frame

log = logging.getLogger("shmq.worker")

_MAGIC = MAGIC.to_bytes(4, "big")
PLAINTEXT_REFUSAL = "this port speaks TLS (shmq serve --tls-cert): connect with tcps://HOST:PORT"


class TlsListener:
    """Accepts on ``sock`` (bound, not listening) and serves each connection over TLS with
    a protocol from ``factory``; :meth:`close` stops accepting."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 factory: Callable[[], asyncio.Protocol], ctx: ssl.SSLContext, backlog: int = 4096,
                 place: Callable[[socket.socket], bool] | None = None) -> None:
        self.loop = loop
        self.sock = sock
        self.factory = factory
        self.ctx = ctx
        self.place = place  # hands a connection, before TLS, to the worker that should serve it
        sock.listen(backlog)
        sock.setblocking(False)
        self._pending: set[asyncio.Task[None]] = set()
        self._task = loop.create_task(self._accept(), name="shmq tls accept")

    async def _accept(self) -> None:
        while True:
            try:
                conn, _ = await self.loop.sock_accept(self.sock)
            except OSError as e:  # out of file descriptors, ...: the peer waits in the backlog
                log.warning("accept failed: %s", e)
                await asyncio.sleep(options.WORKER_TICK)
                continue
            self.adopt(conn, placed=False)

    def adopt(self, conn: socket.socket, placed: bool = True) -> None:
        """Serve ``conn`` over TLS: one accepted here, or (``placed``) handed to this worker
        by another before its TLS handshake."""
        task = self.loop.create_task(self._start(conn, placed))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _start(self, conn: socket.socket, placed: bool) -> None:
        conn.setblocking(False)
        try:
            first = await asyncio.wait_for(self._peek(conn), options.TLS_HANDSHAKE_TIMEOUT)
            if not first:  # gone already
                conn.close()
                return
            if _MAGIC.startswith(first):  # a plaintext shmq client: told so in its protocol
                conn.recv(65536)  # (read, so that closing sends FIN, not RST, and it reads the answer)
                body = encode_body(T.ERROR, message=PLAINTEXT_REFUSAL)
                conn.send(encode_frame(T.ERROR, 0, body, int(Status.PROTOCOL_ERROR)))
                conn.shutdown(socket.SHUT_WR)
                conn.close()
                return
            if not placed and self.place is not None and self.place(conn):
                conn.close()  # (ours: the other worker holds a duplicate)
                return
            await self.loop.connect_accepted_socket(self.factory, conn, ssl=self.ctx,
                                                    ssl_handshake_timeout=options.TLS_HANDSHAKE_TIMEOUT)
        except (OSError, TimeoutError, ValueError, ConnectionError) as e:
            log.debug("TLS connection not established: %s", e)
            conn.close()
        except asyncio.CancelledError:
            conn.close()
            raise

    async def _peek(self, conn: socket.socket) -> bytes:
        """The first bytes the peer sent (b"": it closed), left unread."""
        fd = conn.fileno()
        ready: asyncio.Future[None] = self.loop.create_future()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        self.loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            self.loop.remove_reader(fd)
        return conn.recv(4, socket.MSG_PEEK)

    def close(self) -> None:
        self._task.cancel()
        for task in list(self._pending):
            task.cancel()
        with contextlib.suppress(OSError):
            self.sock.close()


__all__ = ["PLAINTEXT_REFUSAL", "TlsListener"]
