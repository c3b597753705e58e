"""Celery through shmq.kombu: real prefork workers (2 processes each) as subprocesses, against
a real ``shmq serve``, with results in the filesystem backend (no server) and each task's
runs recorded in files (``celery_app``).  The workers are the module's: started once, both
consuming the test queue, the first alone the ``solo`` queue; the last test kills one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu
import psutil
import pytest
from celery import Celery

import shmq
from shmq.kombu.naming import queue_name
from tests.integrations import celery_app
from tests.support.server import Server

ROOT = Path(__file__).resolve().parents[2]


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Worker:
    """``celery worker --pool prefork -c 2`` in a session of its own (so it dies whole)."""

    def __init__(self, name: str, env: dict[str, str], log: Path, queues: str) -> None:
        self.name = name
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.integrations.celery_app", "worker",
                 "--pool", "prefork", "-c", "2", "--loglevel", "info", "-n", f"{name}@%h", "-Q", queues,
                 "-E", "--without-mingle", "--without-gossip"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.termed = False  # a SIGTERM was sent: a second one during the warm shutdown kills it (-15)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        wait_for(f"{self.name} to be ready", lambda: " ready." in self.text() or self.proc.poll() is not None)
        assert self.proc.poll() is None, self.text()

    def pids(self) -> set[int]:
        """The worker's processes: its main one and its pool's."""
        try:
            main = psutil.Process(self.proc.pid)
            return {main.pid, *(c.pid for c in main.children(recursive=True))}
        except psutil.NoSuchProcess:
            return set()

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM, once: a warm shutdown starts."""
        if not self.termed and self.proc.poll() is None:
            self.termed = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM (a warm shutdown: Celery's blocking loop sees it within two of its 2 s
        waits), then SIGKILL for whatever of its session is left; its exit status (None when
        it had to be killed)."""
        code: int | None = None
        self.terminate()
        try:
            code = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its session
        except ProcessLookupError:
            pass
        self.proc.wait()
        return code


class Setup:
    def __init__(self, server: Server, tmp: Path) -> None:
        self.server = server
        self.records = tmp / "records"
        self.results = tmp / "results"
        self.records.mkdir()
        self.results.mkdir()
        tag = uuid.uuid4().hex[:8]
        self.queue, self.solo = f"celery-{tag}", f"solo-{tag}"
        self.broker = f"shmq://127.0.0.1:{server.port}"
        self.values = {"broker": self.broker, "results": str(self.results), "records": str(self.records),
                       "queue": self.queue, "solo": self.solo}
        self.env = {**os.environ, **{celery_app.ENV[k]: v for k, v in self.values.items()}}
        self.workers: list[Worker] = []

    def runs(self, key: str) -> list[dict[str, Any]]:
        """Each run of the task recorded under ``key``: its pid and start time, by start time."""
        out = []
        for p in self.records.glob(f"{key}__*"):
            text = p.read_text()
            if text:
                out.append({"pid": int(p.name.split("__")[1]), **json.loads(text)})
        return sorted(out, key=lambda r: r["t"])

    def keys_run(self, prefix: str) -> Counter[str]:
        return Counter(p.name.split("__")[0] for p in self.records.glob(f"{prefix}*__*"))

    def in_flight(self, queue: str) -> int:
        with shmq.connect(self.server.url) as b:
            return int(b.queue(queue_name(queue)).stats()["groups"]["default"]["in_flight"])

    def worker(self, name: str, queues: str, colocated: bool = False) -> Worker:
        env = self.env
        if colocated:
            env = {**env, celery_app.ENV["broker"]: f"shmq+shm://{self.server.instance}"}
        return Worker(name, env, self.records.parent / f"{name}.log", queues)

    def celery(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.integrations.celery_app", *args],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def setup(own_server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    """w1 reaches the broker over TCP, w2 attaches its instance co-located (``shmq+shm://``)."""
    s = Setup(own_server, tmp_path_factory.mktemp("celery"))
    celery_app.configure(**s.values)
    try:
        s.workers = [s.worker("w1", f"{s.queue},{s.solo}"), s.worker("w2", s.queue, colocated=True)]
        for w in s.workers:
            w.wait_ready()
        yield s
    finally:
        for w in s.workers:  # all told at once: their shutdowns overlap
            w.terminate()
        codes = [w.stop() for w in s.workers]
        celery_app.app.close()
    assert codes == [0] * len(codes), "a worker did not shut down cleanly"


def test_a_prefork_worker_runs_a_thousand_tasks_each_once(setup: Setup) -> None:
    key = f"k{uuid.uuid4().hex[:6]}-"
    t = time.monotonic()
    results = [celery_app.solo.delay(f"{key}{i}", i) for i in range(1000)]
    wait_for("1000 tasks to run", lambda: sum(setup.keys_run(key).values()) >= 1000, timeout=120)
    assert [r.get(timeout=30, interval=0.01) for r in results] == [2 * i for i in range(1000)]
    elapsed = time.monotonic() - t
    runs = setup.keys_run(key)
    assert runs == Counter({f"{key}{i}": 1 for i in range(1000)})
    solo_pids = setup.workers[0].pids()
    assert {int(p.name.split("__")[1]) for p in setup.records.glob(f"{key}*__*")} <= solo_pids
    wait_for("the last acks to reach the broker", lambda: setup.in_flight(setup.solo) == 0, timeout=10)
    print(f"1000 tasks in {elapsed:.2f} s")


@pytest.mark.slow
def test_countdown_waits_and_retries_run_again(setup: Setup) -> None:
    """Celery's worker holds a countdown's task (its lease: given back at once if the worker
    dies) until it is due; its timer thread runs such tasks up to about 1 s late."""
    key = f"cd{uuid.uuid4().hex[:6]}"
    sent = time.time()
    r = celery_app.record.apply_async((key, 21), countdown=2)
    assert r.get(timeout=30, interval=0.01) == 42
    (run,) = setup.runs(key)
    assert 2.0 - 0.05 <= run["t"] - sent < 2.0 + 3.0
    rkey = f"rt{uuid.uuid4().hex[:6]}"
    assert celery_app.retrying.delay(rkey, 3).get(timeout=30, interval=0.01) == 3
    assert [run["retries"] for run in setup.runs(rkey)] == [0, 1, 2, 3]


def test_celery_inspect_ping_is_answered(setup: Setup) -> None:
    """The command line's broadcast (a fan-out exchange) reaches both workers, and their
    replies (a direct exchange, to a queue the command bound) reach it."""
    names = [f"{w.name}@{socket.gethostname()}" for w in setup.workers]
    out = setup.celery("inspect", "ping", "--timeout", "10", "--destination", ",".join(names))
    assert out.returncode == 0, out.stdout + out.stderr
    for name in names:
        assert f"{name}: OK" in out.stdout and "pong" in out.stdout, out.stdout
    replies = celery_app.app.control.ping(destination=names, timeout=10)
    assert sorted(next(iter(r)) for r in replies) == sorted(names)


def test_events_reach_a_receiver_in_another_process(setup: Setup) -> None:
    app = celery_app.app
    seen: dict[str, dict[str, Any]] = {}
    consuming = threading.Event()

    def on_event(event: dict[str, Any]) -> None:
        consuming.set()  # (the workers answer the receiver's wake-up with a heartbeat)
        if event["type"] == "task-succeeded":
            seen[event["uuid"]] = event

    with app.connection_for_read() as conn:
        recv = app.events.Receiver(conn, handlers={"*": on_event})
        thread = threading.Thread(target=recv.capture, kwargs={"limit": None, "timeout": 60, "wakeup": True},
                                  daemon=True)
        thread.start()
        try:
            assert consuming.wait(15), "no event reached the receiver"
            r = celery_app.record.delay(f"ev{uuid.uuid4().hex[:6]}", 5)
            assert r.get(timeout=30, interval=0.01) == 10
            event = wait_for("task-succeeded", lambda: seen.get(r.id), timeout=15)
            assert event["hostname"].split("@")[0] in {"w1", "w2"}
        finally:
            recv.should_stop = True
            thread.join(10)
        assert not thread.is_alive()


def test_bad_input_is_a_clear_error_at_the_caller_and_the_broker_serves_on(setup: Setup) -> None:
    port = setup.server.port
    for url, error, says in [(f"shmq://127.0.0.1:{port}?token=wrong", shmq.AuthError, "token"),
                             (f"shmq://127.0.0.1:{port}?tokn=x", shmq.InvalidArgument, "tokn")]:
        bad = Celery("bad", broker=url, set_as_current=False)
        t = time.monotonic()
        with pytest.raises(error, match=says):
            bad.send_task("tests.integrations.celery_app.record", ("never", 1), queue=setup.queue)
        assert time.monotonic() - t < 1.5  # raised at once, not retried
        bad.close()
    with pytest.raises(shmq.MessageTooLarge):
        celery_app.record.delay("too-large", "x" * (2 * 1024 * 1024))
    with kombu.Connection(setup.broker) as conn, pytest.raises(shmq.InvalidArgument, match="x-max-priority"):
        kombu.Queue(f"prio-{uuid.uuid4().hex[:6]}", max_priority=300)(conn.default_channel).declare()
    assert celery_app.record.delay(f"after{uuid.uuid4().hex[:6]}", 4).get(timeout=30, interval=0.01) == 8
    assert setup.keys_run("never") == Counter() and setup.keys_run("too-large") == Counter()


@pytest.mark.parametrize("how", ["tcp", "colocated"])
def test_a_worker_killed_mid_task_has_it_run_again_by_the_other_within_a_second(setup: Setup,
                                                                                how: str) -> None:
    """Under acks_late: SIGKILL a worker (main process and pool) running a task.  Its leases
    go back at once (over TCP its connection drops; co-located, the broker finds the
    process gone within 0.25 s), and the other worker runs the task within a second.  The
    tasks it acked before (their acks reached the broker: nothing in flight but the held
    task) never run again."""
    queue = f"kill-{uuid.uuid4().hex[:6]}"
    victim = setup.worker(f"victim{how}", queue, colocated=how == "colocated")
    other = setup.workers[0]
    other_name = f"{other.name}@{socket.gethostname()}"
    try:
        victim.wait_ready()
        quick = f"q{uuid.uuid4().hex[:6]}-"
        sent = [celery_app.record.apply_async((f"{quick}{i}", i), queue=queue) for i in range(20)]
        assert [r.get(timeout=30, interval=0.01) for r in sent] == [2 * i for i in range(20)]
        key = f"hold{uuid.uuid4().hex[:6]}"
        result = celery_app.hold.apply_async((key,), queue=queue)
        first = wait_for("the held task to start", lambda: setup.runs(key))[0]
        assert first["pid"] in victim.pids()
        # the other worker starts consuming the queue now (remote control: add_consumer)
        reply = celery_app.app.control.add_consumer(queue, destination=[other_name], reply=True, timeout=10)
        assert reply and "ok" in reply[0][other_name], reply
        wait_for("the quick tasks' acks", lambda: setup.in_flight(queue) == 1)
        killed_at = time.time()
        victim.kill()
        runs = wait_for("the task to run again", lambda: len(setup.runs(key)) >= 2 and setup.runs(key),
                        timeout=10)
        assert runs[1]["pid"] in other.pids()
        latency = runs[1]["t"] - killed_at
        assert latency < 1.0, f"ran again {latency:.3f} s after the kill"
        print(f"{how}: ran again on the other worker {latency:.3f} s after the kill")
        (setup.records / f"release-{key}").touch()
        assert result.get(timeout=30, interval=0.01) == key
        after = [celery_app.record.apply_async((f"{quick}after{i}", i), queue=queue) for i in range(10)]
        assert [r.get(timeout=30, interval=0.01) for r in after] == [2 * i for i in range(10)]
        runs_of = setup.keys_run(quick)
        assert set(runs_of.values()) == {1} and len(runs_of) == 30
        assert len(setup.runs(key)) == 2
    finally:
        celery_app.app.control.cancel_consumer(queue, destination=[other_name], reply=True, timeout=10)
        victim.stop()
