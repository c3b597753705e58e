"""``ShmQueue.put_joined``: a batch given as its payloads' lengths and their bytes back to
back (the Spark sink's chunks) is stored exactly as ``put_many`` stores the same payloads:
the same records, offsets and ring words, across the byte ring's end too; idempotent per
(producer, seq); every refusal writes nothing.  The broker stores a PRODUCE_BATCH without
headers the same way."""

from __future__ import annotations

from typing import Any

import pytest

import shmq
from shmq.core import layout as L
from shmq.core.colocated import ShmBroker
from shmq.core.queue import ShmQueue
from shmq.errors import Status
from shmq.joined import Joined
from shmq.protocol.codec import T
from shmq.server.core import Core
from tests.support.durable import Durable
from tests.support.peer import Peer


def payloads(n: int, k: int) -> list[bytes]:
    return [bytes([(k + i) % 251]) * ((k + i) % 23 + 1) for i in range(n)]


def joined(ps: list[bytes]) -> Joined:
    return Joined([len(p) for p in ps], b"".join(ps))


def state(q: shmq.Queue) -> tuple[list[tuple[int, bytes]], list[int]]:
    """Every retained record, and the ring's slots (offset, byte position, lengths) and tail."""
    r = q.ring  # type: ignore[attr-defined]
    w = r.w
    slots = [w[r.slots_w + i * r.slot_words + k] for i in range(r.capacity)
             for k in (L.S_OFFSET, L.S_BYTEPOS, L.S_LENS)]
    first = q.stats()["first_offset"]
    return ([(m.offset, bytes(m.payload)) for m in q.read(first, 10_000)],
            [*slots, w[L.Q_TAIL_BYTES], w[L.Q_NEXT_OFFSET]])


def test_a_joined_batch_is_stored_as_put_many_stores_it(instance: str) -> None:
    """Batches that lap the byte ring (a run split at its end) and the slot table."""
    b = ShmBroker(instance)
    try:
        qs = [b.create_queue(name, capacity=64, max_bytes=4096) for name in ("many", "joined")]
        seq = 0
        for k in range(0, 3000, 30):  # about 36 KiB through a 4 KiB byte ring
            batch = payloads(30, k)
            seq += 1
            first = [qs[0].put_many(batch, producer="p", seq=seq)[0],
                     qs[1].put_joined(joined(batch), producer="p", seq=seq)]
            assert first[0] == first[1] == k
            for q in qs:
                q.commit("default", k + 20)  # keep 10 back: the next batch lands around them
        assert state(qs[0]) == state(qs[1])
        assert [p for _, p in state(qs[1])[0]] == payloads(10, 2990)
    finally:
        b.destroy()


def test_a_joined_batch_is_idempotent_and_refusals_write_nothing(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("j", capacity=8, max_bytes=4096, max_message_size=100)
        ps = payloads(5, 0)
        assert q.put_joined(joined(ps), producer="p", seq=1) == 0
        with pytest.raises(shmq.Duplicate):
            q.put_joined(joined(payloads(2, 9)), producer="p", seq=1)
        with pytest.raises(shmq.InvalidArgument):
            q.put_joined(Joined([3, 3], b"12345"), producer="p", seq=2)  # lengths and bytes disagree
        with pytest.raises(shmq.InvalidArgument):
            q.put_joined(Joined([], b""), producer="p", seq=2)
        with pytest.raises(shmq.MessageTooLarge):
            q.put_joined(Joined([101], b"x" * 101), producer="p", seq=2)
        with pytest.raises(shmq.InvalidArgument):
            q.put_joined(Joined([1], b"x"), producer="p", seq=0)
        with pytest.raises(shmq.Full):
            q.put_joined(joined(payloads(4, 0)), producer="p", seq=2, timeout=0)  # 5 + 4 > 8 slots
        assert [bytes(m.payload) for m in q.read(0, 100)] == ps
        assert q.put_joined(joined(payloads(3, 5)), producer="p", seq=2) == 5
        assert [bytes(m.payload) for m in q.read(0, 100)] == payloads(8, 0)
    finally:
        b.destroy()


def test_a_joined_batch_on_a_journaled_queue_survives_kill9(durable: Durable) -> None:
    """On an ``always`` queue the journal has the batch before put_joined returns: a broker
    killed with its shared memory removed gives back every payload from disk."""
    with shmq.connect(durable.srv.url) as b:
        b.create_queue("jj", durability="always")
    local = ShmBroker(durable.inst)
    try:
        ps = payloads(40, 3)
        assert local.queue("jj").put_joined(joined(ps), producer="p", seq=1) == 0
    finally:
        local.close()
    durable.crash(reboot=True)
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        q = b.queue("jj")
        assert [bytes(m.payload) for m in q.read(0, 100)] == ps
        with pytest.raises(shmq.Duplicate):  # the producer's sequence was journaled too
            q.put_many([b"again"], producer="p", seq=1)


def test_the_broker_stores_a_plain_produce_batch_from_its_joined_bytes(
        core: Core, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PRODUCE_BATCH / PRODUCE_IDEMPOTENT without headers reaches the queue as one
    ``Joined`` (``codec.decode_joined``), with put_many's answers and errors."""
    seen: list[int] = []
    real = ShmQueue.put_joined

    def spy(self: ShmQueue, batch: Joined, *a: Any, **kw: Any) -> int:
        seen.append(len(batch))
        return real(self, batch, *a, **kw)

    monkeypatch.setattr(ShmQueue, "put_joined", spy)
    local = ShmBroker(core.broker.instance)
    try:
        q = local.create_queue("tcpj", capacity=8)
        p = Peer(core)
        ps = payloads(5, 1)
        assert p.ok(T.PRODUCE_BATCH, T.PRODUCE_BATCH_OK, queue="tcpj", timeout_ms=0, payloads=ps) == {
            "first": 0, "count": 5}
        assert p.ok(T.PRODUCE_IDEMPOTENT, T.PRODUCE_BATCH_OK, queue="tcpj", producer="p", seq=3,
                    timeout_ms=0, payloads=payloads(2, 7)) == {"first": 5, "count": 2}
        dup = p.call(T.PRODUCE_IDEMPOTENT, queue="tcpj", producer="p", seq=3, timeout_ms=0, payloads=[b"x"])
        assert dup.status == Status.DUPLICATE
        never = p.call(T.PRODUCE_BATCH, queue="tcpj", timeout_ms=0, payloads=payloads(9, 0))
        assert never.status == Status.QUEUE_FULL  # 9 can never fit 8 slots: refused, not parked
        assert seen == [5, 2, 1, 9]
        assert [bytes(m.payload) for m in q.read(0, 100)] == ps + payloads(2, 7)
    finally:
        local.close()
