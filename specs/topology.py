"""Clusters made of node groups: islands of nodes with their own GPUs and NICs, joined by links between groups.

A cluster profile with ``node_groups`` (see docs/contract.md) describes, per group, its GPU, its nodes and their
NICs (``kind``: ib, roce or ethernet), and ``between_groups`` the per-node bandwidth and latency of the links that
join two groups (``default_between`` for every pair not listed). :class:`Topology` holds it as a networkx graph
(a switch per group, its nodes behind it, the group links between switches) and answers the one question the
cost model asks of it: over what bandwidth and latency do the nodes of two groups talk (the widest path's
narrowest link; its latencies summed)? Everything else about a group is an ordinary homogeneous cluster
(``ClusterSpec.group_view``).
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import Field, field_validator

from specs.strict import Strict

NicKind = Literal["ib", "roce", "ethernet"]
NIC_KINDS: tuple[str, ...] = get_args(NicKind)
GROUP_NAME = r"^[A-Za-z0-9_.-]+$"  # what a node group may be called (it appears in placements and plan files)


class Link(Strict):
    """The link between the GPUs of one node."""

    bandwidth_GBps: float = Field(gt=0)  # per GPU, per direction
    latency_us: float = Field(3.0, ge=0)
    # achieved bus bandwidth / nominal for large collectives (NVLink: ~240 of 300 GB/s)
    efficiency: float = Field(0.80, gt=0, le=1)


class InterNode(Strict):
    """A node's NICs: what joins the nodes of a cluster (of a node group) to each other."""

    nic_bandwidth_Gbps: float = Field(gt=0)  # per NIC
    nics_per_node: int = Field(ge=1)
    latency_us: float = Field(5.0, ge=0)
    efficiency: float = Field(0.80, gt=0, le=1)  # NCCL bus bandwidth at scale: typically 75-85% of line rate
    oversubscription: float = Field(1.0, ge=1)  # spine oversubscription: 2.0 halves cross-node bandwidth

    @property
    def node_Gbps(self) -> float:
        """What one node can send at once over its NICs."""
        return self.nic_bandwidth_Gbps * self.nics_per_node / self.oversubscription


class GroupNetwork(InterNode):
    """A node group's NICs, and their kind."""

    kind: NicKind = "ib"


class NodeGroup(Strict):
    """One island of identical nodes."""

    name: str

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if re.fullmatch(GROUP_NAME, v) is None:
            raise ValueError(f"got {v!r}; a group's name may hold letters, digits, '_', '.' and '-' only (it is "
                             "written in placements such as a*2/b and a+b)")
        return v
    gpu: dict[str, Any]  # its GPU profile (a profile file names it; loading puts the profile here)
    num_nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    intra_node: dict[str, float]  # {bandwidth_GBps, latency_us}; a profile file may leave it to the GPU's node link
    inter_node: GroupNetwork
    # measured collective fits of this group ({collective: {"intra"|"inter": fit}}), as a cluster profile's
    # ``collectives``: taken from the group's own `autopar profile` output (``profile:`` in the file); each fit's fields
    # (numbers, and a fit's ``busbw_by_nodes``) are checked as a CollectiveFit where the group's view is built
    collectives: dict[str, dict[str, dict[str, Any]]] = {}
    # the fit that scaled that profile, where `autopar calibrate` / `tune` wrote it (a specs.cluster.Calibration):
    # a link its comm scale lifted past the datasheet's is a measured one
    calibration: dict[str, Any] | None = None

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


class DefaultLink(Strict):
    """The link between the nodes of two groups: each node's share of it, and its latency."""

    bandwidth_Gbps_per_node: float = Field(gt=0)
    latency_us: float = Field(20.0, ge=0)


class GroupLink(DefaultLink):
    """The link between the nodes of the two ``groups``."""

    groups: tuple[str, str]


class Topology:
    """The node groups and their links as a graph of ``group:<name>`` switches (a group's nodes hang off its switch
    through their NICs, which :meth:`between` counts at both ends)."""

    def __init__(self, groups: tuple[NodeGroup, ...], links: tuple[GroupLink, ...],
                 default: DefaultLink | None) -> None:
        self.groups = {g.name: g for g in groups}
        self._between: dict[tuple[str, str], tuple[float, float]] = {}
        import networkx as nx  # (here: a plan's workers on a cluster without node groups never need it, 0.1 s)

        self.graph = nx.Graph()
        for g in groups:  # a group's nodes reach its switch over their own NICs (``between`` adds them)
            self.graph.add_node(_switch(g.name), kind="switch")
        listed: set[frozenset[str]] = set()
        self.repeated: tuple[str, str] | None = None  # a pair of groups two entries link (problem() says so)
        self.looped: str | None = None  # a group an entry links to itself (its nodes' own network says that)
        for link in links:
            a, b = link.groups
            if a == b:
                self.looped = self.looped or a
                continue
            if frozenset((a, b)) in listed:
                self.repeated = self.repeated or (min(a, b), max(a, b))
            listed.add(frozenset((a, b)))
            self.graph.add_edge(_switch(a), _switch(b), Gbps=link.bandwidth_Gbps_per_node, latency_us=link.latency_us)
        if default is not None:
            names = list(self.groups)
            for i, a in enumerate(names):
                for b in names[i + 1:]:
                    if frozenset((a, b)) not in listed:
                        self.graph.add_edge(_switch(a), _switch(b), Gbps=default.bandwidth_Gbps_per_node,
                                            latency_us=default.latency_us)

    def problem(self) -> str | None:
        """Why these groups and links do not make one cluster (an unknown group, a group no link reaches), or
        None."""
        if self.looped is not None and self.looped in self.groups:
            return (f"between_groups links group {self.looped} to itself; its nodes reach each other over its own "
                    f"inter_node network: set that, and link {self.looped} to other groups only")
        if self.repeated is not None:
            a, b = self.repeated
            return f"between_groups links {a} and {b} twice (in either order); give each pair of groups one entry"
        ends = [e[6:] for edge in self.graph.edges for e in edge if e.startswith("group:")]
        for name in [*ends, *([self.looped] if self.looped else [])]:
            if name not in self.groups:
                return (f"between_groups names group '{name}', which is not one of the node_groups "
                        f"({', '.join(self.groups)})")
        import networkx as nx

        switches = [_switch(n) for n in self.groups]
        reached = nx.node_connected_component(self.graph, switches[0])
        lost = [s[6:] for s in switches if s not in reached]
        if lost:
            return (f"no link reaches node group{'s' if len(lost) > 1 else ''} {', '.join(lost)} from "
                    f"{switches[0][6:]}: add between_groups entries for it or a default_between link")
        return None

    def between(self, a: str, b: str) -> tuple[float, float]:
        """(Gb/s per node, latency in us) between a node of group ``a`` and one of group ``b`` (two nodes of ``a``
        when ``b`` is ``a``): from a node's NICs through the switches to the other's, over the path of switches
        with the widest narrowest link (ties: the lower latency)."""
        if (a, b) not in self._between:
            na, nb = self.groups[a].inter_node, self.groups[b].inter_node
            ends = (min(na.node_Gbps, nb.node_Gbps), (na.latency_us + nb.latency_us) / 2)
            best = (float("inf"), 0.0)
            if a != b:
                import networkx as nx

                switches = self.graph.subgraph(_switch(n) for n in self.groups)  # not an unknown group a link named
                best = (0.0, float("inf"))
                for path in nx.all_simple_paths(switches, _switch(a), _switch(b)):
                    edges = [switches.edges[u, v] for u, v in zip(path, path[1:])]
                    cand = (min(e["Gbps"] for e in edges), sum(e["latency_us"] for e in edges))
                    if (cand[0], -cand[1]) > (best[0], -best[1]):
                        best = cand
            self._between[a, b] = (min(ends[0], best[0]), ends[1] + best[1])
        return self._between[a, b]


    def per_gpu_Gbps(self, a: str, b: str) -> float:
        """Gb/s each GPU of a node of ``a`` gets to a node of ``b`` when every GPU of both sends at once: the path's
        per-node bandwidth shared by the larger node's GPUs, and no more than either node's NICs give each of its
        GPUs (groups may differ in GPUs per node)."""
        ga, gb = self.groups[a], self.groups[b]
        return min(self.between(a, b)[0] / max(ga.gpus_per_node, gb.gpus_per_node),
                   ga.inter_node.node_Gbps / ga.gpus_per_node, gb.inter_node.node_Gbps / gb.gpus_per_node)


def _switch(name: str) -> str:
    return f"group:{name}"
