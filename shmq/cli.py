"""The ``shmq`` command line (typer; rich for tables and progress).

Every command talks TCP to ``shmq serve`` by default (``--url``, or
``$SHMQ_URL``); ``--shm`` attaches the shared memory of a local instance
instead.  Errors are one line on stderr and a non-zero exit code; ``--json``
gives output a script can parse.
"""

from __future__ import annotations

import json
import sys
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from . import __version__, connect, options, runtime
from . import config as cfg
from .api import Broker
from .cleanup import reclaim, scan
from .errors import ConnectionLost, Empty, ShmqError
from .top_cli import register_top
from .urls import parse_tcp_url

app = typer.Typer(help="shmq: a message broker for one host.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
console = Console(width=None if sys.stdout.isatty() else 160)  # pipes get whole tables
err = Console(stderr=True, soft_wrap=True)

DEFAULT_URL = options.DEFAULT_URL
UrlOpt = typer.Option(None, "--url", envvar="SHMQ_URL", help=f"broker URL (default {DEFAULT_URL})")
ShmOpt = typer.Option(None, "--shm", help="attach the shared memory of this local instance instead of TCP")


def _warn_argv_token(value: str | None) -> str | None:
    """A token typed on the command line is in every local user's ``ps``: say so."""
    if value and any(a == "--token" or a.startswith("--token=") for a in sys.argv[1:]):
        err.print(f"[yellow]warning[/yellow]: --token on the command line is visible to every local user "
                  f"(ps, /proc/PID/cmdline); set ${options.TOKEN_ENV} or use --token-file instead",
                  markup=True, highlight=False)
    return value


def _token(token: str | None, token_file: str | None) -> str | None:
    """The token: ``--token-file`` (the file's first line), else ``--token`` / $SHMQ_TOKEN."""
    if not token_file:
        return token
    try:
        with open(token_file) as f:
            return f.readline().strip()
    except OSError as e:
        _fail(ShmqError(f"cannot read the token file {token_file}: {e.strerror or e}"))


TokenOpt = typer.Option(None, "--token", envvar=options.TOKEN_ENV, callback=_warn_argv_token,
                        help=f"auth token (prefer ${options.TOKEN_ENV} or --token-file: argv is public)")
TokenFileOpt = typer.Option(None, "--token-file", help="read the auth token from this file's first line")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")


def _broker(url: str | None, shm: str | None, token: str | None) -> Broker:
    """The broker handle of a CLI command.  A ``tcp://`` URL on loopback goes over the Unix
    socket that this user's broker on that port listens on beside it, when it has one
    (``shmq serve --unix auto``, the default): no TCP stack, and no token needed."""
    if shm:
        return connect(f"shm://{shm}", token=token)
    url = url or DEFAULT_URL
    if url.startswith("tcp://") and "?" not in url:
        path = runtime.local_socket(*parse_tcp_url(url))
        if path is not None:
            try:
                return connect(f"unix://{path}", token=token)
            except ConnectionLost:
                pass  # left by a broker that is gone: TCP says what is there now
    return connect(url, token=token)


def _fail(e: Exception) -> NoReturn:
    code = getattr(e, "code", None)
    name = getattr(code, "name", None)
    err.print(f"[red]error[/red]: {e}" + (f" ({name})" if name else ""), markup=True, highlight=False)
    raise typer.Exit(1)


class _Session:
    def __init__(self, url: str | None, shm: str | None, token: str | None) -> None:
        self.args = (url, shm, token)
        self.b: Broker | None = None

    def __enter__(self) -> Broker:
        try:
            self.b = _broker(*self.args)
        except (ShmqError, OSError) as e:
            _fail(e)
        assert self.b is not None
        return self.b

    def __exit__(self, et: Any, e: Any, tb: Any) -> None:
        if self.b is not None:
            try:
                self.b.close()
            except Exception:  # noqa: BLE001
                pass
        if isinstance(e, ShmqError):
            _fail(e)


@app.command()
def version() -> None:
    """Print the version."""
    print(__version__)


@app.command()
@cfg.with_settings(token={"callback": _warn_argv_token})  # one option per row of shmq.config.SETTINGS
def serve(
    ctx: typer.Context,
    config_file: str = typer.Option("", "--config", "-c", envvar=options.CONFIG_ENV, show_default="none",
                                    help="read settings, and queues to declare, from this TOML file "
                                         "(flags and $SHMQ_<NAME> variables override it)"),
    print_config: bool = typer.Option(False, "--print-config", help="print the settings in effect and "
                                      "where each comes from, then exit without starting anything"),
    as_json: bool = typer.Option(False, "--json", help="with --print-config: as JSON"),
    **settings: Any,
) -> None:
    """Run the broker: a supervisor and N workers on one SO_REUSEPORT port.

    Example: shmq serve --port 7878 --workers 4 (TLS: --tls-cert server.pem --tls-key server.key;
    from a file: --config shmq.toml, checked with --print-config)
    """
    try:
        if as_json and not print_config:
            raise cfg.ConfigError("--json goes with --print-config")
        eff = cfg.resolve(settings, cfg.sources(ctx), config_file or None)
    except cfg.ConfigError as e:
        from rich.markup import escape
        err.print(f"[red]error[/red]: {escape(str(e))}", markup=True, highlight=False)
        raise typer.Exit(2) from None
    if print_config:
        print(cfg.render(eff, as_json))
        return
    from .server.supervisor import Supervisor
    try:
        raise typer.Exit(Supervisor.from_settings(eff, _token(eff["token"], eff["token_file"]) or "").serve())
    except (ShmqError, OSError) as e:
        _fail(e)


@app.command()
def status(url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
           token_file: str | None = TokenFileOpt,
           timeout: float = typer.Option(options.STATUS_TIMEOUT, min=0.01, max=3600,
                                         help="seconds to wait for the broker's answer")) -> None:
    """Is the broker up?  `ready` (exit 0) once it answers a handshake and a request, else
    `not ready: REASON` (exit 1), within --timeout: a health check.

    Example: shmq status --url tcp://127.0.0.1:7878 --timeout 2
    """
    from .health import check

    token = _token(token, token_file)
    reason = check(lambda: _broker(url, shm, token), shm, timeout)
    print(f"not ready: {reason}" if reason else "ready")
    raise typer.Exit(1 if reason else 0)


@app.command()
def create(
    queue: str,
    capacity: int = typer.Option(options.DEFAULT_CAPACITY, help="messages held"),
    max_bytes: int = typer.Option(options.DEFAULT_MAX_BYTES, help="bytes held"),
    max_message_size: int = typer.Option(0, help="largest payload (default: 1 MiB or less)"),
    visibility_timeout: float = typer.Option(options.DEFAULT_VISIBILITY_TIMEOUT, help="lease seconds"),
    max_deliveries: int = typer.Option(options.DEFAULT_MAX_DELIVERIES, help="before dead-lettering"),
    max_groups: int = typer.Option(options.DEFAULT_MAX_GROUPS, help="consumer groups"),
    durability: str = typer.Option(
        options.DEFAULT_DURABILITY,
        help="memory (default): shared memory only; survives a broker crash, lost at reboot or "
             "`shmq serve` stop. interval: journaled, fsynced every --sync-interval (1 s): a host "
             "crash loses at most that window. always: a produce or ack returns once fsynced: "
             "nothing confirmed is lost"),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
) -> None:
    """Create a queue.

    Example: shmq create orders --capacity 100000 --max-deliveries 10 --durability always

    Durability (loss window): memory = lost at reboot or broker stop (survives a broker
    crash); interval = at most the last --sync-interval of `shmq serve` (1 s);
    always = none (group commit: concurrent producers share each fsync).
    """
    limits: dict[str, Any] = dict(capacity=capacity, max_bytes=max_bytes,
                                  visibility_timeout=visibility_timeout, max_deliveries=max_deliveries,
                                  max_groups=max_groups, durability=durability)
    if max_message_size:
        limits["max_message_size"] = max_message_size
    with _Session(url, shm, _token(token, token_file)) as b:
        b.create_queue(queue, **limits)
    console.print(f"created {queue}")


@app.command()
def delete(queue: str, url: str | None = UrlOpt, shm: str | None = ShmOpt,
           token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt) -> None:
    """Delete a queue (its messages are gone).

    Example: shmq delete orders
    """
    with _Session(url, shm, _token(token, token_file)) as b:
        b.delete_queue(queue)
    console.print(f"deleted {queue}")


@app.command("list")
def list_(url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
          as_json: bool = JsonOpt) -> None:
    """List queues with their depth.

    Example: shmq list --json
    """
    with _Session(url, shm, _token(token, token_file)) as b:
        rows = []
        for info in b.list_queues():
            st = b.queue(info.name).stats()
            rows.append({"name": info.name, "dlq": info.is_dlq, "retained": st["retained"],
                         "capacity": st["capacity"], "bytes_used": st["bytes_used"],
                         "groups": list(st["groups"])})
    if as_json:
        print(json.dumps(rows))
        return
    table = Table("queue", "retained", "capacity", "bytes", "groups")
    for r in rows:
        table.add_row(r["name"] + (" (dlq)" if r["dlq"] else ""), str(r["retained"]), str(r["capacity"]),
                      str(r["bytes_used"]), ", ".join(r["groups"]))
    console.print(table)


@app.command()
def produce(
    queue: str,
    message: list[str] = typer.Argument(None, help="messages; none: read lines from --file or stdin"),
    file: str | None = typer.Option(None, "--file", "-f", help="read one message per line from a file"),
    batch: int = typer.Option(100, help="messages per request"),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Produce messages: arguments, or one per line of stdin / a file.

    Example: seq 1000 | shmq produce orders
    """
    from rich.progress import Progress

    if message:
        lines: Any = iter([m.encode() for m in message])
        total = len(message)
    else:
        src = open(file, "rb") if file else sys.stdin.buffer  # noqa: SIM115
        lines = (line.rstrip(b"\n") for line in src)
        total = None
    offsets: list[int] = []
    with _Session(url, shm, _token(token, token_file)) as b, Progress(console=err, transient=True,
                                                    disable=as_json or not err.is_terminal) as prog:
        q = b.queue(queue)
        task = prog.add_task("producing", total=total)
        chunk: list[bytes] = []
        for line in lines:
            chunk.append(line)
            if len(chunk) >= batch:
                offsets += q.put_many(chunk)
                prog.advance(task, len(chunk))
                chunk = []
        if chunk:
            offsets += q.put_many(chunk)
    if as_json:
        print(json.dumps({"produced": len(offsets), "first": offsets[0] if offsets else None,
                          "last": offsets[-1] if offsets else None}))
    else:
        console.print(f"produced {len(offsets)} message(s)" +
                      (f", offsets {offsets[0]}..{offsets[-1]}" if offsets else ""))


def _show(m: Any, raw: bool, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"offset": m.offset, "deliveries": m.deliveries, "timestamp": m.timestamp,
                          "payload": bytes(m.payload).decode(errors="replace"),
                          "origin": m.origin.__dict__ if m.origin else None}))
    elif raw:
        sys.stdout.buffer.write(bytes(m.payload) + b"\n")
        sys.stdout.flush()
    else:
        console.print(f"[{m.offset}] {bytes(m.payload).decode(errors='replace')}", markup=False)


@app.command()
def consume(
    queue: str,
    n: int = typer.Option(1, "-n", help="messages to take (0 with --follow: no limit)"),
    group: str = typer.Option(options.DEFAULT_GROUP, "--group", "-g"),
    follow: bool = typer.Option(False, "--follow", help="keep waiting for new messages"),
    ack: bool = typer.Option(True, "--ack/--no-ack", help="acknowledge what is printed"),
    timeout: float = typer.Option(1.0, help="seconds to wait for a message"),
    raw: bool = typer.Option(False, "--raw", help="payloads only, one per line"),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Consume messages (and acknowledge them, unless --no-ack).

    Example: shmq consume orders -n 10 --json
    """
    got = 0
    with _Session(url, shm, _token(token, token_file)) as b:
        q = b.queue(queue)
        while follow and n == 0 or got < n:
            try:
                m = q.get(group=group, timeout=timeout)
            except Empty:
                if follow:
                    continue
                break
            _show(m, raw, as_json)
            if ack:
                m.ack()
            got += 1
    if got == 0 and not follow:
        err.print(f"no message on {queue} (group {group}) within {timeout} s")
        raise typer.Exit(2)


@app.command()
def peek(queue: str, offset: int = typer.Option(-1, help="first offset (default: oldest retained)"),
         n: int = typer.Option(10, "-n"), url: str | None = UrlOpt, shm: str | None = ShmOpt,
         token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt, raw: bool = typer.Option(False, "--raw"),
         as_json: bool = JsonOpt) -> None:
    """Show retained messages without taking them.

    Example: shmq peek orders -n 5
    """
    with _Session(url, shm, _token(token, token_file)) as b:
        q = b.queue(queue)
        start = q.stats()["first_offset"] if offset < 0 else offset
        for m in q.read(start, n):
            _show(m, raw, as_json)


@app.command()
def stats(queue: str, url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
          as_json: bool = JsonOpt) -> None:
    """Depth, in-flight, bytes and counters of a queue, per group.

    Example: shmq stats orders --json
    """
    with _Session(url, shm, _token(token, token_file)) as b:
        st = b.queue(queue).stats()
    if as_json:
        print(json.dumps(st))
        return
    console.print(f"{st['name']}: {st['retained']} retained of {st['capacity']}, "
                  f"{st['bytes_used']} of {st['max_bytes']} bytes, {st['produced']} produced")
    table = Table("group", "depth", "in flight", "acked", "nacked", "redelivered", "dead-lettered", "expired")
    for g, s in st["groups"].items():
        table.add_row(g, *(str(s[k]) for k in ("depth", "in_flight", "acked", "nacked", "redelivered",
                                                 "dead_lettered", "expired")))
    console.print(table)


@app.command()
def purge(queue: str, url: str | None = UrlOpt, shm: str | None = ShmOpt,
          token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt) -> None:
    """Drop every message of a queue.

    Example: shmq purge orders
    """
    with _Session(url, shm, _token(token, token_file)) as b:
        n = b.queue(queue).purge()
    console.print(f"purged {n} message(s) from {queue}")


@app.command()
def dlq(queue: str, redrive: bool = typer.Option(False, help="move them back to the source queue"),
        n: int = typer.Option(100, "-n", help="at most this many"), url: str | None = UrlOpt,
        shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt, as_json: bool = JsonOpt) -> None:
    """List a queue's dead letters, or redrive them back to it.

    Example: shmq dlq orders --redrive
    """
    name = queue if queue.endswith(options.DLQ_SUFFIX) else queue + options.DLQ_SUFFIX
    with _Session(url, shm, _token(token, token_file)) as b:
        d = b.queue(name)
        if not redrive:
            st = d.stats()
            for m in d.read(st["first_offset"], n):
                _show(m, False, as_json)
            return
        moved = 0
        while moved < n:
            try:
                m = d.get(timeout=0)
            except Empty:
                break
            origin = m.origin
            target = b.queue(origin.queue if origin else queue[: -len(options.DLQ_SUFFIX)])
            target.put(m.payload)
            m.ack()
            moved += 1
    console.print(f"redrove {moved} message(s)")


@app.command()
def doctor(
    clean: bool = typer.Option(False, "--clean", help="remove what belongs to dead instances"),
    check: bool = typer.Option(False, "--check", help="check every invariant of the shared memory "
                               "(under its locks: safe on a live instance); exit 1 on a violation"),
    instance: str | None = typer.Option(None, "--instance", "-i", help="only this instance"),
    as_json: bool = JsonOpt,
) -> None:
    """List shmq shared memory on this host; with --clean, reclaim dead instances' objects;
    with --check, verify the invariants of each instance (one line per violation).

    Example: shmq doctor --clean
    """
    if check:
        _doctor_check(instance, as_json)
        return
    reports = reclaim(instance) if clean else scan(instance)
    if as_json:
        print(json.dumps([r.__dict__ for r in reports], indent=2))
        return
    table = Table("instance", "state", "queues", "objects", "why")
    for r in reports:
        state = "live" if r.alive else ("reclaimed" if clean else "dead")
        table.add_row(r.instance, state, str(r.queues), str(len(r.objects)), r.reason)
    console.print(table if reports else "no shmq shared memory on this host")


def _doctor_check(instance: str | None, as_json: bool) -> None:
    from .check import check_all, check_instance
    try:
        found = {instance: check_instance(instance)} if instance else check_all()
    except ShmqError as e:
        _fail(e)
    if as_json:
        print(json.dumps(found, indent=2))
    else:
        for inst, violations in found.items():
            for v in violations:
                print(f"{inst}: {v}")
            if not violations:
                console.print(f"{inst}: clean")
        if not found:
            console.print("no shmq instance on this host")
    if any(found.values()):
        raise typer.Exit(1)


@app.command()
def bench(
    queue: str = typer.Option("bench", help="queue to use (created if missing)"),
    messages: int = typer.Option(10000, "-n", help="messages per producer"),
    producers: int = typer.Option(2), consumers: int = typer.Option(2),
    size: int = typer.Option(100, help="payload bytes"), batch: int = typer.Option(1),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
    as_json: bool = JsonOpt,
) -> None:
    """A stress test: producers and consumers in processes, a live progress bar, a results table.

    Example: shmq bench -n 50000 --producers 4 --consumers 4 --batch 100
    """
    from .stress import run_stress

    target = f"shm://{shm}" if shm else (url or DEFAULT_URL)
    token = _token(token, token_file)
    try:
        result = run_stress(target, token, queue, messages, producers, consumers, size, batch,
                            progress=not as_json)
    except ShmqError as e:
        _fail(e)
    if as_json:
        print(json.dumps(result))
        return
    table = Table("metric", "value")
    for k, v in result.items():
        table.add_row(k, f"{v:,.1f}" if isinstance(v, float) else str(v))
    console.print(table)


register_top(app, _Session, _token, console, UrlOpt, ShmOpt, TokenOpt, TokenFileOpt)  # shmq top
