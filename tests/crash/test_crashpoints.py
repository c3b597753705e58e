"""Every crash point, enumerated: a victim process runs a mixed workload with the point
armed and is SIGKILLed there by itself; then the survivors must carry on at once, every
message the victim saw confirmed must be acknowledged, deliverable or in the dead-letter
queue, the whole capacity must be usable again, and ``shmq doctor --check`` must be clean.
Each point runs twice: with a reaper first and with a delivery first (order matters)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq import crashpoints
from shmq.core import layout as L
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerQueue
from shmq.errors import Empty
from tests.support.connect import connect_shm

pytestmark = pytest.mark.crash

CTX = mp.get_context("fork")
SERVER_POINTS = {n for n in crashpoints.POINTS if n.startswith(("worker.", "journal.", "recovery."))}
CORE_POINTS = [n for n in crashpoints.POINTS if n not in SERVER_POINTS]
CAP = 64
GROUPS = ("default", "g2")


class Log:
    """The victim's own account, line-buffered: A (attempted) before a put, C (confirmed)
    with its offset after it returns; T (trying to settle: ack, commit) before an ack or a
    commit and K (acknowledged) or M (committed below an offset) after it returns.  Only
    the last T can be in flight when the victim dies: its messages may or may not be
    settled, every other confirmed message must be deliverable or dead-lettered."""

    def __init__(self, path: Path) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - the victim dies holding it
        self.n = 0

    def ids(self, k: int) -> list[str]:
        out = [f"v{self.n + i}" for i in range(k)]
        self.n += k
        for i in out:
            self.f.write(f"A {i}\n")
        return out

    def confirmed(self, queue: str, ids: list[str], offsets: list[int]) -> None:
        for i, o in zip(ids, offsets, strict=True):
            self.f.write(f"C {queue} {i} {o}\n")

    def trying(self, msgs: list[shmq.Message]) -> None:
        self.f.write("T " + " ".join(f"{m.group}:{m.payload.decode().split('|')[0]}" for m in msgs) + "\n")

    def acked(self, msgs: list[shmq.Message]) -> None:
        for m in msgs:
            self.f.write(f"K {m.group} {m.payload.decode().split('|')[0]}\n")


def _payloads(ids: list[str]) -> list[bytes]:
    return [f"{i}|{i}".encode() for i in ids]


def _put(log: Log, q: shmq.Queue, k: int, **kw: object) -> None:
    ids = log.ids(k)
    if k == 1 and not kw:
        offsets = [q.put(_payloads(ids)[0])]
    else:
        try:
            offsets = q.put_many(_payloads(ids), **kw)  # type: ignore[arg-type]
        except shmq.Duplicate:
            return
    log.confirmed(q.name, ids, offsets)


def _take(q: shmq.Queue, n: int, **kw: object) -> list[shmq.Message]:
    try:
        return q.get_many(n, block=False, **kw)  # type: ignore[arg-type]
    except shmq.Empty:
        return []


def _lease_and_vanish(url: str) -> None:
    """A consumer that takes leases and dies without giving them back (no atexit)."""
    crashpoints.disarm()  # the victim's point is the victim's
    shmq.connect(url).queue("q").get_many(2, group="g2", block=False)
    os._exit(0)


def _workload(url: str, log_path: str, point: str) -> None:
    """Pass every core crash point, a few times over, with the armed one killing us."""
    crashpoints.arm(point)
    log = Log(Path(log_path))

    def ack(q: shmq.Queue, msgs: list[shmq.Message]) -> None:
        if msgs:
            log.trying(msgs)
            q.ack_many(msgs) if len(msgs) > 1 else msgs[0].ack()
            log.acked(msgs)

    for r in range(3):
        b = connect_shm(url)
        q, o, e, t = b.queue("q"), b.queue("o"), b.queue("e"), b.queue("t")
        _put(log, q, 1)
        _put(log, q, 4)
        _put(log, q, 2, producer="p", seq=r + 1)
        _put(log, o, 2)
        ack(q, [q.get(block=False)])  # registers the slot
        ack(q, [q.get(block=False)])  # the hot path
        _put(log, q, 6)
        sq = ServerQueue(q)
        block = sq.take_block("default", 3)  # the server's batch path, acked as the server does
        if block:
            first, _stamps, lens, data = block
            ref = sq.group_ref("default")
            msgs, pos = [], 0
            for i, n in enumerate(lens):
                msgs.append(tuple.__new__(shmq.Message, (q, ref, "default", first + i, 1,
                                                         data[pos:pos + n], b"", 0)))
                pos += n
            log.trying(msgs)
            assert not sq.ack_offsets(ref, [m.offset for m in msgs], [1] * len(msgs))[0]
            log.acked(msgs)
        ms = _take(q, 4)  # the general path
        ack(q, ms[:2])  # a run
        if len(ms) == 4:
            ack(q, [ms[0 + 2]])
            ms[3].nack()  # READY, then redelivered, then past max_deliveries (2) to the DLQ
            for m in _take(q, 8):
                if m.deliveries > 1:
                    m.nack()
                else:
                    m.touch(30.0)
                    ack(q, [m])
        for m in _take(q, 2):
            m.dead_letter()
        _put(log, q, 3)
        short = _take(q, 3, visibility_timeout=0.001)
        _put(log, t, 2)  # a TTL of 1 ms: these expire, new and delayed, to t.dlq
        _put(log, t, 1, delay=0.001)
        time.sleep(0.005)  # the workload: let those leases and TTLs expire
        _take(t, 4)
        again = _take(q, 8)
        ack(q, [again[i] for i in range(0, len(again), 2)])  # not a run: the batch path
        ack(q, [again[i] for i in range(1, len(again), 2)])
        del short
        # group g2: a batch given back (a server's closed connection), a commit, a group made and dropped
        g2 = _take(q, 3, group="g2")
        sq.give_back(sq.group_ref("g2"), [m.offset for m in g2], [m.deliveries for m in g2])
        below = q.offsets()[0] + 2
        log.f.write(f"T commit g2 {below}\n")
        q.commit("g2", below)
        log.f.write(f"M g2 {below}\n")
        g2 = _take(q, 4, group="g2")
        ack(q, g2[:2])
        q.seek("g2", 0)  # back to the oldest retained message: delivered again (g2[2:]'s leases stale)
        ack(q, _take(q, 4, group="g2"))
        q.create_group(f"x{r}")
        q.delete_group(f"x{r}")
        # a dead-letter copy that finds its DLQ full is orphaned, and retried by the reaper
        for m in _take(o, 1):
            m.dead_letter()
        # a dead consumer's leases, given back by our reaper
        p = CTX.Process(target=_lease_and_vanish, args=(url,))
        p.start()
        p.join()
        b.reap()
        try:
            e.get(timeout=0.06)  # sleeps: announced as a waiter
        except shmq.Empty:
            pass
        b.create_queue(f"tmp{r}")
        b.delete_queue(f"tmp{r}")
        b.close()  # frees the client slot
    os._exit(3)  # never reached the point: the test fails


class Account:
    """What the victim's log says: attempted ids, confirmed ids with queue and offset,
    settled ids per group, each group's committed offset, and what was in flight."""

    def __init__(self, log_path: Path) -> None:
        self.attempted: set[str] = set()
        self.confirmed: dict[str, dict[str, int]] = defaultdict(dict)  # queue -> id -> offset
        self.acked: dict[str, set[str]] = defaultdict(set)  # group -> ids
        self.committed: dict[str, int] = defaultdict(int)  # group -> offset (queue q)
        last_try: list[str] = []
        for line in log_path.read_text().splitlines():
            parts = line.split()  # (the last line may be cut short by the kill)
            if len(parts) >= 2 and parts[0] == "A":
                self.attempted.add(parts[1])
            elif len(parts) == 4 and parts[0] == "C":
                self.confirmed[parts[1]][parts[2]] = int(parts[3])
            elif len(parts) == 3 and parts[0] == "K":
                self.acked[parts[1]].add(parts[2])
            elif len(parts) == 3 and parts[0] == "M":
                self.committed[parts[1]] = max(self.committed[parts[1]], int(parts[2]))
            if parts and parts[0] == "T":
                last_try = parts[1:]
        # the settle in flight at the kill may have taken effect
        if last_try[:1] == ["commit"] and len(last_try) == 3:
            self.committed[last_try[1]] = max(self.committed[last_try[1]], int(last_try[2]))
        elif last_try and last_try[0] != "commit":
            for item in last_try:
                g, _, ident = item.partition(":")
                self.acked[g].add(ident)


def _drain(b: ShmBroker) -> tuple[dict[tuple[str, str], set[str]], dict[tuple[str, str], set[str]]]:
    """Everything deliverable, per (queue, group), acked; and the ids in the DLQs, per the
    (queue, group) their origin names.  Rounds until nothing moves: the reaper retries
    orphaned dead-letter copies once the drain makes room in their DLQ."""
    got: dict[tuple[str, str], set[str]] = defaultdict(set)
    dead: dict[tuple[str, str], set[str]] = defaultdict(set)
    for _ in range(20):
        b.reap()
        moved = 0
        for name in ("q", "o", "t", "q.dlq", "o.dlq", "t.dlq"):
            try:
                q = b.queue(name)
            except shmq.QueueNotFound:
                continue
            for g in q.groups():  # a group the victim made before dying holds messages too
                while True:
                    try:
                        ms = q.get_many(100, group=g, block=False)
                    except shmq.Empty:
                        break
                    for m in ms:
                        ident, copy = m.payload.decode().split("|")
                        assert ident == copy, f"corrupted payload {m.payload!r}"
                        if name.endswith(".dlq"):
                            if ident != "filler":
                                assert m.origin is not None, f"{name}: {ident} has no origin"
                                dead[(m.origin.queue, m.origin.group)].add(ident)
                        else:
                            got[(name, g)].add(ident)
                    q.ack_many(ms)
                    moved += len(ms)
        if not moved and all(i["retained"] == 0 for i in map(lambda n: b.queue(n).stats(), ("q", "o", "t"))):
            break
    return got, dead


def _setup(b: ShmBroker) -> None:
    b.create_queue("q", capacity=CAP, max_bytes=64 * 1024, max_deliveries=2, visibility_timeout=30)
    b.queue("q").create_group("g2")
    b.create_queue("o", capacity=CAP, max_bytes=64 * 1024, visibility_timeout=30)
    b.create_queue("o.dlq", dead_letter=True, capacity=1, max_bytes=4096)  # full: copies into it are orphaned
    b.queue("o.dlq").put(b"filler|filler")
    b.create_queue("e")
    b.create_queue("t", capacity=CAP, max_bytes=64 * 1024, message_ttl=0.001)


@pytest.mark.parametrize("reap_first", [True, False], ids=["reap-first", "deliver-first"])
@pytest.mark.parametrize("point", CORE_POINTS)
def test_crash_point_recovers(instance: str, tmp_path: Path, point: str, reap_first: bool) -> None:
    b = ShmBroker(instance)
    _setup(b)
    log_path = tmp_path / "victim.log"
    p = CTX.Process(target=_workload, args=(b.url, str(log_path), point))
    p.start()
    p.join(30)
    assert p.exitcode == -signal.SIGKILL, f"the victim did not die at {point}: exit code {p.exitcode}"

    t0 = time.monotonic()
    q = b.queue("q")
    if reap_first:
        b.reap()
    # survivors carry on at once: a put and a get on every queue, no deadlock
    for name in ("q", "o", "e"):
        b.queue(name).put(b"after|after")
    assert time.monotonic() - t0 < 1.0, "a survivor waited on the dead process"
    violations = check_instance(instance)
    assert violations == [], violations

    got, dead = _drain(b)
    acc = Account(log_path)
    for name, groups in (("q", GROUPS), ("o", ("default",)), ("t", ("default",))):
        for g in groups:
            settled = acc.acked[g] | got[(name, g)] | dead[(name, g)]  # (a DLQ's: from this group only)
            if name == "q":
                settled |= {i for i, off in acc.confirmed[name].items() if off < acc.committed[g]}
            lost = set(acc.confirmed[name]) - settled
            assert not lost, f"{name}/{g}: confirmed and lost: {sorted(lost)}"
            unexpected = got[(name, g)] - acc.attempted - {"after"}
            assert not unexpected, f"{name}/{g}: never produced: {sorted(unexpected)}"
        assert "after" in got[(name, "default")] or name == "t"  # (t has no "after")
    # the whole capacity is usable again
    for name in ("q", "o"):
        qq = b.queue(name)
        st = qq.stats()
        assert st["retained"] == 0 and all(g["in_flight"] == 0 for g in st["groups"].values()), st
        qq.put_many([b"x"] * CAP, block=False)
        qq.purge()
    assert q.stats()["retained"] == 0
    assert check_instance(instance) == []
    b.destroy()


def test_crashpoints_lists_every_point_once() -> None:
    out = subprocess.run([sys.executable, "-m", "shmq.crashpoints"], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == list(crashpoints.POINTS)
    # every listed point is passed somewhere in the code, and every passed one is listed
    root = Path(shmq.__file__).parent
    code = "".join(p.read_text() for d in (root, root.parent / "server") for p in d.rglob("*.py"))
    import re
    passed = set(re.findall(r'crashpoints\.hit\("([^"]+)"\)', code))
    assert passed == set(crashpoints.POINTS)
    # the compiled stores pass their twins' points, each declared, and no other
    c_code = "".join(p.read_text() for p in root.glob("_speedups*.c"))
    in_c = set(re.findall(r'crash_point\("([^"]+)"\)', c_code))
    assert in_c == {"put.written", "put.committed", "deliver.one.leased", "ack.done", "floor.moved",
                    "ack_range.done", "commit.word"}


def test_an_unknown_point_is_refused() -> None:
    r = subprocess.run([sys.executable, "-m", "shmq.crashpoints"], capture_output=True, text=True,
                       env={**os.environ, crashpoints.ENV: "no.such.point"})
    assert r.returncode != 0 and "no crash point named 'no.such.point'" in r.stderr


def test_an_armed_point_kills_at_its_nth_pass(instance: str) -> None:
    b = ShmBroker(instance)
    b.create_queue("q")
    code = (f"import shmq; q = shmq.connect('shm://{instance}').queue('q')\n"
            "for i in range(5): q.put(b'x'); print(i, flush=True)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, crashpoints.ENV: "put.committed:3"})
    assert r.returncode == -signal.SIGKILL and r.stdout.split() == ["0", "1"]
    assert b.queue("q").stats()["retained"] == 3  # the third put committed before the kill
    b.destroy()


_ARMED_RUN = """
import json, shmq
from shmq.accel import ext
q = shmq.connect("shm://{instance}").queue("q")
before = ext.calls()
q.put_many([b"a", b"b", b"c", b"d", b"e"])  # (put_many: the twin's)
q.put(b"f")
q.get().ack()  # (the first get takes the process's client slot: the general path)
q.get().ack()
q.ack_many(q.get_many(2))
q.commit("default", 6)
print(json.dumps({{k: v - before[k] for k, v in ext.calls().items()}}))
"""


def test_an_armed_process_runs_the_compiled_stores(instance: str) -> None:
    """With a point armed (here one the run never reaches its count of), the five compiled
    functions that write shared memory still run: arming changes nothing else."""
    b = ShmBroker(instance)
    b.create_queue("q")
    env = {k: v for k, v in os.environ.items() if k != "SHMQ_PURE"}  # (whatever this run's mode)
    r = subprocess.run([sys.executable, "-c", _ARMED_RUN.format(instance=instance)], capture_output=True,
                       text=True, env={**env, crashpoints.ENV: "put.committed:1000000"}, timeout=60)
    assert r.returncode == 0, r.stderr
    calls = json.loads(r.stdout)
    assert calls == {"put_one": 1, "deliver_one": 1, "ack_one": 2, "ack_run": 1, "settle_range": 1}
    b.destroy()


_ACK_TWICE = """
import shmq
q = shmq.connect("shm://{instance}").queue("q")
ms = [q.get() for _ in range(3)]
for m in ms:
    m.ack()
    print(m.offset, flush=True)
"""


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
def test_both_implementations_die_between_the_same_two_stores(instance: str, pure: bool) -> None:
    """``ack.done:2``: the second ack stores DONE and dies before its counter moves, in C as
    in Python: after the reap, message 1 stays settled (never delivered again), message 2
    comes back, and the acked counter says 1."""
    b = ShmBroker(instance)
    q = b.create_queue("q")
    q.put_many([b"0", b"1", b"2"])
    env = {k: v for k, v in os.environ.items() if k != "SHMQ_PURE"}
    if pure:
        env["SHMQ_PURE"] = "1"
    r = subprocess.run([sys.executable, "-c", _ACK_TWICE.format(instance=instance)], capture_output=True,
                       text=True, env={**env, crashpoints.ENV: "ack.done:2"}, timeout=60)
    assert r.returncode == -signal.SIGKILL and r.stdout.split() == ["0"], (r.returncode, r.stdout, r.stderr)
    b.reap()
    assert [m.payload for m in q.get_many(10, block=False)] == [b"2"]
    st = q.stats()
    assert st["groups"]["default"]["acked"] == 1  # DONE stored, the counter not moved
    assert st["lock_recoveries"] == 1  # killed inside the consumer lock: the next holder repaired
    assert check_instance(instance) == []
    b.destroy()


_GET_DIES = """
import shmq
q = shmq.connect("shm://{instance}").queue("q")
q.get().ack()  # the general path (the handle learns the group): no one-message point on it
print("first", flush=True)
q.get()  # the compiled take_one: killed inside it, the consumer lock held
"""

_ACK_DIES = """
import shmq
q = shmq.connect("shm://{instance}").queue("q")
m = q.get()
print(m.payload.decode(), flush=True)
m.ack()  # the compiled ack_lock: killed inside it, DONE stored, the lock held
"""


def _within(call: Any, timeout: float = 30.0) -> Any:
    """``call()`` in a thread, which must be done within ``timeout`` s (a test that fails,
    not one that hangs)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(call()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{call} still waits after {timeout} s"
    return out[0]


def _run_killed(instance: str, script: str, point: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "SHMQ_PURE"}  # the compiled paths
    r = subprocess.run([sys.executable, "-c", script.format(instance=instance)], capture_output=True,
                       text=True, env={**env, crashpoints.ENV: point}, timeout=60)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr)
    return r


def test_a_compiled_get_first_to_find_a_dead_holder_recovers_the_lock(instance: str) -> None:
    """A consumer killed inside the compiled take_one leaves the consumer lock to its robust
    owner-died state; the next get here (compiled: trylock hands it over with EOWNERDEAD)
    makes it consistent, repairs, and delivers.  Every message's fate: "0" acked by the
    dead consumer, never delivered again; "1", whose lease word it stored, delivered
    again once it is reaped; "2" delivered here."""
    b = ShmBroker(instance)
    q = b.create_queue("q")
    q.put_many([b"p", b"0", b"1", b"2"])
    q.get().ack()  # "p": this handle learns the group, so its next get is the compiled one
    r = _run_killed(instance, _GET_DIES, "deliver.one.leased:1")
    assert r.stdout.split() == ["first"]
    w = q.words  # type: ignore[attr-defined]
    assert w[L.Q_CLOCK_RECOVERIES] == 0  # (read raw: stats takes the lock, and would recover it)
    got = _within(lambda: [q.get(timeout=10)])  # (a mishandled owner-died lock hangs its taker)
    assert w[L.Q_CLOCK_RECOVERIES] == 1  # the get was the one that recovered it
    b.reap()  # the dead consumer's leases come back
    got += q.get_many(10, block=False)
    for m in got:
        m.ack()
    assert sorted(m.payload for m in got) == [b"1", b"2"]
    assert q.stats()["groups"]["default"]["acked"] == 4
    with pytest.raises(Empty):
        q.get(block=False)
    b.destroy()


def test_a_compiled_ack_first_to_find_a_dead_holder_recovers_the_lock(instance: str) -> None:
    """As above, for the compiled ack_lock: a consumer killed inside its ack leaves its
    message settled (DONE was stored); an ack here is the first to take the lock, recovers
    it and settles its own message; nothing else is delivered again."""
    b = ShmBroker(instance)
    q = b.create_queue("q")
    q.put_many([b"0", b"1"])
    mine = q.get()  # "0"
    r = _run_killed(instance, _ACK_DIES, "ack.done:1")
    assert r.stdout.split() == ["1"]
    w = q.words  # type: ignore[attr-defined]
    assert w[L.Q_CLOCK_RECOVERIES] == 0
    _within(mine.ack)
    assert w[L.Q_CLOCK_RECOVERIES] == 1  # the ack was the one that recovered it
    b.reap()
    with pytest.raises(Empty):  # "1" stays settled, "0" is acked
        q.get(block=False)
    assert q.stats()["groups"]["default"]["acked"] == 1  # the child's DONE stored, its count not moved
    b.destroy()
