"""A corrupt queue segment gives a typed error, never a fault.

Shared memory is ours alone, but a bug, a stray write or a version mix must not kill a
broker.  A throwaway queue (messages put, some leased, one given back) has each word
of its header, and each word of a few slots, overwritten in turn with 0, 2**63,
2**64-1 and a random value; each time a fresh process attaches it and makes every
public call.  No process may die by a signal or hang; each call succeeds or raises a
typed shmq error.  Compiled (the default) and pure (``SHMQ_PURE=1``) alike.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.segment import queue_segment_name, shm_path
from tests.support.instances import session_tmp

# runs in a fresh interpreter (its implementation chosen by its environment); for each
# case it restores the segment, corrupts one word, and forks a process that attaches the
# instance and makes every call, reporting each call's outcome through a pipe
CHILD = r"""
import json, os, select, signal, sys, time
import shmq
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker

inst, path, cases_path = sys.argv[1:4]
pristine = open(path, "rb").read()


def calls(b):
    q = b.queue("q")
    yield "stats", lambda: q.stats()
    yield "read", lambda: q.read(0, 10)
    yield "put", lambda: q.put(b"new", block=False)
    yield "put_many", lambda: q.put_many([b"a", b"bb"], block=False)
    yield "put headers", lambda: q.put(b"h", block=False, headers={"k": "v"})
    yield "get+ack", lambda: q.get(block=False).ack()
    yield "get_many+ack_many", lambda: q.ack_many(q.get_many(5, block=False))
    yield "get+nack", lambda: q.get(block=False).nack()
    yield "groups", lambda: q.groups()
    yield "commit", lambda: q.commit("default", 1)
    yield "list_queues", lambda: b.list_queues()
    yield "doctor --check", lambda: check_instance(inst)


def run_case():
    out = []
    try:
        b = ShmBroker(inst, create=False)
        try:
            for name, call in calls(b):
                try:
                    call()
                    out.append([name, "ok"])
                except shmq.ShmqError as e:
                    out.append([name, type(e).__name__])
                except Exception as e:  # noqa: BLE001 - what the test reports
                    out.append(["untyped " + name, f"{type(e).__name__}: {str(e)[:200]}"])
        except shmq.ShmqError as e:  # the queue itself refused (a corrupt header)
            out.append(["queue", type(e).__name__])
    except BaseException as e:  # noqa: BLE001 - what the test reports
        out.append(["untyped", f"{type(e).__name__}: {str(e)[:200]}"])
    return out


results = []
for word, value in json.load(open(cases_path)):
    with open(path, "r+b") as f:
        f.write(pristine)
        f.seek(word * 8)
        f.write(value.to_bytes(8, "little"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, json.dumps(run_case()).encode())
        os._exit(0)
    os.close(w)
    data, deadline = b"", time.monotonic() + 20
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    done, status = os.waitpid(pid, os.WNOHANG)
    end = time.monotonic() + 10
    while not done and time.monotonic() < end:  # (it wrote its report: it is exiting)
        time.sleep(0.002)
        done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        results.append([word, value, "HANG", data.decode(errors="replace")[:300]])
        continue
    if os.WIFSIGNALED(status):
        results.append([word, value, f"SIGNAL {os.WTERMSIG(status)}", data.decode(errors="replace")[:300]])
        continue
    results.append([word, value, "exit", json.loads(data or b"[]")])
with open(path, "r+b") as f:
    f.write(pristine)
print(json.dumps(results))
"""


def _cases(slots_off: int, slot_words: int) -> list[tuple[int, int]]:
    rng = random.Random(32)
    words = list(range(L.Q_EXPIRES_MAX + 1))  # every header word of the layout (not the locks)
    for s in range(3):  # the words of three slots
        words += range(slots_off // L.WORD + s * slot_words, slots_off // L.WORD + (s + 1) * slot_words)
    values = [0, 1 << 63, (1 << 64) - 1]
    return [(w, v) for w in words for v in [*values, rng.getrandbits(64)]]


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
def test_a_corrupt_word_gives_a_typed_error_never_a_fault(instance: str, pure: bool) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("q", capacity=16, max_bytes=4096, max_groups=2, visibility_timeout=300)
        q.put_many([b"m0", b"m1", b"m2", b"m3", b"m4"])
        q.put(b"m5", headers={"h": "1"})
        got = q.get_many(3)
        got[0].ack()
        got[1].nack()
        q.create_group("g2")
        w = q.words  # type: ignore[attr-defined]
        path = shm_path(queue_segment_name(instance, q.ring.queue_id))  # type: ignore[attr-defined]
        cases = _cases(w[L.Q_SLOTS_OFF], w[L.Q_SLOT_WORDS])
        cases_path = Path(session_tmp("corrupt-")) / "cases.json"
        cases_path.write_text(json.dumps(cases))
        env = {k: v for k, v in os.environ.items() if k != "SHMQ_PURE"}
        if pure:
            env["SHMQ_PURE"] = "1"
        r = subprocess.run([sys.executable, "-c", CHILD, instance, path, str(cases_path)],
                           capture_output=True, text=True, env=env, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        results = json.loads(r.stdout)
        assert len(results) == len(cases)
        faults = [x for x in results if x[2] != "exit"]
        untyped = [x for x in results if x[2] == "exit" and any(k.startswith("untyped") for k, _ in x[3])]
        shown = [f"word {x[0]} = {x[1]:#x}: {x[2]} {x[3]}" for x in faults + untyped]
        assert not shown, f"{len(shown)} of {len(cases)} cases:\n" + "\n".join(shown[:40])
    finally:
        b.destroy()


_BAD_GEOMETRY = r"""
import importlib, mmap, sys
ext = importlib.import_module("shmq._speedups")
mm = mmap.mmap(-1, 16384)  # 2048 words
lock_mm = mmap.mmap(-1, 64)
from shmq.core.lock import init_mutex, RobustLock
lock = RobustLock(lock_mm, 0).address
init_mutex(lock)
bad = []
for cap in (2**64 - 1, 2**63, 2**62 + 1, 1 << 40):
    put = (mm, 200, 300, cap, 13, 24, 4096, 4096)
    one = (*put, tuple, None)
    calls = {
        "put_one": lambda: ext.put_one(put, b"x", b"", 1),
        "deliver_one": lambda: ext.deliver_one(one, 0, 1, 1, 0, "g"),
        "ack_one": lambda: ext.ack_one(one, 0, 0, 1, -1),
        "take_one": lambda: ext.take_one(one, 0, 1, 1000, "g", lock, 0, 1),
        "ack_lock": lambda: ext.ack_lock(one, 0, 0, 1, -1, lock),
        "spin_wait": lambda: ext.spin_wait(one, 0, 1000, 1),
        "ack_run": lambda: ext.ack_run(one, [(None, 0, "g", 0, 1), (None, 0, "g", 1, 1)], None, -1),
        "settle_range": lambda: ext.settle_range(mm, 300, cap, 13, 5, 0, 10),
        "read_run": lambda: ext.read_run(mm, 300, cap, 13, 4096, 4096, 0, 5, 1 << 20, 0),
    }
    for name, call in calls.items():
        try:
            call()
            bad.append(f"{name} cap={cap}: no error")
        except ValueError:
            pass
print("\n".join(bad) or "ok")
"""


def test_the_compiled_stores_refuse_a_geometry_past_their_mapping() -> None:
    """Each C entry point checks, in unsigned arithmetic, that the geometry it is handed
    fits its mapping: a capacity of 2**64-1 (or 2**63, or one whose product with the slot
    words wraps) is a ValueError, never a store past the end (a child runs it: a fault
    would kill it, not the suite)."""
    r = subprocess.run([sys.executable, "-c", _BAD_GEOMETRY], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if k != "SHMQ_PURE"})
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "ok", r.stdout


def test_doctor_check_reports_a_corrupt_header(instance: str) -> None:
    from shmq.core.check import check_instance
    b = ShmBroker(instance)
    try:
        q = b.create_queue("q", capacity=16, max_bytes=4096)
        w = q.words  # type: ignore[attr-defined]
        w[L.Q_CAPACITY] = (1 << 64) - 1  # (the process that wrote it keeps its own geometry)
        (line,) = check_instance(instance)
        assert "is corrupt: its header's Q_CAPACITY is 18446744073709551615" in line, line
        r = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()", "doctor", "--check",
                            "--instance", instance],
                           capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 1 and "Q_CAPACITY is 18446744073709551615" in r.stdout + r.stderr, (
            r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        w[L.Q_CAPACITY] = 16
        assert check_instance(instance) == []
    finally:
        b.destroy()
