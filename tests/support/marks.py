"""Marks given by folder: a folder's ``conftest.py`` marks every test collected under it."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_folder(items: list[pytest.Item], folder: Path, mark: pytest.MarkDecorator) -> None:
    """Add ``mark`` to each of ``items`` whose file is under ``folder``.  (A conftest's
    ``pytest_collection_modifyitems`` sees every item of the session, not only its folder's.)"""
    for item in items:
        if item.path.is_relative_to(folder):
            item.add_marker(mark)
