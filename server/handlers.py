"""The request stream of a connection: the handshake, dispatch, and every request but
PRODUCE and CONSUME (``parking``).

A handler (``HANDLERS``, by request type) gets the worker's :class:`~shmq.server.core.Core`,
the connection, the frame and its fields, read by the request type's decoder (``DECODERS``,
beside it: the body, its frame flags undone), and answers through the connection (or through
``Core.answer``, which holds a reply until the journal has what it confirms).
An error raised by a handler becomes an ERROR reply to that request, and the
connection and the worker carry on: one bad request never takes anything else
down.  :func:`receive` is all a driver calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from time import perf_counter_ns
from typing import Any

from shmq import crashpoints, options
from shmq.core.durability import Mark, Marks
from shmq.core.serverqueue import ServerQueue
from shmq.errors import InvalidArgument, LimitExceeded, ProtocolError, ShmqError, StaleAck, Status
from shmq.names import is_reply_name
from shmq.protocol.codec import Frame, T, decode_body, encode_frame, frame
from shmq.protocol.consume_ack import decode_consume
from shmq.resources import exhaustion, is_exhaustion
from shmq.settle import Settle

from .connection import ServerConnection, Subscription, agree_heartbeat
from .core import SERVER_NAME, Core
from .leasing import READ_HEADROOM, RECORD_COLUMNS, push
from .logs import Throttle
from .parking import decode_produce, deliver_or_park, poke, produce, produce_run

log = logging.getLogger("shmq.worker")
Handler = Callable[[Core, ServerConnection, Frame, dict[str, Any]], None]
Decoder = Callable[[Frame], dict[str, Any]]  # a request frame's fields, its flags undone


def receive(core: Core, conn: ServerConnection, data: bytes) -> None:
    """Everything a driver does with bytes read from a connection: the frames they
    complete are handled, and the replies go out in one write.  Raises
    :class:`ProtocolError` on a malformed stream (answer with an ERROR for message
    id 0, then close)."""
    frames = conn.receive(data)
    conn.hold()
    try:
        handle_frames(core, conn, frames)
    finally:
        conn.flush()


def handle_frames(core: Core, conn: ServerConnection, frames: list[Frame]) -> None:
    """Handle the frames of one read, in order, until the connection closes.  PRODUCE
    frames in a row are stored together when they can be (``parking.produce_run``).  With
    ``--metrics``, each step is counted and timed (``Core.meter``: the requests of a run
    each took the run's time; one clock read per step: a step starts when the last ended)."""
    i = 0
    meter = core.meter
    t0 = perf_counter_ns() if meter is not None else 0
    while i < len(frames):
        if conn.closed:
            return
        f = frames[i]
        conn.busy = True
        start = i
        try:
            if f.type == T.PRODUCE and conn.ready and i + 1 < len(frames):
                j, stored = produce_run(core, conn, frames, i)
                if not stored:
                    for g in frames[i:j]:
                        if conn.closed:
                            break
                        handle(core, conn, g)
                i = j
            else:
                handle(core, conn, f)
                i += 1
        finally:
            conn.busy = False
        if meter is not None:
            t1 = perf_counter_ns()
            meter.record(f.type, i - start, t1 - t0)
            t0 = t1


def handle(core: Core, conn: ServerConnection, f: Frame) -> None:
    if not conn.ready:
        if f.type != T.HANDSHAKE:
            conn.error(f.msg_id, Status.PROTOCOL_ERROR, "the first frame must be HANDSHAKE")
            end(core, conn)
            return
        handshake(core, conn, f)
        return
    handler = HANDLERS.get(f.type)
    if handler is None:
        conn.error(f.msg_id, Status.INVALID_TYPE, f"type 0x{f.type:02x} is not a request")
        return
    try:
        handler(core, conn, f, DECODERS[f.type](f))
    except ShmqError as e:  # ProtocolError too
        if is_exhaustion(e):  # descriptors or /dev/shm ran out: the log says so too
            _warn(core, str(e))
        conn.error(f.msg_id, e.code, str(e))
    except (ValueError, TypeError, KeyError) as e:
        conn.error(f.msg_id, Status.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
    except OSError as e:
        err = exhaustion(e, f"{_name(f.type)} failed")
        if err is None:
            _internal(core, conn, f, e)
        else:  # descriptors or /dev/shm ran out: the caller and the log are told what to raise
            _warn(core, str(err))
            conn.error(f.msg_id, err.code, str(err))
    except Exception as e:  # noqa: BLE001 - one bad request must not take the worker down
        _internal(core, conn, f, e)


def _name(t: int) -> str:
    try:
        return T(t).name
    except ValueError:
        return f"type 0x{t:02x}"


def _internal(core: Core, conn: ServerConnection, f: Frame, e: BaseException) -> None:
    """A bug, or something no code path expects: INTERNAL to the caller, the traceback to
    the log, always."""
    log.error("worker %d: %s from %s failed", core.worker_id, _name(f.type), conn.peer or "a peer",
              exc_info=e)
    conn.error(f.msg_id, Status.INTERNAL, f"{type(e).__name__}: {e}")


_exhausted = Throttle()  # an exhaustion logs a line a second at most


def _warn(core: Core, text: str) -> None:
    if _exhausted.ready(core.clock()):
        log.warning("worker %d: %s", core.worker_id, text)


def handshake(core: Core, conn: ServerConnection, f: Frame) -> None:
    """Check the token; hand the connection to another worker if it should be served
    there (``Core.place``); else accept it.  The token is looked at first, whatever the
    peer did before: a right one is never refused, so a client sharing an address with a
    misconfigured one (every local client is 127.0.0.1) keeps working.  Only failures are
    throttled (``Core.auth_wait``): past ``AUTH_FAILURES_MAX`` of them in the window, a
    wrong token from that address is refused without a log line (brute force against a
    long random token is hopeless anyway: the throttle bounds the log's noise)."""
    try:
        fields = conn.check_handshake(f)
    except ProtocolError as e:
        conn.error(f.msg_id, e.code, str(e))
        end(core, conn)
        return
    if fields is None:
        wait = core.auth_wait(conn.peer)
        if wait:
            conn.refuse_handshake(f, f"bad or missing token; too many failed handshakes from "
                                     f"{conn.peer or 'this peer'}: try again in {wait:.0f} s")
        else:
            conn.refuse_handshake(f)
            n = core.auth_failed(conn.peer)
            log.warning("worker %d: refused a handshake from %s: bad or missing token (%d in the last "
                        "%.0f s%s)", core.worker_id, conn.peer or "an unknown peer", n,
                        options.AUTH_FAILURE_WINDOW,
                        "; more from there go unlogged for a while" if n >= options.AUTH_FAILURES_MAX else "")
        end(core, conn)
        return
    if conn.may_move() and core.place is not None and core.place(conn, f, fields["affinity"]):
        return
    conn.accept(f, core.worker_id, SERVER_NAME, agree_heartbeat(core.heartbeat, fields["heartbeat_ms"]))


def end(core: Core, conn: ServerConnection) -> None:
    """Close the connection: what is held goes out, its subscriptions end, its leases go
    back at once and what waits on their queues is retried.  (The driver then closes
    the socket.)"""
    if conn.close():
        for name in core.release(conn):
            poke(core, name)


# ---------------------------------------------------------------- settling
def _leases(core: Core, d: dict[str, Any]) -> tuple[ServerQueue, int]:
    """The queue and group reference a settle names (-1 when the group was deleted since,
    even if made again: its leases are stale)."""
    q = core.queue(d["queue"])
    return q, q.group_ref_or_none(d["group"])


def ack(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """ACK, answered; ACK_NO_REPLY, answered only when it fails (by ``handle``)."""
    mark = _ack_one(core, conn, d, d["offset"], d["deliveries"])
    if crashpoints.active:
        crashpoints.hit("worker.ack.unanswered")
    if f.type == T.ACK:  # an unwaited ack: nobody waits for the journal either
        core.answer(conn, f.msg_id, encode_frame(T.ACK_OK, f.msg_id), mark)  # (no body: one pack)


def _ack_one(core: Core, conn: ServerConnection, d: dict[str, Any], off: int, deliveries: int
             ) -> Mark | None:
    """Ack one lease of ours (:class:`StaleAck` when it is not); the mark confirming it."""
    q, ref = _leases(core, d)
    held = conn.leases.require(q, ref, off, deliveries)
    try:
        return q.ack(ref, off, deliveries)
    finally:
        conn.leases.settled(held, off)


def ack_batch(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """ACK_BATCH, answered with the offsets that were stale; ACK_BATCH_NO_REPLY, answered
    only when some were (with ERROR STALE_ACK)."""
    offsets, asked = map(list, zip(*d["settles"], strict=True)) if d["settles"] else ([], [])
    _ack_many(core, conn, f, d, offsets, asked)


def ack_range(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """ACK_RANGE / ACK_RANGE_NO_REPLY: ACK_BATCH / ACK_BATCH_NO_REPLY of the ``count``
    offsets from ``first``, each with the same delivery count (one push's or one
    get_many's new messages), answered the same way."""
    n = d["count"]
    if n > options.MAX_BATCH:
        raise LimitExceeded(f"{n} acks in one frame (the limit is {options.MAX_BATCH})")
    first = d["first"]
    _ack_many(core, conn, f, d, list(range(first, first + n)), [d["deliveries"]] * n)


def _ack_many(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any], offsets: list[int],
              asked: list[int]) -> None:
    stale, mark = _ack_offsets(core, conn, d, offsets, asked)
    if f.type in WAITED_BATCH_ACKS:
        core.answer(conn, f.msg_id, frame(T.ACK_BATCH_OK, f.msg_id, stale=stale), mark)
    elif stale:  # an unwaited one: nobody waits for the journal either
        raise StaleAck.of_batch(stale, len(offsets))


def _ack_offsets(core: Core, conn: ServerConnection, d: dict[str, Any], offsets: list[int],
                 asked: list[int]) -> tuple[list[int], Mark | Marks | None]:
    """Ack the leases of ours among (``offsets``, ``asked`` deliveries): (the offsets that
    were stale, the mark confirming the others)."""
    q, ref = _leases(core, d)
    mine, dcs, stale = conn.leases.take(conn.leases.of(q, ref), offsets, asked)
    mark = None
    if mine:
        more, mark = q.ack_offsets(ref, mine, dcs)
        stale += more
    return stale, mark


def get(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """CONSUME and CONSUME_BATCH (``parking.deliver_or_park``).  With ``consuming.ACK_FLAG`` they
    carry leases (``acks``) that are acked first, as ACK / ACK_BATCH would: when one was
    stale the request fails with STALE_ACK (the others are acked) and nothing is delivered;
    else the get goes on once the journal has the acks (an ``always`` queue), so its
    answer confirms them."""
    acks = d.get("acks")
    if acks is None:
        deliver_or_park(core, conn, f, d)
        return
    mark: Mark | Marks | None
    if f.type == T.CONSUME:
        (off, dc), = acks
        mark = _ack_one(core, conn, d, off, dc)
    else:
        offsets, asked = map(list, zip(*acks, strict=True)) if acks else ([], [])
        stale, mark = _ack_offsets(core, conn, d, offsets, asked)
        if stale:
            raise StaleAck.of_batch(stale, len(offsets))
    if mark is None or mark.reached():
        deliver_or_park(core, conn, f, d)
    else:
        core.held.after(mark, conn, partial(_get_after_ack, core, conn, f, d))


def _get_after_ack(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any],
                   err: ShmqError | None) -> None:
    """The get of a CONSUME* whose acks the journal now has (or could not write: ``err``)."""
    if err is not None:
        conn.error(f.msg_id, err.code, str(err))
        return
    if conn.closed:
        return
    try:
        deliver_or_park(core, conn, f, d)
    except ShmqError as e:
        conn.error(f.msg_id, e.code, str(e))


def _settle(core: Core, conn: ServerConnection, d: dict[str, Any], action: Settle, arg: float | None
            ) -> Any:
    """nack / touch / dead-letter one lease of ours; the mark confirming it.  A lease found
    stale is no longer ours either."""
    q, ref = _leases(core, d)
    off = d["offset"]
    held = conn.leases.require(q, ref, off, d["deliveries"])
    try:
        mark = q.settle(ref, off, d["deliveries"], action, arg)
    except StaleAck:
        conn.leases.settled(held, off)
        raise
    if action != Settle.TOUCH:
        conn.leases.settled(held, off)
    return mark


def nack(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    mark = _settle(core, conn, d, Settle.NACK, d["delay_ms"] / 1000)
    core.answer(conn, f.msg_id, frame(T.NACK_OK, f.msg_id), mark)
    poke(core, d["queue"])


def touch(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    _settle(core, conn, d, Settle.TOUCH, d["visibility_ms"] / 1000 if d["visibility_ms"] else None)
    conn.reply(f, T.TOUCH_OK)


def dead_letter(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    mark = _settle(core, conn, d, Settle.DEAD, 0.0)
    core.answer(conn, f.msg_id, frame(T.DEAD_LETTER_OK, f.msg_id), mark)


# ---------------------------------------------------------------- queues and groups
def create_queue(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    if not isinstance(d["config"], dict):
        raise InvalidArgument("config must be a JSON object")
    core.broker.create_queue(d["queue"], **d["config"])
    if is_reply_name(d["queue"]):  # a requester's reply queue: it goes with this connection
        conn.reply_queues.add(d["queue"])
    conn.reply(f, T.CREATE_QUEUE_OK)


def delete_queue(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    core.broker.delete_queue(d["queue"])
    conn.leases.forget_gone()  # (other connections' stop counting where they need the room)
    conn.reply(f, T.DELETE_QUEUE_OK)


def list_queues(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    conn.reply(f, T.LIST_QUEUES_OK, queues=[
        {"name": i.name, "is_dlq": i.is_dlq, "config": i.config.__dict__} for i in core.broker.list_queues()])


def group_join(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    mark = core.queue(d["queue"]).create_group(d["group"], "latest" if d["start"] else "earliest")
    core.answer(conn, f.msg_id, frame(T.GROUP_JOIN_OK, f.msg_id), mark)


def group_commit(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    mark = core.queue(d["queue"]).commit(d["group"], d["offset"])
    core.answer(conn, f.msg_id, frame(T.GROUP_COMMIT_OK, f.msg_id), mark)


def group_seek(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """Move a group (``create`` 1: a new one) to the first message at or after a time."""
    q = core.queue(d["queue"])
    if d["create"] > 1:
        raise InvalidArgument(f"GROUP_SEEK create must be 0 or 1, not {d['create']}")
    seek = q.create_group_at if d["create"] else q.seek
    offset, mark = seek(d["group"], d["timestamp_ns"])
    core.answer(conn, f.msg_id, frame(T.GROUP_SEEK_OK, f.msg_id, offset=offset), mark)
    poke(core, d["queue"])  # messages sought back are deliverable now


def group_delete(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    mark = core.queue(d["queue"]).delete_group(d["group"])
    conn.leases.forget_gone()
    core.answer(conn, f.msg_id, frame(T.GROUP_DELETE_OK, f.msg_id), mark)


def group_list(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    conn.reply(f, T.GROUP_LIST_OK, groups=core.queue(d["queue"]).groups())


def read(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    n = max(1, min(d["max"], options.MAX_BATCH))
    # a reply never outgrows a frame: the reader asks again from where this one stops
    field = core.queue(d["queue"]).read_field(d["offset"], n,
                                              options.MAX_FRAME - READ_HEADROOM - RECORD_COLUMNS * n)
    conn.send(encode_frame(T.READ_OK, f.msg_id, field))


def stats(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    conn.reply(f, T.STATS_OK, stats=core.queue(d["queue"]).stats())


def purge(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    n, mark = core.queue(d["queue"]).purge()
    core.answer(conn, f.msg_id, frame(T.PURGE_OK, f.msg_id, purged=n), mark)


def info(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """INFO: what the instance says of itself (``ServerBroker.info``), with the workers'
    connection counts (``placement.Counts``: every worker's, as this one sees them now)."""
    counts = core.counts.snapshot() if core.counts is not None else None
    about = replace(core.broker.info(), worker=core.worker_id, connections=counts,
                    workers=None if counts is None else len(counts),
                    replication=None if core.replication is None else core.replication())
    conn.reply(f, T.INFO_OK, info=asdict(about))


def promote(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """PROMOTE on a primary: refused (it is for a standby: ``server.standby``)."""
    epoch = (core.replication() if core.replication is not None else {}).get("epoch", 1)
    raise InvalidArgument(f"this broker is a primary already (epoch {epoch}): shmq promote is for a standby "
                          "(shmq serve --replica-of)")


def disconnect(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """The client leaves: its leases go back and its reply queues go now, then
    DISCONNECT_OK, then the close."""
    touched = core.give_back(conn)
    core.drop_reply_queues(conn)
    conn.reply(f, T.DISCONNECT_OK)
    end(core, conn)
    for name in touched:
        poke(core, name)


# ---------------------------------------------------------------- push mode
def subscribe(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    core.queue(d["queue"]).group_ref(d["group"])  # creates the group if new, checks the name
    s = Subscription(conn, f.msg_id, d["queue"], d["group"], d["credit"], d["visibility_ms"])
    core.add_sub(s)
    conn.reply(f, T.SUBSCRIBE_OK)
    push(core, s)


def credit(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    s = conn.subs.get(d["subscription"])
    if s is not None:
        s.credit += d["credit"]
        push(core, s)


def unsubscribe(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    s = conn.subs.pop(d["subscription"], None)
    if s is not None:
        core.drop_sub(s)
    conn.reply(f, T.UNSUBSCRIBE_OK)


def heartbeat(core: Core, conn: ServerConnection, f: Frame, d: dict[str, Any]) -> None:
    """The client is alive (the driver counted the read); nothing to answer."""


WAITED_BATCH_ACKS = frozenset((T.ACK_BATCH, T.ACK_RANGE))  # answered with ACK_BATCH_OK

HANDLERS: dict[int, Handler] = {
    T.PRODUCE: produce, T.PRODUCE_BATCH: produce, T.PRODUCE_IDEMPOTENT: produce,
    T.CONSUME: get, T.CONSUME_BATCH: get,
    T.ACK: ack, T.ACK_NO_REPLY: ack, T.ACK_BATCH: ack_batch, T.ACK_BATCH_NO_REPLY: ack_batch,
    T.ACK_RANGE: ack_range, T.ACK_RANGE_NO_REPLY: ack_range,
    T.NACK: nack, T.TOUCH: touch, T.DEAD_LETTER: dead_letter,
    T.CREATE_QUEUE: create_queue, T.DELETE_QUEUE: delete_queue, T.LIST_QUEUES: list_queues,
    T.GROUP_JOIN: group_join, T.GROUP_COMMIT: group_commit, T.GROUP_DELETE: group_delete,
    T.GROUP_LIST: group_list, T.READ: read, T.STATS: stats, T.PURGE: purge, T.INFO: info,
    T.DISCONNECT: disconnect, T.SUBSCRIBE: subscribe, T.CREDIT: credit, T.UNSUBSCRIBE: unsubscribe,
    T.HEARTBEAT: heartbeat, T.GROUP_SEEK: group_seek, T.PROMOTE: promote,
}


def decode_request(f: Frame) -> dict[str, Any]:
    """The fields of a request that has no flags of its own: its body, as its schema says."""
    return decode_body(f.type, f.body)


# how the body of each request in HANDLERS is read: its fields, given to its handler
DECODERS: dict[int, Decoder] = {
    **dict.fromkeys(HANDLERS, decode_request),
    T.PRODUCE: decode_produce, T.PRODUCE_BATCH: decode_produce, T.PRODUCE_IDEMPOTENT: decode_produce,
    T.CONSUME: decode_consume, T.CONSUME_BATCH: decode_consume,
}
