"""Leasing messages out: the answer to a CONSUME, and a subscription's pushes.

Every message sent is a lease of the connection it goes to (``Leases``): held
until it is settled, or given back when the connection goes.  Nothing leased
ever waits for the journal: a delivery changes no durable state.
"""

from __future__ import annotations

from itertools import repeat

from shmq import crashpoints, options
from shmq.core.serverqueue import ServerQueue
from shmq.errors import QueueNotFound
from shmq.protocol.codec import T, deliver_frame, encode_frame, frame, records_field

from .connection import ServerConnection, Subscription
from .core import Core

RECORD_COLUMNS = 26  # bytes of columns per record of a DELIVER_BATCH (offset, deliveries, stamp, lengths)
READ_HEADROOM = 4096  # bytes of a READ_OK kept for its header and the records' columns


def deliver(conn: ServerConnection, q: ServerQueue, group: str, n: int, vis_ms: int, msg_id: int,
            one: bool) -> int:
    """Lease up to ``n`` messages of ``group`` to ``conn`` and send them with ``msg_id``:
    one DELIVER when ``one``, else one DELIVER_BATCH.  The number sent, 0 when none
    was ready."""
    vis = vis_ms / 1000 if vis_ms else None
    budget = 0
    if not one:  # a batch: new messages stored back to back go out as columns
        budget = options.MAX_FRAME - 4 - RECORD_COLUMNS * n  # its records fit one frame
        block = q.take_block(group, n, vis, budget) if n > 1 else None
        if block is not None:
            first, stamps, lens, data = block
            k = len(lens)
            if not k:
                return 0  # nothing to deliver at all
            offsets = range(first, first + k)
            conn.leases.add(q, q.group_ref(group), offsets, repeat(1, k))
            if crashpoints.active:
                crashpoints.hit("worker.deliver.unsent")
            conn.send(encode_frame(T.DELIVER_BATCH, msg_id, records_field(
                offsets, [1] * k, stamps, [0] * k, lens, data)))
            return k
    msgs = q.poll(group, n, vis, budget)
    if not msgs:
        return 0
    if crashpoints.active:
        crashpoints.hit("worker.deliver.unsent")
    if one:
        # a Message indexed: (queue, group reference, group, offset, deliveries, payload, meta,
        # timestamp_ns); its properties cost a call each, and these loops run per message (4% of
        # TCP batches, bench/ab.py)
        m = msgs[0]
        conn.leases.add(q, m[1], (m[3],), (m[4],))
        conn.send(deliver_frame(msg_id, m[3], m[4], m[7], bytes(m[6]), m[5]))
    else:
        conn.leases.add(q, msgs[0][1], [m[3] for m in msgs], [m[4] for m in msgs])
        records = [(m[3], m[4], m[7], bytes(m[6]), m[5]) for m in msgs]
        conn.send(frame(T.DELIVER_BATCH, msg_id, records=records))
    return len(msgs)


def push(core: Core, s: Subscription) -> None:
    """Send up to the subscription's credit (what is ready goes out in frames of up to
    MAX_BATCH; DELIVER for a credit of one).  The round robin between a group's
    subscribers comes from each taking at most its credit, and from rotating the
    one pushed to behind the others."""
    total = 0
    conn = s.conn
    try:
        q = core.queue(s.queue)
        while s.credit > 0:
            n = min(s.credit, conn.leases.room(), options.MAX_BATCH)
            if n <= 0:
                break
            sent = deliver(conn, q, s.group, n, s.vis_ms, s.sub_id, s.credit == 1)
            if not sent:
                break
            s.credit -= sent
            total += sent
    except QueueNotFound as e:  # deleted: the subscription ends with the error, its id on it
        conn.subs.pop(s.sub_id, None)
        core.drop_sub(s)
        conn.error(s.sub_id, e.code, str(e))
        return
    if total:
        core.rotate(s)
