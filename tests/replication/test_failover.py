"""Fail-over with fate accounting (as Jepsen's total-queue check): producers and consumers run
while every process of the primary is SIGKILLed; the standby is promoted and they carry on.

Every value a producer tried is unique.  At the end, *lost* (confirmed, never delivered) and
*unexpected* (delivered, never tried) are computed from every message's fate, and duplicates
are counted (at-least-once allows them):

* ``sync``: nothing confirmed is lost;
* ``async``: what is lost is at most the lag the primary reported just before the kill, and
  only messages past what the standby held.  So that there is a lag, the standby reaches the
  primary through a proxy that blackholes the link for a while (``tests.support.proxy``);
  what it held when the primary died is dropped with it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import shmq
from tests.support.replication import TOKEN, Standby, promote, proxied_primary, replication, wait_caught_up
from tests.support.server import Server, kill_broker
from tests.support.wait import wait_until

pytestmark = pytest.mark.crash

FAILING = (shmq.ConnectionLost, shmq.NotPrimary, shmq.StorageError, shmq.Timeout, shmq.InstanceError)


class Client(threading.Thread):
    """A producer or a consumer on one fail-over handle over "PRIMARY,STANDBY": the handle
    finds the promoted standby by itself (``shmq.client.failover``).  ``go`` cleared: it
    pauses between calls (``idle`` set while it does)."""

    def __init__(self, urls: str, stop: threading.Event, go: threading.Event) -> None:
        super().__init__(daemon=True)
        self.urls = urls
        self.stop = stop
        self.go = go
        self.idle = threading.Event()
        self.errors: Counter[str] = Counter()
        self.b: Any = None

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.go.is_set():
                self.idle.set()
                self.go.wait(0.1)
                continue
            self.idle.clear()
            self.step(self.handle())
        self.idle.set()

    def step(self, b: Any) -> None:
        """One call."""
        raise NotImplementedError

    def handle(self) -> Any:
        if self.b is None:
            self.b = shmq.connect(self.urls, token=TOKEN, connect_timeout=2, failover_timeout=60)
        return self.b

    def failed(self, e: BaseException) -> None:
        """A call failed (the handle stays: the next call goes to the primary it finds)."""
        self.errors[type(e).__name__] += 1

    def close(self) -> None:
        if self.b is not None:
            self.b.close(timeout=1)


class Producer(Client):
    def __init__(self, urls: str, stop: threading.Event, k: int, go: threading.Event) -> None:
        super().__init__(urls, stop, go)
        self.k = k
        self.i = 0
        self.tried: set[bytes] = set()
        self.confirmed: dict[bytes, int] = {}
        self.since = 0.0  # when the put under way started (0: none is)

    def stuck(self, seconds: float) -> bool:
        """Has the put under way waited ``seconds`` for its confirmation?"""
        since = self.since
        return bool(since) and time.monotonic() - since >= seconds

    def step(self, b: Any) -> None:
        v = f"p{self.k}-{self.i}".encode()
        self.i += 1
        self.tried.add(v)
        self.since = time.monotonic()
        try:
            self.confirmed[v] = b.queue("fate").put(v, timeout=5)
        except FAILING as e:
            self.failed(e)
        self.since = 0.0


class Consumer(Client):
    def __init__(self, urls: str, stop: threading.Event, go: threading.Event) -> None:
        super().__init__(urls, stop, go)
        self.delivered: Counter[bytes] = Counter()

    def step(self, b: Any) -> None:
        try:
            q = b.queue("fate")
            got = q.get_many(64, timeout=0.2)
            for m in got:
                self.delivered[bytes(m.payload)] += 1
            if got:
                q.ack_many(got)
        except shmq.Empty:
            pass
        except (*FAILING, shmq.StaleAck) as e:
            self.failed(e)


@pytest.fixture
def primary() -> Iterator[tuple[Server, Any]]:
    srv, proxy = proxied_primary(workers=2)
    yield srv, proxy
    srv.stop()
    proxy.close()


def run_failover(nodes: tuple[Server, Any], mode: str) -> dict[str, Any]:
    """The scenario of the module docstring; the fates and the lag read before the kill."""
    primary, proxy = nodes
    with shmq.connect(primary.url, token=TOKEN) as b:
        b.create_queue("fate", durability="always", replication=mode, capacity=100_000, max_bytes=64 << 20)
    standby = Standby(primary.url)
    urls = f"{primary.url},{standby.url}"  # the clients' list: they find the primary
    stop, stop_consumers, go, consume = (threading.Event() for _ in range(4))
    go.set()
    consume.set()
    producers = [Producer(urls, stop, k, go) for k in range(3)]
    consumers = [Consumer(urls, stop_consumers, consume)]
    lag = None
    before: dict[bytes, int] = {}
    rejoined: Standby | None = None
    try:
        with shmq.connect(primary.url, token=TOKEN) as b, shmq.connect(standby.url, token=TOKEN) as s:
            wait_caught_up(b, s, "fate")
            for c in (*producers, *consumers):
                c.start()
            wait_until(lambda: sum(len(p.confirmed) for p in producers) >= 300, 60)
            # the standby is cut off while the producers go on: what it lacks is what the kill
            # may lose (the consumers wait meanwhile: what they took would count as delivered)
            consume.clear()
            wait_until(lambda: all(c.idle.is_set() for c in consumers), 30)
            proxy.cut()
            base = sum(len(p.confirmed) for p in producers)
            if mode == "sync":  # nothing is confirmed now: every producer waits (or, if broken, 100 go)
                wait_until(lambda: all(p.stuck(1.0) for p in producers)
                           or sum(len(p.confirmed) for p in producers) >= base + 100, 60)
            else:
                wait_until(lambda: sum(len(p.confirmed) for p in producers) >= base + 200, 60)
                go.clear()
                wait_until(lambda: all(p.idle.is_set() for p in producers), 30)
                paused = time.time()
                wait_until(lambda: replication(b)["reported_at"] > paused, 10)
                (link,) = replication(b)["standbys"]
                lag = link["lag_records"]
        kill_broker(primary)  # (a sync put under way fails: not confirmed)
        before = {v: off for p in producers for v, off in list(p.confirmed.items())}
        proxy.drop()  # (what it held for the standby dies with the primary)
        with shmq.connect(standby.url, token=TOKEN) as s:
            wait_until(lambda: not replication(s)["connected"], 20)  # it saw the primary go
            assert promote(s) == 2
        standby.promoted()
        consume.set()
        # the old primary rejoins as the new one's standby (its unreplicated tail is discarded):
        # a sync queue confirms again once a standby has its rounds
        rejoined = Standby(standby.url, data_dir=primary.data_dir)
        go.set()
        base = sum(len(p.confirmed) for p in producers)
        wait_until(lambda: sum(len(p.confirmed) for p in producers) >= base + 200, 60)
        stop.set()
        for p in producers:
            p.join(30)
        with shmq.connect(standby.url, token=TOKEN) as s:  # everything stored is delivered and acked
            wait_until(lambda: s.queue("fate").stats()["retained"] == 0, 60)
        stop_consumers.set()
        for c in consumers:
            c.join(30)
        for c in (*producers, *consumers):
            c.close()
    finally:
        stop.set()
        stop_consumers.set()
        go.set()
        consume.set()
        if rejoined is not None:
            rejoined.stop(keep_data=True)  # (the primary's data dir: its Server removes it)
        standby.stop()
    tried = set().union(*(p.tried for p in producers))
    confirmed = {v: off for p in producers for v, off in p.confirmed.items()}
    delivered: Counter[bytes] = sum((c.delivered for c in consumers), Counter())
    return {"tried": tried, "confirmed": confirmed, "before": before, "delivered": delivered, "lag": lag,
            "lost": {v: confirmed[v] for v in set(confirmed) - set(delivered)},
            "unexpected": set(delivered) - tried,
            "duplicates": sum(n - 1 for n in delivered.values() if n > 1)}


def test_sync_failover_loses_nothing_confirmed(primary: tuple[Server, Any]) -> None:
    fates = run_failover(primary, "sync")
    assert fates["unexpected"] == set()
    assert fates["lost"] == {}, sorted(fates["lost"].items())[:20]
    assert len(fates["confirmed"]) >= 500
    print(f"sync fail-over: {len(fates['confirmed'])} confirmed, {fates['duplicates']} duplicates")


def test_async_failover_loses_at_most_the_lag_reported_before_the_kill(primary: tuple[Server, Any]) -> None:
    fates = run_failover(primary, "async")
    assert fates["unexpected"] == set()
    lag, lost = fates["lag"], fates["lost"]
    assert lag is not None and lag > 0  # the frozen standby was behind
    assert len(lost) <= lag, (len(lost), lag)
    # and only the newest confirmed before the kill: what the standby had not ACKed
    newest = set(sorted(fates["before"].values())[-lag:])
    assert all(v in fates["before"] and fates["before"][v] in newest for v in lost), sorted(lost.values())
    print(f"async fail-over: lag {lag}, lost {len(lost)}, {fates['duplicates']} duplicates")
