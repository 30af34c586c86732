"""The what-if plot: throughput and efficiency against the varied value, every point labelled with its plan.

Three kinds, each drawn the way its axis reads best:
- GPU or node count: log-log throughput with the ideal (linear) scaling from the smallest point, and scaling
  efficiency below;
- bandwidth (and NICs, a node group's bandwidth or nodes): throughput against a log axis;
- GPU type: a bar chart, one bar per GPU (grouped by curve with ``--compare``), the names horizontal (slanted
  where they would run together); a GPU
  without a plan has "no plan" written where its bar would stand (on line plots, where its plan would be named).
Every point carries its best plan (:func:`plan_label`), written vertically so neighbouring labels never cross
(line plots: in strips above and below the throughput axes, clear of the data; bars: on the bar);
throughput reads in k/M tokens per second; the figure is saved with nothing clipped. A ``--compare`` curve is
drawn beside the best one (one compared curve: the command takes one).
"""

from __future__ import annotations

import math
import os
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any

from planner.whatif import axis_label
from specs.errors import AutoparError
from specs.files import check_output_file
from specs.parallel import KEYS, ParallelConfig
from specs.placement import groups_text

MIN_EFF_SPAN = 0.1  # the efficiency axis spans at least this: differences below a percent read as flat
NO_PLAN = "no plan"  # where a point's bar or plan label would be, when it has none (none fits, or none is possible)
NOTE_WIDTH = 110  # characters a footnote line holds (below the x axis' label, 8-9 inches wide)


SHORT = {"mbs": "mb", "vpp": "v", "zero": "z", "selective": "sel"}  # a plot label's shorter names
NOT_LABELLED = ("recompute_layers", "dp_overlap", "tp_overlap", "layers")  # the table and JSON say these


def plan_label(parallel: dict[str, Any]) -> str:
    """A plan in a few characters, its keys in the order they are declared (specs/parallel.py), those at their
    default left out as :meth:`ParallelConfig.short` does: ``tp8 pp4 dp32 cp2 ep4 mb3 v8 sp sel z1``; on node groups
    the groups of its pipeline ranks last (``ib*2/roce*2``)."""
    parts = []
    for f in fields(ParallelConfig):
        k, info = f.name, KEYS[f.name]
        if k in NOT_LABELLED or k not in parallel or (parallel[k] == f.default and not info.always_shown):
            continue
        v = parallel[k]
        if k == "placement":
            parts.append(groups_text(v))
        else:
            parts.append(k if info.kind == "bool" else SHORT.get(v, v) if k == "recompute" else f"{SHORT.get(k, k)}{v}")
    return " ".join(parts)


def si(value: float, _pos: Any = None) -> str:
    """1234 -> 1.2k, 2500000 -> 2.5M (tick labels)."""
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= div:
            return f"{value / div:.3g}{unit}"
    return f"{value:.3g}"


def _plain(text: str) -> str:
    """User text for a plot label: a literal ``$`` rather than the start of matplotlib's math mode."""
    return text.replace("$", r"\$")


def plot_file(path: str, inputs: dict[str, str | None] | None = None) -> str:
    """The file ``--plot`` writes (a name without an extension gets ``.png``), checked before the sweep (not one of
    the command's ``inputs``)."""
    if Path(path).is_dir() or path.endswith(("/", os.sep)):
        what = "is a directory" if Path(path).is_dir() else "names a folder (it ends in /)"
        raise AutoparError(f"--plot {path} {what}; give a file name such as {Path(path) / 'whatif.png'}")
    out = check_output_file(path if Path(path).suffix else path + ".png", "plot", inputs)
    kinds = _image_kinds()
    if out.suffix.lower().lstrip(".") not in kinds:
        raise AutoparError(f"--plot {path}: matplotlib writes no {out.suffix} image; name a .png (or "
                           f"{', '.join('.' + k for k in sorted(kinds) if k != 'png')})")
    if out.is_file() and out.stat().st_size and out.suffix.lower() not in RAW and not _a_figure(out):
        raise AutoparError(f"{out} exists and is not a plot (an image matplotlib writes): writing the plot there would "
                           "destroy it; give another file name (or delete it first)")
    return str(out)


def _image_kinds() -> set[str]:
    """The file extensions matplotlib writes images as (png, pdf, svg, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return set(Figure().canvas.get_supported_filetypes())


SAVE_DPI = 120  # the saved image's resolution; the figure is laid out at it, so what is measured is what is saved
FIGURE_STARTS = (b"\x89PNG", b"%PDF", b"%!PS", b"\xff\xd8\xff", b"<?xml", b"<svg", b"II*\x00", b"MM\x00*", b"RIFF",
                 b"\x1f\x8b")  # (the last: gzip, an .svgz)
RAW = (".raw", ".rgba")  # pixels alone: no header tells them from another file's bytes


def _a_figure(path: Path) -> bool:
    """Whether a file begins as an image matplotlib writes does (PNG, PDF, PostScript, JPEG, SVG, TIFF, WebP,
    gzipped SVG)."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError:
        return False
    return head.startswith(FIGURE_STARTS)


def figure(curves: dict[str, list[dict[str, Any]]], key: str, model: str, cluster: str) -> Any:
    """The matplotlib figure of a sweep (``curves``: name -> points as ``whatif.sweep`` returns them)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator
    from matplotlib.transforms import blended_transform_factory

    scaling = key in ("gpus", "nodes")
    values = [p["value"] for p in next(iter(curves.values()))]
    categorical = any(isinstance(v, str) for v in values)  # bars: GPU types, group names
    names = list(curves)
    if categorical:
        fig, (top, low) = plt.subplots(2, 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]},
                                       dpi=SAVE_DPI)
        head = top
    else:
        fig, top, low, strips = _line_axes(plt, curves, len(names[:2]))
        head = strips[0]
    for i, name in enumerate(names[:2]):
        ok = [p for p in curves[name] if p.get("tokens_per_s")]
        label = "best plan" if name == "best" else _plain(name)
        if categorical:  # bars, their plans on top of them
            width = 0.8 / len(names)
            xs = [values.index(p["value"]) + (i - (len(names) - 1) / 2) * width for p in ok]
            top.bar(xs, [p["tokens_per_s"] for p in ok], width, label=label)
            low.bar(xs, [p["scaling_efficiency"] for p in ok], width, label=label)
            for x, p in zip(xs, ok):
                top.annotate(_plain(plan_label(p["parallel"])), (x, p["tokens_per_s"]), textcoords="offset points",
                             xytext=(0, 4), rotation=90, ha="center", va="bottom", fontsize=7, gid="plan-label")
            for p in curves[name]:  # a GPU tried without a plan: its bar's place says so, at the base
                if not p.get("tokens_per_s"):
                    x = values.index(p["value"]) + (i - (len(names) - 1) / 2) * width
                    for ax in (top, low):
                        ax.text(x, 0.02, NO_PLAN, transform=blended_transform_factory(ax.transData, ax.transAxes),
                                rotation=90, ha="center", va="bottom", fontsize=7, color="grey", gid="no-plan")
            continue
        xs = [p["value"] for p in ok]
        line, = top.plot(xs, [p["tokens_per_s"] for p in ok], "-o" if i == 0 else "--s", label=label)
        low.plot(xs, [p["scaling_efficiency"] for p in ok], "-o" if i == 0 else "--s", label=label)
        band = blended_transform_factory(strips[i].transData, strips[i].transAxes)  # x in data, y in its height
        # the best curve's plans in the strip above the throughput, the compared curve's in the strip below it, each
        # written from the edge next to the data
        y, va = (0.02, "bottom") if i == 0 else (0.98, "top")
        for x, p in zip(xs, ok):
            strips[i].text(x, y, _plain(plan_label(p["parallel"])), transform=band, rotation=90, ha="center", va=va,
                           fontsize=7, color=line.get_color(), gid="plan-label")
        for p in curves[name]:  # a point tried without a plan: "no plan" where its plan would be named
            if not p.get("tokens_per_s"):
                strips[i].text(p["value"], y, NO_PLAN, transform=band, rotation=90, ha="center", va=va, fontsize=7,
                               color="grey", gid="no-plan")
    if scaling:
        ok = [p for p in curves[names[0]] if p.get("tokens_per_s")]
        if ok:
            base = min(ok, key=lambda p: p["gpus"])
            xs = sorted(p["value"] for p in ok)
            per = base["tokens_per_s"] / base["value"]
            top.plot(xs, [per * x for x in xs], ":", color="grey", label="ideal (linear) scaling")
        top.set_yscale("log")
    if not categorical:
        _leave_room(top, log=scaling)
    marks, footnotes = _notes({name: curves[name] for name in names[:2]}, values)  # (the curves drawn)
    shown = [(_plain(str(v)) if categorical else f"{v:g}") + marks.get(i, "") for i, v in enumerate(values)]
    if categorical:
        top.set_xlim(-0.5, len(values) - 0.5)  # every GPU's place, a bar or "no plan" (shared with the lower axes)
        top.set_xticks(range(len(values)))
        top.set_xticklabels(shown)
        low.set_xticks(range(len(values)))
        # horizontal while each name fits its bar's place (about 0.075 inch a character at 10 points), else slanted
        crowded = max(len(v) for v in shown) * 0.075 > 0.9 * 7.5 / len(values)
        low.set_xticklabels(shown, rotation=40 if crowded else 0, ha="right" if crowded else "center",
                            rotation_mode="anchor")
    else:  # every numeric sweep (counts, bandwidths) doubles from point to point: a log axis
        for ax in (top, low):
            ax.set_xscale("log", base=2)
            ax.set_xticks(values)
            ax.set_xticklabels(shown)
            ax.xaxis.set_minor_locator(NullLocator())
        top.set_xlim(min(values) / 1.25, max(values) * 1.25)  # every point's place, "no plan" ones too
    effs = [p["scaling_efficiency"] for pts in curves.values() for p in pts if p.get("tokens_per_s")]
    if not categorical and effs and max(effs) - min(effs) < MIN_EFF_SPAN:  # a spread of 1e-4 is not magnified
        mid = (max(effs) + min(effs)) / 2
        low.set_ylim(mid - MIN_EFF_SPAN / 2, mid + MIN_EFF_SPAN / 2)
    low.ticklabel_format(axis="y", useOffset=False)
    top.yaxis.set_major_formatter(FuncFormatter(si))
    lo, hi = top.get_ylim()
    # a log axis holding fewer than two powers of ten (one major tick, or none) labels its minor ticks
    few = scaling and math.floor(math.log10(hi)) - math.ceil(math.log10(lo)) + 1 < 2
    # (across a decade or more, those at 2, 3 and 5 times a power of ten: every one would crowd)
    some = lambda v, pos: si(v, pos) if hi < 10 * lo or round(v / 10 ** math.floor(math.log10(v))) in (2, 3, 5) \
        else ""  # noqa: E731
    top.yaxis.set_minor_formatter(FuncFormatter(some if few else lambda v, pos: ""))
    if categorical:
        top.margins(y=0.35)
    top.set_ylabel("tokens / s")
    low.set_ylabel("scaling efficiency (per-GPU vs smallest)" if scaling else "throughput relative to the best point")
    low.set_xlabel("\n".join([axis_label(key), *footnotes]), multialignment="left")  # (laid out with the axes)
    head.set_title(f"{_plain(model)} on {_plain(cluster)}: the best plan at each point", pad=24)
    handles, texts = top.get_legend_handles_labels()
    head.legend(handles, texts, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=3, fontsize=8, frameon=False)
    for ax in (top, low):
        ax.grid(alpha=0.3, which="major")
    if categorical:
        fig.tight_layout(h_pad=2.5)
        _room_above_bars(fig, top)
    return fig


def _notes(curves: dict[str, list[dict[str, Any]]], values: list[Any]) -> tuple[dict[int, str], list[str]]:
    """The points' notes (what else changed with the swept value: a link the platform lacks, a GPU's own node link)
    as footnotes: each point's mark (`` [1]``, for its tick label) by its index in ``values``, and the footnotes'
    lines, wrapped (each note once, however many points it holds for)."""
    by_note: dict[str, list[int]] = {}
    for pts in curves.values():
        for p in pts:
            if p.get("note"):
                at = by_note.setdefault(p["note"], [])
                if values.index(p["value"]) not in at:
                    at.append(values.index(p["value"]))
    marks: dict[int, str] = {}
    lines = []
    for k, (note, at) in enumerate(by_note.items(), 1):
        for i in at:
            marks[i] = marks.get(i, "") + f" [{k}]"
        lines += textwrap.wrap(_plain(f"[{k}] {note}"), NOTE_WIDTH, subsequent_indent="    ")
    return marks, lines


def _room_above_bars(fig: Any, ax: Any) -> None:
    """Raise the bar axes' top so that the tallest bar's plan label (written upwards from the bar's top, a fixed
    length in points) ends inside the axes: a long label (a placement) ran into the title."""
    labels = [t for t in ax.texts if t.get_gid() == "plan-label"]
    if not labels:
        return
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    height = ax.bbox.height
    need = max(t.get_window_extent(r).height for t in labels) + 20.0  # pixels: the offset above a bar, and a margin
    tallest = max(t.xy[1] for t in labels)
    if height > need:
        ax.set_ylim(top=max(ax.get_ylim()[1], tallest * height / (height - need)))


def _line_axes(plt: Any, curves: dict[str, list[dict[str, Any]]], n: int) -> tuple[Any, Any, Any, list[Any]]:
    """A line plot's figure: a strip for the best curve's plan labels, the throughput axes, a strip for the compared
    curve's labels (``n`` = 2), the efficiency axes; the strips as tall as the longest label, so that the data have
    their axes' whole height. Returns (figure, throughput axes, efficiency axes, strips)."""
    shown = [plan_label(p["parallel"]) if p.get("tokens_per_s") else NO_PLAN for pts in curves.values() for p in pts]
    strip = 0.2 + 0.058 * max(map(len, shown), default=len(NO_PLAN))  # inches: 7-point characters, upright
    heights = [strip, 3.4, *([strip] if n > 1 else []), 2.4]
    fig = plt.figure(figsize=(9, sum(heights) + 1.2), layout="constrained", dpi=SAVE_DPI)  # (title, legend, labels)
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    top = fig.add_subplot(grid[1])
    low = fig.add_subplot(grid[-1], sharex=top)
    strips = [fig.add_subplot(grid[0], sharex=top), *([fig.add_subplot(grid[2], sharex=top)] if n > 1 else [])]
    for ax in strips:
        ax.set_axis_off()
    top.tick_params(labelbottom=False)
    return fig, top, low, strips


def _leave_room(ax: Any, log: bool) -> None:
    """Set the y limits a little beyond the data (a log axis at least a quarter of an e-fold wide, a linear one from
    zero where the data are near it: no negative tokens/s)."""
    lo, hi = ax.dataLim.y0, ax.dataLim.y1
    f = (lambda v: math.log(v)) if log else (lambda v: v)
    g = (lambda v: math.exp(v)) if log else (lambda v: v)
    a, b = f(lo), f(hi)
    span = max(b - a, 0.25 if log else 0.25 * max(abs(hi), 1.0))
    mid = (a + b) / 2
    a, b = mid - 0.6 * span, mid + 0.6 * span
    ax.set_ylim(g(a) if log else max(g(a), 0.0), g(b))


def plot(curves: dict[str, list[dict[str, Any]]], key: str, model: str, cluster: str, path: str) -> str:
    """Write the sweep's figure; returns the file written (a name without an extension gets ``.png``)."""
    path = plot_file(path)
    import matplotlib.pyplot as plt

    fig = figure(curves, key, model, cluster)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)  # a folder --plot names that is not there yet, as --out
        fig.savefig(path, dpi=SAVE_DPI, bbox_inches="tight")
    except (OSError, ValueError) as err:
        raise AutoparError(f"cannot write plot {path}: {err}") from None
    finally:
        plt.close(fig)
    return path
