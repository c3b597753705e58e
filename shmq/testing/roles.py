"""The processes of a chaos storm (``shmq.testing.chaos``): the queues they use, what each role does,
and the event log each one writes.

A role is one kind of child process (``fork``-ed by the storm): a plain or idempotent
producer, a consumer of one group, a dead-letter queue consumer, a lock hog or a reaper.
Each logs one line per event, before and after each call (the line format is in
``shmq.testing.chaos``'s docstring), which ``testing.fates`` reads back to judge every message's
fate.  A payload is its message's id repeated (:func:`payload`), so a torn or misplaced
record shows (:func:`parse_payload`).
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmq import connect, crashpoints
from shmq.api import Message
from shmq.errors import Duplicate, Empty, Full, StaleAck

AUDIT = "audit"  # the second group of every queue, made up front
SHORT_LEASE = 0.05  # s: a lease taken to be let expire
PUT_TIMEOUT = 0.5  # s: a producer gives up a put after this (Full: not written) and looks at the stop flag
GET_TIMEOUT = 0.2
PLAIN_QUOTA = 3000  # message ids a plain producer uses up before it exits 0
IDEM_BATCH = 4  # messages per idempotent batch
IDEM_QUOTA = 500  # batches an idempotent producer writes before it exits 0
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
class Env:
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
def child_main(role: Role, env: Env) -> None:
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


def _rnd(role: Role, env: Env) -> random.Random:
    return random.Random(f"{env.seed}/{role.tag}/{os.getpid()}")


def _log(role: Role, env: Env) -> Any:
    return open(os.path.join(env.log_dir, f"{role.tag}.log"), "a", buffering=1)


def _plain_producer(role: Role, env: Env) -> None:
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


def _idem_producer(role: Role, env: Env) -> None:
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


def _consumer(role: Role, env: Env) -> None:
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
                    msgs = [q.get(timeout=GET_TIMEOUT, group=g, visibility_timeout=vis)]
                else:
                    msgs = q.get_many(n, timeout=GET_TIMEOUT, group=g, visibility_timeout=vis)
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
                if r >= spec.nack + spec.delayed_nack + spec.dead_letter + spec.touch:
                    acks.append((m, ident))  # (acked below, with the others)
                    continue
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
                    else:
                        m.touch()
                        log.write(f"T {g} {ident}\n")  # an ack begun: its K follows, or a kill did
                        m.ack()
                        log.write(f"K {g} {ident}\n")
                except StaleAck:
                    log.write(f"{stale} {g} {ident}\n")
            if acks:  # (a nack or a dead-letter in flight at a kill leaves a trace: no T for those)
                log.write(f"T {g} {' '.join(ident for _, ident in acks)}\n")
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


def _dlq_consumer(role: Role, env: Env) -> None:
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
                ident, bad, group = dlq_entry(m, role.queue)
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


def dlq_entry(m: Message, source: str) -> tuple[str, str | None, str]:
    """(id, what is wrong or None, the group it was dead-lettered from) of a DLQ message."""
    ident, bad = parse_payload(m.payload, source)
    origin = m.origin
    if origin is None:
        return ident, bad or f"{source}.dlq: offset {m.offset} has no origin", "?"
    if origin.queue != source and not bad:
        bad = f"{source}.dlq: offset {m.offset} says it came from {origin.queue!r}"
    return ident, bad, origin.group


def _lock_hog(role: Role, env: Env) -> None:
    """Holds a queue's producer or consumer lock (now and then the registry's) much of the
    time, so that kills land inside locks and the next holder must recover."""
    b = connect(env.url)
    reg = b.registry  # type: ignore[attr-defined]
    names = [s.name for s in env.specs.values()] + [f"{s.name}.dlq" for s in env.specs.values() if s.dlq]
    rings = [b.queue(n).ring for n in names]  # type: ignore[attr-defined]
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


def _reaper(role: Role, env: Env) -> None:
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


_BODIES: dict[str, Callable[[Role, Env], None]] = {
    "plain": _plain_producer, "idem": _idem_producer, "consumer": _consumer, "dlq": _dlq_consumer,
    "hog": _lock_hog, "reaper": _reaper,
}
