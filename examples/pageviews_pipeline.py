"""Page views on Spark: JSON events from a shmq queue, counted per window and page, written back
to a queue and to Parquet, exactly once.

    .venv/bin/python examples/pageviews_pipeline.py                  # a minute or two, local[*]
    .venv/bin/python examples/pageviews_pipeline.py --seconds 60 --rate 5000

One command runs it all: a broker (``shmq serve`` on a free port, unless ``--url`` names one),
a producer process that publishes page-view events (``{"ts_us": ..., "user": ..., "page": ...,
"ms": ...}``) into the queue ``pageviews`` for ``--seconds``, and two Structured Streaming
queries over it, each with its own consumer group (``default`` and ``to-parquet``).  Both
count views, distinct users and mean latency per 10-second window and page, with a 5-second
watermark, in ``append`` mode (a window is written once, when the watermark has passed its end):

* ``to-queue`` writes each window's rows as JSON messages into the queue ``pageview_counts``;
* ``to-parquet`` writes them to Parquet.

When the producer is done, each query processes what is left.  The producer keeps its own
count of every window, and the summary checks each window the queries wrote against it.
On a cluster: see docs/spark.md ("On a cluster").
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import shmq

PAGES = ["/home", "/products", "/product/42", "/cart", "/checkout", "/blog", "/about", "/help"]
WEIGHTS = [30, 20, 15, 10, 6, 8, 5, 6]
EVENTS, COUNTS = "pageviews", "pageview_counts"
WINDOW, WATERMARK = 10, 5  # seconds
CAPACITY = 1 << 18  # events the queue holds while the queries catch up (64 MiB of shared memory)


# ---------------------------------------------------------------- broker and producer
@contextmanager
def broker(url: str | None, tmp: str) -> Iterator[str]:
    """The broker's URL: the one given, or a ``shmq serve`` started here for the run."""
    if url:
        yield url
        return
    log = os.path.join(tmp, "broker.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()", "serve",
                                 "--port", "0", "--workers", "2", "--instance", f"pageviews{os.getpid()}",
                                 "--data-dir", os.path.join(tmp, "data")],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (m := re.search(r"tcp://[0-9.]+:\d+", open(log).read())):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"shmq serve did not start: {open(log).read()!r}")
            time.sleep(0.05)
        yield m.group(0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def produce(url: str, seconds: float, rate: int, truth: str) -> None:
    """Publish page views at about ``rate`` per second for ``seconds``, in batches every 50 ms,
    and write the true count of every (window start, page) to the file ``truth``."""
    rnd = random.Random(7)
    q = shmq.connect(url).queue(EVENTS)
    per_tick = max(1, rate // 20)
    counts: Counter[tuple[int, str]] = Counter()
    start = time.monotonic()
    tick = 0
    while time.monotonic() - start < seconds:
        ts_us = time.time_ns() // 1000
        batch = []
        for _ in range(per_tick):
            page = rnd.choices(PAGES, WEIGHTS)[0]
            batch.append(json.dumps({"ts_us": ts_us, "user": f"u{rnd.randrange(500)}", "page": page,
                                     "ms": rnd.randrange(5, 400)}))
            counts[(ts_us // 1_000_000 // WINDOW * WINDOW, page)] += 1
        q.put_many(batch)
        tick += 1
        time.sleep(max(0.0, start + tick / 20 - time.monotonic()))
    with open(truth, "w") as f:
        json.dump([[w, page, n] for (w, page), n in counts.items()], f)


# ---------------------------------------------------------------- the Spark side
def session(master: str | None, shuffle_partitions: int, tmp: str) -> Any:
    # No PYSPARK_PYTHON needed in local mode: shmq.spark.register points Spark's workers at
    # this Python when the default one (python3) cannot import shmq and pyarrow.  On a
    # cluster, set it (spark-submit --conf spark.pyspark.python=...): docs/spark.md.
    from pyspark.sql import SparkSession

    import shmq.spark

    b = SparkSession.builder.appName("shmq-pageviews")
    if master:
        b = b.master(master)
    spark = (b.config("spark.sql.shuffle.partitions", str(shuffle_partitions))
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.warehouse.dir", os.path.join(tmp, "warehouse"))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    shmq.spark.register(spark)
    return spark


def windowed_counts(spark: Any, url: str, group: str) -> Any:
    """Views, distinct users and mean latency per window and page (window: epoch seconds)."""
    from pyspark.sql import functions as F

    events = (spark.readStream.format("shmq").option("url", url).option("queue", EVENTS)
              .option("group", group).option("startingOffsets", "earliest")
              .option("maxOffsetsPerTrigger", 50_000).load())
    views = (events.select(F.from_json(F.col("payload").cast("string"),
                                       "ts_us long, user string, page string, ms int").alias("e"))
             .select(F.timestamp_micros("e.ts_us").alias("event_time"), "e.user", "e.page", "e.ms"))
    return (views.withWatermark("event_time", f"{WATERMARK} seconds")
            .groupBy(F.window("event_time", f"{WINDOW} seconds").alias("w"), "page")
            .agg(F.count("*").alias("views"), F.approx_count_distinct("user").alias("users"),
                 F.round(F.avg("ms"), 1).alias("avg_ms"))
            .select(F.unix_timestamp("w.start").alias("window"), "page", "views", "users", "avg_ms"))


def start_queries(spark: Any, url: str, checkpoint: str, parquet: str) -> list[Any]:
    from pyspark.sql import functions as F

    # Each query owns a consumer group; a message is freed once every group has committed it.
    # Nothing else reads "pageviews", so one query takes the queue's own "default" group.
    as_json = windowed_counts(spark, url, "default").select(
        F.to_json(F.struct("window", "page", "views", "users", "avg_ms")).alias("payload"))
    to_queue = (as_json.writeStream.queryName("to-queue").format("shmq").option("url", url)
                .option("queue", COUNTS).trigger(processingTime="2 seconds")
                .option("checkpointLocation", os.path.join(checkpoint, "to-queue")).start())
    to_parquet = (windowed_counts(spark, url, "to-parquet")
                  .writeStream.queryName("to-parquet").format("parquet").option("path", parquet)
                  .trigger(processingTime="2 seconds")
                  .option("checkpointLocation", os.path.join(checkpoint, "to-parquet")).start())
    return [to_queue, to_parquet]


# ---------------------------------------------------------------- summary
def read_all(q: shmq.Queue) -> list[shmq.Message]:
    out: list[shmq.Message] = []
    while batch := q.read(out[-1].offset + 1 if out else 0, shmq.options.MAX_BATCH):
        out += batch
    return out


def hms(epoch: int) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch))


def check(name: str, rows: list[tuple[int, str, int]], truth: dict[tuple[int, str], int]) -> bool:
    """Print what a sink holds; True when every (window, page) is there once, with the true count."""
    keys = [(w, page) for w, page, _ in rows]
    dups = len(keys) - len(set(keys))
    wrong = sum(1 for w, page, n in rows if truth.get((w, page)) != n)
    windows = sorted({w for w, _ in keys})
    span = f"{hms(windows[0])}-{hms(windows[-1] + WINDOW)} UTC" if windows else "none"
    print(f"{name:<26} {len(rows):>4} rows, {len(windows):>2} windows ({span}), "
          f"{sum(n for *_, n in rows):>7,} views; duplicates: {dups}, counts unlike the producer's: {wrong}")
    return bool(rows) and not dups and not wrong


def summary(spark: Any, url: str, parquet: str, truth: dict[tuple[int, str], int],
            queries: list[Any]) -> bool:
    for q in queries:
        rows = sum(p["numInputRows"] for p in q.recentProgress)
        print(f"query {q.name:<10} read {rows:>8,} events in {len(q.recentProgress)} micro-batches")
    with shmq.connect(url) as b:
        msgs = read_all(b.queue(COUNTS))
    in_queue = [(d["window"], d["page"], d["views"]) for d in (json.loads(m.payload) for m in msgs)]
    in_parquet = [(r.window, r.page, r.views) for r in spark.read.parquet(parquet).collect()]
    print()
    ok = check(f"queue {COUNTS!r}", in_queue, truth)
    ok = check("parquet", in_parquet, truth) and ok
    written = {(w, p) for w, p, _ in in_queue}
    open_views = sum(n for k, n in truth.items() if k not in written)
    by_page = Counter[str]()
    for _w, page, n in in_queue:
        by_page[page] += n
    print("\nviews per page (closed windows): " + ", ".join(f"{p} {n:,}" for p, n in by_page.most_common()))
    print(f"produced {sum(truth.values()):,} events: {sum(n for *_, n in in_queue):,} in the windows "
          f"written, {open_views:,} in the last ones, still open (the watermark has not passed them)")
    print("every written window matches the producer's count, once: " + ("yes" if ok else "NO"))
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an existing broker (default: start one for the run)")
    p.add_argument("--master", help="Spark master (default: Spark's, local[*]; spark-submit sets it)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long the producer runs")
    p.add_argument("--rate", type=int, default=2000, help="page views per second")
    p.add_argument("--checkpoint", help="checkpoint folder (default: a temporary one)")
    p.add_argument("--parquet", help="Parquet output folder (default: a temporary one)")
    p.add_argument("--shuffle-partitions", type=int, default=4)
    args = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="pageviews.")
    checkpoint = args.checkpoint or os.path.join(tmp, "checkpoint")
    parquet = args.parquet or os.path.join(tmp, "parquet")
    truth_file = os.path.join(tmp, "truth.json")
    try:
        with broker(args.url, tmp) as url:
            print(f"broker {url}")
            with shmq.connect(url) as b:
                for name, cap in ((EVENTS, CAPACITY), (COUNTS, 1 << 16)):
                    b.create_queue(name, capacity=cap, max_bytes=cap * 256)
            spark = session(args.master, args.shuffle_partitions, tmp)
            queries = start_queries(spark, url, checkpoint, parquet)
            print(f"queries started; producing ~{args.rate:,} page views/s for {args.seconds:g} s")
            producer = mp.get_context("spawn").Process(target=produce,
                                                       args=(url, args.seconds, args.rate, truth_file))
            producer.start()
            producer.join()
            t0 = time.monotonic()
            for q in queries:
                q.processAllAvailable()  # the rest of the events, then stop
                q.stop()
            print(f"producer done; the queries caught up {time.monotonic() - t0:.1f} s later\n")
            with open(truth_file) as f:
                truth = {(w, page): n for w, page, n in json.load(f)}
            ok = summary(spark, url, parquet, truth, queries)
            spark.stop()
            return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
