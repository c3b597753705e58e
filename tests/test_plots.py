"""bench/plot.py renders the benchmark plots from a results file (bench/resultfile.py's schema).

The results here are written by hand: these tests check the renderer and the file's
checks, not any performance."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from PIL import Image

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import plot  # noqa: E402
import resultfile  # noqa: E402
import sweep  # noqa: E402
from common import Out, TrialError  # noqa: E402


def _series(name: str, xs: Sequence[float], med: Sequence[float | None]) -> dict[str, Any]:
    return {"name": name, "x": xs, "median": med,
            "min": [None if v is None else v * 0.9 for v in med],
            "max": [None if v is None else v * 1.1 for v in med]}


def results() -> dict[str, Any]:
    sizes = [64, 1024, 65536]
    levels = [0.01, 0.5, 0.9, 0.99, 0.999]
    return {
        "schema": resultfile.SCHEMA, "date": "2026-11-24T22:00:00+00:00",
        "command": "python bench/sweep.py --quick",
        "machine": {"host": "testhost", "cpus": 2, "cpu_model": "Test CPU", "python": "3.11.7",
                    "shmq_commit": "abc1234567", "shmq_dirty": False, "load_avg_start": [1.5, 1.0, 0.5]},
        "config": {"rounds": 1},
        "figures": {
            "throughput_vs_size": {
                "title": "Throughput vs payload size", "x_label": "payload size (bytes)",
                "y_label": "throughput (msgs/s)", "note": "hand-written",
                "series": [_series("shmq shm", sizes, [800e3, 400e3, 6e3]),
                           _series("shmq tcp", sizes, [150e3, 90e3, 1.5e3]),
                           _series("faster-fifo", sizes, [130e3, None, 4.5e3]),
                           _series("Redis lists", sizes, [120e3, 80e3, 1e3])],
                "not_measured": {}},
            "throughput_vs_batch": {
                "title": "Throughput vs batch size", "x_label": "messages per call",
                "y_label": "throughput (msgs/s)",
                "series": [_series("shmq shm", [1, 10, 100], [1e5, 4e5, 8e5]),
                           _series("shmq tcp", [1, 10, 100], [2e3, 2e4, 1.7e5])]},
            "latency_cdf": {
                "title": "Ping-pong latency CDF", "x_label": "round-trip time (µs)",
                "y_label": "fraction of round trips",
                "series": [_series("shmq shm", levels, [10, 13, 20, 120, 300]),
                           _series("mp.Queue", levels, [120, 170, 220, 330, 900])],
                "not_measured": {}},
            "throughput_vs_workers": {
                "title": "Throughput vs workers", "x_label": "workers", "y_label": "msgs/s",
                "series": [_series("shmq tcp", [1, 2], [3600, 3100])], "not_measured": {}},
        },
    }


def write(tmp_path: Path, data: Any, name: str = "r.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def texts(fig: Any) -> str:
    """Every piece of text drawn in a figure (titles, labels, legends, captions)."""
    return "\n".join(t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")))


def test_renders_the_four_plots_as_valid_pngs(tmp_path: Path) -> None:
    paths = plot.render_file(write(tmp_path, results()), tmp_path / "png")
    assert [p.name for p in paths] == [f"{f}.png" for f in resultfile.FIGURES]
    for p in paths:
        with Image.open(p) as im:
            im.verify()  # a complete, uncorrupted PNG
        with Image.open(p) as im:
            assert im.format == "PNG"
            assert im.size == (round(plot.SIZE_IN[0] * plot.DPI), round(plot.SIZE_IN[1] * plot.DPI))
            darkest, lightest = im.convert("L").getextrema()
            assert isinstance(darkest, int) and isinstance(lightest, int)
            assert lightest - darkest > 100  # something is drawn on the white


def test_default_out_folder_is_beside_the_results_file(tmp_path: Path) -> None:
    paths = plot.render_file(write(tmp_path, results(), "2026-11-24-testhost.json"))
    assert {p.parent for p in paths} == {tmp_path / "2026-11-24-testhost"}


def test_figures_carry_titles_machine_date_and_legend() -> None:
    data = results()
    for fid in resultfile.FIGURES:
        fig = plot.figure(data, fid)
        try:
            drawn = texts(fig)
            assert data["figures"][fid]["title"] in drawn
            assert "testhost, 2 CPUs (Test CPU), 2026-11-24" in drawn
            assert "python bench/sweep.py --quick" in drawn
            for s in data["figures"][fid]["series"]:
                assert s["name"] in drawn
            assert all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)
        finally:
            plt.close(fig)
    fig = plot.figure(data, "throughput_vs_size")
    try:
        assert all(ax.get_xscale() == "log" and ax.get_yscale() == "log" for ax in fig.axes)
    finally:
        plt.close(fig)


def test_a_series_not_measured_still_renders_and_says_so(tmp_path: Path) -> None:
    data = results()
    fig_size = data["figures"]["throughput_vs_size"]
    fig_size["series"] = [s for s in fig_size["series"] if not s["name"].startswith("Redis")]
    fig_size["not_measured"] = {"Redis": "no redis-server"}
    paths = plot.render_file(write(tmp_path, data), tmp_path / "png")
    assert len(paths) == 4
    fig = plot.figure(data, "throughput_vs_size")
    try:
        box = fig.axes[0].get_legend()
        assert box is not None
        legend = [t.get_text() for t in box.get_texts()]
        assert "Redis: not measured (no redis-server)" in legend
        assert "Redis lists" not in legend
        assert "Redis: not measured (no redis-server)" in plot.caption(data, fig_size)
    finally:
        plt.close(fig)


def test_a_figure_with_only_unmeasured_series_renders(tmp_path: Path) -> None:
    data = results()
    data["figures"] = {"throughput_vs_size": {**data["figures"]["throughput_vs_size"], "series": [],
                                              "not_measured": {"Redis": "no redis-server"}}}
    paths = plot.render_file(write(tmp_path, data), tmp_path / "png")
    assert [p.name for p in paths] == ["throughput_vs_size.png"]


def test_a_series_whose_every_run_failed_is_named() -> None:
    data = results()
    data["figures"]["throughput_vs_batch"]["series"][1]["median"] = [None, None, None]
    fig = plot.figure(data, "throughput_vs_batch")
    try:
        assert "shmq tcp (every run failed)" in texts(fig)
    finally:
        plt.close(fig)


def _broken(change: Any) -> dict[str, Any]:
    data = copy.deepcopy(results())
    change(data)
    return data


@pytest.mark.parametrize(("data", "message"), [
    ("{not json", "not JSON"),
    ("[]", "expected a JSON object"),
    (_broken(lambda d: d.update(schema="other/2")), "schema is 'other/2'"),
    (_broken(lambda d: d.pop("machine")), "'machine' is missing"),
    (_broken(lambda d: d["figures"].update(pie_chart=d["figures"]["latency_cdf"])),
     "unknown figure 'pie_chart'"),
    (_broken(lambda d: d["figures"]["throughput_vs_batch"]["series"][0]["median"].pop()),
     "figure 'throughput_vs_batch', series 0 ('shmq shm'): 'median' must be a list as long as 'x' (3)"),
    (_broken(lambda d: d["figures"]["latency_cdf"]["series"][1]["max"].__setitem__(0, "fast")),
     "'max' holds a value that is not a number"),
    (_broken(lambda d: d["figures"]["throughput_vs_workers"].update(series=[], not_measured={})),
     "no series, and none listed as not measured"),
])
def test_a_malformed_results_file_is_refused_clearly(tmp_path: Path, data: Any, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(resultfile.ResultsError) as e:
        plot.render_file(path, tmp_path / "png")
    assert str(e.value).startswith(str(path))
    assert message in str(e.value)
    assert not (tmp_path / "png").exists()


def test_the_command_line_reports_a_malformed_file(tmp_path: Path) -> None:
    path = write(tmp_path, _broken(lambda d: d["figures"]["throughput_vs_size"]["series"][0].pop("x")))
    r = subprocess.run([sys.executable, str(BENCH / "plot.py"), str(path), "--out", str(tmp_path / "png")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("error: ")
    assert "'x' must be a non-empty list of numbers" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "png").exists()


def test_writing_refuses_what_plot_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(resultfile.ResultsError, match="'figures' is empty"):
        resultfile.write(tmp_path / "r.json", {**results(), "figures": {}})
    assert not (tmp_path / "r.json").exists()


def test_sweep_interleaves_the_series_and_keeps_failed_rounds() -> None:
    calls: list[tuple[str, int]] = []

    def measure(name: str, fail_at: int | None = None) -> Any:
        def fn(x: int) -> float:
            calls.append((name, x))
            if x == fail_at and sum(c == (name, x) for c in calls) == 2:
                raise TrialError("child crashed")
            return float(x * (10 if name == "a" else 1) + len(calls))
        return fn

    out = sweep.sweep(Out(label_columns=1), "t", [1, 2], {"a": measure("a"), "b": measure("b", fail_at=2)}, 3,
                      lambda _n, x: 100 * x)
    assert calls == [("a", 1), ("b", 1)] * 3 + [("a", 2), ("b", 2)] * 3  # round by round, series in turn
    a, b = out
    assert a["runs"] == [[11.0, 13.0, 15.0], [27.0, 29.0, 31.0]]
    assert a["median"] == [13.0, 29.0] and a["min"] == [11.0, 27.0] and a["max"] == [15.0, 31.0]
    assert b["runs"][1] == [10.0, None, 14.0]  # the failed round is kept as null, not dropped
    assert b["median"][1] == 12.0 and b["min"][1] == 10.0 and b["max"][1] == 14.0
    assert a["messages"] == [100, 200]
    resultfile.validate({**results(), "figures": {"throughput_vs_batch": {
        "title": "t", "x_label": "x", "y_label": "y", "series": out}}})


def test_message_counts_are_whole_batches() -> None:
    for size in sweep.SIZES:
        n = sweep.size_messages(size, 0.2)
        assert n % sweep.SIZE_BATCH == 0 and n >= sweep.SIZE_BATCH
    for batch in sweep.BATCHES:
        for tcp in (False, True):
            n = sweep.batch_messages(batch, tcp, 0.05)
            assert n % batch == 0 and n >= batch
