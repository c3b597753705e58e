"""The ``shmq`` command line (typer).  More commands arrive with the server."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from . import __version__
from .reclaim import reclaim, scan

app = typer.Typer(help="shmq: a message broker for one host.", no_args_is_help=True,
                  add_completion=False)
console = Console()


@app.command()
def version() -> None:
    """Print the version."""
    print(__version__)


@app.command()
def doctor(
    clean: bool = typer.Option(False, "--clean", help="remove what belongs to dead instances"),
    instance: str | None = typer.Option(None, "--instance", "-i", help="only this instance"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """List shmq shared memory on this host; with --clean, reclaim dead instances' objects.

    Example: shmq doctor --clean
    """
    reports = reclaim(instance) if clean else scan(instance)
    if as_json:
        print(json.dumps([r.__dict__ for r in reports], indent=2))
        return
    table = Table("instance", "state", "queues", "objects", "why")
    for r in reports:
        state = "live" if r.alive else ("reclaimed" if clean else "dead")
        table.add_row(r.instance, state, str(r.queues), str(len(r.objects)), r.reason)
    console.print(table if reports else "no shmq shared memory on this host")


def main() -> None:  # pragma: no cover
    app()
