"""An fsck for an instance's shared memory: every invariant the code relies on, checked.

``check_instance(name)`` returns one line per violation (an empty list: clean);
``shmq doctor --check`` prints them.  It holds the registry lock, then each queue's
producer and consumer locks, so it may run against a live instance and sees no
operation half-done: a lock whose holder died hands it ``EOWNERDEAD``, and the
check repairs what that holder left (as any process taking the lock would) before
it looks.

What is checked (the invariants are stated where they are kept: ``registry``,
``ring``, ``group``):

* registry: queue names and ids unique, ids below the next id, every listed queue's
  segment and semaphores present, and no segment of the instance that the registry
  neither lists nor is creating;
* each queue segment: magic, version, instance uid, id, name and DLQ flag as listed;
* the ring: free <= next, next - free <= capacity, each retained slot names its
  offset, records in order, inside one lap and within max_bytes; no idempotent
  put left pending; a message's own TTL (S_EXPIRES) after its put, at most a year past
  it and no later than Q_EXPIRES_MAX, and none on a dead-letter queue;
* each group: serials (distinct, at most the generation; zero when free),
  free <= floor <= cursor <= next, lease words by position (DONE below the floor,
  NEW or DONE past the cursor, or READY never delivered (a delayed message, due no later
  than Q_DELAY_MAX), never NEW below it, the floor not on a DONE word), owners of leases are
  taken client slots, dead-letter orphans flagged, a message dead-lettered undelivered
  only by a TTL that dead-letters (the queue's or its own), the hints true bounds
  (G_REDELIVER, G_READY_LO, G_NEXT_READY, G_NEXT_EXPIRY), and no seek left unfinished;
* free offset = min(next offset, durable mark, every active group's floor).
"""

from __future__ import annotations

import os

import posix_ipc

from shmq import options
from shmq.core import layout as L
from shmq.core.groups import Groups
from shmq.core.registry import Registry
from shmq.core.ring import Ring
from shmq.core.segment import (
    SHM_DIR,
    Mapping,
    parse_object_name,
    queue_id_of,
    queue_segment_name,
    registry_name,
    semaphore_names,
    shm_path,
)
from shmq.errors import InstanceError, StorageError

_STATES = {L.NEW: "NEW", L.LEASED: "LEASED", L.READY: "READY", L.DONE: "DONE", L.DEADING: "DEADING"}


def instances() -> list[str]:
    """Names of our instances (their names carry our effective uid) with a registry on this
    host.  Other users' are not ours to check, nor an older version's (another layout)."""
    uid = str(os.geteuid())
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(m["inst"] for m in map(parse_object_name, names)
                  if m and m["uid"] == uid and m["reg"] and not m["tmppid"] and not m["sem"])


def check_all() -> dict[str, list[str]]:
    """``check_instance`` for every instance on this host."""
    out = {}
    for inst in instances():
        try:
            out[inst] = check_instance(inst)
        except InstanceError as e:  # destroyed while we looked: nothing to check
            if os.path.exists(shm_path(registry_name(inst))):
                out[inst] = [f"registry: {e}"]
    return out


def check_instance(instance: str) -> list[str]:
    """Every violation of the instance's invariants, one line each ([] when clean)."""
    reg = Registry.open(instance, create=False)
    try:
        with reg.lock:
            return _check_registry(reg)
    finally:
        reg.close()


def _check_registry(reg: Registry) -> list[str]:
    bad: list[str] = []
    w = reg.w
    next_id = w[L.R_NEXT_QUEUE_ID]
    names: dict[str, int] = {}
    listed: dict[int, tuple[str, bool]] = {}
    for i in range(reg.max_queues):
        e = reg.queues_w + i * L.E_WORDS
        state, qid = w[e + L.E_STATE], w[e + L.E_QUEUE_ID]
        if state == L.E_FREE:
            continue
        name = reg._entry_name(e)
        if state not in (L.E_ACTIVE, L.E_CREATING):
            bad.append(f"registry: queue entry {i} has state {state}")
            continue
        if name in names:
            bad.append(f"registry: queue name {name!r} listed twice")
        if qid in listed or not 1 <= qid < next_id:
            bad.append(f"registry: queue id {qid} of {name!r} is repeated or not below the next id {next_id}")
        names[name] = qid
        if state == L.E_CREATING:  # (a dead creator's is dropped by the next reaper)
            continue
        listed[qid] = (name, bool(w[e + L.E_FLAGS] & L.F_DLQ))
    reserved = set(names.values())
    for n in sorted(os.listdir(SHM_DIR)):
        seg_id = queue_id_of(reg.instance, n)
        if seg_id is not None and seg_id not in reserved:
            bad.append(f"registry: segment {n} belongs to no queue (an orphan)")
    for qid, (name, is_dlq) in sorted(listed.items()):
        bad += [f"{name}: {v}" for v in _check_queue(reg, qid, name, is_dlq)]
    return bad


def _check_queue(reg: Registry, qid: int, name: str, is_dlq: bool) -> list[str]:
    for s in semaphore_names(reg.instance, qid):
        try:
            posix_ipc.Semaphore(s).close()
        except posix_ipc.ExistentialError:
            return [f"semaphore {s} is missing"]
    try:
        mapping = Mapping.attach(queue_segment_name(reg.instance, qid))
    except (FileNotFoundError, InstanceError) as e:
        return [f"segment of queue id {qid}: {e}"]
    try:
        ring = Ring(mapping)
    except (InstanceError, StorageError) as e:  # not a queue segment, or a corrupt one
        mapping.close()
        return [str(e)]
    try:
        w = ring.w
        bad = []
        if (w[L.Q_INSTANCE_UID], w[L.Q_QUEUE_ID], ring.name) != (reg.uid, qid, name):
            bad.append(f"header says instance {w[L.Q_INSTANCE_UID]:#x}, id {w[L.Q_QUEUE_ID]}, name "
                       f"{ring.name!r}; the registry lists {reg.uid:#x}, {qid}, {name!r}")
        if w[L.Q_STATE] != L.QS_ACTIVE:
            bad.append(f"listed but in state {w[L.Q_STATE]}")
        if bool(ring.flags & L.F_DLQ) != is_dlq:
            bad.append("the dead-letter flag differs from the registry's")
        if is_dlq and ring.message_ttl_ms:
            bad.append(f"a dead-letter queue with a message TTL of {ring.message_ttl_ms} ms")
        groups = Groups(ring)  # its repair runs if a consumer died holding the lock
        with ring.plock, ring.clock:
            bad += check_ring(ring, groups, reg)
        return bad
    finally:
        ring.close()


def check_ring(ring: Ring, groups: Groups, reg: Registry | None = None) -> list[str]:
    """The violations of one queue's ring and groups; call with both its locks held.
    ``reg``: also check that lease owners are taken client slots."""
    w = ring.w
    bad: list[str] = []
    nxt, free, cap = w[L.Q_NEXT_OFFSET], w[L.Q_FREE_OFFSET], ring.capacity
    if not free <= nxt <= free + cap:
        bad.append(f"free offset {free}, next offset {nxt}: not free <= next <= free + capacity ({cap})")
        return bad  # the rest would only repeat it
    if w[L.Q_PENDING_PRODUCER]:
        bad.append("an idempotent put is left pending under a held producer lock")
    prev_end = None
    for o in range(free, nxt):
        base = ring.slot_base(o)
        pos, lens = w[base + L.S_BYTEPOS], w[base + L.S_LENS]
        n = (lens & L.LEN_PAYLOAD_MASK) + (lens >> L.LEN_META_SHIFT)
        if w[base + L.S_OFFSET] != o:
            bad.append(f"slot of offset {o} names offset {w[base + L.S_OFFSET]}")
        elif pos % ring.size + n > ring.size:
            bad.append(f"record {o} crosses the end of the byte ring")
        elif prev_end is not None and pos < prev_end:
            bad.append(f"record {o} overlaps the one before")
        prev_end = pos + n
        bad += _check_expires(ring, o, w[base + L.S_TIMESTAMP], w[base + L.S_EXPIRES])
    if nxt > free and prev_end is not None:
        first = w[ring.slot_base(free) + L.S_BYTEPOS]
        if w[L.Q_TAIL_BYTES] < prev_end or w[L.Q_TAIL_BYTES] - first > ring.size:
            bad.append(f"byte tail {w[L.Q_TAIL_BYTES]} is not in [{prev_end}, {first} + max_bytes]")
    gen = w[L.Q_GROUP_GEN]
    serials: set[int] = set()
    low = min(nxt, w[L.Q_DURABLE_OFFSET])
    for gi in range(ring.max_groups):
        g = ring.groups_w + gi * L.G_WORDS
        serial = w[g + L.G_SERIAL]
        if w[g + L.G_STATE] != L.GS_ACTIVE:
            if serial:
                bad.append(f"free group index {gi} keeps serial {serial}: its old leases could settle")
            continue
        gname = groups._name(gi)
        if serial in serials or serial > gen:  # (0: the group made with the queue)
            bad.append(f"group {gname!r}: serial {serial} is repeated or past the generation {gen}")
        serials.add(serial)
        low = min(low, w[g + L.G_FLOOR])
        bad += [f"group {gname!r}: {v}" for v in _check_group(ring, groups, gi, reg)]
    if free != low:
        bad.append(f"free offset {free} is not min(next offset, durable mark, floors) = {low}")
    return bad


def _check_group(ring: Ring, groups: Groups, gi: int, reg: Registry | None) -> list[str]:
    w = ring.w
    g = ring.groups_w + gi * L.G_WORDS
    floor, cur, nxt = w[g + L.G_FLOOR], w[g + L.G_CURSOR], w[L.Q_NEXT_OFFSET]
    if not w[L.Q_FREE_OFFSET] <= floor <= cur <= nxt:
        return [f"not free {w[L.Q_FREE_OFFSET]} <= floor {floor} <= cursor {cur} <= next {nxt}"]
    bad = []
    if w[g + L.G_SEEK_TO]:  # (a seek cut short is finished by the lock's repair, before this)
        bad.append(f"a seek to offset {w[g + L.G_SEEK_TO] - 1} was left unfinished")
    lw = L.S_GROUPS + gi

    def word(o: int) -> int:
        return w[ring.slot_base(o) + lw]

    for o in range(w[L.Q_FREE_OFFSET], floor):
        if word(o) & L.STATE_MASK != L.DONE:
            bad.append(f"offset {o} below the floor {floor} is {_describe(word(o))}")
    for o in range(cur, nxt):
        x = word(o)
        if x & L.STATE_DC_MASK == L.READY:  # a delayed message (READY, never delivered)
            if x >> L.TIME_SHIFT > w[L.Q_DELAY_MAX]:
                bad.append(f"offset {o} past the cursor is delayed to {x >> L.TIME_SHIFT}, after "
                           f"Q_DELAY_MAX {w[L.Q_DELAY_MAX]}")
        elif x & L.STATE_MASK not in (L.NEW, L.DONE):
            bad.append(f"offset {o} past the cursor {cur} is {_describe(x)}")
    if floor < cur and word(floor) & L.STATE_MASK == L.DONE:
        bad.append(f"the floor {floor} stands on a DONE word")
    ready: list[tuple[int, int]] = []
    deadlines: list[int] = []
    for o in range(floor, cur):
        x = word(o)
        state, dc = x & L.STATE_MASK, (x >> L.DC_SHIFT) & L.DC_MASK
        owner = (x >> L.OWNER_SHIFT) & L.OWNER_MASK
        if state not in _STATES or state == L.NEW:
            bad.append(f"offset {o} below the cursor is {_describe(x)}")
        elif state == L.READY:
            ready.append((o, x >> L.TIME_SHIFT))
        elif state in (L.LEASED, L.DEADING):
            if state == L.LEASED:
                deadlines.append(x >> L.TIME_SHIFT)
                if not dc:  # a lease is a delivery: it counts one at least
                    bad.append(f"offset {o} is LEASED with 0 deliveries")
            if dc > groups.give_up_at:
                bad.append(f"offset {o} was delivered {dc} times, past the limit {groups.give_up_at}")
            ttl = ring.message_ttl_ms or w[ring.slot_base(o) + L.S_EXPIRES]
            if state == L.DEADING and not dc and (not ttl or ring.flags & L.F_TTL_DROP):
                bad.append(f"offset {o} is dead-lettered undelivered on a queue that dead-letters no "
                           "expired message")
            if state == L.DEADING and owner == L.NO_OWNER:
                if not w[L.Q_ORPHANS]:
                    bad.append(f"offset {o} is an orphaned dead-letter copy, but Q_ORPHANS is not set")
            elif reg is not None and not _slot_taken(reg, owner):
                bad.append(f"offset {o} is {_describe(x)} by client slot {owner}, which is free")
    if ready:
        if w[g + L.G_REDELIVER] < len(ready):
            bad.append(f"G_REDELIVER {w[g + L.G_REDELIVER]} is below the {len(ready)} READY words")
        if w[g + L.G_READY_LO] > ready[0][0]:
            bad.append(f"G_READY_LO {w[g + L.G_READY_LO]} is above the lowest READY offset {ready[0][0]}")
        if w[g + L.G_NEXT_READY] > min(t for _, t in ready):
            bad.append(f"G_NEXT_READY {w[g + L.G_NEXT_READY]} is after the earliest READY time "
                       f"{min(t for _, t in ready)}")
    if deadlines and not 0 < w[g + L.G_NEXT_EXPIRY] <= min(deadlines):
        bad.append(f"G_NEXT_EXPIRY {w[g + L.G_NEXT_EXPIRY]} is not a lower bound of the lease "
                   f"deadlines (earliest {min(deadlines)})")
    return bad


def _check_expires(ring: Ring, o: int, ts: int, exp: int) -> list[str]:
    """The violations of offset ``o``'s own TTL (S_EXPIRES ``exp``; 0: none)."""
    if not exp:
        return []
    if ring.flags & L.F_DLQ:
        return [f"offset {o} of a dead-letter queue has a TTL of its own"]
    if not ts < exp <= ts + int(options.MAX_MESSAGE_TTL * 1e9):
        return [f"offset {o} expires at {exp}, not within a year after its put at {ts}"]
    if exp > ring.w[L.Q_EXPIRES_MAX]:
        return [f"offset {o} expires at {exp}, after Q_EXPIRES_MAX {ring.w[L.Q_EXPIRES_MAX]}"]
    return []


def _slot_taken(reg: Registry, slot: int) -> bool:
    return slot < reg.max_clients and reg.w[reg.clients_w + slot * L.C_WORDS + L.C_STATE] == L.C_LIVE


def _describe(x: int) -> str:
    state = _STATES.get(x & L.STATE_MASK, f"state {x & L.STATE_MASK}")
    dc, owner = (x >> L.DC_SHIFT) & L.DC_MASK, (x >> L.OWNER_SHIFT) & L.OWNER_MASK
    return f"{state} (deliveries {dc}, owner {owner})"
