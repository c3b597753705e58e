"""Spark (local[2]) through shmq's data source, against Spark's own rate source as the ceiling.

Run from the repository root::

    python bench/bench_spark.py              # 3 timed micro-batches of 200,000 rows, 3 rounds
    python bench/bench_spark.py --quick      # smoke run: 2 batches of 20,000, 1 round

Pipelines, all Structured Streaming on ``local[2]`` with micro-batches of the same size:

1. ``rate-micro-batch`` -> ``noop``: Spark's built-in rate source (the variant that makes a
   fixed number of rows per micro-batch, so its batches are the size of shmq's) into the no-op
   sink: what Spark itself does per row, the ceiling.
2. shmq source -> ``noop``, over TCP and over shared memory (``shm://``): a queue filled
   beforehand with 100-byte messages, ``maxOffsetsPerTrigger`` = the batch size,
   ``minPartitions`` 2 (one read task per core), ``trigger(availableNow=True)``.
3. rate-micro-batch -> a 100-byte ``payload`` column -> ``noop``, and the same -> shmq sink
   (TCP, shm): the sink from a generated DataFrame, with the projection's own cost shown apart.

Rows per second = rows / time of the micro-batches (Spark's ``durationMs.triggerExecution``),
after one warm-up batch that is not counted.  Every round runs each pipeline in turn; the
table reports the median over ``--rounds`` and the ratio to the rate -> noop ceiling.  The
broker (``shmq serve --workers 2``) runs on the same 2 cores as Spark.
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
from shmq.shm import ShmBroker

SIZE = 100
PAYLOAD = "concat(lpad(cast(value as string), 12, '0'), repeat('x', 88))"  # 100 bytes per row


def progress_rate(progress: list[dict[str, Any]], batches: int) -> float:
    """Rows per second over the timed batches (the first one, a warm-up, is left out)."""
    timed = progress[1:1 + batches]
    if len(timed) < batches:
        raise RuntimeError(f"only {len(progress)} micro-batches ran, {batches + 1} were needed")
    rows = sum(p["numInputRows"] for p in timed)
    seconds = sum(p["durationMs"]["triggerExecution"] for p in timed) / 1000
    return rows / seconds


class Bench:
    def __init__(self, spark: Any, server: ShmqServer, rows: int, batches: int, tmp: str) -> None:
        self.spark, self.server, self.rows, self.batches, self.tmp = spark, server, rows, batches, tmp
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
        """Let a never-ending query run its warm-up + timed batches, then stop it."""
        deadline = time.monotonic() + 600
        while len(query.recentProgress) < self.batches + 1:
            if query.exception() is not None:
                raise RuntimeError(str(query.exception()))
            if time.monotonic() > deadline:
                raise RuntimeError("the query ran too few batches in 600 s")
            time.sleep(0.1)
        query.stop()
        return list(query.recentProgress)

    def rate_stream(self) -> Any:
        return (self.spark.readStream.format("rate-micro-batch").option("rowsPerBatch", self.rows)
                .option("numPartitions", 2).load())

    def rate_noop(self) -> float:
        q = (self.rate_stream().writeStream.format("noop").trigger(processingTime="0 seconds")
             .option("checkpointLocation", self.checkpoint()).start())
        return progress_rate(self.until_batches(q), self.batches)

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
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(str(q.exception()))
        self.src_q.delete_group(group)
        return progress_rate(list(q.recentProgress), self.batches)

    def projected(self) -> Any:
        return self.rate_stream().selectExpr(f"{PAYLOAD} as payload")

    def payload_noop(self) -> float:
        q = (self.projected().writeStream.format("noop").trigger(processingTime="0 seconds")
             .option("checkpointLocation", self.checkpoint()).start())
        return progress_rate(self.until_batches(q), self.batches)

    def sink(self, url: str) -> float:
        self.sink_q.purge()
        q = (self.projected().writeStream.format("shmq").option("url", url).option("queue", self.sink_q.name)
             .trigger(processingTime="0 seconds").option("checkpointLocation", self.checkpoint()).start())
        progress = self.until_batches(q)
        written = self.sink_q.stats()["next_offset"] - self.sink_q.stats()["first_offset"]
        if written < self.rows * (self.batches + 1):
            raise RuntimeError(f"the sink wrote {written} rows, fewer than the batches had")
        return progress_rate(progress, self.batches)

    def close(self) -> None:
        for name in (self.src_q.name, self.sink_q.name):
            try:
                self.shm.delete_queue(name)
            except shmq.QueueNotFound:
                pass
        self.shm.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, help="rows per micro-batch (default 200,000; 20,000 with --quick)")
    p.add_argument("--batches", type=int, help="timed micro-batches per run (default 3; 2 with --quick)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="small smoke run")
    a = p.parse_args(argv)
    rows = a.rows or (20_000 if a.quick else 200_000)
    batches = a.batches or (2 if a.quick else 3)
    rounds = a.rounds or (1 if a.quick else 3)

    out = Out(label_columns=1)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    import shmq.spark

    tmp = tempfile.mkdtemp(prefix="bench_spark.")
    server = ShmqServer(2, "s")
    bench: Bench | None = None
    spark = None
    try:
        server.start()
        shm_url = f"shm://{server.instance}"
        spark = (SparkSession.builder.master("local[2]").appName("shmq-bench")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2")
                 .config("spark.sql.warehouse.dir", os.path.join(tmp, "warehouse"))
                 .config("spark.local.dir", os.path.join(tmp, "local")).getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        shmq.spark.register(spark)
        bench = Bench(spark, server, rows, batches, tmp)
        b = bench
        pipelines: list[tuple[str, Callable[[], float]]] = [
            ("rate-micro-batch -> noop (Spark itself)", b.rate_noop),
            ("shmq source (tcp) -> noop", lambda: b.source(server.url)),
            ("shmq source (shm) -> noop", lambda: b.source(shm_url)),
            ("rate-micro-batch -> payload -> noop", b.payload_noop),
            ("rate-micro-batch -> payload -> shmq sink (tcp)", lambda: b.sink(server.url)),
            ("rate-micro-batch -> payload -> shmq sink (shm)", lambda: b.sink(shm_url)),
        ]
        out.line(f"Spark {spark.version} local[2], micro-batches of {rows:,} rows x {batches} timed "
                 f"(+1 warm-up), {SIZE} B payloads, {rounds} round(s); broker: shmq serve --workers 2")
        results: dict[str, list[float]] = {name: [] for name, _ in pipelines}
        for r in range(rounds):
            for name, fn in pipelines:
                v = fn()
                results[name].append(v)
                out.line(f"round {r + 1}: {name:<48} {v:>12,.0f} rows/s")
        med = {name: statistics.median(v) for name, v in results.items()}
        ceiling = med[pipelines[0][0]]
        out.table("Rows per second (median of rounds)", ["pipeline", "rows/s", "vs rate -> noop"],
                  [[name, f"{med[name]:,.0f}", fmt_ratio(med[name] / ceiling)] for name, _ in pipelines])
        return 0
    finally:
        if bench is not None:
            bench.close()
        if spark is not None:
            spark.stop()
        server.stop()
        for note in server.notes:
            out.line(f"note: {note}")
        shutil.rmtree(tmp, ignore_errors=True)
        if common.leftovers(server.instance):
            out.line("warning: shared memory left behind", style="bold red")


if __name__ == "__main__":
    sys.exit(main())
