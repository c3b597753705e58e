"""Authentication is on by default, with nothing to set up for the broker's own user.

``shmq serve`` without a token makes one at start and leaves it, mode 0600 in a 0700
folder, for its user's clients (``shmq.runtime``); those connect with no token given.
Anyone else needs the token. ``--no-auth`` opts out, on loopback only."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys

import pytest

import shmq
from shmq import runtime
from shmq.client import aio
from shmq.protocol.codec import FrameDecoder, T, encode_body, encode_frame
from tests.support.nobody import as_nobody, as_root
from tests.support.server import Server


def _raw_handshake(port: int, token: str) -> int:
    """The type of the broker's answer to a HANDSHAKE with ``token``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        body = encode_body(T.HANDSHAKE, token=token, client="raw", affinity="", heartbeat_ms=0)
        s.sendall(encode_frame(T.HANDSHAKE, 1, body))
        dec = FrameDecoder()
        while True:
            data = s.recv(65536)
            assert data, "closed without an answer"
            frames = dec.feed(data)
            if frames:
                return int(frames[0].type)


def test_a_broker_without_a_token_makes_one_for_its_own_user() -> None:
    srv = Server(workers=1)  # no token given
    path = runtime.token_path(srv.port)
    try:
        st, folder = os.stat(path), os.stat(path.parent)
        assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        assert folder.st_uid == os.geteuid() and stat.S_IMODE(folder.st_mode) == 0o700
        token, pid = path.read_text().split("\n")[:2]  # the token, then whose it is
        assert len(token) >= 32 and srv.token == token and int(pid) == srv.proc.pid
        assert _raw_handshake(srv.port, "") == T.HANDSHAKE_NACK  # anyone without it is refused
        assert _raw_handshake(srv.port, token) == T.HANDSHAKE_ACK
        b = shmq.connect(srv.url)  # this user's client: no token given, none needed
        q = b.create_queue("authed")
        q.put(b"x")
        assert q.get(timeout=5).payload == b"x"
        b.delete_queue("authed")
        b.close()

        async def main() -> None:
            ab = await aio.connect(srv.url)
            assert await ab.list_queues() == []
            await ab.close()

        asyncio.run(main())
    finally:
        assert srv.stop() == 0
    assert not path.exists()  # removed with its broker


def test_each_start_makes_a_new_token() -> None:
    a = Server(workers=1)
    b = Server(workers=1)
    try:
        assert a.token and b.token and a.token != b.token
    finally:
        assert a.stop() == 0 and b.stop() == 0


def test_no_auth_opts_out_on_loopback_only() -> None:
    srv = Server(workers=1, extra=["--no-auth"])
    try:
        assert not runtime.token_path(srv.port).exists()
        assert _raw_handshake(srv.port, "") == T.HANDSHAKE_ACK
    finally:
        assert srv.stop() == 0
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve",
                          "--host", "0.0.0.0", "--port", "0", "--no-auth", "--instance", "noauth-off"],
                         capture_output=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                               if k != "SHMQ_TOKEN"})
    assert out.returncode == 1 and b"--no-auth is for loopback only" in out.stderr


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f"read: {f.read()!r}"
    except OSError as e:
        return type(e).__name__


@as_root
def test_another_user_cannot_read_the_token() -> None:
    srv = Server(workers=1)
    try:
        assert as_nobody(_read, str(runtime.token_path(srv.port))) == "PermissionError"
    finally:
        assert srv.stop() == 0


def test_a_runtime_folder_that_is_not_ours_is_never_read(tmp_path: os.PathLike[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    folder = runtime.runtime_dir()
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # open to others: someone could have planted a token
    (folder / "tcp-7878.token").write_text("planted\n")
    assert runtime.token_for("127.0.0.1", 7878) is None
    with pytest.raises(shmq.InstanceError, match="is not ours"):
        runtime.write_token(7878, "mine")
    folder.chmod(0o700)
    assert runtime.token_for("127.0.0.1", 7878) is None  # the file itself is 0644: still not trusted
    runtime.write_token(7878, "mine")
    assert runtime.token_for("127.0.0.1", 7878) == "mine"
    assert runtime.token_for("10.0.0.1", 7878) is None  # only for loopback brokers
    runtime.remove_token(7878, "someone else's")
    assert runtime.token_for("127.0.0.1", 7878) == "mine"  # a newer broker's file is left
    runtime.remove_token(7878, "mine")
    assert not (folder / "tcp-7878.token").exists()


def test_a_killed_brokers_token_file_is_swept_by_the_next_start() -> None:
    """A token file names its broker's pid: a dead broker's goes at the next start, a live
    one's stays even while nothing listens on its port (its only worker restarting)."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that was a process and is no more
    with socket.socket() as held, socket.socket() as quiet:  # bound, never listening
        held.bind(("127.0.0.1", 0))
        quiet.bind(("127.0.0.1", 0))
        port, live_port = held.getsockname()[1], quiet.getsockname()[1]
        runtime.write_token(port, "left by a broker that was SIGKILLed")
        runtime.token_path(port).write_text(f"left by a broker that was SIGKILLed\n{dead.pid}\n")
        runtime.write_token(live_port, "ours, alive, listening nowhere right now")
        srv = Server(workers=1)
        try:
            assert not runtime.token_path(port).exists()  # swept: its broker is dead
            assert runtime.token_for("127.0.0.1", live_port) == "ours, alive, listening nowhere right now"
            assert runtime.token_path(srv.port).exists()  # its own, kept
        finally:
            runtime.remove_token(live_port, "ours, alive, listening nowhere right now")
            assert srv.stop() == 0
