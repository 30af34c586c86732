"""Communication cost: alpha-beta time of each collective, hierarchical over NVLink and NICs.

Groups are placed on the (pp, dp, cp, tp) rank order, tp innermost: a group is described by its ``size`` and
the ``stride`` between consecutive members. From that and the node size follow how many members share a
node (``k``) and how many nodes it spans (``N``). All functions take numpy arrays or scalars (broadcast).

Bandwidth model (NCCL rings; reduce-scatter and all-gather are ring-only, all-reduce may use a tree): a group
with k members per node moves its data over NVLink inside a node and
over the k NIC shares of its members across nodes, so a ring's bottleneck is min(intra, k x NIC-per-GPU).
Each GPU's NIC share is nics_per_node x nic_bandwidth / gpus_per_node (every GPU of the node talks at once,
as when all tensor-parallel ranks run their data-parallel reduce together). Latency: one hop per ring step
(NVLink hops inside nodes, a NIC hop between nodes); all-reduce uses a tree across nodes (log2 N NIC hops).
Large reductions run in buckets, each paying the latency. Measured fits from ``autopar profile`` replace both:
across nodes a fit is one member's share (measured with one rank a node, every rank of the node at once), so a
ring with k members a node gets k of them up to NVLink's bandwidth, as the analytic model does, and a fit with
``busbw_by_nodes`` gives that share for the node count the group spans (a fabric that slows with scale).
"""

from __future__ import annotations

import numpy as np

from specs.cluster import ClusterSpec, bus_factor

ArrayLike = np.ndarray | float | int


class CommModel:
    """Collective times on one cluster. Sizes are bytes per GPU as defined for each collective."""

    def __init__(self, cluster: ClusterSpec) -> None:
        self.c = cluster
        intra = cluster.intra_node
        self.g = cluster.gpus_per_node
        self.bw_intra = intra.bandwidth_GBps * 1e9 * intra.efficiency
        self.lat_intra = intra.latency_us * 1e-6
        if cluster.inter_node is not None:
            self.bw_nic = cluster.nic_bw_per_gpu * cluster.inter_node.efficiency
            self.lat_inter = cluster.inter_node.latency_us * 1e-6
        else:
            self.bw_nic, self.lat_inter = self.bw_intra, self.lat_intra
        self.fits = cluster.collectives

    # ---- placement ---------------------------------------------------------------------------
    def placement(self, size: ArrayLike, stride: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """Members per node (k) and nodes spanned (N) of a group of ``size`` ranks ``stride`` apart."""
        size = np.asarray(size, dtype=float)
        stride = np.asarray(stride, dtype=float)
        per_node = np.maximum(1.0, np.floor(self.g / np.maximum(stride, 1.0)))
        k = np.minimum(size, per_node)
        nodes = np.ceil(size / k)
        return k, nodes

    def _bw(self, k: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        return np.where(nodes > 1, np.minimum(self.bw_intra, k * self.bw_nic), self.bw_intra)

    def _lat(self, k: np.ndarray, nodes: np.ndarray, ring: bool) -> np.ndarray:
        """Latency of one pass: a ring pays one hop per member (n-1 steps: (k-1) NVLink hops per node and
        one NIC hop between nodes); all-reduce may use NCCL's tree, log2(nodes) NIC hops deep."""
        across = nodes if ring else np.ceil(np.log2(np.maximum(nodes, 1)))
        intra = (k - 1) * (nodes if ring else 1)
        return intra * self.lat_intra + np.where(nodes > 1, across, 0.0) * self.lat_inter

    def _fit_time(self, f, nbytes: np.ndarray, factor: np.ndarray, extra: np.ndarray, nodes: ArrayLike = 1.0,
                  k: ArrayLike | None = None) -> np.ndarray:
        """A measured fit's time; across nodes (``k``: the group's members per node) its bandwidth is one member's
        NIC share, as `autopar profile` measures it (one rank a node, every rank of the node at once), so a ring of
        k members a node moves k shares, up to NVLink's (the analytic model's min(intra, k x NIC))."""
        bw = f.busbw_at(nodes) * 1e9
        if k is not None:
            bw = np.minimum(self.bw_intra, np.asarray(k, dtype=float) * bw)
        return (f.alpha_us + f.alpha_per_rank_us * extra) * 1e-6 + nbytes * factor / bw

    def _collective(self, name: str, nbytes: ArrayLike, size: ArrayLike, stride: ArrayLike,
                    volume: float, ring: bool = True) -> np.ndarray:
        """The bus factor (``specs.cluster.bus_factor``: ``volume`` x (n-1)/n) x bytes over the bottleneck bandwidth,
        plus ``volume`` passes' latency; zero for n == 1.

        A measured fit for the group's level (nccl-tests convention; a group of n > 2 ranks adds the fit's
        per-rank latency for each member beyond two) replaces the analytic time; a level the profile did not
        measure (say, across nodes after a one-node profile) keeps the analytic model."""
        nbytes = np.asarray(nbytes, dtype=float)
        n = np.asarray(size, dtype=float)
        k, nodes = self.placement(n, stride)
        factor = bus_factor(name, n)
        t = volume * self._lat(k, nodes, ring) + nbytes * factor / self._bw(k, nodes)
        return np.where(n > 1, self._measured(name, t, nbytes, n, nodes, factor, k), 0.0)

    def _measured(self, name: str, t: np.ndarray, nbytes: np.ndarray, n: np.ndarray, nodes: np.ndarray,
                  factor: np.ndarray, k: np.ndarray | None = None) -> np.ndarray:
        """The analytic time ``t`` of collective ``name``, replaced by the profile's measured fit where it has one for
        the group's level (inside a node, across nodes); ``k`` for a ring (its members per node), None for the
        all-to-all (each member over its own NIC share)."""
        fit = self.fits.get(name) or {}
        extra = np.maximum(n - 2.0, 0.0)
        if fit.get("intra"):
            t = np.where(nodes <= 1, self._fit_time(fit["intra"], nbytes, factor, extra), t)
        if fit.get("inter"):
            t = np.where(nodes > 1, self._fit_time(fit["inter"], nbytes, factor, extra, nodes, k), t)
        return t

    # ---- collectives -------------------------------------------------------------------------
    def all_reduce(self, nbytes: ArrayLike, size: ArrayLike, stride: ArrayLike = 1) -> np.ndarray:
        """All-reduce of a ``nbytes`` buffer held by every member (ring: 2(n-1)/n of it crosses each link)."""
        return self._collective("all_reduce", nbytes, size, stride, 2.0, ring=False)

    def all_gather(self, out_bytes: ArrayLike, size: ArrayLike, stride: ArrayLike = 1) -> np.ndarray:
        """All-gather producing ``out_bytes`` on every member."""
        return self._collective("all_gather", out_bytes, size, stride, 1.0)

    def reduce_scatter(self, in_bytes: ArrayLike, size: ArrayLike, stride: ArrayLike = 1) -> np.ndarray:
        """Reduce-scatter of an ``in_bytes`` input on every member."""
        return self._collective("reduce_scatter", in_bytes, size, stride, 1.0)

    def bucketed(self, collective, nbytes: ArrayLike, buckets: ArrayLike, size: ArrayLike,
                 stride: ArrayLike = 1) -> np.ndarray:
        """``collective`` over ``nbytes`` issued as ``buckets`` equal calls (each pays the latency)."""
        nb = np.maximum(np.asarray(buckets, dtype=float), 1.0)
        return nb * collective(np.asarray(nbytes, dtype=float) / nb, size, stride)

    def all_to_all(self, nbytes: ArrayLike, size: ArrayLike, stride: ArrayLike = 1) -> np.ndarray:
        """All-to-all of ``nbytes`` sent by every member (1/n to each): not a ring, every member talks to every
        other at once, so the (n - k)/n of its data bound for other nodes goes over its own NIC share while the
        (k - 1)/n for its node's members goes over NVLink; one latency per peer node. A measured fit replaces it."""
        nbytes = np.asarray(nbytes, dtype=float)
        n = np.asarray(size, dtype=float)
        k, nodes = self.placement(n, stride)
        inside = nbytes * (k - 1) / np.maximum(n, 1) / self.bw_intra
        across = nbytes * (n - k) / np.maximum(n, 1) / self.bw_nic
        t = np.maximum(inside, across) + self.lat_intra + np.where(nodes > 1, (nodes - 1) * self.lat_inter, 0.0)
        return np.where(n > 1, self._measured("all_to_all", t, nbytes, n, nodes, bus_factor("all_to_all", n)), 0.0)

    def p2p(self, nbytes: ArrayLike, cross_node: ArrayLike) -> np.ndarray:
        """One send/recv between neighbouring pipeline stages (every GPU of the node sending at once)."""
        nbytes = np.asarray(nbytes, dtype=float)
        cross = np.asarray(cross_node, dtype=bool)
        t = np.where(cross, self.lat_inter + nbytes / self.bw_nic, self.lat_intra + nbytes / self.bw_intra)
        fit = self.fits.get("p2p") or {}
        zero = np.zeros_like(nbytes)
        if fit.get("intra"):
            t = np.where(~cross, self._fit_time(fit["intra"], nbytes, 1.0, zero), t)
        if fit.get("inter"):
            t = np.where(cross, self._fit_time(fit["inter"], nbytes, 1.0, zero, 2.0), t)
        return t


class EdgeComm(CommModel):
    """Collectives of one node group's view whose pipeline sends all cross the link from the group to another
    (``cross_bw`` bytes/s per GPU, every GPU of a node sending at once; ``cross_lat`` seconds): the sends of a
    pipeline rank at the edge of its group, placed beside another group (cost_models/placement.py ``cross_send``
    prices one such send the same way)."""

    def __init__(self, cluster: ClusterSpec, cross_bw: float, cross_lat: float) -> None:
        super().__init__(cluster)
        self.cross_bw, self.cross_lat = cross_bw, cross_lat

    def p2p(self, nbytes: ArrayLike, cross_node: ArrayLike) -> np.ndarray:
        nbytes, _ = np.broadcast_arrays(np.asarray(nbytes, dtype=float), np.asarray(cross_node))
        return self.cross_lat + nbytes / self.cross_bw


class SpanningComm(CommModel):
    """Collectives of a pipeline rank whose data-parallel replicas are split evenly over ``parts`` node groups, priced
    on one of those groups (its view) and the link between them (``cross_bw`` bytes/s per GPU, every GPU of a node
    sending at once; ``cross_lat`` seconds).

    A group of the stage's ranks wider than one group's share of them (``size`` x ``stride`` beyond ``share`` ranks)
    crosses the link, and runs hierarchically (as the runtime does, ``runtime.parallel.hierarchy``): reduce-scatter
    inside each group over its ``size / parts`` members, the collective across the groups on that shard (a ring of
    ``parts``, one member per group), all-gather inside. Only 1/(size/parts) of the data crosses the slow link, where
    a flat ring would carry all of it across (a node's members sharing the node's part of the link). Groups inside a
    share (tp, cp) and wider than the stage (the step's norm) are priced as on the group alone."""

    def __init__(self, cluster: ClusterSpec, parts: int, share: int, cross_bw: float, cross_lat: float) -> None:
        super().__init__(cluster)
        self.parts, self.share, self.cross_bw, self.cross_lat = parts, share, cross_bw, cross_lat

    def spans(self, size: ArrayLike, stride: ArrayLike) -> np.ndarray:
        """Whether a group of ``size`` ranks ``stride`` apart crosses between the stage's node groups."""
        n, span = np.asarray(size, dtype=float), np.asarray(size, dtype=float) * np.asarray(stride, dtype=float)
        return (span > self.share) & (span <= self.share * self.parts) & (n % self.parts == 0)

    def across(self, nbytes: ArrayLike, volume: float) -> np.ndarray:
        """A ring over one member of each group, across the link between them."""
        p = self.parts
        return volume * ((p - 1) * self.cross_lat + (p - 1) / p * np.asarray(nbytes, dtype=float) / self.cross_bw)

    def flat(self, nbytes: ArrayLike, size: ArrayLike, stride: ArrayLike, volume: float) -> np.ndarray:
        """The same collective as one flat ring over every member (what the hierarchy saves; for comparisons)."""
        nbytes, n = np.asarray(nbytes, dtype=float), np.asarray(size, dtype=float)
        k, nodes = self.placement(n, stride)
        return (volume * (self._lat(k, nodes, True) + self.parts * self.cross_lat)
                + nbytes * volume * (n - 1) / n / np.minimum(self._bw(k, nodes), k * self.cross_bw))

    def _collective(self, name: str, nbytes: ArrayLike, size: ArrayLike, stride: ArrayLike,
                    volume: float, ring: bool = True) -> np.ndarray:
        inside = super()._collective(name, nbytes, size, stride, volume, ring)
        spans = self.spans(size, stride)
        if name not in ("all_reduce", "reduce_scatter", "all_gather") or not spans.any():
            return inside
        nbytes, n = np.asarray(nbytes, dtype=float), np.asarray(size, dtype=float)
        n_in = np.maximum(n // self.parts, 1)
        scatter = super()._collective("reduce_scatter", nbytes, n_in, stride, 1.0)
        gather = super()._collective("all_gather", nbytes, n_in, stride, 1.0)
        inner = {"all_reduce": scatter + gather, "reduce_scatter": scatter, "all_gather": gather}[name]
        return np.where(spans, inner + self.across(nbytes / n_in, volume), inside)
