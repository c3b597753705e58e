"""The metrics endpoint: Prometheus's ``/metrics`` for the whole broker, from a process of its own.

``shmq serve --metrics HOST:PORT`` (``:PORT`` means loopback).  The supervisor has
no threads (it forks), so it only binds the listening socket (a bad address or a
port in use is an error at start, before any worker runs) and forks the *metrics
process*, which serves it: restarted if it dies, stopped with the broker.  Each
scrape is answered by ``server.collector`` reading shared memory then; nothing is
kept between scrapes, and one scrape is served at a time (a client that sends no
request within ``options.METRICS_REQUEST_TIMEOUT`` is dropped).

Authentication follows the broker's rules.  On loopback the endpoint is open.  Off
loopback it needs the broker's token as ``Authorization: Bearer <token>``
(Prometheus: ``authorization: {credentials_file: ...}``), compared in constant
time, and it speaks HTTPS with the broker's ``--tls-cert/--tls-key`` (and
``--tls-client-ca``) when those are given; a broker with ``--no-auth`` refuses an
endpoint off loopback at start.  Every answer but a scrape of ``/metrics`` with
the right credentials is 401 or 404, with no figures in it.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import logging
import signal
import socket
import ssl
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from shmq import options, runtime
from shmq.core.serverqueue import ServerBroker
from shmq.errors import InvalidArgument

from .collector import BrokerCollector
from .placement import Counts
from .scoreboard import Scoreboard

log = logging.getLogger("shmq.metrics")
PROCESS_NAME = b"shmq-metrics"  # the metrics process's name (comm: /proc/PID/comm, ps, psutil)


def parse_address(value: str, flag: str = "--metrics") -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (loopback) as (host, port); InvalidArgument
    naming ``flag``."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"{flag} {value!r}: give HOST:PORT (e.g. 127.0.0.1:9464, or :9464 for "
                              "loopback; port 0 picks a free one)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in host and not value.strip().startswith("["):
        raise InvalidArgument(f"{flag} {value!r}: write an IPv6 address in brackets ([::1]:9464)")
    return host or options.DEFAULT_HOST, int(port)


def is_loopback(host: str) -> bool:
    return host in runtime.LOOPBACK


def listen(host: str, port: int, flag: str = "--metrics") -> socket.socket:
    """The endpoint's listening socket, bound now; OSError naming ``flag`` and the address
    otherwise."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise OSError(errno.EINVAL, f"{flag}: cannot resolve {host!r}: {e.strerror}") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
    try:
        sock.bind(addr)
        sock.listen(64)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(e.errno, f"{flag}: port {port} on {host} is in use by another process "
                                   "(port 0 picks a free one)") from None
        raise OSError(e.errno, f"{flag}: cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


class MetricsServer(HTTPServer):
    """An HTTP(S) server on a socket bound already, answering one request at a time."""

    def __init__(self, sock: socket.socket, registry: CollectorRegistry, token: str,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(sock.getsockname()[:2], _Handler, bind_and_activate=False)
        self.socket.close()
        self.socket = sock
        self.registry = registry
        self.expected = f"Bearer {token}".encode() if token else b""
        self.tls = tls
        self.timeout = 0.25  # handle_request() returns this often, to see a stop

    def get_request(self) -> tuple[Any, Any]:
        conn, addr = self.socket.accept()
        conn.settimeout(options.METRICS_REQUEST_TIMEOUT)
        if self.tls is not None:  # the TLS handshake here, bounded by the same timeout
            try:
                conn = self.tls.wrap_socket(conn, server_side=True)
            except OSError:
                conn.close()
                raise
        return conn, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("a scrape from %s ended early", client_address, exc_info=True)  # not on stderr

    def allowed(self, authorization: str | None) -> bool:
        if not self.expected:
            return True
        return hmac.compare_digest((authorization or "").strip().encode(), self.expected)


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = options.METRICS_REQUEST_TIMEOUT
    server_version = "shmq-metrics"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self.server.allowed(self.headers.get("Authorization")):
            self._answer(401, b"bearer token required\n", {"WWW-Authenticate": 'Bearer realm="shmq"'})
            return
        if self.path.split("?", 1)[0] != options.METRICS_PATH:
            self._answer(404, f"not found: try {options.METRICS_PATH}\n".encode())
            return
        try:
            body = generate_latest(self.server.registry)
        except Exception as e:  # noqa: BLE001 - one failed scrape must not end the endpoint
            log.exception("a scrape failed")
            self._answer(500, f"scrape failed: {type(e).__name__}\n".encode())
            return
        self._answer(200, body, {"Content-Type": CONTENT_TYPE_LATEST})

    def _answer(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        log.debug("%s: " + format, self.address_string(), *args)


def metrics_main(instance: str, sock: socket.socket, token: str, tls: ssl.SSLContext | None,
                 board: Scoreboard | None, counts: Counts | None, ready: Any,
                 replication: Callable[[], dict[str, Any]] | None = None) -> None:
    """The metrics process (forked by the supervisor): serve scrapes until SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when we stop
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor
        libc.prctl(15, PROCESS_NAME)  # PR_SET_NAME: how ps (and tests) tell it from a worker
    except (OSError, AttributeError):
        pass
    broker = ServerBroker(instance)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(broker, board, counts, replication))
    server = MetricsServer(sock, registry, token, tls)
    if ready is not None:
        ready.set()
    try:
        while not stop:
            server.handle_request()  # (returns at least every 0.25 s)
            broker.prune()  # a queue deleted since: its memory goes from here too
    finally:
        broker.close()


__all__ = ["MetricsServer", "is_loopback", "listen", "metrics_main", "parse_address"]
