"""Queue declarations: the queues a config file names (``[queues.NAME]``), made real at start.

The supervisor applies them before any worker accepts a client, in two steps:

* ``check``, after the durable queues are recovered and before the journal process
  starts: every declared queue that exists (in shared memory, inherited or rebuilt from its
  journal) must have the settings the file names, or the broker does not start.  As
  RabbitMQ's PRECONDITION_FAILED for a redeclare, nothing is changed to make them match:
  a mismatch is one line naming the queue, the setting, the file's value and the queue's.
  A journaled queue is compared with the settings it was created with (its journal's
  ``meta.json``): a rebuild may have given it more room to hold what it had.
* ``create``, once the journal process runs (a journaled queue needs its writer): the
  declared queues that are missing are created, and the declared groups that are
  missing are added (``start="earliest"``: a new group sees what the queue retains).

Settings the file leaves out are neither checked nor changed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shmq.core.serverqueue import ServerBroker, ServerQueue
from shmq.errors import QueueExists
from shmq.journal import Journal
from shmq.journal.files import JournalError
from shmq.server.config import QueueDecl

log = logging.getLogger("shmq.declarations")


def _declared(q: ServerQueue, data_dir: Path) -> dict[str, Any]:
    """The settings ``q`` was created with (a journaled queue's, from its journal)."""
    config = dict(q.config.__dict__)
    if config["durability"] == "memory":
        return config
    try:
        j = Journal(data_dir, q.name, log=log, create=False)
    except JournalError:
        return config  # no journal yet: what the shared memory says
    try:
        meta = j.read_meta()
    finally:
        j.close()
    if meta is None or meta.get("created_ns") != q.durability.created_ns:
        return config
    return {**config, **meta["config"]}


def _same(key: str, want: Any, have: Any) -> bool:
    if key in ("visibility_timeout", "message_ttl"):  # kept in ms
        return abs(float(want) - float(have)) < 0.0005
    return bool(want == have)


def check(broker: ServerBroker, decls: Iterable[QueueDecl], data_dir: Path) -> None:
    """Refuse (QueueExists) a declared queue that exists with other settings."""
    for d in decls:
        q = broker.find(d.name)
        if q is None:
            continue
        have = _declared(q, data_dir)
        wrong = [f"{k} = {have[k]!r} where {d.origin} says {v!r}" for k, v in d.limits.items()
                 if not _same(k, v, have[k])]
        if wrong:
            raise QueueExists(f"queue {d.name!r} exists with other settings: {'; '.join(wrong)} "
                              "(change the file, or delete the queue)")
        log.info("declared queue %r: exists, settings as declared", d.name)


def create(broker: ServerBroker, decls: Iterable[QueueDecl]) -> None:
    """Create the declared queues and groups that are missing."""
    for d in decls:
        if broker.find(d.name) is None:
            broker.create_queue(d.name, **d.limits)
            log.info("declared queue %r: created", d.name)
        q = broker.queue(d.name).handle  # (waits for the journal, as a client would)
        for g in d.groups:
            if g not in q.groups():
                q.create_group(g)
                log.info("declared queue %r: group %r created", d.name, g)


__all__ = ["check", "create"]
