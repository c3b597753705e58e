"""shmq.spark: the PySpark source and sink, on a real Spark (local[2]) against a real ``shmq serve``.

One SparkSession and one broker per module (per xdist worker).  Spark's own files (warehouse,
local dir, derby) go to a temporary folder, and the JVM is shut down at the end of the module, so
the session's leak check finds no process of ours.  The tests that need no Spark (options, the
reader's offset logic) call shmq.spark's functions directly; tests/spark/test_spark_rows.py has the
row conversion and the sink's chunking.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq import spark as ss
from shmq.core.colocated import ShmBroker
from tests.support.instances import leftovers, unique_instance
from tests.support.seek import spaced
from tests.support.server import Server
from tests.support.wait import wait_until

pytestmark = [
    pytest.mark.spark,
    pytest.mark.timeout(300),  # the first test also waits for the JVM: slow on a busy machine
    pytest.mark.filterwarnings("ignore:Cannot infer the eval type from type hints:UserWarning"),
]


# ---------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server(workers=2)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    if shutil.which("java") is None:  # rather than py4j's JAVA_GATEWAY_EXITED a minute in
        pytest.fail("Spark needs Java 17 or newer on PATH (e.g. apt-get install openjdk-17-jre-headless)")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    tmp = tmp_path_factory.mktemp("spark")
    java = f"-Dderby.system.home={tmp / 'derby'} -XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
    session = (SparkSession.builder.master("local[2]").appName("shmq-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.sql.warehouse.dir", str(tmp / "warehouse"))
               .config("spark.local.dir", str(tmp / "local"))
               .config("spark.driver.extraJavaOptions", java)  # C1 only: quicker for short jobs
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    ss.register(session)
    yield session
    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    try:
        session.stop()
        if gateway is not None:
            gateway.shutdown()
    finally:  # the JVM lives until its stdin closes: end it now, not when pytest exits
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        SparkContext._gateway = None
        SparkContext._jvm = None


_names = iter(range(1 << 30))


def fresh(broker: shmq.Broker, prefix: str = "q", **limits: Any) -> shmq.Queue:
    return broker.create_queue(f"{prefix}{os.getpid()}_{next(_names)}", **limits)


def payloads(n: int, start: int = 0) -> list[bytes]:
    return [f"m{i}".encode() for i in range(start, start + n)]


def stream(spark: Any, url: str, queue: str, **opts: Any) -> Any:
    r = spark.readStream.format("shmq").option("url", url).option("queue", queue)
    for k, v in opts.items():
        r = r.option(k, v)
    return r.load()


def offsets_in(spark: Any, path: Path) -> list[int]:
    return sorted(r.offset for r in spark.read.parquet(str(path)).select("offset").collect())


# ---------------------------------------------------------------- without Spark
def test_import_shmq_does_not_import_pyspark() -> None:
    code = "import sys, shmq; assert 'pyspark' not in sys.modules, 'shmq imported pyspark'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_options_are_checked() -> None:
    o = ss.read_options({"queue": "ev", "startingOffsets": '{"ev": 7}', "maxOffsetsPerTrigger": "5"},
                        streaming=True)
    assert (o.starting, o.ending, o.max_per_trigger, o.group, o.url) == (7, "latest", 5, "spark",
                                                                         ss.DEFAULT_URL)
    assert ss.read_options({"queue": "ev"}, streaming=True).starting == "latest"
    assert ss.read_options({"queue": "ev"}, streaming=False).starting == "earliest"
    assert ss.read_options({"QUEUE": "ev", "startingOffsets": '{"ev": -2}'}, streaming=True).starting == \
        "earliest"
    bad: list[tuple[dict[str, str], bool, str]] = [
        ({}, True, "queue is required"),
        ({"queue": "ev", "startingOffset": "earliest"}, True, "did you mean 'startingOffsets'"),
        ({"queue": "ev", "batchSize": "10"}, True, "not an option of this direction"),
        ({"queue": "ev", "startingOffsets": "oldest"}, True, "startingOffsets must be"),
        ({"queue": "ev", "startingOffsets": '{"other": 3}'}, True, "startingOffsets must be"),
        ({"queue": "ev", "maxOffsetsPerTrigger": "0"}, True, "maxOffsetsPerTrigger must be between"),
        ({"queue": "ev", "maxOffsetsPerTrigger": "x"}, True, "must be an integer"),
        ({"queue": "ev", "endingOffsets": "latest"}, True, "batch reads only"),
        ({"queue": "ev", "endingOffsets": "earliest"}, False, "cannot be 'earliest'"),
        ({"queue": "ev", "failOnDataLoss": "maybe"}, True, "true or false"),
        ({"queue": "ev", "url": "http://x"}, True, "url must be"),
    ]
    for opts, streaming, message in bad:
        with pytest.raises(shmq.InvalidArgument, match=message):
            ss.read_options(opts, streaming)
    w = ss.write_options({"queue": "out", "batchSize": "10", "checkpointLocation": "/ck", "queryName": "n"})
    assert (w.batch_size, w.write_timeout) == (10, ss.DEFAULT_WRITE_TIMEOUT)
    with pytest.raises(shmq.InvalidArgument, match="batchSize"):
        ss.write_options({"queue": "out", "batchSize": str(shmq.options.MAX_BATCH + 1)})
    with pytest.raises(shmq.InvalidArgument, match="payload"):
        from pyspark.sql.types import LongType, StructField, StructType
        ss.payload_column(StructType([StructField("payload", LongType())]))


def test_split_is_deterministic_and_covers_the_range() -> None:
    parts = ss.split("q", 10, 250_011, 3)
    assert parts == ss.split("q", 10, 250_011, 3)
    assert parts[0].start == 10 and parts[-1].end == 250_011
    assert all(a.end == b.start for a, b in zip(parts, parts[1:], strict=False))
    assert len(parts) == 3 and max(p.end - p.start for p in parts) <= ss.PARTITION_OFFSETS
    assert ss.split("q", 5, 5, 2) == [] and len(ss.split("q", 0, 3, 10)) == 3


def test_reads_default_min_partitions_to_the_sessions_cores() -> None:
    class Ctx:
        def __init__(self, n: int) -> None:
            self.defaultParallelism = n

    class Session:
        def __init__(self, n: int) -> None:
            self.sparkContext = Ctx(n)

    class Connect:  # Spark Connect: a session without a SparkContext
        @property
        def sparkContext(self) -> Any:
            raise RuntimeError("not supported in Spark Connect")

    sessions = (Session(2), Session(64), Session(0), Session(10**6), Connect())
    assert [ss.default_parallelism(s) for s in sessions] == [2, 64, 1, 10_000, 1]
    source = ss.source_for(3)
    assert issubclass(source, ss.ShmqDataSource) and source.name() == "shmq"
    assert source({"queue": "q"}).reader(ss.SCHEMA).o.min_partitions == 3
    assert source({"queue": "q", "minPartitions": "1"}).reader(ss.SCHEMA).o.min_partitions == 1
    assert ss.ShmqDataSource({"queue": "q"}).reader(ss.SCHEMA).o.min_partitions == 1
    assert len(ss.split("q", 0, ss.PARTITION_OFFSETS * 2 + 1, 1)) == 3


def _rows(reader: ss.StreamReader, start: dict[str, int], end: dict[str, int]) -> list[tuple[int, bytes]]:
    out = []
    for part in reader.partitions(start, end):
        for rb in reader.read(part):
            out += list(zip(rb.column("offset").to_pylist(), rb.column("payload").to_pylist(), strict=True))
    return out


def test_stream_reader_ranges_commits_and_retention(srv: Server) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

    with shmq.connect(srv.url) as b:
        q = fresh(b)
        q.put_many(payloads(30))
        o = ss.read_options({"url": srv.url, "queue": q.name, "group": "g", "startingOffsets": "earliest",
                             "minPartitions": "2"}, streaming=True)
        reader = ss.StreamReader(o)
        start = reader.initialOffset()
        assert start == {q.name: 0} and "g" in q.groups()
        q.commit("default", 1000)  # the default group lets go: only the query's group retains them
        latest = ss.read_options({"url": srv.url, "queue": q.name, "group": "g", "startingOffsets": "latest"},
                                 streaming=True)
        assert ss.StreamReader(latest).initialOffset() == start  # an existing group resumes: stable
        end = reader.latestOffset(start, ReadMaxRows(20))
        assert end == {q.name: 20}
        assert reader.latestOffset(start, ReadAllAvailable()) == {q.name: 30}
        first = _rows(reader, start, end)
        assert first == [(i, f"m{i}".encode()) for i in range(20)]
        q.put_many(payloads(5, 30))
        reader2 = pickle.loads(pickle.dumps(reader))  # holds a connection, pickles without it
        assert _rows(reader2, start, end) == first  # the same range yields the same rows
        assert q.stats()["first_offset"] == 0  # nothing freed before the commit
        reader.commit(end)
        reader.commit(end)  # Spark may commit twice ...
        reader.commit(start)  # ... or late: a commit never moves the group back
        st = q.stats()
        assert st["groups"]["g"]["floor"] == 20 and st["first_offset"] == 20
        assert ss.StreamReader(latest).initialOffset() == end  # where the group committed
        assert _rows(reader, end, {q.name: 35}) == [(i, f"m{i}".encode()) for i in range(20, 35)]
        reader.prepareForTriggerAvailableNow()
        q.put_many(payloads(5, 35))
        assert reader.latestOffset(end, ReadAllAvailable()) == {q.name: 35}  # not past the target
        assert reader.reportLatestOffset() == {q.name: 40}
        q.delete_group("g")  # someone deleted the group: the next commit re-creates it from there
        reader.commit({q.name: 35})
        assert q.stats()["groups"]["g"]["floor"] == 35
        with pytest.raises(ss.DataLost, match="offsets 25..29"):  # freed while the group was gone
            reader.latestOffset({q.name: 25}, ReadAllAvailable())
        reader.stop()
        b.delete_queue(q.name)


def test_lost_offsets_are_reported(srv: Server) -> None:
    with shmq.connect(srv.url) as b:
        q = fresh(b)
        q.put_many(payloads(10))
        q.commit("default", 6)  # the only group lets go of 0..5
        part = ss.OffsetRange(q.name, 2, 8)
        strict = ss.read_options({"url": srv.url, "queue": q.name}, streaming=False)
        with pytest.raises(ss.DataLost, match="offsets 2..5"):
            list(ss.read_range(strict, part))
        lenient = ss.read_options({"url": srv.url, "queue": q.name, "failOnDataLoss": "false"}, False)
        got = [o for rb in ss.read_range(lenient, part) for o in rb.column("offset").to_pylist()]
        assert got == [6, 7]
        reader = ss.StreamReader(ss.read_options({"url": srv.url, "queue": q.name, "group": "g",
                                                  "startingOffsets": f'{{"{q.name}": 1}}'}, True))
        with pytest.raises(ss.DataLost, match="no longer retains"):
            reader.initialOffset()
        reader.stop()
        b.delete_queue(q.name)


def test_starting_timestamp_is_checked() -> None:
    o = ss.read_options({"queue": "ev", "startingTimestamp": "1700000000123"}, streaming=True)
    assert (o.starting_timestamp, o.starting) == (1700000000123, "latest")
    assert ss.read_options({"queue": "ev"}, streaming=False).starting_timestamp is None
    bad = [({"queue": "ev", "startingTimestamp": "yesterday"}, "must be an integer"),
           ({"queue": "ev", "startingTimestamp": "-1"}, "startingTimestamp must be between"),
           ({"queue": "ev", "startingTimestamp": "1", "startingOffsets": "earliest"}, "not both"),
           ({"queue": "ev", "startingTimestamps": "1"}, "did you mean 'startingTimestamp'")]
    for opts, message in bad:
        with pytest.raises(shmq.InvalidArgument, match=message):
            ss.read_options(opts, True)


def test_starting_timestamp_starts_the_stream_and_the_batch_at_that_time(srv: Server) -> None:
    from shmq.spark.source import offset_at

    with shmq.connect(srv.url) as b:
        q = fresh(b)
        ts = spaced(q, 5)  # at least 1 ms apart
        ms = ts[2] // 1_000_000  # a millisecond after message 1, at or before message 2
        assert ts[1] < ms * 1_000_000 <= ts[2]
        opts = {"url": srv.url, "queue": q.name, "group": "g", "startingTimestamp": str(ms)}
        reader = ss.StreamReader(ss.read_options(opts, streaming=True))
        assert reader.initialOffset() == {q.name: 2}
        assert q.stats()["groups"]["g"]["floor"] == 2
        assert reader.initialOffset() == {q.name: 2}  # stable: the group exists now
        reader.stop()
        batch = ss.BatchReader(ss.read_options(opts, streaming=False))
        rows = [o for part in batch.partitions() for rb in batch.read(part)
                for o in rb.column("offset").to_pylist()]
        assert rows == [2, 3, 4]
        after = str(ts[4] // 1_000_000 + 1)
        late = ss.BatchReader(ss.read_options({**opts, "startingTimestamp": after}, False))
        assert late.partitions() == [ss.OffsetRange(q.name, 5, 5)]  # after the newest: nothing
        assert [offset_at(q, t, 0, 5) for t in (0, ts[0], ts[0] + 1, ts[4], ts[4] + 1)] == [0, 0, 1, 4, 5]
        b.delete_queue(q.name)


def test_large_messages_are_read_in_smaller_requests(srv: Server) -> None:
    with shmq.connect(srv.url) as b:
        q = fresh(b, max_bytes=64 << 20)
        big = [bytes([i]) * (1 << 20) for i in range(20)]  # 20 MiB: more than one TCP frame
        for p in big:
            q.put(p)
        with shmq.connect(srv.url) as other:
            assert 0 < len(other.queue(q.name).read(0, 20)) < 20  # one reply is capped to a frame
        o = ss.read_options({"url": srv.url, "queue": q.name}, streaming=False)
        got = [p for rb in ss.read_range(o, ss.OffsetRange(q.name, 0, 20)) for p in rb.column("payload")]
        assert [p.as_py() for p in got] == big
        b.delete_queue(q.name)


def test_shm_url_needs_the_instance_on_this_host() -> None:
    name = unique_instance()
    o = ss.read_options({"url": f"shm://{name}", "queue": "q"}, streaming=False)
    with pytest.raises(shmq.InstanceError, match="use tcp://"):
        list(ss.read_range(o, ss.OffsetRange("q", 0, 1)))
    assert not leftovers(name)  # nothing was created on the way


def test_dead_letter_rows_carry_their_delivery_count(instance: str) -> None:
    b = ShmBroker(instance)
    try:
        q = b.create_queue("work", max_deliveries=2)
        q.put_many([b"poison", b"fine"])
        for _ in range(2):
            m = q.get(timeout=1)
            assert m.payload == b"poison"
            m.nack()
        o = ss.read_options({"url": f"shm://{instance}", "queue": "work.dlq"}, streaming=False)
        (rb,) = list(ss.read_range(o, ss.OffsetRange("work.dlq", 0, 1)))
        assert rb.column("payload").to_pylist() == [b"poison"]
        assert rb.column("delivery_count").to_pylist() == [2]
        (rb,) = list(ss.read_range(ss.read_options({"url": f"shm://{instance}", "queue": "work"}, False),
                                   ss.OffsetRange("work", 1, 2)))
        assert rb.column("payload").to_pylist() == [b"fine"]
        assert rb.column("delivery_count").to_pylist() == [1]
    finally:
        b.destroy()


# ---------------------------------------------------------------- on Spark
def test_batch_write_and_read_round_trip(spark: Any, srv: Server) -> None:
    with shmq.connect(srv.url) as b:
        q = fresh(b)
        df = spark.range(0, 500, numPartitions=3).selectExpr("concat('row ', id) as payload", "id")
        df.write.format("shmq").option("url", srv.url).option("queue", q.name).mode("append").save()
        assert q.stats()["next_offset"] == 500
        back = spark.read.format("shmq").option("url", srv.url).option("queue", q.name).load()
        assert back.schema == ss.SCHEMA
        assert back.rdd.getNumPartitions() == 2  # register(spark): minPartitions = local[2]'s cores
        assert (spark.read.format("shmq").option("url", srv.url).option("queue", q.name)
                .option("minPartitions", 3).load().rdd.getNumPartitions()) == 3
        rows = back.collect()
        assert sorted(r.offset for r in rows) == list(range(500))
        assert sorted(bytes(r.payload) for r in rows) == sorted(f"row {i}".encode() for i in range(500))
        assert {r.queue for r in rows} == {q.name} and {r.delivery_count for r in rows} == {1}
        part = (spark.read.format("shmq").option("url", f"shm://{srv.instance}").option("queue", q.name)
                .option("startingOffsets", f'{{"{q.name}": 100}}')
                .option("endingOffsets", f'{{"{q.name}": 110}}')
                .option("minPartitions", 2).load().collect())  # executors attach the shared memory
        assert sorted(r.offset for r in part) == list(range(100, 110))
        with pytest.raises(Exception, match="cannot be overwritten"):
            df.write.format("shmq").option("url", srv.url).option("queue", q.name).mode("overwrite").save()
        with pytest.raises(Exception, match="did you mean 'startingOffsets'"):
            spark.read.format("shmq").option("queue", q.name).option("startingOffset", "0").load().collect()
        assert q.stats()["next_offset"] == 500
        b.delete_queue(q.name)


def test_headers_round_trip_through_the_sink_and_the_source(spark: Any, srv: Server) -> None:
    with shmq.connect(srv.url) as b:
        q, copy = fresh(b, "h"), fresh(b, "hcopy")
        df = spark.range(0, 60, numPartitions=2).selectExpr(  # map<string,string>, null maps and values
            "cast(id as string) as payload",
            "case id % 3 when 0 then null when 1 then map('id', cast(id as string), 'x', '') "
            "else map('gone', cast(null as string), 'k', concat('v', id)) end as headers")
        df.write.format("shmq").option("url", srv.url).option("queue", q.name).mode("append").save()
        want = {str(i).encode(): [{}, {"id": str(i).encode(), "x": b""}, {"k": f"v{i}".encode()}][i % 3]
                for i in range(60)}
        back = spark.read.format("shmq").option("url", srv.url).option("queue", q.name).load()
        assert back.columns == ["queue", "offset", "payload", "timestamp", "delivery_count", "headers",
                                "priority"]
        rows = back.collect()
        got = {bytes(r.payload): {k: bytes(v) for k, v in r.headers.items()} for r in rows}
        assert len(rows) == 60
        assert got == want  # every row once, each with exactly its headers; none: an empty map
        back.write.format("shmq").option("url", srv.url).option("queue", copy.name).mode("append").save()
        assert copy.stats()["next_offset"] == 60
        assert {bytes(m.payload): dict(m.headers) for m in copy.read(0, 100)} == want  # map<string,binary>
        b.delete_queue(q.name)
        b.delete_queue(copy.name)


def test_stream_restarts_after_a_failed_batch_exactly_once(spark: Any, srv: Server, tmp_path: Path) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    flag = tmp_path / "fail"
    flag.touch()

    def check(offset: int) -> int:
        if offset >= 200 and os.path.exists(str(flag)):
            raise RuntimeError(f"injected failure at offset {offset}")
        return offset

    with shmq.connect(srv.url) as b:
        q = fresh(b)
        q.put_many(payloads(300))

        def run() -> Any:
            df = stream(spark, srv.url, q.name, startingOffsets="earliest", maxOffsetsPerTrigger=100)
            df = df.withColumn("offset", F.udf(check, LongType())("offset"))
            return (df.writeStream.format("parquet").option("path", str(tmp_path / "out"))
                    .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())

        query = run()
        with pytest.raises(Exception, match="injected failure"):
            query.awaitTermination(90)
        assert offsets_in(spark, tmp_path / "out") == list(range(200))  # batches 0 and 1 committed
        flag.unlink()
        q.put_many(payloads(100, 300))
        query = run()
        assert query.awaitTermination(90)
        assert query.exception() is None
        assert [p["numInputRows"] for p in query.recentProgress] == [100, 100]  # batch 2 replayed, then 3
        assert offsets_in(spark, tmp_path / "out") == list(range(400))  # each exactly once
        assert q.stats()["groups"]["spark"]["floor"] >= 300  # committed through the replayed batch
        b.delete_queue(q.name)


def test_rate_limit_and_available_now(spark: Any, srv: Server, tmp_path: Path) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    with shmq.connect(srv.url) as b:
        q = fresh(b)
        q.put_many(payloads(450))
        url, name = srv.url, q.name

        def more_while_running(offset: int) -> int:
            if offset == 0:  # the query is running: these arrive after its target was fixed
                with shmq.connect(url) as b2:
                    b2.queue(name).put_many([b"late"] * 50)
            return offset

        df = stream(spark, srv.url, q.name, startingOffsets="earliest", maxOffsetsPerTrigger=100)
        df = df.withColumn("offset", F.udf(more_while_running, LongType())("offset"))
        query = (df.writeStream.format("parquet").option("path", str(tmp_path / "out"))
                 .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
        assert query.awaitTermination(90)
        assert query.exception() is None
        assert [p["numInputRows"] for p in query.recentProgress] == [100, 100, 100, 100, 50]
        assert offsets_in(spark, tmp_path / "out") == list(range(450))
        assert q.stats()["next_offset"] == 500  # the late ones are there, for the next run
        b.delete_queue(q.name)


def test_stop_mid_run_and_restart(spark: Any, srv: Server, tmp_path: Path) -> None:
    with shmq.connect(srv.url) as b:
        q = fresh(b)
        q.put_many(payloads(10))  # before the query: "latest" skips them

        def start(**trigger: Any) -> Any:
            df = stream(spark, srv.url, q.name, startingOffsets="latest", maxOffsetsPerTrigger=60)
            return (df.writeStream.format("parquet").option("path", str(tmp_path / "out"))
                    .option("checkpointLocation", str(tmp_path / "ck")).trigger(**trigger).start())

        def rows_read(query: Any) -> int:
            return sum(p["numInputRows"] for p in query.recentProgress)

        query = start(processingTime="100 milliseconds")
        wait_until(lambda: len(query.recentProgress) >= 1, timeout=60, interval=0.05)  # started at 10
        q.put_many(payloads(300, 10))
        wait_until(lambda: rows_read(query) >= 120, timeout=60, interval=0.05)
        query.stop()  # mid-run: a batch may be in flight
        done = len(offsets_in(spark, tmp_path / "out"))
        assert 120 <= done <= 300
        q.commit("default", 1 << 40)  # now only the query's group retains the rest
        q.put_many(payloads(40, 310))
        query = start(availableNow=True)  # "latest" must not apply again: the checkpoint decides
        assert query.awaitTermination(90)
        assert query.exception() is None
        assert offsets_in(spark, tmp_path / "out") == list(range(10, 350))
        b.delete_queue(q.name)


def test_stream_sink_replays_a_failed_batch_without_duplicates(spark: Any, srv: Server,
                                                                tmp_path: Path) -> None:
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    flag = tmp_path / "fail"
    flag.touch()
    with shmq.connect(srv.url) as b:
        src, out = fresh(b, "src"), fresh(b, "out")
        src.put_many(payloads(200))
        url, out_name = srv.url, out.name

        def fail_after_partition_0(offset: int) -> int:
            # Partition 1 (offsets 100..199) fails once partition 0 has written its 100 messages.
            if offset == 150 and os.path.exists(str(flag)):
                import time
                deadline = time.monotonic() + 60
                with shmq.connect(url) as b2:
                    while b2.queue(out_name).stats()["next_offset"] < 100 and time.monotonic() < deadline:
                        time.sleep(0.02)
                raise RuntimeError("injected failure after partition 0 was written")
            return offset

        def run() -> Any:
            df = stream(spark, srv.url, src.name, startingOffsets="earliest", minPartitions=2)
            df = df.where(F.udf(fail_after_partition_0, LongType())("offset") >= 0)
            return (df.select("payload").writeStream.format("shmq").option("url", srv.url)
                    .option("queue", out.name).option("checkpointLocation", str(tmp_path / "ck"))
                    .trigger(availableNow=True).start())

        query = run()
        with pytest.raises(Exception, match="injected failure"):
            query.awaitTermination(90)
        assert out.stats()["next_offset"] == 100  # partition 0 of batch 0 is in the queue already
        flag.unlink()
        query = run()  # replays batch 0: partition 0's chunk is a duplicate, partition 1 is written
        assert query.awaitTermination(90)
        assert query.exception() is None
        got = sorted(bytes(m.payload) for m in out.read(0, 1000))
        assert got == sorted(payloads(200))
        b.delete_queue(src.name)
        b.delete_queue(out.name)


def test_a_stream_from_starting_timestamp_reads_exactly_what_came_after(spark: Any, srv: Server,
                                                                        tmp_path: Path) -> None:
    with shmq.connect(srv.url) as b:
        for transport, url in (("tcp", srv.url), ("shm", f"shm://{srv.instance}")):
            q = fresh(b)
            ts = spaced(q, 5)  # m0 .. m4, at least 1 ms apart
            ms = ts[2] // 1_000_000  # after m1, at or before m2
            assert ts[1] < ms * 1_000_000 <= ts[2]
            df = stream(spark, url, q.name, startingTimestamp=ms, maxOffsetsPerTrigger=2)
            query = (df.writeStream.format("parquet").option("path", str(tmp_path / transport))
                     .option("checkpointLocation", str(tmp_path / f"ck-{transport}"))
                     .trigger(availableNow=True).start())
            assert query.awaitTermination(90)
            assert query.exception() is None
            assert [p["numInputRows"] for p in query.recentProgress] == [2, 1]
            rows = spark.read.parquet(str(tmp_path / transport)).select("offset", "payload").collect()
            got = sorted((r.offset, bytes(r.payload)) for r in rows)
            assert got == [(2, b"m2"), (3, b"m3"), (4, b"m4")], transport  # every one, none twice
            b.delete_queue(q.name)


@pytest.mark.crash
def test_a_stream_keeps_exactly_once_across_a_fail_over(spark: Any, tmp_path: Path) -> None:
    """Source and sink over a URL list: the primary is SIGKILLed between two runs of a stream,
    the standby is promoted, and the second run carries on from the checkpoint on the new
    primary, where every offset is what it was: each message is written exactly once."""
    from tests.support.replication import TOKEN, Standby, promote, replication, wait_caught_up
    from tests.support.server import kill_broker

    primary = Server(workers=1, token=TOKEN, extra=["--unix", "off"])
    standby = None
    try:
        standby = Standby(primary.url)
        urls = f"{primary.url},{standby.url}"  # the stream's: it finds the primary

        def run() -> Any:
            df = stream(spark, urls, "src", token=TOKEN, startingOffsets="earliest")
            return (df.select("payload").writeStream.format("shmq").option("url", urls)
                    .option("token", TOKEN).option("queue", "dst")
                    .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())

        with shmq.connect(primary.url, token=TOKEN) as b:
            b.create_queue("src", durability="always").put_many(payloads(200))
            b.create_queue("dst", durability="always")
            query = run()
            assert query.awaitTermination(90) and query.exception() is None
            assert b.queue("dst").stats()["next_offset"] == 200
            with shmq.connect(standby.url, token=TOKEN) as s:
                for name in ("src", "dst"):
                    wait_caught_up(b, s, name)
        kill_broker(primary)
        with shmq.connect(standby.url, token=TOKEN) as s:
            wait_until(lambda: not replication(s)["connected"], 20)
            assert promote(s) == 2
        standby.promoted()
        with shmq.connect(urls, token=TOKEN) as b:
            b.queue("src").put_many(payloads(100, 200))
            query = run()
            assert query.awaitTermination(90) and query.exception() is None
            got = [bytes(m.payload) for m in b.queue("dst").read(0, 1000)]
        assert sorted(got) == sorted(payloads(300))  # all of them, each once
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()


# ---------------------------------------------------------------- priority queues
P = 1 << shmq.options.PRIORITY_SHIFT  # a priority queue's offset of level 1, offset 0


def test_the_sink_writes_each_row_at_its_priority_and_the_source_reads_every_level(spark: Any,
                                                                                     srv: Server) -> None:
    with shmq.connect(srv.url) as b:
        q = fresh(b, "prio", priorities=3)
        df = spark.range(0, 90, numPartitions=2).selectExpr(  # a null priority is 0
            "concat('r', id) as payload",
            "case id % 3 when 0 then null else cast(id % 3 as int) end as priority")
        df.write.format("shmq").option("url", srv.url).option("queue", q.name).mode("append").save()
        st = q.stats()
        assert [lv["next_offset"] & (P - 1) for lv in st["levels"]] == [30, 30, 30]
        back = spark.read.format("shmq").option("url", srv.url).option("queue", q.name).load().collect()
        assert sorted((r.priority, r.offset) for r in back) == sorted(
            [(k, k * P + i) for k in range(3) for i in range(30)])  # every level, every row once
        assert all(int(bytes(r.payload)[1:]) % 3 == r.priority for r in back)
        got = []
        while True:
            try:
                m = q.get(False)
            except shmq.Empty:
                break
            got.append((m.priority, int(m.text[1:]) % 3))
            m.ack()
        assert [p for p, _ in got] == [2] * 30 + [1] * 30 + [0] * 30  # the highest first
        assert all(p == r for p, r in got)  # every row at its own priority
        with pytest.raises(Exception, match="has priorities"):
            (spark.read.format("shmq").option("url", srv.url).option("queue", q.name)
             .option("startingOffsets", f'{{"{q.name}": 3}}').load().collect())
        b.delete_queue(q.name)


def test_a_stream_reads_a_priority_queue_level_by_level(srv: Server) -> None:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

    with shmq.connect(srv.url) as b:
        q = fresh(b, "prios", priorities=2)
        q.put_many(payloads(4))
        q.put_many(payloads(3, 100), priority=1)
        o = ss.read_options({"url": srv.url, "queue": q.name, "group": "g", "startingOffsets": "earliest"},
                            streaming=True)
        reader = ss.StreamReader(o)
        lvl1 = f"{q.name}.prio1"
        start = reader.initialOffset()
        assert start == {q.name: 0, lvl1: P}
        q.commit("default", 1000)  # (level 0's default group lets go)
        q.commit("default", P + 1000)
        end = reader.latestOffset(start, ReadMaxRows(5))
        assert end == {q.name: 2, lvl1: P + 3}  # the highest level first
        assert sorted(_rows(reader, start, end)) == sorted(
            [(i, f"m{i}".encode()) for i in range(2)] + [(P + i, f"m{100 + i}".encode()) for i in range(3)])
        reader.commit(end)
        st = q.stats()
        assert [lv["groups"]["g"]["floor"] for lv in st["levels"]] == [2, P + 3]
        assert ss.StreamReader(o).initialOffset() == end  # where the group committed, level by level
        assert reader.latestOffset(end, ReadAllAvailable()) == {q.name: 4, lvl1: P + 3}
        with pytest.raises(shmq.InvalidArgument, match="another queue"):
            reader.latestOffset({"other": 0}, ReadAllAvailable())
        reader.stop()
        b.delete_queue(q.name)
