"""``shmq.spark.register`` checks the Python of Spark's workers first (``shmq.spark.workers``):
without a JVM here, on a stand-in session, with stand-in Pythons (shell scripts)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import shmq
from shmq.spark import workers


class _Context:
    def __init__(self, python: str, master: str) -> None:
        self.pythonExec, self.master = python, master


class _Conf:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)


class _Session:
    """What ``check`` reads of a SparkSession: its SparkContext's master and pythonExec, its conf."""

    def __init__(self, python: str, master: str = "local[2]", conf: dict[str, str] | None = None) -> None:
        self.sparkContext = _Context(python, master)
        self.conf = _Conf(conf or {})


class _Connect:
    """A Spark Connect session: it has no SparkContext."""

    @property
    def sparkContext(self) -> Any:
        raise RuntimeError("[JVM_ATTRIBUTE_NOT_SUPPORTED] Attribute `sparkContext` is not supported")


@pytest.fixture
def system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for a system ``python3`` without pyarrow: it says so as the check's Python
    would, and counts its runs in ``runs``; nothing chosen (no $PYSPARK_PYTHON)."""
    py = tmp_path / "python3"
    py.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\necho pyarrow\nexit 1\n")
    py.chmod(0o755)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    workers.cannot_import.cache_clear()
    return py


def _runs(system: Path) -> int:
    runs = system.parent / "runs"
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def test_the_check_says_what_a_python_cannot_import(system: Path, tmp_path: Path) -> None:
    assert workers.cannot_import(str(system)) == "cannot import pyarrow"
    assert workers.cannot_import(str(system)) == "cannot import pyarrow" and _runs(system) == 1  # cached
    assert workers.cannot_import(sys.executable) == ""  # this venv's: shmq and pyarrow
    assert workers.cannot_import(str(tmp_path / "none")).startswith("cannot be run (")


def test_nothing_chosen_the_workers_run_the_drivers_python(system: Path) -> None:
    session = _Session(str(system))
    workers.check(session)
    assert session.sparkContext.pythonExec == sys.executable


def test_spark_pyspark_python_that_pyspark_ignored_is_what_the_workers_run(system: Path) -> None:
    wanted = sys.executable + "3"  # another name of a Python that imports both (the venv's python3)
    assert os.path.exists(wanted)
    session = _Session(str(system), conf={"spark.pyspark.python": wanted})
    workers.check(session)
    assert session.sparkContext.pythonExec == wanted


def test_a_chosen_python_that_cannot_is_an_error_saying_the_fix(system: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYSPARK_PYTHON", str(system))
    session = _Session(str(system))
    with pytest.raises(shmq.InvalidArgument) as info:
        workers.check(session)
    assert str(info.value) == (
        f"Spark's Python workers run {system}, which cannot import pyarrow: set PYSPARK_PYTHON="
        f"{sys.executable} before creating the SparkSession (spark-submit: --conf spark.pyspark.python=...)")
    assert session.sparkContext.pythonExec == str(system)  # left as chosen


def test_a_python_that_can_is_left_alone_and_asked_once(system: Path) -> None:
    for _ in range(2):
        session = _Session(sys.executable)
        workers.check(session)
        assert session.sparkContext.pythonExec == sys.executable
    assert workers.cannot_import.cache_info().misses == 1


def test_a_cluster_and_spark_connect_are_not_checked_here(system: Path) -> None:
    session = _Session(str(system), master="spark://spark-master:7077")
    workers.check(session)  # its workers' Python is on other hosts
    assert session.sparkContext.pythonExec == str(system) and _runs(system) == 0
    workers.check(_Connect())
    assert _runs(system) == 0
