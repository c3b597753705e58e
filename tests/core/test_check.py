"""The invariant checker (``shmq doctor --check``): clean on a healthy instance, and each
kind of damage it looks for is reported, one line per violation."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from typer.testing import CliRunner

from shmq.cli.app import app
from shmq.core import layout as L
from shmq.core.check import check_instance
from shmq.core.colocated import ShmBroker
from shmq.core.queue import ShmQueue


def _busy_queue(b: ShmBroker) -> ShmQueue:
    """A queue in a mixed state: acked, leased, given back, two groups, wrapped."""
    q = b.create_queue("q", capacity=8, max_bytes=4096)
    q.create_group("g2")
    for i in range(12):
        q.put(f"m{i}".encode())
        q.get().ack()
        q.get(group="g2").ack()
    q.put_many([b"a", b"b", b"c"])
    q.get().nack(delay=5)
    q.get_many(2)
    return q


def _word(q: ShmQueue, offset: int, group: int = 0) -> int:
    return q.ring.slot_base(offset) + L.S_GROUPS + group


DAMAGE: dict[str, tuple[Callable[[ShmQueue], None], str]] = {
    "ready past the cursor": (lambda q: q.words.__setitem__(
        _word(q, q.offsets()[1] - 1, 1), L.lease_word(L.READY, 1, L.NO_OWNER, 0)), "past the cursor"),
    "new below the cursor": (lambda q: q.words.__setitem__(_word(q, q.offsets()[0] + 1), L.NEW),
                             "below the cursor is NEW"),
    "floor on a done word": (lambda q: q.words.__setitem__(_word(q, q.offsets()[0]),
                                                        L.lease_word(L.DONE, 1, 0, 0)), "stands on a DONE"),
    "redeliver hint too low": (lambda q: q.words.__setitem__(q.ring.groups_w + L.G_REDELIVER, 0),
                               "G_REDELIVER"),
    "expiry hint too late": (lambda q: q.words.__setitem__(q.ring.groups_w + L.G_NEXT_EXPIRY, 1 << 39),
                             "G_NEXT_EXPIRY"),
    "free offset ahead": (lambda q: q.words.__setitem__(L.Q_FREE_OFFSET, q.words[L.Q_FREE_OFFSET] + 1),
                          "free offset"),
    "slot names another offset": (lambda q: q.words.__setitem__(q.ring.slot_base(q.offsets()[0]), 999),
                                  "names offset 999"),
    "serial of a free group": (lambda q: q.words.__setitem__(q.ring.groups_w + 5 * L.G_WORDS + L.G_SERIAL, 7),
                               "free group index 5 keeps serial"),
    "lease of a free client slot": (lambda q: q.words.__setitem__(
        _word(q, q.offsets()[1] - 1), L.lease_word(L.LEASED, 1, 900, 1 << 30)), "client slot 900"),
    "seek left unfinished": (lambda q: q.words.__setitem__(q.ring.groups_w + L.G_SEEK_TO, 3),
                             "seek to offset 2 was left unfinished"),
}


def test_a_busy_instance_is_clean(shm_broker: ShmBroker) -> None:
    _busy_queue(shm_broker)
    assert check_instance(shm_broker.instance) == []


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_reported(shm_broker: ShmBroker, damage: str) -> None:
    q = _busy_queue(shm_broker)
    saved = bytes(q.ring.mm)
    harm, says = DAMAGE[damage]
    with q.ring.clock:
        harm(q)
    found = check_instance(shm_broker.instance)
    assert found and any(says in v for v in found), found
    assert all(v.startswith("q: ") for v in found)
    with q.ring.plock, q.ring.clock:  # undo, for the fixture's own check
        q.ring.mm[L.Q_HEADER_SIZE:] = saved[L.Q_HEADER_SIZE:]
        q.ring.mm[:L.Q_LOCK_P] = saved[:L.Q_LOCK_P]


def test_an_orphaned_segment_is_reported(shm_broker: ShmBroker) -> None:
    shm_broker.create_queue("q")
    reg = shm_broker._att.registry
    with reg.lock:
        reg.w[L.R_NEXT_QUEUE_ID] += 1
    from shmq.core.segment import Mapping, queue_segment_name, unlink_shm
    name = queue_segment_name(shm_broker.instance, 2)
    Mapping.create(name, 4096).close()
    try:
        assert check_instance(shm_broker.instance) == [
            f"registry: segment {name[1:]} belongs to no queue (an orphan)"]
    finally:
        unlink_shm(name)


def test_doctor_check_cli(shm_broker: ShmBroker) -> None:
    q = _busy_queue(shm_broker)
    runner = CliRunner()
    out = runner.invoke(app, ["doctor", "--check", "--instance", shm_broker.instance])
    assert out.exit_code == 0 and "clean" in out.output
    with q.ring.clock:
        old = q.words[q.ring.groups_w + L.G_REDELIVER]
        q.words[q.ring.groups_w + L.G_REDELIVER] = 0
    try:
        out = runner.invoke(app, ["doctor", "--check", "--instance", shm_broker.instance, "--json"])
        assert out.exit_code == 1
        found = json.loads(out.output)[shm_broker.instance]
        assert len(found) == 1 and "G_REDELIVER 0 is below the 1 READY words" in found[0]
    finally:
        with q.ring.clock:
            q.words[q.ring.groups_w + L.G_REDELIVER] = old
    out = runner.invoke(app, ["doctor", "--check", "--instance", "no-such-instance"])
    assert out.exit_code == 1
