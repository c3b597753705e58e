"""Every test in tests/spark/ imports pyspark (and some start a Spark session): marked ``spark``,
which ``make check`` leaves out (``make test`` runs it, after checking for Java)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.marks import mark_folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.spark)
