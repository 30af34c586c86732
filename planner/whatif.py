"""What-if sweeps: vary network bandwidth, GPU count or GPU type; re-plan at every point.

Scaling efficiency: for a ``gpus`` sweep, per-GPU throughput relative to the first (smallest) point; for other
sweeps, throughput relative to the best point of the curve. A point where the best plan's layout changes is
marked (``plan_changed``), in the table and on the plot.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from planner.search import search
from planner.space import check_fixed_keys
from specs.cluster import ClusterSpec, list_gpus, load_gpu
from specs.errors import AutoparError, did_you_mean
from specs.files import check_output_file
from specs.model import ModelSpec
from specs.parallel import LAYOUT

VARY_KEYS = {
    "inter_node_bw": "Gb/s per NIC",
    "intra_node_bw": "GB/s per GPU (NVLink)",
    "gpus": "GPUs",
    "nodes": "nodes",
    "gpu": "GPU type",
    "nics_per_node": "NICs per node",
}
SWEPT_LAYOUT = tuple(k for k in LAYOUT if k != "dp")  # dp follows the GPU count


def parse_vary(text: str) -> tuple[str, list[Any]]:
    if "=" not in text:
        raise AutoparError(f"--vary takes key=v1,v2,...; keys: {', '.join(VARY_KEYS)}")
    key, raw = (s.strip() for s in text.split("=", 1))
    if key not in VARY_KEYS:
        raise AutoparError(f"cannot vary '{key}'{did_you_mean(key, VARY_KEYS)}; keys: {', '.join(VARY_KEYS)}")
    items = [x.strip() for x in raw.split(",") if x.strip()]
    if not items:
        raise AutoparError(f"--vary {key}= needs at least one value")
    if key == "gpu":
        for g in items:
            load_gpu(g)
        return key, items
    vals: list[Any] = []
    for x in items:
        try:
            v = float(x) if key.endswith("_bw") else int(x)
        except ValueError:
            raise AutoparError(f"--vary {key} takes numbers ({VARY_KEYS[key]}), got '{x}'") from None
        if not (v > 0 and math.isfinite(v)) or (key.endswith("_bw") and v < 0.01):
            raise AutoparError(f"--vary {key} values must be finite and positive (at least 0.01), got {x}")
        vals.append(v)
    return key, vals


def cluster_at(cluster: ClusterSpec, key: str, value: Any) -> ClusterSpec:
    """The cluster with one property changed."""
    if key == "gpus":
        return cluster.resized(gpus=int(value))
    if key == "nodes":
        return cluster.resized(nodes=int(value))
    if key == "gpu":
        return cluster.model_copy(update={"gpu": load_gpu(value)})
    if key == "intra_node_bw":
        intra = cluster.intra_node.model_copy(update={"bandwidth_GBps": value})
        return cluster.model_copy(update={"intra_node": intra})
    if cluster.inter_node is None:
        raise AutoparError(f"cluster {cluster.name} has no inter-node network to vary; use --gpus to span nodes")
    field = "nic_bandwidth_Gbps" if key == "inter_node_bw" else "nics_per_node"
    return cluster.model_copy(update={"inter_node": cluster.inter_node.model_copy(update={field: value})})


def sweep(model: ModelSpec, cluster: ClusterSpec, global_batch: int, key: str, values: list[Any],
          fixed: dict[str, Any], headroom_GiB: float = 0.0, compare: dict[str, Any] | None = None
          ) -> list[dict[str, Any]]:
    """Best plan at every value (a point with no fitting plan is {value, gpus, error}).

    ``compare`` holds the ``--compare`` keys, fixed on top of ``fixed`` (errors about them name --compare).
    Errors that would fail every point (bad keys, a network the cluster does not have) are raised first.
    """
    compare = compare or {}
    flags = {k: "--compare" for k in compare}
    check_fixed_keys(model, fixed, global_batch)
    check_fixed_keys(model, compare, global_batch, flags)
    if key in ("inter_node_bw", "nics_per_node"):
        if cluster.inter_node is None:
            raise AutoparError(f"--vary {key}: cluster {cluster.name} has no inter_node section (it is one node), "
                               "so there is no network between nodes to vary; use a multi-node cluster profile")
        if cluster.num_nodes == 1:
            raise AutoparError(f"--vary {key}: {cluster.name} is one node here, so the network between nodes "
                               "does not matter; give --gpus or --nodes to span several")
    pts: list[dict[str, Any]] = []
    for v in values:
        pt: dict[str, Any] = {"value": v}
        try:
            c = cluster_at(cluster, key, v)
            pt["gpus"] = c.num_gpus
            res = search(model, c, global_batch, fixed={**fixed, **compare}, top=1, headroom_GiB=headroom_GiB,
                         refine_count=12, flags=flags)
        except AutoparError as err:
            res, pt["error"] = None, str(err)
            pt.setdefault("gpus", v if key == "gpus" else None)
        if res is not None and res.plans:
            best = res.plans[0]
            e = best.estimate
            pt.update(tokens_per_s=e.tokens_per_s, step_time_s=e.step_time_s, mfu=e.mfu, memory_GiB=e.memory_GiB,
                      plan=best.config.short(), parallel=best.config.to_dict())
        elif res is not None:
            pt["error"] = "no plan fits"
        pts.append(pt)
    normalize({"curve": pts}, key)
    prev = None
    for p in pts:
        lay = tuple(p["parallel"][k] for k in SWEPT_LAYOUT) if "parallel" in p else None
        p["plan_changed"] = bool(prev is not None and lay is not None and lay != prev)
        prev = lay if lay is not None else prev
    return pts


def normalize(curves: dict[str, list[dict[str, Any]]], key: str) -> None:
    """Set each point's ``scaling_efficiency``: per-GPU throughput relative to the curve's smallest cluster for
    a GPU-count sweep; otherwise throughput relative to the best point of all curves (so curves compare)."""
    ok = {name: [p for p in pts if p.get("tokens_per_s")] for name, pts in curves.items()}
    top = max((p["tokens_per_s"] for pts in ok.values() for p in pts), default=0.0)
    for pts in ok.values():
        for p in pts:
            if key in ("gpus", "nodes"):
                base = min(pts, key=lambda q: q["gpus"])  # the smallest cluster of the sweep
                p["scaling_efficiency"] = p["tokens_per_s"] / p["gpus"] / (base["tokens_per_s"] / base["gpus"])
            else:
                p["scaling_efficiency"] = p["tokens_per_s"] / top


def _plain(text: str) -> str:
    """User text for a plot label: a literal ``$`` rather than the start of matplotlib's math mode."""
    return text.replace("$", r"\$")


def plot_file(path: str) -> str:
    """The file ``--plot`` writes (a name without an extension gets ``.png``), checked before the sweep."""
    if Path(path).is_dir():
        raise AutoparError(f"--plot {path} is a directory; give a file name such as {Path(path) / 'whatif.png'}")
    return str(check_output_file(path if Path(path).suffix else path + ".png", "plot"))


def plot(curves: dict[str, list[dict[str, Any]]], key: str, model: str, cluster: str, path: str) -> str:
    """Throughput and scaling efficiency against the varied value; plan changes marked. Returns the file written
    (a name without an extension gets ``.png``)."""
    path = plot_file(path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    categorical = key == "gpu"
    for i, (name, pts) in enumerate(curves.items()):
        ok = [p for p in pts if p.get("tokens_per_s")]
        xs = [_plain(str(p["value"])) if categorical else p["value"] for p in ok]
        style = "-o" if i == 0 else "--s"
        label = "best plan" if name == "best" else _plain(name)
        ax1.plot(xs, [p["tokens_per_s"] for p in ok], style, label=label)
        ax2.plot(xs, [p["scaling_efficiency"] for p in ok], style, label=label)
        if i == 0:
            for p, x in zip(ok, xs):
                if p["plan_changed"]:
                    for ax in (ax1, ax2):
                        ax.axvline(x, color="grey", lw=0.8, ls=":")
                    ax1.annotate(" ".join(p["plan"].split()[:3]),
                                 (x, p["tokens_per_s"]), textcoords="offset points", xytext=(4, 6), fontsize=7)
    if not categorical and key in ("gpus", "nodes", "inter_node_bw", "intra_node_bw"):
        values = sorted({p["value"] for pts in curves.values() for p in pts})
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xticks(values)
            ax.set_xticklabels([f"{v:g}" for v in values])
            ax.minorticks_off()
    ax1.set_ylabel("tokens / s")
    ax2.set_ylabel("scaling efficiency" if key in ("gpus", "nodes") else "relative throughput")
    ax2.set_xlabel(f"{key} ({VARY_KEYS[key]})")
    ax1.set_title(f"{_plain(model)} on {_plain(cluster)}: best plan per point (dotted: plan layout changes)")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except (OSError, ValueError) as err:
        raise AutoparError(f"cannot write plot {path}: {err}") from None
    finally:
        plt.close(fig)
    return path


__all__ = ["parse_vary", "sweep", "normalize", "plot", "cluster_at", "list_gpus"]
