"""The transport's sharp edges, as a new user meets them: a port that is no broker, a
message over the frame limit, a port that is taken, a broker that is not there.

Every client call ends within its bound with a typed error that says what happened."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import shmq
from shmq import options
from shmq.client import aio
from shmq.client.tcp import TcpBroker
from shmq.errors import ConnectionLost, MessageTooLarge, ProtocolError, Status
from shmq.protocol.connection import describe_peer
from shmq.server.supervisor import exclusive_port
from tests.support.server import Server


@contextlib.contextmanager
def fake_peer(answer: bytes | None) -> Iterator[str]:
    """A TCP server that is no broker: it reads what comes and sends ``answer`` (None:
    nothing, ever), and keeps every connection open until the test ends."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(8)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve() -> None:
        lsock.settimeout(0.05)
        while not stop.is_set():
            try:
                c, _ = lsock.accept()
            except TimeoutError:
                continue
            conns.append(c)
            if answer is not None:
                c.recv(65536)
                c.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{lsock.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for c in conns:
            c.close()
        lsock.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- a port that is no broker
def test_a_silent_peer_fails_the_handshake_within_connect_timeout() -> None:
    with fake_peer(None) as url:
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match="did not answer the handshake within 0.3 s") as info:
            TcpBroker(url, connect_timeout=0.3)
        assert info.value.code == Status.UNAVAILABLE
        with pytest.raises(ConnectionLost, match="did not answer the handshake within 0.3 s"):
            asyncio.run(aio.connect(url, connect_timeout=0.3))
        assert time.monotonic() - start < 10  # bounded (the two timeouts, with room for a loaded machine)


@pytest.mark.parametrize(("answer", "described"), [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
     "it answered like an HTTP server ('HTTP/1.1 400 Bad Request')"),
    (b"-ERR unknown command 'DEADBEEF'\r\n",
     "it answered like a Redis server (\"-ERR unknown command 'DEADBEEF'\")"),
    (b"\x15\x03\x03\x00\x02\x02\x46", "it answered like a TLS server"),
    (b"AMQP\x00\x00\x09\x01", "it answered like an AMQP broker (RabbitMQ?)"),
    (b"\x00\x01\x02\x03garbage", "its first bytes, 0x0001020367617262, are no shmq frame (magic 0xdeadbeef)"),
])
def test_a_peer_of_another_protocol_is_named_for_what_it_is(answer: bytes, described: str) -> None:
    with fake_peer(answer) as url:
        with pytest.raises(ProtocolError) as info:
            TcpBroker(url, connect_timeout=5)
        assert str(info.value) == f"{url} is not a shmq broker: {described}"
        assert info.value.code == Status.BAD_MAGIC
        with pytest.raises(ProtocolError) as ainfo:  # the asyncio client alike
            asyncio.run(aio.connect(url, connect_timeout=5))
        assert str(ainfo.value) == f"{url} is not a shmq broker: {described}"


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # (not on the test's stderr)
        pass


@contextlib.contextmanager
def http_server() -> Iterator[str]:
    """``python3 -m http.server``'s server, in a thread: it answers once it has read a request line."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"tcp://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def test_an_http_server_is_named_at_once_not_at_connect_timeout() -> None:
    """An HTTP server reads a whole request line before it answers: the handshake's header
    ends in CRLF, so it answers at once (Python's, to a request line that is no HTTP, with
    an HTML page), and both clients raise ProtocolError long before connect_timeout."""
    with http_server() as url:
        start = time.monotonic()
        with pytest.raises(ProtocolError) as info:
            shmq.connect(url, connect_timeout=30)
        assert time.monotonic() - start < 15  # not the 30 s of connect_timeout
        assert str(info.value) == (f"{url} is not a shmq broker: it answered like an HTTP server "
                                   "(an HTML page: '<!DOCTYPE HTML>')")
        start = time.monotonic()
        with pytest.raises(ProtocolError) as ainfo:
            asyncio.run(aio.connect(url, connect_timeout=30))
        assert time.monotonic() - start < 15
        assert str(ainfo.value) == str(info.value)


def test_describe_peer_reads_the_first_line_only() -> None:
    assert describe_peer(b"HTTP/1.0 200 OK\r\nServer: x\r\n") == (
        "it answered like an HTTP server ('HTTP/1.0 200 OK')")
    assert describe_peer(b"+PONG\r\n") == "it answered like a Redis server ('+PONG')"
    assert describe_peer(b"SSH-2.0-OpenSSH_9.6\r\n").startswith("it answered like an SSH server")
    assert describe_peer(b"+") == "its first bytes, 0x2b, are no shmq frame (magic 0xdeadbeef)"
    assert describe_peer(b"\n<!DOCTYPE html>\n<html>") == (
        "it answered like an HTTP server (an HTML page: '<!DOCTYPE html>')")


def test_no_broker_on_the_port_is_connection_lost_not_internal() -> None:
    url = f"tcp://127.0.0.1:{_free_port()}"
    with pytest.raises(ConnectionLost, match="cannot connect to .*: Connection refused") as info:
        shmq.connect(url, connect_timeout=5)
    assert info.value.code == Status.UNAVAILABLE and info.value.code.name == "UNAVAILABLE"


# ---------------------------------------------------------------- the frame limit
def test_a_message_over_the_frame_limit_is_refused_before_it_is_sent(server: Server) -> None:
    b = shmq.connect(server.url, token=server.token)
    try:
        q = b.create_queue("big")
        with pytest.raises(MessageTooLarge, match="over the frame limit"):
            q.put(b"x" * (20 << 20))
        with pytest.raises(MessageTooLarge):  # a batch whose frame is over the limit, each message not
            q.put_many([b"y" * (options.MAX_FRAME // 2), b"z" * (options.MAX_FRAME // 2)])
        assert q.put(b"small") == 0  # the connection is still usable
        assert q.get(timeout=5).payload == b"small"
        assert q.stats()["retained"] == 1  # nothing of the refused puts got in
    finally:
        b.delete_queue("big")
        b.close()


def test_the_asyncio_client_refuses_it_too(server: Server) -> None:
    async def main() -> None:
        b = await aio.connect(server.url, token=server.token)
        try:
            q = await b.create_queue("big-aio")
            with pytest.raises(MessageTooLarge):
                await q.put(b"x" * (20 << 20))
            assert await q.put(b"small") == 0
            await b.delete_queue("big-aio")
        finally:
            await b.close()

    asyncio.run(main())


# ---------------------------------------------------------------- a taken port
def test_a_taken_port_is_named() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is in use by another process"):
            exclusive_port("127.0.0.1", port)
