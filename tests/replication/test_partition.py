"""A cut link, and a primary that diverged: the standby reaches the primary through a proxy
that blackholes the link (``tests.support.proxy``), then heals it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import shmq
from tests.replication.test_standby import journal_of
from tests.support.replication import TOKEN, Standby, promote, proxied_primary, replication, wait_caught_up
from tests.support.server import Server, kill_broker
from tests.support.wait import wait_until


@pytest.fixture
def nodes() -> Iterator[tuple[Server, Any]]:
    srv, proxy = proxied_primary(extra=["--sync-timeout", "1"])
    yield srv, proxy
    srv.stop()
    proxy.close()


def lag(b: Any) -> int:
    (link,) = replication(b)["standbys"]
    return int(link["lag_records"])


def test_a_cut_link_stops_sync_confirms_and_healing_resumes_them(nodes: tuple[Server, Any]) -> None:
    primary, proxy = nodes
    standby = Standby(primary.url)
    confirmed: dict[bytes, int] = {}
    refused: list[bytes] = []
    try:
        with shmq.connect(primary.url, token=TOKEN) as b, shmq.connect(standby.url, token=TOKEN) as s:
            q = b.create_queue("pay", durability="always", replication="sync")
            wait_until(lambda: replication(s)["caught_up"] and "pay" in replication(s)["queues"], 20)
            for i in range(20):
                confirmed[f"a{i}".encode()] = q.put(f"a{i}".encode())
            proxy.cut()
            for i in range(3):  # what the docs say: StorageError once --sync-timeout (1 s) passes
                v = f"cut{i}".encode()
                with pytest.raises(shmq.StorageError, match="standby"):
                    q.put(v, timeout=10)
                refused.append(v)
            proxy.heal()
            wait_until(lambda: _confirms(q, refused), 30)  # the link comes back (or reconnects)
            for i in range(20):
                confirmed[f"b{i}".encode()] = q.put(f"b{i}".encode())
            wait_caught_up(b, s, "pay")
            # nothing confirmed twice, nothing lost: each offset once, and every message is delivered
            assert len(set(confirmed.values())) == len(confirmed)
            got: dict[bytes, int] = {}
            while True:
                try:
                    m = q.get(timeout=0.5)
                except shmq.Empty:
                    break
                assert bytes(m.payload) not in got
                got[bytes(m.payload)] = m.offset
                m.ack()
            assert {v: got[v] for v in confirmed} == confirmed
            assert set(got) - set(confirmed) <= set(refused)  # (a refused put may be stored: unconfirmed)
    finally:
        standby.stop(keep_data=True)
    held = journal_of(standby.data_dir, "pay")
    assert all(held[off][0] == v for v, off in confirmed.items())


def _confirms(q: Any, tried: list[bytes]) -> bool:
    """Is a put confirmed again?  (Each probe is unique, and counted as tried.)"""
    tried.append(f"probe{len(tried)}".encode())
    try:
        q.put(tried[-1], timeout=5)
    except shmq.StorageError:
        return False
    return True


def test_a_cut_link_lets_async_lag_grow_then_drain(nodes: tuple[Server, Any]) -> None:
    primary, proxy = nodes
    standby = Standby(primary.url)
    try:
        with shmq.connect(primary.url, token=TOKEN) as b, shmq.connect(standby.url, token=TOKEN) as s:
            q = b.create_queue("log", durability="always")
            q.put_many([b"x"] * 10)
            wait_caught_up(b, s, "log")
            wait_until(lambda: lag(b) == 0)
            proxy.cut()
            offsets = [q.put(f"m{i}".encode()) for i in range(100)]  # async: confirmed by our fsync alone
            wait_until(lambda: lag(b) >= 100, 10)
            proxy.heal()
            wait_until(lambda: lag(b) == 0, 30)
            wait_caught_up(b, s, "log")
    finally:
        standby.stop(keep_data=True)
    held = journal_of(standby.data_dir, "log")
    assert [held[o][0] for o in offsets] == [f"m{i}".encode() for i in range(100)]


@pytest.mark.crash
def test_an_old_primary_rejoins_discards_its_diverged_tail_and_matches_offset_by_offset(
        nodes: tuple[Server, Any]) -> None:
    primary, proxy = nodes
    standby = Standby(primary.url)
    rejoined = None
    try:
        with shmq.connect(primary.url, token=TOKEN) as b, shmq.connect(standby.url, token=TOKEN) as s:
            q = b.create_queue("log", durability="always")
            q.put_many([f"a{i}".encode() for i in range(30)])
            wait_caught_up(b, s, "log")
            proxy.cut()
            q.put_many([f"tail{i}".encode() for i in range(25)])  # the async tail the standby never gets
        kill_broker(primary)
        proxy.drop()
        with shmq.connect(standby.url, token=TOKEN) as s:
            wait_until(lambda: not replication(s)["connected"], 20)
            assert promote(s) == 2
        standby.promoted()
        with shmq.connect(standby.url, token=TOKEN) as s:
            s.queue("log").put_many([f"new{i}".encode() for i in range(10)])  # offsets 30..39, again
            rejoined = Standby(standby.url, data_dir=primary.data_dir)  # the old primary follows
            with shmq.connect(rejoined.url, token=TOKEN) as r:
                wait_caught_up(s, r, "log")
                info = replication(r)
                assert info["epoch"] == 2
                assert info["discarded"] == [
                    f"queue 'log': discarded 25 records past offset 30 (this node's history parted from "
                    f"{standby.url}'s there)"]
        assert "discarded 25 records past offset 30" in rejoined.stderr_so_far()
    finally:
        if rejoined is not None:
            rejoined.stop(keep_data=True)
        standby.stop(keep_data=True)
    ours, theirs = journal_of(primary.data_dir, "log"), journal_of(standby.data_dir, "log")
    assert ours == theirs
    assert [ours[o][0] for o in range(30, 40)] == [f"new{i}".encode() for i in range(10)]
