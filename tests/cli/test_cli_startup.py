"""What a CLI call loads: each is a new process, so ``import shmq.cli`` stays light (no
rich, no pydantic, no transport), and a command loads only what it uses.  Checked by the
modules loaded, in a subprocess, not by timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ["rich", "pydantic", "pyspark", "pyarrow", "ssl", "posix_ipc", "shmq.api", "shmq.client.tcp",
         "shmq.core.colocated", "shmq.core.cleanup", "shmq.progress", "shmq.runtime", "shmq.urls",
         "shmq.server.supervisor", "shmq.server.worker"]  # the settings table, shmq.server.config, is light


def loaded_after(code: str) -> list[str]:
    """Which of HEAVY the interpreter holds after ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=60, check=True)
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def run_cli(*args: str) -> str:
    return ("import sys\nsys.argv = ['shmq', " + ", ".join(map(repr, args)) + "]\n"
            "from shmq.cli.app import app\ntry:\n    app()\nexcept SystemExit:\n    pass")


def test_importing_the_cli_loads_nothing_heavy() -> None:
    assert loaded_after("import shmq.cli.app") == []


@pytest.mark.parametrize(("args", "allowed"), [
    (("--version",), []), (("version",), []),
    (("create", "q", "--shm", "no-such-instance-here"), ["posix_ipc", "shmq.api", "shmq.core.colocated"]),
    (("consume", "q", "-n", "nope"), ["rich"]),  # typer draws a usage error's box with rich
    (("produce", "q", "x", "--url", "tcp://127.0.0.1:1"), ["shmq.api", "shmq.client.tcp", "shmq.progress",
                                                        "shmq.runtime", "shmq.urls"]),  # no ssl: no TLS
])
def test_a_command_loads_only_what_it_uses(args: tuple[str, ...], allowed: list[str]) -> None:
    """``--version`` loads nothing heavy; a missing instance is told without rich or a
    transport of the network; a bad value without pydantic; a plain TCP client without ssl."""
    assert set(loaded_after(run_cli(*args))) <= set(allowed)


def test_typers_pydantic_coercion_is_replaced_for_plain_parameters() -> None:
    """typer coerces through pydantic (120 ms to import); ``cli_params`` does it without.  A
    typer whose hook moved fails here: the CLI still works, but starts slowly."""
    from shmq.cli import params as cli_params

    assert cli_params.install() is True
    assert "pydantic" not in loaded_after(run_cli("consume", "q", "-n", "nope", "--timeout", "x"))
