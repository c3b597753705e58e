"""Every test in tests/crash/ SIGKILLs processes and checks recovery: marked ``crash``, which
``make check`` leaves out (``make test`` runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.marks import mark_folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.crash)
