"""PRODUCE and CONSUME: done now, or parked until their queue may have changed.

Nothing blocks the event loop: a request that has to wait is parked on its
queue (``Core.waiters``) and retried by :func:`poke` when the queue may have
changed: at once after a request of this worker changed it, when the worker's
doorbell rings (another process put a message there), and on the worker's tick
(lease expiry, nack delays, room freed elsewhere).  A request past its deadline
fails with EMPTY / QUEUE_FULL.

Order: a connection's produces to one queue are stored in the order they came.
While one of them waits for room, the later ones wait behind it (or fail at
once when they may not wait), and a retry tries none of them before it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shmq import crashpoints, headers
from shmq.errors import Empty, Full, QueueNotFound, ShmqError, Status
from shmq.names import is_reply_name
from shmq.protocol.codec import WAIT_FOREVER, Frame, T, decode_body, decode_joined, frame, produce_ok_frame
from shmq.protocol.produce import PREFIX_FLAGS, split_prefixes, split_priority

from .connection import ServerConnection
from .core import Core, Waiter
from .leasing import deliver, push

PRODUCE_TYPES = frozenset((T.PRODUCE, T.PRODUCE_BATCH, T.PRODUCE_IDEMPOTENT))
CONSUME_TYPES = frozenset((T.CONSUME, T.CONSUME_BATCH))


def produce(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """PRODUCE, PRODUCE_BATCH and PRODUCE_IDEMPOTENT: stored now, or parked until there is room.
    One refused by a reply queue, gone or full, is a reply dropped: counted (``shmq.api.reply``)."""
    name = d["queue"]
    try:
        if conn.parked_produces.get(name):  # an earlier one of ours waits for room: this one waits behind
            wait_or_fail(core, conn, f, d, lambda: Full(f"queue {name!r} is full (an earlier put waits "
                                                        "for room)"))
        elif not try_produce(core, conn, f, d, poke_after=True):
            wait_or_fail(core, conn, f, d, lambda: Full(f"queue {name!r} is full"))
    except (QueueNotFound, Full) as e:
        if is_reply_name(name):
            core.broker.registry.count_reply_dropped("gone" if isinstance(e, QueueNotFound) else "full")
        raise


def decode_produce(f: Frame) -> dict[str, Any]:
    """The fields of a PRODUCE* request, its frame flags undone: with
    ``producing.DELAY_FLAG`` / ``TTL_FLAG`` / ``PRIORITY_FLAG``, ``delay_ms``, ``ttl_ms`` and
    ``priority``; with ``headers.FLAG``,
    each payload parted from its header block (``meta`` / ``metas``).  A malformed block or
    prefix raises here, before anything is stored."""
    if f.status & PREFIX_FLAGS:
        prio, body = split_priority(f.status, f.body)
        ms, tms, body = split_prefixes(f.status, body)
        d = {**decode_body(f.type, body), "delay_ms": ms, "ttl_ms": tms, "priority": prio}
    elif f.type != T.PRODUCE and not f.status & headers.FLAG:  # plain payloads: one Joined, no copies
        return decode_joined(f.type, f.body)
    else:
        d = decode_body(f.type, f.body)
    if f.status & headers.FLAG:
        if f.type == T.PRODUCE:
            d["meta"], d["payload"] = headers.split(d["payload"])
        else:
            d["metas"], d["payloads"] = headers.split_many(d["payloads"])
    return d


def try_produce(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any],
                poke_after: bool = False) -> bool:
    """Store a produce request and answer it; False when the queue has no room now.
    ``poke_after``: then retry what waits on the queue.  A single message's waiting
    consumer is served before the answer when the answer is not held for the journal
    (its DELIVER is what a round trip through the broker waits for; the producer's
    answer can follow).  A batch is answered first: its producer builds the next
    batch while this worker pushes (+7% msgs/s for batches of 100 in push mode,
    measured A/B on 2 cores)."""
    q = core.queue(d["queue"])
    one = f.type == T.PRODUCE
    try:
        if one:
            off, mark = q.put(d["payload"], d.get("meta", b""), d.get("delay_ms", 0), d.get("ttl_ms", 0),
                              d.get("priority", 0))
        else:  # a batch, maybe an idempotent producer's
            offs, mark = q.put_many(d["payloads"], d.get("producer"), d.get("seq"), d.get("metas"),
                                    d.get("delay_ms", 0), d.get("ttl_ms", 0), d.get("priority", 0))
    except Full:
        if not one and not q.could_fit(d["payloads"], d.get("metas")):
            raise  # a batch that can never fit: waiting would never help
        return False
    if crashpoints.active:
        crashpoints.hit("worker.produce.unanswered")
    if poke_after and one and mark is None:
        poke(core, d["queue"])
        poke_after = False
    if one:
        core.answer(conn, f.msg_id, produce_ok_frame(f.msg_id, off), mark)
    else:
        core.answer(conn, f.msg_id, frame(T.PRODUCE_BATCH_OK, f.msg_id, first=offs[0] if offs else 0,
                                          count=len(offs)), mark)
    if poke_after:
        poke(core, d["queue"])
    return True


def produce_run(core: Core, conn: ServerConnection, frames: list[Frame], i: int) -> tuple[int, bool]:
    """PRODUCE frames in a row from ``frames[i]``, to one queue, read together (a
    Publisher's pipeline): stored with one ``put_many`` (in order, all or none), each
    answered on its own.  Returns (the index after the run, whether it was stored).
    When it was not (a run of one, an earlier put waiting, a full queue, any error),
    each frame of the run is to be handled alone, exactly as if it had come by itself."""
    run: list[tuple[Frame, dict[str, Any]]] = []
    j = i
    while j < len(frames) and frames[j].type == T.PRODUCE and not frames[j].status & PREFIX_FLAGS:
        try:
            d = decode_produce(frames[j])
        except ShmqError:  # malformed (ProtocolError), or a bad header block: handled alone
            break
        if run and d["queue"] != run[0][1]["queue"]:
            break
        run.append((frames[j], d))
        j += 1
    name = run[0][1]["queue"] if run else ""
    if len(run) < 2 or conn.parked_produces.get(name):
        return i + 1, False
    try:
        metas = [d.get("meta", b"") for _, d in run]
        offs, mark = core.queue(name).put_many([d["payload"] for _, d in run],
                                               metas=metas if any(metas) else None)
    except ShmqError:
        return j, False
    if crashpoints.active:
        crashpoints.hit("worker.produce.unanswered")
    for (f, _), off in zip(run, offs, strict=True):  # one mark covers the run
        core.answer(conn, f.msg_id, produce_ok_frame(f.msg_id, off), mark)
    poke(core, name)
    return j, True


def deliver_or_park(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """CONSUME and CONSUME_BATCH: delivered now, or parked until a message is ready."""
    if not try_consume(core, conn, f, d):
        wait_or_fail(core, conn, f, d, lambda: Empty(f"no message for group {d['group']!r} of "
                                                     f"{d['queue']!r}"))


def try_consume(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> bool:
    n = d.get("max", 1)
    conn.leases.check_room(n)
    return deliver(conn, core.queue(d["queue"]), d["group"], n, d["visibility_ms"], f.msg_id,
                   f.type == T.CONSUME) > 0


def wait_or_fail(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any],
                 err: Callable[[], ShmqError]) -> None:
    """Park the request until its queue changes, or raise ``err()`` when it may not wait
    (a timeout of 0, or the worker is stopping)."""
    t = d["timeout_ms"]
    if t == 0 or core.stopping:
        raise err()
    deadline = None if t == WAIT_FOREVER else core.clock() + t / 1000
    if f.type in PRODUCE_TYPES:
        conn.parked_produces[d["queue"]] = conn.parked_produces.get(d["queue"], 0) + 1
    core.park(d["queue"], Waiter(conn, f, d, deadline))


def retry(core: Core, w: Waiter, now: float, try_put: bool = True) -> bool:
    """A parked request: True when it is answered (done or failed).  ``try_put`` False:
    only its deadline is checked (an earlier produce of its connection still waits)."""
    f, d, conn = w.frame, w.fields, w.conn
    try:
        if try_put and (try_consume(core, conn, f, d) if f.type in CONSUME_TYPES
                        else try_produce(core, conn, f, d)):
            return True
    except ShmqError as e:
        conn.error(f.msg_id, e.code, str(e))
        return True
    if w.deadline is not None and now >= w.deadline:
        if f.type in CONSUME_TYPES:
            conn.error(f.msg_id, Status.EMPTY, f"no message for group {d['group']!r} of "
                       f"{d['queue']!r} within {d['timeout_ms']} ms")
        else:
            conn.error(f.msg_id, Status.QUEUE_FULL, f"queue {d['queue']!r} is full "
                       f"(timed out after {d['timeout_ms']} ms)")
        return True
    return False


def poke(core: Core, name: str) -> None:
    """The queue may have changed: retry what waits on it (in arrival order; a
    connection's produces stay in order: none is tried while an earlier one waits),
    then push to its subscriptions that have credit."""
    waiters = core.waiters.get(name)
    if waiters:
        now = core.clock()
        keep = []
        stuck: set[ServerConnection] = set()  # connections whose earlier produce still waits
        for w in waiters:
            if w.conn.closed:
                continue
            producing = w.frame.type in PRODUCE_TYPES
            if not retry(core, w, now, try_put=not (producing and w.conn in stuck)):
                keep.append(w)
                if producing:
                    stuck.add(w.conn)
            elif producing:
                pp = w.conn.parked_produces
                pp[name] -= 1
                if not pp[name]:  # (the names a connection ever waited on do not pile up)
                    del pp[name]
        if keep:
            core.waiters[name] = keep
        else:
            del core.waiters[name]
    subs = core.subs.get(name)
    if subs:
        for s in list(subs):
            if s.credit > 0 and not s.conn.closed:
                push(core, s)
