"""A fate-tracking SIGKILL storm: Jepsen-style proof that kills lose nothing and invent nothing.

``run_storm()`` makes a fresh instance with small queues (the ring wraps, producers meet
``Full``), runs producer, consumer, lock-hog and reaper processes (``fork``), and SIGKILLs
them at random (``random.Random(seed)``), starting a replacement for each one killed, until
``kills`` kills are done or ``seconds`` have passed.  Then it stops everything, drains every
group of every queue and the dead-letter queue, and checks each message's fate against what
the processes wrote down:

* each process logs, line-buffered, one line per event, before and after each call:
  ``A id`` before a put, ``C id`` once it returned (confirmed); ``G group id offset`` once a
  get returned it (delivered), ``T group id...`` before an ack (or an ``ack_many``), ``K`` /
  ``N`` / ``X group id`` once its ack / nack / dead-letter returned; ``D group id`` once the
  dead-letter queue delivered it (``group``: the one it came from); ``S`` / ``E group id`` a
  stale settle on a long lease (a lease taken from a live process: a bug) / on a
  deliberately short one (expected); ``B text`` a corrupt payload.  A write() of a line is
  not torn by SIGKILL, so a line is there or it is not.
* per group, every confirmed message must meet a **fate**: acked by an ack that returned
  (``K``), drained at the end, in the dead-letter queue with this queue and group as its
  origin, or in the one ack in flight when its consumer was killed (a ``T`` without its
  outcome).  A delivery is no fate: a consumer killed holding a lease must have given it
  back, so that another gets it.  **lost** = confirmed without a fate; **delivered again
  after an ack** = acked and drained; **unexpected** = seen - attempted; **stranded** =
  depth left after the drain although gets return nothing.  Duplicates (at-least-once)
  are counted, not forbidden; a message seen at two offsets of its queue was **written
  twice** (a plain put never retries; an idempotent one must not).
* every child's exit status: -9 for those the parent killed (or that reached the crash point
  they were armed with), 0 for producers done with their quota; any other (an exception:
  its traceback is in ``<tag>.err``) fails the run.
* after the drain: no lease in flight, nothing retained, each queue still takes and gives
  a message, and ``shmq.core.check.check_instance`` finds no violated invariant.

The payload is the message's id (``queue:tag.n``) repeated 2 to 6 times (by ``n``), so a
torn or misplaced record shows.  Workload: ``put``, ``put_many`` and idempotent
``put_many(producer=, seq=)`` (a producer killed mid-batch is restarted under the same id
and retries its last batch: ``Duplicate`` means it was written); ``get``, ``get_many``,
``ack``, ``ack_many``, ``nack`` with and without a delay, ``touch``, ``dead_letter``, short
leases left to expire; consumers on the default group and on ``audit`` (every group sees
every message); one queue with ``max_deliveries=3`` feeding ``<queue>.dlq`` (kept small,
so dead-letter copies also meet a full DLQ and are retried); forced ``broker.reap()`` in a
loop racing the deliveries.  A share of the children is started with a crash point
(``shmq.crashpoints``) armed: they SIGKILL themselves between two stores that matter
(a lease word and the cursor, a record and its commit, ...), where a random kill would
hardly ever land.  With ``journal=True`` a ``shmq serve`` runs for the journal writer and
one queue is ``durability="interval"``.

``python bench/chaos.py --kills 1000`` is the command line; ``tests/crash/test_crash.py`` runs a
short storm.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shmq import crashpoints
from shmq.api import Message
from shmq.core.colocated import ShmBroker
from shmq.core.segment import objects_of, registry_name, shm_path
from shmq.errors import Empty, ShmqError
from shmq.testing.fates import GroupFate, Logs, Offsets, StormResult, group_fates, summary
from shmq.testing.roles import (
    AUDIT,
    CRASH_POINTS,
    Env,
    QueueSpec,
    Role,
    child_main,
    dlq_entry,
    parse_payload,
    payload,
    plan,
    queue_of,
    roles,
)

FINISH_TIMEOUT = 30.0  # s the producers have to stop once asked
DRAIN_TIMEOUT = 0.25  # s a drain get waits before the group counts as empty
KILL_WEIGHTS = {"producer": 3, "consumer": 4, "hog": 2, "reaper": 1}
KIND_CLASS = {"plain": "producer", "idem": "producer", "consumer": "consumer", "dlq": "consumer",
              "hog": "hog", "reaper": "reaper"}
TAG_PREFIX = {"plain": "p", "idem": "i", "consumer": "c", "dlq": "d", "hog": "h", "reaper": "r"}

__all__ = ["GroupFate", "QueueSpec", "Role", "StormResult", "parse_payload", "payload", "plan", "queue_of",
           "roles", "run_storm", "summary"]


# ============================================================== the broker (journaled queues)
class _Server:
    """``shmq serve --port 0 --workers 1`` for the journal writer, in its own session."""

    def __init__(self, instance: str, data_dir: str, log_dir: str) -> None:
        self.stderr_path = os.path.join(log_dir, "server.stderr")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from shmq.cli.app import app; app()", "serve", "--port", "0",
                 "--workers", "1", "--instance", instance, "--data-dir", data_dir],
                stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        line = b""
        deadline = time.monotonic() + 60
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
            while b"\n" not in line:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"shmq serve did not start: {line!r} {self.stderr()}")
                if sel.select(0.5):
                    chunk = os.read(self.proc.stdout.fileno(), 4096)  # type: ignore[union-attr]
                    line += chunk
        m = re.search(rb"tcp://[0-9.]+:(\d+)", line)
        self.port = int(m.group(1)) if m else 0

    def stderr(self) -> str:
        try:
            return Path(self.stderr_path).read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (graceful: it removes the instance's shared memory); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return -999
        finally:
            if self.proc.stdout:
                self.proc.stdout.close()

    def kill(self) -> None:
        """SIGKILL the broker and its workers (its own process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


# ============================================================== the storm
class _Storm:
    """The parent's side: spawn, kill, replace, and check each exit status."""

    def __init__(self, env: Env, rnd: random.Random, result: StormResult, crash_share: float) -> None:
        self.env = env
        self.rnd = rnd
        self.result = result
        self.crash_share = crash_share
        self.ctx = mp.get_context("fork")
        self.serial = itertools.count(1)
        self.live: dict[str, tuple[Role, Any]] = {}  # tag -> (role, process)

    def spawn(self, role: Role) -> None:
        tag = role.tag or f"{TAG_PREFIX[role.kind]}{next(self.serial)}"
        crash = ""
        points = [n for n in CRASH_POINTS.get(role.kind, ()) if n in crashpoints.POINTS]
        if points and self.rnd.random() < self.crash_share:
            crash = f"{self.rnd.choice(points)}:{self.rnd.randint(1, 10)}"
            self.result.armed += 1
        role = Role(role.kind, role.queue, role.group, tag, crash)
        p = self.ctx.Process(target=child_main, args=(role, self.env), name=f"chaos-{role.tag}")
        p.start()
        self.live[role.tag] = (role, p)
        self.result.spawned += 1

    def _ended(self, role: Role, p: Any, killed: bool) -> bool:
        """Check a child's exit status (it has ended); True when it finished its quota."""
        code = p.exitcode
        p.close()
        if killed and code == -signal.SIGKILL:
            return False
        if role.crash and code == -signal.SIGKILL:  # it reached its crash point
            self.result.crash_deaths[role.crash.partition(":")[0]] += 1
            return False
        if code == 0 and KIND_CLASS[role.kind] == "producer":
            self.result.finished += 1
            return True
        err = Path(self.env.log_dir, f"{role.tag}.err")
        why = err.read_text(errors="replace")[-3000:] if err.exists() else "(no traceback written)"
        self.result.bad_exits.append(f"{role.kind} {role.tag} ({role.queue}/{role.group}) "
                                     f"exited with {code}{' before its kill' if killed else ''}: {why}")
        return False

    def kill(self, tag: str) -> bool:
        """SIGKILL one child and reap it; True if it died of that kill."""
        role, p = self.live.pop(tag)
        if p.exitcode is None:  # polled: one that ended is reaped, and its pid may be anyone's now;
            os.kill(p.pid, signal.SIGKILL)  # one that ends after the poll stays a zombie until joined
        p.join()
        killed = p.exitcode == -signal.SIGKILL
        self._ended(role, p, killed=True)
        return killed

    def replace(self, role: Role, finished: bool) -> None:
        """A killed idempotent producer comes back under its tag (it retries its last batch);
        everything else under a new tag."""
        keep = role.kind == "idem" and not finished
        self.spawn(Role(role.kind, role.queue, role.group, role.tag if keep else ""))

    def poll(self) -> None:
        """Children that ended on their own: producers done (replaced), or failures."""
        for tag, (role, p) in list(self.live.items()):
            if p.exitcode is not None:
                del self.live[tag]
                finished = self._ended(role, p, killed=False)
                if finished or role.crash:
                    self.replace(role, finished=finished)

    def pick(self) -> str:
        classes = {KIND_CLASS[r.kind] for r, _ in self.live.values()}
        weights = {c: w for c, w in KILL_WEIGHTS.items() if c in classes}
        cls = self.rnd.choices(list(weights), list(weights.values()))[0]
        return self.rnd.choice(sorted(t for t, (r, _) in self.live.items() if KIND_CLASS[r.kind] == cls))

    def of_class(self, *classes: str) -> list[str]:
        return [t for t, (r, _) in self.live.items() if KIND_CLASS[r.kind] in classes]

    def kill_all(self) -> None:
        for tag in list(self.live):
            role, p = self.live.pop(tag)
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)
            p.join()
            p.close()


def _drain(b: ShmBroker, specs: list[QueueSpec], corrupted: list[str], offsets: Offsets
           ) -> tuple[dict[tuple[str, str], list[str]], dict[tuple[str, str], set[str]]]:
    """Empty every group of every queue, then the dead-letter queues, acknowledging all;
    again until a round finds nothing (a reap or a retried dead-letter copy may bring more)."""
    drained: dict[tuple[str, str], list[str]] = {}
    dlq_drained: dict[tuple[str, str], set[str]] = {}
    for _ in range(10):
        b.reap()
        for s in specs:
            b.queue(s.name).maintain()  # expired leases back, orphaned dead-letter copies retried
        found = 0
        for s in specs:
            q = b.queue(s.name)
            for g in ("default", AUDIT):
                for m in _empty(q, g):
                    ident, bad = parse_payload(m.payload, s.name)
                    if bad:
                        corrupted.append(f"drained from {s.name}/{g}: {bad}")
                    drained.setdefault((s.name, g), []).append(ident)
                    offsets.see(s.name, ident, m.offset)
                    found += 1
        for s in specs:
            if s.dlq:
                for m in _empty(b.queue(f"{s.name}.dlq"), "default"):
                    ident, bad, group = dlq_entry(m, s.name)
                    if bad:
                        corrupted.append(f"drained from {s.name}.dlq: {bad}")
                    dlq_drained.setdefault((s.name, group), set()).add(ident)
                    found += 1
        if not found:
            break
    return drained, dlq_drained


def _empty(q: Any, group: str) -> Iterator[Message]:
    while True:
        try:
            msgs = q.get_many(100, timeout=DRAIN_TIMEOUT, group=group)
        except Empty:
            return
        yield from msgs
        q.ack_many(msgs)


def _after_drain(b: ShmBroker, specs: list[QueueSpec], fates: list[GroupFate], result: StormResult) -> None:
    """Stranded depth, leases in flight, retained messages, lock recoveries; then that every
    queue still takes a message and gives it to each group."""
    names = [s.name for s in specs] + [f"{s.name}.dlq" for s in specs if s.dlq]
    by_key = {(f.queue, f.group): f for f in fates}
    for name in names:
        q = b.queue(name)
        st = q.stats()
        if st["config"]["durability"] != "memory":  # the journal's mark holds storage until it passes
            q.wait_durable(st["next_offset"], time.monotonic() + 10)
            st = q.stats()
        result.lock_recoveries += st["lock_recoveries"]
        for g, gs in st["groups"].items():
            if gs["depth"]:
                if (name, g) in by_key:
                    by_key[name, g].stranded = gs["depth"]
                else:
                    result.problems.append(f"{name}/{g}: depth {gs['depth']} left after the drain (stranded)")
            if gs["in_flight"]:
                result.problems.append(f"{name}/{g}: {gs['in_flight']} leases in flight after the drain")
        if st["retained"]:
            result.problems.append(f"{name}: {st['retained']} messages retained after the drain "
                                   f"(first offset {st['first_offset']}, next {st['next_offset']})")
    for name in names:
        q = b.queue(name)
        try:
            off = q.put(b"chaos: still works", timeout=2)
            for g in q.groups():
                m = q.get(timeout=2, group=g)
                if (m.offset, m.payload) != (off, b"chaos: still works"):
                    result.problems.append(f"{name}/{g}: after the storm a put at {off} came back as {m!r}")
                m.ack()
        except ShmqError as e:
            result.problems.append(f"{name}: does not work after the storm: {e!r}")


def _check(instance: str, result: StormResult) -> None:
    try:
        from shmq.core.check import check_instance
    except ImportError as e:  # being written alongside: say so rather than pass silently
        result.checker = False
        result.problems.append(f"shmq.core.check is not importable, the invariants were not checked: {e}")
        return
    try:
        result.violations += check_instance(instance)
    except Exception as e:  # noqa: BLE001 - a checker that fails is a finding, not a reason to lose the run
        result.problems.append(f"the invariant checker failed: {e!r}")


_counter = itertools.count()


def run_storm(kills: int = 1000, seconds: float = 600.0, seed: int = 0, *, instance: str | None = None,
              journal: bool = True, log_dir: str | None = None, gap: tuple[float, float] = (0.002, 0.03),
              crash_share: float = 0.3, progress: Callable[[str], None] | None = None,
              progress_every: float = 5.0) -> StormResult:
    """Run a storm (see the module's docstring) and return what it found.

    ``instance``: a fresh name (default ``chaos<pid>x<n>``); it is destroyed at the end.
    ``log_dir``: where the children's logs go (default: a temporary folder, removed when the
    run is clean, kept and named in the result otherwise).  ``gap``: the range of the random
    pause between two kills.  ``crash_share``: the share of children started with a crash point
    armed (``shmq.crashpoints``: one of those its kind passes, at a random pass); they die there
    by their own SIGKILL and are replaced like the killed ones.  ``progress``: called with a
    line now and then."""
    t0 = time.monotonic()
    instance = instance or f"chaos{os.getpid()}x{next(_counter)}"
    own_logs = log_dir is None
    log_dir = log_dir or tempfile.mkdtemp(prefix=f"shmq-chaos-{instance}-")
    say = progress or (lambda _line: None)
    rnd = random.Random(seed)
    specs = plan(journal)
    result = StormResult(instance, seed, journal, log_dir)
    ctx = mp.get_context("fork")
    env = Env(f"shm://{instance}", log_dir, ctx.RawValue("b", 0), seed, {s.name: s for s in specs})
    server: _Server | None = None
    data_dir = tempfile.mkdtemp(prefix=f"shmq-chaos-{instance}-data-") if journal else None
    storm = _Storm(env, rnd, result, crash_share)
    b: ShmBroker | None = None
    try:
        if data_dir:
            server = _Server(instance, data_dir, log_dir)
            say(f"shmq serve started on port {server.port} for the journal writer")
        b = ShmBroker(instance)
        for s in specs:
            q = b.create_queue(s.name, **s.limits)
            q.create_group(AUDIT)
            if s.dlq:
                b.create_queue(f"{s.name}.dlq", dead_letter=True, **s.dlq_limits)
        for role in roles(specs):
            storm.spawn(role)

        t_storm = time.monotonic()
        deadline = t_storm + seconds
        next_say = t_storm + progress_every
        while result.kills < kills and time.monotonic() < deadline and not result.bad_exits:
            time.sleep(rnd.uniform(*gap))  # the workload: spaces the kills (nothing waits on it)
            storm.poll()
            tag = storm.pick()
            role = storm.live[tag][0]
            if storm.kill(tag):
                result.kills += 1
                storm.replace(role, finished=False)
            else:
                storm.replace(role, finished=True)  # it finished just before the kill (or failed: reported)
            if time.monotonic() >= next_say:
                next_say += progress_every
                produced = sum(b.queue(s.name).stats()["next_offset"] for s in specs)
                say(f"{result.kills} kills, {sum(result.crash_deaths.values())} deaths at crash points, "
                    f"{time.monotonic() - t_storm:.1f} s, {produced} messages written, "
                    f"{result.spawned} processes started")
        result.storm_seconds = time.monotonic() - t_storm
        say(f"storm over: {result.kills} kills in {result.storm_seconds:.1f} s; stopping the children")

        # the end: consumers, hogs and reapers die; producers finish the operation they are in
        for tag in storm.of_class("consumer", "hog", "reaper"):
            storm.kill(tag)
        env.stop.value = 1
        finish = time.monotonic() + FINISH_TIMEOUT
        for tag in storm.of_class("producer"):
            role, p = storm.live.pop(tag)
            p.join(max(0.0, finish - time.monotonic()))
            if p.exitcode is None:
                result.bad_exits.append(f"{role.kind} {tag} ({role.queue}) did not stop within "
                                        f"{FINISH_TIMEOUT} s of being asked: {b.queue(role.queue).stats()}")
                os.kill(p.pid, signal.SIGKILL)  # not reaped: join timed out with the child alive
                p.join()
                p.close()
            elif p.exitcode != 0:
                storm._ended(role, p, killed=False)  # a crash point's death is fine, the rest is not
            else:
                p.close()

        logs = Logs(log_dir)
        drained, dlq_drained = _drain(b, specs, logs.corrupted, logs.offsets)
        fates = group_fates(specs, logs, drained, dlq_drained)
        _after_drain(b, specs, fates, result)
        _check(instance, result)
        result.groups = fates
        result.attempted, result.confirmed = len(logs.attempted), len(logs.confirmed)
        result.delivered = sum(f.delivered for f in fates)
        result.deliveries = sum(f.deliveries for f in fates)
        result.duplicates = sum(f.duplicates for f in fates)
        result.dead_lettered = sum(f.dead_lettered for f in fates)
        result.expected_stale = logs.expected_stale
        result.doubled = sorted(logs.offsets.doubled)
        result.corrupted = logs.corrupted
        result.stolen = logs.stolen
    finally:
        storm.kill_all()
        if b is not None:
            b.close()
        if server is not None:
            code = server.stop()
            if code != 0:
                result.problems.append(f"shmq serve exited with {code}: {server.stderr()}")
        if os.path.exists(shm_path(registry_name(instance))):
            ShmBroker(instance).destroy()
        left = objects_of(instance)
        if left:
            result.problems.append(f"left in /dev/shm: {left}")
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        result.seconds = time.monotonic() - t0
    if own_logs and result.ok:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result
