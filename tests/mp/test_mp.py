"""shmq.mp: the stdlib's queue semantics on shared memory, and what it adds: every object's
fate across processes, a SIGKILL at any point, and the queue's lifetime."""

from __future__ import annotations

import copyreg
import multiprocessing
import os
import pickle
import queue
import signal
import time
from collections import Counter
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest

import shmq
from shmq import mp
from shmq.core.cleanup import scan
from shmq.mp import _dumps
from tests.support.instances import objects

METHODS = ["fork", "spawn", "forkserver"]
DEADLINE = 60.0  # s a test waits for what must happen well before


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)

    def __hash__(self) -> int:
        return hash((self.x, self.y))


# ------------------------------------------------------------------ children
def _produce(q: mp.Queue, tag: str, n: int) -> None:
    for i in range(n):
        q.put((tag, i))


def _consume(q: mp.Queue, out: mp.Queue) -> None:
    for item in iter(q.get, None):
        out.put(item)


def _produce_for_ever(q: mp.Queue, tag: str, started: Any) -> None:
    started.set()
    i = 0
    while True:
        q.put((tag, i, b"x" * (i % 3000)))  # payloads of every size, whole or not at all
        i += 1


def _work(q: mp.JoinableQueue, done: mp.Queue, died: Any) -> None:
    for item in iter(q.get, None):
        if item == "die" and not died.value:
            died.value = os.getpid()
            os.kill(os.getpid(), signal.SIGKILL)  # holding the task: it must come back
        done.put(item)
        q.task_done()


def _hold(q: mp.Queue, ready: Any, stop: Any) -> None:
    ready.set()
    stop.wait(DEADLINE)
    q.put("still here")


def _make_and_report(conn: Any) -> None:
    q = mp.Queue()
    q.put("left behind")
    conn.send(q._instance)
    time.sleep(DEADLINE)  # until SIGKILLed


def _init_worker(q: mp.Queue) -> None:
    global _pool_queue
    _pool_queue = q


_pool_queue: mp.Queue | None = None


def _pool_task(i: int) -> int:
    assert _pool_queue is not None
    _pool_queue.put(i * i)
    return i


# ------------------------------------------------------------------ pickling
@pytest.mark.parametrize("obj", [b"x" * 100, "text", 7, 2.5, True, None, {"a": [1, (2, 3)]},
                                 Point(1, 2), frozenset({1, 2}), bytearray(b"ab")])
def test_objects_are_pickled_as_multiprocessing_pickles_them(obj: object) -> None:
    assert _dumps(obj) == bytes(ForkingPickler.dumps(obj))
    q = mp.Queue()
    q.put(obj)
    assert q.get(timeout=DEADLINE) == obj
    q.close()


class Wrapped:
    def __init__(self, v: int) -> None:
        self.v = v


def _reduce_wrapped(w: Wrapped) -> tuple[Any, tuple[Any, ...]]:
    return Point, (w.v, -w.v)


def test_a_reducer_registered_with_forkingpickler_counts_from_the_next_queue_on() -> None:
    ForkingPickler.register(Wrapped, _reduce_wrapped)
    try:
        q = mp.Queue()
        q.put(Wrapped(3))
        assert q.get(timeout=DEADLINE) == Point(3, -3)
        q.close()
    finally:
        del ForkingPickler._extra_reducers[Wrapped]  # type: ignore[attr-defined]
    assert Wrapped not in copyreg.dispatch_table


def test_an_object_that_cannot_be_pickled_raises_in_put_and_nothing_is_stored() -> None:
    q = mp.Queue()
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        q.put(lambda: 1)
    q.put({"next": [1]})  # the pickler that failed half-way is reused: nothing of that stays
    assert q.get(timeout=DEADLINE) == {"next": [1]}
    assert q.empty()
    q.close()


def test_threads_putting_at_once_each_get_their_own_objects_through() -> None:
    import threading
    q = mp.Queue()
    n = 2000

    def put(tag: int) -> None:
        for i in range(n):
            q.put({"tag": tag, "i": i, "pad": [tag] * (i % 7)})

    threads = [threading.Thread(target=put, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    got = [q.get(timeout=DEADLINE) for _ in range(4 * n)]
    for t in threads:
        t.join()
    for tag in range(4):
        mine = [g for g in got if g["tag"] == tag]
        assert mine == [{"tag": tag, "i": i, "pad": [tag] * (i % 7)} for i in range(n)]
    q.close()


# ------------------------------------------------------------------ the stdlib's shape
def test_put_get_nowait_and_timeouts_as_the_stdlib() -> None:
    q = mp.Queue(maxsize=2)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    with pytest.raises(queue.Empty):
        q.get(False)
    with pytest.raises(queue.Empty):
        q.get(True, -1)  # a negative timeout is 0, as the stdlib's
    q.put(1)
    q.put_nowait(2)
    assert q.full() and q.qsize() == 2 and not q.empty()
    with pytest.raises(queue.Full):
        q.put(3, False)
    start = time.monotonic()
    with pytest.raises(queue.Full):
        q.put(3, True, 0.1)
    assert time.monotonic() - start >= 0.09
    assert [q.get(), q.get_nowait()] == [1, 2]
    assert q.empty() and not q.full()
    q.close()
    for call in (lambda: q.put(1), q.get, q.get_nowait, lambda: q.put_nowait(1)):
        with pytest.raises(ValueError, match="is closed"):
            call()
    q.join_thread()
    q.cancel_join_thread()


def test_join_thread_before_close_is_refused_as_the_stdlibs() -> None:
    q = mp.Queue()
    with pytest.raises(AssertionError, match="not closed"):
        q.join_thread()
    q.close()


def test_put_many_and_get_many_keep_order_and_lose_nothing() -> None:
    q = mp.Queue()
    q.put_many(range(250))
    got: list[int] = []
    while len(got) < 250:
        got += q.get_many(max_messages=100, timeout=DEADLINE)
    assert got == list(range(250))
    with pytest.raises(queue.Empty):
        q.get_many(block=False)
    q.close()


def test_simple_queue() -> None:
    q = mp.SimpleQueue()
    assert q.empty()
    q.put(["a"])
    assert not q.empty()
    assert q.get() == ["a"]
    q.close()


def test_limits_are_typed_errors() -> None:
    q = mp.Queue(max_bytes=64 * 1024)
    with pytest.raises(shmq.MessageTooLarge):
        q.put(b"x" * 64 * 1024)
    q.put(b"fits")
    assert q.get() == b"fits"
    q.close()
    with pytest.raises(TypeError):
        mp.Queue(maxsize="3")  # type: ignore[arg-type]


def test_task_done_too_often_is_a_value_error_and_join_waits_for_every_task() -> None:
    q = mp.JoinableQueue()
    with pytest.raises(ValueError, match="too many"):
        q.task_done()
    q.put_many(["a", "b"])
    assert q.get() == "a"
    assert q.get() == "b"
    q.task_done()
    assert q._default_group()["in_flight"] == 1  # join would wait: one task not done
    q.task_done()
    q.join()
    q.close()


# ------------------------------------------------------------------ across processes
@pytest.mark.parametrize("method", METHODS)
def test_every_object_reaches_exactly_one_consumer_in_each_producers_order(method: str) -> None:
    ctx: Any = multiprocessing.get_context(method)
    q, out = mp.Queue(), mp.Queue()
    n = 300
    producers = [ctx.Process(target=_produce, args=(q, tag, n)) for tag in "ab"]
    consumers = [ctx.Process(target=_consume, args=(q, out)) for _ in range(2)]
    for p in producers + consumers:
        p.start()
    got = [out.get(timeout=DEADLINE) for _ in range(2 * n)]
    for p in producers:
        p.join(DEADLINE)
    for _ in consumers:
        q.put(None)
    for p in consumers:
        p.join(DEADLINE)
    assert Counter(got) == Counter((tag, i) for tag in "ab" for i in range(n))  # each once
    with pytest.raises(queue.Empty):
        out.get(False)
    q.close()
    out.close()


def test_a_queue_passes_to_a_pool_initializer_under_spawn() -> None:
    q = mp.Queue()
    with multiprocessing.get_context("spawn").Pool(2, initializer=_init_worker, initargs=(q,)) as pool:
        assert sorted(pool.map(_pool_task, range(10))) == list(range(10))
    assert sorted(q.get(timeout=DEADLINE) for _ in range(10)) == [i * i for i in range(10)]
    q.close()


def test_a_producer_sigkilled_mid_put_leaves_every_other_process_working() -> None:
    """A producer killed at any instruction of its put loop, again and again: the other
    producer never stalls, and what the killed ones put arrives whole and in order (a
    prefix of what each tried: no torn object, none twice)."""
    ctx = multiprocessing.get_context("fork")
    q = mp.Queue(maxsize=64)
    steady = ctx.Process(target=_produce, args=(q, "steady", 2000))
    steady.start()
    killed: dict[str, int] = {}
    got: dict[str, list[int]] = {}
    for round_ in range(5):
        started = ctx.Event()
        victim = ctx.Process(target=_produce_for_ever, args=(q, f"k{round_}", started))
        victim.start()
        assert started.wait(DEADLINE)
        tag = f"k{round_}"
        while len(got.get(tag, [])) < 20 + 37 * round_:  # well into its loop: kill it mid-put
            item = q.get(timeout=10)  # never stuck (10 s: many reap ticks)
            got.setdefault(item[0], []).append(item[1])
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(DEADLINE)
        killed[tag] = 1
    while len(got.get("steady", [])) < 2000:
        item = q.get(timeout=10)  # never stuck (10 s: many reap ticks)
        got.setdefault(item[0], []).append(item[1])
    steady.join(DEADLINE)
    while True:  # what the killed ones put before they died
        try:
            item = q.get(timeout=0.5)
        except queue.Empty:
            break
        got.setdefault(item[0], []).append(item[1])
    assert got["steady"] == list(range(2000))
    for tag in killed:
        assert got[tag] == list(range(len(got[tag]))), tag
    q.put("after")
    assert q.get(timeout=DEADLINE) == "after"
    q.close()


def _consume_and_report(q: mp.Queue, out: mp.Queue, started: Any) -> None:
    started.set()
    while True:
        out.put(q.get())


def test_a_consumer_sigkilled_mid_get_never_stalls_the_others() -> None:
    """Consumers killed at any instruction of their get loop, again and again, beside a
    steady producer: the parent keeps getting, no object comes twice, and at most one
    object is lost per kill (the one a victim had got and not yet reported)."""
    ctx = multiprocessing.get_context("fork")
    # ``out`` is small, so a victim gets at most a few objects ahead of what the parent read of
    # its reports: with an unbounded one, the victims could take all n before the parent's
    # own gets, which then found none (a race of the test's, not a stall)
    q, out = mp.Queue(maxsize=64), mp.Queue(maxsize=8)
    n = 3000
    producer = ctx.Process(target=_produce, args=(q, "p", n))
    producer.start()
    mine: list[tuple[str, int]] = []
    reported: list[tuple[str, int]] = []
    kills = 0
    while kills < 8:
        started = ctx.Event()
        victim = ctx.Process(target=_consume_and_report, args=(q, out, started))
        victim.start()
        assert started.wait(DEADLINE)
        for _ in range(20 + 13 * kills):  # it alone consumes now: kill it well into its loop
            reported.append(out.get(timeout=DEADLINE))
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(DEADLINE)
        kills += 1
        for _ in range(40):  # the others carry on: the parent gets from the queue it was in
            mine.append(q.get(timeout=10))
    while True:
        try:
            reported.append(out.get(False))
        except queue.Empty:
            break
    while len(mine) + len(reported) < n - kills:
        mine.append(q.get(timeout=10))  # never stuck: what is left comes (10 s: many reap ticks)
    producer.join(DEADLINE)
    while True:
        try:
            mine.append(q.get(timeout=0.5))
        except queue.Empty:
            break
    seen = Counter(mine + reported)
    assert max(seen.values()) == 1  # none twice
    assert set(seen) <= {("p", i) for i in range(n)}
    assert n - len(seen) <= kills  # lost: at most the one in each victim's hands
    q.close()
    out.close()


def test_a_task_whose_worker_is_sigkilled_is_done_by_another_and_join_returns() -> None:
    ctx = multiprocessing.get_context("fork")
    q, done = mp.JoinableQueue(), mp.Queue()
    died = ctx.Value("q", 0)
    workers = [ctx.Process(target=_work, args=(q, done, died)) for _ in range(3)]
    for w in workers:
        w.start()
    q.put_many(range(20))
    q.put("die")  # the first worker to get it dies holding it ...
    q.put_many(range(20, 40))
    q.join()  # ... another does it, and join returns once every task is done
    assert died.value
    victim = next(w for w in workers if w.pid == died.value)
    victim.join(DEADLINE)
    assert victim.exitcode == -signal.SIGKILL
    survivors = [w for w in workers if w is not victim]
    for _ in survivors:
        q.put(None)
    for w in survivors:
        w.join(DEADLINE)
        assert w.exitcode == 0
    got = Counter(done.get(False) for _ in range(41))  # put before their task_done: there already
    assert got == Counter([*range(40), "die"])  # every task done, once
    with pytest.raises(queue.Empty):
        done.get(False)
    q.close()
    done.close()


# ------------------------------------------------------------------ lifetime
def test_a_queue_is_removed_when_its_last_user_lets_go() -> None:
    q = mp.Queue()
    inst = q._instance
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold, args=(q, ready, stop))
    child.start()
    assert ready.wait(DEADLINE)
    q.close()  # the parent lets go; the child still holds it
    assert objects(inst)
    stop.set()
    child.join(DEADLINE)
    assert child.exitcode == 0
    assert objects(inst) == []  # the child was the last: it removed it as it ended


def test_a_sigkilled_last_user_leaves_it_to_the_next_queue_made_never_a_live_one() -> None:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    maker = ctx.Process(target=_make_and_report, args=(send,))
    maker.start()
    assert recv.poll(DEADLINE)
    dead_inst = recv.recv()
    live = mp.Queue()  # held by this process: the sweep below must not touch it
    ready, stop = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(live, ready, stop))
    holder.start()
    assert ready.wait(DEADLINE)
    live.close()  # only the holder holds it now
    assert maker.pid is not None
    os.kill(maker.pid, signal.SIGKILL)
    maker.join(DEADLINE)
    left = scan(dead_inst)
    assert left == [] or not left[0].alive  # dead (or already swept by another test's queue)
    fresh = mp.Queue()  # the next queue made sweeps the dead ones
    assert objects(dead_inst) == []
    assert objects(live._instance)  # the holder's is alive and kept
    stop.set()
    holder.join(DEADLINE)
    assert holder.exitcode == 0
    fresh.close()


def test_unpickling_a_queue_that_is_gone_names_it() -> None:
    q = mp.Queue()
    data = pickle.dumps(q)
    q.close()
    with pytest.raises(shmq.InstanceNotFound, match="is gone"):
        pickle.loads(data)
