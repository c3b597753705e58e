"""The verdict of a chaos storm (``shmq.testing.chaos``): every message's fate, from the children's logs.

:class:`Logs` reads back what the processes wrote down; :func:`group_fates` sets it
against what the drain found, per group (lost, redelivered, unexpected, duplicates: the
definitions are in ``shmq.testing.chaos``'s docstring); :class:`StormResult` holds all a storm
found and :func:`summary` says it in one paragraph.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shmq.testing.roles import AUDIT, QueueSpec, queue_of


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
    in_flight: int = 0  # ids whose ack was in flight when its consumer was killed
    lost: list[str] = field(default_factory=list)
    redelivered: list[str] = field(default_factory=list)  # drained although an ack of it returned
    unexpected: list[str] = field(default_factory=list)
    stranded: int = 0

    @property
    def ok(self) -> bool:
        return not (self.lost or self.redelivered or self.unexpected or self.stranded)


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
    violations: list[str] = field(default_factory=list)  # shmq.core.check.check_instance
    problems: list[str] = field(default_factory=list)  # in flight, retained, still works, leftovers, ...
    checker: bool = True  # shmq.core.check could be imported

    @property
    def lost(self) -> dict[str, list[str]]:
        return {f"{f.queue}/{f.group}": f.lost for f in self.groups if f.lost}

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


class Logs:
    """Every child's log, read back: sets and counts per (queue, group)."""

    def __init__(self, log_dir: str) -> None:
        self.attempted: set[str] = set()
        self.confirmed: set[str] = set()
        self.got: dict[tuple[str, str], Counter[str]] = {}
        self.acked: dict[tuple[str, str], set[str]] = {}
        self.in_dlq: dict[tuple[str, str], set[str]] = {}
        self.in_flight: dict[tuple[str, str], set[str]] = {}  # acks begun (T), no outcome: a kill
        self.offsets = Offsets()
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
        begun: set[tuple[str, str]] = set()  # (group, id) of the last T whose outcome is not logged yet
        for line in lines:
            if not line:
                continue
            kind = line[0]
            if kind == "T":
                _, g, *ids = line.split(" ")
                begun = {(g, i) for i in ids}
            elif kind == "A":
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
            elif kind in "KDSE":  # (N and X need nothing: their outcome shows, redelivered or in the DLQ)
                _, g, ident = line.split(" ", 2)
                if kind != "D":
                    begun.discard((g, ident))  # the ack's outcome is logged
                if kind == "E":
                    self.expected_stale += 1
                elif kind == "S":
                    self.stolen.append(f"{path.name}: group {g}, {ident}")
                else:
                    table = self.acked if kind == "K" else self.in_dlq
                    table.setdefault((queue_of(ident), g), set()).add(ident)
        for g, ident in begun:  # the ack in flight when this process was killed
            self.in_flight.setdefault((queue_of(ident), g), set()).add(ident)


class Offsets:
    """The offset each id was seen at in its queue: a second one means it was written twice."""

    def __init__(self) -> None:
        self.first: dict[tuple[str, str], int] = {}
        self.doubled: set[str] = set()

    def see(self, queue: str, ident: str, offset: int) -> None:
        if ident != "?" and self.first.setdefault((queue, ident), offset) != offset:
            self.doubled.add(f"{ident} at offsets {self.first[queue, ident]} and {offset}")


def group_fates(specs: list[QueueSpec], logs: Logs, drained: dict[tuple[str, str], list[str]],
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
            dlq = logs.in_dlq.get(key, set()) | dlq_drained.get(key, set())  # origin: this queue, group
            acked = logs.acked.get(key, set())
            in_flight = logs.in_flight.get(key, set())
            f = GroupFate(s.name, g, confirmed=len(confirmed), delivered=len(seen),
                          deliveries=sum(got.values()) + len(dr), drained=len(dr), dead_lettered=len(dlq),
                          in_flight=len(in_flight))
            f.duplicates = f.deliveries - f.delivered
            # every confirmed message meets a fate: acked by an ack that returned, drained at the
            # end, in the DLQ from this group, or the ack in flight at its consumer's kill.  A
            # delivery alone is none: a consumer killed holding it must have given it back.
            f.lost = sorted(confirmed - acked - set(dr) - dlq - in_flight)
            f.redelivered = sorted(acked & set(dr))  # an acknowledged message is never delivered again
            f.unexpected = sorted((seen | dlq) - attempted)
            out.append(f)
    return out


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
        if f.redelivered:
            bad.append(f"{f.queue}/{f.group} DELIVERED AGAIN AFTER AN ACK {len(f.redelivered)}: "
                       f"{few(f.redelivered)}")
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
