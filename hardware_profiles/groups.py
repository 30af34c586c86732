"""Node groups for ``autopar profile --group NAME``: which ranks form which group, which nodes measure the links
between groups, and the cluster profile with ``node_groups`` and ``between_groups`` built from the measurements.

Every node of a torchrun job names its group (``--group``, the same on all its ranks); the ranks exchange
their names (:func:`node_layout` checks them: all or none named, one name per node, the same ranks on every node
of a group; groups may differ in ranks per node). Each group is measured as a cluster of its own, restricted to
its ranks and nodes (collectives.run_groups), and each pair of groups over one node of each (:func:`link_rounds`,
collectives.run_links): local rank i of one node exchanges with local rank i of the other for every i both nodes
have, all at once, so the pairs share the nodes' NICs as pipeline sends do. A link's bandwidth per node is the
alpha-beta fit's per-GPU bandwidth times the number of pairs (what the link carried); its latency is the fit's
alpha less the two groups' NIC hops, which the cost model adds back (specs/topology.py ``Topology.between``).

Pure Python + numpy (no torch), so it is testable on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hardware_profiles.assemble import _sig, cluster_profile
from hardware_profiles.fit import fit_alpha_beta
from specs.cluster import COLLECTIVES
from specs.errors import AutoparError
from specs.topology import GROUP_NAME, NIC_KINDS

NAME = re.compile(GROUP_NAME)


@dataclass(frozen=True)
class Layout:
    """The node groups of a torchrun job: each group's nodes (their global ranks by local rank), groups in the
    order of their first node, and each group's NIC kind. Every node of a group runs the same number of ranks;
    groups may differ."""

    groups: dict[str, list[list[int]]]
    kinds: dict[str, str]

    @property
    def members(self) -> list[list[int]]:
        """Each group's ranks, node after node (what the collectives of a group run over)."""
        return [[r for node in nodes for r in node] for nodes in self.groups.values()]

    @property
    def per_node(self) -> list[int]:
        """Each group's ranks per node (its GPUs per node), in the order of :attr:`members`."""
        return [len(nodes[0]) for nodes in self.groups.values()]


@dataclass(frozen=True)
class LinkPlan:
    """The link between groups ``a`` and ``b`` measured between one node of each: (rank of a, rank of b) pairs."""

    groups: tuple[str, str]
    pairs: tuple[tuple[int, int], ...]


def rank_record(group: str | None, nic_kind: str | None, node: int, local_rank: int, local_world: int
                ) -> dict[str, Any]:
    """What one rank tells the others (all_gather_object) about itself."""
    return {"group": group, "nic_kind": nic_kind, "node": node, "local_rank": local_rank, "local_world": local_world}


def _nodes(records: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Node -> its global ranks by local rank, nodes ascending."""
    out: dict[int, list[int]] = {}
    for rank, r in sorted(enumerate(records), key=lambda x: (x[1]["node"], x[1]["local_rank"])):
        out.setdefault(r["node"], []).append(rank)
    return out


def _sizes(nodes: dict[int, list[int]], records: list[dict[str, Any]]) -> dict[int, int]:
    """The ranks of each node, as its ranks counted themselves (one-line error where their LOCAL_WORLD_SIZE
    says otherwise)."""
    for n, ranks in nodes.items():
        said = sorted({records[r]["local_world"] for r in ranks})
        if said != [len(ranks)]:
            raise AutoparError(f"node {n} runs {len(ranks)} rank(s) but its ranks say LOCAL_WORLD_SIZE "
                               f"{', '.join(map(str, said))}: run every node under torchrun (it sets GROUP_RANK and "
                               "LOCAL_WORLD_SIZE)")
    return {n: len(ranks) for n, ranks in nodes.items()}


def _check_equal(sizes: dict[int, int]) -> None:
    """Every node the same number of ranks (a profile without node groups is homogeneous)."""
    if len(set(sizes.values())) > 1:
        per = ", ".join(f"node {n}: {s}" for n, s in sizes.items())
        raise AutoparError(f"every node must run the same number of ranks; got {per}: give every node the same "
                           "--nproc-per-node (or name node groups with --group: groups may differ in GPUs per node)")


def _check_groups(groups: dict[str, list[int]], sizes: dict[int, int]) -> None:
    """Every node of a group the same number of ranks (groups may differ)."""
    for name, nodes in groups.items():
        if len({sizes[n] for n in nodes}) > 1:
            per = ", ".join(f"node {n}: {sizes[n]}" for n in nodes)
            raise AutoparError(f"the nodes of group {name} run different numbers of ranks ({per}): give every node of "
                               "a group the same --nproc-per-node (groups may differ)")


def node_layout(records: list[dict[str, Any]]) -> Layout | None:
    """The node groups named by every rank's record (:func:`rank_record`), or None when no rank named one.

    One-line errors: some nodes named and others not, a bad name or NIC kind, a node whose ranks disagree, nodes
    of one group (or, without groups, any nodes) of different sizes. Every rank calls it on the same records, so
    every rank fails alike."""
    nodes = _nodes(records)
    sizes = _sizes(nodes, records)
    named = [n for n, ranks in nodes.items() if any(records[r]["group"] for r in ranks)]
    if not named:
        _check_equal(sizes)
        kinds = sorted({r["nic_kind"] for r in records if r["nic_kind"]})
        if kinds:
            raise AutoparError(f"--nic-kind {kinds[0]} describes a node group's NICs: give it with --group NAME")
        return None
    bare = [n for n in nodes if n not in named]
    if bare:
        first = records[nodes[named[0]][0]]["group"]
        raise AutoparError(f"--group must be given on every node or on none: node{'s' if len(bare) > 1 else ''} "
                           f"{', '.join(map(str, bare))} gave none (node {named[0]}: --group {first})")
    groups: dict[str, list[list[int]]] = {}
    node_ids: dict[str, list[int]] = {}
    kinds: dict[str, set[str]] = {}
    for n, ranks in nodes.items():
        names = sorted({records[r]["group"] or "(none)" for r in ranks})
        if len(names) > 1:
            raise AutoparError(f"the ranks of node {n} gave different --group names ({', '.join(names)}): give every "
                               "rank of a node the same name")
        if not NAME.match(names[0]):
            raise AutoparError(f"--group {names[0]!r}: a group name may hold only letters, digits, '_', '.' and '-'")
        groups.setdefault(names[0], []).append(ranks)
        node_ids.setdefault(names[0], []).append(n)
        kinds.setdefault(names[0], set()).update(records[r]["nic_kind"] or "ib" for r in ranks)
    for name, ks in kinds.items():
        bad = sorted(ks - set(NIC_KINDS))
        if bad:
            raise AutoparError(f"--nic-kind {bad[0]}: use one of {', '.join(NIC_KINDS)}")
        if len(ks) > 1:
            raise AutoparError(f"the nodes of group {name} gave different --nic-kind ({', '.join(sorted(ks))}): "
                               "give one per group")
    _check_groups(node_ids, sizes)
    return Layout(groups, {name: ks.pop() for name, ks in kinds.items()})


def link_rounds(groups: dict[str, list[list[int]]]) -> list[list[LinkPlan]]:
    """Every pair of groups once, between a node of each, local rank i with local rank i for every i both nodes
    have (the larger node's other ranks sit out). A node serves one
    link at a time; links that share no node are measured at once (one round), so a group with several nodes
    lends a different node to each of its links."""
    names = list(groups)
    rounds: list[list[LinkPlan]] = []
    busy: list[set[tuple[str, int]]] = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for r in range(len(rounds) + 1):
                if r == len(rounds):
                    rounds.append([])
                    busy.append(set())
                na = next((j for j in range(len(groups[a])) if (a, j) not in busy[r]), None)
                nb = next((j for j in range(len(groups[b])) if (b, j) not in busy[r]), None)
                if na is not None and nb is not None:
                    busy[r] |= {(a, na), (b, nb)}
                    rounds[r].append(LinkPlan((a, b), tuple(zip(groups[a][na], groups[b][nb]))))
                    break
    return rounds


def link_fit(points: list[tuple[int, float]], pairs: int) -> dict[str, float]:
    """``{bandwidth_Gbps_per_node, alpha_us, r2}`` from a link's (bytes each rank sent, seconds) points: the
    alpha-beta fit per pair, its bandwidth times the ``pairs`` that sent at once (what the link carried between
    the two nodes), and its alpha end to end (NIC hops included)."""
    ab = fit_alpha_beta([b for b, _ in points], [t for _, t in points])
    return {"bandwidth_Gbps_per_node": _sig(ab.bw_Bps * pairs * 8 / 1e9), "alpha_us": _sig(ab.alpha_s * 1e6),
            "r2": round(ab.r2, 4)}


def link_latency(alpha_us: float, a: dict[str, Any], b: dict[str, Any]) -> float:
    """A link's ``latency_us`` between node groups ``a`` and ``b`` (their ``node_groups`` entries) from its measured
    end-to-end alpha: less the NIC hops ``Topology.between`` adds ((a's + b's NIC latency) / 2), so the model
    prices the alpha once; 0 where the hops alone exceed it."""
    hops = (a["inter_node"]["latency_us"] + b["inter_node"]["latency_us"]) / 2
    return _sig(max(0.0, alpha_us - hops))


def _network(g: dict[str, Any], profile: dict[str, Any], links: list[dict[str, Any]], notes: list[str]
             ) -> dict[str, Any]:
    """A group's ``inter_node``: measured across its nodes, else (one node) the bundled defaults the homogeneous
    profile uses, else its fastest measured link to another group, else its intra-node bandwidth. Where its
    links were measured its efficiency is 1 (the cost model scales a link between groups by it)."""
    name = g["name"]
    if len(g["nodes"]) > 1 and "inter_node" in profile:
        return profile["inter_node"]
    if len(g["nodes"]) > 1:  # several nodes, but nothing measured across them (backend lacks every collective)
        notes.append(f"group {name}: no collective measured across its nodes; its NICs use the defaults below")
    if "inter_node" in profile:  # efficiency 1: a cross-group send is priced at the link as measured
        notes.append(f"group {name} has one node: its NICs are the bundled defaults for {profile['gpu']['name']} "
                     "(profile two or more of its nodes to measure them)")
        return {**profile["inter_node"], "efficiency": 1.0}
    mine = [x for x in links if name in x["groups"]]
    if mine:
        best = max(mine, key=lambda x: x["bandwidth_Gbps_per_node"])
        notes.append(f"group {name} has one node: its NICs are taken as its fastest measured link "
                     f"({'-'.join(best['groups'])}, one NIC of {best['bandwidth_Gbps_per_node']:.4g} Gb/s)")
        return {"nic_bandwidth_Gbps": best["bandwidth_Gbps_per_node"], "nics_per_node": 1,
                "latency_us": best["alpha_us"], "efficiency": 1.0}
    intra = profile["intra_node"]
    notes.append(f"group {name} has one node and no link was measured: its NICs are taken as its intra-node "
                 "bandwidth")
    return {"nic_bandwidth_Gbps": _sig(intra["bandwidth_GBps"] * 8), "nics_per_node": 1,
            "latency_us": intra.get("latency_us", 5.0)}


def node_group(g: dict[str, Any], meas: dict[str, Any], links: list[dict[str, Any]], notes: list[str],
               kernel_overhead_s: float | None = None, elementwise_Bps: float | None = None) -> dict[str, Any]:
    """One ``node_groups`` entry from a group's measurements (``{name, kind, nodes, device, compute,
    collectives}``): its GPU with the measured tables, links, NICs and collective fits, as assemble.py builds a
    homogeneous profile."""
    local = len(g["nodes"][0])  # its own GPUs per node
    world = len(g["nodes"]) * local
    run = {**meas, "device": g["device"], "world": world, "local": local, "compute": g["compute"],
           "collectives": g["collectives"]}
    prof = cluster_profile(run, g["name"], kernel_overhead_s, elementwise_Bps, as_run=True)
    if world > 1:
        missing = [c for c in COLLECTIVES if c not in g["collectives"]]
        if missing:
            notes.append(f"group {g['name']}: {meas['backend']} does not implement {', '.join(missing)} here; the "
                         "model's defaults apply")
    out = {"name": g["name"], "gpu": prof["gpu"], "num_nodes": len(g["nodes"]), "gpus_per_node": local,
           "intra_node": prof["intra_node"], "inter_node": {**_network(g, prof, links, notes), "kind": g["kind"]}}
    if prof.get("collectives"):
        out["collectives"] = prof["collectives"]
    return out


def grouped_profile(meas: dict[str, Any], name: str,
                    probe_fits: dict[str, tuple[float | None, float | None]] | None = None
                    ) -> tuple[dict[str, Any], list[str]]:
    """The cluster profile with ``node_groups`` and ``between_groups`` (valid for ``cluster_from_dict``) and notes
    for the user, from rank 0's measurements of a grouped run. ``probe_fits``: per group, the CPU layer probes'
    (seconds per kernel, elementwise bytes/s)."""
    notes: list[str] = []
    links = [{"groups": list(x["groups"]), **link_fit(x["points"], len(x["pairs"]))} for x in meas["links"]]
    if len(meas["groups"]) == 1:
        notes.append("one node group: no link between groups to measure (give other nodes another --group name)")
    fits = probe_fits or {}
    groups = [node_group(g, meas, links, notes, *fits.get(g["name"], (None, None))) for g in meas["groups"]]
    by_name = {g["name"]: g for g in groups}
    between = [{"groups": x["groups"], "bandwidth_Gbps_per_node": x["bandwidth_Gbps_per_node"],
                "latency_us": link_latency(x["alpha_us"], *(by_name[n] for n in x["groups"]))} for x in links]
    profile = {"name": name, "backend": meas["backend"], "precision": meas["precision"], "node_groups": groups}
    if between:
        profile["between_groups"] = between
    return profile, notes
