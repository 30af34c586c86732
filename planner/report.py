"""Human-readable output: tables for estimates, plans and what-if sweeps (rich)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cost_models.step import Estimate

if TYPE_CHECKING:
    from specs.cluster import ClusterSpec
    from specs.model import ModelSpec


class _Console(Console):
    """rich's console, except that a reader gone away (``autopar plan | head``) ends the command as a closed pipe
    does everywhere else in autopar (exit 0, planner/cli.py), not with rich's exit status 1."""

    def on_broken_pipe(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more reaches the closed pipe
        raise BrokenPipeError

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """As rich prints, except that a table narrower than its content folds its cells onto more lines instead of
        cutting them short: "685.6k" cut to "685…" would read as another number."""
        for obj in objects:
            if isinstance(obj, Table):
                for col in obj.columns:
                    col.overflow = "fold"
        super().print(*objects, **kwargs)


def console() -> Console:
    """The console the commands print their tables to: 140 columns when stdout is not a terminal; no escape codes at
    all (bold and italics neither) where NO_COLOR is set."""
    plain = {"color_system": None} if os.environ.get("NO_COLOR") else {}
    con = _Console(highlight=False, soft_wrap=False, **plain)
    if not con.is_terminal:
        con = _Console(highlight=False, soft_wrap=False, width=140, **plain)
    return con


def print_inputs(con: Console, model: ModelSpec, cluster: ClusterSpec) -> None:
    """The model and cluster lines a table output starts with (user-given names printed as text, not markup)."""
    con.print(f"model   {escape(model.summary())}")
    con.print(f"cluster {escape(cluster.summary())}")


def fmt_time(s: float) -> str:
    if s >= 1.0:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_range(lo: float, hi: float) -> str:
    """``lo``-``hi`` seconds in one unit (that of ``hi``)."""
    unit, scale = ("s", 1.0) if hi >= 1.0 else ("ms", 1e3) if hi >= 1e-3 else ("us", 1e6)
    return f"{lo * scale:.3g}-{hi * scale:.3g} {unit}"


def fmt_gib(x: float) -> str:
    """GiB, in MiB below one."""
    return f"{x * 1024:.1f} MiB" if x < 1 else f"{x:.3f} GiB"


def fmt_rate(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:,.1f}{unit}"
    return f"{x:,.1f}"


def per_rank(values: list[str]) -> str:
    """Per-rank values joined by " / ", three or more equal ones in a row once, with their ranks (a 64-stage
    pipeline's middle ranks are one entry, not 62)."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        out.extend([f"{values[i]} (ranks {i}-{j})"] if j - i >= 2 else values[i:j + 1])
        i = j + 1
    return " / ".join(out)


# breakdown keys whose plain names would mislead: dp_comm_exposed also holds the tied embedding's sum and, under
# sequence parallelism, the sum over tp of the gradients it leaves partial (a tp=2 dp=1 plan has some)
ROW_NAMES = {"dp_comm_exposed": "grad sync exposed"}


def estimate_tables(est: Estimate, title: str) -> list[Table]:
    top = Table(title=title, show_header=True, header_style="bold")
    for col in ("step time", "tokens/s", "MFU", "memory/GPU", "fits", "bubble", "exposed comm"):
        top.add_column(col, justify="right")
    top.add_row(fmt_time(est.step_time_s), fmt_rate(est.tokens_per_s), f"{est.mfu * 100:.1f}%",
                f"{est.memory_GiB:.1f} GiB", "yes" if est.fits else "[red]NO[/red]",
                f"{est.bubble_fraction * 100:.1f}%", f"{est.exposed_comm_fraction * 100:.1f}%")
    bd = Table(title="step time on the critical pipeline rank", header_style="bold")
    pp = len(est.stage_memory_GiB)
    if pp > 1:  # where the bubble comes from: an uneven stage makes the others wait
        # virtual stage k (of pp x vpp) runs on pipeline rank k % pp
        work = per_rank([fmt_time(sum(est.stage_time_s[r::pp])) for r in range(pp)])
        bd = Table(title=f"step time as the busiest pipeline rank spends it (rank {est.critical_rank} of {pp})",
                   header_style="bold", min_width=64, caption_justify="left",
                   caption=f"a micro-batch's forward + backward by pipeline rank: {work}; the bubble is the wait for "
                           "the pipeline to fill and for slower ranks")
    bd.add_column("part")
    bd.add_column("time", justify="right")
    bd.add_column("share", justify="right")
    for k, v in est.breakdown.items():
        bd.add_row(ROW_NAMES.get(k, k.replace("_", " ")), fmt_time(v), f"{v / est.step_time_s * 100:.1f}%")
    mem = Table(title="memory on the fullest GPU", header_style="bold")
    mem.add_column("part")
    mem.add_column("GiB", justify="right")
    for k, v in est.memory_breakdown.items():
        mem.add_row(k.replace("_", " "), f"{v:.2f}")
    return [top, bd, mem]


def memory_check_table(rows: list[dict[str, Any]]) -> Table:
    """``estimate --verify``: per pipeline rank, the replayed and the predicted state and peak."""
    tab = Table(title="memory: replayed by the runtime (meta device) vs the model (allocator left out)",
                header_style="bold")
    for col in ("pp rank", "state replayed", "state model", "peak replayed", "peak model", "model vs replay"):
        tab.add_column(col, justify="right")
    for r in rows:
        sizes = (fmt_gib(r[k]) for k in ("state_GiB", "predicted_state_GiB", "peak_GiB", "predicted_peak_GiB"))
        tab.add_row(str(r["pp_rank"]), *sizes, f"{r['peak_error'] * 100:+.1f}%")
    return tab


def plans_table(rows: list[dict[str, Any]], title: str) -> Table:
    """One row per plan; with a ``band`` (seconds, low and high) in every row, a column for it."""
    tab = Table(title=title, header_style="bold")
    banded = all("band" in r for r in rows)
    for col, just in (("#", "right"), ("plan", "left"), ("step time", "right"), *([("band", "right")] if banded
                      else []), ("tokens/s", "right"), ("MFU", "right"), ("memory", "right"), ("bubble", "right"),
                      ("exp. comm", "right")):
        tab.add_column(col, justify=just)
    for i, r in enumerate(rows, 1):
        band = [fmt_range(*r["band"])] if banded else []
        tab.add_row(str(i), r["plan"], fmt_time(r["step_time_s"]), *band, fmt_rate(r["tokens_per_s"]),
                    f"{r['mfu'] * 100:.1f}%", f"{r['memory_GiB']:.1f} GiB",
                    f"{r['bubble_fraction'] * 100:.1f}%", f"{r['exposed_comm_fraction'] * 100:.1f}%")
    return tab


def whatif_table(pts: list[dict[str, Any]], key: str, title: str) -> Table:
    """One row per point; each column says what it holds and in which unit (the efficiency column: per-GPU
    throughput against the smallest point in a GPU-count sweep, throughput against the best point otherwise)."""
    from planner.whatif import axis_label

    scaling = key in ("gpus", "nodes")
    tab = Table(title=escape(title), header_style="bold",
                caption="efficiency: " + ("tokens/s per GPU relative to the smallest cluster" if scaling
                                          else "tokens/s relative to the best point"))
    a2a = any(p.get("breakdown", {}).get("ep_comm", 0.0) > 0 for p in pts)  # a MoE model's all-to-all share
    gpus = key != "gpus"  # a GPU-count sweep's swept column is its GPUs (as its CSV has it)
    for col, just in ((f"{axis_label(key)} (swept)", "right"), *((("GPUs", "right"),) if gpus else ()),
                      ("tokens/s", "right"),
                      ("MFU (%)", "right"), ("scaling efficiency" if scaling else "relative throughput", "right"),
                      ("memory per GPU (GiB)", "right"), *((("all-to-all (% of step)", "right"),) if a2a else ()),
                      ("best plan", "left")):
        tab.add_column(escape(col), justify=just)
    for p in pts:
        if not p.get("tokens_per_s"):
            tab.add_row(str(p["value"]), *((str(p.get("gpus") or "-"),) if gpus else ()), "-", "-", "-", "-",
                        *(("-",) if a2a else ()),
                        f"[red]{escape(p.get('error', 'no plan'))}[/red]")
            continue
        mark = " [yellow](changed)[/yellow]" if p["plan_changed"] else ""
        share = (f"{100 * p['breakdown']['ep_comm'] / p['step_time_s']:.1f}",) if a2a else ()
        tab.add_row(str(p["value"]), *((str(p["gpus"]),) if gpus else ()), fmt_rate(p["tokens_per_s"]),
                    f"{p['mfu'] * 100:.1f}",
                    f"{p['scaling_efficiency']:.2f}", f"{p['memory_GiB']:.1f}", *share, p["plan"] + mark)
    return tab
