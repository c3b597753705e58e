"""Find and reclaim shared memory left behind by dead shmq instances.

An object is ours when its name matches ``shmq.<instance>.(reg|q<id>)...``
and, for segments, it carries our magic.  An instance is dead when no process
is attached to it: every attached process (and every child forked from one)
holds a shared ``flock`` on the registry's file, which the kernel releases when
the last holder dies, so an exclusive ``flock`` that can be taken is the proof.
It is held while the instance's objects are removed, and the registry's magic
is zeroed first, so a process attaching at that moment sees a dead registry and
makes a new one.  A live instance is never touched, except for objects its own
registry proves orphaned (an id it allocated but neither lists nor is creating),
which are removed under the registry lock.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import layout as L
from . import options, process
from .segment import SHM_DIR, Mapping, not_ours, unlink_semaphore, unlink_shm

_NAME = re.compile(
    r"^(?P<sem>sem\.)?shmq\.(?P<inst>[A-Za-z0-9_-]+)\."
    r"(?:(?P<reg>reg)(?:\.tmp(?P<tmppid>\d+)\.[0-9a-f]+)?|q(?P<qid>\d+)(?:\.(?:ne|nf|j|d))?)$")


@dataclass
class InstanceReport:
    instance: str
    alive: bool
    reason: str
    owner_pid: int = 0
    pids: list[int] = field(default_factory=list)
    queues: int = 0
    objects: list[str] = field(default_factory=list)  # names in /dev/shm
    orphans: list[str] = field(default_factory=list)  # of a live instance, safe to remove
    foreign: list[str] = field(default_factory=list)  # not ours (another user's, or open to others)


def _objects() -> dict[str, list[re.Match[str]]]:
    by_inst: dict[str, list[re.Match[str]]] = {}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return {}
    for n in names:
        m = _NAME.match(n)
        if m:
            by_inst.setdefault(m["inst"], []).append(m)
    return by_inst


def _age(name: str) -> float:
    try:
        return time.time() - os.stat(os.path.join(SHM_DIR, name)).st_mtime
    except FileNotFoundError:
        return 0.0


def scan(instance: str | None = None) -> list[InstanceReport]:
    reports = []
    for inst, matches in sorted(_objects().items()):
        if instance is not None and inst != instance:
            continue
        reports.append(_judge(inst, matches))
    return reports


@contextmanager
def _exclusive(reg_name: str) -> Iterator[bool]:
    """Try the exclusive flock of a registry: True (and held for the block) when no
    process is attached."""
    try:
        fd = os.open(os.path.join(SHM_DIR, reg_name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _foreign(name: str) -> str | None:
    """Why the object ``name`` (in /dev/shm) is not ours, None when it is (or is gone)."""
    try:
        return not_ours(os.stat(os.path.join(SHM_DIR, name)))
    except FileNotFoundError:
        return None


def _judge(inst: str, matches: list[re.Match[str]], dead: bool | None = None,
           claim: bool = False) -> InstanceReport:
    """``dead``: the caller holds the exclusive flock (True) or knows it is taken (False).
    ``claim``: the caller will remove a dead instance: its registry is marked dead first.
    Objects that are not ours are reported in ``foreign`` and never read or removed; an
    instance whose registry is not ours is left alone whole."""
    foreign = {m.string: why for m in matches if (why := _foreign(m.string)) is not None}
    if not foreign:
        return _judge_ours(inst, matches, dead, claim)
    reg_why = foreign.get(f"shmq.{inst}.reg")
    if reg_why is None:
        report = _judge_ours(inst, [m for m in matches if m.string not in foreign], dead, claim)
    else:
        report = InstanceReport(inst, True, f"its registry is {reg_why}: left alone")
    report.foreign = sorted(foreign)
    report.reason += f"; {len(foreign)} object(s) not ours, never touched"
    return report


def _judge_ours(inst: str, matches: list[re.Match[str]], dead: bool | None, claim: bool) -> InstanceReport:
    """``_judge`` of objects that are all ours."""
    names = [m.string for m in matches]
    tmp_alive = [m for m in matches if m["tmppid"] and process.start_ticks(int(m["tmppid"]))]
    reg_name = f"shmq.{inst}.reg"
    if reg_name not in names:
        young = [n for n in names if _age(n) < options.CREATION_GRACE]
        if tmp_alive or young:
            return InstanceReport(inst, True, "being created", objects=names)
        return InstanceReport(inst, False, "no registry: leftovers of a dead run", objects=names)
    if dead is None:
        with _exclusive(reg_name) as free:
            return _judge_ours(inst, matches, free, claim)
    try:
        mapping = Mapping.attach("/" + reg_name)
    except Exception as e:  # noqa: BLE001
        if dead:
            return InstanceReport(inst, False, f"registry unreadable ({e}), nobody attached", objects=names)
        return InstanceReport(inst, True, f"registry unreadable ({e}); left alone", objects=names)
    try:
        w = mapping.words
        valid = w[L.R_MAGIC] == L.REGISTRY_MAGIC
        owner = w[L.R_OWNER_PID] if valid else 0
        clients = []
        ids: set[int] = set()
        next_id = 0
        if valid:
            cw = w[L.R_CLIENTS_OFF] // L.WORD
            for slot in range(w[L.R_MAX_CLIENTS]):
                c = cw + slot * L.C_WORDS
                if w[c + L.C_STATE] == L.C_LIVE:
                    clients.append(w[c + L.C_PID])
            qw = w[L.R_QUEUES_OFF] // L.WORD
            ids = {w[qw + i * L.E_WORDS + L.E_QUEUE_ID] for i in range(w[L.R_MAX_QUEUES])
                   if w[qw + i * L.E_WORDS + L.E_STATE] != L.E_FREE}
            next_id = w[L.R_NEXT_QUEUE_ID]
        if dead and valid and claim:
            w[L.R_MAGIC] = 0  # whoever opened it a moment ago sees a dead registry once it may look
    finally:
        mapping.close()
    report = InstanceReport(inst, not dead, "", owner_pid=owner, pids=sorted(set(clients)),
                            queues=len(ids), objects=names)
    if dead:
        report.reason = "no process is attached" if valid else "registry destroyed or invalid"
    else:
        report.reason = "processes attached" + (f" (registered: {report.pids})" if clients else "")
        report.orphans = [m.string for m in matches
                          if m["qid"] and int(m["qid"]) not in ids and int(m["qid"]) < next_id]
    return report


def _unlink(name: str) -> bool:
    if name.startswith("sem."):
        return unlink_semaphore("/" + name[4:])
    return unlink_shm("/" + name)


def reclaim(instance: str | None = None, dry_run: bool = False) -> list[InstanceReport]:
    """Remove the objects of dead instances (and proven orphans of live ones).

    Returns the reports of the instances acted on (or that would be, with ``dry_run``).
    """
    acted = []
    for inst, matches in sorted(_objects().items()):
        if instance is not None and inst != instance:
            continue
        if dry_run:
            report = _judge(inst, matches)
        else:
            with _exclusive(f"shmq.{inst}.reg") as free:  # held while we remove
                report = _judge(inst, matches, free, claim=True)
                if not report.alive:
                    for n in report.objects:
                        _unlink(n)
        if not report.alive:
            acted.append(report)
        elif report.orphans:
            acted.append(report)
            if not dry_run:
                _remove_orphans(report)
    return acted


def _remove_orphans(report: InstanceReport) -> None:
    from .registry import Registry
    reg = Registry.open(report.instance, create=False)
    try:
        with reg.lock:  # ids listed or being created are not orphans
            reg.repair()
    finally:
        reg.close()
