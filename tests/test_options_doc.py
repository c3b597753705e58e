"""docs/operations.md's tables of limits and defaults against shmq/options.py, the one
place every number lives (as test_codec checks docs/protocol.md against the codec).

Each documented number is found in the row that names it, written the way the doc
writes numbers (``16 MiB``, ``10,000``, ``30 s``); a changed default that the doc does
not follow fails here."""

from __future__ import annotations

from pathlib import Path

import pytest

from shmq import options

DOC = Path(__file__).parent.parent / "docs" / "operations.md"


def _rows() -> list[str]:
    return [line for line in DOC.read_text().splitlines() if line.startswith("|")]


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,}"


def _count(n: int) -> str:
    return f"{n:,}" if n >= 10_000 else str(n)


def _seconds(s: float) -> str:
    if s >= 3600 and s % 3600 == 0:
        return f"{int(s // 3600)} h"
    return f"{s:g} s"


def _buckets(bounds: tuple[float, ...]) -> str:
    return f"{bounds[0] * 1e6:g} µs … {bounds[-1]:g} s, {len(bounds)} bounds"


# (the words that pick the row, the number as the doc writes it)
DOCUMENTED = [
    ("queues per instance", _count(options.MAX_QUEUES)),
    ("processes attached per instance", _count(options.MAX_CLIENTS)),
    ("queue name", f"1–{options.QUEUE_NAME_MAX} chars"),
    ("group name", f"1–{options.GROUP_NAME_MAX} chars"),
    ("group name", f"`{options.DEFAULT_GROUP}`"),
    ("instance name", f"1–{options.INSTANCE_NAME_MAX} chars"),
    ("instance name", f"`{options.DEFAULT_INSTANCE}`"),
    ("`capacity`", str(options.DEFAULT_CAPACITY)),
    ("`capacity`", f"1 – {options.MAX_CAPACITY:,}"),
    ("`max_bytes`", _size(options.DEFAULT_MAX_BYTES)),
    ("`max_bytes`", f"{_size(options.MIN_MAX_BYTES)} – {_size(options.MAX_MAX_BYTES)}"),
    ("`max_message_size`", _size(options.DEFAULT_MAX_MESSAGE_SIZE)),
    ("`max_message_size`", f"`max_bytes` − {_size(options.MAX_META_SIZE)}"),
    ("`max_message_size`", f"and {_size(options.MAX_MESSAGE_SIZE)}"),
    ("`visibility_timeout`", _seconds(options.DEFAULT_VISIBILITY_TIMEOUT)),
    ("`visibility_timeout`", f"(0, {_seconds(options.MAX_VISIBILITY_TIMEOUT)}]"),
    ("`max_deliveries`", f"| {options.DEFAULT_MAX_DELIVERIES} |"),
    ("`max_deliveries`", f"1 – {options.MAX_DELIVERIES_LIMIT}"),
    ("`max_groups` per queue", f"| {options.DEFAULT_MAX_GROUPS} |"),
    ("`max_groups` per queue", f"1 – {options.MAX_GROUPS_LIMIT}"),
    ("`priorities`", f"0 – {options.MAX_PRIORITIES} (`MAX_PRIORITIES`)"),
    ("headers per message", f"{options.MAX_HEADERS} (`MAX_HEADERS`)"),
    ("headers' encoded bytes per message", f"{options.MAX_HEADERS_BYTES} (`MAX_HEADERS_BYTES`)"),
    ("idempotent producers remembered", _count(options.MAX_PRODUCERS)),
    ("a message's own TTL", f"{options.MAX_MESSAGE_TTL / (365 * 86400):g} year] (`MAX_MESSAGE_TTL`)"),
    ("lease words the broker's maintenance looks at", f"{options.TTL_SWEEP_BATCH} (`TTL_SWEEP_BATCH`)"),
    ("lease words the broker's maintenance looks at", f"`REAP_INTERVAL`, {_seconds(options.REAP_INTERVAL)}"),
    ("dead-letter copies into an `always` DLQ", f"{_seconds(options.DEAD_LETTER_SYNC_WAIT)} "),
    ("idempotent producer id", f"1–{options.PRODUCER_ID_MAX} chars"),
    ("`durability`", f"`{options.DEFAULT_DURABILITY}`"),
    ("`durability`", ", ".join(f"`{m}`" for m in options.DURABILITY_MODES)),
    ("`--sync-interval`", _seconds(options.DEFAULT_SYNC_INTERVAL)),
    ("journal segment file", _size(options.JOURNAL_SEGMENT_BYTES)),
    ("journal preallocation", _size(options.JOURNAL_PREALLOC_BYTES)),
    ("unconfirmed messages", _count(options.DEFAULT_PUBLISH_WINDOW)),
    ("unconfirmed messages", _count(options.MAX_PUBLISH_WINDOW)),
    ("frame body", f"{_size(options.MAX_FRAME - 4096)} + {_size(4096)}"),
    ("messages per batch frame", _count(options.MAX_BATCH)),
    ("connections per worker", _count(options.MAX_CONNECTIONS)),
    ("unacknowledged messages per connection", _count(options.MAX_INFLIGHT_PER_CONNECTION)),
    ("handshake", _seconds(options.HANDSHAKE_TIMEOUT)),
    ("heartbeat interval", _seconds(options.HEARTBEAT)),
    ("silent intervals before",
     f"{options.HEARTBEAT_MISSES} ({_seconds(options.HEARTBEAT * options.HEARTBEAT_MISSES)}"),
    ("TLS negotiation", _seconds(options.TLS_HANDSHAKE_TIMEOUT)),
    ("a worker's polling for the next request", f"| {options.WORKER_SPIN_US:g} µs;"),
    ("a worker's polling for the next request", f"at most {options.MAX_SPIN_US:,.0f} µs (`MAX_SPIN_US`)"),
    ("a blocking client's polling for an answer", f"| {options.CLIENT_SPIN_US:g} µs;"),
    ("a blocking client's polling for an answer", f"at most {options.MAX_SPIN_US:,.0f} µs;"),
    ("waits that sleep at once after a poll", f"| {options.SPIN_BACKOFF} |"),
    ("a co-located get's spin before it sleeps", f"| {options.LOCAL_SPIN_US:g} µs |"),
    ("a co-located requester's spin for its reply", f"| {options.REPLY_SPIN_US:g} µs |"),
    ("progress bar delay", _seconds(options.PROGRESS_DELAY)),
    ("progress line interval", _seconds(options.PROGRESS_INTERVAL)),
    ("refused tokens from one peer address", f"{options.AUTH_FAILURES_MAX} in "
                                                f"{_seconds(options.AUTH_FAILURE_WINDOW)}"),
    ("a scrape connection's request", _seconds(options.METRICS_REQUEST_TIMEOUT)),
    ("request-duration buckets", _buckets(options.REQUEST_LATENCY_BUCKETS)),
    ("fsync-duration buckets", _buckets(options.FSYNC_LATENCY_BUCKETS)),
    ("`shmq.mp.Queue(maxsize=0)`", f"{_count(options.MP_CAPACITY)} (`MP_CAPACITY`)"),
    ("`shmq.mp.Queue(maxsize=0)`", f"up to {options.MAX_CAPACITY:,}"),
    ("`shmq.mp` queue's bytes", f"{_size(options.MP_MAX_BYTES)} (`MP_MAX_BYTES`)"),
    ("`shmq top --interval`", f"| {_seconds(options.TOP_INTERVAL)} (`TOP_INTERVAL`) |"),
    ("`shmq top --interval`", f"{_seconds(options.TOP_MIN_INTERVAL)} – {_seconds(options.TOP_MAX_INTERVAL)}"),
    ("`shmq top` depth history", f"| {options.TOP_HISTORY} (`TOP_HISTORY`) |"),
]


@pytest.mark.parametrize(("row", "number"), DOCUMENTED, ids=[f"{r}:{n}" for r, n in DOCUMENTED])
def test_the_doc_states_the_option(row: str, number: str) -> None:
    rows = [r for r in _rows() if row.strip("| ") in r.split("|")[1]]  # by its first cell
    assert len(rows) == 1, f"no single row of docs/operations.md names {row!r}: {rows}"
    assert number in rows[0], f"docs/operations.md says {rows[0]!r}; options.py makes it {number!r}"


def test_the_frame_limit_is_the_one_written() -> None:
    assert options.MAX_FRAME - 4096 == options.MAX_MESSAGE_SIZE  # the row writes it that way


def test_every_option_name_the_tables_use_exists() -> None:
    import re
    names = set(re.findall(r"\(`([A-Z][A-Z_]+)`\)", "\n".join(_rows())))
    assert names and {n for n in names if not hasattr(options, n)} == set()
