"""What processes map and hold of an instance's shared memory, read from ``/proc``."""

from __future__ import annotations

import os
from collections.abc import Iterable

from shmq.core.segment import objects_of, parse_object_name


def mapped(pid: int, instance: str) -> set[str]:
    """The objects of ``instance``'s queues (segments and semaphores) that process ``pid``
    maps, as ``name`` or ``name (deleted)``."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            m = parse_object_name(os.path.basename(path.removesuffix(" (deleted)")))
            if m and m["inst"] == instance and m["qid"]:
                out.add(os.path.basename(path))
    return out


def mapped_by(pids: Iterable[int], instance: str, qid: int | None = None) -> dict[int, set[str]]:
    """Per process, what it maps of ``instance``'s queues (of queue ``qid`` only, if given)."""
    out = {}
    for pid in pids:
        names = {n for n in mapped(pid, instance)
                 if qid is None or parse_object_name(n.removesuffix(" (deleted)"))["qid"] == str(qid)}  # type: ignore[index]
        if names:
            out[pid] = names
    return out


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def queue_ids(instance: str) -> set[int]:
    return {int(m["qid"]) for n in objects_of(instance) if (m := parse_object_name(n)) and m["qid"]}
