"""Find and reclaim shared memory left behind by dead shmq instances.

An object is ours when its name matches ``shmq.<uid>.<instance>.(reg|q<id>)...``
with our effective uid (``segment.OBJECT_NAME``), it is owned by us and open to
nobody else, and, for segments, it carries our magic.  An instance is dead when no
process is attached to it: every attached process (and every child forked from
one) holds a shared ``flock`` on the registry's file, which the kernel releases
when the last holder dies, so an exclusive ``flock`` that can be taken is the
proof.  It is held while the instance's objects are removed, and the registry's
magic is zeroed first, so a process attaching at that moment sees a dead registry
and makes a new one.  A live instance is never touched, except for objects its own
registry proves orphaned (an id it allocated but neither lists nor is creating),
which are removed under the registry lock.

Two other kinds of names are reported too.  Names of another uid are another
user's instance: all its objects are listed in ``foreign`` and never read nor
removed, even by root (their owner, or root by hand, removes them).  Names without
a uid (``shmq.<instance>.*``) are leftovers of an older version of shmq: they are
judged as ours are (live while a process holds their registry's flock) and, once
dead, those of them that are ours are removed; the others stay in ``foreign``.
"""

from __future__ import annotations

import fcntl
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shmq import options, process
from shmq.core import layout as L
from shmq.core.segment import (
    PREFIX,
    SHM_DIR,
    Mapping,
    describe_user,
    instance_prefix,
    not_ours,
    parse_object_name,
    unlink_semaphore,
    unlink_shm,
)

Key = tuple[str, int | None]  # (instance, the uid its names carry: None in an older version's)


@dataclass
class InstanceReport:
    instance: str
    alive: bool  # True also for what is left alone unjudged (another user's instance)
    reason: str
    owner_pid: int = 0
    pids: list[int] = field(default_factory=list)
    queues: int = 0
    objects: list[str] = field(default_factory=list)  # names in /dev/shm
    orphans: list[str] = field(default_factory=list)  # of a live instance, safe to remove
    foreign: list[str] = field(default_factory=list)  # not ours (another user's, or open to others)
    uid: int | None = None  # the uid its names carry; None: names of an older version, without one


def _objects() -> dict[Key, list[re.Match[str]]]:
    by_key: dict[Key, list[re.Match[str]]] = {}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return {}
    for n in names:
        m = parse_object_name(n)
        if m:
            by_key.setdefault((m["inst"], None if m["uid"] is None else int(m["uid"])), []).append(m)
    return by_key


def _groups(instance: str | None) -> list[tuple[Key, list[re.Match[str]]]]:
    """The objects in /dev/shm by instance and uid (of ``instance`` only, when given)."""
    return sorted(((k, v) for k, v in _objects().items() if instance is None or k[0] == instance),
                  key=lambda kv: (kv[0][0], -1 if kv[0][1] is None else kv[0][1]))


def _registry_file(inst: str, uid: int | None) -> str:
    """The registry's name in /dev/shm: ``shmq.<uid>.<inst>.reg``, or an older version's."""
    return f"{PREFIX}{inst}.reg" if uid is None else f"{instance_prefix(inst, uid)}reg"


def _age(name: str) -> float:
    try:
        return time.time() - os.stat(os.path.join(SHM_DIR, name)).st_mtime
    except FileNotFoundError:
        return 0.0


def scan(instance: str | None = None) -> list[InstanceReport]:
    return [_judge(inst, uid, matches) for (inst, uid), matches in _groups(instance)]


@contextmanager
def _exclusive(reg_name: str) -> Iterator[bool]:
    """Try the exclusive flock of a registry: True (and held for the block) when no
    process is attached."""
    try:
        fd = os.open(os.path.join(SHM_DIR, reg_name), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    except PermissionError:  # not ours (``_judge`` leaves it alone): we cannot tell
        yield False
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


def _judge(inst: str, uid: int | None, matches: list[re.Match[str]], dead: bool | None = None,
           claim: bool = False) -> InstanceReport:
    """``dead``: the caller holds the exclusive flock (True) or knows it is taken (False).
    ``claim``: the caller will remove a dead instance: its registry is marked dead first.
    Objects that are not ours are reported in ``foreign`` and never read or removed; an
    instance whose registry is not ours, or whose names are another uid's, is left alone
    whole.  ``uid`` None: the names of an older version (judged, never repaired)."""
    if uid is not None and uid != os.geteuid():
        return _judge_theirs(inst, uid, matches)
    foreign = {m.string: why for m in matches if (why := _foreign(m.string)) is not None}
    if not foreign:
        report = _judge_ours(inst, uid, matches, dead, claim)
    else:
        reg_why = foreign.get(_registry_file(inst, uid))
        if reg_why is None:
            report = _judge_ours(inst, uid, [m for m in matches if m.string not in foreign], dead, claim)
        else:
            report = InstanceReport(inst, True, f"its registry is {reg_why}: left alone")
        report.foreign = sorted(foreign)
        report.reason += f"; {len(foreign)} object(s) not ours, never touched"
    report.uid = uid
    if uid is None:  # its orphans would be found under our names: only a dead one is acted on
        report.orphans = []
        report.reason = f"names of an older shmq version, without the uid: {report.reason}"
    return report


def _judge_theirs(inst: str, uid: int, matches: list[re.Match[str]]) -> InstanceReport:
    """Another user's instance (its names carry their uid): listed, never opened nor removed."""
    names = sorted(m.string for m in matches)
    owners = set()
    for n in names:
        try:
            owners.add(os.stat(os.path.join(SHM_DIR, n)).st_uid)
        except FileNotFoundError:
            pass
    owned = ", ".join(describe_user(o) for o in sorted(owners)) or "nobody (gone)"
    return InstanceReport(inst, True, f"another user's: names of {describe_user(uid)}, owned by "
                          f"{owned}; never touched", foreign=names, uid=uid)


def _judge_ours(inst: str, uid: int | None, matches: list[re.Match[str]], dead: bool | None,
                claim: bool) -> InstanceReport:
    """``_judge`` of objects that are all ours."""
    names = [m.string for m in matches]
    tmp_alive = [m for m in matches if m["tmppid"] and process.start_ticks(int(m["tmppid"]))]
    reg_name = _registry_file(inst, uid)
    if reg_name not in names:
        young = [n for n in names if _age(n) < options.CREATION_GRACE]
        if tmp_alive or young:
            return InstanceReport(inst, True, "being created", objects=names)
        return InstanceReport(inst, False, "no registry: leftovers of a dead run", objects=names)
    if dead is None:
        with _exclusive(reg_name) as free:
            return _judge_ours(inst, uid, matches, free, claim)
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
    for (inst, uid), matches in _groups(instance):
        if dry_run or (uid is not None and uid != os.geteuid()):  # another user's: never opened
            report = _judge(inst, uid, matches)
        else:
            with _exclusive(_registry_file(inst, uid)) as free:  # held while we remove
                report = _judge(inst, uid, matches, free, claim=True)
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


def reclaim_dead(prefix: str) -> list[InstanceReport]:
    """``reclaim`` of each dead instance of ours whose name starts with ``prefix`` (those
    ``shmq.mp`` makes: no process may keep them once every user is gone); live ones are
    only probed (one flock), not judged."""
    acted = []
    me = os.geteuid()
    for inst, uid in {k for k in _objects() if k[0].startswith(prefix) and k[1] == me}:
        with _exclusive(_registry_file(inst, uid)) as free:
            pass
        if free:
            acted += reclaim(inst)
    return acted


def _remove_orphans(report: InstanceReport) -> None:
    from shmq.core.registry import Registry
    reg = Registry.open(report.instance, create=False)
    try:
        with reg.lock:  # ids listed or being created are not orphans
            reg.repair()
    finally:
        reg.close()
