"""A standby (``shmq serve --replica-of``): the copy, the stream, resume, reads only, promote.

Real brokers: a primary (``Server``) and a standby (``Standby``), each with its own
instance, port and data dir, on this host.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

import shmq
from shmq.journal import Journal
from tests.server.test_config import _invoke
from tests.support.replication import TOKEN, Standby, promote, replication, wait_caught_up
from tests.support.server import Server, kill_broker
from tests.support.wait import wait_until


@pytest.fixture
def primary() -> Iterator[Server]:
    srv = Server(workers=1, token=TOKEN, extra=["--unix", "off"])
    yield srv
    srv.stop()  # (also after a SIGKILL: what it left in /dev/shm goes)


def journal_of(data_dir: str, name: str) -> dict[int, tuple[bytes, bytes]]:
    """offset -> (payload, metadata) of what a (stopped) node's journal holds of a queue."""
    with Journal(data_dir, name, create=False) as j:
        rec = j.recover()
    return {o: (p, rec.metas.get(o, b"")) for o, _, p in rec.messages}


def test_full_copy_has_every_message_at_its_offset_with_its_headers(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        q = b.create_queue("orders", durability="always")
        sent = {q.put(f"m{i}".encode(), headers={"i": str(i)} if i % 3 else None): i for i in range(50)}
        for m in q.get_many(10):  # the first 10 acked: settled, gone from the copy's deliveries
            m.ack()
        standby = Standby(primary.url)
        try:
            with shmq.connect(standby.url, token=TOKEN) as s:
                wait_caught_up(b, s, "orders")
                more = {q.put(f"n{i}".encode()): 100 + i for i in range(20)}  # the live stream
                wait_caught_up(b, s, "orders")
                assert replication(s)["caught_up"] is True
                info = replication(b)
                assert [sb["node"].rsplit(":", 1)[1] for sb in info["standbys"]] == [str(standby.port)]
        finally:
            standby.stop(keep_data=True)
        held = journal_of(standby.data_dir, "orders")
        for off, i in {**sent, **more}.items():
            payload = f"m{i}".encode() if i < 100 else f"n{i - 100}".encode()
            assert held[off][0] == payload, off
            if i < 100 and i % 3:
                assert b"i" in held[off][1]
        assert set(held) == set(sent) | set(more)


def test_a_standby_serves_reads_and_refuses_writes_naming_the_primary(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        b.create_queue("jobs", durability="interval")
        b.create_queue("scratch")  # memory only: its definition is replicated
        b.queue("jobs").put(b"x")
        standby = Standby(primary.url)
        try:
            with shmq.connect(standby.url, token=TOKEN) as s:
                wait_until(lambda: replication(s)["caught_up"], 20)
                assert sorted(i.name for i in s.list_queues()) == ["jobs", "scratch"]
                info = replication(s)
                assert info["role"] == "standby" and info["primary"] == primary.url
                q = s.queue("jobs")
                assert q.stats()["standby"] is True
                for op in (lambda: q.put(b"y"), lambda: q.get(timeout=0), lambda: s.create_queue("new"),
                           lambda: s.delete_queue("jobs")):
                    with pytest.raises(shmq.NotPrimary) as e:
                        op()
                    assert e.value.primary == primary.url
                    assert e.value.code == shmq.Status.NOT_PRIMARY
                with pytest.raises(shmq.QueueNotFound):
                    s.queue("nope")
        finally:
            standby.stop()
        assert b.queue("jobs").get(timeout=5).payload == b"x"  # nothing on the primary changed


def test_a_restarted_standby_resumes_from_its_position_not_from_zero(primary: Server) -> None:
    payload = b"p" * 2000
    with shmq.connect(primary.url, token=TOKEN) as b:
        q = b.create_queue("log", durability="always", max_bytes=64 << 20)
        q.put_many([payload] * 500)  # 1 MB the first copy sends
        data_dir = None
        standby = Standby(primary.url)
        try:
            data_dir = standby.data_dir
            with shmq.connect(standby.url, token=TOKEN) as s:
                wait_caught_up(b, s, "log")
            # (INFO shows what the journal process reported at most 0.1 s ago)
            wait_until(lambda: replication(b)["bytes_sent"] > 500 * len(payload))
            first = replication(b)["bytes_sent"]
        finally:
            standby.stop(keep_data=True)
        q.put_many([payload] * 20)  # while it is down
        again = Standby(primary.url, data_dir=data_dir)
        try:
            with shmq.connect(again.url, token=TOKEN) as s:
                wait_caught_up(b, s, "log")
            wait_until(lambda: replication(b)["bytes_sent"] >= first + 20 * len(payload))
            resent = replication(b)["bytes_sent"] - first
        finally:
            again.stop()
        # the 20 new messages and the state, not the 500 it had
        assert 20 * len(payload) <= resent < 60 * len(payload), resent


def test_a_sync_put_is_confirmed_only_once_a_standby_has_it(primary_sync: Server) -> None:
    primary = primary_sync
    with shmq.connect(primary.url, token=TOKEN) as b:
        q = b.create_queue("pay", durability="always", replication="sync")
        with pytest.raises(shmq.StorageError, match="standby"):  # none connected: refused after the bound
            q.put(b"lonely", timeout=10)
        standby = Standby(primary.url)
        try:
            with shmq.connect(standby.url, token=TOKEN) as s:
                wait_until(lambda: replication(s)["caught_up"], 20)
            wait_until(lambda: _puts(q), 20)  # confirmed again once a standby acks
            confirmed = [q.put(f"c{i}".encode()) for i in range(30)]
            os.kill(standby.proc.pid, signal.SIGSTOP)  # frozen: it acks nothing
            try:
                with pytest.raises(shmq.StorageError):
                    q.put(b"frozen", timeout=10)
            finally:
                os.kill(standby.proc.pid, signal.SIGCONT)
            wait_until(lambda: _puts(q), 20)
            confirmed.append(q.put(b"after"))
        finally:
            standby.stop(keep_data=True)
        held = journal_of(standby.data_dir, "pay")
        assert all(off in held for off in confirmed), sorted(set(confirmed) - set(held))


def _puts(q: shmq.Queue) -> bool:
    try:
        q.put(b"probe", timeout=5)
        return True
    except shmq.StorageError:
        return False


@pytest.fixture
def primary_sync() -> Iterator[Server]:
    srv = Server(workers=1, token=TOKEN, extra=["--unix", "off", "--sync-timeout", "1"])
    yield srv
    srv.stop()  # (also after a SIGKILL: what it left in /dev/shm goes)


def test_promote_turns_the_standby_into_the_primary_with_the_same_offsets(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        q = b.create_queue("orders", durability="always")
        offs = [q.put(f"m{i}".encode()) for i in range(30)]
        q.get_many(5)  # leased, never acked: delivered again by the new primary
        later = q.put(b"later", delay=3600)  # due in an hour: not before, on the new primary either
        b.create_queue("scratch", capacity=77)  # memory only: the new primary has it, empty
        standby = Standby(primary.url)
        with shmq.connect(standby.url, token=TOKEN) as s:
            wait_caught_up(b, s, "orders")
            wait_until(lambda: "scratch" in {i.name for i in s.list_queues()})
        top = _invoke("top", "--once", "--url", standby.url, "--token", TOKEN, "--interval", "0.1")
        assert top.exit_code == 0 and "standby of" in top.output and "orders" in top.output, top.output
    kill_broker(primary)
    try:
        with shmq.connect(standby.url, token=TOKEN) as s:
            wait_until(lambda: not replication(s)["connected"], 20)
        out = _invoke("promote", "--url", standby.url, "--token", TOKEN)  # as an operator would
        assert (out.exit_code, out.stdout) == (0, "promoted: epoch 2\n"), out.output
        standby.promoted()
        with shmq.connect(standby.url, token=TOKEN) as s:
            info = replication(s)
            assert info["role"] == "primary" and info["epoch"] == 2
            q2 = s.queue("orders")
            got = {m.offset: m.payload for m in q2.get_many(100, timeout=5)}
            # the 5 leased (never acked) on the old primary come back too; the delayed one waits
            assert got == {o: f"m{i}".encode() for i, o in enumerate(offs)}
            assert q2.stats()["next_offset"] == later + 1
            assert q2.put(b"new") == later + 1
            assert {i.name: i.config.capacity for i in s.list_queues()}["scratch"] == 77
    finally:
        standby.stop()


def test_bad_requests_get_clear_errors(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        b.create_queue("q", durability="always").put(b"keep")
        with pytest.raises(shmq.InvalidArgument, match="primary already"):
            promote(b)
        out = _invoke("promote", "--url", primary.url, "--token", TOKEN)
        assert out.exit_code == 1 and "is a primary already (epoch 1)" in out.output, out.output
        out = _invoke("promote", "--url", f"{primary.url},{primary.url}", "--token", TOKEN)
        assert out.exit_code == 1 and "give its URL alone" in out.output, out.output
        wrong = Standby(primary.url, primary_token="not-the-token")
        try:
            with shmq.connect(wrong.url, token=TOKEN) as s:
                wait_until(lambda: "AUTH_FAILED" in replication(s)["error"], 20)
                with pytest.raises(shmq.InvalidArgument, match="never finished copying"):
                    promote(s)  # it holds nothing of its primary's
        finally:
            wrong.stop()
        good = Standby(primary.url)
        try:
            chained = Standby(good.url)
            try:
                with shmq.connect(chained.url, token=TOKEN) as s:
                    wait_until(lambda: "is a standby itself" in replication(s)["error"], 20)
            finally:
                chained.stop()
            with shmq.connect(good.url, token=TOKEN) as s:
                wait_until(lambda: replication(s)["caught_up"], 20)
                with pytest.raises(shmq.InvalidArgument, match="alive and streaming"):
                    promote(s)
        finally:
            good.stop()
        assert b.queue("q").get(timeout=5).payload == b"keep"


def test_a_standby_shows_its_queues_stats_and_messages_and_its_role(primary: Server) -> None:
    with shmq.connect(primary.url, token=TOKEN) as b:
        q = b.create_queue("orders", durability="always")
        sent = [q.put(f"m{i}".encode(), headers={"k": "v"}) for i in range(40)]
        for m in q.get_many(15):
            m.ack()
        standby = Standby(primary.url)
        try:
            with shmq.connect(standby.url, token=TOKEN) as s:
                wait_caught_up(b, s, "orders")
                wait_until(lambda: s.queue("orders").stats()["groups"]["default"]["acked"] == 15)
                st, theirs = s.queue("orders").stats(), q.stats()
                for key in ("next_offset", "produced", "first_offset", "retained"):
                    assert st[key] == theirs[key], key
                assert st["groups"]["default"]["floor"] == theirs["groups"]["default"]["floor"] == 15
                got = s.queue("orders").read(sent[10], 100)
                assert [(m.offset, m.payload, dict(m.headers)) for m in got] == [
                    (m.offset, m.payload, dict(m.headers)) for m in q.read(sent[10], 100)]
                assert [m.offset for m in got] == sent[15:]
                info = replication(s)
                assert (info["role"], info["epoch"], info["caught_up"]) == ("standby", 1, True)
            out = _invoke("status", "--url", standby.url, "--token", TOKEN)
            assert out.stdout == f"ready\nstandby of {primary.url}, epoch 1, caught up\n", out.output
            out = _invoke("status", "--url", primary.url, "--token", TOKEN)
            assert out.stdout.startswith("ready\nprimary, epoch 1, 1 standby ("), out.output
        finally:
            standby.stop()


def test_a_standbys_data_dir_does_not_start_as_a_primary(primary: Server) -> None:
    """Started without --replica-of, a standby's data dir would take writes in its primary's
    epoch beside it: refused, naming the way out (and nothing of it is touched)."""
    import subprocess
    import sys

    standby = Standby(primary.url)
    standby.stop(keep_data=True)
    out = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                          "--instance", standby.instance, "--data-dir", standby.data_dir, "--unix", "off"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "SHMQ_TOKEN": TOKEN})
    assert out.returncode == 1 and f"is a standby's (of {primary.url}, epoch 1)" in out.stderr, out.stderr
    assert "start it with --replica-of, or promote it" in out.stderr
