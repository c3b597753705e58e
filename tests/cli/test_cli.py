"""The command line's rough edges, each held down: ``--shm`` attaches and never creates, an
empty or absent DLQ is the same empty answer, ``consume --follow`` keeps going until Ctrl-C
and acknowledges only what it printed, queue names a command line would misread are
refused, long names are cut short in errors, ``--version``, ``-h`` and completion exist,
help texts match their defaults, counts have their plural.

In process (typer's CliRunner) on shared-memory instances, except where a real Ctrl-C or
the TCP broker is the point."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

import shmq
from shmq import options
from shmq.cli import messages as cli_messages
from shmq.cli.app import app
from shmq.core.colocated import ShmBroker
from shmq.text import plural, shown
from tests.support.instances import objects, unique_instance
from tests.support.server import Server
from tests.support.wait import wait_until

runner = CliRunner()


def cli(*args: str, stdin: bytes | None = None) -> Any:
    return runner.invoke(app, list(args), input=stdin, prog_name="shmq")


@pytest.fixture
def inst(shm_broker: ShmBroker) -> Iterator[tuple[str, ShmBroker]]:
    """A live instance with a queue ``q`` (max 2 deliveries), and a handle on it."""
    shm_broker.create_queue("q", max_deliveries=2)
    yield shm_broker.instance, shm_broker


# ---------------------------------------------------------------- --shm attaches only
def test_shm_with_a_name_that_is_no_instance_is_an_error_and_creates_nothing() -> None:
    name = unique_instance()
    for args in (["stats", "q"], ["create", "q"], ["list", "--json"], ["consume", "q"], ["dlq", "q"],
                 ["bench", "-n", "1"]):
        out = cli(*args, "--shm", name)
        assert out.exit_code == 1, (args, out.output)
        assert f"no shmq instance '{name}' on this host (is shmq serve running?" in out.stderr, args
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.output
    assert objects(name) == []
    with pytest.raises(shmq.InstanceNotFound):  # the library: attach only when asked
        shmq.connect(f"shm://{name}", create=False)
    assert objects(name) == []


def test_shm_attaches_a_live_instance(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    assert cli("produce", "q", "one", "--shm", name).exit_code == 0
    assert b.queue("q").get(timeout=1).payload == b"one"


# ---------------------------------------------------------------- dlq
def _dead_letter(b: ShmBroker, *payloads: bytes) -> None:
    q = b.queue("q")
    for p in payloads:
        q.put(p)
        q.get(timeout=1).dead_letter()


def test_a_dlq_never_made_and_an_empty_one_answer_alike(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    for made in (False, True):
        if made:  # a dead letter, redriven and consumed: q.dlq exists and is empty
            _dead_letter(b, b"x")
            assert cli("dlq", "q", "--redrive", "--shm", name).exit_code == 0
            b.queue("q").get(timeout=1).ack()
            assert "q.dlq" in [i.name for i in b.list_queues()]
        out = cli("dlq", "q", "--shm", name)
        assert out.exit_code == 0 and out.stdout == "" and "q.dlq is empty" in out.stderr, made
        out = cli("dlq", "q", "--json", "--shm", name)
        assert out.exit_code == 0 and json.loads(out.stdout) == [], made
        out = cli("dlq", "q", "--redrive", "--shm", name)
        assert out.exit_code == 0 and out.stdout == "redrove 0 messages (q.dlq is empty)\n", made
        out = cli("dlq", "q", "--redrive", "--json", "--shm", name)
        assert out.exit_code == 0 and json.loads(out.stdout) == {"redrove": 0}, made


def test_dlq_of_a_queue_that_does_not_exist_is_an_error(inst: tuple[str, ShmBroker]) -> None:
    name, _ = inst
    for queue in ("nope", "nope.dlq"):
        out = cli("dlq", queue, "--shm", name)
        assert out.exit_code == 1 and "QUEUE_NOT_FOUND" in out.stderr, queue


def test_dlq_lists_and_redrives_every_dead_letter(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    _dead_letter(b, b"a", b"b", b"c")
    out = cli("dlq", "q", "--json", "--shm", name)
    found = json.loads(out.stdout)
    assert [m["payload"] for m in found] == ["a", "b", "c"] and found[0]["origin"]["queue"] == "q"
    assert cli("dlq", "q", "-n", "1", "--json", "--shm", name).stdout.count("payload") == 1
    out = cli("dlq", "q", "--redrive", "--shm", name)
    assert out.exit_code == 0 and out.stdout == "redrove 3 messages\n"
    q = b.queue("q")
    got = [q.get(timeout=1) for _ in range(3)]
    assert sorted(m.payload for m in got) == [b"a", b"b", b"c"]
    q.ack_many(got)


# ---------------------------------------------------------------- consume
def test_follow_keeps_consuming_until_ctrl_c_and_exits_130(inst: tuple[str, ShmBroker]) -> None:
    """A real SIGINT to a real ``consume --follow`` (no -n): it takes more than one message,
    waits through an empty queue, and ends with 130, no traceback, everything acknowledged."""
    name, b = inst
    q = b.queue("q")
    proc = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()", "consume", "q",
                             "--follow", "--raw", "--shm", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        q.put_many([b"m1", b"m2"])
        assert proc.stdout is not None
        assert [proc.stdout.readline() for _ in range(2)] == [b"m1\n", b"m2\n"]
        wait_until(lambda: q.stats()["retained"] == 0)  # both acknowledged: the queue is empty now
        q.put(b"m3")
        assert proc.stdout.readline() == b"m3\n"
        wait_until(lambda: q.stats()["retained"] == 0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
        assert proc.stderr is not None and b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()


def test_follow_ends_when_its_reader_goes(inst: tuple[str, ShmBroker]) -> None:
    """``consume --follow | head -1``: once the reader has closed the pipe, consume notices
    while it waits (exit 141, no traceback), rather than waiting for a message to fail on."""
    name, b = inst
    b.queue("q").put(b"only")
    proc = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()", "consume", "q",
                             "--follow", "--raw", "--shm", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"only\n"
        proc.stdout.close()
        assert proc.wait(10) == 141
        assert proc.stderr is not None  # nothing but, on a slow machine, that it waited
        waited = b"waiting for messages on 'q' (group 'default'); Ctrl-C stops"
        assert set(proc.stderr.read().splitlines()) <= {waited}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr:
            proc.stderr.close()
    assert b.queue("q").stats()["retained"] == 0


def _line_within(stream: Any, seconds: float) -> bytes:
    """The next line of a child's pipe, failing the test if none is whole within ``seconds``."""
    fd, got = stream.fileno(), b""
    deadline = time.monotonic() + seconds
    while not got.endswith(b"\n"):
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"no whole line within {seconds} s: {got!r}"
        chunk = os.read(fd, 1)  # a byte at a time: what follows the line stays in the pipe
        assert chunk, f"the pipe closed: {got!r}"
        got += chunk
    return got


def test_an_idle_consume_says_it_waits_and_the_first_ctrl_c_says_what_it_consumed(
        inst: tuple[str, ShmBroker]) -> None:
    """``consume --follow`` on a queue gone quiet says so on stderr, once (stdout keeps the
    messages only); the first SIGINT ends it (exit 130), saying how many it consumed."""
    name, b = inst
    b.queue("q").put_many([b"m1", b"m2"])
    proc = subprocess.Popen([sys.executable, "-c", "from shmq.cli.app import app; app()", "consume", "q",
                             "--follow", "--raw", "--shm", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert [_line_within(proc.stdout, 30) for _ in range(2)] == [b"m1\n", b"m2\n"]
        said = _line_within(proc.stderr, 30)
        assert said == b"waiting for messages on 'q' (group 'default'); Ctrl-C stops\n"
        proc.send_signal(signal.SIGINT)  # the first one: it stops, and says what it took
        out, err = proc.communicate(timeout=10)
        assert proc.returncode == 130 and out == b"" and err == b"consumed 2 messages\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert b.queue("q").stats()["groups"]["default"]["acked"] == 2


def test_consume_waits_in_silence_for_a_second(inst: tuple[str, ShmBroker]) -> None:
    """A wait shorter than WAIT_NOTICE says nothing: ``consume`` of an empty queue with the
    default --timeout (1 s) says only that nothing came (exit 2)."""
    name, _ = inst
    out = cli("consume", "q", "--timeout", "0.5", "--shm", name)
    assert out.exit_code == 2 and out.stdout == ""
    assert out.stderr == "no message on q (group default) within 0.5 s\n"


def test_payloads_that_are_no_plain_text_show_escaped_and_say_so_once(inst: tuple[str, ShmBroker]) -> None:
    """Text shows as it is; a payload that is no UTF-8, or has control characters, shows
    escaped (the first one said on stderr); --raw writes the bytes; JSON has them exactly."""
    name, b = inst
    payloads = [b"plain \xc3\xa9\ttab", b"\x00\xffbin\\", b"two\nlines\x1b[0m"]
    b.queue("q").put_many(payloads)
    escaped = ["[0] plain \u00e9\ttab", "[1] \\x00\\xffbin\\\\", "[2] two\\nlines\\x1b[0m"]
    out = cli("peek", "q", "--shm", name)
    assert out.exit_code == 0 and out.stdout.splitlines() == escaped
    note = "payload of message 1 is not UTF-8: shown escaped; --raw writes the bytes as they are"
    assert out.stderr == note + "\n"
    out = cli("peek", "q", "--raw", "--shm", name)
    assert out.stdout_bytes == b"".join(p + b"\n" for p in payloads) and out.stderr == ""
    found = json.loads(cli("peek", "q", "--json", "--shm", name).stdout)
    assert [m["payload"] for m in found] == ["plain \u00e9\ttab", "\\x00\\xffbin\\\\", "two\nlines\x1b[0m"]
    assert [m.get("payload_base64") for m in found] == [None, "AP9iaW5c", None]
    out = cli("consume", "q", "-n", "3", "--timeout", "0", "--shm", name)
    assert out.exit_code == 0 and out.stdout.splitlines() == escaped
    assert out.stderr.splitlines() == [note]  # once, for the first
    _dead_letter(b, b"\xfe")
    out = cli("dlq", "q", "--shm", name)
    assert out.stdout.endswith(" \\xfe\n") and "is not UTF-8: shown escaped" in out.stderr
    assert cli("dlq", "q", "--raw", "--shm", name).stdout_bytes == b"\xfe\n"


def test_follow_with_n_stops_after_n(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    b.queue("q").put_many([b"1", b"2", b"3"])
    out = cli("consume", "q", "--follow", "-n", "2", "--raw", "--shm", name)
    assert out.exit_code == 0 and out.stdout == "1\n2\n"
    assert b.queue("q").stats()["retained"] == 1


def test_a_message_taken_but_not_printed_is_not_acknowledged(inst: tuple[str, ShmBroker],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (a second one: the first only asks to stop) while the second message is
    being printed: exit 130, the first acknowledged, the second given back."""
    name, b = inst
    b.queue("q").put_many([b"first", b"second"])
    shown_so_far: list[bytes] = []
    show = cli_messages._show

    def show_then_interrupt(m: Any, raw: bool, as_json: bool) -> None:
        if shown_so_far:
            raise KeyboardInterrupt
        show(m, raw, as_json)
        shown_so_far.append(bytes(m.payload))

    monkeypatch.setattr(cli_messages, "_show", show_then_interrupt)
    out = cli("consume", "q", "-n", "0", "--timeout", "0", "--raw", "--shm", name)
    assert out.exit_code == 130 and out.stdout == "first\n"
    st = b.queue("q").stats()  # (its lease is this test process's: it goes back when a CLI process exits)
    assert st["retained"] == 1 and st["groups"]["default"]["acked"] == 1
    assert st["groups"]["default"]["in_flight"] == 1


def test_a_first_ctrl_c_stops_the_loop_after_the_message_in_hand(inst: tuple[str, ShmBroker],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    name, b = inst
    b.queue("q").put_many([b"1", b"2", b"3"])
    show = cli_messages._show

    def show_and_signal(m: Any, raw: bool, as_json: bool) -> None:
        show(m, raw, as_json)
        if m.payload == b"2":
            os.kill(os.getpid(), signal.SIGINT)  # handled by the command's Stop: a request

    monkeypatch.setattr(cli_messages, "_show", show_and_signal)
    out = cli("consume", "q", "--follow", "--raw", "--shm", name)
    assert out.exit_code == 130 and out.stdout == "1\n2\n"
    st = b.queue("q").stats()
    assert st["retained"] == 1 and st["groups"]["default"]["in_flight"] == 0


# ---------------------------------------------------------------- names
@pytest.mark.parametrize("bad", ["-x", "_x", ".x", "orders.dlq"])
def test_names_a_command_line_misreads_or_a_dlq_takes_are_refused(inst: tuple[str, ShmBroker],
                                                                   bad: str) -> None:
    name, b = inst
    out = cli("create", "--shm", name, "--", bad)
    assert out.exit_code == 1 and "INVALID_NAME" in out.stderr
    assert ("dead-letter queues, made by the broker" if bad.endswith(".dlq") else "begins with a letter") \
        in out.stderr
    with pytest.raises(shmq.InvalidName):
        b.create_queue(bad)
    assert bad not in [i.name for i in b.list_queues()]


def test_the_broker_still_makes_dead_letter_queues_and_one_can_be_made_ahead(shm_broker: ShmBroker) -> None:
    q = shm_broker.create_queue("src")
    q.put(b"x")
    q.get(timeout=1).dead_letter()
    infos = {i.name: i for i in shm_broker.list_queues()}
    assert infos["src.dlq"].is_dlq and shm_broker.queue("src.dlq").get(timeout=1).payload == b"x"
    ahead = shm_broker.create_queue("other.dlq", dead_letter=True, capacity=8)
    assert ahead.config.capacity == 8 and {i.name: i for i in shm_broker.list_queues()}["other.dlq"].is_dlq
    for bad in ("plain", "other.dlq.dlq"):
        with pytest.raises(shmq.InvalidName):
            shm_broker.create_queue(bad, dead_letter=True)


def test_tcp_refuses_alike_and_passes_dead_letter(server: Server) -> None:
    with shmq.connect(server.url) as b:
        for bad in ("-x", "t.dlq"):
            with pytest.raises(shmq.InvalidName):
                b.create_queue(bad)
        b.create_queue("tcpsrc.dlq", dead_letter=True, capacity=4)
        try:
            assert [i.is_dlq for i in b.list_queues() if i.name == "tcpsrc.dlq"] == [True]
        finally:
            b.delete_queue("tcpsrc.dlq")


def test_a_long_bad_name_is_cut_short_in_the_error(inst: tuple[str, ShmBroker]) -> None:
    name, _ = inst
    out = cli("create", "y" * 300, "--shm", name)
    assert out.exit_code == 1 and "(300 chars)" in out.stderr and "y" * 41 not in out.stderr
    assert len(out.stderr) < 200
    assert shown("z" * 41) == repr("z" * 40) + "… (41 chars)" and shown("short") == "'short'"
    with pytest.raises(shmq.InvalidName, match=r"\(250 chars\)"):
        shmq.connect("shm://" + "i" * 250)


# ---------------------------------------------------------------- version, help, completion
def test_version_flag_and_command() -> None:
    for args in (["--version"], ["version"]):
        out = cli(*args)
        assert out.exit_code == 0 and out.stdout == shmq.__version__ + "\n"


def _commands() -> dict[str, Any]:
    group = typer.main.get_command(app)
    return group.commands  # type: ignore[attr-defined, no-any-return]


@pytest.mark.parametrize("command", sorted(_commands()))
def test_dash_h_is_help_on_every_command(command: str) -> None:
    short, long = cli(command, "-h"), cli(command, "--help")
    assert short.exit_code == long.exit_code == 0 and "Usage" in short.stdout
    assert short.stdout == long.stdout


def test_help_texts_say_what_each_option_is_and_its_real_default() -> None:
    for name, command in _commands().items():
        if name == "serve":  # its options are another change's
            continue
        for p in command.params:
            assert p.help, f"shmq {name} {p.name} has no help text"
            assert "(default" not in p.help, f"shmq {name} {p.name}: {p.help!r} (the default is shown)"
    params = {p.name: p for p in _commands()["peek"].params} | {
        p.name: p for p in _commands()["create"].params if p.name == "max_message_size"}
    assert params["offset"].show_default == "the oldest retained" and params["offset"].default is None
    mms = params["max_message_size"]
    assert mms.default is None and str(options.DEFAULT_MAX_MESSAGE_SIZE) in str(mms.show_default)


# typer's Python types (<str>, <bool>, <list[str]>) and braces around a required argument ({QUEUE})
TYPER_PLACEHOLDER = re.compile(r"<(?:str|int|float|bool|list)\b[^>]*>|\{[A-Z_]+\}")


@pytest.mark.parametrize("command", ["", *sorted(_commands())])
def test_help_shows_plain_placeholders(command: str) -> None:
    out = runner.invoke(app, [*command.split(), "--help"], prog_name="shmq", env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "Usage" in out.stdout
    assert not TYPER_PLACEHOLDER.findall(out.stdout), out.stdout
    if command == "produce":
        assert "Usage: shmq produce [OPTIONS] QUEUE [MESSAGE]..." in out.stdout
        assert re.search(r"--batch +INTEGER ", out.stdout) and re.search(r"--json +machine", out.stdout)
    if command == "consume":
        assert re.search(r"--timeout +SECONDS ", out.stdout) and re.search(r"-n +N ", out.stdout)


def test_shell_completion_is_there() -> None:
    # --show-completion shows the script of the shell it finds among this process's parents
    # (typer, through shellingham), and a test run may have none (started by a service or in
    # the background): typer's switch for tests names the shell instead, and is read when the
    # app is made, so a fresh process
    main = [sys.executable, "-c", "from shmq.cli.app import app; app(prog_name='shmq')"]
    shown = subprocess.run([*main, "--show-completion", "bash"], capture_output=True, timeout=60,
                           env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"})
    assert shown.returncode == 0 and b"_SHMQ_COMPLETE" in shown.stdout, shown.stderr
    env = {**os.environ, "_SHMQ_COMPLETE": "complete_bash", "COMP_WORDS": "shmq cre", "COMP_CWORD": "1"}
    done = subprocess.run(main, env=env, capture_output=True, timeout=60)
    assert done.stdout.split() == [b"create"]


# ---------------------------------------------------------------- counts
def test_counts_have_their_plural(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    assert plural(1, "worker") == "1 worker" and plural(2, "worker") == "2 workers"
    assert plural(0, "group") == "0 groups"
    out = cli("produce", "q", "only", "--shm", name)
    assert out.stdout == "produced 1 message, offset 0\n"
    out = cli("produce", "q", "--shm", name, stdin=b"a\nb\n")
    assert out.stdout == "produced 2 messages, offsets 1..2\n"
    assert cli("purge", "q", "--shm", name).stdout == "purged 3 messages from q\n"
    b.queue("q").put(b"x")
    assert cli("purge", "q", "--shm", name).stdout == "purged 1 message from q\n"


def test_a_signal_handled_during_a_shared_memory_wait_is_not_an_error(shm_broker: ShmBroker) -> None:
    """A handler that does not raise (the CLI's Ctrl-C, a SIGCHLD, ...) ends a semaphore sleep
    early: the get looks again and waits out its timeout, it does not fail."""
    q = shm_broker.create_queue("sig")
    seen: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda signum, frame: seen.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)  # every 10 ms, all through the wait
    try:
        with pytest.raises(shmq.Empty):
            q.get(timeout=0.3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert len(seen) >= 5


def test_peek_and_list_say_when_there_is_nothing(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    out = cli("peek", "q", "--shm", name)
    assert out.exit_code == 0 and out.stdout == "" and "no message retained in q" in out.stderr
    assert json.loads(cli("peek", "q", "--json", "--shm", name).stdout) == []
    b.queue("q").put_many([b"a", b"b"])
    assert [m["payload"] for m in json.loads(cli("peek", "q", "--json", "--shm", name).stdout)] == ["a", "b"]
    b.delete_queue("q")
    out = cli("list", "--shm", name)
    assert out.exit_code == 0 and out.stdout == "" and "no queues" in out.stderr
    assert json.loads(cli("list", "--json", "--shm", name).stdout) == []


def test_the_start_line_counts_workers_in_words() -> None:
    srv = Server(workers=1)
    try:
        assert srv.start_line.count(" with 1 worker;") == 1
    finally:
        assert srv.stop() == 0


def test_produce_delay_holds_the_message_back(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    out = cli("produce", "q", "later", "--delay", "3600", "--shm", name)
    assert out.exit_code == 0 and out.stdout == "produced 1 message, offset 0\n", out.output
    q = b.queue("q")
    assert q.stats()["groups"]["default"]["delayed"] == 1
    with pytest.raises(shmq.Empty):
        q.get(block=False)  # stored, and not delivered before it is due
    assert [m.payload for m in q.read(0, 1)] == [b"later"]
    bad = cli("produce", "q", "x", "--delay", "-1", "--shm", name)
    assert bad.exit_code == 1 and q.stats()["next_offset"] == 1  # refused, nothing stored


def test_create_says_what_it_did_and_takes_exist_ok_and_replication(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    out = cli("create", "pay", "--replication", "sync", "--shm", name)  # (kept for a journaled queue)
    assert (out.exit_code, out.stdout) == (0, "created pay\n"), out.output
    assert b.queue("pay").config.replication == "sync"
    out = cli("create", "pay", "--shm", name)
    assert out.exit_code == 1 and "exists" in out.output and "QUEUE_EXISTS" in out.output
    out = cli("create", "pay", "--exist-ok", "--capacity", "7", "--shm", name)  # left as it is
    assert (out.exit_code, out.stdout) == (0, "pay exists already\n"), out.output
    assert b.queue("pay").config.capacity == options.DEFAULT_CAPACITY
    out = cli("create", "other", "--replication", "often", "--shm", name)
    assert out.exit_code == 1 and "replication must be one of async, sync" in out.output


def test_produce_splits_a_batch_bigger_than_a_small_queue(shm_broker: ShmBroker) -> None:
    """``seq 12 | shmq produce small`` (batches of 100 by default) into a queue of 8: the
    batch can never fit, so it goes in halves (6, then 6 waits for room), in order."""
    q = shm_broker.create_queue("small", capacity=8)
    args = [sys.executable, "-c", "from shmq.cli.app import app; app()", "produce", "small", "--timeout", "1",
            "--shm", shm_broker.instance]
    out = subprocess.run(args, input=b"".join(b"%d\n" % i for i in range(12)), capture_output=True,
                         timeout=60)
    assert out.returncode == 1 and out.stdout == b"", out.stderr
    assert out.stderr.decode().splitlines()[-2:] == [
        "produced 6 messages before the error",
        "error: queue 'small' stayed full for --timeout 1 s (QUEUE_FULL)"]
    assert [bytes(m.payload) for m in q.read(0, 20)] == [b"%d" % i for i in range(6)]


def test_produce_into_a_full_queue_says_so_honours_timeout_and_stops_at_the_first_ctrl_c(
        shm_broker: ShmBroker) -> None:
    """``seq 30 | shmq produce big`` into a queue of 10: it says the queue is full within a
    second, gives up at --timeout with what it produced, and without one stops at the first
    SIGINT, saying what went in (exit 130)."""
    name = shm_broker.instance
    q = shm_broker.create_queue("big", capacity=10)
    lines = b"".join(b"%d\n" % i for i in range(30))
    args = [sys.executable, "-c", "from shmq.cli.app import app; app()", "produce", "big", "--batch", "5",
            "--shm", name]
    out = subprocess.run([*args, "--timeout", "1.5"], input=lines, capture_output=True, timeout=60)
    assert out.returncode == 1 and out.stdout == b""
    assert out.stderr.decode().splitlines() == [
        "queue 'big' is full (10 of 10 messages): waiting for room; Ctrl-C stops",
        "produced 10 messages before the error",
        "error: queue 'big' stayed full for --timeout 1.5 s (QUEUE_FULL)"]
    assert [bytes(m.payload) for m in q.read(0, 20)] == [b"%d" % i for i in range(10)]  # nothing else
    q.purge()
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stderr is not None
        proc.stdin.write(lines)
        proc.stdin.flush()
        said = proc.stderr.readline()
        assert said == b"queue 'big' is full (10 of 10 messages): waiting for room; Ctrl-C stops\n"
        proc.send_signal(signal.SIGINT)  # the first one: it stops now, and says what went in
        out_, err = proc.communicate(timeout=5)
        assert proc.returncode == 130 and err == b""
        assert out_ == b"produced 10 messages, offsets 10..19\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_create_priorities_and_produce_priority(inst: tuple[str, ShmBroker]) -> None:
    name, b = inst
    assert cli("create", "jobs", "--priorities", "3", "--shm", name).exit_code == 0
    assert b.queue("jobs").config.priorities == 3
    assert cli("produce", "jobs", "low", "--shm", name).exit_code == 0
    out = cli("produce", "jobs", "high", "--priority", "2", "--shm", name)
    assert out.exit_code == 0 and out.stdout == f"produced 1 message, offset {2 << 56}\n", out.output
    bad = cli("produce", "jobs", "x", "--priority", "3", "--shm", name)
    assert bad.exit_code == 1 and "priority must be an int in 0..2" in bad.output  # refused, nothing stored
    q = b.queue("jobs")
    got = [q.get(False) for _ in range(2)]
    assert [(m.text, m.priority) for m in got] == [("high", 2), ("low", 0)]
    q.ack_many(got)
    assert q.stats()["produced"] == 2
