"""Doorbells (shmq.core.doorbell): a ring reaches the workers whose flag is set, and only them."""

from __future__ import annotations

import os
import secrets

from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.doorbell import NO_BELLS, RINGER, Bell, Ringer
from tests.support.clock import FakeClock
from tests.support.nobody import as_nobody, as_root


def _flags(*workers: int) -> bytes:
    b = bytearray(L.Q_BELLS_SIZE)
    for i in workers:
        b[i] = 1
    return bytes(b)


def test_a_ring_reaches_every_flagged_worker_but_the_skipped_one() -> None:
    uid = secrets.randbits(64)
    bells = [Bell(uid, i) for i in range(4)]
    try:
        RINGER.ring(_flags(0, 2, 3), uid, 7, skip=3)
        RINGER.ring(_flags(2), uid, 9, skip=-1)
        RINGER.ring(_flags(2), uid, 9, skip=-1)  # twice: drained as one
        assert bells[0].drain() == {7}
        assert bells[1].drain() == set()  # not flagged
        assert bells[2].drain() == {7, 9}
        assert bells[3].drain() == set()  # the ringer itself
        assert bells[2].drain() == set()  # drained
    finally:
        for b in bells:
            b.close()


def test_ringing_nobody_and_a_full_doorbell_never_raise_nor_block() -> None:
    uid = secrets.randbits(64)
    RINGER.ring(_flags(5, 63), uid, 1, skip=-1)  # nobody bound: dropped
    bell = Bell(uid, 0)
    try:
        for _ in range(100_000):  # far past the socket's receive buffer
            RINGER.ring(_flags(0), uid, 1, skip=-1)
        assert bell.drain() == {1}
    finally:
        bell.close()


def test_instances_do_not_hear_each_other() -> None:
    a, b = secrets.randbits(64), secrets.randbits(64)
    bell_a, bell_b = Bell(a, 0), Bell(b, 0)
    try:
        RINGER.ring(_flags(0), a, 3, skip=-1)
        assert bell_a.drain() == {3}
        assert bell_b.drain() == set()
    finally:
        bell_a.close()
        bell_b.close()


def test_a_forked_child_rings_too() -> None:
    uid = secrets.randbits(64)
    bell = Bell(uid, 1)
    ringer = Ringer()
    try:
        ringer.ring(_flags(1), uid, 11, skip=-1)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                ringer.ring(_flags(1), uid, 12, skip=-1)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert bell.drain() == {11, 12}
    finally:
        bell.close()


def test_no_bells_is_a_table_with_no_flag() -> None:
    assert NO_BELLS == bytes(L.Q_BELLS_SIZE) and len(NO_BELLS) == L.Q_BELLS_SIZE


def test_messages_given_back_ring_as_a_put_does(clocked: ShmBroker, clock: FakeClock) -> None:
    """A nack without delay and a lease expired by maintenance make a message deliverable
    again: like a put, they ring the workers with requests parked on the queue, so a get
    parked on another worker is retried at once rather than on its tick."""
    q = clocked.create_queue("giveback", visibility_timeout=5)
    qid = q.ring.queue_id
    bell = Bell(q.ring.instance_uid, 5)
    try:
        q._mm[L.Q_BELLS + 5] = 1  # worker 5 has a request parked here
        q.put_many([b"a", b"b"])
        assert bell.drain() == {qid}
        a, b = q.get_many(2)
        a.nack(delay=1)  # deliverable only later: no ring (the waiter's tick covers it)
        assert bell.drain() == set()
        b.nack()
        assert bell.drain() == {qid}
        again = q.get(timeout=0)
        assert again.payload == b"b" and bell.drain() == set()
        clock.advance(10)  # its lease expires
        assert q.maintain() == 1
        assert bell.drain() == {qid}
        assert q.maintain() == 0 and bell.drain() == set()
    finally:
        bell.close()


def _ring(instance_uid: int, worker: int, qid: int) -> None:
    Ringer().ring(_flags(worker), instance_uid, qid, -1)


@as_root
def test_a_bell_ignores_another_users_datagrams() -> None:
    """The abstract namespace has no permissions: any local user can send to a bell.
    Only datagrams of the bell's own user count (SCM_CREDENTIALS)."""
    uid = secrets.randbits(62)
    bell = Bell(uid, 5)
    try:
        assert as_nobody(_ring, uid, 5, 666) is None
        Ringer().ring(_flags(5), uid, 7, -1)  # ours, after theirs: both are queued by now
        assert bell.drain() == {7}
    finally:
        bell.close()
