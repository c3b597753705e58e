"""Fixtures of the integration tests (kombu, Celery): a broker of their own per module, so
that the fixed queue names of kombu's base tests, and the queues Celery leaves, meet no
other test's; and ports nothing listens on."""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.client.test_tls import TOKEN, _key_and_csr, _openssl, _sign, _tls_args
from tests.support.server import Server


@pytest.fixture(scope="module")
def own_server() -> Iterator[Server]:
    """``shmq serve`` with 2 workers for this module alone (its token left for this user,
    so clients find it without being told)."""
    s = Server(workers=2)
    yield s
    assert s.stop() == 0


def dead_port() -> int:
    """A loopback port nothing listens on (bound once by the kernel's choice, then let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TlsBroker:
    server: Server
    ca: Path  # the CA file a client checks the broker's certificate with
    token: str


@pytest.fixture(scope="module")
def tls_broker() -> Iterator[TlsBroker]:
    """``shmq serve`` with TLS (certificates made as ``tests/client/test_tls.py`` makes them)
    and a token of its own."""
    d = Path(tempfile.mkdtemp(prefix="shmq-tls-"))
    try:
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca", cwd=d)
        (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _key_and_csr("server", d)
        _sign("server", d, "san.ext")
        srv = Server(workers=1, token=TOKEN, extra=_tls_args(d))
        try:
            yield TlsBroker(srv, d / "ca.pem", TOKEN)
        finally:
            assert srv.stop() == 0
    finally:
        shutil.rmtree(d, ignore_errors=True)
