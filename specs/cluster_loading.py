"""Reading GPU and cluster profiles: bundled ones by name, files by path, node groups assembled from their own
profiles (specs/cluster.py holds what a profile is).

Bundled profiles live in ``hardware_profiles/gpus`` and ``hardware_profiles/clusters``; ``autopar profile``
writes a cluster file of the same shape with measured tables filled in.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from specs.cluster import (
    MAX_GPUS,
    Calibration,
    ClusterSpec,
    GPUSpec,
    gpu_precision_problem,
    intra_link_problem,
    table_rate_problem,
)
from specs.errors import AutoparError, did_you_mean, validated
from specs.files import check_output_file, read_mapping
from specs.topology import DefaultLink, GroupLink, Link, NodeGroup, Topology

PROFILE_DIR = Path(__file__).resolve().parent.parent / "hardware_profiles"


def list_gpus() -> list[str]:
    return sorted(p.stem for p in (PROFILE_DIR / "gpus").glob("*.yaml"))


def list_clusters() -> list[str]:
    return sorted(p.stem for p in (PROFILE_DIR / "clusters").glob("*.yaml"))


def _profile_path(ref: str, kind: str, bundled: list[str], more: str = "") -> Path:
    """The file of a profile given as a path, or bundled under ``kind`` (gpus, clusters) by name."""
    what = "GPU" if kind == "gpus" else "cluster"
    path = Path(ref)
    if path.is_dir() and ref not in bundled:
        inside = sorted(f.name for f in path.glob("*.y*ml"))[:5]
        hint = f" ({', '.join(inside)} there)" if inside else ""
        raise AutoparError(f"{what} profile {ref} is a folder; give a profile file inside it{hint}, or a bundled "
                           f"name: {', '.join(bundled)}")
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        if not path.exists():
            raise AutoparError(f"{what} profile {ref} does not exist; bundled {kind}: {', '.join(bundled)}")
        return path
    path = PROFILE_DIR / kind / f"{ref}.yaml"
    if not path.exists():
        raise AutoparError(f"unknown {what} '{ref}'{did_you_mean(ref, bundled)}; bundled {kind}: "
                           f"{', '.join(bundled)}{more}")
    return path


def is_profile_data(data: Any) -> bool:
    """Whether a file's content (read as YAML) is a cluster profile's: a mapping naming its GPU or node groups."""
    return isinstance(data, dict) and ("gpu" in data or "node_groups" in data)


def check_profile_out(path: str, what: str, inputs: dict[str, str | None] | None = None) -> None:
    """``path`` can take a cluster profile: written as YAML, so not named .json (it would then be read as JSON and
    fail to load), and not a file of another kind (a model spec, a plan) that writing it would destroy."""
    check_output_file(path, what, inputs, replaces=is_profile_data)
    if Path(path).suffix.lower() == ".json":
        raise AutoparError(f"{what} {path}: profiles are written as YAML; name it .yaml or .yml")


def load_gpu(ref: str | dict[str, Any]) -> GPUSpec:
    """A GPU profile by bundled name, file path, or inline mapping."""
    if isinstance(ref, dict):
        return validated(GPUSpec, ref, "inline GPU profile")
    path = _profile_path(ref, "gpus", list_gpus())
    return validated(GPUSpec, read_mapping(path, "GPU profile"), f"GPU profile {ref}")


def _gpu_of(ref: str | dict[str, Any], base: Path | None, where: str) -> GPUSpec:
    """:func:`load_gpu` of a profile's ``gpu`` field, an error naming the profile (``where``) and, for a file not
    found, the folders it was looked for in."""
    try:
        return load_gpu(_near(ref, base))
    except AutoparError as err:
        folders = " and ".join(dict.fromkeys(str(f.resolve()) for f in (base, Path.cwd()) if f is not None))
        seen = (f" (looked for in {folders})" if isinstance(ref, str) and "does not exist" in str(err)
                and not Path(ref).is_absolute() else "")
        raise AutoparError(f"{where}: gpu: {err}{seen}") from None


def _near(ref: Any, base: Path | None) -> Any:
    """A profile path written inside a profile, read from that profile's folder (``base``) when the file is there:
    a relative path means the same file wherever the command runs. Names and mappings are returned as they are."""
    if isinstance(ref, str) and base is not None and not Path(ref).is_absolute() and (base / ref).is_file():
        return str(base / ref)
    return ref


def cluster_from_dict(data: dict[str, Any], source: str, base: Path | None = None) -> ClusterSpec:
    """A cluster from a profile's mapping (``source`` names it in errors; ``base``: the folder relative paths in it
    are read from)."""
    data = dict(data)
    if data.get("node_groups") == [] and "gpu" not in data:
        raise AutoparError(f"cluster profile {source}: node_groups is empty; give its groups, or 'gpu' and the other "
                           "fields of one kind of node")
    if not data.get("node_groups"):  # written out by autopar for a homogeneous cluster: empty group fields
        for key in ("node_groups", "between_groups", "default_between"):
            if not data.get(key):
                data.pop(key, None)
    elif "gpu" in data and all(isinstance(g, dict) and isinstance(g.get("gpu"), dict) for g in data["node_groups"]):
        return validated(ClusterSpec, data, f"cluster profile {source}")  # written out by autopar: complete
    else:
        data = _grouped(data, source, base)
    if "gpu" not in data:
        raise AutoparError(f"cluster profile {source}: missing required field 'gpu' (a GPU name or mapping)")
    gpu = data["gpu"]
    if not isinstance(gpu, (str, dict, GPUSpec)):
        raise AutoparError(f"cluster profile {source}: 'gpu' must be a GPU name, a profile path or a mapping, "
                           f"not {type(gpu).__name__}")
    data["gpu"] = gpu if isinstance(gpu, GPUSpec) else _gpu_of(gpu, base, f"cluster profile {source}")
    data.setdefault("name", Path(source).stem)
    link = data["gpu"].node_link
    if "intra_node" not in data:  # the GPU's own platform link
        if link is None:
            raise AutoparError(f"cluster profile {source}: missing 'intra_node' (e.g. {{bandwidth_GBps: 300}}, per GPU "
                               f"inside a node), and GPU {data['gpu'].name} has no node_link to take it from")
        data["intra_node"] = {"bandwidth_GBps": link.bandwidth_GBps, "latency_us": link.latency_us}
    return validated(ClusterSpec, data, f"cluster profile {source}")


def load_cluster(ref: str, gpus: int | None = None, nodes: int | None = None) -> ClusterSpec:
    """A cluster by bundled name or file path, optionally resized."""
    path = _profile_path(ref, "clusters", list_clusters(), ", or a path to a profile from `autopar profile`")
    return cluster_from_dict(read_mapping(path, "cluster profile"), str(ref), path.parent).resized(gpus, nodes)


def _grouped(data: dict[str, Any], source: str, base: Path | None = None) -> dict[str, Any]:
    """A profile with ``node_groups``: each group's GPU resolved to its profile and its intra-node link filled in,
    the links checked, and the top-level fields set to the cluster seen as homogeneous at its slowest GPU and
    link (what plans that ignore the groups are priced on), in nodes of the largest number of GPUs that divides
    every group's nodes."""
    where = f"cluster profile {source}"
    raw = data.get("node_groups")
    if not isinstance(raw, list) or not raw:
        raise AutoparError(f"{where}: node_groups must be a non-empty list of groups (name, gpu, num_nodes, "
                           "gpus_per_node, inter_node)")
    for key in ("gpu", "gpus_per_node", "num_nodes", "intra_node", "inter_node"):
        if key in data:
            raise AutoparError(f"{where}: with node_groups, give '{key}' per group, not at the top level")
    groups = []
    for i, g in enumerate(raw):
        if isinstance(g, dict) and "profile" in g:
            g = _from_profile(g, where, i, base)
        if not isinstance(g, dict) or not isinstance(g.get("gpu"), (str, dict)):
            raise AutoparError(f"{where}: node_groups[{i}] needs a 'gpu' (a GPU profile name) among its fields, or "
                               "'profile' (the group's own cluster profile, e.g. from `autopar profile`)")
        gpu = _gpu_of(g["gpu"], base, f"{where}: node_groups[{i}]")
        g = {**g, "gpu": gpu.model_dump()}
        if g.get("intra_node") is None:
            if gpu.node_link is None:
                raise AutoparError(f"{where}: node group {g.get('name', i)} needs 'intra_node' ({{bandwidth_GBps: "
                                   f"...}}): GPU {gpu.name} has no node_link to take it from")
            g["intra_node"] = {"bandwidth_GBps": gpu.node_link.bandwidth_GBps, "latency_us": gpu.node_link.latency_us}
        groups.append(validated(NodeGroup, g, f"{where}, node_groups[{i}]"))
    names = [g.name for g in groups]
    if len(set(names)) < len(names):
        raise AutoparError(f"{where}: node group names must differ, got {', '.join(names)}")
    total = sum(g.num_gpus for g in groups)
    if total > MAX_GPUS:  # before anything is built from the groups
        raise AutoparError(f"{where}: its node groups hold {total:,} GPUs, beyond autopar's limit of {MAX_GPUS:,}; "
                           "check each group's num_nodes and gpus_per_node")
    links = tuple(validated(GroupLink, x, f"{where}, between_groups") for x in data.get("between_groups") or [])
    default = data.get("default_between")
    default = validated(DefaultLink, default, f"{where}, default_between") if default is not None else None
    topo = Topology(tuple(groups), links, default)
    problem = topo.problem()
    if problem:
        raise AutoparError(f"{where}: {problem}")
    precision = data.get("precision", "bf16")
    gpus = [GPUSpec.model_validate(g.gpu) for g in groups]
    backend = data.get("backend", "nccl")
    for g, gpu in zip(groups, gpus):  # every group's GPU, not only the slowest the merged view keeps
        fit = Calibration.model_validate(g.calibration) if g.calibration is not None else None
        problem = (gpu_precision_problem(gpu, precision, backend)
                   or table_rate_problem(gpu, precision, backend, fit is not None)
                   or intra_link_problem(gpu, g.intra_node["bandwidth_GBps"], fit))
        if problem:
            raise AutoparError(f"{where}: node group {g.name}: {problem}")
    slowest = min(gpus, key=lambda x: x.peak(precision))
    narrow = min(range(len(groups)), key=lambda i: groups[i].intra_node["bandwidth_GBps"])
    intra = Link.model_validate(groups[narrow].intra_node)  # the slowest GPU gets the narrowest node's link
    slowest = slowest.model_copy(update={"memory_GiB": min(x.memory_GiB for x in gpus),
                                         "node_link": gpus[narrow].node_link})
    pairs = [(a.name, b.name) for i, a in enumerate(groups) for b in groups[i:]]
    node = math.gcd(*(g.gpus_per_node for g in groups))  # the view's node: what every group's nodes are made of
    per_node = min(topo.per_gpu_Gbps(a, b) for a, b in pairs) * node
    latency = max(topo.between(a, b)[1] for a, b in pairs)
    return {**data, "node_groups": groups, "between_groups": links, "default_between": default,
            "gpu": slowest, "gpus_per_node": node, "num_nodes": sum(g.num_gpus for g in groups) // node,
            "intra_node": intra.model_dump(),
            "inter_node": {"nic_bandwidth_Gbps": per_node, "nics_per_node": 1, "latency_us": latency,
                           "efficiency": min(g.inter_node.efficiency for g in groups)}}


def _from_profile(group: dict[str, Any], where: str, i: int, base: Path | None = None) -> dict[str, Any]:
    """A node group given as ``{name, profile: path, num_nodes}``: its GPU (with any measured tables), links, NICs and
    measured collective fits from that cluster profile (e.g. written by `autopar profile` on one of its nodes, or on
    the group under torchrun); the entry's own fields (num_nodes, kind, ...) win."""
    rest = {k: v for k, v in group.items() if k != "profile"}
    ref = group["profile"]
    if not isinstance(ref, str):
        raise AutoparError(f"{where}: node_groups[{i}].profile must be a cluster profile name or path")
    try:
        path = _profile_path(_near(ref, base), "clusters", list_clusters())
        raw = read_mapping(path, "cluster profile")
    except AutoparError as err:  # say which file named it
        raise AutoparError(f"{where}: node_groups[{i}].profile: {err}") from None
    if raw.get("node_groups"):  # checked before it is read as a cluster: a profile naming itself would never end
        raise AutoparError(f"{where}: node_groups[{i}].profile {ref} is itself made of node groups; give a profile of "
                           "one group's nodes")
    c = cluster_from_dict(raw, ref, path.parent)
    net = c.inter_node.model_dump() if c.inter_node is not None else {
        "nic_bandwidth_Gbps": c.intra_node.bandwidth_GBps * 8, "nics_per_node": 1}
    base = {"gpu": c.gpu.model_dump(), "num_nodes": c.num_nodes, "gpus_per_node": c.gpus_per_node,
            "intra_node": {"bandwidth_GBps": c.intra_node.bandwidth_GBps, "latency_us": c.intra_node.latency_us},
            "inter_node": {**net, **rest.pop("inter_node", {})},
            "collectives": {op: {lv: f.model_dump(exclude_none=True) for lv, f in levels.items()}
                            for op, levels in c.collectives.items()},
            "calibration": c.calibration.model_dump() if c.calibration is not None else None}
    return {**base, **rest}
