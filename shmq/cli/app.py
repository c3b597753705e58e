"""The ``shmq`` command line (typer).

Every command talks TCP to ``shmq serve`` by default (``--url``, or ``$SHMQ_URL``);
``--shm NAME`` attaches the shared memory of a running broker's instance instead.
Errors are one line on stderr and exit code 1; Ctrl-C is exit code 130
(``shmq.cli.session``); ``--json`` gives output a script can parse.

Each call is a new process, so start-up counts: this module imports typer and what
declares the commands, and each command imports the rest (the transports, rich for
tables and bars) when it runs; ``cli.params`` keeps typer's pydantic out
(``tests/cli/test_cli_startup.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from shmq import options
from shmq.cli.messages import consume, dlq, peek, produce
from shmq.cli.params import install as _plain_params
from shmq.cli.session import (
    INTERRUPTED,
    JsonOpt,
    QueueArg,
    ShmOpt,
    TokenFileOpt,
    TokenOpt,
    UrlOpt,
    note,
    session,
)
from shmq.cli.session import Session as _Session
from shmq.cli.session import broker as _connect
from shmq.cli.session import error as _error
from shmq.cli.session import fail as _fail
from shmq.cli.session import token as _token
from shmq.cli.session import warn_argv_token as _warn_argv_token
from shmq.cli.top_command import register_top
from shmq.errors import InvalidArgument, QueueExists, ShmqError
from shmq.server import config as cfg
from shmq.text import plural
from shmq.version import __version__

_plain_params()
app = typer.Typer(no_args_is_help=True,
                  pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})

DEFAULT_URL = options.DEFAULT_URL


def _print_version(value: bool) -> None:
    if value:
        print(__version__)
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="print the version and exit")) -> None:
    """shmq: a message broker for one host.

    Exit codes: 0 done, 1 error, 2 bad usage (and consume: no message in time),
    130 interrupted (Ctrl-C).
    """


@app.command()
def version() -> None:
    """Print the version."""
    print(__version__)


@app.command()
@cfg.with_settings(token={"callback": _warn_argv_token})  # one option per row of shmq.server.config.SETTINGS
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
        _error(str(e))
        raise typer.Exit(2) from None
    if print_config:
        print(cfg.render(eff, as_json))
        return
    from shmq.server.supervisor import Supervisor
    try:
        sup = Supervisor.from_settings(eff, _token(eff["token"], eff["token_file"]) or "")
        if eff["replica_of"]:
            from shmq.server.standby import StandbyNode
            node = StandbyNode(eff["replica_of"], instance=sup.instance, host=sup.host, port=sup.port,
                               token=sup.token, data_dir=sup.data_dir, tls=sup.tls,
                               leave_token=sup.generated)
            if node.run() is None:
                raise typer.Exit(0)
            sup.port = node.port  # promoted: the primary serves where the standby did
        raise typer.Exit(sup.serve())
    except (ShmqError, OSError) as e:
        _fail(e)


@app.command()
def promote(url: str | None = UrlOpt, token: str | None = TokenOpt, token_file: str | None = TokenFileOpt,
            force: bool = typer.Option(False, "--force", help="promote even while the primary still streams "
                                       "to this standby (two primaries then take writes: fence the old one)"),
            ) -> None:
    """Make a standby (shmq serve --replica-of) the primary: it raises its epoch, rebuilds its
    queues from the journals it received, and takes writes on the same port.

    Example: shmq promote --url tcp://standby-host:7878
    """
    if url and "," in url:
        _fail(InvalidArgument("shmq promote goes to one standby: give its URL alone (--url)"))
    with _connect(url, None, _token(token, token_file)) as b:
        if not hasattr(b, "promote"):
            _fail(InvalidArgument("shmq promote goes to a standby over tcp:// or tcps:// (--url)"))
        try:
            epoch = b.promote(force)
        except ShmqError as e:
            _fail(e)
    print(f"promoted: epoch {epoch}")


@app.command()
def status(url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
           token_file: str | None = TokenFileOpt,
           timeout: float = typer.Option(options.STATUS_TIMEOUT, min=0.01, max=3600,
                                         help="seconds to wait for the broker's answer"),
           as_json: bool = typer.Option(False, "--json", help='one object: {"ready", "reason", '
                                        '"replication"}')) -> None:
    """Is the broker up?  `ready` (exit 0) once it answers a handshake and a request, else
    `not ready: REASON` (exit 1), within --timeout: a health check.  A broker that
    replicates adds a line: its role, epoch and lag.

    Example: shmq status --url tcp://127.0.0.1:7878 --timeout 2
    """
    from shmq.cli.health import check, replication_line

    token = _token(token, token_file)
    about: list[dict[str, Any]] = []
    reason = check(lambda: _connect(url, shm, token), shm, timeout, about)
    if as_json:
        print(json.dumps({"ready": not reason, "reason": reason or None,
                          "replication": about[0] if about else None}))
    else:
        print(f"not ready: {reason}" if reason else "ready")
        for repl in about:  # a broker that replicates: its role, epoch and lag
            print(replication_line(repl))
    raise typer.Exit(1 if reason else 0)


@app.command()
def create(
    queue: str = typer.Argument(..., metavar="QUEUE",
                                help=f"the new queue's name: 1-{options.QUEUE_NAME_MAX} of A-Za-z0-9._-, "
                                     "a letter or digit first (QUEUE.dlq: made by the broker)"),
    capacity: int = typer.Option(options.DEFAULT_CAPACITY, help="messages held at most (unacknowledged "
                                 "by some group)"),
    max_bytes: int = typer.Option(options.DEFAULT_MAX_BYTES, help="bytes of payload and metadata held at "
                                  "most, reserved at creation"),
    max_message_size: int | None = typer.Option(
        None, help="largest payload (bytes)",
        show_default=f"{options.DEFAULT_MAX_MESSAGE_SIZE}, or max-bytes - {options.MAX_META_SIZE} if less"),
    visibility_timeout: float = typer.Option(options.DEFAULT_VISIBILITY_TIMEOUT, help="seconds a delivery "
                                             "is leased before it is given back"),
    max_deliveries: int = typer.Option(options.DEFAULT_MAX_DELIVERIES, help="deliveries of a message before "
                                       "it is dead-lettered to QUEUE.dlq"),
    max_groups: int = typer.Option(options.DEFAULT_MAX_GROUPS, help="consumer groups at most (the default "
                                   "group included)"),
    durability: str = typer.Option(
        options.DEFAULT_DURABILITY,
        help="memory: shared memory only; survives a broker crash, lost at reboot or "
             "`shmq serve` stop. interval: journaled, fsynced every --sync-interval (1 s): a host "
             "crash loses at most that window. always: a produce or ack returns once fsynced: "
             "nothing confirmed is lost"),
    message_ttl: float = typer.Option(0.0, help="seconds a message may wait for its first delivery to "
                                      "a group; then it expires for that group (0: never)"),
    expired_to_dlq: bool = typer.Option(True, help="dead-letter an expired message to QUEUE.dlq "
                                        "(reason ttl_expired); --no-expired-to-dlq drops it"),
    replication: str = typer.Option("", help="to a standby (shmq serve --replica-of): sync (an always "
                                    "put waits for a standby's fsync too) or async; none: the broker's "
                                    "--replication", show_default="none"),
    priorities: int = typer.Option(0, help=f"levels of priority, 2..{options.MAX_PRIORITIES}: "
                                   "`shmq produce --priority P` (0..N-1), the highest delivered first; "
                                   "0: none"),
    exist_ok: bool = typer.Option(False, "--exist-ok", help="a queue of that name already there is fine "
                                  "(it is left as it is: its settings are not compared)"),
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
    if message_ttl or not expired_to_dlq:  # (an older broker knows neither)
        limits.update(message_ttl=message_ttl, expired_to_dlq=expired_to_dlq)
    if max_message_size is not None:
        limits["max_message_size"] = max_message_size
    if replication:  # (an older broker does not know it)
        limits["replication"] = replication
    if priorities:
        limits["priorities"] = priorities
    with session(url, shm, token, token_file) as b:
        try:
            b.create_queue(queue, **limits)
        except QueueExists:
            if not exist_ok:
                raise
            print(f"{queue} exists already")
            return
    print(f"created {queue}")


@app.command()
def delete(queue: str = QueueArg, url: str | None = UrlOpt, shm: str | None = ShmOpt,
           token: str | None = TokenOpt, token_file: str | None = TokenFileOpt) -> None:
    """Delete a queue (its messages are gone; its QUEUE.dlq stays).

    Example: shmq delete orders
    """
    with session(url, shm, token, token_file) as b:
        b.delete_queue(queue)
    print(f"deleted {queue}")


@app.command("list")
def list_(url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
          token_file: str | None = TokenFileOpt, as_json: bool = JsonOpt) -> None:
    """List queues with their depth.

    Example: shmq list --json
    """
    with session(url, shm, token, token_file) as b:
        rows = []
        for info in b.list_queues():
            st = b.queue(info.name).stats()
            rows.append({"name": info.name, "dlq": info.is_dlq, "retained": st["retained"],
                         "capacity": st["capacity"], "bytes_used": st["bytes_used"],
                         "groups": list(st["groups"])})
    if as_json:
        print(json.dumps(rows))
    elif not rows:
        note("no queues")
    else:
        _table(["queue", "retained", "capacity", "bytes", "groups"],
               [[r["name"] + (" (dlq)" if r["dlq"] else ""), str(r["retained"]), str(r["capacity"]),
                 str(r["bytes_used"]), ", ".join(r["groups"])] for r in rows])


for _command in (produce, consume, peek):  # shmq.cli.messages
    app.command()(_command)


def _table(headers: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*headers)
    for r in rows:
        table.add_row(*r)
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # pipes get whole tables


@app.command()
def stats(queue: str = QueueArg, url: str | None = UrlOpt, shm: str | None = ShmOpt,
          token: str | None = TokenOpt, token_file: str | None = TokenFileOpt,
          as_json: bool = JsonOpt) -> None:
    """Depth, in-flight, bytes and counters of a queue, per group.

    Example: shmq stats orders --json
    """
    with session(url, shm, token, token_file) as b:
        st = b.queue(queue).stats()
    if as_json:
        print(json.dumps(st))
        return
    print(f"{st['name']}: {st['retained']} retained of {st['capacity']}, "
          f"{st['bytes_used']} of {st['max_bytes']} bytes, {st['produced']} produced")
    _table(["group", "depth", "in flight", "acked", "nacked", "redelivered", "dead-lettered", "expired"],
           [[g, *(str(s[k]) for k in ("depth", "in_flight", "acked", "nacked", "redelivered", "dead_lettered",
                                      "expired"))] for g, s in st["groups"].items()])


@app.command()
def purge(queue: str = QueueArg, url: str | None = UrlOpt, shm: str | None = ShmOpt,
          token: str | None = TokenOpt, token_file: str | None = TokenFileOpt,
          as_json: bool = JsonOpt) -> None:
    """Drop every message of a queue.

    Example: shmq purge orders
    """
    with session(url, shm, token, token_file) as b:
        n = b.queue(queue).purge()
    print(json.dumps({"purged": n}) if as_json else f"purged {plural(n, 'message')} from {queue}")


@app.command()
def seek(queue: str = QueueArg,
         time_: str = typer.Option(..., "--time", "-t", help="ISO 8601 with a timezone "
                                   "(2026-11-24T10:00:00Z) or relative to now (-90s, -5m, -1h, -2d)"),
         group: str = typer.Option(options.DEFAULT_GROUP, "--group", "-g", help="the group to move"),
         create: bool = typer.Option(False, "--create", help="make a new group starting at that time"),
         url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
         token_file: str | None = TokenFileOpt, as_json: bool = JsonOpt) -> None:
    """Move a group to the first message produced at or after a time: below it every message
    is settled for the group, from it on the retained ones are delivered (again).

    Example: shmq seek orders --group billing --time -1h
    """
    import time

    from shmq.seektime import parse_time

    with session(url, shm, token, token_file) as b:
        at = parse_time(time_, time.time())
        q = b.queue(queue)
        if create:
            q.create_group(group, start=at)
            offset = int(q.stats()["groups"][group]["floor"])
        else:
            offset = q.seek(group, at)
    print(json.dumps({"group": group, "offset": offset}) if as_json
          else f"group {group} of {queue} {'starts' if create else 'moved to'} offset {offset}")


app.command()(dlq)


@app.command()
def doctor(
    clean: bool = typer.Option(False, "--clean", help="remove what belongs to dead instances"),
    check: bool = typer.Option(False, "--check", help="check every invariant of the shared memory "
                               "(under its locks: safe on a live instance); exit 1 on a violation"),
    instance: str | None = typer.Option(None, "--instance", "-i", help="only this instance",
                                        show_default="every instance of this user"),
    as_json: bool = JsonOpt,
) -> None:
    """List shmq shared memory on this host; with --clean, reclaim dead instances' objects;
    with --check, verify the invariants of each instance (one line per violation).

    Example: shmq doctor --clean
    """
    from shmq.core.cleanup import reclaim, scan

    if check:
        _doctor_check(instance, as_json)
        return
    try:
        reports = reclaim(instance) if clean else scan(instance)
    except ShmqError as e:
        _fail(e)
    if as_json:
        print(json.dumps([r.__dict__ for r in reports], indent=2))
    elif not reports:
        print("no shmq shared memory on this host")
    else:
        _table(["instance", "state", "queues", "objects", "why"],
               [[r.instance, "live" if r.alive else ("reclaimed" if clean else "dead"), str(r.queues),
                 str(len(r.objects)), r.reason] for r in reports])


def _doctor_check(instance: str | None, as_json: bool) -> None:
    from shmq.core.check import check_all, check_instance
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
                print(f"{inst}: clean")
        if not found:
            print("no shmq instance on this host")
    if any(found.values()):
        raise typer.Exit(1)


@app.command()
def bench(
    queue: str = typer.Option("bench", help="queue to use (created if missing)"),
    messages: int = typer.Option(10000, "-n", help="messages per producer"),
    producers: int = typer.Option(2, help="producer processes"),
    consumers: int = typer.Option(2, help="consumer processes"),
    size: int = typer.Option(100, help="payload bytes"),
    batch: int = typer.Option(1, help="messages per put and per get"),
    url: str | None = UrlOpt, shm: str | None = ShmOpt, token: str | None = TokenOpt,
    token_file: str | None = TokenFileOpt,
    as_json: bool = JsonOpt,
) -> None:
    """A stress test: producers and consumers in processes, a live progress bar, a results table.

    Example: shmq bench -n 50000 --producers 4 --consumers 4 --batch 100
    """
    from shmq.cli.stress import run_stress

    token = _token(token, token_file)
    if shm:
        with _Session(None, shm, token):
            pass  # the instance must exist (--shm attaches, never creates)
    target = f"shm://{shm}" if shm else (url or DEFAULT_URL)
    try:
        result = run_stress(target, token, queue, messages, producers, consumers, size, batch,
                            progress=not as_json)
    except ShmqError as e:
        _fail(e)
    except KeyboardInterrupt:
        raise typer.Exit(INTERRUPTED) from None
    if as_json:
        print(json.dumps(result))
        return
    _table(["metric", "value"], [[k, f"{v:,.1f}" if isinstance(v, float) else str(v)]
                                 for k, v in result.items()])


register_top(app, _Session, _token, UrlOpt, ShmOpt, TokenOpt, TokenFileOpt)  # shmq top
