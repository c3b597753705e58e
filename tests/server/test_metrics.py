"""Prometheus metrics (``shmq serve --metrics HOST:PORT``): the figures a scrape shows
against what a workload did, the metrics process's life, and who may scrape.

The end-to-end tests start real brokers and scrape them with urllib, parsing the answer
with ``prometheus_client``'s own parser; the first tests read shared memory (and the
scoreboard) with no broker at all."""

from __future__ import annotations

import base64
import http.client
import multiprocessing as mp
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import shmq
from shmq import options
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerBroker
from shmq.errors import InvalidArgument
from shmq.protocol.codec import T
from shmq.server.collector import METRICS, BrokerCollector
from shmq.server.handlers import HANDLERS
from shmq.server.metrics import parse_address
from shmq.server.scoreboard import OPS, Scoreboard
from tests.support.connect import connect_tcp
from tests.support.instances import objects, unique_instance
from tests.support.paths import OPERATIONS_DOC
from tests.support.server import Server
from tests.support.wait import wait_until

TOKEN = "metrics-s3cret"


class Scrape:
    """One scrape's samples: ``s["shmq_queue_depth", {"queue": "q"}]``."""

    def __init__(self, text: str) -> None:
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        self.families = set()
        for fam in text_string_to_metric_families(text):
            self.families.add(fam.name)
            for s in fam.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def __getitem__(self, key: tuple[str, dict[str, str]]) -> float:
        name, labels = key
        return self.samples[(name, frozenset(labels.items()))]

    def total(self, name: str, **labels: str) -> float:
        """The sum over every sample of ``name`` whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items() if n == name and want <= ls)


def scrape(url: str, token: str | None = None, ctx: ssl.SSLContext | None = None) -> Scrape:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10, context=ctx) as r:
        assert r.status == 200
        return Scrape(r.read().decode())


def status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


# ---------------------------------------------------------------- no broker
def test_the_collector_reads_a_queue_from_shared_memory_alone(instance: str) -> None:
    b = ShmBroker(instance)
    sb = ServerBroker(instance)
    try:
        q = b.create_queue("c", capacity=64)
        t0 = time.time_ns()
        q.put_many([b"x" * 10] * 5)
        t1 = time.time_ns()
        q.create_group("audit", start="earliest")
        held = q.get(timeout=1)
        q.get(timeout=1).ack()
        reg = CollectorRegistry(auto_describe=False)
        reg.register(BrokerCollector(sb))
        before = time.time_ns()
        s = Scrape(generate_latest(reg).decode())
        after = time.time_ns()
        c, d, a = {"queue": "c"}, {"queue": "c", "group": "default"}, {"queue": "c", "group": "audit"}
        assert s["shmq_queue_depth", c] == 5  # the audit group has acknowledged nothing
        assert s["shmq_queue_used_bytes", c] == 50
        assert s["shmq_queue_capacity_messages", c] == 64
        assert s["shmq_queue_capacity_bytes", c] == options.DEFAULT_MAX_BYTES
        assert s["shmq_queue_produced_total", c] == 5
        assert s["shmq_group_lag", d] == 5 and s["shmq_group_lag", a] == 5  # held stays at the floor
        assert s["shmq_group_in_flight", d] == 1 and s["shmq_group_in_flight", a] == 0
        assert s["shmq_group_delivered_total", d] == 2 and s["shmq_group_acked_total", d] == 1
        assert s["shmq_group_delivered_total", a] == 0
        age = s["shmq_group_oldest_unacked_age_seconds", d]
        assert (before - t1) / 1e9 <= age <= (after - t0) / 1e9
        assert held.offset == 0
        assert ("shmq_queue_durable_lag", frozenset(c.items())) not in s.samples  # memory only
        # no workers, no journal here: those families are there, without samples
        assert {"shmq_worker_requests", "shmq_journal_fsync_duration_seconds"} <= s.families
        assert s.total("shmq_worker_requests_total") == 0
    finally:
        sb.close()


def test_a_reading_names_the_oldest_unacknowledged_message_exactly(instance: str) -> None:
    b = ShmBroker(instance)
    sb = ServerBroker(instance)
    try:
        q = b.create_queue("r")
        q.put_many([b"a", b"bb", b"ccc"])
        first, second = q.get(timeout=1), q.get(timeout=1)
        second.ack()  # the floor stays on the first: still leased
        r = sb.queue("r").reading()
        (g,) = r.groups
        assert (g.lag, g.in_flight, g.oldest_ns) == (3, 1, first.timestamp_ns)
        assert (r.depth, r.bytes_used, r.durable_lag) == (3, 6, None)
        first.ack()
        q.get(timeout=1).ack()
        (g,) = sb.queue("r").reading().groups
        assert (g.lag, g.in_flight, g.oldest_ns, g.delivered, g.acked) == (0, 0, 0, 3, 3)
    finally:
        sb.close()


def test_the_scoreboard_keeps_histograms_per_worker_and_op() -> None:
    board = Scoreboard(2)
    m = board.worker(1)
    m.record(T.PRODUCE, 3, 20_000)  # 20 us: the 25 us bucket
    m.record(T.PRODUCE, 1, 2_000_000_000)  # past the last bound: +Inf only
    m.record(0xEE, 1, 1)  # no such request type
    assert board.requests(0) == {}
    h = board.requests(1)
    produce = h["produce"]
    bounds = options.REQUEST_LATENCY_BUCKETS
    assert produce.count == 4
    assert produce.cumulative[bounds.index(0.00001)] == 0
    assert produce.cumulative[bounds.index(0.000025)] == 3
    assert produce.cumulative[len(bounds) - 1] == 3 and produce.cumulative[-1] == 4
    assert produce.sum_seconds == pytest.approx(3 * 20e-6 + 2.0)
    assert h["other"].count == 1
    j = board.journal()
    j.fsync(300_000)
    j.failed()
    errors, fsync = board.journal_figures()
    assert (errors, fsync.count) == (1, 1)
    board.restarted(0)
    board.restarted(-1)
    assert board.restarts() == ([1, 0], 1)
    with pytest.raises(ValueError):
        board.worker(2)


def test_every_request_type_has_its_op() -> None:
    names = {T(t).name.lower() for t in (*HANDLERS, T.HANDSHAKE)}
    assert names <= set(OPS) and len(OPS) == len(set(OPS))
    assert all(name.startswith("shmq_") for name in METRICS)
    assert all(name.endswith("_total") for name, (kind, _, _) in METRICS.items() if kind == "counter")


def test_the_operations_doc_lists_every_metric() -> None:
    import re
    doc = OPERATIONS_DOC.read_text()
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `(shmq_\w+)` \| (\w+) \|", doc, re.M)}
    assert rows == {name: kind for name, (kind, _, _) in METRICS.items()}


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)), (":9464", ("127.0.0.1", 9464)),
    ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:9464", ("::1", 9464)), ("localhost:80", ("localhost", 80))])
def test_metrics_addresses(value: str, expected: tuple[str, int]) -> None:
    assert parse_address(value) == expected


@pytest.mark.parametrize("value", ["127.0.0.1", "9464x", "host:", "host:99999", "::1:9464", "a:-1"])
def test_bad_metrics_addresses_are_named(value: str) -> None:
    with pytest.raises(InvalidArgument, match="--metrics"):
        parse_address(value)


# ---------------------------------------------------------------- a broker
@pytest.fixture(scope="module")
def metered() -> Iterator[Server]:
    srv = Server(workers=2, extra=["--metrics", "127.0.0.1:0"])
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def test_the_start_line_names_the_endpoint_and_workers_are_told_apart(metered: Server) -> None:
    assert metered.metrics_url.startswith("http://127.0.0.1:")
    children = {p.pid for p in psutil.Process(metered.proc.pid).children()}
    assert metered.metrics_pid in children
    assert len(metered.workers()) == 2 and metered.metrics_pid not in {p.pid for p in metered.workers()}
    assert status(metered.metrics_url.replace("/metrics", "/other")) == 404


def test_counters_match_the_workload_exactly(metered: Server) -> None:
    name = f"m{os.getpid()}a"
    url = metered.metrics_url
    with connect_tcp(metered.url, metered.token) as b:
        q = b.create_queue(name)
        before = scrape(url)
        for i in range(50):
            q.put(b"m%d" % i)
        for _ in range(20):
            q.get(timeout=5).ack()
        s = scrape(url)
        qd, gd = {"queue": name}, {"queue": name, "group": "default"}
        assert s["shmq_queue_produced_total", qd] == 50
        assert s["shmq_queue_depth", qd] == 30
        assert s["shmq_group_delivered_total", gd] == 20 and s["shmq_group_acked_total", gd] == 20
        assert s["shmq_group_lag", gd] == 30 and s["shmq_group_in_flight", gd] == 0
        for op, n in (("produce", 50), ("consume", 20), ("ack", 20)):
            reqs = "shmq_worker_requests_total"
            assert s.total(reqs, op=op) - before.total(reqs, op=op) == n, op
            hist = (s.total("shmq_worker_request_duration_seconds_count", op=op)
                    - before.total("shmq_worker_request_duration_seconds_count", op=op))
            assert hist == n, op
        assert s.total("shmq_worker_request_duration_seconds_sum", op="produce") > 0
        assert s.total("shmq_worker_connections") >= 1

        # a held lease: in flight, and the oldest unacknowledged message is its
        held = q.get(timeout=5)
        t0 = time.time_ns()
        s = scrape(url)
        t1 = time.time_ns()
        assert s["shmq_group_in_flight", gd] == 1 and s["shmq_group_lag", gd] == 30
        age = s["shmq_group_oldest_unacked_age_seconds", gd]
        assert (t0 - held.timestamp_ns) / 1e9 <= age <= (t1 - held.timestamp_ns) / 1e9
        for i in range(5):
            q.put(b"more %d" % i)
        assert scrape(url)["shmq_group_lag", gd] == 35
        held.ack()
        s = scrape(url)
        assert s["shmq_group_lag", gd] == 34 and s["shmq_group_in_flight", gd] == 0

        # leases of a connection that closes come back, and are delivered again
        with connect_tcp(metered.url, metered.token) as other:
            oq = other.queue(name)
            taken = [oq.get(timeout=5), oq.get(timeout=5)]
            assert scrape(url)["shmq_group_in_flight", gd] == 2
        wait_until(lambda: scrape(url)["shmq_queue_leases_returned_total", qd] == 2)
        again = [q.get(timeout=5), q.get(timeout=5)]
        assert [m.offset for m in again] == [m.offset for m in taken]
        s = scrape(url)
        assert s["shmq_group_redelivered_total", gd] == 2
        assert s["shmq_group_delivered_total", gd] == 20 + 1 + 2 + 2
        q.ack_many(again)
        b.delete_queue(name)
    assert ("shmq_queue_depth", frozenset({"queue": name}.items())) not in scrape(url).samples


def _take_one_and_die(url: str, name: str) -> None:
    q = shmq.connect(url).queue(name)
    q.get(timeout=5)
    os._exit(0)  # no exit handlers: the lease stays until a reaper finds us dead


def test_leases_of_a_dead_colocated_consumer_are_counted_reaped(metered: Server) -> None:
    name = f"m{os.getpid()}r"
    with connect_tcp(metered.url, metered.token) as b:
        q = b.create_queue(name)
        q.put(b"orphan")
        p = mp.get_context("fork").Process(target=_take_one_and_die, args=(f"shm://{metered.instance}", name))
        p.start()
        p.join(30)
        assert p.exitcode == 0
        qd = {"queue": name}
        wait_until(lambda: scrape(metered.metrics_url)["shmq_queue_leases_reaped_total", qd] == 1)
        assert q.get(timeout=5).deliveries == 2
        b.delete_queue(name)


def test_a_durable_queue_shows_fsyncs_and_durable_lag(metered: Server) -> None:
    url = metered.metrics_url
    always, interval = f"m{os.getpid()}d", f"m{os.getpid()}i"
    with connect_tcp(metered.url, metered.token) as b:
        qa = b.create_queue(always, durability="always")
        before = scrape(url)
        for i in range(5):
            qa.put(b"d%d" % i)  # each returns once fsynced
        s = scrape(url)
        fsyncs = "shmq_journal_fsync_duration_seconds_count"
        assert s.total(fsyncs) - before.total(fsyncs) >= 1
        assert s.total("shmq_journal_fsync_duration_seconds_sum") > 0
        assert s["shmq_queue_durable_lag", {"queue": always}] == 0
        assert s["shmq_queue_journal_errno", {"queue": always}] == 0
        assert s.total("shmq_journal_storage_errors_total") == 0

        qi = b.create_queue(interval, durability="interval")
        qi.put(b"first")
        lag = lambda: scrape(url)["shmq_queue_durable_lag", {"queue": interval}]  # noqa: E731
        wait_until(lambda: lag() == 0)
        journal = psutil.Process(metered.journal_pid)
        journal.suspend()  # nothing reaches the disk meanwhile
        try:
            for i in range(3):
                qi.put(b"i%d" % i)
            assert lag() == 3
        finally:
            journal.resume()
        wait_until(lambda: lag() == 0, timeout=10)
        b.delete_queue(always)
        b.delete_queue(interval)


def test_restarts_are_counted_and_the_metrics_process_comes_back() -> None:
    srv = Server(workers=2, extra=["--metrics", "127.0.0.1:0"])
    try:
        url = srv.metrics_url
        assert scrape(url).total("shmq_worker_restarts_total") == 0
        srv.workers()[0].kill()
        wait_until(lambda: scrape(url).total("shmq_worker_restarts_total") == 1, timeout=10)
        wait_until(lambda: len(srv.workers()) == 2, timeout=10)
        psutil.Process(srv.metrics_pid).kill()
        wait_until(lambda: any(p.pid != srv.metrics_pid and p.name() == "shmq-metrics"
                               for p in psutil.Process(srv.proc.pid).children()), timeout=10)
        s = scrape(url)  # the same port: the supervisor kept the socket
        assert s.total("shmq_worker_restarts_total") == 1 and s.total("shmq_journal_restarts_total") == 0
        assert len(srv.workers()) == 2
    finally:
        assert srv.stop() == 0


# ---------------------------------------------------------------- who may scrape
def _serve_refused(*args: str) -> subprocess.CompletedProcess[str]:
    inst = unique_instance()
    with tempfile.TemporaryDirectory() as data:
        env = {k: v for k, v in os.environ.items() if k != options.TOKEN_ENV}
        r = subprocess.run([sys.executable, "-c", "from shmq.cli.app import app; app()",
                            "serve", "--port", "0",
                            "--workers", "1", "--instance", inst, "--data-dir", data, *args],
                           capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0, r
    assert r.stdout == ""  # no start line: nothing was served
    assert objects(inst) == []
    return r


def test_an_endpoint_off_loopback_without_auth_is_refused_at_start() -> None:
    r = _serve_refused("--no-auth", "--metrics", "0.0.0.0:0")
    assert r.stderr.count("\n") == 1 and "not loopback" in r.stderr and "--no-auth" in r.stderr


def test_a_bad_metrics_address_is_refused_at_start() -> None:
    r = _serve_refused("--metrics", "9464")
    assert r.stderr.count("\n") == 1 and "HOST:PORT" in r.stderr


def test_a_metrics_port_in_use_is_refused_at_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = _serve_refused("--metrics", f"127.0.0.1:{port}")
    assert r.stderr.count("\n") == 1 and f"port {port}" in r.stderr and "in use" in r.stderr


def test_off_loopback_a_scrape_needs_the_token() -> None:
    srv = Server(workers=1, token=TOKEN, extra=["--metrics", "0.0.0.0:0"])
    try:
        url = srv.metrics_url
        assert status(url) == 401
        assert status(url, {"Authorization": "Bearer wrong"}) == 401
        assert status(url, {"Authorization": f"Bearer {TOKEN}x"}) == 401
        basic = base64.b64encode(f"user:{TOKEN}".encode()).decode()
        assert status(url, {"Authorization": f"Basic {basic}"}) == 401
        assert status(url.replace("/metrics", "/other")) == 401  # nothing said without the token
        assert status(url.replace("/metrics", "/other"), {"Authorization": f"Bearer {TOKEN}"}) == 404
        s = scrape(url, TOKEN)
        assert s.total("shmq_worker_connections", worker="0") == 0
    finally:
        assert srv.stop() == 0


@pytest.fixture
def self_signed() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="shmq-metrics-tls-"))
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "key.pem", "-out", "cert.pem",
                        "-days", "2", "-subj", "/CN=shmq",
                        "-addext", "subjectAltName=IP:127.0.0.1"], cwd=d, check=True, capture_output=True,
                       timeout=60)
        yield d
    finally:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_off_loopback_the_endpoint_speaks_tls_when_the_broker_does(self_signed: Path) -> None:
    cert, key = self_signed / "cert.pem", self_signed / "key.pem"
    srv = Server(workers=1, token=TOKEN, extra=["--metrics", "0.0.0.0:0", "--tls-cert", str(cert),
                                                  "--tls-key", str(key)])
    try:
        assert srv.metrics_url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        assert "shmq_worker_connections" in scrape(srv.metrics_url, TOKEN, ctx).families
        with pytest.raises(urllib.error.HTTPError) as e:
            scrape(srv.metrics_url, None, ctx)
        assert e.value.code == 401
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            scrape(srv.metrics_url.replace("https://", "http://"), TOKEN)  # plain HTTP is not spoken
    finally:
        assert srv.stop() == 0
