"""Progress of long jobs where stderr is no terminal: a line every PROGRESS_INTERVAL (driven
here by a fake clock, or an interval of 0), for a big produce, a redrive and the journal
recovery at broker start; nothing for a short job."""

from __future__ import annotations

import io
import logging
import re
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shmq import options
from shmq.api import QueueConfig
from shmq.cli.app import app
from shmq.core.colocated import ShmBroker
from shmq.core.serverqueue import ServerBroker
from shmq.journal import Journal
from shmq.progress import Progress
from shmq.server.journaler import recover
from shmq.text import amount
from tests.support.clock import FakeClock


def test_a_line_every_interval_and_none_before(clock: FakeClock) -> None:
    lines: list[str] = []
    with Progress("produced", emit=lines.append, terminal=False, interval=2.0, clock=clock) as p:
        for _ in range(10):
            p.advance(100)
            clock.advance(0.1)
        assert lines == []  # 1 s so far
        clock.advance(1.0)
        p.advance(1000)  # 2000 messages at t = 2 s
        assert lines == ["produced 2000 messages (1000/s)"]
        clock.advance(1.9)
        p.advance(100)
        assert len(lines) == 1  # the next one is due 2 s after the last
        clock.advance(0.1)
        p.advance(0)
        assert lines[1] == "produced 2100 messages (525/s)"


def test_a_known_total_and_bytes(clock: FakeClock) -> None:
    lines: list[str] = []
    p = Progress("redrove", total=400, emit=lines.append, terminal=False, interval=1, clock=clock)
    clock.advance(1)
    p.advance(100)
    assert lines == ["redrove 100 of 400 messages (25%, 100/s)"]
    b = Progress("journal recovery: read", "bytes", 3 << 30, emit=lines.append, terminal=False,
                 interval=1, clock=clock)
    clock.advance(2)
    b.advance(3 << 29)
    assert lines[-1] == "journal recovery: read 1.5 GiB of 3 GiB (50%, 768 MiB/s)"
    assert amount(1023, "bytes") == "1023 bytes" and amount(1536, "bytes") == "1.5 KiB"


def test_disabled_progress_counts_and_shows_nothing(clock: FakeClock) -> None:
    lines: list[str] = []
    p = Progress("produced", emit=lines.append, terminal=False, interval=0, clock=clock, enabled=False)
    clock.advance(100)
    p.advance(5)
    assert p.count == 5 and lines == []


@pytest.fixture
def every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A progress line at every step, and stderr no terminal (as under a pipe or a log)."""
    monkeypatch.setattr(options, "PROGRESS_INTERVAL", 0.0)
    monkeypatch.setattr(sys, "stderr", io.StringIO())


def test_a_big_produce_reports_its_progress_on_stderr(shm_broker: ShmBroker, every_step: None) -> None:
    shm_broker.create_queue("big", capacity=5000, max_bytes=1 << 20)
    data = b"".join(b"%d\n" % i for i in range(2500))
    out = CliRunner().invoke(app, ["produce", "big", "--batch", "1000", "--shm", shm_broker.instance],
                             input=data)
    assert out.exit_code == 0 and out.stdout == "produced 2500 messages, offsets 0..2499\n"
    steps = re.findall(r"^produced (\d+) messages \(\d+/s\)$", out.stderr, re.M)
    assert steps == ["1000", "2000", "2500"]


def test_a_redrive_reports_its_progress(shm_broker: ShmBroker, every_step: None) -> None:
    q = shm_broker.create_queue("src")
    q.put_many([b"a", b"b", b"c"])
    for m in q.get_many(3, timeout=1):
        m.dead_letter()
    out = CliRunner().invoke(app, ["dlq", "src", "--redrive", "--shm", shm_broker.instance])
    assert out.exit_code == 0 and out.stdout == "redrove 3 messages\n"
    assert re.findall(r"^redrove (\d) of 3 messages \(\d+%", out.stderr, re.M) == ["1", "2", "3"]


def test_journal_recovery_reports_its_progress_and_counts_in_words(
        instance: str, tmp_path: Path, every_step: None, caplog: pytest.LogCaptureFixture) -> None:
    sizes = {}
    for name, n in (("one", 1), ("two", 2)):
        j = Journal(tmp_path, name)
        j.write_meta({"name": name, "is_dlq": False, "config": asdict(QueueConfig(durability="always")),
                      "created_ns": 1})
        j.recover()
        j.append_messages([(i, 0, b"x" * 100) for i in range(n)])
        j.sync()
        j.close()
        sizes[name] = sum(f.stat().st_size for f in (tmp_path / f"q-{name}").glob("*.log"))
    broker = ServerBroker(instance)
    try:
        with caplog.at_level(logging.INFO, logger="shmq.journal"):
            report = recover(broker, tmp_path)
        assert report[0].startswith("one: rebuilt from the journal: offsets 0..0, 1 message retained, "
                                    "0 groups")
        assert "2 messages retained" in report[1]
        one, total = amount(sizes["one"], "bytes"), amount(sizes["one"] + sizes["two"], "bytes")
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("journal recovery")]
        pct = 100 * sizes["one"] // (sizes["one"] + sizes["two"])
        assert [line.rpartition(", ")[0] for line in lines] == [
            f"journal recovery: read {one} of {total} ({pct}%",
            f"journal recovery: read {total} of {total} (100%"]
    finally:
        broker.destroy()
