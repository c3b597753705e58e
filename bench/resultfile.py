"""The results file that ``bench/sweep.py`` writes and ``bench/plot.py`` reads: its schema,
the machine facts it records, and loading it with clear errors.

Schema ``shmq-bench/1``: one JSON object per run, ``bench/results/<date>-<host>.json``::

    schema    "shmq-bench/1"
    date      start of the run, ISO 8601 in UTC ("2026-11-24T22:10:00+00:00")
    command   the command line that produced the file
    machine   host, cpus, cpu_model, python, platform, shmq_commit, shmq_dirty,
              load_avg_start / load_avg_end (1, 5, 15 min), and versions of the peers
    config    the sweep's settings (rounds, message counts, ...), for the record
    figures   {figure id: FIGURE}, the ids being FIGURES below

    FIGURE    title, x_label, y_label (with units), note (what was measured, one line),
              series: [SERIES], not_measured: {series name: why} (e.g. "Redis": "no redis-server")
    SERIES    name, x: [number], median: [number | null] (null: every round failed),
              optional min / max: [number | null] (the spread over the rounds),
              optional runs: [[number | null]] (each round, per x), messages: [int] (per x)

``bench/bench_peers.py`` writes the same schema (``<date>-<host>-peers.json``), with keys of its own
beside these: ``peers`` (each one's version and settings, or why it was not measured), ``work_queue``,
``ping_pong`` (every run) and ``targets``.

Units: payload and batch sizes in messages or bytes as the x_label says, throughput in
msgs/s, latency in µs.  In ``latency_cdf`` x is the cumulative fraction (0-1) and
median / min / max are the round-trip times (µs) at that fraction.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

SCHEMA = "shmq-bench/1"
FIGURES = ("throughput_vs_size", "throughput_vs_batch", "latency_cdf", "throughput_vs_workers")
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "bench" / "results"


class ResultsError(ValueError):
    """A results file that cannot be read or does not follow the schema."""


# =============================================================== machine facts
def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def host_name() -> str:
    """The short host name, safe in a file name."""
    name = socket.gethostname().split(".")[0] or "host"
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)


def machine_facts() -> dict[str, Any]:
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"host": host_name(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "python": platform.python_version(), "platform": platform.platform(),
            "shmq_commit": _git("rev-parse", "--short=10", "HEAD"),
            "shmq_dirty": None if status is None else bool(status),
            "load_avg_start": [round(v, 2) for v in os.getloadavg()]}


def begin(out: str | None, tag: str = "") -> tuple[str, dict[str, Any], Path]:
    """A run's start: its date (UTC, ISO, to the second), the machine's facts, and the file
    it writes (``out``, else ``default_path``'s)."""
    date = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
    machine = machine_facts()
    return date, machine, Path(out) if out else default_path(date, machine["host"], tag)


def default_path(date: str, host: str, tag: str = "") -> Path:
    """``bench/results/<date>-<host>.json`` (``<date>-<host>-<tag>.json`` with a ``tag``), with ``-2``,
    ``-3``, ... for a later run the same day."""
    stem = f"{date[:10]}-{host}" + (f"-{tag}" if tag else "")
    path = RESULTS_DIR / f"{stem}.json"
    k = 2
    while path.exists():
        path = RESULTS_DIR / f"{stem}-{k}.json"
        k += 1
    return path


def write(path: Path, data: dict[str, Any]) -> None:
    validate(data, str(path))  # never write a file that plot.py would refuse
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.write("\n")


# =============================================================== loading
def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a results file; ResultsError says what is wrong and where."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ResultsError(f"{path}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    validate(data, str(path))
    return data  # type: ignore[no-any-return]


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise ResultsError(f"{where}: {what}")


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def validate(data: Any, where: str = "results") -> None:
    _need(isinstance(data, dict), where, "expected a JSON object at the top")
    _need(data.get("schema") == SCHEMA, where,
          f"schema is {data.get('schema')!r}, expected {SCHEMA!r} (is this a bench/sweep.py results file?)")
    for key, kind in (("date", str), ("command", str), ("machine", dict), ("figures", dict)):
        _need(isinstance(data.get(key), kind), where, f"{key!r} is missing or not a {kind.__name__}")
    figures = data["figures"]
    _need(bool(figures), where, "'figures' is empty")
    for fid, fig in figures.items():
        fw = f"{where}: figure {fid!r}"
        _need(fid in FIGURES, where, f"unknown figure {fid!r} (known: {', '.join(FIGURES)})")
        _need(isinstance(fig, dict), fw, "expected an object")
        for key in ("title", "x_label", "y_label"):
            _need(isinstance(fig.get(key), str), fw, f"{key!r} is missing or not a string")
        _need(isinstance(fig.get("series"), list), fw, "'series' is missing or not a list")
        nm = fig.get("not_measured", {})
        _need(isinstance(nm, dict) and all(isinstance(v, str) for v in nm.values()), fw,
              "'not_measured' must map series names to reasons")
        _need(bool(fig["series"]) or bool(nm), fw, "no series, and none listed as not measured")
        for i, s in enumerate(fig["series"]):
            _validate_series(s, f"{fw}, series {i}")


def _validate_series(s: Any, where: str) -> None:
    _need(isinstance(s, dict), where, "expected an object")
    _need(isinstance(s.get("name"), str), where, "'name' is missing or not a string")
    where = f"{where} ({s['name']!r})"
    xs = s.get("x")
    _need(isinstance(xs, list) and bool(xs) and all(_is_num(v) for v in xs), where,
          "'x' must be a non-empty list of numbers")
    for key in ("median", "min", "max"):
        if key == "median" or key in s:
            v = s.get(key)
            _need(isinstance(v, list) and len(v) == len(xs), where,
                  f"{key!r} must be a list as long as 'x' ({len(xs)})")
            _need(all(e is None or _is_num(e) for e in v), where,
                  f"{key!r} holds a value that is not a number")
    if "runs" in s:
        _need(isinstance(s["runs"], list) and len(s["runs"]) == len(xs), where,
              f"'runs' must be a list as long as 'x' ({len(xs)})")


def main() -> int:
    """``python bench/resultfile.py FILE...``: check results files."""
    code = 0
    for path in sys.argv[1:]:
        try:
            load(path)
            print(f"{path}: ok")
        except ResultsError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
