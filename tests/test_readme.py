"""The README's promises: its quick start and Python section run as written, and every test
its guarantee table names exists."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server import Server

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def test_every_test_the_readme_names_exists() -> None:
    named = re.findall(r"`(tests/(?:\w+/)?test_\w+\.py)(?:::(\w+))?`", README)
    assert len(named) >= 10, named
    for path, name in named:
        f = ROOT / path
        assert f.is_file(), f"README names {path}, which does not exist"
        if name:
            tree = ast.parse(f.read_text())
            tests = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            assert name in tests, f"README names {path}::{name}, which does not exist"


def test_the_cli_list_names_every_command() -> None:
    import typer.main

    from shmq.cli.app import app
    listed = re.search(r"The CLI: `shmq ([^`]+)`", README)
    assert listed, "the README's list of commands is gone"
    names = {n.strip() for n in listed.group(1).split("|")}
    assert names == set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_the_mp_snippet_runs_as_written_and_leaves_nothing(tmp_path: Path) -> None:
    from tests.support.instances import leftovers
    code = [b for b in _blocks("python") if "from shmq import mp" in b][0]
    (tmp_path / "snippet.py").write_text(code)  # spawn and forkserver children import __main__
    with subprocess.Popen([sys.executable, "snippet.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as p:
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert out.splitlines() == ["[0, 2, 4]"]
    assert leftovers(f"mp-{p.pid}-") == []  # its queues went with it


def test_the_celery_snippet_makes_an_app_on_the_shmq_transport() -> None:
    code = [b for b in _blocks("python") if "import shmq.kombu" in b][0]
    scope: dict[str, object] = {}
    exec(code, scope)  # makes the app; nothing connects until a task is sent
    from shmq.kombu import Transport
    with scope["app"].connection_for_write() as conn:  # type: ignore[attr-defined]
        assert isinstance(conn.transport, Transport)


def test_the_readme_names_only_the_two_set_up_commands() -> None:
    first = _blocks("")[0]
    assert [line.split()[:2] for line in first.splitlines()] == [["make", "run"], ["make", "test"]]


@pytest.mark.slow
def test_the_quick_start_then_the_python_section_run_as_written(tmp_path: Path) -> None:
    quick = _blocks("")[1]
    python = [b for b in _blocks("python") if "shmq.connect" in b][0]
    assert quick.count(".venv/bin/shmq") == 4
    srv = Server(workers=2)
    try:
        # the quick start's commands, as typed in the repository: .venv/bin/shmq is this venv's
        venv_bin = tmp_path / ".venv" / "bin"
        venv_bin.mkdir(parents=True)
        (venv_bin / "shmq").symlink_to(Path(sys.executable).parent / "shmq")
        env = {**os.environ, "SHMQ_URL": srv.url}
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", quick], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # consume -n 3 printed the three messages with their offsets; stats counted them
        printed = re.findall(r"^\[(\d+)\] (\d)$", r.stdout, re.M)
        assert printed == [("0", "1"), ("1", "2"), ("2", "3")], r.stdout
        assert "3 produced" in r.stdout
        code = python.replace("tcp://127.0.0.1:7878", srv.url)
        assert code != python
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["b'order #42'", "[b'order #42', b'a', b'b']", "1002"], r.stdout
        # and again, as a reader trying it twice would: the group it makes exists now (exist_ok)
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        # billing's depth: the first run's 1002, the second's 1005, less the 100 it got this time
        assert r.stdout.splitlines()[-1] == str(1002 + 1005 - 100), r.stdout
    finally:
        assert srv.stop() == 0
