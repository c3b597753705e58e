"""Fixtures of the co-located core's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shmq import headers
from shmq.core import consumer as consume
from shmq.core import delivery as group_delivery
from shmq.core import lock, ring
from shmq.core import settlement as group_settlement
from tests.support.compiled import IMPLS, compiled


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every accelerated name of the hot paths bound to one implementation."""
    ext = compiled() if request.param == "compiled" else None
    trylock = lock._trylock if ext is None else ext.trylock
    unlock = lock._unlock if ext is None else ext.unlock
    for mod in (lock, ring, consume):
        monkeypatch.setattr(mod, "trylock", trylock)
        monkeypatch.setattr(mod, "unlock", unlock)
    monkeypatch.setattr(headers, "encode_c", None if ext is None else ext.encode_headers)
    monkeypatch.setattr(headers, "parse_c", None if ext is None else ext.parse_headers)
    monkeypatch.setattr(headers, "decode_c", None if ext is None else ext.decode_headers)
    monkeypatch.setattr(group_delivery, "_records",
                        group_delivery._records_py if ext is None else ext.records)
    monkeypatch.setattr(consume, "_deliver_c", None if ext is None else ext.deliver_one)
    monkeypatch.setattr(consume, "_ack_c", None if ext is None else ext.ack_one)
    monkeypatch.setattr(consume, "_ack_run_c", None if ext is None else ext.ack_run)
    monkeypatch.setattr(consume, "_take_c", None if ext is None else ext.take_one)
    monkeypatch.setattr(consume, "_ack_lock_c", None if ext is None else ext.ack_lock)
    monkeypatch.setattr(consume, "_spin_c", None if ext is None else ext.spin_wait)
    monkeypatch.setattr(ring, "_put_c", None if ext is None else ext.put_one)
    monkeypatch.setattr(group_settlement, "_settle_c", None if ext is None else ext.settle_range)
    yield request.param
