"""Shared fixtures; the helpers they use, and the tests too, are in ``tests/support/``.

Every test gets its own instance name (``t<pid>x<n>``), so tests run in
parallel (pytest-xdist) without seeing each other.  At the end of the session
a check fails the run if any object of this session is left in /dev/shm or
any process this session started is still alive.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import shmq
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerBroker
from shmq.server.core import Core
from tests.support.clock import FakeClock
from tests.support.durable import Durable
from tests.support.fakes import HeldMark
from tests.support.instances import (
    leftovers,
    mp_helper,
    objects,
    reg_path,
    remove_session_tmp,
    unique_instance,
)
from tests.support.server import Server


@pytest.fixture(scope="session", autouse=True)
def no_leaks() -> Iterator[None]:
    yield
    children = [p for p in psutil.Process().children(recursive=True) if not mp_helper(p)]
    gone, alive = psutil.wait_procs(children, timeout=5)
    left = leftovers()
    remove_session_tmp()
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


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def clocked(instance: str, clock: FakeClock) -> Iterator[ShmBroker]:
    """A broker whose leases and delays run on the test's FakeClock."""
    b = ShmBroker(instance, clock=clock)
    yield b
    b.destroy()


# ---------------------------------------------------------------- the broker server
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


@pytest.fixture
def held(core: Core) -> HeldMark:
    """``core``'s held answers, with a mark the test reaches (:class:`HeldMark`)."""
    return HeldMark(core)


# ---------------------------------------------------------------- a journaled broker, killed and restarted
@pytest.fixture
def durable(tmp_path: Path) -> Any:
    d = Durable(tmp_path)
    yield d
    if d.srv.proc.poll() is None:
        assert d.srv.stop() == 0
