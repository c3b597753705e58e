"""When a resource runs out: a full disk, descriptors, shared memory, the lease count.

Each runs out for real: a small tmpfs as the data dir (mounted here: the suite runs as
root, as CI does), a broker started under a descriptor limit (``prlimit --nofile``'s
``setrlimit``), and a private mount namespace whose own small ``/dev/shm`` fills
(``unshare -m``), so the host's ``/dev/shm`` is never filled.  Each gets a typed error
that names what ran out, a log line, and nothing is lost; and the broker recovers by
itself once there is room.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq import options
from shmq.core.colocated import ShmBroker
from shmq.core.segment import parse_object_name
from shmq.errors import Status
from shmq.protocol.codec import T, decode_body
from shmq.server import handlers
from shmq.server.core import Core
from tests.support.connect import connect_tcp
from tests.support.instances import session_tmp, unique_instance
from tests.support.memory import fds, mapped_by, queue_ids
from tests.support.paths import ROOT
from tests.support.peer import Peer
from tests.support.server import Server, broker_pids
from tests.support.wait import wait_until

MB = 1 << 20
# a full journal frees its settled segments and takes puts again within its retry and drop
# intervals (0.5 s each); the margin is for a loaded 2-core machine running tests
RECOVERY_BOUND = options.JOURNAL_RETRY_INTERVAL + options.JOURNAL_DROP_INTERVAL + 5.0


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 30 MiB tmpfs, mounted for the test (a disk that fills in a second)."""
    d = Path(session_tmp("disk-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m,mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"mounting a tmpfs needs root (as CI runs): {r.stderr.strip()}"
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=True)


def _fill(path: Path) -> Path:
    """Fill the file system of ``path`` to the last byte; the filler file."""
    filler = path / "filler"
    try:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:  # not even a file's name fits: full already
        return filler
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, bytes(size))
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _payload(i: int) -> bytes:
    return f"{i:08d}".encode().ljust(4000, b".")


def _put_until_full(q: Any, start: int = 0) -> tuple[dict[int, bytes], shmq.StorageError]:
    """Confirmed puts of distinct 4000-byte payloads until the journal cannot take more."""
    confirmed: dict[int, bytes] = {}
    i = start
    while True:
        batch = [_payload(i + k) for k in range(10)]
        try:
            offsets = q.put_many(batch)
        except shmq.StorageError as e:
            return confirmed, e
        confirmed.update(zip(offsets, batch, strict=True))
        i += 10


def _try_put(q: Any, payload: bytes) -> int | None:
    try:
        return int(q.put(payload))
    except shmq.StorageError:
        return None


@pytest.mark.slow
def test_a_full_disk_frees_what_is_settled_takes_puts_again_and_restarts(small_disk: Path) -> None:
    data = small_disk / "data"
    srv = Server(workers=2, data_dir=str(data), extra=["--journal-segment-bytes", str(4 * MB)])
    try:
        b = connect_tcp(srv.url, srv.token)
        q = b.create_queue("d", durability="always", capacity=65536, max_bytes=64 * MB)
        confirmed, full = _put_until_full(q)
        assert len(confirmed) > 1000
        assert str(data / "q-d") in str(full) and "ENOSPC" in str(full)
        segments = len(list((data / "q-d").glob("*.log")))
        assert segments > 4

        # while full (to the last byte): a durable queue cannot be made, and nothing of it is left
        _fill(small_disk)
        with pytest.raises(shmq.StorageError):
            b.create_queue("d2", durability="always")
        assert "d2" not in {i.name for i in b.list_queues()}
        with pytest.raises(shmq.QueueExists):  # (the name was never free: its first owner lives)
            b.create_queue("d", durability="always")
        mem = b.create_queue("mem")  # memory queues serve
        mem.put(b"m")
        mem.get(timeout=5).ack()

        # consumers and their acks carry on: every confirmed message is delivered, each ack succeeds
        seen: dict[int, bytes] = {}
        while True:
            try:
                msgs = q.get_many(100, timeout=2)
            except shmq.Empty:
                break
            q.ack_many(msgs)  # applied, and confirmed although the journal cannot take it
            seen.update((m.offset, bytes(m.payload)) for m in msgs)
        assert {o: seen.get(o) for o in confirmed} == confirmed
        assert all(p == _payload(int(p[:8])) for p in seen.values())  # nothing invented

        # what every group settled is deleted, and the queue takes puts again by itself
        t0 = time.monotonic()
        wait_until(lambda: _try_put(q, b"after") is not None, timeout=RECOVERY_BOUND, interval=0.05)
        print(f"puts taken again {time.monotonic() - t0:.2f} s after the last ack")
        assert len(list((data / "q-d").glob("*.log"))) < segments
        assert srv.stop() == 0
        assert "1 durable queue kept" in srv.stdout_at_stop

        # a start on a completely full disk: it serves; the durable queue comes back
        filler = _fill(small_disk)
        srv2 = Server(workers=1, data_dir=str(data))
        try:
            assert "full" in srv2.stderr_so_far()  # one line says the data dir is full
            b2 = connect_tcp(srv2.url, srv2.token)
            assert {i.name for i in b2.list_queues()} == {"d"}
            q2 = b2.queue("d")
            got = [bytes(m.payload) for m in q2.get_many(10, timeout=5)]
            assert b"after" in got
            mem2 = b2.create_queue("mem")
            mem2.put(b"m")
            assert mem2.get(timeout=5).payload == b"m"
            _, full = _put_until_full(q2, start=10**7)  # (into what its active segment holds ahead)
            assert str(data / "q-d") in str(full)
            filler.unlink()
            t0 = time.monotonic()
            wait_until(lambda: _try_put(q2, b"room again") is not None, timeout=RECOVERY_BOUND,
                       interval=0.05)
            print(f"puts taken again {time.monotonic() - t0:.2f} s after room was made")
            b2.close()
        finally:
            assert srv2.stop() == 0
        b.close()
    finally:
        if srv.proc.poll() is None:
            srv.stop()


# ---------------------------------------------------------------- leases of what is gone
def _lease_all(q: Any, group: str, n: int) -> list[Any]:
    leased: list[Any] = []
    while len(leased) < n:
        leased += q.get_many(1000, group=group, timeout=5)
    return leased


@pytest.mark.parametrize("who", ["itself", "another connection"])
def test_leases_of_a_deleted_group_stop_counting_against_their_connection(server: Server, who: str) -> None:
    limit = options.MAX_INFLIGHT_PER_CONNECTION
    b = connect_tcp(server.url, server.token)
    other = connect_tcp(server.url, server.token)
    name = unique_instance()
    q = b.create_queue(name, capacity=2 * limit, max_bytes=32 * MB)
    for _ in range(limit // 1000):
        q.put_many([b"m"] * 1000)
    leased = _lease_all(q, "tmp", limit)
    with pytest.raises(shmq.LimitExceeded):  # the connection holds all it may
        q.get(group="other", block=False)
    (b if who == "itself" else other).queue(name).delete_group("tmp")
    with pytest.raises(shmq.StaleAck):
        leased[0].ack()
    m = q.get(group="other", timeout=5)  # room again: the deleted group's leases count no more
    assert (m.offset, m.payload) == (0, b"m")
    m.ack()
    assert len(_lease_all(q, "again", limit)) == limit  # ... every one of them
    b.delete_queue(name)
    b.close()
    other.close()


def test_leases_of_a_queue_deleted_elsewhere_stop_counting(server: Server) -> None:
    limit = options.MAX_INFLIGHT_PER_CONNECTION
    b = connect_tcp(server.url, server.token)
    other = connect_tcp(server.url, server.token)
    gone, kept = unique_instance(), unique_instance()
    q = b.create_queue(gone, capacity=2 * limit, max_bytes=32 * MB)
    for _ in range(limit // 1000):
        q.put_many([b"m"] * 1000)
    _lease_all(q, "default", limit)
    k = b.create_queue(kept)
    k.put(b"k")
    with pytest.raises(shmq.LimitExceeded):
        k.get(block=False)
    other.delete_queue(gone)
    assert k.get(timeout=5).payload == b"k"
    b.delete_queue(kept)
    b.close()
    other.close()


def test_a_colocated_consumer_of_a_deleted_group_holds_nothing_of_it(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("g", capacity=4096)
    q.put_many([b"%d" % i for i in range(1000)])
    leased = _lease_all(q, "tmp", 1000)
    assert q.stats()["groups"]["tmp"]["in_flight"] == 1000
    q.delete_group("tmp")
    with pytest.raises(shmq.StaleAck):
        leased[0].ack()
    q.create_group("tmp")  # made again: a new group, holding no lease of the old one
    assert q.stats()["groups"]["tmp"]["in_flight"] == 0
    again = _lease_all(q, "tmp", 1000)
    assert [m.payload for m in again] == [b"%d" % i for i in range(1000)]


# ---------------------------------------------------------------- reply queues
def test_request_clients_leave_no_memory_behind() -> None:
    """100 clients that connect, make one request and close: their reply queues go, and
    no broker process keeps one mapped (each kept about 4 MiB before)."""
    server = Server(workers=2)
    try:
        pids = broker_pids(server)
        b = connect_tcp(server.url, server.token)
        svc = unique_instance()
        b.create_queue(svc)
        stop = threading.Event()
        t = threading.Thread(target=_echo, args=(b.queue(svc), stop))
        t.start()
        try:
            for i in range(100):
                c = connect_tcp(server.url, server.token)
                assert c.request(svc, b"%d" % i, timeout=10).payload == b"re:%d" % i
                c.close()  # its reply queue goes with it
        finally:
            stop.set()
            t.join(10)
        b.delete_queue(svc)
        b.close()
        # every reply queue deleted, and no broker process maps one
        wait_until(lambda: not mapped_by(pids, server.instance) and not queue_ids(server.instance))
    finally:
        assert server.stop() == 0


def _echo(q: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            m = q.get(timeout=0.05)
        except shmq.Empty:
            continue
        m.reply(b"re:" + bytes(m.payload))
        m.ack()


# ---------------------------------------------------------------- descriptors
def test_running_out_of_descriptors_is_a_typed_error_and_a_log_line() -> None:
    """A broker under a descriptor limit of 200 that it cannot raise: it says so at start,
    refuses the connections past what the limit allows with LIMIT_EXCEEDED naming it, and
    keeps serving the others; queues cost no descriptor, so 300 made and deleted leave
    every process's count where it was."""
    srv = Server(workers=1, nofile=200)
    try:
        assert "descriptor limit is 200" in srv.stderr_so_far()
        first = connect_tcp(srv.url, srv.token)
        held = [first]
        with pytest.raises(shmq.LimitExceeded, match="ulimit -n 200") as refused:
            for _ in range(400):
                held.append(connect_tcp(srv.url, srv.token))
        assert 100 < len(held) <= 200 - options.FD_RESERVE
        assert refused.value.code == Status.LIMIT_EXCEEDED
        assert first.info().workers is not None  # the others are served
        q = first.create_queue("still")
        q.put(b"x")
        assert q.get(timeout=5).payload == b"x"
        for c in held[1:]:
            c.close()
        pids = broker_pids(srv)
        (still,) = queue_ids(srv.instance)
        before = {pid: fds(pid) for pid in pids}
        for i in range(300):
            first.create_queue(f"churn{i % 7}")
            first.delete_queue(f"churn{i % 7}")
        def qids() -> set[str]:
            return {parse_object_name(n.removesuffix(" (deleted)"))["qid"]  # type: ignore[index]
                    for names in mapped_by(pids, srv.instance).values() for n in names}

        wait_until(lambda: qids() <= {str(still)})  # every churned queue let go of
        after = {pid: fds(pid) for pid in pids}
        assert all(after[pid] <= before[pid] + 2 for pid in pids), (before, after)
        first.close()
        assert "refused a connection (LIMIT_EXCEEDED)" in srv.stderr_so_far()
    finally:
        assert srv.stop() == 0


def test_an_internal_error_is_logged_with_its_traceback(core: Core, caplog: pytest.LogCaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setitem(handlers.HANDLERS, T.LIST_QUEUES, broken)
    p = Peer(core)
    with caplog.at_level(logging.ERROR, logger="shmq.worker"):
        f = p.call(T.LIST_QUEUES)
    assert f.type == T.ERROR and f.status == Status.INTERNAL
    assert decode_body(T.ERROR, f.body)["message"] == "RuntimeError: a bug"
    (rec,) = [r for r in caplog.records if "LIST_QUEUES" in r.getMessage()]
    assert rec.exc_info is not None and "a bug" in caplog.text and "Traceback" in caplog.text
    assert not p.conn.closed  # the connection (and the worker) carry on


# ---------------------------------------------------------------- a full /dev/shm
_IN_NAMESPACE = textwrap.dedent("""
    import json, os, re, subprocess, sys, time
    import shmq
    from shmq import runtime
    out = {}

    def err(fn):
        try:
            fn()
            return None
        except shmq.ShmqError as e:
            return [type(e).__name__, str(e)]

    b = shmq.connect("shm://full", create=True)
    out["too big"] = err(lambda: b.create_queue("big", max_bytes=8 << 20))
    srv = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()",
                            "serve", "--port", "0",
                            "--workers", "1", "--instance", "srv", "--data-dir", sys.argv[1]],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        port = int(re.search(rb"tcp://[0-9.]+:(\\d+)", srv.stdout.readline()).group(1))
        t = shmq.connect(f"tcp://127.0.0.1:{port}", token=runtime.token_for("127.0.0.1", port))
        kept = t.create_queue("kept", max_bytes=64 << 10, capacity=64)
        with open("/dev/shm/filler", "wb", buffering=0) as f:  # the last byte of /dev/shm
            for size in (1 << 16, 4096, 1):
                try:
                    while True:
                        f.write(bytes(size))
                except OSError:
                    pass
        out["colocated, full"] = err(lambda: b.create_queue("small", max_bytes=64 << 10, capacity=64))
        out["new instance, full"] = err(lambda: shmq.connect("shm://other", create=True))
        out["tcp, full"] = err(lambda: t.create_queue("small", max_bytes=64 << 10, capacity=64))
        kept.put(b"k")
        out["kept serves"] = bytes(kept.get(timeout=5).payload).decode()
        t.close()
    finally:  # (the broker never outlives this script, whatever happens)
        srv.terminate()
        out["log"] = srv.communicate(timeout=30)[1].decode()
    os.unlink("/dev/shm/filler")
    b.destroy()
    print(json.dumps(out))
""")


def test_a_full_dev_shm_is_a_typed_error_naming_it() -> None:
    """In a mount namespace of its own, with a 4 MiB /dev/shm: a queue too big for what is
    left, then a /dev/shm full to the last byte, co-located and over TCP."""
    script = Path(session_tmp("ns-")) / "full_shm.py"
    script.write_text(_IN_NAMESPACE)
    data = session_tmp("ns-data-")
    repo = str(ROOT)
    path = os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        "mount --make-rprivate / && mount -t tmpfs -o size=4m tmpfs /dev/shm && "
                        f"exec {sys.executable} {script} {data}"],
                       capture_output=True, text=True, timeout=120, cwd=repo,
                       env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for case in ("too big", "colocated, full", "new instance, full", "tcp, full"):
        kind, text = out[case]
        assert kind == "LimitExceeded" and "/dev/shm is full" in text, (case, text)
        assert "MiB free of 4.0 MiB" in text, (case, text)
    assert out["kept serves"] == "k"
    assert "/dev/shm is full" in out["log"]  # the broker's log line
