"""The compiled accelerator itself, for tests that compare it with its pure twins."""

from __future__ import annotations

import importlib
from types import ModuleType

IMPLS = ["compiled", "pure"]


def compiled() -> ModuleType:
    """The extension itself (``make test`` builds it; importable even under SHMQ_PURE)."""
    return importlib.import_module("shmq._speedups")
