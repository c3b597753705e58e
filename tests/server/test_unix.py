"""``shmq serve --unix PATH``: a Unix-domain socket beside the TCP port.

The socket file is mode 0600. A peer whose uid is the broker's (the kernel says so:
SO_PEERCRED) needs no token; any other peer, let in by a wider mode, must present it."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import shmq
from shmq.errors import AuthError, ConnectionLost
from tests.support.connect import aio_round_trip, try_connect
from tests.support.nobody import as_nobody, as_root
from tests.support.server import Server

TOKEN = "s3cret"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="shmq-unix-"))
    try:
        yield d
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


@pytest.fixture
def unix_server(sock_dir: Path) -> Iterator[tuple[Server, str]]:
    path = sock_dir / "broker.sock"
    srv = Server(workers=2, token=TOKEN, extra=["--unix", str(path)])
    try:
        yield srv, f"unix://{path}"
    finally:
        assert srv.stop() == 0
        assert not path.exists()  # removed on stop: nothing left behind


def test_our_own_uid_needs_no_token_on_the_unix_socket(unix_server: tuple[Server, str]) -> None:
    srv, url = unix_server
    path = url[len("unix://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    b = shmq.connect(url, token="")
    try:
        q = b.create_queue("over-unix")
        assert [q.put(b"m%d" % i) for i in range(3)] == [0, 1, 2]
        assert [m.payload for m in q.get_many(10, timeout=5)] == [b"m0", b"m1", b"m2"]
    finally:
        b.close()
    with pytest.raises(AuthError):  # the same broker over TCP still wants the token
        shmq.connect(srv.url, token="")
    with pytest.raises(AuthError):  # and a wrong token is refused even from our own uid
        shmq.connect(url, token="wrong")
    tcp = shmq.connect(srv.url, token=TOKEN)
    try:  # one broker, one set of queues, whatever the transport
        q = tcp.queue("over-unix")
        msgs = q.get_many(10, timeout=5)  # the unix client closed: its leases came back
        assert [(m.payload, m.deliveries) for m in msgs] == [(b"m0", 2), (b"m1", 2), (b"m2", 2)]
        q.ack_many(msgs)
        tcp.delete_queue("over-unix")
    finally:
        tcp.close()


def test_the_asyncio_client_speaks_unix_too(unix_server: tuple[Server, str]) -> None:
    _, url = unix_server

    asyncio.run(aio_round_trip(url, "", "aio-unix"))


@as_root
def test_another_uid_needs_the_token_where_the_socket_lets_it_in(unix_server: tuple[Server, str]) -> None:
    _, url = unix_server
    path = Path(url[len("unix://"):])
    path.parent.chmod(0o755)  # let the other uid reach the socket at all
    path.chmod(0o666)
    for token, expected in (("", "refused"), ("wrong", "refused"), (TOKEN, "admitted")):
        got = as_nobody(try_connect, url, token)
        assert got == expected, (token, got)


def test_a_stale_socket_file_is_replaced_and_a_live_one_refused(sock_dir: Path) -> None:
    path = sock_dir / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # bound, never listening, then closed: the file stays, nobody answers
    dead.close()
    srv = Server(workers=1, extra=["--unix", str(path)])
    try:
        b = shmq.connect(f"unix://{path}")
        assert b.list_queues() == []
        b.close()
        with pytest.raises(RuntimeError, match="another broker listens there"):
            Server(workers=1, extra=["--unix", str(path)])
    finally:
        assert srv.stop() == 0
    assert not path.exists()


def test_no_socket_there_is_connection_lost(sock_dir: Path) -> None:
    with pytest.raises(ConnectionLost, match="cannot connect to unix://"):
        shmq.connect(f"unix://{sock_dir / 'none.sock'}")


def test_by_default_the_broker_listens_in_the_runtime_folder_and_the_cli_goes_there() -> None:
    """``--unix auto`` (the default): tcp-PORT.sock, 0600, in this user's 0700 runtime
    folder; the CLI given the loopback TCP URL takes it, and it is gone after the stop."""
    from shmq import runtime
    from shmq.cli import session as cli_session

    srv = Server(workers=1, token=TOKEN)
    path = runtime.runtime_dir() / f"tcp-{srv.port}.sock"
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
        b = cli_session.broker(srv.url, None, None)  # no token given: the socket needs none from us
        try:
            assert b.url == f"unix://{path}"  # type: ignore[attr-defined]
            b.create_queue("cli-unix").put(b"by the socket")
        finally:
            b.close()
        tcp = shmq.connect(srv.url, token=TOKEN)
        try:
            assert tcp.queue("cli-unix").get(timeout=5).payload == b"by the socket"
        finally:
            tcp.close()
    finally:
        assert srv.stop() == 0
    assert not path.exists()


def test_the_cli_falls_back_to_tcp_past_a_stale_socket_and_a_start_sweeps_it() -> None:
    from shmq import runtime
    from shmq.cli import session as cli_session

    srv = Server(workers=1, extra=["--unix", "off"])
    stale = runtime.socket_path(srv.port)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))  # what a killed broker leaves: a socket file nobody listens on
    dead.close()
    try:
        b = cli_session.broker(srv.url, None, None)
        try:
            assert b.url == srv.url and b.list_queues() == []  # type: ignore[attr-defined]
        finally:
            b.close()
        other = Server(workers=1)  # any broker's start sweeps the runtime folder
        assert other.stop() == 0
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)
        assert srv.stop() == 0
