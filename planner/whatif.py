"""What-if sweeps: vary network bandwidth, GPU count or GPU type; re-plan at every point.

Scaling efficiency: for a ``gpus`` sweep, per-GPU throughput relative to the first (smallest) point; for other
sweeps, throughput relative to the best point of the curve. A point where the best plan's layout changes is
marked (``plan_changed``) in the table; the plot is whatif_plot.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cost_models.headroom import check_headroom, headroom_for, usable_GiB
from planner.search import search
from planner.space import check_fixed_keys, unplaced
from specs.cluster import LINK_SLACK, ClusterSpec
from specs.cluster_loading import cluster_from_dict, list_clusters, list_gpus, load_cluster, load_gpu
from specs.errors import AutoparError, did_you_mean
from specs.model import ModelSpec
from specs.parallel import LAYOUT, typed_keys, whole_number
from specs.rules import placement_names_problem


@dataclass(frozen=True)
class Sweep:
    """What a ``--vary`` key's values are: ``unit`` (the error messages' words), the plot's x axis (``{unit}`` and
    ``{group}``, a node group's name, filled in) and, for a node group's key, how to write it."""

    unit: str
    axis: str = "{unit}"
    usage: str = ""

    def axis_label(self, group: str = "") -> str:
        return self.axis.format(unit=self.unit, group=group)

    def __str__(self) -> str:
        return f"{self.unit} ({self.usage})" if self.usage else self.unit


@dataclass(frozen=True)
class SweepInputs:
    """A sweep's checked inputs: the key and values swept, the plan keys fixed at every point (``--fix`` and
    ``--compare`` together), which flag gave each ``--compare`` key (for errors), and whether the node groups are
    planned as one homogeneous cluster (``placement=none``)."""

    key: str
    values: list[Any]
    fixed: dict[str, Any]
    flags: dict[str, str]
    homogeneous: bool


VARY_KEYS = {
    "inter_node_bw": Sweep("Gb/s per NIC", "inter-node bandwidth ({unit})"),
    "intra_node_bw": Sweep("GB/s per GPU", "NVLink bandwidth ({unit})"),
    "gpus": Sweep("GPUs"),
    "nodes": Sweep("nodes"),
    "gpu": Sweep("GPU type"),
    "nics_per_node": Sweep("NICs per node"),
    "group_bw": Sweep("Gb/s per NIC of one node group", "Gb/s per NIC of node group {group}",
                      "group_bw:<group>=v1,v2,..."),
    "group_nodes": Sweep("nodes of one node group", "nodes of node group {group}", "group_nodes:<group>=n1,n2,..."),
    "group_net": Sweep("one node group's NICs, as another group's",
                       "the NICs node group {group} has (those of the group named)", "group_net:<group>=<group>,..."),
}


def axis_label(key: str) -> str:
    """What a sweep of ``key`` varies, with its unit (``group_bw:eth`` names its group): a plot's x axis, a table's
    column."""
    base, _, group = key.partition(":")
    return VARY_KEYS[base].axis_label(group) if base in VARY_KEYS else key


GROUP_KEYS = ("group_bw", "group_nodes", "group_net")  # a cluster of node groups varies these (the rest follows)
SWEPT_LAYOUT = tuple(k for k in LAYOUT if k != "dp")  # dp follows the GPU count
# what a plain cluster varies instead of a node group's property
PLAIN_KEYS = {"group_bw": "inter_node_bw=...", "group_nodes": "nodes=...",
              "group_net": "inter_node_bw=... or nics_per_node=..."}
# the CSV's columns after ``curve`` and the varied key, in the order they were added (new ones go at the end)
CSV_COLUMNS = ("tokens_per_s", "step_time_s", "mfu", "scaling_efficiency", "memory_GiB", "plan", "plan_changed",
               "note", "error")


def csv_header(key: str) -> list[str]:
    """The CSV's header row for a sweep of ``key``: ``gpus`` last, unless it is the varied key already."""
    return ["curve", key, *CSV_COLUMNS, *([] if key == "gpus" else ["gpus"])]


def csv_rows(curves: dict[str, list[dict[str, Any]]], key: str) -> list[list[Any]]:
    """One row per point of every curve, under :func:`csv_header` (empty cells where a point has no value)."""
    rows = []
    for name, pts in curves.items():
        for p in pts:
            row = [name, p["value"], *(p.get(c, "") for c in CSV_COLUMNS)]
            rows.append(row + ([] if key == "gpus" else [p.get("gpus", "")]))
    return rows


def parse_vary(text: str) -> tuple[str, list[Any]]:
    if "=" not in text:
        raise AutoparError(f"--vary takes key=v1,v2,...; keys: {', '.join(VARY_KEYS)}")
    key, raw = (s.strip() for s in text.split("=", 1))
    base, _, group = key.partition(":")
    if base not in VARY_KEYS:
        raise AutoparError(f"cannot vary '{key}'{did_you_mean(key, VARY_KEYS)}; keys: {', '.join(VARY_KEYS)}")
    if (base in GROUP_KEYS) != bool(group):
        raise AutoparError(f"--vary {key}: {base} names a node group (--vary {base}:<group>=...)" if not group
                           else f"--vary {key}: only {' and '.join(GROUP_KEYS)} take a node group")
    items = [x.strip() for x in raw.split(",")]
    if not any(items):
        raise AutoparError(f"--vary {key}= needs at least one value")
    if not all(items):
        raise AutoparError(f"--vary {key}={raw.strip()} has an empty value (two commas, or one at an end); "
                           "give the values once each, comma-separated")
    if key == "gpu":
        for g in items:
            try:
                load_gpu(g)
            except AutoparError as err:
                raise AutoparError(f"--vary gpu={g}: {err}") from None
    # group_net's values are group names, checked against the cluster's groups (with_group)
    vals = items if key == "gpu" or base == "group_net" else [_point(key, base, x) for x in items]
    twice = next((v for i, v in enumerate(vals) if v in vals[:i]), None)
    if twice is not None:  # it would be planned and drawn twice
        raise AutoparError(f"--vary {key} gives {twice:g} twice; give each point once" if isinstance(twice, float)
                           else f"--vary {key} gives {twice} twice; give each point once")
    numeric = key != "gpu" and base != "group_net"
    return key, sorted(vals) if numeric else vals  # a curve runs along its axis, whatever the order given


def _point(key: str, base: str, x: str) -> Any:
    """One numeric value of ``--vary key=...``, checked."""
    try:
        if not x.isascii():
            raise ValueError(x)
        v = float(x) if base.endswith("_bw") else whole_number(x)
    except ValueError:
        raise AutoparError(f"--vary {key} takes {'numbers' if base.endswith('_bw') else 'whole numbers'} "
                           f"({VARY_KEYS[base]}), got '{x}'") from None
    if not (v > 0 and math.isfinite(v)) or (base.endswith("_bw") and v < 0.01):
        raise AutoparError(f"--vary {key} values must be finite and at least 0.01, got {x}" if base.endswith("_bw")
                           else f"--vary {key} values must be whole numbers of at least 1, got {x}")
    return v


def cluster_at(cluster: ClusterSpec, key: str, value: Any) -> tuple[ClusterSpec, str | None]:
    """The cluster with one property changed, and a one-line note on what else changed with it (or None)."""
    base, _, group = key.partition(":")
    if cluster.node_groups or group:
        return with_group(cluster, base, group, value), None
    if key == "gpus":
        return cluster.resized(gpus=int(value), asked_as=f"--vary gpus={value}"), None
    if key == "nodes":
        return cluster.resized(nodes=int(value), asked_as=f"--vary nodes={value}"), None
    if key == "gpu":
        return with_gpu(cluster, value)
    if key == "intra_node_bw":
        intra = cluster.intra_node.model_copy(update={"bandwidth_GBps": value})
        out = cluster.model_copy(update={"intra_node": intra})
        if out.link_problem() is None:
            return out, None
        link = cluster.gpu.node_link  # (a what-if may ask for more; a cluster profile may not claim it)
        return out, (f"{value:g} GB/s per GPU is more than {LINK_SLACK:g}x the {link.text()} that nodes of "
                     f"{cluster.gpu.name} have: a link their platform lacks")
    if cluster.inter_node is None:
        raise AutoparError(f"cluster {cluster.name} has no inter-node network to vary; use --gpus to span nodes")
    field = "nic_bandwidth_Gbps" if key == "inter_node_bw" else "nics_per_node"
    return cluster.model_copy(update={"inter_node": cluster.inter_node.model_copy(update={field: value})}), None


def grouped_clusters() -> list[str]:
    """The bundled cluster profiles made of node groups (those a ``group_*`` sweep can vary)."""
    return [name for name in list_clusters() if load_cluster(name).node_groups]


def check_vary_key(cluster: ClusterSpec, key: str) -> None:
    """Refuse a key the cluster cannot vary at any value: a node group's property on a plain cluster, another
    property or an unknown group on a cluster of node groups."""
    base, _, group = key.partition(":")
    if base in GROUP_KEYS and not cluster.node_groups:
        raise AutoparError(f"--vary {key}: cluster {cluster.name} has no node groups ({base} varies one group of a "
                           f"cluster of node groups, e.g. the bundled {', '.join(grouped_clusters())}); on "
                           f"{cluster.name} vary {PLAIN_KEYS[base]} instead")
    if not cluster.node_groups:
        return
    if base not in GROUP_KEYS:
        raise AutoparError(f"--vary {key}: cluster {cluster.name} is made of node groups "
                           f"({', '.join(cluster.groups)}); vary one group's network or size: "
                           f"{', '.join(f'{k}:<group>' for k in GROUP_KEYS)}")
    if group not in cluster.groups:
        raise AutoparError(f"--vary {key}: no node group '{group}'{did_you_mean(group, list(cluster.groups))}; "
                           f"the cluster's groups are {', '.join(cluster.groups)}")


def with_group(cluster: ClusterSpec, key: str, group: str, value: Any) -> ClusterSpec:
    """A cluster of node groups with one group's NIC bandwidth (``group_bw``), nodes (``group_nodes``) or whole NIC
    section (``group_net``: kind, NICs, latency and efficiency of group ``value``; "what if the Ethernet island got
    the RoCE island's NICs") changed; its derived fields (the cluster at its slowest link) follow."""
    check_vary_key(cluster, f"{key}:{group}" if group else key)
    if key == "group_net" and value not in cluster.groups:
        raise AutoparError(f"--vary group_net:{group}={value}: no node group '{value}'"
                           f"{did_you_mean(value, list(cluster.groups))}; give groups whose NICs to use "
                           f"({', '.join(cluster.groups)})")
    data = cluster.model_dump(mode="json")
    for k in ("gpu", "gpus_per_node", "num_nodes", "intra_node", "inter_node"):
        data.pop(k)
    nets = {g["name"]: g["inter_node"] for g in data["node_groups"]}
    for g in data["node_groups"]:
        if g["name"] == group:
            if key == "group_bw":
                g["inter_node"]["nic_bandwidth_Gbps"] = value
            elif key == "group_net":
                g["inter_node"] = dict(nets[value])
            else:
                g["num_nodes"] = value
    return cluster_from_dict(data, cluster.name)


def with_gpu(cluster: ClusterSpec, name: str) -> tuple[ClusterSpec, str | None]:
    """The cluster's nodes with GPU ``name``: inside a node they get that GPU's own link (its profile's
    ``node_link``) when it differs from the cluster's; the second value says so in one line, or is None."""
    gpu = load_gpu(name)
    # the cluster's own GPU keeps its (maybe measured or calibrated) profile; another GPU drops the calibration,
    # which describes this one's runs
    swapped = cluster if gpu.name == cluster.gpu.name else cluster.model_copy(update={"gpu": gpu,
                                                                                      "calibration": None})
    problem = swapped.precision_problem()
    if problem:  # the sweep keeps the cluster's precision: its advice is a profile's (whatif has no precision option)
        raise AutoparError(f"{cluster.name} with {name}: {problem} (in a cluster profile's precision: a sweep keeps "
                           f"{cluster.name}'s)")
    problem = swapped.rate_problem()
    if problem:  # a GPU profile whose tables pass its peak: no plan is priced on it
        raise AutoparError(f"{cluster.name} with {name}: {problem}")
    link, intra = gpu.node_link, cluster.intra_node
    if gpu.name == cluster.gpu.name or link is None or link.bandwidth_GBps == intra.bandwidth_GBps:
        return swapped, None  # the cluster's own GPU keeps the cluster's (maybe measured) link
    own = intra.model_copy(update={"bandwidth_GBps": link.bandwidth_GBps, "latency_us": link.latency_us})
    note = (f"{name} nodes have {link.text()} inside a node, not {cluster.name}'s {intra.bandwidth_GBps:g} GB/s: "
            "priced with the GPU's own link")
    fits = {op: {lv: f for lv, f in levels.items() if lv != "intra"} for op, levels in cluster.collectives.items()}
    if fits != cluster.collectives:
        note += f" (the collectives {cluster.name}'s profile measured inside its nodes are left out)"
    return swapped.model_copy(update={"intra_node": own, "collectives": fits}), note


def _check_placements(keys: dict[str, Any], cluster: ClusterSpec, flags: dict[str, str]) -> None:
    """Refuse a fixed placement that no point of a sweep can run (no value swept renames the groups or changes a
    fixed pp): bad input in one line, not a sweep whose every point says so."""
    held = unplaced(keys)[0].get("placement")
    if held is None:
        return
    pp = keys.get("pp") if isinstance(keys.get("pp"), int) else None
    problem = placement_names_problem(held, cluster.groups, pp)
    if problem:
        raise AutoparError(f"{flags.get('placement', '--fix')} {problem}")


def checked_sweep(model: ModelSpec, cluster: ClusterSpec, global_batch: int, key: str, values: list[Any],
                  fixed: dict[str, Any], headroom_GiB: float | None = None,
                  compare: dict[str, Any] | None = None) -> SweepInputs:
    """A sweep's inputs, checked: errors that would fail every point (bad keys, a network the cluster does not have,
    a placement no point can run) are raised here, before any point is planned (the command checks a ``--compare``
    curve's before planning the first curve)."""
    key, values = parse_vary(f"{key}={','.join(map(str, values))}")  # the command's checks for the API's callers
    fixed, compare = typed_keys(fixed), typed_keys(dict(compare or {}))
    compare, homogeneous = unplaced(compare, cluster, "--compare")
    fixed, flat = unplaced(fixed, cluster)  # (--fix placement=none: the same as --compare's)
    flags = {k: "--compare" for k in compare}
    check_fixed_keys(model, fixed, global_batch)
    check_fixed_keys(model, compare, global_batch, flags)
    check_headroom(headroom_GiB, cluster)  # (a GPU type swept to may still be too small for it: that point says so)
    if key in ("inter_node_bw", "nics_per_node") and not cluster.node_groups:
        if cluster.inter_node is None:
            raise AutoparError(f"--vary {key}: cluster {cluster.name} has no inter_node section (it is one node), "
                               "so there is no network between nodes to vary; use a multi-node cluster profile")
        if cluster.num_nodes == 1:
            raise AutoparError(f"--vary {key}: {cluster.name} is one node here, so the network between nodes "
                               "does not matter; give --gpus or --nodes to span several")
    check_vary_key(cluster, key)  # a key the cluster cannot vary is bad input, not a sweep without a plan
    _check_placements({**fixed, **compare}, cluster, {**{k: "--fix" for k in fixed}, **flags})
    if key.startswith("group_net:"):  # a group name that is not one is bad input, not a point without a plan
        for v in values:
            cluster_at(cluster, key, v)
    return SweepInputs(key, values, {**fixed, **compare}, flags, homogeneous or flat)


def sweep(model: ModelSpec, cluster: ClusterSpec, global_batch: int, key: str, values: list[Any],
          fixed: dict[str, Any], headroom_GiB: float | None = None, compare: dict[str, Any] | None = None,
          progress: Callable[[int, int], None] | None = None) -> list[dict[str, Any]]:
    """Best plan at every value (a point with no fitting plan is {value, gpus, error}); ``headroom_GiB`` None:
    each point's default (cost_models/headroom.py: a share of each GPU's memory); ``progress(done, total)`` is
    told after each point.

    ``compare`` holds the ``--compare`` keys, fixed on top of ``fixed`` (errors about them name --compare);
    ``placement=none`` among them plans a cluster of node groups as homogeneous at its slowest link instead of
    placing plans on its groups. Errors that would fail every point are raised first (:func:`checked_sweep`).
    """
    given = checked_sweep(model, cluster, global_batch, key, values, fixed, headroom_GiB, compare)
    key, values = given.key, given.values
    pts: list[dict[str, Any]] = []
    for v in values:
        pt: dict[str, Any] = {"value": v}
        try:
            c, note = cluster_at(cluster, key, v)
            if note:
                pt["note"] = note
            pt["gpus"] = c.num_gpus
            res = search(model, c, global_batch, fixed=given.fixed, top=1, headroom_GiB=headroom_GiB,
                         refine_count=12, flags=given.flags, place_groups=not given.homogeneous)
        except AutoparError as err:
            res, pt["error"] = None, str(err)
            pt.setdefault("gpus", v if key == "gpus" else None)
        if res is not None and res.plans:
            best = res.plans[0]
            e = best.estimate
            pt.update(tokens_per_s=e.tokens_per_s, step_time_s=e.step_time_s, mfu=e.mfu, memory_GiB=e.memory_GiB,
                      plan=best.config.short(), parallel=best.config.to_dict(), breakdown=e.breakdown)
        elif res is not None:
            close = res.closest
            need = (f"; the closest ({close.config.short()}) needs {close.estimate.memory_GiB:.1f} GiB per GPU, of "
                    f"{usable_GiB(headroom_GiB, c.gpu.memory_GiB):g} usable ({c.gpu.memory_GiB:g} less "
                    f"{headroom_for(headroom_GiB, c.gpu.memory_GiB):g} headroom)"
                    ) if close is not None else ""
            pt["error"] = f"no plan fits{need}"
        pts.append(pt)
        if progress is not None:
            progress(len(pts), len(values))
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


__all__ = ["parse_vary", "sweep", "normalize", "cluster_at", "csv_header", "csv_rows",
           "list_gpus"]
