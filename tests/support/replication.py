"""A standby (``shmq serve --replica-of``) as a real subprocess, beside ``tests.support.server.Server``."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

from shmq.core.colocated import ShmBroker
from tests.support.instances import reg_path, session_tmp, unique_instance
from tests.support.server import Server, kill_tree
from tests.support.wait import wait_until

# one token per test process: a standby of another pytest worker's test, still reconnecting
# to its dead primary's port, may find one of ours there once the port is reused (ports are
# ephemeral), and would follow it and ack its sync rounds if it held the same token
TOKEN = f"replication-test-token-{os.getpid()}"


class Standby:
    """``shmq serve --replica-of PRIMARY`` on an ephemeral port, until promoted (then a primary)."""

    def __init__(self, primary_url: str, token: str = TOKEN, data_dir: str | None = None,
                 extra: list[str] | None = None, primary_token: str | None = None, port: int = 0) -> None:
        self.instance = unique_instance()
        self.own_data_dir = data_dir is None
        self.data_dir = data_dir or session_tmp(f"{self.instance}-")
        url = primary_url if primary_token is None else f"{primary_url}?token={primary_token}"
        args = [sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", str(port),
                "--workers", "1", "--instance", self.instance, "--data-dir", self.data_dir, "--unix", "off",
                "--replica-of", url, *(extra or [])]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={**os.environ, "SHMQ_TOKEN": token})
        self.token = token
        self._out = b""
        line = self.read_line(60)
        m = re.search(r"serving reads on tcp://[0-9.]+:(\d+)", line)
        assert m, line
        self.port = int(m.group(1))
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.journal_pid = 0

    def read_line(self, timeout: float) -> str:
        """The next line of its stdout (its start line; after a promote, the primary's)."""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            while b"\n" not in self._out:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    err = self.stderr_so_far()
                    raise RuntimeError(f"no line from the standby: {self._out!r} {err}")
                if sel.select(0.2):
                    self._out += os.read(self.proc.stdout.fileno(), 4096)  # type: ignore[union-attr]
        line, _, self._out = self._out.partition(b"\n")
        return line.decode(errors="replace")

    def promoted(self) -> str:
        """Wait for the start line of the primary it became; the line."""
        line = self.read_line(60)
        m = re.search(r"\(writer pid (\d+)\)", line)
        assert m, line
        self.journal_pid = int(m.group(1))
        return line

    def stderr_so_far(self) -> str:
        """What it wrote to stderr until now (without waiting for more)."""
        return Server._so_far(self.proc.stderr)

    def stop(self, timeout: float = 20, keep_data: bool = False) -> int:
        """SIGTERM, and wait; its data dir goes too unless ``keep_data`` (the session's
        temporary folder goes at the end anyway)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()
            raise
        finally:
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream:
                    stream.close()
            if os.path.exists(reg_path(self.instance)):
                ShmBroker(self.instance).destroy()
            if self.own_data_dir and not keep_data:
                import shutil
                shutil.rmtree(self.data_dir, ignore_errors=True)

    def kill(self) -> None:
        kill_tree(self.proc.pid)
        self.proc.wait()


def replication(b: Any) -> dict[str, Any]:
    info = b.info().replication
    assert info is not None
    return dict(info)


def wait_caught_up(primary: Any, standby: Any, queue: str, timeout: float = 20) -> None:
    """Until the standby's journal of ``queue`` ends where the primary's queue does."""
    end = primary.queue(queue).stats()["next_offset"]
    wait_until(lambda: replication(standby)["queues"].get(queue) == end, timeout)


def promote(b: Any, force: bool = False) -> int:
    """PROMOTE over ``b``'s connection (what ``shmq promote`` sends): the new epoch."""
    return int(b.promote(force))


def proxied_primary(workers: int = 1, extra: list[str] | None = None) -> tuple[Any, Any]:
    """A primary whose standbys reach its replication port through a ``CutProxy`` (it announces
    the proxy's port): (Server, CutProxy)."""
    from tests.support.proxy import CutProxy

    proxy = CutProxy(("127.0.0.1", 0))
    srv = Server(workers=workers, token=TOKEN, extra=["--unix", "off", "--replication-announce",
                                                       f"127.0.0.1:{proxy.port}", *(extra or [])])
    m = re.search(r"standbys connect to port (\d+)", srv.start_line)
    assert m, srv.start_line
    proxy.target = ("127.0.0.1", int(m.group(1)))
    return srv, proxy


def free_port() -> int:
    """A port free now (for a node whose URL must be known before it starts: a list of peers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
