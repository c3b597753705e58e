"""Render the four benchmark plots (PNG) from a results file of ``bench/sweep.py``.

    python bench/plot.py bench/results/2026-11-24-host.json            # into bench/results/2026-11-24-host/
    python bench/plot.py RESULTS.json --out DIR

Writes ``throughput_vs_size.png``, ``throughput_vs_batch.png``, ``latency_cdf.png`` and
``throughput_vs_workers.png`` (those figures the file holds), each with the machine and
the date under the title.  A series the run could not measure (``not_measured`` in the
file, e.g. Redis without a redis-server) is named in the legend and the caption.  The
schema is described in ``bench/resultfile.py``; a file that does not follow it is refused
with a message saying what is wrong (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")  # no display: render to files only

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402
from resultfile import FIGURES, ResultsError, load  # noqa: E402

DPI = 110
Loc = Literal["best", "lower left", "upper left", "lower right"]
SIZE_IN = (9.0, 6.2)
STYLE = {  # series name -> (colour, marker); unknown names get matplotlib's cycle
    "shmq shm": ("tab:blue", "o"),
    "shmq tcp": ("tab:orange", "s"),
    "faster-fifo": ("tab:green", "^"),
    "mp.Queue": ("tab:purple", "v"),
    "Redis": ("tab:red", "D"),
}


def _bytes(v: float, _pos: Any = None) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if v >= k:
            return f"{v / k:g} {unit}"
    return f"{v:g} B"


def _count(v: float, _pos: Any = None) -> str:
    for unit, k in (("M", 1e6), ("k", 1e3)):
        if v >= k:
            return f"{v / k:g}{unit}"
    return f"{v:g}"


def caption(results: dict[str, Any], fig: dict[str, Any]) -> str:
    """The lines under a plot: the machine, the date, the command, what was measured, what was not."""
    m = results["machine"]
    commit = m.get("shmq_commit") or "?"
    if m.get("shmq_dirty"):
        commit += " (+ local changes)"
    load_avg = m.get("load_avg_start")
    load = f"; load avg {load_avg[0]:g} at the start" if isinstance(load_avg, list) and load_avg else ""
    when = results["date"][:16].replace("T", " ")
    lines = [f"{m.get('host', '?')}: {m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), "
             f"Python {m.get('python', '?')}, shmq {commit}; {when} UTC{load}",
             f"command: {results['command']}"]
    if fig.get("note"):
        lines.append(str(fig["note"]))
    lines += [f"{name}: not measured ({why})" for name, why in fig.get("not_measured", {}).items()]
    return "\n".join(textwrap.fill(line, 140, subsequent_indent="    ") for line in lines)


# colours and markers for series STYLE does not name (or names twice in one figure: a peer's variants)
MORE_COLOURS = ("tab:cyan", "tab:brown", "tab:pink", "tab:olive", "tab:gray", "goldenrod", "navy", "teal",
                "darkred", "limegreen", "indigo", "salmon")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "h", "<", ">", "d")


def _style(name: str, series: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """``name``'s colour and marker: STYLE's for the first series of a figure (``series``) that a
    STYLE prefix names, distinct ones for the others."""
    names = [s["name"] for s in series] or [name]
    styles: dict[str, dict[str, Any]] = {}
    used: set[str] = set()
    for n in names:
        for prefix, (colour, marker) in STYLE.items():
            if n.startswith(prefix) and colour not in used:
                styles[n] = {"color": colour, "marker": marker}
                used.add(colour)
                break
    free = [c for c in (*MORE_COLOURS, *(c for c, _m in STYLE.values())) if c not in used]
    k = 0
    for n in names:
        if n not in styles:
            styles[n] = {"color": free[k % len(free)], "marker": MARKERS[k % len(MARKERS)]}
            k += 1
    return styles.get(name, {"marker": "o"})


def _points(s: dict[str, Any], scale: Sequence[float] | None = None) -> tuple[list[float], ...]:
    """x, median and the spread below / above it, of the points with a median (scaled per x)."""
    xs, med, lo, hi = [], [], [], []
    for i, (x, y) in enumerate(zip(s["x"], s["median"], strict=True)):
        if y is None:
            continue
        k = scale[i] if scale is not None else 1.0
        mn = s["min"][i] if s.get("min") and s["min"][i] is not None else y
        mx = s["max"][i] if s.get("max") and s["max"][i] is not None else y
        xs.append(x)
        med.append(y * k)
        lo.append(max(0.0, (y - mn) * k))
        hi.append(max(0.0, (mx - y) * k))
    return xs, med, lo, hi


def _plot_series(ax: Axes, s: dict[str, Any], scale: Sequence[float] | None = None,
                 series: Sequence[dict[str, Any]] = ()) -> None:
    xs, med, lo, hi = _points(s, scale)
    if xs:
        ax.errorbar(xs, med, yerr=[lo, hi], label=s["name"], capsize=3, linewidth=1.6, markersize=5,
                    **_style(s["name"], series))
    else:
        ax.plot([], [], label=f"{s['name']} (every run failed)", **_style(s["name"], series))


def _legend(ax: Axes, fig: dict[str, Any], loc: Loc = "best") -> None:
    handles, labels = ax.get_legend_handles_labels()
    for name, why in fig.get("not_measured", {}).items():
        handles.append(Line2D([], [], linestyle="none", marker="x", color="grey"))
        labels.append(f"{name}: not measured ({why})")
    ax.legend(handles, labels, loc=loc, fontsize=8)


def subtitle(results: dict[str, Any]) -> str:
    """The line under the title: which machine, when."""
    m = results["machine"]
    return (f"{m.get('host', '?')}, {m.get('cpus', '?')} CPUs ({m.get('cpu_model', '?')}), "
            f"{results['date'][:10]}")


def _new(results: dict[str, Any], fig: dict[str, Any], ncols: int = 1) -> tuple[Figure, list[Axes]]:
    f, axes = plt.subplots(1, ncols, figsize=SIZE_IN, dpi=DPI, squeeze=False)
    f.suptitle(fig["title"], fontsize=13, fontweight="bold", y=0.985)
    f.text(0.5, 0.935, subtitle(results), ha="center", fontsize=9, color="#444444")
    return f, list(axes[0])


def _finish(f: Figure, results: dict[str, Any], fig: dict[str, Any]) -> Figure:
    text = caption(results, fig)
    lines = text.count("\n") + 1
    bottom = min(0.4, 0.035 + 0.019 * lines)
    f.text(0.01, 0.01, text, fontsize=7, va="bottom", ha="left", family="monospace", color="#333333")
    f.tight_layout(rect=(0, bottom, 1, 0.93))
    return f


def _label(ax: Axes, fig: dict[str, Any], y_label: str | None = None) -> None:
    """Axis labels (the figure's, or ``y_label``) and the grid."""
    ax.set_xlabel(fig["x_label"])
    ax.set_ylabel(y_label or fig["y_label"])
    ax.grid(True, which="major", alpha=0.4)
    ax.grid(True, which="minor", alpha=0.15)


def throughput_vs_size(results: dict[str, Any], fig: dict[str, Any]) -> Figure:
    f, (a1, a2) = _new(results, fig, 2)
    for s in fig["series"]:
        _plot_series(a1, s, series=fig["series"])
        _plot_series(a2, s, [x / 1e6 for x in s["x"]], fig["series"])  # msgs/s * bytes -> MB/s
    for ax, ylabel in ((a1, fig["y_label"]), (a2, "payload throughput (MB/s, 10^6 bytes/s, log scale)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(_bytes))
        _label(ax, fig, ylabel)
    for ax in (a1, a2):
        ax.yaxis.set_major_formatter(FuncFormatter(_count))
    a1.set_title("messages per second", fontsize=10)
    a2.set_title("payload bytes per second", fontsize=10)
    _legend(a1, fig, "lower left")
    return _finish(f, results, fig)


def throughput_vs_batch(results: dict[str, Any], fig: dict[str, Any]) -> Figure:
    f, (ax,) = _new(results, fig)
    for s in fig["series"]:
        _plot_series(ax, s, series=fig["series"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax.yaxis.set_major_formatter(FuncFormatter(_count))
    _label(ax, fig)
    _legend(ax, fig)  # "best": where no series runs
    return _finish(f, results, fig)


def latency_cdf(results: dict[str, Any], fig: dict[str, Any]) -> Figure:
    f, (ax,) = _new(results, fig)
    for s in fig["series"]:
        pts = [(q, v, lo, hi) for q, v, lo, hi in zip(s["x"], s["median"], s.get("min") or s["median"],
                                                      s.get("max") or s["median"], strict=True)
               if v is not None]
        if not pts:
            ax.plot([], [], label=f"{s['name']} (every run failed)", **_style(s["name"], fig["series"]))
            continue
        qs = [p[0] for p in pts]
        style = _style(s["name"], fig["series"])
        p50 = _at(pts, 0.5)
        p99 = _at(pts, 0.99)
        label = s["name"] + (f"  (p50 {p50:,.0f} µs, p99 {p99:,.0f} µs)" if p50 and p99 else "")
        ax.plot([p[1] for p in pts], qs, label=label, color=style.get("color"), linewidth=1.8)
        lo = [p[2] if p[2] is not None else p[1] for p in pts]
        hi = [p[3] if p[3] is not None else p[1] for p in pts]
        ax.fill_betweenx(qs, lo, hi, color=style.get("color"), alpha=0.15)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}"))
    ax.set_ylim(0, 1)
    _label(ax, fig)
    ax.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
    ax.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    _legend(ax, fig, "lower right")
    return _finish(f, results, fig)


def _at(pts: Sequence[tuple[float, float, Any, Any]], q: float) -> float | None:
    for p in pts:
        if abs(p[0] - q) < 1e-9:
            return p[1]
    return None


def throughput_vs_workers(results: dict[str, Any], fig: dict[str, Any]) -> Figure:
    f, (ax,) = _new(results, fig)
    for s in fig["series"]:
        _plot_series(ax, s, series=fig["series"])
    xs = [x for s in fig["series"] for x in s["x"]]
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if xs:
        ax.set_xlim(min(xs) - 0.5, max(xs) + 0.5)
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(_count))
    _label(ax, fig)
    _legend(ax, fig, "lower right")
    return _finish(f, results, fig)


RENDERERS = {"throughput_vs_size": throughput_vs_size, "throughput_vs_batch": throughput_vs_batch,
             "latency_cdf": latency_cdf, "throughput_vs_workers": throughput_vs_workers}
assert set(RENDERERS) == set(FIGURES)


def figure(results: dict[str, Any], fid: str) -> Figure:
    """Figure ``fid`` of a loaded results file, drawn (the caller closes it: plt.close)."""
    return RENDERERS[fid](results, results["figures"][fid])


def render(results: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Render every figure of a loaded results file into ``out_dir`` as PNGs; the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fid in FIGURES:
        if fid in results["figures"]:
            f = figure(results, fid)
            try:
                path = out / f"{fid}.png"
                f.savefig(path)
                written.append(path)
            finally:
                plt.close(f)
    return written


def render_file(results_path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Load ``results_path`` and render it (by default into the folder beside it named like it)."""
    data = load(results_path)
    return render(data, out_dir if out_dir is not None else Path(results_path).with_suffix(""))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a results file of bench/sweep.py")
    ap.add_argument("--out", help="folder for the PNGs (default: beside the file, named like it)")
    a = ap.parse_args(argv)
    try:
        paths = render_file(a.results, a.out)
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
