"""The optional compiled accelerator (``shmq._speedups``, chosen by ``shmq.accel``) and its
pure-Python twins: each primitive gives the same result, or leaves to its twin exactly the
input its twin refuses; the co-located hot paths behave the same on either; ``SHMQ_PURE=1``
forces the twins."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmq import accel, headers, options
from shmq.api import Message
from shmq.core import consumer as consume
from shmq.core import delivery as group_delivery
from shmq.core import layout as L
from shmq.core import lock, ring
from shmq.core import settlement as group_settlement
from shmq.core.colocated import ShmBroker
from shmq.errors import Full, InvalidArgument, LimitExceeded, StaleAck
from tests.support.compiled import IMPLS, compiled


def test_the_extension_is_built_and_chosen_unless_pure_is_asked() -> None:
    ext = compiled()
    assert {"trylock", "unlock", "encode_headers", "parse_headers", "decode_headers",
            "records", "deliver_one", "ack_one", "put_one"} <= set(dir(ext))
    pure = os.environ.get(accel.PURE_ENV, "") not in ("", "0")
    assert (accel.ext is None) == pure
    assert lock.trylock is (lock._trylock if pure else ext.trylock)


def test_shmq_pure_forces_the_twins_and_the_queue_still_works(instance: str) -> None:
    code = (
        "import sys\n"
        "from shmq import accel, headers\n"
        "from shmq.core import delivery, lock\n"
        "from shmq.core.colocated import ShmBroker\n"
        "assert accel.ext is None and headers.encode_c is headers.parse_c is headers.decode_c is None\n"
        "assert delivery._records is delivery._records_py and lock.trylock is lock._trylock\n"
        "b = ShmBroker(sys.argv[1])\n"
        "q = b.create_queue('pure')\n"
        "q.put(b'a', headers={'k': 'v'}); q.put_many([b'b', b'c'])\n"
        "m = q.get(); assert m.payload == b'a' and dict(m.headers) == {'k': b'v'}; m.ack()\n"
        "ms = q.get_many(5); assert [x.payload for x in ms] == [b'b', b'c']; q.ack_many(ms)\n"
        "print(accel.describe()); b.close()\n")
    out = subprocess.run([sys.executable, "-c", code, instance], env={**os.environ, accel.PURE_ENV: "1"},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "pure Python (SHMQ_PURE is set)"


# ------------------------------------------------------------------ locks
def test_lock_functions_take_and_release_the_robust_mutex(impl: str, instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("locks")
        addr = q.ring.clock.address
        assert lock.trylock(addr) == 0
        assert lock.trylock(addr) == errno.EBUSY  # held (by us): a second try does not take it
        assert lock.unlock(addr) == 0
        with q.ring.clock:  # the RobustLock path runs on the same functions
            assert lock.trylock(addr) == errno.EBUSY
        assert lock.trylock(addr) == 0
        lock.unlock(addr)
    finally:
        b.destroy()


def test_compiled_lock_refuses_a_null_address() -> None:
    with pytest.raises(ValueError, match="null"):
        compiled().trylock(0)
    with pytest.raises(TypeError):
        compiled().unlock("nowhere")


# ------------------------------------------------------------------ headers
def _pure_encode(h: Any) -> bytes | Exception:
    saved = headers.encode_c
    headers.encode_c = None
    try:
        return headers.encode(h)
    except Exception as e:  # noqa: BLE001 - the error itself is the result compared
        return e
    finally:
        headers.encode_c = saved


def _pure_decode(meta: bytes) -> Any:
    saved = headers.parse_c, headers.decode_c
    headers.parse_c = headers.decode_c = None
    try:
        return headers.decode(meta)
    except Exception as e:  # noqa: BLE001
        return e
    finally:
        headers.parse_c, headers.decode_c = saved


def _pure_parse(meta: bytes) -> tuple[dict[str, bytes], int] | Exception:
    saved = headers.parse_c
    headers.parse_c = None
    try:
        return headers._parse(meta)
    except Exception as e:  # noqa: BLE001
        return e
    finally:
        headers.parse_c = saved


keys = st.text(min_size=0, max_size=12)
values = st.one_of(st.binary(max_size=300), st.text(max_size=300))


@given(st.dictionaries(keys, values, max_size=8))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_compiled_encode_matches_the_twin_or_leaves_it_the_error(h: dict[str, Any]) -> None:
    want = _pure_encode(h)
    got = compiled().encode_headers(h, options.MAX_HEADERS, options.MAX_HEADERS_BYTES)
    if isinstance(want, Exception):
        assert got is None
    else:
        assert got == want


@pytest.mark.parametrize("h", [
    {"a": "\ud800"},  # a lone surrogate: str.encode's own error
    {"a": bytearray(b"x")}, {"a": memoryview(b"x")},  # rarer value types: the twin takes them
    {1: b"x"}, {"": b"x"}, {"a": 1},
    {f"k{i}": b"" for i in range(options.MAX_HEADERS + 1)},
    {"big": b"x" * options.MAX_HEADERS_BYTES},
    ["not", "a", "mapping"],
])
def test_compiled_encode_leaves_every_odd_input_to_the_twin(h: Any) -> None:
    assert compiled().encode_headers(h, options.MAX_HEADERS, options.MAX_HEADERS_BYTES) is None


def test_encode_errors_are_the_typed_ones_on_both(impl: str) -> None:
    with pytest.raises(InvalidArgument, match="non-empty str"):
        headers.encode({"": b"x"})
    with pytest.raises(LimitExceeded):
        headers.encode({"big": b"x" * options.MAX_HEADERS_BYTES})
    with pytest.raises(InvalidArgument, match="mapping"):
        headers.encode(["k"])  # type: ignore[arg-type]
    assert headers.encode({"k": bytearray(b"v")}) == headers.encode({"k": b"v"})  # type: ignore[dict-item]


@given(st.binary(max_size=64))
@settings(max_examples=500)
def test_compiled_parse_matches_the_twin_on_any_bytes(blob: bytes) -> None:
    meta = b"\x01" + blob  # mostly malformed: the tag, then anything
    want = _pure_parse(meta)
    got = compiled().parse_headers(meta)
    if isinstance(want, Exception):
        assert got is None
    else:
        assert got == want


@given(st.one_of(st.binary(max_size=40), st.binary(max_size=40).map(lambda b: b"\x01" + b)))
@settings(max_examples=500)
def test_compiled_decode_matches_the_twin_on_any_metadata(meta: bytes) -> None:
    want = _pure_decode(meta)
    got = compiled().decode_headers(meta, headers.EMPTY)
    if isinstance(want, Exception):
        assert got is None
    else:
        assert type(got) is type(want) and got == want
        assert (got is headers.EMPTY) == (want is headers.EMPTY)


def test_compiled_decode_reuses_keys_seen_lately_and_stays_exact() -> None:
    ext = compiled()
    h = {"trace-id": b"1", "content-type": b"json"}
    first = ext.decode_headers(_pure_encode(h), headers.EMPTY)
    again = ext.decode_headers(_pure_encode({"trace-id": b"2", "content-type": b"xml"}), headers.EMPTY)
    assert [k for k in first] == [k for k in again] == list(h)
    assert all(a is b for a, b in zip(first, again, strict=True))  # the same str objects: cached
    # many keys through the small cache (evictions, collisions), ASCII or not, short or long:
    # every decode still equals the twin's
    names = [f"k{i}" for i in range(300)] + ["é", "ключ", "x" * 65, "x" * 64, "k1\x00"]
    for rnd in range(3):
        for i in range(0, len(names), 3):
            block = _pure_encode({k: str(rnd).encode() for k in names[i:i + 3]})
            assert isinstance(block, bytes)
            got = ext.decode_headers(block, headers.EMPTY)
            assert got == _pure_decode(block) and list(got) == list(_pure_decode(block))


@given(st.dictionaries(keys.filter(bool), st.binary(max_size=40), max_size=6), st.binary(max_size=20))
@settings(max_examples=300)
def test_compiled_parse_reads_every_encoded_block(h: dict[str, bytes], tail: bytes) -> None:
    block = _pure_encode(h)
    assert isinstance(block, bytes)
    if not block:
        return
    for meta in (block + tail, memoryview(block + tail)):
        got = compiled().parse_headers(meta)
        assert got == _pure_parse(bytes(meta)) == (h, len(block))
        assert list(got[0]) == list(h)  # the order kept
        view = compiled().decode_headers(meta, headers.EMPTY)
        assert view == _pure_decode(bytes(meta)) == h and list(view) == list(h)


def test_decode_errors_are_the_typed_ones_on_both(impl: str) -> None:
    with pytest.raises(InvalidArgument, match="malformed"):
        headers.decode(b"\x01\x00\x02\x00\x01k\x00\x00")  # says 2, holds 1
    with pytest.raises(InvalidArgument, match="repeated"):
        headers.decode(b"\x01\x00\x02\x00\x01k\x00\x00\x00\x01k\x00\x00")
    assert dict(headers.decode(b"\x01\x00\x01\x00\x01k\x00\x01v{}")) == {"k": b"v"}


# ------------------------------------------------------------------ delivered records
def test_records_match_the_twin_on_a_real_ring(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("rec", capacity=16, max_bytes=1 << 16)
        q.put_many([b"p%d" % i * i for i in range(5)], headers=[{"i": str(i)} if i % 2 else None
                                                                for i in range(5)])
        q.put(b"", headers={"only": "headers"})
        q.put(b"z" * 40_000)  # one big record
        r = q.ring
        b0 = r.slots_w
        for fn in (compiled().records, group_delivery._records_py):
            out: list[Any] = []
            fn(out, Message, (q, 7, "g"), r.w, r.mm, b0, r.slot_words, 7, 0, r.data_off, r.size)
            assert all(type(m) is Message for m in out)
            got = [tuple(m) for m in out]
            if fn is not group_delivery._records_py:
                first = got
        assert got == first
        assert [m[5] for m in got] == [b"p%d" % i * i for i in range(5)] + [b"", b"z" * 40_000]
        assert [dict(headers.decode(m[6])) for m in got][:2] == [{}, {"i": b"1"}]
        assert [m[3] for m in got] == list(range(7)) and {m[4] for m in got} == {1}
        assert all(m[:3] == (q, 7, "g") and m[7] > 0 for m in got)
    finally:
        b.destroy()


def test_compiled_records_checks_its_arguments(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        r = b.create_queue("args", capacity=4).ring
        ext = compiled()
        with pytest.raises(TypeError):
            ext.records([], dict, (), r.w, r.mm, r.slots_w, r.slot_words, 1, 0, r.data_off, r.size)
        with pytest.raises(ValueError, match="past the end"):
            ext.records([], Message, (), r.w, r.mm, r.slots_w, r.slot_words, 10 ** 9, 0, r.data_off, r.size)
        with pytest.raises(ValueError, match="geometry"):
            ext.records([], Message, (), r.w, r.mm, r.slots_w, r.slot_words, 1, 0, r.data_off, 0)
    finally:
        b.destroy()


# ------------------------------------------------------------------ the hot paths, on both
def test_hot_paths_behave_the_same_on_both(impl: str, instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("hot", capacity=8, max_bytes=4096)
        for rnd in range(3):  # three laps: the slot table and the byte ring wrap
            q.put(b"one", headers={"r": str(rnd)})
            m = q.get(timeout=1)
            assert (m.payload, dict(m.headers), m.deliveries) == (b"one", {"r": str(rnd).encode()}, 1)
            m.ack()
            payloads = [bytes([65 + i]) * (100 * i + 1) for i in range(6)]
            q.put_many(payloads, headers=[{"i": str(i)} if i == 3 else None for i in range(6)])
            got = q.get_many(10, timeout=1)
            assert [x.payload for x in got] == payloads
            assert [dict(x.headers) for x in got][2:4] == [{}, {"i": b"3"}]
            q.ack_many(got)
            assert q.stats()["groups"]["default"]["depth"] == 0
        q.put(b"again")
        m = q.get(timeout=1)
        m.ack()
        with pytest.raises(Exception, match="no longer held"):
            m.ack()
    finally:
        b.destroy()


def test_a_batch_of_large_records_is_copied_whole_across_the_ring_end(impl: str, instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("large", capacity=16, max_bytes=40_000)
        for lap in range(4):  # each batch copies record by record (no joined copy), laps the ring
            batch = [os.urandom(3000 + lap) for _ in range(4)]
            q.put_many(batch)
            got = q.get_many(10, timeout=1)
            assert [m.payload for m in got] == batch
            q.ack_many(got)
        q.ring.check_invariants()
    finally:
        b.destroy()


# ------------------------------------------------------------------ one message: put, get, ack
def _words_on_both(instance: str, monkeypatch: pytest.MonkeyPatch, script: Callable[[Any], list[Any]],
                   compiled_fns: dict[tuple[ModuleType, str], Any], **queue: Any) -> list[list[Any]]:
    """What ``script`` leaves in the shared words of a new queue (``queue``: its settings),
    run with the compiled functions (``compiled_fns``: where each is looked up) and then
    with their pure twins."""
    b = ShmBroker(instance)
    try:
        seen = []
        for name, use_c in (("c", True), ("py", False)):
            for (module, attr), fn in compiled_fns.items():
                monkeypatch.setattr(module, attr, fn if use_c else None)
            seen.append(script(b.create_queue(name, **queue)))
        return seen
    finally:
        b.destroy()


def _one_message_script(q: Any) -> list[int]:
    """Puts, gets and acks one at a time, out of order, on two groups, a message with its
    own TTL among them, a stale ack, the slot table and the byte ring lapped; the shared
    words and bytes they leave (lease words less their times, slots less timestamps)."""
    q.put(b"a")
    q.put(b"b", ttl=60)  # a TTL of its own: the compiled deliver_one leaves it to the twin
    q.put(b"c", headers={"k": "v"})
    q.put(b"d")
    m = [q.get(block=False) for _ in range(3)]
    assert [x.payload for x in m] == [b"a", b"b", b"c"] and dict(m[2].headers) == {"k": b"v"}
    m[1].ack()  # out of order: the floor stays
    assert q.offsets()[0] == 0
    m[0].ack()  # the floor passes both: storage freed (the only group)
    assert q.offsets()[0] == 2
    with pytest.raises(StaleAck):
        m[0].ack()
    q.create_group("other", "earliest")  # two groups (from offset 2): the free offset is recomputed
    o = [q.get(False, group="other") for _ in range(2)]
    assert [x.payload for x in o] == [b"c", b"d"]
    m[2].ack()
    assert q.offsets()[0] == 2  # "other" holds it back
    for x in o:
        x.ack()
    assert q.offsets()[0] == 3
    last = q.get(block=False)
    last.ack()
    assert q.offsets()[0] == 4
    for lap in range(12):  # lap the slot table (8) and the byte ring (4096) a few times
        q.put(bytes([lap]) * 700, headers={"lap": str(lap)} if lap % 3 else None)
        x = q.get(block=False)
        want = str(lap).encode() if lap % 3 else None
        assert (x.payload, x.headers.get("lap")) == (bytes([lap]) * 700, want)
        x.ack()
        o = q.get(False, group="other")
        o.ack()
    q.put(b"y" * 3000)
    with pytest.raises(Full):  # no room in the byte ring (4096 B) for 3000 B more
        q.put(b"z" * 3000, block=False)
    r, w = q.ring, q.ring.w
    slots = [w[r.slots_w + i * r.slot_words + k] for i in range(r.capacity)
             for k in (L.S_OFFSET, L.S_BYTEPOS, L.S_LENS, L.S_EXPIRES)]
    data = bytes(r.mm[r.data_off:r.data_off + r.size])
    mask = (1 << L.OWNER_SHIFT) - 1
    words = [w[r.groups_w + gi * L.G_WORDS + k] for gi in range(2)
             for k in (L.G_CURSOR, L.G_FLOOR, L.G_DELIVERED, L.G_ACKED)]
    expiry = [bool(w[r.groups_w + gi * L.G_WORDS + L.G_NEXT_EXPIRY]) for gi in range(2)]  # (a time)
    leases = [w[r.slots_w + i * r.slot_words + L.S_GROUPS + gi] & mask for i in range(r.capacity)
              for gi in range(2)]
    return [*words, *expiry, *leases, *slots, data, w[L.Q_FREE_OFFSET], w[L.Q_NEXT_OFFSET],
            w[L.Q_TAIL_BYTES]]


def test_one_message_paths_leave_the_same_shared_words_on_both(instance: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    ext = compiled()
    seen = _words_on_both(instance, monkeypatch, _one_message_script,
                          {(consume, "_deliver_c"): ext.deliver_one, (consume, "_ack_c"): ext.ack_one,
                           (consume, "_take_c"): ext.take_one, (consume, "_ack_lock_c"): ext.ack_lock,
                           (consume, "_spin_c"): ext.spin_wait, (ring, "_put_c"): ext.put_one},
                          capacity=8, max_bytes=4096)
    assert seen[0] == seen[1]


def test_the_compiled_one_message_path_is_taken_and_leaves_the_twin_what_it_must(
        instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = compiled()
    monkeypatch.setattr(consume, "_deliver_c", ext.deliver_one)
    monkeypatch.setattr(consume, "_ack_c", ext.ack_one)
    twin = []
    real = group_delivery.Delivery.deliver_one

    def counted(self: Any, *a: Any) -> Any:
        twin.append(a[1])
        return real(self, *a)

    monkeypatch.setattr(group_delivery.Delivery, "deliver_one", counted)
    b = ShmBroker(instance)
    try:
        q = b.create_queue("taken", capacity=8)
        q.put_many([b"first", b"plain"])
        q.put(b"own ttl", ttl=60)
        q.get().ack()  # a handle's first get takes the general path (it learns the group)
        q.get().ack()
        assert twin == []  # the compiled one delivered it
        q.get().ack()
        assert len(twin) == 1  # the twin decided on the message with a TTL of its own
        ttlq = b.create_queue("ttl", capacity=8, message_ttl=60)
        assert ttlq._one is None  # a queue TTL: the twin reads the wall clock every time
        ttlq.put_many([b"x", b"y"])
        ttlq.get().ack()
        ttlq.get().ack()
        assert len(twin) == 2
    finally:
        b.destroy()


def test_compiled_one_message_functions_check_their_arguments(instance: str) -> None:
    ext = compiled()
    b = ShmBroker(instance)
    try:
        q = b.create_queue("args1", capacity=4)
        geom = q._one
        assert geom is not None
        with pytest.raises(TypeError):
            ext.deliver_one(geom[:9], 0, 1, 0, 0, "default")
        with pytest.raises(TypeError):
            ext.ack_one(list(geom), 0, 0, 1, -1)
        bad = (geom[0], 10 ** 9, *geom[2:])  # a group table past the end of the mapping
        with pytest.raises(ValueError, match="past the end"):
            ext.deliver_one(bad, 0, 1, 0, 0, "default")
        with pytest.raises(ValueError, match="past the end"):
            ext.ack_one(bad, 0, 0, 1, -1)
        with pytest.raises(ValueError):
            ext.ack_one(geom, 0, 0, 1 << 20, -1)  # a delivery count no lease word holds
        pg = q.ring._put_geom
        with pytest.raises(TypeError):
            ext.put_one(pg[:5], b"x", b"", 1)
        with pytest.raises(TypeError):
            ext.put_one(pg, "not bytes", b"", 1)
        with pytest.raises(ValueError, match="past the end"):
            ext.put_one((pg[0], 10 ** 9, *pg[2:]), b"x", b"", 1)
        with pytest.raises(ValueError, match="geometry"):
            ext.put_one((*pg[:7], 0), b"x", b"", 1)
        lk = q._clock_addr
        with pytest.raises(TypeError):
            ext.take_one(geom[:9], 0, 1, 1000, "default", lk, 0, -1)
        with pytest.raises(ValueError, match="null lock"):
            ext.take_one(geom, 0, 1, 1000, "default", 0, 0, -1)
        with pytest.raises(ValueError, match="owner"):
            ext.take_one(geom, 0, 1 << 13, 1000, "default", lk, 0, -1)  # no owner field holds it
        with pytest.raises(ValueError, match="no such group"):
            ext.take_one(geom, 1 << 5, 1, 1000, "default", lk, 0, -1)  # past the queue's 8 groups
        with pytest.raises(ValueError, match="past the end"):
            ext.take_one(bad, 0, 1, 1000, "default", lk, 0, -1)
        with pytest.raises(ValueError, match="null lock"):
            ext.ack_lock(geom, 0, 0, 1, -1, 0)
        with pytest.raises(ValueError, match="past the end"):
            ext.ack_lock(bad, 0, 0, 1, -1, lk)
        with pytest.raises(TypeError):
            ext.spin_wait(geom, 0, 1000)
        with pytest.raises(ValueError, match="out of range"):
            ext.spin_wait(geom, 1 << 5, 1000, 0)
        with pytest.raises(ValueError, match="out of range"):
            ext.spin_wait(geom, 0, -1, 0)
        assert lock.trylock(lk) == 0  # none of them kept the lock
        lock.unlock(lk)
        assert q.offsets() == (0, 0)  # none of them wrote anything
        assert ext.deliver_one(geom, 0, 1, 0, 0, "default") is None  # nothing to deliver
        assert ext.ack_one(geom, 0, 0, 1, -1) == 1  # STALE: no such lease (group serial 0 ...)
        assert ext.take_one(geom, 0, 1, 1000, "default", lk, 0, -1) is None  # (nothing, or the gen differs)
        assert ext.ack_lock(geom, 0, 0, 1, -1, lk) == 1
        assert ext.spin_wait(geom, 0, 0, 0) is False  # nothing past the cursor: a window of 0 ends it
    finally:
        b.destroy()


def _batch_ack_script(q: Any) -> list[Any]:
    """ack_many in every shape on two groups: the usual run (whole, not from the floor,
    then the one below it), reversed, with a stale one, as a tuple, two groups' at once,
    across the end of the slot table, one message; the shared words it leaves."""
    q.create_group("g2", "earliest")
    q.put_many([b"m%d" % i for i in range(12)])
    a, b = q.get_many(4), q.get_many(4)
    q.ack_many(b)  # a run above the floor: the floor stays
    assert q.offsets()[0] == 0
    q.ack_many(a)  # the run at the floor: it jumps over both
    rest = q.get_many(4)
    q.ack_many(list(reversed(rest[:2])))  # not in order: the twin's
    with pytest.raises(StaleAck):
        q.ack_many(rest[1:])  # rest[1] is acked already: the twin reports it
    g2 = q.get_many(12, group="g2")
    q.ack_many(tuple(g2[:3]))  # not a list: the twin's
    with pytest.raises(StaleAck):
        q.ack_many([g2[3], g2[4], a[0]])  # two groups (a[0] acked already): the twin's
    q.ack_many(g2[5:])  # g2's run: the floors of both groups are at 12 now
    assert q.offsets()[0] == 12
    q.put_many([b"n%d" % i for i in range(10)])  # 12..21: the slot table (16) laps
    lap = q.get_many(10)
    q.ack_many(lap[:2])  # 12, 13
    q.ack_many(lap[2:])  # 14..21, across the end of the table: the twin's
    q.put(b"last")
    q.ack_many([q.get()])  # one message: the twin's
    r, w = q.ring, q.ring.w
    mask = (1 << L.OWNER_SHIFT) - 1
    words = [w[r.groups_w + gi * L.G_WORDS + k] for gi in range(2)
             for k in (L.G_CURSOR, L.G_FLOOR, L.G_DELIVERED, L.G_ACKED)]
    leases = [w[r.slots_w + i * r.slot_words + L.S_GROUPS + gi] & mask for i in range(r.capacity)
              for gi in range(2)]
    return [*words, *leases, w[L.Q_FREE_OFFSET], w[L.Q_NEXT_OFFSET]]


def test_batch_acks_leave_the_same_shared_words_on_both(instance: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _words_on_both(instance, monkeypatch, _batch_ack_script,
                          {(consume, "_ack_run_c"): compiled().ack_run}, capacity=16)
    assert seen[0] == seen[1]


def test_the_compiled_batch_ack_takes_the_usual_batch_and_leaves_the_rest(
        instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ext = compiled()
    monkeypatch.setattr(consume, "_ack_run_c", ext.ack_run)
    twin: list[int] = []
    real = group_settlement.Settlement.ack_offsets

    def counted(self: Any, ref: int, offsets: list[int], *a: Any) -> bool:
        twin.append(len(offsets))
        return real(self, ref, offsets, *a)

    monkeypatch.setattr(group_settlement.Settlement, "ack_offsets", counted)
    b = ShmBroker(instance)
    try:
        q = b.create_queue("run", capacity=64)
        q.put_many([b"x"] * 20)
        q.ack_many(q.get_many(10))
        assert twin == [] and q.offsets()[0] == 10  # the compiled one acked them, storage freed
        got = q.get_many(10)
        q.ack_many(got[::2])  # a gap: the twin's
        assert twin == [5]
        q.ack_many(got[1::2])
        assert twin == [5, 5] and q.offsets()[0] == 20
        ttl = b.create_queue("ttl", capacity=8, message_ttl=60)
        ttl.put_many([b"a", b"b"])
        ttl.ack_many(ttl.get_many(2))  # a queue TTL: no geometry, the twin's
        assert twin == [5, 5, 2]
    finally:
        b.destroy()


def test_compiled_batch_ack_checks_its_arguments(instance: str) -> None:
    ext = compiled()
    b = ShmBroker(instance)
    try:
        q = b.create_queue("args2", capacity=8)
        other = b.create_queue("args3", capacity=8)
        q.put_many([b"a", b"b"])
        other.put_many([b"a", b"b"])
        got = q.get_many(2)
        with pytest.raises(TypeError):
            ext.ack_run(q._one, tuple(got), q, -1)
        with pytest.raises(TypeError):
            ext.ack_run(q._one[:9], got, q, -1)  # type: ignore[index]
        assert ext.ack_run(q._one, got[:1], q, -1) == -1  # one message: ack_one's
        assert ext.ack_run(q._one, got, other, -1) == -1  # delivered through another handle
        lone = other.ring.w[L.Q_GROUP_GEN]
        assert ext.ack_run(other._one, other.get_many(2), other, lone) == 3  # the lone group's floor: freed
        assert q.offsets() == (0, 2)  # nothing of q's was written
        assert ext.ack_run(q._one, got, q, -1) == 4  # the floor moved: the free offset is the caller's
        assert ext.ack_run(q._one, got, q, -1) == -1  # acked already: the twin reports them
    finally:
        b.destroy()


lease_words = st.builds(L.lease_word, st.integers(0, 4), st.integers(0, L.DC_MASK),
                        st.integers(0, L.OWNER_MASK), st.integers(0, L.TIME_MASK))


@given(st.lists(st.one_of(st.just(0), lease_words), min_size=1, max_size=40),
       st.integers(0, 60), st.integers(0, 80))
@settings(max_examples=400)
def test_compiled_settle_range_makes_the_twins_stores(words: list[int], start: int, end: int) -> None:
    """A commit's range, lapping the slot table or not, empty or backwards: the same words
    and the same count of DEADING ones left, on slots of 7 words (2 groups, the 2nd's)."""
    sw, lw, cap = 7, L.S_GROUPS + 1, len(words)
    from array import array
    mem = [array("Q", [0] * (3 + cap * sw)) for _ in IMPLS]
    for m in mem:
        for i, x in enumerate(words):
            m[3 + i * sw + lw] = x
            m[3 + i * sw + lw - 1] = 99  # the other group's word stays as it is
    left_c = compiled().settle_range(mem[0], 3, cap, sw, lw, start, end)
    left_py = group_settlement.settle_range(mem[1], 3, cap, sw, lw, start, end)
    assert (left_c, list(mem[0])) == (left_py, list(mem[1]))


def test_compiled_settle_range_checks_its_arguments() -> None:
    from array import array
    ext, mem = compiled(), array("Q", [0] * 64)
    with pytest.raises(TypeError):
        ext.settle_range(mem, 0, 8, 7, 5, 0)
    with pytest.raises(BufferError):
        ext.settle_range(bytes(512), 0, 8, 7, 5, 0, 8)  # not writable
    with pytest.raises(ValueError, match="past the end"):
        ext.settle_range(mem, 0, 10, 7, 5, 0, 8)  # 10 slots of 7 words in 64
    for bad in ((0, 8, 7, 7), (0, 8, 4, 5), (0, 0, 7, 5), (-1, 8, 7, 5), (0, 8, 7, 4)):
        with pytest.raises(ValueError, match="geometry"):
            ext.settle_range(mem, *bad, 0, 8)
    assert not any(mem)  # none of them wrote anything


@pytest.mark.parametrize("n", [5, 300])
def test_a_commit_leaves_the_same_words_on_both(impl: str, instance: str, n: int) -> None:
    """A commit over leased, nacked-with-delay, acked and new messages, two groups."""
    b = ShmBroker(instance)
    try:
        q = b.create_queue("commit", capacity=512)
        q.create_group("g2", "earliest")
        q.put_many([b"m%d" % i for i in range(n)])
        got = [q.get(block=False) for _ in range(3)]
        got[0].ack()
        got[1].nack(delay=60)
        q.put(b"late", delay=60)
        q.commit("default", n - 1)
        assert q.offsets()[0] == 0  # g2 holds the storage
        with pytest.raises(StaleAck):
            got[2].ack()  # its lease turned stale
        assert [q.get(block=False).payload for _ in range(1)] == [b"m%d" % (n - 1)]
        q.commit("g2", n + 1)
        assert q.offsets()[0] == n - 1
        r, w = q.ring, q.ring.w
        words = [w[r.slots_w + (o % r.capacity) * r.slot_words + L.S_GROUPS + gi] & L.STATE_DC_MASK
                 for o in range(n + 1) for gi in range(2)]
        assert words[:2 * (n - 1)] == [L.DONE | (1 << L.DC_SHIFT) if o < 3 and gi == 0 else L.DONE
                                       for o in range(n - 1) for gi in range(2)]
        assert words[2 * n:] == [L.READY, L.DONE]  # "late": g2 settled it, default has not reached it
    finally:
        b.destroy()


def test_the_c_sources_layout_constants_are_layout_py_s() -> None:
    """The C sources repeat some of ``shmq/core/layout.py``'s names as ``#define``s: each has
    layout.py's value (the header block's own constants are ``shmq.headers``')."""
    src = Path(accel.__file__).parent
    defines = {}
    for f in sorted(src.glob("_speedups*.[ch]")):
        for m in re.finditer(r"^#define ([A-Z][A-Z_]*) (0x[0-9a-fA-F]+|[0-9]+)\b", f.read_text(), re.M):
            defines[m[1]] = (int(m[2], 0), f.name)
    own = {"HEADER_TAG": headers.TAG, "SHORT_LEN": 256, "KEY_CACHE": 64, "KEY_CACHE_LEN": 64}
    assert len(defines) > 20  # (the pattern still finds them)
    for name, (value, where) in defines.items():
        expected = own[name] if name in own else getattr(L, name)
        assert value == expected, f"{where}: #define {name} {value}, but it is {expected}"
