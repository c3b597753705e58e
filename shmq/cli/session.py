"""How a CLI command reaches the broker, says what went wrong, and stops on Ctrl-C.

The options that choose the broker (``--url``, ``--shm``, ``--token``, ``--token-file``)
are declared here once, for every command.  ``session(...)`` (a ``Session``) is the
broker handle of one command: TCP (over this user's
Unix socket beside a loopback port when the broker has one), or with ``--shm NAME`` the
shared memory of a *running* instance: a name that is no instance is an error, never a
new instance.  An shmq error is one line on stderr and exit 1 (``fail``).

Ctrl-C ends a command with exit code 130 (``INTERRUPTED``), no traceback.  A command that
loops (``consume``, ``produce``, ``dlq --redrive``) runs its loop under ``Stop``: Ctrl-C
then only asks the loop to stop after the message in hand (so no shared-memory update is
cut in the middle, and nothing received is left half done); a second Ctrl-C stops at once.
A command that waits (for messages, for room in a full queue) says so on stderr once it has
waited ``WAIT_NOTICE`` (``Waiting``), so a silent terminal is never a mystery.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from shmq import options
from shmq.errors import ConnectionLost, InstanceNotFound, ShmqError

if TYPE_CHECKING:
    from shmq.api import Broker

INTERRUPTED = 130  # the exit code of a command ended by Ctrl-C (128 + SIGINT, as shells report it)
BROKEN_PIPE = 141  # consume's, when its reader went away (128 + SIGPIPE)
SLICE = 0.25  # s: the longest wait of a loop under Stop before it looks at the flag again
WAIT_NOTICE = 1.0  # s a command waits (for messages, for room) before it says so on stderr

UrlOpt = typer.Option(None, "--url", envvar="SHMQ_URL", show_default=options.DEFAULT_URL,
                      help="the broker: tcp://HOST:PORT, tcps://HOST:PORT?ca=FILE or unix://PATH; "
                           "a comma-separated list of them (a primary and its standbys) fails over")
ShmOpt = typer.Option(None, "--shm", metavar="INSTANCE",
                      help="attach the shared memory of this running broker's instance (shmq serve "
                           "--instance) instead of TCP")
JsonOpt = typer.Option(False, "--json", help="machine-readable output")
QueueArg = typer.Argument(..., metavar="QUEUE", help="the queue's name")


def warn_argv_token(value: str | None) -> str | None:
    """A token typed on the command line is in every local user's ``ps``: say so."""
    if value and any(a == "--token" or a.startswith("--token=") for a in sys.argv[1:]):
        note(f"warning: --token on the command line is visible to every local user "
             f"(ps, /proc/PID/cmdline); set ${options.TOKEN_ENV} or use --token-file instead")
    return value


def token(token: str | None, token_file: str | None) -> str | None:
    """The token: ``--token-file`` (the file's first line), else ``--token`` / $SHMQ_TOKEN."""
    if not token_file:
        return token
    try:
        with open(token_file) as f:
            return f.readline().strip()
    except OSError as e:
        fail(ShmqError(f"cannot read the token file {token_file}: {e.strerror or e}"))


TokenOpt = typer.Option(None, "--token", envvar=options.TOKEN_ENV, callback=warn_argv_token,
                        show_default="this user's broker's own, left in the runtime folder",
                        help=f"auth token (prefer ${options.TOKEN_ENV} or --token-file: argv is public)")
TokenFileOpt = typer.Option(None, "--token-file", help="read the auth token from this file's first line")


def fail(e: BaseException | str) -> NoReturn:
    """One line on stderr (``error: ...``, with the status name of an shmq error), exit 1."""
    code = getattr(e, "code", None)
    name = getattr(code, "name", None)
    if type(e) is OSError and e.strerror and not e.filename:  # a sentence of ours: without "[Errno N]"
        error(e.strerror)
    else:
        error(f"{e}" + (f" ({name})" if name else ""))
    raise typer.Exit(1)


def error(text: str) -> None:
    """``error: text`` on stderr, ``error`` in red on a terminal."""
    red = sys.stderr.isatty() and "NO_COLOR" not in os.environ
    print(("\x1b[31merror\x1b[0m: " if red else "error: ") + text, file=sys.stderr, flush=True)


def note(text: str) -> None:
    """A line for the human on stderr (never in the way of stdout's output)."""
    print(text, file=sys.stderr, flush=True)


def broker(url: str | None, shm: str | None, token: str | None) -> Broker:
    """The broker handle of a CLI command.  A ``tcp://`` URL on loopback goes over the Unix
    socket that this user's broker on that port listens on beside it, when it has one
    (``shmq serve --unix auto``, the default): no TCP stack, and no token needed.  A
    comma-separated list of URLs goes to ``shmq.connect`` as it is: the list's primary, failing
    over (``shmq.client.failover``)."""
    from shmq import connect

    if shm:
        try:
            return connect(f"shm://{shm}", token=token, create=False)
        except InstanceNotFound as e:
            raise InstanceNotFound(f"{e} (is shmq serve running? --shm attaches a running broker's "
                                   "instance)") from None
    url = url or options.DEFAULT_URL
    if url.startswith("tcp://") and "?" not in url and "," not in url:  # (a list fails over: as given)
        from shmq import runtime
        from shmq.urls import parse_tcp_url

        path = runtime.local_socket(*parse_tcp_url(url))
        if path is not None:
            try:
                return connect(f"unix://{path}", token=token)
            except ConnectionLost:
                pass  # left by a broker that is gone: TCP says what is there now
    return connect(url, token=token)


class Session:
    """``with Session(url, shm, token) as b:``: the broker, closed at the end; an shmq
    error inside is ``fail``, Ctrl-C is exit ``INTERRUPTED``."""

    def __init__(self, url: str | None, shm: str | None, token: str | None) -> None:
        self.args = (url, shm, token)
        self.b: Broker | None = None

    def __enter__(self) -> Broker:
        try:
            self.b = broker(*self.args)
        except (ShmqError, OSError) as e:
            fail(e)
        except KeyboardInterrupt:
            raise typer.Exit(INTERRUPTED) from None
        return self.b

    def __exit__(self, et: Any, e: Any, tb: Any) -> None:
        if self.b is not None:
            try:
                self.b.close()
            except Exception:  # noqa: BLE001 - the command's own outcome is what matters
                pass
        if isinstance(e, ShmqError):
            fail(e)
        if isinstance(e, KeyboardInterrupt):
            raise typer.Exit(INTERRUPTED) from None


class Stop:
    """Ctrl-C as a request: ``with Stop() as stop:`` … ``if stop.requested: break``.  The
    first SIGINT sets ``requested``; a second raises KeyboardInterrupt as usual.  Outside
    the main thread, or not ``enabled``, it changes nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.requested = False
        self.enabled = enabled
        self._old: Any = None

    def __enter__(self) -> Stop:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


class Waiting:
    """A command's wait (for a message, for room in a full queue), said on stderr: call
    ``tick()`` at each try while it waits (the first starts it); once it has lasted ``WAIT_NOTICE``
    seconds, the line ``say()`` makes goes to stderr (stdout keeps only the command's
    output), once per wait -- or once per command with ``once``.  ``over()`` ends a wait
    (saying ``again()``'s line if the wait was said); the next ``tick()`` starts another."""

    def __init__(self, say: Callable[[], str], again: Callable[[], str] | None = None,
                 once: bool = False) -> None:
        self.say, self.again, self.once = say, again, once
        self.since = 0.0  # when this wait began (0: no wait now)
        self.said = False  # this wait was said
        self.ever = False  # some wait was said

    def tick(self) -> float:
        """Seconds this wait has lasted (0 at its first try); says it once it is WAIT_NOTICE."""
        now = time.monotonic()
        if not self.since:
            self.since = now
        waited = now - self.since
        if waited >= WAIT_NOTICE and not self.said and not (self.once and self.ever):
            note(self.say())
            self.said = self.ever = True
        return waited

    def over(self) -> None:
        if self.said and self.again is not None:
            note(self.again())
        self.since, self.said = 0.0, False


def session(url: str | None, shm: str | None, token_: str | None, token_file: str | None) -> Session:
    """The ``Session`` of a command's ``--url``, ``--shm``, ``--token`` and ``--token-file``."""
    return Session(url, shm, token(token_, token_file))
