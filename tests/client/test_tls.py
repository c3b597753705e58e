"""TLS (``shmq serve --tls-cert/--tls-key [--tls-client-ca]``, ``tcps://`` URLs) and URL
query parameters (``?token=``, ``?ca=``, ``&cert=&key=``, ``?insecure=1``).

The certificates are made here, by the ``openssl`` command, in a throw-away folder:
a CA, a server certificate it signs (SAN 127.0.0.1 and localhost), a client
certificate it signs, and an unrelated second CA."""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq.client import aio
from shmq.errors import AuthError, ConnectionLost, InvalidArgument
from shmq.urls import client_settings, parse_url
from tests.support.connect import aio_round_trip, connect_tcp
from tests.support.server import Server

TOKEN = "tls-s3cret"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _key_and_csr(name: str, cwd: Path) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)


def _sign(name: str, cwd: Path, ext: str = "") -> None:
    extra = ["-extfile", ext] if ext else []
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", *extra, cwd=cwd)


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="shmq-tls-"))
    try:
        for ca in ("ca", "other"):
            _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                     "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2", "-subj", f"/CN={ca}", cwd=d)
        (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        _key_and_csr("server", d)
        _sign("server", d, "san.ext")
        _key_and_csr("client", d)
        _sign("client", d)
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _tls_args(certs: Path, client_ca: bool = False) -> list[str]:
    args = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key")]
    return args + (["--tls-client-ca", str(certs / "ca.pem")] if client_ca else [])


@pytest.fixture(scope="module")
def tls_server(certs: Path) -> Iterator[tuple[Server, str]]:
    srv = Server(workers=2, token=TOKEN, extra=_tls_args(certs))
    try:
        yield srv, f"tcps://127.0.0.1:{srv.port}?ca={certs / 'ca.pem'}"
    finally:
        assert srv.stop() == 0


@pytest.fixture(scope="module")
def mtls_server(certs: Path) -> Iterator[tuple[Server, str]]:
    srv = Server(workers=1, token=TOKEN, extra=_tls_args(certs, client_ca=True))
    try:
        yield srv, f"tcps://localhost:{srv.port}?ca={certs / 'ca.pem'}"
    finally:
        assert srv.stop() == 0


def test_tls_connections_are_balanced_across_workers_before_their_tls(certs: Path) -> None:
    """A TLS session cannot move between processes, so a new connection is handed to the
    worker with the fewest connections as it arrives, before its TLS handshake."""
    srv = Server(workers=2, token=TOKEN, extra=_tls_args(certs))
    url = f"tcps://127.0.0.1:{srv.port}?ca={certs / 'ca.pem'}"
    brokers: list[Any] = []
    try:
        brokers = [connect_tcp(url, token=TOKEN) for _ in range(6)]
        assert sorted(b.worker for b in brokers) == [0, 0, 0, 1, 1, 1]
        q = brokers[0].create_queue("spread-tls")
        for i, b in enumerate(brokers):  # served wherever they landed: one set of queues
            b.queue("spread-tls").put(b"m%d" % i)
        got = q.get_many(10, timeout=5)
        assert sorted(m.payload for m in got) == [b"m%d" % i for i in range(6)]
        q.ack_many(got)
    finally:
        for b in brokers:
            b.close()
        assert srv.stop() == 0


def _round_trip(b: shmq.Broker, name: str) -> None:
    q = b.create_queue(name)
    try:
        assert q.put_many([b"a", b"b"]) == [0, 1]
        msgs = q.get_many(10, timeout=5)
        assert [m.payload for m in msgs] == [b"a", b"b"]
        q.ack_many(msgs)
        assert q.stats()["retained"] == 0
    finally:
        b.delete_queue(name)


# ---------------------------------------------------------------- round trips
def test_a_round_trip_over_tls(tls_server: tuple[Server, str]) -> None:
    srv, url = tls_server
    b = connect_tcp(url, token=TOKEN)
    assert b._spin.window == 0  # a TLS stream does not poll (its records are read whole)
    try:
        _round_trip(b, "tls-sync")
        q = b.create_queue("tls-one")
        q.put(b"x" * 100_000)  # over several TLS records
        m = q.get(timeout=5)
        assert m.payload == b"x" * 100_000
        m.ack()
        b.delete_queue("tls-one")
    finally:
        b.close()
    assert "tcps://127.0.0.1" in repr(b) and TOKEN not in repr(b)


def test_threads_share_one_tls_handle_while_it_beats(tls_server: tuple[Server, str]) -> None:
    """One thread blocked reading while others send (requests, heartbeats every 0.1 s):
    OpenSSL forbids two threads in one connection, so the blocking client's TLS runs on
    memory BIOs (``shmq.tls.TlsStream``).  Every message arrives once, intact."""
    _, url = tls_server
    b = shmq.connect(url, token=TOKEN, heartbeat=0.1)
    q = b.create_queue("tls-threads")
    got: list[bytes] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            while len(got) < 400:
                for m in q.get_many(50, timeout=10):
                    got.append(m.payload)
                    m.ack()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def produce(k: int) -> None:
        try:
            for i in range(100):
                q.put(b"%d-%d-" % (k, i) + bytes(1000))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=consume)] + [threading.Thread(target=produce, args=(k,))
                                                         for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert sorted(got) == sorted(b"%d-%d-" % (k, i) + bytes(1000) for k in range(4) for i in range(100))
        b.delete_queue("tls-threads")
    finally:
        b.close()


def test_the_asyncio_client_speaks_tls(tls_server: tuple[Server, str]) -> None:
    _, url = tls_server

    asyncio.run(aio_round_trip(url, TOKEN, "tls-aio"))


def test_the_token_can_be_in_the_url(tls_server: tuple[Server, str]) -> None:
    _, url = tls_server
    b = shmq.connect(f"{url}&token={TOKEN}")
    try:
        _round_trip(b, "tls-url-token")
    finally:
        b.close()
    with pytest.raises(AuthError):
        shmq.connect(f"{url}&token=wrong")
    with pytest.raises(AuthError):  # the argument wins over the URL
        shmq.connect(f"{url}&token={TOKEN}", token="wrong")

    async def main() -> None:
        b = await aio.connect(f"{url}&token={TOKEN}")
        await b.close()
        with pytest.raises(AuthError):
            await aio.connect(f"{url}&token=wrong")

    asyncio.run(main())


def test_a_tls_handle_pickles_as_its_url(tls_server: tuple[Server, str]) -> None:
    _, url = tls_server
    b = connect_tcp(f"{url}&token={TOKEN}")
    try:
        q = b.create_queue("tls-pickle")
        q2 = pickle.loads(pickle.dumps(q))  # reconnects: the same CA, the same token
        try:
            q2.put(b"via the copy")
            m = q.get(timeout=5)
            assert m.payload == b"via the copy"
            m.ack()
        finally:
            q2.broker.close()
        b2 = pickle.loads(pickle.dumps(b))
        assert b2.url == b.url and b2.url.startswith("tcps://") and "token" not in b2.url
        b2.close()
        b.delete_queue("tls-pickle")
    finally:
        b.close()


# ---------------------------------------------------------------- refusals
def test_a_certificate_of_another_ca_is_refused(tls_server: tuple[Server, str], certs: Path) -> None:
    srv, _ = tls_server
    url = f"tcps://127.0.0.1:{srv.port}?ca={certs / 'other.pem'}"
    with pytest.raises(ConnectionLost, match="broker's certificate was refused"):
        shmq.connect(url, token=TOKEN)
    with pytest.raises(ConnectionLost, match="system's trust store"):  # no ca=: the system's store
        shmq.connect(f"tcps://127.0.0.1:{srv.port}", token=TOKEN)

    async def main() -> None:
        with pytest.raises(ConnectionLost, match="broker's certificate was refused"):
            await aio.connect(url, token=TOKEN)

    asyncio.run(main())


def test_an_unreadable_ca_file_is_named(tls_server: tuple[Server, str], certs: Path) -> None:
    srv, _ = tls_server
    with pytest.raises(InvalidArgument, match="nope.pem: no such file"):
        shmq.connect(f"tcps://127.0.0.1:{srv.port}?ca={certs / 'nope.pem'}", token=TOKEN)


def test_a_plaintext_client_is_told_the_port_speaks_tls(tls_server: tuple[Server, str]) -> None:
    srv, _ = tls_server
    t0 = time.monotonic()
    with pytest.raises(ConnectionLost, match="this port speaks TLS.*tcps://"):
        shmq.connect(f"tcp://127.0.0.1:{srv.port}", token=TOKEN, connect_timeout=3)
    assert time.monotonic() - t0 < 3

    async def main() -> None:
        with pytest.raises(ConnectionLost, match="this port speaks TLS"):
            await aio.connect(f"tcp://127.0.0.1:{srv.port}", token=TOKEN, connect_timeout=3)

    asyncio.run(main())


def test_a_tls_client_of_a_plaintext_port_is_told(server: Server, certs: Path) -> None:
    url = f"tcps://127.0.0.1:{server.port}?ca={certs / 'ca.pem'}"
    with pytest.raises(ConnectionLost, match="does not speak TLS"):
        shmq.connect(url, token=server.token, connect_timeout=3)

    async def main() -> None:
        with pytest.raises(ConnectionLost, match="does not speak TLS"):
            await aio.connect(url, token=server.token, connect_timeout=3)

    asyncio.run(main())


def test_mutual_tls(mtls_server: tuple[Server, str], certs: Path) -> None:
    _, url = mtls_server
    mine = f"{url}&cert={certs / 'client.pem'}&key={certs / 'client.key'}"
    b = shmq.connect(mine, token=TOKEN)
    try:
        _round_trip(b, "mtls")
    finally:
        b.close()
    with pytest.raises(ConnectionLost, match="requires a client certificate.*none was given"):
        shmq.connect(url, token=TOKEN)
    foreign = f"{url}&cert={certs / 'other.pem'}&key={certs / 'other.key'}"
    with pytest.raises(ConnectionLost, match="requires a client certificate.*did not sign"):
        shmq.connect(foreign, token=TOKEN)

    async def main() -> None:
        b = await aio.connect(mine, token=TOKEN)
        await b.close()
        with pytest.raises(ConnectionLost, match="requires a client certificate"):
            await aio.connect(url, token=TOKEN)

    asyncio.run(main())


def test_bad_server_files_are_named_at_start(certs: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()",
                          "serve", "--port", "0",
                          "--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "ca.key")],
                         capture_output=True, timeout=60, env={**os.environ, "SHMQ_TOKEN": TOKEN})
    assert out.returncode == 1
    assert b"server.pem" in out.stderr and b"ca.key" in out.stderr and b"cannot be used" in out.stderr
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                          "--tls-cert", str(certs / "missing.pem"), "--tls-key", str(certs / "server.key")],
                         capture_output=True, timeout=60, env={**os.environ, "SHMQ_TOKEN": TOKEN})
    assert out.returncode == 1 and b"missing.pem" in out.stderr


@pytest.mark.slow
def test_the_cli_over_tls(tls_server: tuple[Server, str]) -> None:
    _, url = tls_server

    def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", *args,
                               "--url", url],
                              input=stdin, capture_output=True, timeout=120,
                              env={**os.environ, "SHMQ_TOKEN": TOKEN})

    assert cli("create", "tls-cli").returncode == 0
    out = cli("produce", "tls-cli", "--json", stdin=b"one\ntwo\n")
    assert out.returncode == 0 and b'"produced": 2' in out.stdout, out.stderr
    out = cli("consume", "tls-cli", "-n", "2", "--json")
    assert b'"payload": "one"' in out.stdout and b'"payload": "two"' in out.stdout, out.stderr
    assert cli("delete", "tls-cli").returncode == 0


# ---------------------------------------------------------------- URLs (no network)
def test_url_parameters_are_parsed_and_checked() -> None:
    u = parse_url("tcps://broker.example:7878?ca=/etc/ca.pem&cert=/c.pem&key=/c.key&token=t")
    assert (u.scheme, u.host, u.port, u.tls) == ("tcps", "broker.example", 7878, True)
    assert u.params == {"ca": "/etc/ca.pem", "cert": "/c.pem", "key": "/c.key", "token": "t"}
    assert u.without_token() == "tcps://broker.example:7878?ca=/etc/ca.pem&cert=/c.pem&key=/c.key"
    assert parse_url("unix:///run/s.sock?token=x").path == "/run/s.sock"
    assert parse_url("tcp://[::1]:5?token=x").without_token() == "tcp://[::1]:5"
    for bad, why in [("tcp://h:1?ca=/x", "not one of"), ("tcps://h:1?nope=1", "not one of"),
                     ("unix:///s?insecure=1", "not one of"), ("tcps://h:1?token=a&token=b", "twice"),
                     ("tcps://h:1?key=/k", "needs cert"), ("tcp://h:1?insecure=yes", "must be 1"),
                     ("http://h:1", "unsupported"), ("tcps://h", "expected tcps://HOST:PORT"),
                     ("tcp://h:99999", "port 99999 is not in 1..65535"), ("tcps://h:0", "port 0 is not")]:
        with pytest.raises(InvalidArgument, match=why):
            parse_url(bad)


def test_the_token_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMQ_TOKEN", "from-env")
    assert client_settings("tcp://127.0.0.1:1?token=from-url", "from-arg")[1] == "from-arg"
    assert client_settings("tcp://127.0.0.1:1?token=from-url", None)[1] == "from-url"
    assert client_settings("tcp://127.0.0.1:1", None)[1] == "from-env"
    assert client_settings("unix:///s?token=u", None)[1] == "u"


def test_a_token_is_never_sent_in_clear_off_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHMQ_TOKEN", raising=False)
    for url, token in [("tcp://10.255.255.1:7878", "t"), ("tcp://10.255.255.1:7878?token=t", None),
                       ("tcp://broker.example:7878", "t")]:
        with pytest.raises(InvalidArgument, match="clear text.*tcps://"):
            shmq.connect(url, token=token, connect_timeout=0.5)  # refused before connecting
        with pytest.raises(InvalidArgument, match="clear text"):
            asyncio.run(aio.connect(url, token=token, connect_timeout=0.5))
    monkeypatch.setenv("SHMQ_TOKEN", "from-env")
    with pytest.raises(InvalidArgument, match="clear text"):
        client_settings("tcp://10.255.255.1:7878", None)
    # allowed: loopback, TLS, no token, or said to be fine
    assert client_settings("tcp://127.0.0.2:7878", "t")[1] == "t"
    assert client_settings("tcps://10.255.255.1:7878", "t")[1] == "t"
    assert client_settings("tcp://10.255.255.1:7878?insecure=1", "t")[1] == "t"
    assert client_settings("tcp://10.255.255.1:7878", "")[1] == ""


def test_spark_options_take_tcps_and_unix_urls() -> None:
    from shmq.spark.options import read_options

    for url in ("tcps://h:1?ca=/x", "unix:///run/s.sock"):
        assert read_options({"url": url, "queue": "q"}, streaming=True).url == url
    with pytest.raises(InvalidArgument, match="option url"):
        read_options({"url": "http://h:1", "queue": "q"}, streaming=True)


def test_a_standby_follows_a_primary_over_tls(tls_server: tuple[Server, str]) -> None:
    """``--replica-of tcps://...?ca=``: the standby asks the TLS client port where the primary
    streams, and the stream speaks TLS too (the same certificate); the token is the primary's."""
    from tests.support.replication import Standby, replication, wait_caught_up

    srv, url = tls_server
    with shmq.connect(url, token=TOKEN) as b:
        q = b.create_queue(f"repl{os.getpid()}", durability="always")
        offsets = [q.put(f"m{i}".encode(), headers={"h": str(i)}) for i in range(5)]
        standby = Standby(url, token=TOKEN)
        try:
            with shmq.connect(standby.url, token=TOKEN) as s:
                wait_caught_up(b, s, q.name)
                info = replication(s)
                assert (info["primary"], info["error"]) == (url, "")
                got = s.queue(q.name).read(0, 10)
                assert [(m.offset, m.payload) for m in got] == [
                    (o, f"m{i}".encode()) for i, o in enumerate(offsets)]
        finally:
            standby.stop()
        b.delete_queue(q.name)
