"""Shared fixtures.

Every test gets its own instance name (``t<pid>x<n>``), so tests run in
parallel (pytest-xdist) without seeing each other.  At the end of the session
a check fails the run if any object of this session is left in /dev/shm or
any process this session started is still alive.
"""

from __future__ import annotations

import importlib
import itertools
import os
import signal
import threading
import time
from collections.abc import Callable, Generator, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import psutil
import pytest

import shmq
from shmq import runtime
from shmq.client.tcp import TcpBroker
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.core.durability import Mark
from shmq.core.segment import parse_object_name, registry_name, shm_path
from shmq.core.serverqueue import ServerBroker
from shmq.server.core import Core

_counter = itertools.count()
SESSION_PREFIX = f"t{os.getpid()}x"


_tmp_root: list[str] = []  # this session's folder for brokers' data dirs, made on first use


def session_tmp(prefix: str) -> str:
    """A new folder for this session's temporary files: under one folder that the session
    removes at its end, so a test that stops no broker (or kills one) leaves nothing in /tmp."""
    import tempfile
    if not _tmp_root:
        _tmp_root.append(tempfile.mkdtemp(prefix=f"shmq-{SESSION_PREFIX}-"))
    return tempfile.mkdtemp(prefix=prefix, dir=_tmp_root[0])


def unique_instance() -> str:
    return f"{SESSION_PREFIX}{next(_counter)}"


def leftovers(prefix: str = SESSION_PREFIX) -> list[str]:
    """The objects in /dev/shm of every instance whose name starts with ``prefix``, of any
    uid (a test's child that became another user names its objects with that user's)."""
    return sorted(n for n in os.listdir("/dev/shm")
                  if (m := parse_object_name(n)) and m["inst"].startswith(prefix))


def objects(instance: str) -> list[str]:
    """The objects in /dev/shm of ``instance`` (that name exactly), of any uid."""
    return [n for n in leftovers(instance) if (m := parse_object_name(n)) and m["inst"] == instance]


def reg_path(instance: str) -> str:
    """The file of our ``instance``'s registry in /dev/shm."""
    return shm_path(registry_name(instance))


def _mp_helper(p: psutil.Process) -> bool:
    """multiprocessing's own helpers (forkserver, resource tracker) live as long as we do."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return True
    return "multiprocessing.forkserver" in cmd or "multiprocessing.resource_tracker" in cmd


@pytest.fixture(scope="session", autouse=True)
def no_leaks() -> Iterator[None]:
    yield
    children = [p for p in psutil.Process().children(recursive=True) if not _mp_helper(p)]
    gone, alive = psutil.wait_procs(children, timeout=5)
    left = leftovers()
    if _tmp_root:
        import shutil
        shutil.rmtree(_tmp_root[0], ignore_errors=True)
    for p in alive:
        p.kill()
    assert not alive, f"processes started by the tests are still running: {alive}"
    assert not left, f"shared memory left in /dev/shm: {left}"


@pytest.fixture
def instance() -> Iterator[str]:
    """A fresh instance name; afterwards its shared memory must pass the invariant
    checker (``shmq doctor --check``) and is removed."""
    name = unique_instance()
    yield name
    if os.path.exists(reg_path(name)):
        try:
            violations = check_instance(name)
        except shmq.InstanceError:  # destroyed by the test itself
            violations = []
        ShmBroker(name).destroy()
        assert violations == [], f"shmq doctor --check after the test: {violations}"
    mine = objects(name)
    assert not mine, f"this test left shared memory behind: {mine}"


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def clocked(instance: str, clock: FakeClock) -> Iterator[ShmBroker]:
    """A broker whose leases and delays run on the test's FakeClock."""
    b = ShmBroker(instance, clock=clock)
    yield b
    b.destroy()


def wait_until(pred: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> None:
    """Poll a condition (for observing other processes, never as a substitute for a result)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def connect_shm(url: str, **kwargs: Any) -> ShmBroker:
    """``shmq.connect`` for a ``shm://`` URL, typed as the broker it returns there, for a
    test that looks at the shared-memory handle's own parts (``reap``, ``_ring``, ...)."""
    b = shmq.connect(url, **kwargs)
    assert isinstance(b, ShmBroker), b
    return b


def connect_tcp(url: str, token: str | None = None, **kwargs: Any) -> TcpBroker:
    """``shmq.connect`` for a ``tcp://`` URL, typed as the broker it returns there, for a
    test that looks at the TCP handle's own parts (``worker``, ``subscribe``, ...)."""
    b = shmq.connect(url, token, **kwargs)
    assert isinstance(b, TcpBroker), b
    return b


# ---------------------------------------------------------------- another user
NOBODY = 65534  # the second uid (and gid) the tests become: a forked child drops root to it
importlib.import_module("encodings.idna")  # a TCP connect imports it; a child of another uid can't
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="becoming another uid needs root (CI is root)")


def _nobody_main(conn: Connection, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        got = target(*args)
        if not isinstance(got, Generator):
            conn.send(got)
            return
        try:
            step = next(got)
            while True:  # each value it yields goes to the parent; the parent's reply is sent in
                conn.send(step)
                step = got.send(conn.recv())
        except StopIteration as done:
            conn.send(done.value)  # and what it returns, at the end
    except Exception as e:  # noqa: BLE001 - the parent reports it
        conn.send(f"raised {type(e).__name__}: {e}")


class AsNobody:
    """``target(*args)`` in a forked child that became uid and gid ``NOBODY``.  Its return
    value comes back through a pipe (``result``); so does each value a generator yields,
    and ``reply`` resumes it (with a value) until it returns.  An exception comes back as
    ``"raised Type: message"``."""

    def __init__(self, target: Callable[..., Any], *args: Any) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self._conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_nobody_main, args=(theirs, target, args))
        self.proc.start()
        theirs.close()

    def result(self, timeout: float = 60) -> Any:
        assert self._conn.poll(timeout), "the child of another uid did not answer in time"
        return self._conn.recv()

    def reply(self, value: Any = None) -> None:
        self._conn.send(value)

    def close(self) -> int | None:
        """Wait for the child (killed if it hangs); its exit code."""
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self._conn.close()
        return self.proc.exitcode

    def __enter__(self) -> AsNobody:
        return self

    def __exit__(self, *exc: object) -> None:
        code = self.close()
        assert exc[0] is not None or code == 0, f"the child of another uid exited with {code}"


def as_nobody(target: Callable[..., Any], *args: Any) -> Any:
    """What ``target(*args)`` returns (or ``"raised Type: message"``) run as ``NOBODY``."""
    with AsNobody(target, *args) as child:
        return child.result()


def try_connect(url: str, token: str | None) -> str:
    """Connect and list the queues: ``"admitted"``, ``"refused"`` (``AuthError``), or the error."""
    try:
        with shmq.connect(url, token=token, connect_timeout=5) as b:
            b.list_queues()
        return "admitted"
    except shmq.AuthError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - the caller reports it
        return f"{type(e).__name__}: {e}"


__all__ = ["FakeClock", "connect_shm", "connect_tcp", "shmq", "unique_instance", "wait_until", "leftovers",
           "objects", "reg_path", "NOBODY", "as_root", "AsNobody", "as_nobody", "try_connect"]


async def aio_round_trip(url: str, token: str, name: str) -> None:
    """One message through a new queue ``name`` with the asyncio client, and the queue gone."""
    from shmq.client import aio
    b = await aio.connect(url, token=token)
    try:
        q = await b.create_queue(name)
        assert await q.put(b"hello") == 0
        m = await q.get(timeout=5)
        assert m.payload == b"hello"
        await m.ack()
        await b.delete_queue(name)
    finally:
        await b.close()


# ---------------------------------------------------------------- the broker server
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


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    s = Server(workers=2)
    yield s
    assert s.stop() == 0


def _clean(b: shmq.Broker) -> None:
    for info in b.list_queues():
        try:
            b.delete_queue(info.name)
        except shmq.QueueNotFound:
            pass


@pytest.fixture
def shm_broker(instance: str) -> Iterator[ShmBroker]:
    b = ShmBroker(instance)
    yield b
    b.destroy()


@pytest.fixture(params=["shm", "tcp"])
def broker(request: pytest.FixtureRequest, instance: str) -> Iterator[shmq.Broker]:
    """The same tests against both transports."""
    if request.param == "shm":
        b: Any = ShmBroker(instance)
        yield b
        b.destroy()
    else:
        srv = request.getfixturevalue("server")
        b = shmq.connect(srv.url)
        yield b
        _clean(b)
        b.close()


# ---------------------------------------------------------------- a broker worker's core, in memory
@pytest.fixture
def core(instance: str) -> Iterator[Core]:
    """A worker's request handling (``server.core``) over a fresh instance, no event loop."""
    sb = ServerBroker(instance)
    c = Core(sb, worker_id=3, token="")
    try:
        yield c
    finally:
        sb.close()


class HeldMark:
    """A stand-in for a queue's durable marks (``durability.Mark`` waits on it) and the
    event loop of ``core``'s held answers: ``mark()`` is a mark not yet reached; ``reach()``
    reaches it, waits for the held answer to be posted to the loop and runs it there."""

    name = "stand-in"
    WORD, END = 28, 5

    def __init__(self, core: Core) -> None:
        self.w = [0] * 64
        self.moved = threading.Event()
        self.posted: list[tuple[Any, ...]] = []
        self.done = threading.Event()
        core.held._post = self._post  # type: ignore[method-assign]  # (the loop's call_soon_threadsafe)

    def wait(self, word: int, end: int, deadline: float | None) -> int:
        assert self.moved.wait(10)
        return self.w[word]

    def _post(self, fn: Any, *args: Any) -> None:
        self.posted.append((fn, *args))
        self.done.set()

    def mark(self) -> Mark:
        return Mark(self, self.WORD, self.END)  # type: ignore[arg-type]

    def reach(self) -> None:
        self.w[self.WORD] = self.END
        self.moved.set()
        assert self.done.wait(10)
        fn, *args = self.posted[0]
        fn(*args)  # on the loop


@pytest.fixture
def held(core: Core) -> HeldMark:
    """``core``'s held answers, with a mark the test reaches (:class:`HeldMark`)."""
    return HeldMark(core)


# ---------------------------------------------------------------- a journaled broker, killed and restarted
def kill_broker(srv: Server) -> None:
    """SIGKILL the supervisor, its journal process and its workers, all at once."""
    procs = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)
    srv.proc.wait()
    for stream in (srv.proc.stdout, srv.proc.stderr):
        if stream:
            stream.close()


def remove_shm(instance: str) -> None:
    """What a reboot does to our shared memory."""
    for n in leftovers(instance):
        os.unlink(f"/dev/shm/{n}")


class Durable:
    """A broker with a data dir, and a way to crash it (optionally 'rebooting') and restart."""

    def __init__(self, tmp_path: Path) -> None:
        self.data = str(tmp_path / "data")
        self.inst = unique_instance()
        self.srv = Server(workers=1, instance=self.inst, data_dir=self.data)

    def crash(self, reboot: bool = True) -> None:
        kill_broker(self.srv)
        if reboot:
            remove_shm(self.inst)

    def start(self) -> str:
        """Start again; what the broker logged while starting."""
        self.srv = Server(workers=1, instance=self.inst, data_dir=self.data)
        return self.srv.stderr_so_far()


@pytest.fixture
def durable(tmp_path: Path) -> Any:
    d = Durable(tmp_path)
    yield d
    if d.srv.proc.poll() is None:
        assert d.srv.stop() == 0


# ---------------------------------------------------------------- a queue handle without a broker
class FakeHandle:
    """A queue handle as ``shmq.protocol.commands`` sees it (``commands.Handle``), with no connection
    behind it: for building requests and parsing answers in the tests."""

    name = "q"
    _qb = b"q"
    _message = shmq.Message
    _b = object()
