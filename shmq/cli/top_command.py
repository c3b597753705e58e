"""The ``shmq top`` command: its options, registered on the CLI's app by ``shmq.cli.app``.

It is kept apart from ``cli.py``, which holds every other command, for size only.  What
it shares with them -- the connection options and the session that turns a broker
error into one line and exit 1 -- comes from there as arguments, so this module
imports nothing of the CLI, and the dashboard (``shmq.cli.top``, rich's Live) loads only
when the command runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import typer

from shmq import options

if TYPE_CHECKING:
    from shmq.api import Broker

Session = Callable[[str | None, str | None, str | None], AbstractContextManager["Broker"]]


def register_top(app: typer.Typer, session: Session, token_of: Callable[[str | None, str | None], str | None],
                 url_opt: Any, shm_opt: Any, token_opt: Any, token_file_opt: Any) -> None:
    """Add ``shmq top`` to ``app``; ``token_of(token, token_file)`` is the token to present."""

    @app.command()
    def top(url: str | None = url_opt, shm: str | None = shm_opt, token: str | None = token_opt,
            token_file: str | None = token_file_opt,
            interval: float = typer.Option(options.TOP_INTERVAL, help="seconds between refreshes"),
            sort: str = typer.Option("queue", help="the column to sort by first: queue, in, out, depth, "
                                                   "inflight, lag, dlq or durability"),
            filter_: str = typer.Option("", "--filter", help="only the queues whose name contains this"),
            once: bool = typer.Option(False, "--once", help="print one frame (rates over one --interval) "
                                                            "and exit"),
            ) -> None:
        """A live dashboard of every queue: messages in and acks out per second, depth (and its
        recent history), in flight, each group's lag, dead letters, durability.

        Keys: q quits (so does Ctrl-C); 1-8 sort by that column (again: the other way);
        the slash key types a name filter on the last line (Enter applies it, Esc clears it).

        Example: shmq top --sort depth
        """
        from shmq.cli.top import run

        with session(url, shm, token_of(token, token_file)) as b:
            run(b, b.url, interval, sort, filter_, once)
