"""``shmq serve`` as a real subprocess, and killing one whole."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil

from shmq import runtime
from shmq.core.colocated import ShmBroker
from tests.support.instances import reg_path, session_tmp, unique_instance


def _name(p: psutil.Process) -> str:
    try:
        return str(p.name())
    except psutil.Error:
        return ""


class Server:
    """``shmq serve`` as a real subprocess on an ephemeral port."""

    def __init__(self, workers: int = 2, token: str = "", extra: list[str] | None = None,
                 instance: str | None = None, data_dir: str | None = None, nofile: int | None = None
                 ) -> None:
        """``nofile``: the broker's descriptor limit, soft and hard (as ``prlimit --nofile``)."""
        import re
        import selectors
        import subprocess
        import sys

        self.instance = instance or unique_instance()
        self.keep = "--keep" in (extra or [])
        self.own_data_dir = data_dir is None
        self.data_dir = data_dir or session_tmp(f"{self.instance}-")
        args = [sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                "--workers", str(workers), "--instance", self.instance, "--data-dir", self.data_dir,
                *(extra or [])]
        env = {**os.environ, "SHMQ_TOKEN": token}  # as users should: not in argv, where ps shows it
        limit = None
        if nofile is not None:
            import resource
            limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))  # noqa: E731
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     preexec_fn=limit)
        self.stdout_at_stop = ""
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        line = b""
        deadline = time.monotonic() + 60
        while b"\n" not in line:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                if self.proc.poll() is None:
                    self.proc.kill()
                err = self.proc.stderr.read()  # type: ignore[union-attr]
                self.stop()
                raise RuntimeError(f"shmq serve did not start: {line!r} {err!r}")
            if sel.select(0.5):
                line += os.read(self.proc.stdout.fileno(), 4096)  # type: ignore[union-attr]
        sel.close()
        self.start_line = line.decode(errors="replace")
        m = re.search(rb"tcps?://[0-9.]+:(\d+)", line)
        assert m, line
        self.port = int(m.group(1))
        self.url = f"tcp://127.0.0.1:{self.port}"
        # with no token given, the broker made one and left it for this user's clients
        self.token = token or (runtime.token_for("127.0.0.1", self.port) or "")
        m = re.search(rb"\(writer pid (\d+)\)", line)  # the journal process's: not a worker
        assert m, line
        self.journal_pid = int(m.group(1))
        # --metrics: "metrics on http(s)://HOST:PORT/metrics (pid N)", reached through 127.0.0.1
        m = re.search(rb"metrics on (https?)://\S+?:(\d+)/metrics \(pid (\d+)\)", line)
        self.metrics_url = f"{m.group(1).decode()}://127.0.0.1:{int(m.group(2))}/metrics" if m else ""
        self.metrics_pid = int(m.group(3)) if m else 0

    def stderr_so_far(self) -> str:
        """What the broker wrote to stderr until now (without waiting for more)."""
        return self._so_far(self.proc.stderr)

    @staticmethod
    def _so_far(stream: Any) -> str:
        import selectors
        out = b""
        with selectors.DefaultSelector() as sel:
            sel.register(stream, selectors.EVENT_READ)
            while sel.select(0):
                chunk = os.read(stream.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
        return out.decode(errors="replace")

    def workers(self) -> list[psutil.Process]:
        """The worker processes (not the journal process, nor the metrics process, which
        names itself ``shmq-metrics`` and may have been restarted since the start line)."""
        return [p for p in psutil.Process(self.proc.pid).children()
                if p.is_running() and p.pid != self.journal_pid and _name(p) != "shmq-metrics"]

    def stop(self, timeout: float = 20) -> int:
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                p.kill()
            self.proc.kill()
            self.proc.wait()
            raise
        finally:
            if self.proc.stdout and not self.proc.stdout.closed:
                self.stdout_at_stop = self._so_far(self.proc.stdout)  # its stop line, for instance
            for stream in (self.proc.stdout, self.proc.stderr):
                if stream:
                    stream.close()
            if not self.keep and os.path.exists(reg_path(self.instance)):
                ShmBroker(self.instance).destroy()  # only if the broker failed to clean up
            if getattr(self, "token", ""):
                runtime.remove_token(self.port, self.token)  # a killed broker's, if it left it
            if self.own_data_dir and not self.keep:
                import shutil
                shutil.rmtree(self.data_dir, ignore_errors=True)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its children at once."""
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def kill_broker(srv: Server) -> None:
    """SIGKILL the supervisor, its journal process and its workers, all at once."""
    kill_tree(srv.proc.pid)
    srv.proc.wait()
    for stream in (srv.proc.stdout, srv.proc.stderr):
        if stream:
            stream.close()


def broker_pids(srv: Server) -> list[int]:
    """The broker's supervisor and its children (journal process, workers, metrics)."""
    return [srv.proc.pid, *(c.pid for c in psutil.Process(srv.proc.pid).children())]
