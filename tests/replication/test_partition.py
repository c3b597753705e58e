"""A cut link, and a primary that diverged: the standby reaches the primary through a proxy
that blackholes the link (``tests.support.proxy``), then heals it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq.server.replication import write_state
from tests.replication.test_standby import journal_of
from tests.support.instances import session_tmp
from tests.support.replication import (
    TOKEN,
    Standby,
    free_port,
    promote,
    proxied_primary,
    replication,
    wait_caught_up,
)
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


@pytest.mark.crash
def test_two_standbys_of_one_list_follow_the_promoted_one_and_a_second_promote_is_refused(
        nodes: tuple[Server, Any]) -> None:
    primary, _ = nodes
    a_port, b_port = free_port(), free_port()
    peers = f"{primary.url},tcp://127.0.0.1:{a_port},tcp://127.0.0.1:{b_port}"  # the same list on each
    a = Standby(peers, port=a_port)
    b = None
    try:
        b = Standby(peers, port=b_port)
        with shmq.connect(primary.url, token=TOKEN) as p:
            q = p.create_queue("log", durability="always")
            offsets = [q.put(f"m{i}".encode()) for i in range(20)]
            for node in (a, b):
                with shmq.connect(node.url, token=TOKEN) as s:
                    wait_caught_up(p, s, "log")
                    assert replication(s)["primary"] == primary.url
        kill_broker(primary)
        with shmq.connect(a.url, token=TOKEN) as s:
            wait_until(lambda: not replication(s)["connected"], 20)
            assert promote(s) == 2
        a.promoted()
        with shmq.connect(b.url, token=TOKEN) as s:  # b finds the new primary in its list
            wait_until(lambda: replication(s)["primary"] == a.url and replication(s)["caught_up"], 30)
            assert replication(s)["epoch"] == 2
            with pytest.raises(shmq.InvalidArgument, match="alive and streaming"):
                promote(s)
        with shmq.connect(a.url, token=TOKEN) as s:
            q = s.queue("log")
            offsets.append(q.put(b"after"))
            with shmq.connect(b.url, token=TOKEN) as sb:
                wait_caught_up(s, sb, "log")
            got = {m.offset: m.payload for m in q.get_many(100, timeout=5)}
        assert got == {o: (f"m{i}".encode() if i < 20 else b"after") for i, o in enumerate(offsets)}
    finally:
        if b is not None:
            b.stop()
        a.stop()


def test_a_primary_that_learns_of_a_newer_epoch_confirms_no_more_writes() -> None:
    data = session_tmp("fenced-")  # kept after its stop: it is started again below
    primary = Server(workers=1, token=TOKEN, data_dir=data, extra=["--unix", "off"])
    try:
        _fenced(primary)
    finally:
        primary.stop()
    again = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve",
                            "--port", "0", "--instance", primary.instance, "--data-dir", data,
                            "--unix", "off"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SHMQ_TOKEN": TOKEN})
    assert again.returncode != 0 and "a node of epoch 2 exists: rejoin it as a standby" in again.stderr, (
        again.stdout, again.stderr)


def _fenced(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        q = b.create_queue("log", durability="always")
        kept = q.put(b"before")
        newer = Path(session_tmp("newer-"))  # a node that knows epoch 2 (a standby of the new primary)
        write_state(newer, {"epoch": 2, "role": "standby", "primary": "", "forks": {}})
        other = Standby(primary.url, data_dir=str(newer))
        try:
            with shmq.connect(other.url, token=TOKEN) as s:
                wait_until(lambda: "superseded" in replication(s)["error"], 20)
            wait_until(lambda: replication(b)["superseded_by"] == 2, 10)
            with pytest.raises(shmq.StorageError, match="superseded by a newer primary"):
                q.put(b"after", timeout=5)
        finally:
            other.stop()
        assert q.get(timeout=5).offset == kept  # what it had is still served
