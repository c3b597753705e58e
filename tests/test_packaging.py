"""What ``pip install`` (not editable) ships: every package of the source tree is listed in
pyproject.toml, which names them one by one (server/ installs as shmq.server)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_of_the_tree_is_installed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "shmq").rglob("__init__.py")}
    tree.add("shmq.server")  # the folder server/, installed under shmq
    assert listed == tree
