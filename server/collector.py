"""The collector: the broker's Prometheus metrics, read from shared memory at each scrape.

``BrokerCollector.collect`` is called by ``prometheus_client`` when a scrape comes
(``server.metrics``).  It reads every queue of the instance (``shmq.core.readings``:
lock-free, from the queue headers and group tables), the workers' connection
counts (``server.placement.Counts``), the replies dropped (registry words) and the
scoreboard (``server.scoreboard``: requests, latencies, fsyncs, restarts).  Nothing is
counted per message for it: the figures are the words the broker keeps anyway, plus
the scoreboard's few stores per request.  ``METRICS`` lists every metric once; docs/operations.md
("Metrics") renders the same list.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from shmq.core.readings import QueueReading
from shmq.core.serverqueue import ServerBroker
from shmq.errors import ShmqError

from .placement import Counts
from .scoreboard import Histogram, Scoreboard

Q, G, W, WO = ("queue",), ("queue", "group"), ("worker",), ("worker", "op")

#: name -> (type, labels, help); the names are as exposed (counters with their ``_total``)
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "shmq_queue_depth": ("gauge", Q, "Messages retained: produced and not yet acknowledged by every group."),
    "shmq_queue_capacity_messages": ("gauge", Q, "Messages the queue holds at most (capacity)."),
    "shmq_queue_used_bytes": ("gauge", Q, "Bytes of the ring taken by retained messages."),
    "shmq_queue_capacity_bytes": ("gauge", Q, "Bytes of the ring (max_bytes)."),
    "shmq_queue_produced_total": ("counter", Q, "Messages produced (the next offset)."),
    "shmq_queue_durable_lag": ("gauge", Q, "Journaled queues: messages produced and not yet on disk."),
    "shmq_queue_journal_errno": ("gauge", Q, "Journaled queues: errno of the failing journal write, "
                                             "0 while it writes fine (produce is refused meanwhile)."),
    "shmq_queue_lock_recoveries_total": ("counter", Q, "Times a process died holding one of the "
                                                       "queue's locks (and the next holder repaired it)."),
    "shmq_queue_leases_reaped_total": ("counter", Q, "Leases of dead processes given back by the reaper."),
    "shmq_queue_leases_returned_total": ("counter", Q, "Leases of closed broker connections given back."),
    "shmq_group_lag": ("gauge", G, "Messages produced that the group has not acknowledged "
                                   "(next offset - floor; in flight included)."),
    "shmq_group_in_flight": ("gauge", G, "Messages leased to consumers now."),
    "shmq_group_oldest_unacked_age_seconds": ("gauge", G, "Age of the group's oldest unacknowledged "
                                                          "message (its producer's timestamp); 0 when none."),
    "shmq_group_delivered_total": ("counter", G, "Deliveries, first and repeated."),
    "shmq_group_redelivered_total": ("counter", G, "Deliveries of messages given back before."),
    "shmq_group_acked_total": ("counter", G, "Messages acknowledged."),
    "shmq_group_nacked_total": ("counter", G, "Messages given back by a nack."),
    "shmq_group_expired_total": ("counter", G, "Leases that ran past their visibility timeout."),
    "shmq_group_dead_lettered_total": ("counter", G, "Messages sent to the dead-letter queue."),
    "shmq_group_ttl_expired_total": ("counter", G, "Messages not delivered within the queue's "
                                                   "message_ttl (dead-lettered or dropped)."),
    "shmq_replies_dropped_total": ("counter", ("reason",), "Replies dropped: read after their request "
                                                         "timed out (late), sent to a reply queue gone "
                                                         "(gone) or full (full)."),
    "shmq_journal_fsync_duration_seconds": ("histogram", (), "Time one journal fsync took."),
    "shmq_journal_storage_errors_total": ("counter", (), "Journal writes or fsyncs that failed."),
    "shmq_journal_restarts_total": ("counter", (), "Times the journal process died and was restarted."),
    "shmq_replication_role": ("gauge", ("role",), "1 for this node's role (primary; a standby serves "
                                                 "no metrics), with the role as a label."),
    "shmq_replication_epoch": ("gauge", (), "The node's epoch: raised by each `shmq promote`."),
    "shmq_replication_standbys": ("gauge", (), "Standbys streaming from this primary now."),
    "shmq_replication_lag_records": ("gauge", ("standby",), "Messages journaled here that the standby "
                                                            "has not confirmed (fsynced) yet."),
    "shmq_replication_lag_bytes": ("gauge", ("standby",), "Bytes queued for the standby, not sent yet."),
    "shmq_replication_lag_seconds": ("gauge", ("standby",), "Age of the oldest round the standby has "
                                                            "not confirmed; 0 when none."),
    "shmq_worker_connections": ("gauge", W, "Client connections the worker serves now."),
    "shmq_worker_requests_total": ("counter", WO, "Requests handled, by operation."),
    "shmq_worker_request_duration_seconds": ("histogram", WO, "Time the worker spent on a request "
                                                              "(not the time it waited parked or for "
                                                              "the journal)."),
    "shmq_worker_restarts_total": ("counter", W, "Times the worker died and was restarted."),
}


def _family(name: str) -> Any:
    kind, labels, doc = METRICS[name]
    if kind == "counter":
        return CounterMetricFamily(name, doc, labels=labels)
    if kind == "gauge":
        return GaugeMetricFamily(name, doc, labels=labels)
    return HistogramMetricFamily(name, doc, labels=labels)


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    return [(floatToGoString(b), c) for b, c in zip((*h.bounds, float("inf")), h.cumulative, strict=True)]


class BrokerCollector(Collector):
    """Every metric of one instance; ``board`` and ``counts``: None when there are no
    workers to read (a collector over shared memory alone, as in tests)."""

    def __init__(self, broker: ServerBroker, board: Scoreboard | None = None,
                 counts: Counts | None = None,
                 replication: Callable[[], dict[str, Any]] | None = None) -> None:
        self.broker = broker
        self.replication = replication  # INFO's replication (server.replication.Board), None: not known
        self.board = board
        self.counts = counts

    def readings(self) -> list[QueueReading]:
        """Every queue now (one deleted meanwhile is left out)."""
        self.broker.prune()
        out = []
        for q in self.broker.queues():
            try:
                out.append(q.reading())
            except (ShmqError, ValueError):  # deleted meanwhile: its mapping may be gone
                continue
        return out

    def collect(self) -> Iterator[Any]:
        fam = {name: _family(name) for name in METRICS}

        def add(name: str, labels: list[str], value: float) -> None:
            fam[name].add_metric(labels, value)

        now_ns = time.time_ns()
        for r in self.readings():
            q = [r.name]
            add("shmq_queue_depth", q, r.depth)
            add("shmq_queue_capacity_messages", q, r.capacity)
            add("shmq_queue_used_bytes", q, r.bytes_used)
            add("shmq_queue_capacity_bytes", q, r.max_bytes)
            add("shmq_queue_produced_total", q, r.produced)
            if r.durable_lag is not None:
                add("shmq_queue_durable_lag", q, r.durable_lag)
                add("shmq_queue_journal_errno", q, r.journal_errno)
            add("shmq_queue_lock_recoveries_total", q, r.lock_recoveries)
            add("shmq_queue_leases_reaped_total", q, r.leases_reaped)
            add("shmq_queue_leases_returned_total", q, r.leases_returned)
            for g in r.groups:
                qg = [r.name, g.name]
                add("shmq_group_lag", qg, g.lag)
                add("shmq_group_in_flight", qg, g.in_flight)
                add("shmq_group_oldest_unacked_age_seconds", qg,
                    max(0.0, (now_ns - g.oldest_ns) / 1e9) if g.oldest_ns else 0.0)
                add("shmq_group_delivered_total", qg, g.delivered)
                add("shmq_group_redelivered_total", qg, g.redelivered)
                add("shmq_group_acked_total", qg, g.acked)
                add("shmq_group_nacked_total", qg, g.nacked)
                add("shmq_group_expired_total", qg, g.expired)
                add("shmq_group_dead_lettered_total", qg, g.dead_lettered)
                add("shmq_group_ttl_expired_total", qg, g.ttl_expired)
        for reason, n in self.broker.registry.replies_dropped().items():
            add("shmq_replies_dropped_total", [reason], n)
        if self.replication is not None:
            repl = self.replication()
            add("shmq_replication_role", [str(repl.get("role", "primary"))], 1)
            add("shmq_replication_epoch", [], int(repl.get("epoch", 1)))
            standbys = repl.get("standbys") or []
            add("shmq_replication_standbys", [], len(standbys))
            for sb in standbys:
                who = [str(sb.get("node") or sb.get("peer"))]
                add("shmq_replication_lag_records", who, sb.get("lag_records", 0))
                add("shmq_replication_lag_bytes", who, sb.get("lag_bytes", 0))
                add("shmq_replication_lag_seconds", who, sb.get("lag_seconds", 0.0))
        if self.counts is not None:
            for i, n in enumerate(self.counts.snapshot()):
                add("shmq_worker_connections", [str(i)], n)
        if self.board is not None:
            errors, fsync = self.board.journal_figures()
            add("shmq_journal_storage_errors_total", [], errors)
            fam["shmq_journal_fsync_duration_seconds"].add_metric([], _buckets(fsync), fsync.sum_seconds)
            workers, journal = self.board.restarts()
            add("shmq_journal_restarts_total", [], journal)
            for i, n in enumerate(workers):
                add("shmq_worker_restarts_total", [str(i)], n)
                for op, h in self.board.requests(i).items():
                    add("shmq_worker_requests_total", [str(i), op], h.count)
                    fam["shmq_worker_request_duration_seconds"].add_metric(
                        [str(i), op], _buckets(h), h.sum_seconds)
        yield from fam.values()


__all__ = ["METRICS", "BrokerCollector"]
