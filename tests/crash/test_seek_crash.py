"""A seek killed half-way is all or nothing: a process SIGKILLed at each of a seek's crash
points (``seek.*``, ``commit.word``, ``commit.words``, ``floor.moved``) leaves its target in
G_SEEK_TO, and the next holder of the consumer lock finishes the seek.  After the kill the
queue passes ``shmq doctor --check``, and every message's fate is the whole seek's: the
same as the same seek run to its end without a kill."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import dataclass

import pytest

import shmq
from shmq import crashpoints
from shmq.core import layout as L
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.core.queue import ShmQueue
from tests.support.connect import connect_shm
from tests.support.seek import between, spaced

pytestmark = pytest.mark.crash

CTX = mp.get_context("fork")
N = 8  # messages m0 .. m7


@dataclass(frozen=True)
class Case:
    """A group state to seek from and where to: ``acked``, ``held`` (leased, kept by the
    test) and ``nacked`` (given back) offsets of the group, its cursor one past the last of
    them; the target message; and the whole seek's outcome: (floor, cursor), then what
    the group gets afterwards, in order, as (offset, deliveries)."""

    acked: tuple[int, ...]
    held: tuple[int, ...]
    nacked: tuple[int, ...]
    to: int
    position: tuple[int, int]
    after: tuple[tuple[int, int], ...]


CASES = {
    # back past the floor: the floor is lowered, m2 m3 (acked) and m4 (leased) delivered again
    "back": Case(acked=(0, 1, 2, 3), held=(4,), nacked=(5,), to=2, position=(2, 6),
                 after=((2, 2), (3, 2), (4, 2), (5, 2), (6, 1), (7, 1))),
    # back, above the floor: m2 (leased) settled below the target, m4 (leased) delivered again
    "between": Case(acked=(0, 1), held=(2, 4), nacked=(3,), to=3, position=(3, 5),
                    after=((3, 2), (4, 2), (5, 1), (6, 1), (7, 1))),
    # forward past the cursor: m1 (leased), m2 (given back), m3 m4 (new) settled
    "forward": Case(acked=(0,), held=(1,), nacked=(2,), to=5, position=(5, 5),
                    after=((5, 1), (6, 1), (7, 1))),
}

# every crash point each seek passes, with the pass to die at
POINTS = {
    "back": ["seek.floor", "seek.word", "seek.word:2", "seek.word:3", "seek.words"],
    "between": ["seek.floor", "seek.word", "seek.word:2", "seek.words", "floor.moved"],
    "forward": ["commit.word", "commit.word:3", "commit.word:4", "commit.words", "floor.moved"],
}
PARAMS = [(c, p) for c, points in POINTS.items() for p in [None, *points]]


def _prepare(b: ShmBroker, case: Case) -> tuple[ShmQueue, list[int], list[shmq.Message]]:
    """The queue, its messages' timestamps and the leases the test holds.  Group ``keep``
    holds every message (so a seek back finds them retained) and is never touched."""
    q = b.create_queue("q", capacity=16, visibility_timeout=60)
    q.create_group("keep")
    stamps = spaced(q, N)
    held = []
    for m in q.get_many(max(case.acked + case.held + case.nacked) + 1, block=False):
        if m.offset in case.acked:
            m.ack()
        elif m.offset in case.nacked:
            m.nack()
        else:
            held.append(m)
    assert [m.offset for m in held] == list(case.held)
    return q, stamps, held


def _seek_and_die(url: str, point: str, when: float) -> None:
    name, _, n = point.partition(":")
    crashpoints.arm(name, int(n or 1))
    connect_shm(url).queue("q").seek("default", when)
    os._exit(3)  # the seek never passed the point: the test fails


def _drain(q: ShmQueue, group: str) -> list[tuple[int, int]]:
    got: list[tuple[int, int]] = []
    while True:
        try:
            m = q.get(group=group, block=False)
        except shmq.Empty:
            return got
        got.append((m.offset, m.deliveries))
        assert m.payload == b"m%d" % m.offset
        m.ack()


@pytest.mark.parametrize(("case", "point"), PARAMS, ids=[f"{c}-{p or 'no-kill'}" for c, p in PARAMS])
def test_a_seek_killed_anywhere_is_finished_whole(instance: str, case: str, point: str | None) -> None:
    c = CASES[case]
    b = ShmBroker(instance)
    q, stamps, held = _prepare(b, c)
    when = between(stamps, c.to)
    if point is None:  # the same seek, to its end: the outcome the killed ones must reach
        assert q.seek("default", when) == c.to
    else:
        p = CTX.Process(target=_seek_and_die, args=(b.url, point, when))
        p.start()
        p.join(30)
        assert p.exitcode == -signal.SIGKILL, f"the seek did not die at {point}: exit code {p.exitcode}"
        g = q.ring.groups_w + q.consumer_groups.index("default") * L.G_WORDS
        assert q.words[g + L.G_SEEK_TO] == c.to + 1  # left for the lock's repair
    assert check_instance(instance) == []  # (it takes the lock: the repair runs first)
    st = q.stats()["groups"]["default"]
    assert (st["floor"], st["cursor"]) == c.position
    for m in held:  # every lease the seek passed over turned stale
        with pytest.raises(shmq.StaleAck):
            m.ack()
    assert _drain(q, "default") == list(c.after)
    assert _drain(q, "keep") == [(o, 1) for o in range(N)]  # other groups are untouched
    assert check_instance(instance) == []
    b.reap()
    b.destroy()
