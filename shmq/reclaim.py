"""Find and reclaim shared memory left behind by dead shmq instances.

An object is ours when its name matches ``shmq.<instance>.(reg|q<id>)...``
and, for segments, it carries our magic.  An instance is dead when its
registry's owner and every process registered in it are proven dead
(pid + start time, see ``process``).  A live instance is never touched,
except for objects its own registry proves orphaned (an id it allocated but
does not list), which are removed under the registry lock.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

from . import layout as L
from . import options, process
from .segment import SHM_DIR, Mapping, unlink_semaphore, unlink_shm

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


def _judge(inst: str, matches: list[re.Match[str]]) -> InstanceReport:
    names = [m.string for m in matches]
    tmp_alive = [m for m in matches if m["tmppid"] and process.start_ms(int(m["tmppid"]))]
    reg_name = f"shmq.{inst}.reg"
    if reg_name not in names:
        young = [n for n in names if _age(n) < options.STALE_HEARTBEAT]
        if tmp_alive or young:
            return InstanceReport(inst, True, "being created", objects=names)
        return InstanceReport(inst, False, "no registry: leftovers of a dead run", objects=names)
    try:
        mapping = Mapping.attach("/" + reg_name)
    except Exception as e:  # noqa: BLE001
        return InstanceReport(inst, True, f"registry unreadable ({e}); left alone", objects=names)
    try:
        w = mapping.words
        if w[L.R_MAGIC] != L.REGISTRY_MAGIC:
            if _age(reg_name) < options.STALE_HEARTBEAT:
                return InstanceReport(inst, True, "registry not valid yet", objects=names)
            return InstanceReport(inst, False, "registry destroyed or invalid", objects=names)
        owner = (w[L.R_OWNER_PID], w[L.R_OWNER_START])
        clients = []
        cw = w[L.R_CLIENTS_OFF] // L.WORD
        for slot in range(w[L.R_MAX_CLIENTS]):
            c = cw + slot * L.C_WORDS
            if w[c + L.C_STATE] == L.C_LIVE:
                clients.append((w[c + L.C_PID], w[c + L.C_START]))
        qw = w[L.R_QUEUES_OFF] // L.WORD
        ids = {w[qw + i * L.E_WORDS + L.E_QUEUE_ID] for i in range(w[L.R_MAX_QUEUES])
               if w[qw + i * L.E_WORDS + L.E_STATE] == L.E_ACTIVE}
        next_id = w[L.R_NEXT_QUEUE_ID]
    finally:
        mapping.close()
    alive_pids = [pid for pid, start in [owner, *clients] if process.is_alive(pid, start)]
    report = InstanceReport(inst, bool(alive_pids), "", owner_pid=owner[0],
                            pids=sorted({p for p, _ in clients}), queues=len(ids), objects=names)
    if alive_pids:
        report.reason = f"live processes attached: {sorted(set(alive_pids))}"
        report.orphans = [m.string for m in matches
                          if m["qid"] and int(m["qid"]) not in ids and int(m["qid"]) < next_id]
    else:
        report.reason = "owner and every attached process are dead"
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
    for report in scan(instance):
        if not report.alive:
            acted.append(report)
            if not dry_run:
                for n in report.objects:
                    _unlink(n)
        elif report.orphans:
            acted.append(report)
            if not dry_run:
                _remove_orphans(report)
    return acted


def _remove_orphans(report: InstanceReport) -> None:
    from .registry import Registry
    reg = Registry.open(report.instance, create=False)
    try:
        with reg.lock:  # no queue is being created while we look
            ids = {e.queue_id for e in reg.queues()}
            for n in report.orphans:
                m = _NAME.match(n)
                if m and m["qid"] and int(m["qid"]) not in ids:
                    _unlink(n)
    finally:
        reg.close()
