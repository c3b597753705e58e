"""The settings of ``shmq serve``: one table, read from four sources.

Each setting is named once, in ``SETTINGS``: its type, its default (from
``shmq.options``), its help text, its flag (``--max-connections``) and its environment
variable (``SHMQ_MAX_CONNECTIONS``).  The CLI builds ``serve``'s options from the table,
a config file (``shmq serve --config shmq.toml``, TOML) is checked against it, and
``--print-config`` prints it, so the four cannot drift apart.

Per setting, the first of these that gives a value wins:

1. a flag on the command line;
2. its environment variable (``SHMQ_<NAME>``: ``SHMQ_PORT``, ``SHMQ_TOKEN``, ...);
3. the config file (top-level keys, the settings' names: ``port = 7878``);
4. the default.

The file may also declare queues, one table each (``[queues.orders]``, with
``create_queue``'s settings and ``groups = [...]``): the broker creates them at start when
they are missing and refuses to start when one exists with other settings
(``shmq.server.declarations``).  File paths in the file are relative to its folder.

Errors are :class:`ConfigError`, one line naming the file and the key: an unknown key
(with the nearest valid one), a value of the wrong type, a file that is missing or
not TOML (with the parser's line and column).
"""

from __future__ import annotations

import difflib
import inspect
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from shmq import options
from shmq.errors import InvalidArgument, ShmqError

_F = TypeVar("_F", bound=Callable[..., Any])


class ConfigError(InvalidArgument):
    """The settings of ``shmq serve`` cannot be used (a bad config file, most often)."""


@dataclass(frozen=True)
class Setting:
    """One setting of ``shmq serve``."""

    name: str  # the config file's key and the parameter's name: max_connections
    kind: type  # str, int, float or bool
    default: Any
    help: str
    shown: str | None = None  # the default as --help shows it, where the value itself would mislead
    choices: tuple[str, ...] = ()
    path: bool = False  # a file or folder: relative to the config file's folder when set there
    off_flag: str = ""  # a bool's flag that turns it off (--no-keep), so a flag can undo the file
    secret: bool = False  # never printed (--print-config says "(set)")
    in_file: bool = True  # may be set in the config file

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return options.ENV_PREFIX + self.name.upper()


_H = options.HEARTBEAT_MISSES
SETTINGS: tuple[Setting, ...] = (
    Setting("host", str, options.DEFAULT_HOST, "address to bind (not loopback: needs a token)"),
    Setting("port", int, options.DEFAULT_PORT, "TCP port (0: any free port)"),
    Setting("workers", int, 0, f"worker processes (0: CPU count, at most {options.MAX_WORKERS})",
            shown="CPU count"),
    Setting("instance", str, options.DEFAULT_INSTANCE, "shared-memory instance name"),
    Setting("token", str, "", f"auth token clients must present (prefer ${options.TOKEN_ENV} or "
            "--token-file: argv is public; never read from a config file)", shown="none: one is made",
            secret=True, in_file=False),
    Setting("token_file", str, "", "read the auth token from this file's first line",
            shown="none", path=True),
    Setting("unix", str, options.DEFAULT_UNIX_SOCKET,
            "also listen on this Unix-domain socket (mode 0600; a peer of our own uid needs no token): "
            "auto = tcp-PORT.sock in this user's runtime folder, where the CLI finds it; off = none",
            path=True),
    Setting("no_auth", bool, False, "accept clients without a token (loopback only; by default a token "
            "is made and left for this user's clients)", off_flag="--auth"),
    Setting("tls_cert", str, "", "serve TLS (tcps://) on the TCP port with this certificate (PEM)",
            shown="none: plain TCP", path=True),
    Setting("tls_key", str, "", "the private key of --tls-cert (PEM)", shown="none", path=True),
    Setting("tls_client_ca", str, "", "mutual TLS: require client certificates signed by this CA",
            shown="none", path=True),
    Setting("max_connections", int, options.MAX_CONNECTIONS, "connections per worker"),
    Setting("heartbeat", float, options.HEARTBEAT, "seconds between heartbeats on each connection, at "
            f"most (0: none); a peer silent {_H} intervals is closed"),
    Setting("spin_us", float, options.WORKER_SPIN_US, "microseconds a worker polls for the next request "
            f"after a read before it sleeps (0: never; at most {options.MAX_SPIN_US:,.0f})"),
    Setting("keep", bool, False, "keep the shared memory (memory-only queues too) when stopping",
            off_flag="--no-keep"),
    Setting("data_dir", str, "", "journal of durable queues",
            shown=f"{options.DEFAULT_DATA_DIR}/INSTANCE", path=True),
    Setting("sync_interval", float, options.DEFAULT_SYNC_INTERVAL,
            "longest time an `interval` queue goes without fsync (s)"),
    Setting("journal_segment_bytes", int, options.JOURNAL_SEGMENT_BYTES,
            "journal segment file size before it rolls"),
    Setting("log_level", str, options.DEFAULT_LOG_LEVEL, ", ".join(options.LOG_LEVELS),
            choices=options.LOG_LEVELS),
    Setting("log_format", str, options.DEFAULT_LOG_FORMAT,
            "text (one line each, naming process role and pid) or json (one object a line)",
            choices=options.LOG_FORMATS),
    Setting("replica_of", str, "", "run as a standby of this primary (tcp://HOST:PORT or tcps://): copy its "
            "journaled queues, serve reads only, until `shmq promote`", shown="none: a primary"),
    Setting("replication", str, options.DEFAULT_REPLICATION, "a queue's replication to a standby when it "
            "names none: async, or sync (an `always` put waits for a standby's fsync too)",
            choices=("async", "sync")),
    Setting("replication_port", int, 0, "TCP port (on --host) where standbys connect (0: any free port, "
            "announced in INFO)"),
    Setting("replication_announce", str, "", "HOST:PORT standbys are told to connect to instead (the "
            "replication port seen through NAT or a proxy)",
            shown="none: the replication port on the URL's host"),
    Setting("sync_timeout", float, options.DEFAULT_SYNC_TIMEOUT, "seconds a `sync` round waits for a "
            "standby's fsync before its puts fail with StorageError (until a standby confirms)"),
    Setting("metrics", str, "", "serve Prometheus metrics on HOST:PORT (:PORT = loopback; off loopback "
            "the broker's token is required, and TLS is used with --tls-cert)", shown="off"),
)
SETTING = {s.name: s for s in SETTINGS}
assert SETTING["token"].env == options.TOKEN_ENV and SETTING["data_dir"].env == options.DATA_DIR_ENV

# a declared queue's keys: create_queue's settings, and the groups to create
# a declared queue's keys: QueueConfig's fields (shmq.api, which `import shmq.cli` must not load), and groups
QUEUE_KEYS: dict[str, type] = {
    "capacity": int, "max_bytes": int, "max_message_size": int, "visibility_timeout": float,
    "max_deliveries": int, "max_groups": int, "durability": str, "message_ttl": float,
    "expired_to_dlq": bool, "replication": str, "priorities": int, "groups": list}
_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
          list: "a list of group names", dict: "a table"}

# where a value came from, most important first
FLAG, ENV, FILE, DEFAULT = "flag", "env", "file", "default"


@dataclass(frozen=True)
class QueueDecl:
    """A queue the config file declares: the settings it names (the others are not
    checked), and the consumer groups to create."""

    name: str
    limits: dict[str, Any]
    groups: tuple[str, ...]
    origin: str  # the file

    def as_dict(self) -> dict[str, Any]:
        return {**self.limits, **({"groups": list(self.groups)} if self.groups else {})}


@dataclass(frozen=True)
class FileConfig:
    """A config file, read and checked: its settings and its queues."""

    path: str
    settings: dict[str, Any]
    queues: tuple[QueueDecl, ...]


@dataclass
class Effective:
    """The settings in effect: each value with where it came from."""

    values: dict[str, Any]
    sources: dict[str, str]  # "flag --port", "env SHMQ_PORT", "file shmq.toml", "default"
    queues: tuple[QueueDecl, ...] = ()
    path: str | None = None
    notes: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


def _near(key: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1)
    return f"; did you mean {near[0]!r}?" if near else f" (valid: {', '.join(valid)})"


def _check_type(value: Any, kind: type, what: str, path: str) -> Any:
    """``value`` as ``kind``, or a ConfigError naming ``what``, the type and the file."""
    ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not ok:
        raise ConfigError(f"{what} in {path} must be {_KINDS[kind]}, not {type(value).__name__} {value!r}")
    return value


def load(path: str) -> FileConfig:
    """Read and check a config file (TOML)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    base = Path(path).resolve().parent
    settings: dict[str, Any] = {}
    queues: tuple[QueueDecl, ...] = ()
    valid = [s.name for s in SETTINGS if s.in_file] + ["queues"]
    for key, value in data.items():
        if key == "queues":
            queues = _queues(_check_type(value, dict, "'queues'", path), path)
            continue
        s = SETTING.get(key)
        if s is not None and not s.in_file:
            raise ConfigError(f"{key!r} is not read from a config file ({path}): a secret there sits in "
                              f"plain text; use {s.name}_file (mode 0600) or ${s.env}")
        if s is None:
            raise ConfigError(f"unknown key {key!r} in {path}{_near(key, valid)}")
        value = _check_type(value, s.kind, repr(key), path)
        if s.choices and value not in s.choices:
            raise ConfigError(f"{key!r} in {path} must be one of {', '.join(s.choices)}, not {value!r}")
        if s.path and value and value not in ("auto", "off"):
            value = str(base / os.path.expanduser(value))
        settings[key] = value
    return FileConfig(path, settings, queues)


def _queues(table: dict[str, Any], path: str) -> tuple[QueueDecl, ...]:
    from shmq.api.limits import check_config
    from shmq.names import check_group_name, check_queue_name

    out = []
    for name, body in table.items():
        where = f"[queues.{name}]"
        try:
            check_queue_name(name)
        except ShmqError as e:
            raise ConfigError(f"{where} in {path}: {e}") from None
        body = _check_type(body, dict, where, path)
        limits: dict[str, Any] = {}
        groups: tuple[str, ...] = ()
        for key, value in body.items():
            kind = QUEUE_KEYS.get(key)
            if kind is None:
                raise ConfigError(f"unknown key {key!r} in {where} of {path}{_near(key, list(QUEUE_KEYS))}")
            value = _check_type(value, kind, f"{key!r} of {where}", path)
            if key == "groups":
                try:
                    groups = tuple(check_group_name(g) for g in value)
                except ShmqError as e:
                    raise ConfigError(f"'groups' of {where} in {path}: {e}") from None
            else:
                limits[key] = value
        try:
            check_config(dict(limits))
        except InvalidArgument as e:
            raise ConfigError(f"{where} in {path}: {e}") from None
        out.append(QueueDecl(name, limits, groups, path))
    return tuple(out)


def resolve(given: Mapping[str, Any], sources: Mapping[str, str], path: str | None = None) -> Effective:
    """The settings in effect.  ``given``: each setting's value as the command line parsed it;
    ``sources``: for each, FLAG, ENV or DEFAULT (which of them gave it); ``path``: the config file."""
    file = load(path) if path else FileConfig("", {}, ())
    values: dict[str, Any] = {}
    where: dict[str, str] = {}
    for s in SETTINGS:
        src = sources.get(s.name, DEFAULT)
        if src == FLAG:
            flag = s.off_flag if s.off_flag and not given[s.name] else s.flag  # --no-keep said it
            values[s.name], where[s.name] = given[s.name], f"flag {flag}"
        elif src == ENV:
            values[s.name], where[s.name] = given[s.name], f"env {s.env}"
        elif s.name in file.settings:
            values[s.name], where[s.name] = file.settings[s.name], f"file {path}"
        else:
            values[s.name], where[s.name] = s.default, DEFAULT
    eff = Effective(values, where, file.queues, path)
    # a token and a token file: the one from the stronger source (the file on a tie, as ever)
    if values["token"] and values["token_file"]:
        rank = [FLAG, ENV, FILE, DEFAULT]
        loser = "token_file" if rank.index(where["token"].split()[0]) < rank.index(
            where["token_file"].split()[0]) else "token"
        eff.notes[loser] = "unused: " + ("token" if loser == "token_file" else "token_file") + " wins"
        values[loser] = ""
    return eff


def with_settings(**extra: dict[str, Any]) -> Callable[[_F], _F]:
    """Give a typer command one option per setting, made from its row (flags, default,
    environment variable, help; ``extra[name]``: more ``typer.Option`` arguments), after
    its own first parameter (the context); the command's ``**settings`` receives them."""
    import typer

    def option(s: Setting) -> Any:
        return typer.Option(s.default, f"{s.flag}/{s.off_flag}" if s.off_flag else s.flag, envvar=s.env,
                            help=s.help, show_default=s.shown if s.shown is not None else True,
                            **extra.get(s.name, {}))

    def wrap(func: _F) -> _F:
        sig = inspect.signature(func)
        own = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        kw = inspect.Parameter.KEYWORD_ONLY
        made = [inspect.Parameter(s.name, kw, default=option(s), annotation=s.kind) for s in SETTINGS]
        rest = [p.replace(kind=kw) for p in own[1:]]
        func.__signature__ = sig.replace(parameters=[*own[:1], *made, *rest])  # type: ignore[attr-defined]
        return func

    return wrap


def sources(ctx: Any) -> dict[str, str]:
    """For each setting, whether a click context's command line (FLAG), environment (ENV)
    or default (DEFAULT) gave it (click's ``ParameterSource``, by name)."""
    named = {"COMMANDLINE": FLAG, "ENVIRONMENT": ENV}
    return {s.name: named.get(getattr(ctx.get_parameter_source(s.name), "name", ""), DEFAULT)
            for s in SETTINGS}


def render(eff: Effective, as_json: bool = False) -> str:
    """``--print-config``'s output: TOML (a config file could start from it) or JSON."""
    if not eff["data_dir"]:
        from .journaler import data_dir_for
        eff.notes.setdefault("data_dir", f"{data_dir_for(eff['instance'])} here")
    return render_json(eff) if as_json else render_text(eff)


def _shown(s: Setting, value: Any) -> Any:
    if s.secret:
        return "(set)" if value else "(not set)"
    return value


def render_json(eff: Effective) -> str:
    return json.dumps({
        "config": eff.path,
        "settings": {s.name: {"value": _shown(s, eff[s.name]), "source": eff.sources[s.name],
                              **({"note": eff.notes[s.name]} if s.name in eff.notes else {})}
                     for s in SETTINGS},
        "queues": {q.name: q.as_dict() for q in eff.queues},
    }, indent=2)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | list):
        return json.dumps(value)  # a JSON string or list of strings is TOML too
    return repr(value)


def render_text(eff: Effective) -> str:
    """The settings as TOML (a config file could start from it), each with its source."""
    lines = ["# shmq serve: the settings in effect, and where each comes from",
             "# (a flag, else its $SHMQ_<NAME> variable, else the config file, else the default)"]
    keys = {s.name: s.name if s.in_file else f"# {s.name}" for s in SETTINGS}  # (# : not a file key)
    width = max(map(len, keys.values()))
    for s in SETTINGS:
        value = eff[s.name]
        text = _shown(s, value) if s.secret else _toml(value)
        note = eff.notes.get(s.name, "")
        if s.name == "workers" and not value:
            note = f"CPU count: {min(os.cpu_count() or 1, options.MAX_WORKERS)} here"
        comment = eff.sources[s.name] + (f" ({note})" if note else "")
        lines.append(f"{keys[s.name]:<{width}} = {text:<24} # {comment}")
    for q in eff.queues:
        lines.append(f"\n[queues.{q.name}]  # file {q.origin}")
        lines += [f"{k} = {_toml(v)}" for k, v in q.as_dict().items()]
    return "\n".join(lines)


__all__ = ["ConfigError", "DEFAULT", "ENV", "FILE", "FLAG", "Effective", "FileConfig", "QueueDecl",
           "SETTINGS", "SETTING", "Setting", "load", "render", "render_json", "render_text", "resolve",
           "sources", "with_settings"]
