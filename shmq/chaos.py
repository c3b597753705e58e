"""A fate-tracking SIGKILL storm: Jepsen-style proof that kills lose nothing and invent nothing.

``run_storm()`` makes a fresh instance with small queues (the ring wraps, producers meet
``Full``), runs producer, consumer, lock-hog and reaper processes (``fork``), and SIGKILLs
them at random (``random.Random(seed)``), starting a replacement for each one killed, until
``kills`` kills are done or ``seconds`` have passed.  Then it stops everything, drains every
group of every queue and the dead-letter queue, and checks each message's fate against what
the processes wrote down:

* each process logs, line-buffered, one line per event, before and after each call:
  ``A id`` before a put, ``C id`` once it returned (confirmed); ``G group id offset`` once a
  get returned it (delivered), ``K`` / ``N`` / ``X group id`` once its ack / nack /
  dead-letter returned; ``D group id`` once the dead-letter queue delivered it (``group``:
  the one it came from); ``S`` / ``E group id`` a stale settle on a long lease (a lease taken
  from a live process: a bug) / on a deliberately short one (expected); ``B text`` a corrupt
  payload.  A write() of a line is not torn by SIGKILL, so a line is there or it is not.
* per group: **lost** = confirmed - (delivered ∪ drained ∪ in the DLQ from this group);
  **vanished** = given back by a nack (or dead-lettered) that returned, every logged
  delivery of it ended so, and never seen again; **unexpected** = seen - attempted;
  **stranded** = depth left after the drain although gets return nothing.  Duplicates
  (at-least-once) are counted, not forbidden; a message seen at two offsets of its queue
  was **written twice** (a plain put never retries; an idempotent one must not).
* every child's exit status: -9 for those the parent killed (or that reached the crash point
  they were armed with), 0 for producers done with their quota; any other (an exception:
  its traceback is in ``<tag>.err``) fails the run.
* after the drain: no lease in flight, nothing retained, each queue still takes and gives
  a message, and ``shmq.check.check_instance`` finds no violated invariant.

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

``python bench/chaos.py --kills 1000`` is the command line; ``tests/test_crash.py`` runs a
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
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import connect, crashpoints
from .api import Message
from .errors import Duplicate, Empty, Full, ShmqError, StaleAck
from .shm import ShmBroker

AUDIT = "audit"  # the second group of every queue, made up front
SHORT_LEASE = 0.05  # s: a lease taken to be let expire
PUT_TIMEOUT = 0.5  # s: a producer gives up a put after this (Full: not written) and looks at the stop flag
GET_TIMEOUT = 0.2
PLAIN_QUOTA = 3000  # message ids a plain producer uses up before it exits 0
IDEM_BATCH = 4  # messages per idempotent batch
IDEM_QUOTA = 500  # batches an idempotent producer writes before it exits 0
FINISH_TIMEOUT = 30.0  # s the producers have to stop once asked
DRAIN_TIMEOUT = 0.25  # s a drain get waits before the group counts as empty
KILL_WEIGHTS = {"producer": 3, "consumer": 4, "hog": 2, "reaper": 1}
KIND_CLASS = {"plain": "producer", "idem": "producer", "consumer": "consumer", "dlq": "consumer",
              "hog": "hog", "reaper": "reaper"}
TAG_PREFIX = {"plain": "p", "idem": "i", "consumer": "c", "dlq": "d", "hog": "h", "reaper": "r"}
# the crash points (shmq.crashpoints) each kind of child passes: an armed child SIGKILLs itself
# at the N-th pass, between the two stores a random kill would almost never fall between
_SETTLE_POINTS = ("ack.done", "ack_range.done", "ack_batch.partial", "floor.moved", "nack.hints",
                  "touch.extended", "dead.marked", "dlq.copied", "dlq.orphaned", "expire.given_back")
_REAP_POINTS = ("reap.partial", "reap.queue", "registry.slot.freed")
CRASH_POINTS: dict[str, tuple[str, ...]] = {
    "plain": ("put.written", "put.committed", "put_many.written", "put_many.committed", "wait.announced",
              "registry.slot.taken"),
    "idem": ("put_idem.pending", "put_idem.entry", "put_idem.committed", "put_many.written",
             "put_many.committed", "wait.announced"),
    "consumer": ("deliver.one.leased", "deliver.run.leased", "deliver.block.leased", "deliver.cursor",
                 "redeliver.leased", "wait.announced", "registry.slot.taken", *_SETTLE_POINTS, *_REAP_POINTS),
    "dlq": ("deliver.run.leased", "deliver.block.leased", "deliver.one.leased", "deliver.cursor",
            "redeliver.leased", "ack_range.done", "ack_batch.partial", "floor.moved", "nack.hints"),
    "reaper": (*_REAP_POINTS, "expire.given_back", "nack.hints", "dlq.copied", "dlq.orphaned", "floor.moved"),
}


@dataclass(frozen=True)
class QueueSpec:
    """A queue of the storm and how its consumers treat deliveries (shares of them)."""

    name: str
    limits: dict[str, Any]
    nack: float = 0.05  # nack() at once
    delayed_nack: float = 0.03  # nack(delay)
    touch: float = 0.03  # touch() then ack()
    dead_letter: float = 0.0  # dead_letter()
    dlq: bool = False  # has <name>.dlq, made up front with dlq_limits
    dlq_limits: dict[str, Any] = field(default_factory=dict)


def plan(journal: bool) -> list[QueueSpec]:
    """The queues: small enough that the ring wraps and ``Full`` happens all the time."""
    specs = [
        QueueSpec("storm", dict(capacity=256, max_bytes=16 * 1024, visibility_timeout=10,
                                max_deliveries=255)),
        QueueSpec("flaky", dict(capacity=64, max_bytes=4096, visibility_timeout=10, max_deliveries=3),
                  nack=0.3, delayed_nack=0.1, dead_letter=0.03, dlq=True,
                  dlq_limits=dict(capacity=32, max_bytes=8192, visibility_timeout=10)),
    ]
    if journal:
        specs.append(QueueSpec("journal", dict(capacity=256, max_bytes=16 * 1024, visibility_timeout=10,
                                               max_deliveries=255, durability="interval")))
    return specs


@dataclass(frozen=True)
class Role:
    """What one child process does: ``kind`` on ``queue`` (``group`` for consumers), logging to
    ``<tag>.log``.  An idempotent producer killed is restarted with the same tag (and id)."""

    kind: str  # plain | idem | consumer | dlq | hog | reaper
    queue: str = ""
    group: str = ""
    tag: str = ""
    crash: str = ""  # "point:N": SIGKILL itself at the N-th pass through that crash point


def roles(specs: list[QueueSpec]) -> list[Role]:
    """The processes running at any time (a killed one is replaced by one of the same role)."""
    out: list[Role] = []
    for s in specs:
        out.append(Role("plain", s.name))
        if s.name != "flaky":
            out.append(Role("idem", s.name))
        for g in ("default", "default", AUDIT) if s.name == "storm" else ("default", AUDIT):
            out.append(Role("consumer", s.name, g))
        if s.dlq:
            out.append(Role("dlq", s.name))
    return out + [Role("hog"), Role("reaper")]


@dataclass
class _Env:
    """What every child gets (through fork: nothing is pickled)."""

    url: str
    log_dir: str
    stop: Any  # a RawValue: set to 1 when producers are to finish (no lock a SIGKILL could leave held)
    seed: int
    specs: dict[str, QueueSpec]


# ============================================================== payloads
def payload(ident: str, n: int) -> bytes:
    """The id, 2 to 6 times (by ``n``): a record torn or mixed with another shows."""
    return "|".join([ident] * (2 + n % 5)).encode()


def parse_payload(data: Any, queue: str) -> tuple[str, str | None]:
    """(the id, None) for a well-formed payload of ``queue``; else ("?", what is wrong): a
    corrupt message is reported as such, and its garbage never counts as an id."""
    try:
        text = bytes(data).decode()
    except UnicodeDecodeError:
        return "?", f"{queue}: payload is not UTF-8: {bytes(data)[:60]!r}"
    parts = text.split("|")
    ident = parts[0]
    try:
        n = int(ident.rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return "?", f"{queue}: payload without an id: {text[:80]!r}"
    if len(parts) != 2 + n % 5 or any(p != ident for p in parts) or not ident.startswith(queue + ":"):
        return "?", f"{queue}: corrupt or misplaced payload {text[:120]!r}"
    return ident, None


def queue_of(ident: str) -> str:
    return ident.split(":", 1)[0]


# ============================================================== the children
def _child_main(role: Role, env: _Env) -> None:
    """Run one role; an exception is written to ``<tag>.err`` and ends the process with 3,
    which the parent reports (it expects -9, or 0 from a producer done with its quota)."""
    try:
        if role.crash:
            name, _, n = role.crash.partition(":")
            crashpoints.arm(name, int(n))
        _BODIES[role.kind](role, env)
    except BaseException:  # noqa: BLE001 - anything a child dies of must reach the report
        with open(os.path.join(env.log_dir, f"{role.tag}.err"), "a") as f:
            f.write(f"{role} (pid {os.getpid()}):\n{traceback.format_exc()}\n")
        sys.exit(3)


def _rnd(role: Role, env: _Env) -> random.Random:
    return random.Random(f"{env.seed}/{role.tag}/{os.getpid()}")


def _log(role: Role, env: _Env) -> Any:
    return open(os.path.join(env.log_dir, f"{role.tag}.log"), "a", buffering=1)


def _plain_producer(role: Role, env: _Env) -> None:
    """put and put_many of fresh ids; a put that times out (Full) wrote nothing: its ids are
    left attempted, never confirmed."""
    q = connect(env.url).queue(role.queue)
    rnd = _rnd(role, env)
    n = 0
    with _log(role, env) as log:
        while n < PLAIN_QUOTA and not env.stop.value:
            k = 1 if rnd.random() < 0.5 else rnd.randint(2, 10)
            ids = [(f"{role.queue}:{role.tag}.{i}", i) for i in range(n, n + k)]
            n += k
            log.write("".join(f"A {ident}\n" for ident, _ in ids))
            try:
                if k == 1:
                    q.put(payload(*ids[0]), timeout=PUT_TIMEOUT)
                else:
                    q.put_many([payload(*x) for x in ids], timeout=PUT_TIMEOUT)
            except Full:
                continue
            log.write("".join(f"C {ident}\n" for ident, _ in ids))


def _resume_seq(path: str) -> int:
    """The batch an idempotent producer restarted under its old tag must retry: the last
    one it attempted (its ids are ``tag.n``, batch ``n // IDEM_BATCH + 1``), else 1."""
    last = -1
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("A ") and line.endswith("\n"):
                    last = max(last, int(line.rsplit(".", 1)[1]))
    except FileNotFoundError:
        pass
    return last // IDEM_BATCH + 1 if last >= 0 else 1


def _idem_producer(role: Role, env: _Env) -> None:
    """Idempotent batches: ``put_many(producer=, seq=)``.  A batch is retried until written:
    after a Full, or by the next incarnation after a kill; ``Duplicate`` says an earlier
    try wrote it, so it is confirmed."""
    q = connect(env.url).queue(role.queue)
    producer = f"chaos.{role.tag}"
    seq = _resume_seq(os.path.join(env.log_dir, f"{role.tag}.log"))
    with _log(role, env) as log:
        while seq <= IDEM_QUOTA and not env.stop.value:
            first = (seq - 1) * IDEM_BATCH
            ids = [(f"{role.queue}:{role.tag}.{i}", i) for i in range(first, first + IDEM_BATCH)]
            log.write("".join(f"A {ident}\n" for ident, _ in ids))
            try:
                q.put_many([payload(*x) for x in ids], timeout=PUT_TIMEOUT, producer=producer, seq=seq)
            except Full:
                continue
            except Duplicate:
                pass  # written by an earlier try whose confirmation was never logged
            log.write("".join(f"C {ident}\n" for ident, _ in ids))
            seq += 1


def _consumer(role: Role, env: _Env) -> None:
    """One group of one queue: get / get_many, then per message ack (batched with ack_many),
    nack, nack(delay), touch + ack or dead_letter; now and then a short lease left to
    expire, and a forced reap racing the others' deliveries."""
    b = connect(env.url)
    q = b.queue(role.queue)
    spec = env.specs[role.queue]
    g = role.group
    rnd = _rnd(role, env)
    with _log(role, env) as log:
        while True:
            if rnd.random() < 0.02:
                b.reap()  # type: ignore[attr-defined]
            n = rnd.choice((1, 1, 1, 5, 20))
            short = rnd.random() < 0.03
            vis = SHORT_LEASE if short else None
            try:
                if n == 1:
                    msgs = [q.get(g, timeout=GET_TIMEOUT, visibility_timeout=vis)]
                else:
                    msgs = q.get_many(n, g, timeout=GET_TIMEOUT, visibility_timeout=vis)
            except Empty:
                continue
            got: list[tuple[Message, str]] = []
            lines = []
            for m in msgs:
                ident, bad = parse_payload(m.payload, role.queue)
                if bad:
                    lines.append(f"B {g} offset {m.offset}: {bad}\n")
                lines.append(f"G {g} {ident} {m.offset}\n")
                got.append((m, ident))
            log.write("".join(lines))  # delivered: logged before any settle
            if short:
                time.sleep(SHORT_LEASE * 2)  # the workload: let the lease run out (its settle is stale)
            stale = "E" if short else "S"
            acks: list[tuple[Message, str]] = []
            for m, ident in got:
                r = rnd.random()
                try:
                    if r < spec.nack:
                        m.nack()
                        log.write(f"N {g} {ident}\n")
                    elif (r := r - spec.nack) < spec.delayed_nack:
                        m.nack(delay=rnd.choice((0.01, 0.05)))
                        log.write(f"N {g} {ident}\n")
                    elif (r := r - spec.delayed_nack) < spec.dead_letter:
                        m.dead_letter()
                        log.write(f"X {g} {ident}\n")
                    elif r - spec.dead_letter < spec.touch:
                        m.touch()
                        m.ack()
                        log.write(f"K {g} {ident}\n")
                    else:
                        acks.append((m, ident))
                except StaleAck:
                    log.write(f"{stale} {g} {ident}\n")
            if len(acks) == 1:
                m, ident = acks[0]
                try:
                    m.ack()
                    log.write(f"K {g} {ident}\n")
                except StaleAck:
                    log.write(f"{stale} {g} {ident}\n")
            elif acks:
                refused: set[int] = set()
                try:
                    q.ack_many([m for m, _ in acks])
                except StaleAck as e:
                    refused = set(e.stale)
                log.write("".join(f"{stale if m.offset in refused else 'K'} {g} {ident}\n"
                                  for m, ident in acks))


def _dlq_consumer(role: Role, env: _Env) -> None:
    """Empties ``<queue>.dlq`` (kept small, so it must be emptied), checking each origin."""
    q = connect(env.url).queue(f"{role.queue}.dlq")
    rnd = _rnd(role, env)
    with _log(role, env) as log:
        while True:
            try:
                msgs = q.get_many(rnd.choice((1, 10)), timeout=GET_TIMEOUT)
            except Empty:
                continue
            lines = []
            for m in msgs:
                ident, bad, group = _dlq_entry(m, role.queue)
                if bad:
                    lines.append(f"B dlq offset {m.offset}: {bad}\n")
                lines.append(f"D {group} {ident}\n")
            log.write("".join(lines))
            try:
                if rnd.random() < 0.05:
                    msgs[0].nack()  # a dead-letter queue redelivers too
                    msgs = msgs[1:]
                q.ack_many(msgs)
            except StaleAck:
                log.write("S dlq -\n")


def _dlq_entry(m: Message, source: str) -> tuple[str, str | None, str]:
    """(id, what is wrong or None, the group it was dead-lettered from) of a DLQ message."""
    ident, bad = parse_payload(m.payload, source)
    origin = m.origin
    if origin is None:
        return ident, bad or f"{source}.dlq: offset {m.offset} has no origin", "?"
    if origin.queue != source and not bad:
        bad = f"{source}.dlq: offset {m.offset} says it came from {origin.queue!r}"
    return ident, bad, origin.group


def _lock_hog(role: Role, env: _Env) -> None:
    """Holds a queue's producer or consumer lock (now and then the registry's) much of the
    time, so that kills land inside locks and the next holder must recover."""
    b = connect(env.url)
    reg = b._att.registry  # type: ignore[attr-defined]
    names = [s.name for s in env.specs.values()] + [f"{s.name}.dlq" for s in env.specs.values() if s.dlq]
    rings = [b.queue(n)._ring for n in names]  # type: ignore[attr-defined]
    rnd = _rnd(role, env)
    while True:
        if rnd.random() < 0.03:
            lock = reg.lock
        else:
            ring = rnd.choice(rings)
            lock = ring.plock if rnd.random() < 0.5 else ring.clock
        lock.acquire()
        time.sleep(rnd.uniform(0, 0.002))
        lock.release()
        time.sleep(rnd.uniform(0, 0.001))


def _reaper(role: Role, env: _Env) -> None:
    """Forced reaps in a loop (besides those consumers run), and now and then a queue's
    maintenance (lease expiry, dead-letter retries) through stats()."""
    b = connect(env.url)
    queues = [b.queue(n) for n in env.specs]
    rnd = _rnd(role, env)
    while True:
        b.reap()  # type: ignore[attr-defined]
        if rnd.random() < 0.1:
            rnd.choice(queues).stats()
        time.sleep(rnd.uniform(0, 0.01))


_BODIES: dict[str, Callable[[Role, _Env], None]] = {
    "plain": _plain_producer, "idem": _idem_producer, "consumer": _consumer, "dlq": _dlq_consumer,
    "hog": _lock_hog, "reaper": _reaper,
}


# ============================================================== the broker (journaled queues)
class _Server:
    """``shmq serve --port 0 --workers 1`` for the journal writer, in its own session."""

    def __init__(self, instance: str, data_dir: str, log_dir: str) -> None:
        self.stderr_path = os.path.join(log_dir, "server.stderr")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from shmq.cli import app; app()", "serve", "--port", "0",
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


# ============================================================== fates
@dataclass
class GroupFate:
    """The fate of one group's messages (the queue's ids: lost, unexpected, ... are ids)."""

    queue: str
    group: str
    confirmed: int = 0
    delivered: int = 0  # distinct ids delivered during the storm or drained after it
    deliveries: int = 0  # deliveries logged + drained
    drained: int = 0
    dead_lettered: int = 0  # distinct ids in the dead-letter queue from this group
    duplicates: int = 0  # deliveries - delivered: at-least-once, not an error
    lost: list[str] = field(default_factory=list)
    vanished: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    stranded: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.vanished or self.unexpected or self.stranded)


@dataclass
class StormResult:
    """Everything a storm found; ``ok`` when no check failed."""

    instance: str
    seed: int
    journal: bool
    log_dir: str
    seconds: float = 0.0  # the whole run
    storm_seconds: float = 0.0  # the kills
    kills: int = 0
    spawned: int = 0
    finished: int = 0  # producers that exited 0 after their quota
    attempted: int = 0
    confirmed: int = 0
    delivered: int = 0  # distinct (group, id) delivered or drained, over every group
    deliveries: int = 0
    duplicates: int = 0
    dead_lettered: int = 0
    expected_stale: int = 0  # settles of short leases that had run out: expected
    armed: int = 0  # children started with a crash point armed
    crash_deaths: Counter[str] = field(default_factory=Counter)  # crash point -> children that died there
    lock_recoveries: int = 0
    groups: list[GroupFate] = field(default_factory=list)
    doubled: list[str] = field(default_factory=list)  # ids seen at two offsets of their queue
    corrupted: list[str] = field(default_factory=list)
    stolen: list[str] = field(default_factory=list)  # stale settles of long leases: taken from the living
    bad_exits: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)  # shmq.check.check_instance
    problems: list[str] = field(default_factory=list)  # in flight, retained, still works, leftovers, ...
    checker: bool = True  # shmq.check could be imported

    @property
    def lost(self) -> dict[str, list[str]]:
        return {f"{f.queue}/{f.group}": f.lost + f.vanished for f in self.groups if f.lost or f.vanished}

    @property
    def unexpected(self) -> dict[str, list[str]]:
        return {f"{f.queue}/{f.group}": f.unexpected for f in self.groups if f.unexpected}

    @property
    def stranded(self) -> dict[str, int]:
        return {f"{f.queue}/{f.group}": f.stranded for f in self.groups if f.stranded}

    @property
    def ok(self) -> bool:
        return (all(f.ok for f in self.groups) and not self.doubled and not self.corrupted
                and not self.stolen and not self.bad_exits and not self.violations and not self.problems
                and self.checker)


class _Logs:
    """Every child's log, read back: sets and counts per (queue, group)."""

    def __init__(self, log_dir: str) -> None:
        self.attempted: set[str] = set()
        self.confirmed: set[str] = set()
        self.got: dict[tuple[str, str], Counter[str]] = {}
        self.acked: dict[tuple[str, str], set[str]] = {}
        self.nacked: dict[tuple[str, str], Counter[str]] = {}
        self.dead: dict[tuple[str, str], set[str]] = {}
        self.in_dlq: dict[tuple[str, str], set[str]] = {}
        self.offsets = _Offsets()
        self.corrupted: list[str] = []
        self.stolen: list[str] = []
        self.expected_stale = 0
        for f in sorted(Path(log_dir).glob("*.log")):
            self._read(f)

    def _read(self, path: Path) -> None:
        text = path.read_text(errors="replace")
        lines = text.split("\n")
        if lines and lines[-1]:
            lines[-1] = ""  # no newline: not a whole line (a write never tears one, but be sure)
        for line in lines:
            if not line:
                continue
            kind = line[0]
            if kind == "A":
                self.attempted.add(line[2:])
            elif kind == "C":
                self.confirmed.add(line[2:])
            elif kind == "B":
                self.corrupted.append(f"{path.name}: {line[2:]}")
            elif kind == "G":
                _, g, ident, off = line.split(" ", 3)
                key = (queue_of(ident), g)
                self.got.setdefault(key, Counter())[ident] += 1
                self.offsets.see(key[0], ident, int(off))
            elif kind in "KNXDSE":
                _, g, ident = line.split(" ", 2)
                if kind == "E":
                    self.expected_stale += 1
                elif kind == "S":
                    self.stolen.append(f"{path.name}: group {g}, {ident}")
                else:
                    table: Any = {"K": self.acked, "N": self.nacked, "X": self.dead, "D": self.in_dlq}[kind]
                    key = (queue_of(ident), g)
                    if kind == "N":
                        table.setdefault(key, Counter())[ident] += 1
                    else:
                        table.setdefault(key, set()).add(ident)


class _Offsets:
    """The offset each id was seen at in its queue: a second one means it was written twice."""

    def __init__(self) -> None:
        self.first: dict[tuple[str, str], int] = {}
        self.doubled: set[str] = set()

    def see(self, queue: str, ident: str, offset: int) -> None:
        if ident != "?" and self.first.setdefault((queue, ident), offset) != offset:
            self.doubled.add(f"{ident} at offsets {self.first[queue, ident]} and {offset}")


def _fates(specs: list[QueueSpec], logs: _Logs, drained: dict[tuple[str, str], list[str]],
           dlq_drained: dict[tuple[str, str], set[str]]) -> list[GroupFate]:
    out = []
    for s in specs:
        attempted = {i for i in logs.attempted if queue_of(i) == s.name}
        confirmed = {i for i in logs.confirmed if queue_of(i) == s.name}
        for g in ("default", AUDIT):
            key = (s.name, g)
            got = logs.got.get(key, Counter())
            dr = drained.get(key, [])
            seen = set(got) | set(dr)
            dlq = logs.in_dlq.get(key, set()) | dlq_drained.get(key, set())
            nacked = logs.nacked.get(key, Counter())
            # given back by every logged delivery (nack returned), so delivered again, drained or
            # dead-lettered; or dead-lettered by a call that returned, so in the DLQ
            returned = {i for i, n in nacked.items() if got[i] <= n} | logs.dead.get(key, set())
            f = GroupFate(s.name, g, confirmed=len(confirmed), delivered=len(seen),
                          deliveries=sum(got.values()) + len(dr), drained=len(dr), dead_lettered=len(dlq))
            f.duplicates = f.deliveries - f.delivered
            f.lost = sorted(confirmed - seen - dlq)
            f.vanished = sorted(returned - set(dr) - dlq - set(f.lost))
            f.unexpected = sorted((seen | dlq) - attempted)
            out.append(f)
    return out


# ============================================================== the storm
class _Storm:
    """The parent's side: spawn, kill, replace, and check each exit status."""

    def __init__(self, env: _Env, rnd: random.Random, result: StormResult, crash_share: float) -> None:
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
        p = self.ctx.Process(target=_child_main, args=(role, self.env), name=f"chaos-{role.tag}")
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


def _drain(b: ShmBroker, specs: list[QueueSpec], corrupted: list[str], offsets: _Offsets
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
                    ident, bad, group = _dlq_entry(m, s.name)
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
            msgs = q.get_many(100, group, timeout=DRAIN_TIMEOUT)
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
                m = q.get(g, timeout=2)
                if (m.offset, m.payload) != (off, b"chaos: still works"):
                    result.problems.append(f"{name}/{g}: after the storm a put at {off} came back as {m!r}")
                m.ack()
        except ShmqError as e:
            result.problems.append(f"{name}: does not work after the storm: {e!r}")


def _check(instance: str, result: StormResult) -> None:
    try:
        from .check import check_instance
    except ImportError as e:  # being written alongside: say so rather than pass silently
        result.checker = False
        result.problems.append(f"shmq.check is not importable, the invariants were not checked: {e}")
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
    env = _Env(f"shm://{instance}", log_dir, ctx.RawValue("b", 0), seed, {s.name: s for s in specs})
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
                b.create_queue(f"{s.name}.dlq", **s.dlq_limits)
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

        logs = _Logs(log_dir)
        drained, dlq_drained = _drain(b, specs, logs.corrupted, logs.offsets)
        fates = _fates(specs, logs, drained, dlq_drained)
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
        if os.path.exists(f"/dev/shm/shmq.{instance}.reg"):
            ShmBroker(instance).destroy()
        left = sorted(n for n in os.listdir("/dev/shm")
                      if n.startswith(f"shmq.{instance}.") or n.startswith(f"sem.shmq.{instance}."))
        if left:
            result.problems.append(f"left in /dev/shm: {left}")
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)
        result.seconds = time.monotonic() - t0
    if own_logs and result.ok:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result


def summary(r: StormResult) -> str:
    """One paragraph: what ran, the figures, and every failed check (the first few ids each)."""
    def few(xs: list[str], n: int = 5) -> str:
        return ", ".join(xs[:n]) + (f", ... ({len(xs)} in all)" if len(xs) > n else "")

    text = (f"chaos storm seed {r.seed} on {r.instance}{' with a journaled queue' if r.journal else ''}: "
            f"{r.kills} kills in {r.storm_seconds:.1f} s ({r.seconds:.1f} s in all), {r.spawned} processes "
            f"started ({r.armed} with a crash point armed; {sum(r.crash_deaths.values())} died at one, "
            f"at {len(r.crash_deaths)} different points), {r.finished} producer(s) finished their quota; "
            f"{r.attempted} messages attempted, "
            f"{r.confirmed} confirmed; {r.delivered} delivered over {len(r.groups)} groups "
            f"({r.deliveries} deliveries, {r.duplicates} duplicates), {r.dead_lettered} dead-lettered, "
            f"{r.expected_stale} short leases expired under their consumer; "
            f"{r.lock_recoveries} lock recoveries.")
    bad = []
    for f in r.groups:
        if f.lost:
            bad.append(f"{f.queue}/{f.group} LOST {len(f.lost)} confirmed: {few(f.lost)}")
        if f.vanished:
            bad.append(f"{f.queue}/{f.group} VANISHED {len(f.vanished)} after a nack or dead-letter: "
                       f"{few(f.vanished)}")
        if f.unexpected:
            bad.append(f"{f.queue}/{f.group} UNEXPECTED {len(f.unexpected)}: {few(f.unexpected)}")
        if f.stranded:
            bad.append(f"{f.queue}/{f.group} STRANDED: depth {f.stranded} after the drain")
    for label, xs in (("WRITTEN TWICE", r.doubled), ("CORRUPTED", r.corrupted),
                      ("LEASES TAKEN FROM LIVE CONSUMERS (stale settles of long leases)", r.stolen),
                      ("BAD EXITS", r.bad_exits), ("INVARIANT VIOLATIONS", r.violations),
                      ("PROBLEMS", r.problems)):
        if xs:
            bad.append(f"{label} ({len(xs)}): {few(xs, 3)}")
    if bad:
        return text + " FAILED: " + "; ".join(bad) + f". Logs in {r.log_dir}."
    return text + " Nothing lost, nothing invented, nothing stranded; every exit status as expected" + (
        "; the invariant checker found nothing." if r.checker else ".")
