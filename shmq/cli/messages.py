"""The CLI's commands on messages: ``produce``, ``consume``, ``peek``, ``dlq``
(registered on the app in ``shmq.cli.app``).

A consumer prints each message and flushes it before acknowledging it, so what was
acknowledged was written out; the loops stop on Ctrl-C between messages (``Stop``),
and a long produce or redrive shows its progress (``shmq.progress``).
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from typing import TYPE_CHECKING, Any

import typer

from shmq import options
from shmq.cli.session import (
    BROKEN_PIPE,
    INTERRUPTED,
    SLICE,
    JsonOpt,
    QueueArg,
    ShmOpt,
    Stop,
    TokenFileOpt,
    TokenOpt,
    UrlOpt,
    Waiting,
    fail,
    note,
    session,
)
from shmq.errors import Full, InvalidArgument, ShmqError
from shmq.text import as_line, plural

if TYPE_CHECKING:
    from shmq.api import Broker, Message, Queue


def produce(
    queue: str = QueueArg,
    message: list[str] | None = typer.Argument(None, help="messages; none: one per line of --file, "
                                               "or of stdin"),
    file: str | None = typer.Option(None, "--file", "-f", help="read one message per line from this file"),
    batch: int = typer.Option(100, help=f"messages per request (1-{options.MAX_BATCH})"),
    header: list[str] | None = typer.Option(None, "--header", "-H", metavar="KEY=VALUE",
                                            help="a header of every message (repeat for more)"),
    delay: float | None = typer.Option(None, "--delay", metavar="SECONDS",
                                       help="deliver each message this many seconds from now"),
    ttl: float | None = typer.Option(None, "--ttl", metavar="SECONDS",
                                     help="each message expires for a group that has not had it this many "
                                     "seconds from now (the queue's --message-ttl, if shorter, counts)"),
    priority: int = typer.Option(0, "--priority", metavar="P",
                                 help="each message's priority, in a queue made with --priorities N: "
                                 "0 (the lowest) .. N-1, the highest delivered first"),
    timeout: float | None = typer.Option(None, "--timeout", metavar="SECONDS",
                                         help="the longest a batch waits for room in a full queue; then "
                                         "the error Full (exit 1)", show_default="wait"),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt, as_json: bool = JsonOpt,
) -> None:
    """Produce messages: arguments, or one per line of stdin / a file.

    A long run shows its progress on stderr, and a full queue says so within a second (it
    waits for room, up to --timeout); Ctrl-C stops at once, and says what was produced
    (exit 130).

    Example: seq 1000 | shmq produce orders --header source=seq
    """
    from shmq.api import delay_ms, ttl_ms
    from shmq.cli.lines import stream_batches
    from shmq.headers import encode
    from shmq.progress import Progress

    if not 1 <= batch <= options.MAX_BATCH:
        fail(InvalidArgument(f"--batch must be 1..{options.MAX_BATCH}"))
    if timeout is not None and not 0 <= timeout < float("inf"):
        fail(InvalidArgument("--timeout must be a number of seconds >= 0"))
    hdrs = dict(h.partition("=")[::2] for h in header or ())
    if any("=" not in h for h in header or ()):
        fail(InvalidArgument("--header takes KEY=VALUE"))
    try:
        encode(hdrs)  # checked before anything is sent
        ttl_ms(ttl, delay_ms(delay))
    except ShmqError as e:
        fail(e)
    src: Any = None
    if not message:
        try:
            src = open(file, "rb") if file else sys.stdin.buffer  # noqa: SIM115
        except OSError as e:
            fail(f"cannot read {file}: {e.strerror or e}")
    interactive = src is None or src.isatty()
    offsets: list[int] = []
    # typing at a terminal: Ctrl-C stops at once (it comes while the read waits, not in a put)
    with session(url, shm, token, token_file) as b, Stop(enabled=not interactive) as stop, \
            Progress("produced", enabled=not interactive) as progress:
        q = b.queue(queue)
        if message:
            batches: Any = (chunk for i in range(0, len(message), batch)
                            if (chunk := [m.encode() for m in message[i:i + batch]]))
        else:  # a part-filled batch goes out once the input is idle (tail -f | shmq produce)
            batches = stream_batches(src, batch, lambda: stop.requested)
        waiting = _Waiting(queue, q, timeout)
        try:
            for chunk in batches:
                parts = [chunk]  # a batch that can never fit a small queue goes in halves
                while parts and not stop.requested:  # room is waited for here: Ctrl-C and a full
                    part = parts[0]  # queue are seen (without waiting for room: the wait for the
                    try:  # journal is not cut short)
                        offsets += q.put_many(part, block=False,
                                              headers=[hdrs] * len(part) if hdrs else None,
                                              delay=delay, ttl=ttl, priority=priority)
                    except Full as e:
                        if len(part) > 1 and "can never fit" in str(e):
                            parts[:1] = [part[:len(part) // 2], part[len(part) // 2:]]
                            continue
                        waiting.full(e)  # (raises Full once --timeout has passed)
                        time.sleep(ROOM_POLL)
                        continue
                    parts.pop(0)
                    waiting.done()
                    progress.advance(len(part))
                if stop.requested:
                    break
        except ShmqError as e:
            if offsets:
                note(f"produced {plural(len(offsets), 'message')} before the error")
            fail(e)
        finally:
            if file and src is not None:
                src.close()
    if as_json:
        print(json.dumps({"produced": len(offsets), "first": offsets[0] if offsets else None,
                          "last": offsets[-1] if offsets else None}))
    else:
        where = "" if not offsets else (f", offset {offsets[0]}" if len(offsets) == 1 else
                                        f", offsets {offsets[0]}..{offsets[-1]}")
        print(f"produced {plural(len(offsets), 'message')}{where}")
    if stop.requested:
        raise typer.Exit(INTERRUPTED)


ROOM_POLL = 0.01  # s between a produce's tries while the queue is full


class _Waiting:
    """``produce``'s wait for room (tries every ``ROOM_POLL``): a line on stderr once the queue
    has been full for a second (``session.Waiting``), and ``Full`` once ``timeout`` has passed."""

    def __init__(self, name: str, q: Queue, timeout: float | None) -> None:
        self.name, self.timeout = name, timeout

        def say() -> str:
            st = q.stats()
            return (f"queue {name!r} is full ({st['retained']:,} of {st['capacity']:,} messages): "
                    "waiting for room; Ctrl-C stops")

        self.wait = Waiting(say, again=lambda: f"queue {name!r} has room again")

    def full(self, e: Full) -> None:
        if "can never fit" in str(e):  # a batch larger than the queue: waiting would not help
            raise e
        waited = self.wait.tick()
        if self.timeout is not None and waited >= self.timeout:
            raise Full(f"queue {self.name!r} stayed full for --timeout {self.timeout:g} s")

    def done(self) -> None:
        self.wait.over()


def _show(m: Message, raw: bool, as_json: bool) -> None:
    """One message on stdout, flushed (a consumer acknowledges only what is written out).
    Text shows a payload as it is when it is UTF-8 without control characters, else escaped
    (``shmq.text.as_line``), saying so on stderr the first time; --raw writes its bytes."""
    if as_json:
        sys.stdout.write(json.dumps(_as_dict(m)) + "\n")
    elif raw:
        sys.stdout.flush()
        sys.stdout.buffer.write(bytes(m.payload) + b"\n")
    else:
        text, why = as_line(bytes(m.payload))
        if why:
            _escaped.say(f"payload of message {m.offset} {why}: shown escaped; --raw writes the bytes "
                         "as they are")
        h = "".join(f" {k}={as_line(bytes(v))[0]}" for k, v in m.headers.items())
        sys.stdout.write(f"[{m.offset}] {text}" + (f"  [headers:{h}]" if h else "") + "\n")
    sys.stdout.flush()


def _as_dict(m: Message) -> dict[str, Any]:
    """A message as JSON: a payload that is no UTF-8 comes escaped (``shmq.text.as_line``)
    and, exactly, as ``payload_base64``."""
    from shmq.headers import as_json

    data = bytes(m.payload)
    out = {"offset": m.offset, "deliveries": m.deliveries, "timestamp": m.timestamp, "payload": "",
           "headers": as_json(m.headers), "origin": m.origin.__dict__ if m.origin else None}
    try:
        out["payload"] = data.decode()
    except UnicodeDecodeError:
        import base64

        out["payload"] = as_line(data)[0]
        out["payload_base64"] = base64.b64encode(data).decode()
        _escaped.say(f"payload of message {m.offset} is not UTF-8: \"payload\" shows it escaped, "
                     "\"payload_base64\" holds its bytes")
    return out


class _Once:
    """A note said once per command (``reset`` as the command starts)."""

    def __init__(self) -> None:
        self.said = False

    def reset(self) -> None:
        self.said = False

    def say(self, text: str) -> None:
        if not self.said:
            self.said = True
            note(text)


_escaped = _Once()  # the first payload shown escaped, said


def consume(
    queue: str = QueueArg,
    n: int | None = typer.Option(None, "-n", metavar="N", help="messages to take (0: no limit)",
                                 show_default="1; with --follow, no limit"),
    group: str = typer.Option(options.DEFAULT_GROUP, "--group", "-g", metavar="GROUP",
                              help="the consumer group"),
    follow: bool = typer.Option(False, "--follow", help="keep consuming until interrupted (Ctrl-C: "
                                "exit 130, after the message in hand is printed and acknowledged)"),
    ack: bool = typer.Option(True, "--ack/--no-ack", help="acknowledge what is printed"),
    timeout: float = typer.Option(1.0, metavar="SECONDS",
                                  help="seconds to wait for a message (without --follow)"),
    raw: bool = typer.Option(False, "--raw", help="payloads only, one per line"),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
    as_json: bool = typer.Option(False, "--json", help="one JSON object a line"),
) -> None:
    """Consume messages (and acknowledge each once printed, unless --no-ack).

    A wait of more than a second for a message is said on stderr (once); the first Ctrl-C
    stops at once (after the message in hand is printed and acknowledged) and says how many
    were consumed (exit 130).  Exit code 2 when no message came within --timeout.

    Example: shmq consume orders -n 10 --json
    """
    from shmq.errors import Empty

    limit = (0 if follow else 1) if n is None else n
    if limit < 0:
        fail(InvalidArgument("-n must be 0 (no limit) or more"))
    _escaped.reset()
    got = 0
    waiting = Waiting(lambda: f"waiting for messages on {queue!r} (group {group!r}); Ctrl-C stops", once=True)
    with session(url, shm, token, token_file) as b, Stop() as stop:
        q = b.queue(queue)
        while not stop.requested and (limit == 0 or got < limit):
            try:
                m = _get(q, group, None if follow else timeout, stop, waiting)
                if m is None:  # stopped
                    break
                _show(m, raw, as_json)
            except Empty:
                break
            except BrokenPipeError:  # the reader went away: a message in hand was not written out
                _quiet_stdout()
                raise typer.Exit(BROKEN_PIPE) from None
            if ack:
                m.ack()
            got += 1
    if stop.requested:
        note(f"consumed {plural(got, 'message')}" + ("" if ack or not got else " (not acknowledged)"))
        raise typer.Exit(INTERRUPTED)
    if got == 0:
        note(f"no message on {queue} (group {group}) within {timeout} s")
        raise typer.Exit(2)


def _get(q: Queue, group: str, timeout: float | None, stop: Stop, waiting: Waiting) -> Message | None:
    """The next message, waiting at most ``timeout`` (None: no limit) in slices, so a Ctrl-C
    (``stop``) is seen within one, and a long wait is said (``waiting``); None once stopped.
    Empty when the time is up; BrokenPipeError when waiting with no limit for a reader
    that has gone."""
    from shmq.errors import Empty

    deadline = None if timeout is None else time.monotonic() + timeout
    while not stop.requested:
        if deadline is None and _reader_gone():
            raise BrokenPipeError
        left = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
        waiting.tick()  # (the first starts the wait: said once it has lasted WAIT_NOTICE)
        try:
            m = q.get(group=group, timeout=max(left, 0))
        except Empty:
            if deadline is not None and time.monotonic() >= deadline:
                raise
        else:
            waiting.over()
            return m
    return None


def _reader_gone() -> bool:
    """Is stdout a pipe whose reader has closed it (``consume --follow | head -1``)?"""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # no file behind it (a test's runner)
        return False
    poll = select.poll()
    poll.register(fd, 0)  # errors and hang-ups only
    return bool(poll.poll(0))


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _read(q: Queue, start: int, n: int) -> list[Message]:
    """Up to ``n`` retained messages from ``start`` (a TCP read stops short at a frame's size)."""
    out: list[Message] = []
    while len(out) < n:
        got = q.read(start, n - len(out))
        if not got:
            break
        out += got
        start = got[-1].offset + 1
    return out


def _list(messages: list[Message], raw: bool, as_json: bool) -> None:
    if as_json:
        print(json.dumps([_as_dict(m) for m in messages]))
        return
    for m in messages:
        _show(m, raw, False)


def peek(queue: str = QueueArg,
         offset: int | None = typer.Option(None, metavar="OFFSET", help="first offset",
                                           show_default="the oldest retained"),
         n: int = typer.Option(10, "-n", metavar="N", help="messages to show at most"),
         url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
         token_file: str | None = TokenFileOpt,
         raw: bool = typer.Option(False, "--raw", help="payloads only, one per line"),
         as_json: bool = typer.Option(False, "--json", help="a JSON array of the messages")) -> None:
    """Show retained messages without taking them.

    Example: shmq peek orders -n 5
    """
    _escaped.reset()
    with session(url, shm, token, token_file) as b:
        q = b.queue(queue)
        start = q.stats()["first_offset"] if offset is None else offset
        found = _read(q, start, n)
    if found or as_json:
        _list(found, raw, as_json)
    else:
        note(f"no message retained in {queue} from offset {start}")


def dlq(queue: str = typer.Argument(..., metavar="QUEUE", help="the source queue (or its QUEUE.dlq)"),
        redrive: bool = typer.Option(False, help="move the dead letters back to the queue each came from"),
        n: int | None = typer.Option(None, "-n", metavar="N", help="at most this many",
                                     show_default="100 listed; every one redriven"),
        url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
        token_file: str | None = TokenFileOpt,
        raw: bool = typer.Option(False, "--raw", help="the dead letters' payloads only, one per line"),
        as_json: bool = typer.Option(False, "--json", help="a JSON array of the dead letters; with "
                                     "--redrive, the count moved")) -> None:
    """List a queue's dead letters, or redrive them back to it.

    A queue that never dead-lettered a message has no QUEUE.dlq yet: an empty list.

    Example: shmq dlq orders --redrive
    """
    from shmq.errors import QueueNotFound
    from shmq.names import dlq_name, is_dlq_name, source_name

    name = queue if is_dlq_name(queue) else dlq_name(queue)
    _escaped.reset()
    with session(url, shm, token, token_file) as b:
        if name != queue:
            b.queue(queue)  # the source must exist: QueueNotFound otherwise
        try:
            d: Queue | None = b.queue(name)
        except QueueNotFound:
            if name == queue:
                raise
            d = None  # nothing was ever dead-lettered
        if redrive:
            moved = 0 if d is None else _redrive(b, d, source_name(name), n)
            if as_json:
                print(json.dumps({"redrove": moved}))
            else:
                print(f"redrove {plural(moved, 'message')}" + ("" if moved else f" ({name} is empty)"))
            return
        found = [] if d is None else _read(d, d.stats()["first_offset"], 100 if n is None else n)
    if found or as_json:
        _list(found, raw, as_json)
    else:
        note(f"no dead letters: {name} is empty")


def _redrive(b: Broker, d: Queue, source: str, n: int | None) -> int:
    """Move up to ``n`` (None: all) dead letters of ``d`` back to the queue each came from
    (its origin, else ``source``): put there, then acknowledged here.  Shows progress; on
    Ctrl-C or an error, says how many were moved."""
    from shmq.errors import Empty
    from shmq.progress import Progress

    depth = d.stats()["groups"][options.DEFAULT_GROUP]["depth"]
    total = depth if n is None else min(n, depth)
    moved = 0
    targets: dict[str, Queue] = {}
    with Stop() as stop, Progress("redrove", total=total) as progress:
        try:
            while (n is None or moved < n) and not stop.requested:
                try:
                    m = d.get(timeout=0)
                except Empty:
                    break
                target = m.origin.queue if m.origin else source
                if target not in targets:
                    targets[target] = b.queue(target)
                targets[target].put(m.payload, headers=m.headers)  # the headers go back too
                m.ack()
                moved += 1
                progress.advance()
        except ShmqError as e:
            note(f"redrove {plural(moved, 'message')} before the error")
            fail(e)
    if stop.requested:
        note(f"redrove {plural(moved, 'message')} before the interrupt")
        raise typer.Exit(INTERRUPTED)
    return moved
