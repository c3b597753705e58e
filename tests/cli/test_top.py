"""``shmq top``: its pure parts without a terminal, then the real thing in a tmux pane.

The pane tests run ``shmq top`` in a detached tmux session of a fixed size, on a tmux
server of their own (``tmux -S``), against a real broker, and read the screen the way a
person would (``capture-pane``), polling it with a deadline.  A shell in the pane runs
``shmq top`` and writes its exit status when it ends, and the pane stays on screen
(``remain-on-exit``), so what ``shmq top`` left there can be read afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import psutil
import pytest
from rich.console import Console

import shmq
from shmq import options
from shmq.api import BrokerInfo
from shmq.cli.top import (
    ESC,
    Keys,
    Row,
    Tracker,
    View,
    duration,
    header,
    keys_of,
    rate,
    run,
    screen,
    sparkline,
)
from shmq.errors import InvalidArgument
from tests.support.instances import unique_instance
from tests.support.server import Server
from tests.support.wait import wait_until

CLI = [sys.executable, "-c", "from shmq.cli.app import app; app()"]


# ---------------------------------------------------------------- figures
def test_rate_is_the_counter_delta_per_second() -> None:
    assert rate(10, 30, 2.0) == 10.0
    assert rate(5, 5, 1.0) == 0.0
    assert rate(None, 30, 1.0) is None  # no earlier reading
    assert rate(30, 10, 1.0) is None  # the counter went back: the queue was made again
    assert rate(1, 2, 0.0) is None


def test_sparkline_scales_to_the_largest_reading() -> None:
    assert sparkline([1, 2, 4, 8], width=4) == "▂▃▅█"
    assert sparkline([0, 0, 0], width=3) == "▁▁▁"
    assert sparkline([0, 1000, 1], width=3) == "▁█▂"  # anything above zero shows above the floor
    assert sparkline([5], width=3) == "  █"  # right-aligned: the newest is always at the end
    assert sparkline([100, 1, 2, 3, 4], width=4) == "▃▅▆█"  # the last four only, scaled to theirs
    assert sparkline([3, 4], width=0) == ""


def _stats(name: str, produced: int, groups: dict[str, tuple[int, int, int, int]], *, dlq: bool = False,
           retained: int = 0, durability: str = "memory") -> dict[str, Any]:
    """A ``stats()`` dict as the queue makes it; groups: name -> (depth, in_flight, acked, floor)."""
    return {"name": name, "is_dlq": dlq, "produced": produced, "next_offset": produced,
            "retained": retained, "config": {"durability": durability},
            "groups": {g: {"depth": d, "in_flight": f, "acked": a, "floor": fl}
                       for g, (d, f, a, fl) in groups.items()}}


def test_rows_from_two_readings() -> None:
    t = Tracker(history=3)
    first = t.rows([_stats("orders", 100, {"default": (40, 5, 10, 60), "audit": (90, 0, 0, 10)})], now=10.0)
    assert first == [Row("orders", None, None, 90, (90,), 5, (("default", 40), ("audit", 90)), None,
                         "memory")]
    second = t.rows([_stats("orders", 150, {"default": (20, 3, 30, 130), "audit": (100, 0, 10, 50)},
                            durability="always")], now=12.0)
    (r,) = second
    assert r.rate_in == 25.0  # 50 produced in 2 s
    assert r.rate_out == 15.0  # 20 + 10 acks in 2 s, both groups
    assert (r.depth, r.history, r.in_flight) == (100, (90, 100), 3)
    assert r.lags == (("default", 20), ("audit", 100)) and r.lag == 100
    assert r.durability == "always"
    for depth in (7, 8, 9):
        (r,) = t.rows([_stats("orders", 150, {"default": (depth, 0, 30, 143)})], now=13.0)
    assert r.history == (7, 8, 9)  # at most ``history`` readings


def test_a_new_group_counts_from_its_second_reading() -> None:
    t = Tracker()
    t.rows([_stats("q", 10, {"default": (0, 0, 10, 10)})], now=0.0)
    (r,) = t.rows([_stats("q", 20, {"default": (0, 0, 20, 20), "late": (0, 0, 500, 20)})], now=1.0)
    assert r.rate_out == 10.0  # the new group's 500 acks are not this second's


def test_a_dlq_is_folded_into_its_source_row_unless_the_source_is_gone() -> None:
    t = Tracker()
    rows = t.rows([_stats("orders", 5, {"default": (5, 0, 0, 0)}),
                   _stats("orders.dlq", 4, {"default": (4, 0, 0, 0)}, dlq=True, retained=4),
                   _stats("lost.dlq", 2, {"default": (2, 0, 0, 0)}, dlq=True, retained=2),
                   _stats("plain", 0, {"default": (0, 0, 0, 0)})], now=0.0)
    by_name = {r.name: r for r in rows}
    assert set(by_name) == {"orders", "lost.dlq", "plain"}
    assert by_name["orders"].dlq == 4
    assert by_name["plain"].dlq is None  # it has no DLQ
    assert by_name["lost.dlq"].depth == 2


def test_a_queue_gone_from_a_reading_is_forgotten() -> None:
    t = Tracker()
    b = _stats("b", 0, {"default": (0, 0, 0, 0)})
    t.rows([_stats("a", 10, {"default": (1, 0, 0, 9)}), b], now=0.0)
    assert [r.name for r in t.rows([b], now=1.0)] == ["b"]
    (a, _) = t.rows([_stats("a", 500, {"default": (1, 0, 0, 499)}), b], now=2.0)
    assert a.rate_in is None and a.history == (1,)  # made again: nothing carried over


def test_a_queue_made_again_between_readings_has_no_rate() -> None:
    t = Tracker()
    t.rows([_stats("a", 1000, {"default": (0, 0, 1000, 1000)})], now=0.0)
    (a,) = t.rows([_stats("a", 3, {"default": (0, 0, 3, 3)})], now=1.0)
    assert a.rate_in is None and a.rate_out is None


# ---------------------------------------------------------------- the view and its keys
def _row(name: str, depth: int, rate_in: float | None = None, dlq: int | None = None) -> Row:
    return Row(name, rate_in, None, depth, (depth,), 0, (("default", depth),), dlq, "memory")


ROWS = [_row("bb", 9, 1.0), _row("aa", 3, None, dlq=2), _row("cc", 5, 7.0)]


def test_sort_keys_pick_a_column_and_again_reverse_it() -> None:
    v = View()
    assert [r.name for r in v.shown(ROWS)] == ["aa", "bb", "cc"]
    assert not v.key("4")
    assert (v.sort, v.descending) == ("depth", True)
    assert [r.name for r in v.shown(ROWS)] == ["bb", "cc", "aa"]
    v.key("4")
    assert [r.name for r in v.shown(ROWS)] == ["aa", "cc", "bb"]
    v.key("2")  # in/s, biggest first; no rate counts as 0
    assert [r.name for r in v.shown(ROWS)] == ["cc", "bb", "aa"]
    v.key("7")  # dlq: a queue without one sorts below an empty one
    assert [r.name for r in v.shown(ROWS)][0] == "aa"
    v.key("1")
    assert (v.sort, v.descending) == ("queue", False)
    for k in ("9", "0", "²", "x"):  # no such column: nothing happens
        v.key(k)
    assert (v.sort, v.descending) == ("queue", False)


def test_the_filter_is_typed_applied_and_cleared() -> None:
    v = View(sort="depth", filter="")
    for k in "/bx\x7fB":
        assert not v.key(k)
    assert v.draft == "bB" and v.filter == ""  # not applied while typing
    assert not v.key("q")  # a q typed into the filter does not quit
    v.key("\x7f")
    v.key("\r")
    assert (v.draft, v.filter) == (None, "bB")
    assert [r.name for r in v.shown(ROWS)] == ["bb"]  # in any case
    v.key("/")
    v.key("z")
    v.key(ESC)  # Esc while typing: no filter at all
    assert (v.draft, v.filter) == (None, "")
    v.filter = "a"
    v.key(ESC)  # Esc outside the footer clears it too
    assert v.filter == "" and len(v.shown(ROWS)) == 3
    assert v.key("q")


def test_an_unknown_sort_column_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="--sort must be one of queue, in, out"):
        View(sort="size")


def test_keys_of_a_terminal_drop_escape_sequences() -> None:
    assert keys_of("q") == ["q"]
    assert keys_of(ESC) == [ESC]
    assert keys_of("\x1b[A4") == ["4"]  # an arrow key, then 4
    assert keys_of("a\x1bOPb\x1b[15~c") == ["a", "b", "c"]  # F1, F5
    assert keys_of("/ab\r") == ["/", "a", "b", "\r"]


def test_keys_put_a_terminal_in_cbreak_mode_and_restore_it() -> None:
    master, slave = os.openpty()
    with os.fdopen(slave, "r") as tty_in:
        before = termios.tcgetattr(slave)
        assert before[3] & termios.ICANON and before[3] & termios.ECHO
        with Keys(tty_in) as keys:
            now = termios.tcgetattr(slave)
            assert not now[3] & termios.ICANON and not now[3] & termios.ECHO
            assert now[3] & termios.ISIG  # Ctrl-C still interrupts
            assert keys.read(0) == []
            os.write(master, b"4\x1b[Aq")
            assert keys.read(5) == ["4", "q"]
        assert termios.tcgetattr(slave) == before
    os.close(master)


def test_keys_of_no_terminal_only_wait() -> None:
    r, w = os.pipe()
    with os.fdopen(r) as pipe_in, Keys(pipe_in) as keys:
        os.write(w, b"q")
        assert keys.fd is None and keys.read(0) == []
    os.close(w)


# ---------------------------------------------------------------- drawing
TCP_INFO = BrokerInfo("0.1.0", "inst", 4242, 3725.0, [1, 2], 2, [3, 1], 0)
SHM_INFO = BrokerInfo("0.1.0", "inst", None, None, [7])


def _text(renderable: Any, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(renderable)
    console.file.close()
    return console.export_text()


def test_duration() -> None:
    assert [duration(s) for s in (0, 59, 61, 3661, 90061)] == ["0s", "59s", "1m 01s", "1h 01m", "1d 01h"]


def test_the_header_says_what_is_known() -> None:
    tcp = header(TCP_INFO, "tcp://h:1")
    assert "broker pid 4242, up 1h 02m" in tcp and "workers 2  connections 4 (3 + 1)" in tcp
    shm = header(SHM_INFO, "shm://inst")
    assert "owner: gone" in shm and "workers –  connections – (shm://: no worker pool)" in shm
    assert "registered processes 1" in shm and "replies dropped" not in shm
    dropped = header(replace(SHM_INFO, replies_dropped={"late": 2, "gone": 0, "full": 1}), "shm://inst")
    assert "replies dropped late 2, gone 0, full 1" in dropped
    repl = header(replace(TCP_INFO, replication={"role": "primary", "epoch": 3, "standbys": [
        {"node": "b:7878", "lag_records": 12, "lag_bytes": 300, "lag_seconds": 0.25}]}), "tcp://h:1")
    assert "primary, epoch 3, 1 standby (b:7878: lag 12 messages, 300 bytes, 0.25 s)" in repl
    standby = header(replace(TCP_INFO, replication={"role": "standby", "epoch": 3, "primary": "tcp://a:1",
                                                    "connected": True, "caught_up": True}), "tcp://h:1")
    assert "standby of tcp://a:1, epoch 3, caught up" in standby
    assert "epoch" not in tcp


def test_a_frame_has_the_header_the_rows_the_sort_and_the_footer() -> None:
    v = View(sort="depth")
    text = _text(screen(ROWS, TCP_INFO, v, "tcp://h:1", 1.0))
    assert "workers 2" in text and "3 queues (3 shown)" in text and "sort: depth descending" in text
    assert "4 depth ↓" in text and "q quit" in text
    lines = [ln for ln in text.splitlines() if ln.startswith((" aa", " bb", " cc"))]
    assert [ln.split()[0] for ln in lines] == ["bb", "cc", "aa"]
    cells = [c.strip() for c in lines[2].split("│")]
    assert cells[:3] == ["aa", "–", "–"] and cells[3] == f"3 {sparkline([3])}".strip()
    assert cells[5:] == ["default:3", "2", "memory"]
    v.key("/")
    v.key("c")
    assert "filter: c▏" in _text(screen(ROWS, TCP_INFO, v, "tcp://h:1", 1.0))
    assert "q quit" not in _text(screen(ROWS, TCP_INFO, View(), "tcp://h:1", 1.0, keys=False))


def test_bad_intervals_are_refused_before_anything_is_read() -> None:
    for bad in (0.0, options.TOP_MIN_INTERVAL / 2, options.TOP_MAX_INTERVAL + 1):
        with pytest.raises(InvalidArgument, match="--interval must be between"):
            run(None, "x", interval=bad)  # type: ignore[arg-type]  # the broker is never touched


# ---------------------------------------------------------------- in a terminal
class Pane:
    """``cmd`` in a detached tmux session of ``width`` x ``height``, on a tmux server of
    its own.  A shell runs it and then writes its exit status on the screen (tmux's own
    ``pane_dead_status`` is not always filled in: tmux 3.3 sometimes leaves an exited
    pane's process unreaped), and the pane stays on screen afterwards (remain-on-exit)."""

    def __init__(self, cmd: list[str], width: int = 160, height: int = 40, stderr: str = "") -> None:
        self.socket = os.path.join(tempfile.gettempdir(), f"shmq-top-{unique_instance()}.tmux")
        # COLUMNS / LINES from the test's environment would override the pane's size;
        # the shell catches SIGINT (so Ctrl-C reaches the command, and the shell still
        # reports); its first line feed after the screen the command leaves is lost in tmux
        line = ("trap true INT; env -u COLUMNS -u LINES " + " ".join(map(shlex.quote, cmd))
                + (f" 2>{shlex.quote(stderr)}" if stderr else "") + '; s=$?; echo; echo "[exit $s]"')
        self._tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height), line,
                   ";", "set-option", "-t", "top", "remain-on-exit", "on")
        shell = psutil.Process(int(self._tmux("display-message", "-p", "-t", "top", "#{pane_pid}")))
        wait_until(lambda: bool(shell.children()))
        self.command = shell.children()[0]  # the command, forked by the shell

    def _tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, "-f", "/dev/null", *args], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()

    def text(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "top")

    def wait_for(self, pred: Callable[[str], bool], timeout: float = 15.0) -> str:
        """The screen once ``pred`` holds for it (polled until ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if pred(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never matched; it shows:\n{text}")
            time.sleep(0.05)  # a poll interval, not a synchronisation: the deadline decides

    def keys(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "top", *keys)

    def exit_status(self, timeout: float = 10.0) -> int:
        """Wait for the command to end; its exit status (the shell reaped it first)."""
        m = re.search(r"^\[exit (\d+)\]$", self.wait_for(lambda t: "[exit " in t, timeout), re.M)
        assert m is not None
        return int(m.group(1))

    def close(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket)  # tmux leaves it behind


@pytest.fixture
def pane_of() -> Iterator[Callable[..., Pane]]:
    panes: list[Pane] = []

    def make(cmd: list[str], **kwargs: Any) -> Pane:
        panes.append(Pane(cmd, **kwargs))
        return panes[-1]

    yield make
    for p in panes:
        p.close()


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = Server(workers=2)
    yield s
    assert s.stop() == 0


def _top(srv: Server, *extra: str) -> list[str]:
    return [*CLI, "top", "--url", srv.url, "--interval", "0.5", *extra]


def _row_cells(screen_text: str, name: str) -> list[str] | None:
    """The cells of ``name``'s row on the screen, None when it has none."""
    for line in screen_text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) == 8 and cells[0] == name:
            return cells
    return None


def _names(screen_text: str, names: set[str]) -> list[str]:
    """The rows of ``names`` on the screen, top to bottom."""
    return [c[0] for line in screen_text.splitlines()
            if (c := [x.strip() for x in line.split("│")])[0] in names and len(c) == 8]


def _float(cell: str) -> float:
    return 0.0 if cell == "–" else float(cell.replace(",", ""))


def test_top_shows_a_busy_broker_and_quits_on_q(srv: Server, pane_of: Callable[..., Pane]) -> None:
    tag = unique_instance()
    busy, still = f"busy-{tag}", f"still-{tag}"
    admin = shmq.connect(srv.url)
    admin.create_queue(busy).create_group("audit")  # nobody reads for audit: its lag grows
    admin.create_queue(still).put_many([b"m"] * 7)
    stop = threading.Event()

    def produce() -> None:
        with shmq.connect(srv.url) as b:
            q = b.queue(busy)
            while not stop.wait(0.01):  # a steady trickle, about 100 messages a second
                q.put(b"x")

    def consume() -> None:
        with shmq.connect(srv.url) as b:
            q = b.queue(busy)
            while not stop.is_set():
                try:
                    q.get(timeout=0.1).ack()
                except shmq.Empty:
                    pass

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    try:
        pane = pane_of(_top(srv))

        def ready(text: str) -> bool:
            b, s = _row_cells(text, busy), _row_cells(text, still)
            return bool(b and s and _float(b[1]) > 0 and _float(b[2]) > 0
                        and re.search(r"workers 2  connections 4 \(", text))  # admin, 2 threads, top

        text = pane.wait_for(ready)
        b, s = _row_cells(text, busy), _row_cells(text, still)
        assert b is not None and s is not None
        assert re.fullmatch(r"default:\d+ audit:\d+", b[5])
        assert int(b[5].split("audit:")[1].replace(",", "")) > 0  # nobody acks for audit
        assert s[3].split()[0] == "7" and s[3].split()[1][-1] == "█"  # depth, and its sparkline
        assert s[5] == "default:7" and s[6] == "–" and s[7] == "memory"
        assert s[1] == "0.0" and s[2] == "0.0"
        assert f"broker pid {srv.proc.pid}" in text and "q quit" in text
        pane.keys("q")
        assert pane.exit_status() == 0
        after = pane.text()
        assert "1 queue" not in after  # the dashboard's screen is gone: the terminal is back
        assert not pane.command.is_running()
    finally:
        stop.set()
        for t in threads:
            t.join()
        admin.delete_queue(busy)
        admin.delete_queue(still)
        admin.close()


def test_top_sorts_and_filters_by_keys(srv: Server, pane_of: Callable[..., Pane]) -> None:
    tag = unique_instance()
    depths = {f"aa-{tag}": 3, f"bb-{tag}": 9, f"cc-{tag}": 5}
    names = set(depths)
    with shmq.connect(srv.url) as admin:
        for name, depth in depths.items():
            admin.create_queue(name).put_many([b"m"] * depth)
        try:
            pane = pane_of(_top(srv, "--filter", tag))
            pane.wait_for(lambda t: _names(t, names) == [f"aa-{tag}", f"bb-{tag}", f"cc-{tag}"])
            pane.keys("4")  # depth, deepest first
            text = pane.wait_for(lambda t: _names(t, names) == [f"bb-{tag}", f"cc-{tag}", f"aa-{tag}"])
            assert "sort: depth descending" in text and "4 depth ↓" in text
            pane.keys("4")  # again: the other way
            pane.wait_for(lambda t: _names(t, names) == [f"aa-{tag}", f"cc-{tag}", f"bb-{tag}"]
                          and "4 depth ↑" in t)
            pane.keys("/", "b", "b")
            pane.wait_for(lambda t: "filter: bb▏" in t and len(_names(t, names)) == 3)  # typed, not applied
            pane.keys("Enter")
            pane.wait_for(lambda t: _names(t, names) == [f"bb-{tag}"] and "filter: bb" in t)
            pane.keys("/", "x", "Escape")  # Esc: no filter at all (not even the one from --filter)
            text = pane.wait_for(lambda t: len(_names(t, names)) == 3 and "filter:" not in t)
            admin.delete_queue(f"cc-{tag}")  # a queue deleted while watching goes from the table
            pane.wait_for(lambda t: _names(t, names) == [f"aa-{tag}", f"bb-{tag}"])
            pane.keys("C-c")  # Ctrl-C leaves as q does
            assert pane.exit_status() == 0
        finally:
            for name in names - {f"cc-{tag}"}:
                admin.delete_queue(name)


def test_a_broker_that_goes_away_ends_top_with_one_line(pane_of: Callable[..., Pane], tmp_path: Any) -> None:
    # the error is what the terminal shows, read from a file: in tmux, a line written just
    # after a program leaves the alternate screen is sometimes lost from the pane's grid
    errors = tmp_path / "stderr"
    own = Server(workers=1)
    try:
        pane = pane_of(_top(own), stderr=str(errors))
        pane.wait_for(lambda t: "workers 1" in t)
        assert own.stop() == 0
        assert pane.exit_status() == 1
        assert "1 queue" not in pane.text()  # the dashboard's screen is gone
        lines = errors.read_text().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "lost" in lines[0], lines
    finally:
        own.stop()


def test_once_prints_one_frame_over_tcp_and_over_shm(srv: Server) -> None:
    name = f"once-{unique_instance()}"
    with shmq.connect(srv.url) as admin:
        admin.create_queue(name).put_many([b"m"] * 4)
        try:
            for where in (["--url", srv.url], ["--shm", srv.instance]):
                out = subprocess.run([*CLI, "top", *where, "--once", "--interval", "0.2"],
                                     capture_output=True, text=True, timeout=60)
                assert out.returncode == 0, out.stderr
                cells = _row_cells(out.stdout, name)
                assert cells is not None and cells[3].startswith("4 ") and cells[5] == "default:4", out.stdout
                assert "q quit" not in out.stdout  # no keys without a terminal
                if "--shm" in where:
                    assert "no worker pool" in out.stdout and f"owner pid {srv.proc.pid}" in out.stdout
                else:
                    assert "workers 2" in out.stdout and f"broker pid {srv.proc.pid}" in out.stdout
        finally:
            admin.delete_queue(name)


def test_sigterm_leaves_as_q_does_and_restores_the_terminal(instance: str) -> None:
    b = shmq.connect(f"shm://{instance}")
    b.create_queue("watched")
    master, slave = os.openpty()
    before = termios.tcgetattr(slave)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([*CLI, "top", "--shm", instance, "--interval", "0.2"], stdin=slave, stdout=slave,
                            stderr=slave, env=env)
    try:
        seen = b""
        deadline = time.monotonic() + 20
        while b"watched" not in seen:
            assert time.monotonic() < deadline and proc.poll() is None, seen[-500:]
            if select.select([master], [], [], 0.1)[0]:
                seen += os.read(master, 65536)
        assert not termios.tcgetattr(slave)[3] & termios.ICANON  # cbreak while it runs
        proc.terminate()
        assert proc.wait(10) == 0
        assert termios.tcgetattr(slave) == before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)
        b.close()


@pytest.mark.parametrize(("args", "says"), [(["--sort", "size"], "--sort must be one of"),
                                            (["--interval", "0"], "--interval must be between")])
def test_bad_options_are_one_line_and_exit_1(srv: Server, args: list[str], says: str) -> None:
    out = subprocess.run([*CLI, "top", "--url", srv.url, "--once", *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
