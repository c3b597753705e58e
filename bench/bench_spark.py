"""Spark (local[2]) through shmq's data source, against Spark's own rate source as the ceiling.

Run from the repository root::

    python bench/bench_spark.py              # 3 timed micro-batches of 200,000 rows, 3 rounds (+1 untimed)
    python bench/bench_spark.py --quick      # smoke run: 2 batches of 20,000, 1 round
    python bench/bench_spark.py --only shm   # the ceiling and the pipelines whose name has "shm"

Pipelines, all Structured Streaming on ``local[2]`` with micro-batches of the same size:

1. ``rate-micro-batch`` -> ``noop``: Spark's built-in rate source (the variant that makes a
   fixed number of rows per micro-batch, so its batches are the size of shmq's) into the no-op
   sink: what Spark itself does per row, the ceiling.
2. shmq source -> ``noop``, over TCP and over shared memory (``shm://``): a queue filled
   beforehand with 100-byte messages, ``maxOffsetsPerTrigger`` = the batch size,
   ``minPartitions`` 2 (one read task per core), ``trigger(availableNow=True)``: the query
   ends on its own once it has read them.
3. rate-micro-batch -> a 100-byte ``payload`` column -> ``noop``, and the same -> shmq sink
   (TCP, shm): the sink from a generated DataFrame, with the projection's own cost shown apart.
4. The same with ``bench/spark_null.py`` in place of shmq: a Python data source of the
   source's schema that reads nothing (prebuilt Arrow batches), and a Python sink that
   writes nothing: what PySpark's Python Data Source API itself costs, the ceiling of
   any source or sink written with it.

Spark's JVM speeds up as it runs (its first rate batches are the slowest), so every
pipeline runs once untimed first (``--warmup``, default 1 round).  The rate pipelines
never end: they start a batch every ``--interval`` seconds and are stopped between two
batches, never in the middle of one (which Spark logs as aborted writes).  Rows per
second = rows / time of the micro-batches (Spark's ``durationMs.triggerExecution``),
after one warm-up batch that is not counted.  Every
round runs each pipeline in turn; the table reports the median over ``--rounds`` and the
ratio to the rate -> noop ceiling.  The broker (``shmq serve --workers 2``) runs on the
same 2 cores as Spark.  Spark logs at ERROR from its start (a log4j2 configuration given
to the driver's JVM), so its start-up warnings stay out and its errors still show.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

# bench/ is sys.path[0]; importing common puts the repository root there too
import common
from bench_tcp import ShmqServer
from common import Out, fmt_ratio

import shmq
from shmq.core.colocated import ShmBroker

SIZE = 100
PAYLOAD = "concat(lpad(cast(value as string), 12, '0'), repeat('x', 88))"  # 100 bytes per row


LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.shell.name = org.apache.spark.api.python.PythonGatewayServer
logger.shell.level = error
"""


def progress_rate(progress: list[dict[str, Any]], batches: int) -> float:
    """Rows per second over the timed batches (the first one, a warm-up, is left out)."""
    timed = progress[1:1 + batches]
    if len(timed) < batches:
        raise RuntimeError(f"only {len(progress)} micro-batches ran, {batches + 1} were needed")
    rows = sum(p["numInputRows"] for p in timed)
    seconds = sum(p["durationMs"]["triggerExecution"] for p in timed) / 1000
    return rows / seconds


class Bench:
    def __init__(self, spark: Any, server: ShmqServer, rows: int, batches: int, tmp: str,
                 interval: float) -> None:
        self.spark, self.server, self.rows, self.batches, self.tmp = spark, server, rows, batches, tmp
        self.interval = interval
        self.runs = 0
        total = rows * (batches + 1)
        self.shm = ShmBroker(server.instance)
        cap = 1 << max(16, (2 * total - 1).bit_length())
        self.src_q = self.shm.create_queue("spark-src", capacity=cap, max_bytes=cap * 128)
        self.sink_q = self.shm.create_queue("spark-sink", capacity=cap, max_bytes=cap * 128)
        self.payloads = [f"{i:012d}".encode() + b"x" * (SIZE - 12) for i in range(total)]

    def checkpoint(self) -> str:
        self.runs += 1
        return os.path.join(self.tmp, f"ck{self.runs}")

    def until_batches(self, query: Any) -> list[dict[str, Any]]:
        """Let a never-ending query (a processing-time trigger) run its warm-up + timed batches,
        then stop it between two batches: stopped during one, Spark cancels its job and logs
        the aborted write as errors."""
        deadline = time.monotonic() + 600
        while len(query.recentProgress) < self.batches + 1 or query.status["isTriggerActive"]:
            if query.exception() is not None:
                raise RuntimeError(str(query.exception()))
            if time.monotonic() > deadline:
                raise RuntimeError("the query ran too few batches in 600 s")
            time.sleep(0.01)
        query.stop()
        return list(query.recentProgress)

    def paced(self, df: Any, fmt: str, **options: Any) -> Any:
        """``df`` written to ``fmt`` by a query that starts a batch every ``interval`` s."""
        w = df.writeStream.format(fmt).trigger(processingTime=f"{self.interval} seconds")
        for k, v in options.items():
            w = w.option(k, v)
        return w.option("checkpointLocation", self.checkpoint()).start()

    def rate_stream(self) -> Any:
        return (self.spark.readStream.format("rate-micro-batch").option("rowsPerBatch", self.rows)
                .option("numPartitions", 2).load())

    def rate_noop(self) -> float:
        return progress_rate(self.until_batches(self.paced(self.rate_stream(), "noop")), self.batches)

    def source(self, url: str) -> float:
        self.src_q.purge()
        for i in range(0, len(self.payloads), 10_000):
            self.src_q.put_many(self.payloads[i:i + 10_000])
        first = self.src_q.stats()["first_offset"]
        group = f"bench{self.runs}"
        q = (self.spark.readStream.format("shmq").option("url", url).option("queue", self.src_q.name)
             .option("group", group).option("startingOffsets", f'{{"{self.src_q.name}": {first}}}')
             .option("maxOffsetsPerTrigger", self.rows).option("minPartitions", 2).load()
             .writeStream.format("noop").trigger(availableNow=True)
             .option("checkpointLocation", self.checkpoint()).start())
        q.awaitTermination()  # after the batches that read the queue: no stop in the middle of one
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
        self.src_q.delete_group(group)
        return progress_rate(list(q.recentProgress), self.batches)

    def null_source(self) -> float:
        q = (self.spark.readStream.format("shmq-null").option("rows", self.rows)
             .option("total", self.rows * (self.batches + 1)).load()
             .writeStream.format("noop").trigger(availableNow=True)
             .option("checkpointLocation", self.checkpoint()).start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
        return progress_rate(list(q.recentProgress), self.batches)

    def null_sink(self) -> float:
        return progress_rate(self.until_batches(self.paced(self.projected(), "shmq-null")), self.batches)

    def projected(self) -> Any:
        return self.rate_stream().selectExpr(f"{PAYLOAD} as payload")

    def payload_noop(self) -> float:
        return progress_rate(self.until_batches(self.paced(self.projected(), "noop")), self.batches)

    def sink(self, url: str) -> float:
        self.sink_q.purge()
        before = self.sink_q.stats()["next_offset"]
        progress = self.until_batches(self.paced(self.projected(), "shmq", url=url, queue=self.sink_q.name))
        written = self.sink_q.stats()["next_offset"] - before
        if written != sum(p["numInputRows"] for p in progress):
            raise RuntimeError(f"the sink wrote {written} rows; its batches had "
                               f"{sum(p['numInputRows'] for p in progress)}")
        return progress_rate(progress, self.batches)

    def close(self) -> None:
        for name in (self.src_q.name, self.sink_q.name):
            try:
                self.shm.delete_queue(name)
            except shmq.QueueNotFound:
                pass
        self.shm.close()


def stop_session(spark: Any) -> None:
    """Stop the queries, then the session.  PySpark's own stop closes the JVM first, and the
    JVM's end of the accumulator connection with it; the accumulator server's thread, still
    polling, then reads EOF and prints an ``EOFError`` traceback.  So that server is shut
    down first here (its thread leaves its poll loop within a second), then the session."""
    for query in spark.streams.active:
        query.stop()
    server = getattr(spark.sparkContext, "_accumulatorServer", None)
    if server is not None:
        server.shutdown()
    spark.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, help="rows per micro-batch (default 200,000; 20,000 with --quick)")
    p.add_argument("--batches", type=int, help="timed micro-batches per run (default 3; 2 with --quick)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed rounds first, to warm Spark's JVM up (default 1; "
                   "0 with --quick)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--interval", type=float, default=2.0,
                   help="s between the starts of the batches of the rate pipelines (default 2)")
    p.add_argument("--only", help="run only the pipelines whose name contains this (and the ceiling)")
    a = p.parse_args(argv)
    rows = a.rows or (20_000 if a.quick else 200_000)
    batches = a.batches or (2 if a.quick else 3)
    rounds = a.rounds or (1 if a.quick else 3)
    warmup = a.warmup if a.warmup is not None else (0 if a.quick else 1)

    out = Out(label_columns=1)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    import spark_null
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    import shmq.spark

    tmp = tempfile.mkdtemp(prefix="bench_spark.")
    log4j2 = os.path.join(tmp, "log4j2.properties")
    with open(log4j2, "w") as f:
        f.write(LOG4J2)
    server = ShmqServer(2, "s")
    bench: Bench | None = None
    spark = None
    try:
        server.start()
        shm_url = f"shm://{server.instance}"
        spark = (SparkSession.builder.master("local[2]").appName("shmq-bench")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2")
                 .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j2}")
                 .config("spark.sql.warehouse.dir", os.path.join(tmp, "warehouse"))
                 .config("spark.local.dir", os.path.join(tmp, "local")).getOrCreate())
        shmq.spark.register(spark)
        cloudpickle.register_pickle_by_value(spark_null)  # not installed where the workers look
        spark.dataSource.register(spark_null.NullDataSource)
        bench = Bench(spark, server, rows, batches, tmp, a.interval)
        b = bench
        pipelines: list[tuple[str, Callable[[], float]]] = [
            ("rate-micro-batch -> noop (Spark itself)", b.rate_noop),
            ("shmq source (tcp) -> noop", lambda: b.source(server.url)),
            ("shmq source (shm) -> noop", lambda: b.source(shm_url)),
            ("python source reading nothing -> noop", b.null_source),
            ("rate-micro-batch -> payload -> noop", b.payload_noop),
            ("rate-micro-batch -> payload -> python sink (none)", b.null_sink),
            ("rate-micro-batch -> payload -> shmq sink (tcp)", lambda: b.sink(server.url)),
            ("rate-micro-batch -> payload -> shmq sink (shm)", lambda: b.sink(shm_url)),
        ]
        pipelines = [p for i, p in enumerate(pipelines) if i == 0 or not a.only or a.only in p[0]]
        out.line(f"Spark {spark.version} local[2], micro-batches of {rows:,} rows x {batches} timed "
                 f"(+1 warm-up), {SIZE} B payloads, {rounds} round(s) after {warmup} untimed; "
                 "broker: shmq serve --workers 2")
        results: dict[str, list[float]] = {name: [] for name, _ in pipelines}
        for r in range(-warmup, rounds):
            for name, fn in pipelines:
                v = fn()
                if r >= 0:
                    results[name].append(v)
                out.line(f"{'warm-up' if r < 0 else f'round {r + 1}'}: {name:<48} {v:>12,.0f} rows/s")
        med = {name: statistics.median(v) for name, v in results.items()}
        ceiling = med[pipelines[0][0]]
        out.table("Rows per second (median of rounds)", ["pipeline", "rows/s", "vs rate -> noop"],
                  [[name, f"{med[name]:,.0f}", fmt_ratio(med[name] / ceiling)] for name, _ in pipelines])
        return 0
    finally:
        if bench is not None:
            bench.close()
        if spark is not None:
            stop_session(spark)
        server.stop()
        for note in server.notes:
            out.line(f"note: {note}")
        shutil.rmtree(tmp, ignore_errors=True)
        if common.leftovers(server.instance):
            out.line("warning: shared memory left behind", style="bold red")


if __name__ == "__main__":
    sys.exit(main())
