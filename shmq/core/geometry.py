"""A queue segment's header, checked once at attach against what its limits make.

Shared memory is ours alone, but a bug, a stray write or a version mix must give a typed
error, never a fault: every size and offset a header names is recomputed from its
capacity, max_bytes and max_groups (``layout.queue_size``) and must match and fit the
segment, and every configuration word must lie within its bounds, before anything else
of the segment is used.  The compiled entry points check the geometry they are handed
again (``shmq/_speedups_one.c``, ``geom_open``).
"""

from __future__ import annotations

from shmq import options
from shmq.core import layout as L
from shmq.core.segment import Mapping, parse_object_name
from shmq.errors import StorageError


def check_geometry(mapping: Mapping) -> None:
    """Every size and offset a queue segment's header names must be the ones its limits
    make, and fit the segment: checked once, at attach, before anything else of it is
    used (a stray write, a bug or a version mix must give a typed error, never a fault).
    :class:`StorageError` names the queue, the instance, the field and its value."""
    w = mapping.words

    def corrupt(field: str, value: int, why: str) -> StorageError:
        m = parse_object_name(mapping.name.lstrip("/"))
        where = f"queue {m['qid']} of instance {m['inst']!r}" if m and m["qid"] else mapping.name
        return StorageError(f"{where} is corrupt: its header's {field} is {value}, {why} (shmq doctor "
                            "--check; a queue of a journaled policy comes back whole from its journal "
                            "once its shared memory is removed)")

    bounds = (("Q_CAPACITY", 1, options.MAX_CAPACITY),
              ("Q_MAX_BYTES", options.MIN_MAX_BYTES, options.MAX_MAX_BYTES),
              ("Q_MAX_GROUPS", 1, options.MAX_GROUPS_LIMIT), ("Q_MAX_PRODUCERS", 0, 1 << 16),
              ("Q_MAX_MESSAGE_SIZE", 1, w[L.Q_MAX_BYTES]), ("Q_NAME_LEN", 1, L.E_NAME_BYTES),
              ("Q_MAX_CLIENTS", 1, L.MAX_OWNER - 1),
              ("Q_DURABILITY", 0, len(options.DURABILITY_MODES) - 1),
              ("Q_VISIBILITY_MS", 0, int(options.MAX_VISIBILITY_TIMEOUT * 1000)),
              ("Q_MAX_DELIVERIES", 0, L.DC_MASK),
              ("Q_MESSAGE_TTL_MS", 0, int(options.MAX_MESSAGE_TTL * 1000)),
              ("Q_FLAGS", 0, L.F_DLQ | L.F_TTL_DROP | L.F_REPL_ASYNC | L.F_REPL_SYNC
                           | options.MAX_PRIORITIES << L.PRIO_SHIFT))
    for field, lo, hi in bounds:
        v = w[getattr(L, field)]
        if not lo <= v <= hi:
            raise corrupt(field, v, f"not in [{lo}, {hi}]")
    want = L.queue_size(w[L.Q_CAPACITY], w[L.Q_MAX_BYTES], w[L.Q_MAX_GROUPS], w[L.Q_MAX_PRODUCERS])
    want["total_size"] = want.pop("total")
    for key, v in want.items():
        field = f"Q_{key.upper()}"
        if w[getattr(L, field)] != v:
            raise corrupt(field, w[getattr(L, field)], f"not {v}, which its capacity, max_bytes and "
                                                      "max_groups make")
    if want["total_size"] != mapping.size:
        raise corrupt("Q_TOTAL_SIZE", w[L.Q_TOTAL_SIZE], f"not the segment's size {mapping.size}")
    if w[L.Q_PENDING_PRODUCER] > w[L.Q_MAX_PRODUCERS]:  # (1 + an index, or 0)
        raise corrupt("Q_PENDING_PRODUCER", w[L.Q_PENDING_PRODUCER], "past the producer table")
    try:
        bytes(mapping.mm[L.Q_NAME * L.WORD:(L.Q_NAME * L.WORD) + w[L.Q_NAME_LEN]]).decode()
    except UnicodeDecodeError:
        raise corrupt("Q_NAME", w[L.Q_NAME], "not UTF-8") from None
