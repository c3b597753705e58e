"""Named crash points: the places where a process may die between two stores that matter.

A process whose environment has ``SHMQ_CRASH_POINT=NAME`` (or ``NAME:N``) SIGKILLs
itself at the first (N-th) pass through the point ``NAME``; tests and ``bench/chaos.py``
use them to prove that every such death is recoverable (FoundationDB's and SQLite's
fault-injection points, for shared memory).  ``python -m shmq.crashpoints`` prints every
name, one a line; ``docs/architecture.md`` says why the state each one leaves is
recoverable.

Cost when unset: none beyond a branch on one flag, this module's :data:`active`, which
every point reads and only this module sets::

    if crashpoints.active:
        crashpoints.hit("put.written")

``arm()`` arms a point later (a forked child in a test), ``disarm()`` disarms it; no
other module's globals are written.

The compiled stores (``shmq.accel``: ``put_one``, ``deliver_one``, ``ack_one``,
``ack_run``, ``settle_range``) pass the same points as their Python twins, between the
same stores (``crash_point`` in ``shmq/_speedups.h``, unarmed the test of one byte):
arming a point changes nothing else, the compiled path stays the one that runs.  When
the accelerator is loaded the count of passes lives there, one for both languages:
``arm``, ``disarm`` and ``hit`` hand it the point.
"""

from __future__ import annotations

import os
import signal

from shmq.accel import ext

ENV = "SHMQ_CRASH_POINT"

# name -> what the process has done when it dies there (docs/architecture.md says why
# each state is recoverable).  Keep the names grouped by the code that passes them.
POINTS: dict[str, str] = {
    # ring.py: producers, under the producer lock
    "put.written": "a single put wrote its record and slot, not the commit (Q_NEXT_OFFSET)",
    "put.committed": "a single put committed, still holding the producer lock",
    "put_many.written": "a batch put wrote its records and slots, not the commit",
    "put_many.committed": "a batch put committed, still holding the producer lock",
    "put_idem.pending": "an idempotent put named its producer entry (Q_PENDING_PRODUCER) only",
    "put_idem.entry": "an idempotent put rewrote its producer entry, not the commit",
    "put_idem.committed": "an idempotent put committed, Q_PENDING_PRODUCER still set",
    # core/consumer.py: sleepers
    "wait.announced": "a blocked put or get counted itself as a waiter and died asleep",
    # core/delivery.py: deliveries, under the consumer lock
    "deliver.one.leased": "the single-message hot path stored a lease word, not the cursor",
    "deliver.run.leased": "the general path leased a run of new messages, not the cursor",
    "deliver.block.leased": "the batch hot path leased a run, not the cursor",
    "deliver.cursor": "a delivery moved the cursor, not the expiry hint",
    "redeliver.leased": "a redelivery leased a READY word, not the hints",
    "ttl.expired": "a TTL expiry stored the word (DONE or DEADING), not the cursor or counter",
    "expire.given_back": "an expiry scan gave a lease back, not the expiry hint",
    # core/settlement.py, core/group_table.py: settling, floors, groups
    "ack.done": "an ack stored DONE, not the counters or the floor",
    "ack_range.done": "a run ack stored DONE for the run, not the floor",
    "ack_batch.partial": "a batch ack stored DONE for part of its offsets",
    "floor.moved": "a floor moved, not the free offset",
    "nack.hints": "a give-back (nack, expiry, reap) raised the hints, not the lease word",
    "touch.extended": "a touch stored the new deadline, not the expiry hint",
    "dead.marked": "a dead-letter marked the word DEADING, before the copy",
    "commit.word": "a commit (or a seek forward) stored DONE for some of its words, not the rest",
    "commit.words": "a commit stored DONE words, not the cursor",
    "group.create.active": "a group create stored ACTIVE, not the generation",
    "group.delete.freed": "a group delete stored FREE, not the generation",
    "reap.partial": "a reaper gave back part of a dead client's leases in one queue",
    # core/groups.py: seeks, under the consumer lock (G_SEEK_TO stored first)
    "seek.floor": "a seek back stored its target and lowered the floor (if it had to), no word changed",
    "seek.word": "a seek back rewrote some of its words (DONE below the target, READY from it), not the rest",
    "seek.words": "a seek back rewrote every word, not the hints, the floor or the free offset",
    # core/handle.py, core/serverqueue.py, core/colocated.py: copies, give-backs, reaping, queues
    "dlq.copied": "a dead-letter copy is in the DLQ, the original is still DEADING",
    "dlq.orphaned": "a failed dead-letter copy was orphaned, Q_ORPHANS not set",
    "give_back.chunk": "a closed connection's leases were given back in part",
    "reap.queue": "a reaper finished one queue of a dead client, the slot still taken",
    "queue.create.segment": "a queue's segment and semaphores exist, not the registry entry",
    "queue.create.published": "a queue is in the registry, the registry lock still held",
    "queue.delete.marked": "a queue is marked deleted, still in the registry",
    "queue.delete.unlisted": "a queue left the registry, its segment not unlinked",
    # registry.py: client slots, under the registry lock
    "registry.slot.taken": "a client slot was taken, the registry lock still held",
    "registry.slot.freed": "a client slot was freed, the registry lock still held",
    # server/ (core, delivery, parking, handlers; journaler): workers and the journal process
    "worker.give_back.queue": "a closing connection's leases went back in one queue (or group), not the rest",
    "worker.deliver.unsent": "a worker leased messages for a DELIVER (batch, push) and did not send it",
    "worker.produce.unanswered": "a worker stored a produce (single, batch, publisher run), no reply sent",
    "worker.ack.unanswered": "a worker applied an ACK, no reply sent",
    "journal.round.appended": "a journal round of new messages is fsynced, Q_DURABLE_OFFSET not published",
    "journal.round.published": "a journal round published its durable marks, not the free offset or wake-ups",
    "recovery.rebuilt": "the supervisor rebuilt one queue from its journal, not the rest; nothing forked yet",
}

_CHECK = ""  # the armed point's name ("" when none)
_LEFT = 0  # passes left until the kill
active = False  # is a point armed in this process?  (every point's test, read as crashpoints.active)


def _parse(spec: str) -> tuple[str, int]:
    name, _, n = spec.partition(":")
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: no crash point named {name!r} "
                         "(python -m shmq.crashpoints lists them)")
    count = int(n) if n else 1
    if count < 1:
        raise ValueError(f"{ENV}={spec!r}: the pass count must be >= 1")
    return name, count


def arm(name: str, count: int = 1) -> None:
    """Die at the ``count``-th pass through ``name`` from now on (in this process)."""
    global _CHECK, _LEFT, active
    _CHECK, _LEFT = _parse(f"{name}:{count}")
    active = True
    if ext is not None:
        ext.crash_arm(_CHECK, _LEFT)


def disarm() -> None:
    global _CHECK, _LEFT, active
    _CHECK, _LEFT, active = "", 0, False
    if ext is not None:
        ext.crash_disarm()


def hit(name: str) -> None:
    """A pass through the point ``name``: SIGKILL this process if it is the armed one's turn."""
    global _LEFT
    if name != _CHECK:
        return
    if ext is not None:  # (the count is the compiled stores' too)
        ext.crash_hit(name)
        return
    _LEFT -= 1
    if _LEFT <= 0:
        os.kill(os.getpid(), signal.SIGKILL)


def armed() -> str:
    """The armed point's name, "" when none (this process)."""
    return _CHECK


_spec = os.environ.get(ENV, "")
if _spec:
    _CHECK, _LEFT = _parse(_spec)
    active = True
    if ext is not None:
        ext.crash_arm(_CHECK, _LEFT)


if __name__ == "__main__":
    for _name in POINTS:
        print(_name)
