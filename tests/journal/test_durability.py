"""Durability: real kill -9 of the whole broker, real files, recovery, loss windows.

The Jepsen-style check: producers send uniquely numbered messages while the
broker is SIGKILLed at random moments and restarted (optionally with its shared
memory removed, as a reboot would); then everything is drained and compared
with what was confirmed.  *lost* (confirmed, never delivered) must be empty --
for ``interval`` only messages confirmed within the sync window before a kill
may be missing -- *unexpected* (delivered, never sent) must be empty, and
duplicates are counted and reported, not forbidden (at-least-once).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.journal import Journal, queue_dir
from tests.support.instances import leftovers, remove_shm, unique_instance
from tests.support.server import Server, kill_broker
from tests.support.wait import wait_until

SYNC = 0.2  # --sync-interval of the `interval` runs (s)


class Producer(threading.Thread):
    """Sends 0, 1, 2, ... through whatever broker is up, reconnecting after kills; keeps
    the confirmation time of every message it was told was stored.  With ``window``, one
    message per call through a Publisher (confirmations collected later, in order)."""

    def __init__(self, url: list[str], queue: str, batch: int = 1, window: int = 0) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.queue = queue
        self.batch = batch
        self.window = window
        self.confirmed: dict[int, float] = {}
        self.sent = 0  # the next number to send: everything below it is confirmed
        self.top = 0  # one past the highest number ever sent
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.dropped: list[str] = []  # why each connection was given up (the last few)

    def confirm_more(self, n: int = 50) -> None:
        """Wait until ``n`` more messages are confirmed."""
        target = len(self.confirmed) + n
        try:
            wait_until(lambda: len(self.confirmed) >= target or not self.is_alive(), timeout=30)
        except AssertionError:
            raise AssertionError(f"no progress: {len(self.confirmed)} confirmed; the last drops "
                                 f"{self.dropped[-5:]}; now in\n{_stack(self)}") from None
        assert len(self.confirmed) >= target, f"the producer stopped: {self.errors}"

    def finish(self) -> None:
        self.stop.set()
        self.join(30)

    def run(self) -> None:
        b: Any = None
        while not self.stop.is_set():
            try:
                if b is None:
                    b = shmq.connect(self.url[0], connect_timeout=1)
                    q = b.queue(self.queue)
                if self.window:
                    self._publish(q)
                    continue
                nums = list(range(self.sent, self.sent + self.batch))
                self.top = max(self.top, nums[-1] + 1)
                q.put_many([str(i).encode() for i in nums], timeout=5)
                now = time.monotonic()
                for i in nums:
                    self.confirmed[i] = now
                self.sent += self.batch
            except (shmq.ConnectionLost, OSError, shmq.QueueNotFound, shmq.Full, shmq.Timeout) as e:
                # not confirmed: resent under the same numbers (a duplicate if it was stored)
                self.dropped = [*self.dropped[-4:], repr(e)]
                _dropped(b)
                b = None
            except Exception as e:  # noqa: BLE001  (reported by confirm_more and the test)
                self.errors.append(repr(e))
                break
        if b is not None:
            b.close()

    def _publish(self, q: Any) -> None:
        """Put ``batch`` numbers per call (``put``, or ``put_many`` for more than one) until
        stopped or an error; what was not confirmed when it stops is sent again under the
        same numbers (the first error stops the confirmed prefix)."""
        p = q.publisher(window=self.window, timeout=5)
        base = self.sent
        try:
            while not self.stop.is_set():
                first = base + p.sent
                self.top = max(self.top, first + self.batch)
                if self.batch == 1:
                    p.put(str(first).encode())
                else:
                    p.put_many([str(i).encode() for i in range(first, first + self.batch)])
                self._confirmed_upto(base + p.confirmed)
            p.flush()
        finally:
            self._confirmed_upto(base + p.confirmed)

    def _confirmed_upto(self, end: int) -> None:
        now = time.monotonic()
        for i in range(self.sent, end):
            self.confirmed[i] = now
        self.sent = max(self.sent, end)


def _stack(t: threading.Thread) -> str:
    """Where thread ``t`` is now (for a failure's message)."""
    import sys
    import traceback
    frame = sys._current_frames().get(t.ident or 0)
    return "".join(traceback.format_stack(frame)) if frame else "(not running)"


def _dropped(b: Any) -> None:
    """A connection lost to a kill: closed (quietly), and a back-off while the broker
    restarts (not a synchronisation); the caller connects again."""
    if b is not None:
        try:
            b.close()
        except Exception:  # noqa: BLE001
            pass
    time.sleep(0.02)


class Consumer(threading.Thread):
    """Gets and acks (the default group) while the broker is killed, over TCP, reconnecting
    as the producer does: ``acked``, offset -> (number, when) of each message whose ack
    returned; ``in_flight``, the numbers of an ack begun when the connection was lost (it
    may or may not have taken effect).  (By offset: a producer that resends what was not
    confirmed may store a number twice.)"""

    def __init__(self, url: list[str], queue: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.queue = queue
        self.acked: dict[int, tuple[int, float]] = {}
        self.in_flight: set[int] = set()
        self.stop = threading.Event()
        self.errors: list[str] = []

    def finish(self) -> None:
        self.stop.set()
        self.join(30)

    def run(self) -> None:
        b: Any = None
        begun: list[int] = []
        while not self.stop.is_set():
            try:
                if b is None:
                    b = shmq.connect(self.url[0], connect_timeout=1)
                    q = b.queue(self.queue)
                try:
                    msgs = q.get_many(10, timeout=0.2)
                except shmq.Empty:
                    continue
                begun = [int(m.payload) for m in msgs]
                q.ack_many(msgs)
                now = time.monotonic()
                self.acked.update((m.offset, (n, now)) for m, n in zip(msgs, begun, strict=True))
                begun = []
            except (shmq.ConnectionLost, OSError, shmq.QueueNotFound, shmq.Timeout):
                self.in_flight.update(begun)  # the kill came during this ack: its fate is open
                begun = []
                _dropped(b)
                b = None
            except Exception as e:  # noqa: BLE001  (reported by the test)
                self.errors.append(repr(e))
                break
        if b is not None:
            b.close()


def drain(url: str, queue: str, group: str = "default") -> list[int]:
    return [n for n, _ in drain_offsets(url, queue, group)]


def drain_offsets(url: str, queue: str, group: str = "default") -> list[tuple[int, int]]:
    """Everything ``group`` still has, acked: (number, offset) each."""
    with shmq.connect(url) as b:
        q = b.queue(queue)
        out: list[tuple[int, int]] = []
        while True:
            try:
                msgs = q.get_many(1000, group=group, timeout=0.5)
            except shmq.Empty:
                return out
            out.extend((int(m.payload), m.offset) for m in msgs)
            q.ack_many(msgs)


def jepsen(tmp_path: Path, policy: str, lose_shm: bool, kills: int = 3, batch: int = 1,
           window: int = 0) -> dict[str, Any]:
    data = str(tmp_path / "data")
    inst = unique_instance()
    extra = ["--sync-interval", str(SYNC)]
    srv = Server(workers=1, instance=inst, data_dir=data, extra=extra)
    url = [srv.url]
    with shmq.connect(srv.url) as b:
        q = b.create_queue("jep", durability=policy, capacity=100_000, max_bytes=32 << 20)
        q.create_group("kept")  # nobody reads it until the end: every confirmed message must be there
    if policy != "memory":  # the group on disk before the first kill (interval: within a sync)
        local = ShmBroker(inst)
        w = local.queue("jep").words  # type: ignore[attr-defined]
        seq = w[L.Q_SETTLE_SEQ]
        wait_until(lambda: w[L.Q_DURABLE_SETTLE] >= seq, timeout=10)
        local.close()
    prod = Producer(url, "jep", batch, window)
    prod.start()
    cons = Consumer(url, "jep")  # acking (the default group) while the kills happen
    cons.start()
    kill_times = []
    logs: list[str] = []  # what each broker wrote to stderr
    rng = random.Random(policy + str(lose_shm))
    try:
        for _ in range(kills):
            prod.confirm_more()
            assert not cons.errors, f"the consumer stopped: {cons.errors}"
            time.sleep(rng.uniform(0.0, 0.15))  # a random moment to kill at (not a synchronisation)
            logs.append(srv.stderr_so_far())
            start = time.monotonic()
            kill_broker(srv)
            kill_times.append((start, time.monotonic()))
            if lose_shm:
                remove_shm(inst)
            srv = Server(workers=1, instance=inst, data_dir=data, extra=extra)
            url[0] = srv.url
        prod.confirm_more()
    except BaseException as e:
        if srv.proc.stderr and not srv.proc.stderr.closed:
            logs.append(srv.stderr_so_far())
        srv.stop()  # a failure leaves no broker behind
        e.add_note(f"the brokers' stderr: {logs}")
        raise
    finally:
        prod.finish()
        cons.finish()
    assert not prod.errors and not cons.errors, (prod.errors, cons.errors)
    logs.append(srv.stderr_so_far())
    assert not [log for log in logs if "Traceback" in log], logs  # a kill is no internal error
    kept = drain(srv.url, "jep", "kept")
    rest = drain_offsets(srv.url, "jep")
    assert srv.stop() == 0
    confirmed = set(prod.confirmed)
    acked = {n for n, _ in cons.acked.values()}
    # every confirmed message's fate, per group: in "kept", drained at the end; in the
    # default group, acked by an ack that returned, in the ack in flight at a kill, or drained
    # (a delivery alone is none: a killed connection's leases come back)
    lost = (confirmed - set(kept)) | (confirmed - acked - cons.in_flight - {n for n, _ in rest})
    unexpected = (set(kept) | acked | {n for n, _ in rest}) - set(range(prod.top))
    return {"lost": lost, "unexpected": unexpected, "dupes": len(kept) - len(set(kept)),
            "confirmed": prod.confirmed, "kills": kill_times, "delivered": len(kept),
            "acked": {n: t for n, t in cons.acked.values()},
            # a message acked, then delivered again (the same message at the same offset): its ack
            # was lost.  (An `interval` queue killed twice in a row, the second time before its
            # journal took any new message, gives the offsets of the lost messages out again, to
            # other messages: those are not acked messages coming back.)
            "acked_again": {n for n, o in rest if cons.acked.get(o, (None,))[0] == n}}


@pytest.mark.slow
@pytest.mark.parametrize("policy,lose_shm", [("always", False), ("always", True), ("interval", False),
                                             ("interval", True), ("memory", False)])
def test_kill9_the_whole_broker_while_producing(tmp_path: Path, policy: str, lose_shm: bool) -> None:
    r = jepsen(tmp_path, policy, lose_shm)
    print(f"{policy} lose_shm={lose_shm}: confirmed {len(r['confirmed'])}, delivered {r['delivered']}, "
          f"lost {len(r['lost'])}, duplicates {r['dupes']}")
    assert not r["unexpected"], sorted(r["unexpected"])[:20]
    assert len(r["confirmed"]) > 200 and len(r["acked"]) > 50
    if policy == "interval" and lose_shm:
        # only what was confirmed (or acked) within the sync window before a kill may be gone
        # (or come back)
        window = SYNC + 0.5  # the window, plus one round's write and fsync on a loaded machine

        def inside(t: float) -> bool:
            return any(k0 - window <= t <= k1 for k0, k1 in r["kills"])

        outside = [i for i in r["lost"] if not inside(r["confirmed"][i])]
        assert not outside, sorted(outside)[:20]
        again = [i for i in r["acked_again"] if not inside(r["acked"][i])]
        assert not again, sorted(again)[:20]
    else:
        assert not r["lost"], sorted(r["lost"])[:20]
        assert not r["acked_again"], sorted(r["acked_again"])[:20]  # an acknowledged message stays so


@pytest.mark.slow
def test_kill9_with_batches_and_lost_shared_memory(tmp_path: Path) -> None:
    r = jepsen(tmp_path, "always", True, kills=2, batch=50)
    assert not r["unexpected"] and not r["lost"] and not r["acked_again"]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 8])
def test_kill9_with_publisher_confirms_and_lost_shared_memory(tmp_path: Path, batch: int) -> None:
    """Pipelined puts (a Publisher, 32 messages unconfirmed at a time; one per put, or batches
    of 8 with put_many): still nothing confirmed is lost."""
    r = jepsen(tmp_path, "always", True, kills=2, batch=batch, window=32)
    print(f"publisher (batch {batch}): confirmed {len(r['confirmed'])}, delivered {r['delivered']}, "
          f"duplicates {r['dupes']}")
    assert len(r["confirmed"]) > 200
    assert not r["unexpected"] and not r["lost"], (sorted(r["unexpected"])[:20], sorted(r["lost"])[:20])
    assert not r["acked_again"], sorted(r["acked_again"])[:20]


# ---------------------------------------------------------------- one broker, restarts


def test_recovery_keeps_offsets_groups_acks_and_never_reuses_an_offset(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("keep", durability="always")
        q.put_many([f"m{i}".encode() for i in range(10)])
        q.create_group("audit")
        a = q.get_many(3, timeout=1)
        q.ack_many(a)  # 0..2 acknowledged by the default group
        leased = q.get(timeout=1)  # 3 leased, never settled
        q.commit("audit", 5)  # the audit group is past 0..4
        q.put_many([b"x"], producer="p", seq=7)
        assert leased.offset == 3
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("keep")
        assert sorted(q.groups()) == ["audit", "default"]
        again = q.get_many(100, timeout=1)
        assert [m.offset for m in again] == list(range(3, 11))  # acked ones do not come back
        assert again[0].deliveries == 2  # the lease was given back, its delivery counted
        assert [m.offset for m in q.get_many(100, group="audit", timeout=1)] == list(range(5, 11))
        with pytest.raises(shmq.Duplicate):  # the idempotent producer's memory survived
            q.put_many([b"x"], producer="p", seq=7)
        assert q.put(b"new") == 11  # offsets continue, never reused


def test_interval_skips_the_offsets_it_may_have_lost(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("iv", durability="interval", capacity=64)
        q.put_many([b"a", b"b"])
        wait_until(lambda: q.stats()["durable_offset"] >= 2, timeout=5)
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("iv")
        assert [m.payload for m in q.get_many(10, timeout=1)] == [b"a", b"b"]
        assert q.put(b"c") >= 2 + 64  # past anything the lost window could have handed out
        assert q.get(timeout=1).payload == b"c"


def test_colocated_always_producer_returns_once_journaled(durable: Any) -> None:
    b = shmq.connect(f"shm://{durable.inst}")
    try:
        q = b.create_queue("co", durability="always")
        for i in range(20):
            off = q.put(f"{i}".encode())
            assert q.words[L.Q_DURABLE_OFFSET] > off  # type: ignore[attr-defined]
        assert q.put_many([b"x", b"y"]) == [20, 21]
        assert q.words[L.Q_DURABLE_OFFSET] >= 22  # type: ignore[attr-defined]
    finally:
        b.close()
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as tb:
        assert len(tb.queue("co").get_many(100, timeout=1)) == 22


def test_torn_tail_and_bit_flip_are_cut_and_the_broker_starts(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("torn", durability="always")
        for i in range(5):
            q.put(f"{i}".encode())
    durable.crash(reboot=True)
    seg = sorted(queue_dir(durable.data, "torn").glob("*.log"))[-1]
    raw = bytearray(seg.read_bytes())
    end = len(raw.rstrip(b"\0"))  # the last record (a snapshot, ending in "}"); preallocated zeros after it
    raw[end - 3:end] = bytes(3)  # a torn last record: its last bytes never reached the disk
    seg.write_bytes(bytes(raw))
    log = durable.start()
    with shmq.connect(durable.srv.url) as b:
        got = [m.payload for m in b.queue("torn").get_many(10, timeout=1)]
        assert got and got == [f"{i}".encode() for i in range(len(got))]
    assert "torn tail" in log  # (not just the queue's name)
    durable.crash(reboot=True)
    seg = sorted(queue_dir(durable.data, "torn").glob("*.log"))[0]
    raw = bytearray(seg.read_bytes())
    raw[len(raw.rstrip(b"\0")) // 2] ^= 0xFF  # a bit flip in the middle of the records
    seg.write_bytes(bytes(raw))
    log = durable.start()
    assert "corrupt" in log.lower() or "quarantin" in log.lower()
    with shmq.connect(durable.srv.url) as b:
        b.queue("torn").put(b"still works")  # the broker started and serves


def test_segments_roll_and_are_removed_once_every_group_passed(tmp_path: Path) -> None:
    data = str(tmp_path / "data")
    srv = Server(workers=1, data_dir=data, extra=["--journal-segment-bytes", "4096"])
    try:
        with shmq.connect(srv.url) as b:
            q = b.create_queue("roll", durability="always")
            for _ in range(10):
                q.put_many([b"x" * 100] * 20)
            segs = lambda: sorted(queue_dir(data, "roll").glob("*.log"))  # noqa: E731
            assert len(segs()) >= 4
            while True:
                try:
                    q.ack_many(q.get_many(1000, timeout=0.2))
                except shmq.Empty:
                    break
            q.put(b"tail")  # a round after the acks
            wait_until(lambda: len(segs()) <= 2, timeout=5)
    finally:
        assert srv.stop() == 0


def test_deleted_queue_does_not_come_back(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        b.create_queue("gone", durability="always").put(b"x")
        b.delete_queue("gone")
        b.create_queue("gone", durability="always").put(b"y")
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        assert [m.payload for m in b.queue("gone").get_many(10, timeout=1)] == [b"y"]


def test_graceful_stop_and_start_keeps_journaled_queues(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        b.create_queue("stay", durability="interval").put_many([b"1", b"2"])
        b.create_queue("mem").put(b"m")
    assert durable.srv.stop() == 0
    assert not leftovers(durable.inst)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        assert [m.payload for m in b.queue("stay").get_many(10, timeout=1)] == [b"1", b"2"]
        with pytest.raises(shmq.QueueNotFound):  # memory-only queues end with the broker
            b.queue("mem")


def test_unwritable_data_dir_is_a_clear_error_at_start(tmp_path: Path) -> None:
    f = tmp_path / "a-file"
    f.write_text("")
    with pytest.raises(RuntimeError, match="not usable"):
        Server(workers=1, data_dir=str(f / "data"))


def test_data_dir_is_made_by_the_first_durable_queue_only(tmp_path: Path) -> None:
    data = tmp_path / "not-yet" / "data"
    srv = Server(workers=1, data_dir=str(data))
    try:
        with shmq.connect(srv.url, token=srv.token) as b:
            b.create_queue("mem").put(b"x")
            assert not data.parent.exists()  # memory-only queues write nothing to disk
            b.create_queue("disk", durability="interval").put(b"y")
            assert (data / "q-disk").is_dir()
    finally:
        assert srv.stop() == 0
    assert data.is_dir()  # the journaled queue's files stay for the next start


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_full_disk_refuses_produce_keeps_consumers_and_recovers(tmp_path: Path) -> None:
    data = tmp_path / "small"
    assert _mount_tmpfs(data, "256k"), "cannot mount a tmpfs here"
    srv = None
    try:
        srv = Server(workers=1, data_dir=str(data))
        with shmq.connect(srv.url) as b:
            q = b.create_queue("fill", durability="always", max_bytes=4 << 20)
            stored = 0
            with pytest.raises(shmq.StorageError, match="ENOSPC|No space"):
                for _ in range(1000):
                    q.put_many([b"z" * 1000] * 10)
                    stored += 10
            with pytest.raises(shmq.StorageError):
                q.put(b"refused while the disk is full")
            got = q.get_many(stored, timeout=1)  # consumers are still served
            assert len(got) >= stored
            assert {m.payload for m in got} == {b"z" * 1000}
            subprocess.run(["mount", "-o", "remount,size=8m", str(data)], check=True)
            wait_until(lambda: _accepts(q), timeout=10)
    finally:
        if srv is not None:
            assert srv.stop() == 0
        subprocess.run(["umount", "-l", str(data)], check=False)


def _accepts(q: Any) -> bool:
    try:
        q.put(b"room again")
        return True
    except shmq.StorageError:
        return False


def test_journal_files_are_private(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        b.create_queue("priv", durability="always").put(b"x")
    d = queue_dir(durable.data, "priv")
    assert d.stat().st_mode & 0o777 == 0o700
    for f in d.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600, f
    with pytest.raises(shmq.ShmqError, match="in use"):  # the live writer holds the journal
        Journal(durable.data, "priv", create=False).recover()


def test_kill9_of_the_journal_process_alone(durable: Any) -> None:
    """The supervisor restarts it; `always` producers wait meanwhile and lose nothing."""
    with shmq.connect(durable.srv.url) as b:
        b.create_queue("jk", durability="always")
    prod = Producer([durable.srv.url], "jk")
    prod.start()
    try:
        for _ in range(2):
            prod.confirm_more()
            old = durable.srv.journal_pid
            os.kill(old, signal.SIGKILL)
            wait_until(lambda o=old: _journal_pid(durable.srv) not in (0, o), timeout=10)  # type: ignore[misc]
            durable.srv.journal_pid = _journal_pid(durable.srv)
        prod.confirm_more()
    finally:
        prod.finish()
    assert not prod.errors, prod.errors
    durable.crash(reboot=True)  # and what was confirmed is on disk
    durable.start()
    got = set(drain(durable.srv.url, "jk"))
    assert set(prod.confirmed) <= got
    assert got <= set(range(prod.sent + 1))


def _journal_pid(srv: Server) -> int:
    """The live journal writer's pid, as it announced itself in the registry (0: none)."""
    from shmq.core.colocated import ShmBroker
    b = ShmBroker(srv.instance)
    try:
        reg = b._att.registry
        return reg.w[L.R_JOURNAL_PID] if reg.journal() is not None else 0
    finally:
        b.close()


def test_recovery_keeps_a_delayed_message_due_time(durable: Any) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("later", durability="always")
        q.put(b"d", delay=600)
        q.put(b"now")
        m = q.get(timeout=1)  # the cursor passes the delayed one: its word is in the group snapshot
        q.put_many([b"e"], delay=300)  # past the cursor at the kill
        m.ack()
    durable.crash(reboot=True)  # monotonic time is not kept: the journal has it as wall-clock time
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("later")
        with pytest.raises(shmq.Empty):
            q.get(block=False)
        assert q.stats()["groups"]["default"]["delayed"] == 2
    local = shmq.core.colocated.ShmBroker(durable.inst)
    try:
        seg = local.queue("later")
        ring = seg.ring  # type: ignore[attr-defined]
        now = seg._now()  # type: ignore[attr-defined]
        dues = [ring.w[ring.slot_base(o) + L.S_GROUPS] >> L.TIME_SHIFT for o in (0, 2)]
        assert now + 590_000 < dues[0] <= now + 600_000  # the same due time, on this boot's clock
        assert now + 290_000 < dues[1] <= now + 300_000
    finally:
        local.close()


@pytest.mark.parametrize("reboot", [False, True], ids=["kill9", "kill9-and-lost-shm"])
def test_a_nack_with_a_delay_keeps_its_due_time_through_recovery(durable: Any, reboot: bool) -> None:
    """``nack(delay=600)`` on an ``always`` queue, then kill -9 (and, as a reboot does, the
    loss of the shared memory): the message comes back when its delay ends, counting the
    delivery it had, and not before."""
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("back", durability="always")
        q.put(b"n")
        q.put(b"other")
        q.get(timeout=1).nack(delay=600)
    durable.crash(reboot=reboot)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("back")
        m = q.get(timeout=1)
        assert m.payload == b"other"  # the nacked one is not due
        m.ack()
        with pytest.raises(shmq.Empty):
            q.get(block=False)
        assert q.stats()["groups"]["default"]["ready"] + q.stats()["groups"]["default"]["delayed"] == 1
    local = shmq.core.colocated.ShmBroker(durable.inst)
    try:
        seg = local.queue("back")
        ring = seg.ring  # type: ignore[attr-defined]
        now = seg._now()  # type: ignore[attr-defined]
        word = ring.w[ring.slot_base(0) + L.S_GROUPS]
        assert word & L.STATE_MASK == L.READY and (word >> L.DC_SHIFT) & L.DC_MASK == 1
        assert now + 590_000 < word >> L.TIME_SHIFT <= now + 600_000  # its due time, on this boot's clock
    finally:
        local.close()
