"""Message headers (``shmq.headers``): on both transports, through the Publisher, asyncio,
redelivery, the dead-letter queue and its redrive, the journal, and every bad input
refused before anything is stored."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

import shmq
import shmq.client.aio
from shmq import headers, options
from shmq.journal import Journal
from shmq.protocol.codec import T, frame
from shmq.protocol.commands import _offsets
from shmq.protocol.connection import Request
from tests.support.durable import Durable
from tests.support.server import Server

H: dict[str, str | bytes] = {"trace-id": "abc123", "bin": b"\x00\xff\x10", "ключ-鍵": "värde ✓", "empty": b""}
WANT = {"trace-id": b"abc123", "bin": b"\x00\xff\x10", "ключ-鍵": "värde ✓".encode(), "empty": b""}


def depth(q: shmq.Queue) -> int:
    return int(q.stats()["groups"]["default"]["depth"])


def test_headers_round_trip_exactly(broker: shmq.Broker) -> None:
    q = broker.create_queue("hdr")
    q.put(b"with", headers=H)
    q.put(b"none")
    q.put(b"empty", headers={})
    m, plain, empty = q.get_many(3, timeout=1)
    assert isinstance(m.headers, MappingProxyType)
    assert dict(m.headers) == WANT and list(m.headers) == list(H)  # values bytes, the order kept
    with pytest.raises(TypeError):
        m.headers["x"] = b"y"  # type: ignore[index]
    assert m.payload == b"with" and m.origin is None
    assert (dict(plain.headers), plain.meta, dict(empty.headers), empty.meta) == ({}, b"", {}, b"")
    assert [dict(r.headers) for r in q.read(0, 3)] == [WANT, {}, {}]  # read() carries them too


def test_per_message_headers_in_a_batch(broker: shmq.Broker) -> None:
    q = broker.create_queue("hbatch")
    q.put_many([b"a", b"b", b"c", b"d"], headers=[{"n": "1"}, None, {}, {"n": b"4", "x": "y"}])
    q.put_many([b"e", b"f"], headers=[None, None])
    got = q.get_many(10, timeout=1)
    assert [(m.payload, dict(m.headers)) for m in got] == [
        (b"a", {"n": b"1"}), (b"b", {}), (b"c", {}), (b"d", {"n": b"4", "x": b"y"}), (b"e", {}), (b"f", {})]


def test_idempotent_batch_with_headers(broker: shmq.Broker) -> None:
    q = broker.create_queue("hidem")
    q.put_many([b"a"], producer="p", seq=1, headers=[{"k": "v"}])
    with pytest.raises(shmq.Duplicate):
        q.put_many([b"a"], producer="p", seq=1, headers=[{"k": "v"}])
    assert [dict(m.headers) for m in q.get_many(10, timeout=1)] == [{"k": b"v"}]


def test_publisher_puts_headers(broker: shmq.Broker) -> None:
    q = broker.create_queue("hpub")
    with q.publisher(window=8) as p:
        for i in range(20):
            p.put(b"%d" % i, headers={"i": str(i)} if i % 2 else None)
        p.put_many([b"b0", b"b1"], headers=[{"batch": "yes"}, None])  # a batch's, one per payload
    got = q.get_many(100, timeout=1)
    assert [(m.payload, dict(m.headers)) for m in got] == [
        (b"%d" % i, {"i": str(i).encode()} if i % 2 else {}) for i in range(20)] + [
        (b"b0", {"batch": b"yes"}), (b"b1", {})]


def test_headers_survive_nack_and_redelivery(broker: shmq.Broker) -> None:
    q = broker.create_queue("hnack")
    q.put(b"x", headers={"k": "v"})
    q.get(timeout=1).nack()
    again = q.get(timeout=1)
    assert (again.deliveries, dict(again.headers)) == (2, {"k": b"v"})


def test_dead_letter_keeps_headers_adds_origin_and_redrive_takes_them_back(broker: shmq.Broker) -> None:
    from shmq.cli.messages import _redrive

    q = broker.create_queue("hdead", max_deliveries=2)
    q.put(b"poison", headers=H)
    q.get(timeout=1).dead_letter()
    dlq = broker.queue("hdead.dlq")
    d = dlq.read(0, 1)[0]
    assert dict(d.headers) == WANT and d.payload == b"poison"
    assert d.origin is not None and (d.origin.queue, d.origin.reason) == ("hdead", "dead_letter")
    assert _redrive(broker, dlq, "hdead", None) == 1
    back = q.get(timeout=1)
    assert (back.payload, dict(back.headers), back.origin) == (b"poison", WANT, None)
    assert depth(dlq) == 0


BAD: list[tuple[Any, type[Exception]]] = [
    ({1: "v"}, shmq.InvalidArgument),
    ({b"k": "v"}, shmq.InvalidArgument),
    ({"": "v"}, shmq.InvalidArgument),
    ({"k": 1}, shmq.InvalidArgument),
    ({"k": None}, shmq.InvalidArgument),
    ([("k", "v")], shmq.InvalidArgument),
    ({f"k{i}": "" for i in range(options.MAX_HEADERS + 1)}, shmq.LimitExceeded),
    ({"k": b"v" * options.MAX_HEADERS_BYTES}, shmq.LimitExceeded),
]


@pytest.mark.parametrize(("bad", "error"), BAD, ids=[f"{e.__name__}-{i}" for i, (_, e) in enumerate(BAD)])
def test_bad_headers_are_refused_and_store_nothing(broker: shmq.Broker, bad: Any, error: type[Exception]
                                                   ) -> None:
    q = broker.create_queue("hbad")
    with pytest.raises(error):
        q.put(b"x", headers=bad)
    with pytest.raises(error):
        q.put_many([b"ok", b"bad", b"ok"], headers=[{"k": "v"}, bad, None])
    with pytest.raises(error), q.publisher() as p:
        p.put(b"x", headers=bad)
    with pytest.raises(error), q.publisher() as p:
        p.put_many([b"ok", b"bad"], headers=[None, bad])
    assert depth(q) == 0 and q.read(0, 10) == []


def test_a_batch_needs_one_mapping_per_payload(broker: shmq.Broker) -> None:
    q = broker.create_queue("hcount")
    for wrong in ([{"k": "v"}], {"k": "v"}, [None, None, None]):
        with pytest.raises(shmq.InvalidArgument):
            q.put_many([b"a", b"b"], headers=wrong)  # type: ignore[arg-type]
    assert depth(q) == 0


def test_headers_count_in_the_message_size(broker: shmq.Broker) -> None:
    q = broker.create_queue("hsize", max_message_size=100)
    q.put(b"x" * 100)
    block = len(headers.encode({"k": "v"}))
    q.put(b"x" * (100 - block), headers={"k": "v"})
    with pytest.raises(shmq.MessageTooLarge):
        q.put(b"x" * (101 - block), headers={"k": "v"})
    with pytest.raises(shmq.MessageTooLarge):
        q.put_many([b"", b"x" * (101 - block)], headers=[None, {"k": "v"}])
    assert depth(q) == 2


def test_asyncio_client_puts_and_gets_headers(server: Server) -> None:
    async def main() -> tuple[dict[str, bytes], list[dict[str, bytes]]]:
        async with await shmq.client.aio.connect(server.url) as b:
            q = await b.create_queue("haio")
            try:
                await q.put(b"one", headers={"k": "v"})
                await q.put_many([b"a", b"b"], headers=[None, {"n": b"\x01"}])
                m = await q.get(timeout=1)
                ms = await q.get_many(10, timeout=1)
                return dict(m.headers), [dict(x.headers) for x in ms]
            finally:
                await b.delete_queue("haio")

    assert asyncio.run(main()) == ({"k": b"v"}, [{}, {"n": b"\x01"}])


# ---------------------------------------------------------------- the encodings


def test_the_header_block_is_the_documented_one() -> None:
    assert headers.encode({"k": "v"}) == bytes.fromhex("01 0001 0001 6b 0001 76")
    assert headers.encode({}) == headers.encode(None) == b""
    block = headers.encode(H)
    assert dict(headers.decode(block + b'{"queue": "x"}')) == WANT
    assert headers.block_of(block + b"{}") == block
    assert dict(headers.decode(b'{"queue": "x"}')) == {}  # a dead letter's origin alone


@pytest.mark.parametrize("blob", [b"\x01", b"\x01\x00\x01\x00\x05ab", b"\x01\x00\x01\x00\x01k\x00\x09v",
                                  b"\x01\x00\x01\x00\x00\x00\x00", b"\x01\x00\x01\x00\x01\xff\x00\x00",
                                  b"\x01\x00\x02\x00\x01k\x00\x00\x00\x01k\x00\x00", b"\x01\x00\x00",
                                  b"\x02\x00\x00"])
def test_a_malformed_block_from_the_wire_is_refused(blob: bytes) -> None:
    with pytest.raises(shmq.InvalidArgument):
        headers.split(blob + b"payload")


def test_a_flagged_produce_with_a_bad_block_gets_a_typed_error_and_stores_nothing(server: Server) -> None:
    with shmq.connect(server.url) as b:
        q = b.create_queue("hwire")
        def bad(msg_id: int) -> bytes:  # the second payload's block claims a key of 9 bytes: 1 follows
            return frame(T.PRODUCE_BATCH, msg_id, headers.FLAG, queue="hwire", timeout_ms=0,
                         payloads=[b"\x00ok", b"\x01\x00\x01\x00\x09k"])

        with pytest.raises(shmq.InvalidArgument):
            b._execute(Request(bad, (), _offsets))  # type: ignore[attr-defined]
        assert depth(q) == 0
        q.put(b"fine", headers={"k": "v"})  # the connection goes on
        assert dict(q.get(timeout=1).headers) == {"k": b"v"}
        b.delete_queue("hwire")


def test_the_journal_keeps_metadata_and_old_records_read_as_before(tmp_path: Path) -> None:
    j = Journal(tmp_path, "jq")
    j.recover()
    meta = headers.encode({"k": "v"})
    j.append_messages([(0, 5, b"plain"), (1, 6, b"p1")])  # no metadata: the flag-free record
    j.append_messages([(2, 7, b"a", meta), (3, 8, b"b")])
    j.sync()
    j.close()
    j = Journal(tmp_path, "jq")
    rec = j.recover()
    j.close()
    assert rec.messages == [(0, 5, b"plain"), (1, 6, b"p1"), (2, 7, b"a"), (3, 8, b"b")]
    assert rec.metas == {2: meta} and not rec.problems


def test_headers_and_origins_survive_kill9_and_recovery(durable: Durable) -> None:
    with shmq.connect(durable.srv.url) as b:
        q = b.create_queue("hkeep", durability="always", max_deliveries=1)
        q.put(b"a", headers=H)
        q.put_many([b"b", b"c"], headers=[None, {"n": "2"}])
        q.get(timeout=1).nack()  # a: dead-lettered, its headers with it
    durable.crash(reboot=True)  # the shared memory goes too: all from the journal
    durable.start()
    with shmq.connect(durable.srv.url) as b:
        got = b.queue("hkeep").get_many(10, timeout=1)
        # a's settle may not have reached the journal before the kill (at least once): then
        # it is back too, with its headers
        by = {bytes(m.payload): dict(m.headers) for m in got}
        assert (by[b"b"], by[b"c"], by.get(b"a", WANT)) == ({}, {"n": b"2"}, WANT) and len(got) <= 3
        d = b.queue("hkeep.dlq").get(timeout=1)
        assert (d.payload, dict(d.headers)) == (b"a", WANT)
        assert d.origin is not None and d.origin.queue == "hkeep"


def test_cli_produces_headers_and_shows_them(shm_broker: Any, instance: str) -> None:
    from typer.testing import CliRunner

    from shmq.cli.app import app

    shm_broker.create_queue("hcli")
    run = CliRunner().invoke
    made = run(app, ["produce", "hcli", "hi", "-H", "k=v", "--header", "eq=a=b", "--shm", instance])
    assert made.exit_code == 0, made.output
    bad = run(app, ["produce", "hcli", "x", "--header", "novalue", "--shm", instance])
    assert bad.exit_code != 0 and "KEY=VALUE" in bad.output
    assert "[0] hi  [headers: k=v eq=a=b]" in run(app, ["peek", "hcli", "--shm", instance]).output
    import json
    shown = json.loads(run(app, ["consume", "hcli", "-n", "1", "--json", "--shm", instance]).output)
    assert shown["headers"] == {"k": "v", "eq": "a=b"}
