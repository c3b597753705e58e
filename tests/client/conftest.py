"""Fixtures of the fail-over tests (``test_failover``, ``test_aio_failover``): a primary and
its standby, real brokers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.replication import TOKEN, Standby
from tests.support.server import Server


@pytest.fixture
def primary() -> Iterator[Server]:
    srv = Server(workers=1, token=TOKEN, extra=["--unix", "off"])
    yield srv
    srv.stop()  # (also after kill_broker: what it left in /dev/shm goes)


@pytest.fixture
def standby(primary: Server) -> Iterator[Standby]:
    node = Standby(primary.url)
    yield node
    node.stop()
