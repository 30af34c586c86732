"""GPU and cluster profiles: datasheet facts, a few documented efficiency parameters, optional measured tables.

Reading them from files (bundled ones by name, node groups assembled): specs/cluster_loading.py.
"""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal, get_args

import numpy as np
from pydantic import Field, StrictInt, field_validator, model_validator

from specs.errors import AutoparError, counted, did_you_mean
from specs.placement import entry_groups
from specs.strict import Strict
from specs.topology import DefaultLink, GroupLink, InterNode, Link, NodeGroup, Topology

MAX_GPUS = 1 << 24  # far beyond any real cluster; keeps the search's divisor enumeration cheap


class Efficiency(Strict):
    """Achieved fractions of datasheet peaks, used where no measured table covers a case.

    The defaults below hold for a GPU profile that gives none; each bundled GPU profile sets its own, with its
    sources (docs/cost_model.md, "Efficiency parameters"). They are per GPU type, never per model or plan.
    """

    gemm: float = 0.80  # fraction of peak a large, well-shaped GEMM sustains during training
    gemm_tile_m: int = Field(128, ge=1)  # output tile of the GEMM kernels, for wave quantisation over the SMs
    gemm_tile_n: int = Field(256, ge=1)
    gemm_k_half: float = Field(96.0, ge=0)  # K at which a GEMM's main loop reaches half its efficiency
    memory: float = 0.80  # fraction of HBM bandwidth streaming (elementwise, norm, optimizer) kernels reach
    attention_fwd: float = 0.55  # flash attention forward, fraction of peak (causal FLOPs)
    attention_bwd: float = 0.45  # flash attention backward
    kernel_overhead_us: float = Field(3.0, ge=0)  # fixed cost per kernel (launch and tail)

    @model_validator(mode="after")
    def _range(self) -> Efficiency:
        for f in ("gemm", "memory", "attention_fwd", "attention_bwd"):
            v = getattr(self, f)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"efficiency.{f} must be in (0, 1], got {v}")
        return self


class GemmPoint(Strict):
    m: int = Field(ge=1)
    n: int = Field(ge=1)
    k: int = Field(ge=1)
    tflops: float = Field(gt=0)


class AttentionPoint(Strict):
    seq: int = Field(ge=1)
    heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    batch: int = Field(1, ge=1)
    fwd_tflops: float = Field(gt=0)  # causal FLOPs (half the s*s work) per second
    bwd_tflops: float = Field(gt=0)


class NodeLink(Strict):
    """How the GPUs of one node of this GPU's platform are joined (datasheet): NVLink through NVSwitch, NVLink
    point to point, or PCIe only."""

    kind: Literal["nvswitch", "nvlink", "pcie"]
    bandwidth_GBps: float = Field(gt=0)  # per GPU, per direction
    latency_us: float = Field(3.0, ge=0)

    def text(self) -> str:
        name = {"nvswitch": "NVLink/NVSwitch", "nvlink": "NVLink", "pcie": "PCIe"}[self.kind]
        return f"{name} ({self.bandwidth_GBps:g} GB/s per GPU)"


# A cluster's intra-node bandwidth may read above its GPU's datasheet link by this factor (measured NVLink SHARP
# all-reduces and calibrated profiles do); beyond it the profile pairs the GPU with a link it lacks.
LINK_SLACK = 1.25
# A measured GEMM or attention rate may read above the GPU's datasheet peak by this factor (a timer's noise on a short
# kernel); beyond it the table is wrong.
RATE_SLACK = 1.05


class GPUSpec(Strict):
    name: str
    peak_tflops: dict[str, float]  # the precisions it computes in (fp8 only where the hardware has it)
    memory_GiB: float = Field(gt=0)
    memory_bandwidth_GBps: float = Field(gt=0)
    sm_count: int = Field(108, ge=1)
    efficiency: Efficiency = Efficiency()
    gemm_table: list[GemmPoint] = Field(default_factory=list)  # measured by `autopar profile`
    attention_table: list[AttentionPoint] = Field(default_factory=list)
    measured_memory_bandwidth_GBps: float | None = Field(None, gt=0)
    # measured (CPU profiles): bandwidth per *modelled* byte of the layers' memory-bound ops (norms, activations,
    # residuals, RoPE), which a CPU runs as several unfused ops; unset: the same as fused streaming kernels
    elementwise_bandwidth_GBps: float | None = Field(None, gt=0)
    # measured (GPU profiles): bytes read per second by a sum over tokens (the bias gradients' reduction); unset:
    # the elementwise bandwidth
    reduce_bandwidth_GBps: float | None = Field(None, gt=0)
    # measured (`autopar profile`): the fused AdamW update's bytes (StateSpec.adamw_bytes) per second over large
    # fp32 tensors, which reaches less than a copy (it computes per element: two moments, a square root, a
    # division); unset: the copy bandwidth (:attr:`mem_bw`)
    optimizer_bandwidth_GBps: float | None = Field(None, gt=0)
    node_link: NodeLink | None = None  # the intra-node link of its platform; None: not known (CPUs, custom GPUs)
    # CPU profiles (`autopar profile` records it): how many ranks a node runs at once at the rates measured (a core
    # each: its usable cores over a rank's threads, or the ranks measured at once where more); a node running more
    # ranks shares them (ClusterSpec.compute_slowdown)
    cores: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> GPUSpec:
        if not self.peak_tflops:
            raise ValueError("peak_tflops needs at least one precision, e.g. {bf16: 312}")
        bad = [k for k, v in self.peak_tflops.items() if not v > 0]
        if bad:
            raise ValueError(f"peak_tflops.{bad[0]} must be positive")
        if self.memory_GiB <= 0 or self.memory_bandwidth_GBps <= 0:
            raise ValueError("memory_GiB and memory_bandwidth_GBps must be positive")
        return self

    def peak(self, precision: str) -> float:
        """Peak FLOP/s for a compute precision (bf16 falls back to fp16, then fp32)."""
        for p in (precision, "fp16", "bf16", "fp32"):
            if p in self.peak_tflops:
                return self.peak_tflops[p] * 1e12
        return next(iter(self.peak_tflops.values())) * 1e12

    @property
    def mem_bw(self) -> float:
        """Achievable memory bandwidth in bytes/s (measured if profiled, else datasheet x efficiency)."""
        if self.measured_memory_bandwidth_GBps:
            return self.measured_memory_bandwidth_GBps * 1e9
        return self.memory_bandwidth_GBps * 1e9 * self.efficiency.memory

    @property
    def ew_bw(self) -> float:
        """Bytes/s of the layers' memory-bound ops (measured on CPUs, else :attr:`mem_bw`)."""
        if self.elementwise_bandwidth_GBps:
            return self.elementwise_bandwidth_GBps * 1e9
        return self.mem_bw

    @property
    def reduce_bw(self) -> float:
        """Bytes/s read by a sum over tokens (measured on GPUs, else :attr:`ew_bw`)."""
        return self.reduce_bandwidth_GBps * 1e9 if self.reduce_bandwidth_GBps else self.ew_bw

    @property
    def opt_bw(self) -> float:
        """Bytes/s of the fused AdamW update (measured, else :attr:`mem_bw`)."""
        return self.optimizer_bandwidth_GBps * 1e9 if self.optimizer_bandwidth_GBps else self.mem_bw


class CollectiveFit(Strict):
    """alpha-beta fit measured by `autopar profile`: time = alpha + bytes / bus_bandwidth x factor, where a
    group of n > 2 ranks adds ``alpha_per_rank_us`` x (n - 2) to alpha (a ring's extra steps).

    Across nodes a fit is one GPU's share (`autopar profile` measures one rank a node, every rank of the node at
    once): a ring with k members a node gets k of them. ``busbw_by_nodes`` (the inter level): that share measured
    with the group spanning each node count ({nodes: GB/s}; from nccl-tests run over every GPU of those nodes, their
    bus bandwidth over the GPUs a node), for a network whose collectives slow as they span more nodes (oversubscribed
    or shared fabrics); a group spanning a count between two measured ones gets their log-log interpolation, one
    beyond them the nearest measured, and ``busbw_GBps`` is then unused."""

    alpha_us: float = Field(ge=0)
    busbw_GBps: float = Field(gt=0)
    alpha_per_rank_us: float = Field(0.0, ge=0)
    r2: float | None = None  # goodness of the fit over the measured sizes and groups (written by the profiler)
    busbw_by_nodes: dict[Annotated[StrictInt, Field(ge=2)], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict)

    @field_validator("busbw_by_nodes", mode="before")
    @classmethod
    def _node_counts(cls, v: Any) -> Any:
        """Node counts as JSON writes them back (keys are text there: "2"), read as the whole numbers they are."""
        if isinstance(v, dict):
            return {int(k) if isinstance(k, str) and k.isdigit() else k: x for k, x in v.items()}
        return v

    def busbw_at(self, nodes: np.ndarray) -> np.ndarray:
        """Bus bandwidth (GB/s) of a group spanning ``nodes`` nodes (numpy-broadcast)."""
        nodes = np.asarray(nodes, dtype=float)
        if not self.busbw_by_nodes:
            return np.full(nodes.shape, self.busbw_GBps)
        counts = sorted(self.busbw_by_nodes)
        x = np.log([float(c) for c in counts])
        y = np.log([self.busbw_by_nodes[c] for c in counts])
        return np.exp(np.interp(np.log(np.maximum(nodes, 1.0)), x, y))


# What `autopar calibrate` can scale on a profile (planner/calibrate.py ``scaled``): the GEMM rate, the attention
# rate, the memory-bound bandwidth, the fixed cost per kernel and the communication speed.
Scale = Literal["gemm", "attention", "memory", "overhead", "comm"]
Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]  # what a profile measures
COLLECTIVES: tuple[str, ...] = get_args(Collective)


def bus_factor(name: str, n: Any) -> Any:
    """Bytes over the slowest link per byte of the message for ``n`` ranks (a number or an array), in nccl-tests'
    bus-bandwidth convention: 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for
    point-to-point. The profiler's fits and the cost model's collectives use it alike."""
    if name == "p2p":
        return 1.0
    share = (np.asarray(n, dtype=float) - 1) / np.maximum(n, 1)
    if name == "all_reduce":
        return 2.0 * share
    if name in ("all_gather", "reduce_scatter", "all_to_all"):
        return share
    raise ValueError(f"unknown collective {name!r}")
CALIBRATION_SCALES: tuple[str, ...] = get_args(Scale)


class Calibration(Strict):
    """What a calibration learned (written by `autopar calibrate` / `tune` into the profile it scales): the factors
    applied to the base profile and how sure the fit is of them, the covariance of their logarithms (the fit's
    posterior: planner/calibrate.py). A plan's band widens by what that uncertainty does to its step time."""

    runs: int = Field(ge=1)  # measured runs the fit saw
    scales: dict[Scale, float]
    log_covariance: tuple[tuple[float, ...], ...]  # over ``scales`` in their order
    # the fingerprints of the runs fitted into the profile, by this fit and those before it (a run fitted twice would
    # count twice): planner.measured_runs.Run.fingerprint
    fitted: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Calibration:
        n, cov = len(self.scales), self.log_covariance
        if n == 0 or any(v <= 0 for v in self.scales.values()):
            raise ValueError("calibration.scales needs at least one positive factor")
        if len(cov) != n or any(len(row) != n for row in cov):
            raise ValueError(f"calibration.log_covariance must be {n} x {n} (one row and column per scale)")
        if any(cov[i][i] < 0 or abs(cov[i][j] - cov[j][i]) > 1e-9 * (1 + abs(cov[i][j]))
               for i in range(n) for j in range(n)):
            raise ValueError("calibration.log_covariance must be symmetric with a non-negative diagonal")
        return self


def gpu_precision_problem(gpu: GPUSpec, precision: str, backend: str) -> str | None:
    """Why ``gpu`` cannot compute in ``precision`` (its profile lists the precisions it has a peak for), or None.
    CPU ranks (gloo) compute in any precision."""
    have = gpu.peak_tflops
    if backend == "gloo" or precision in have:
        return None
    usable = [p for p in ("bf16", "fp16", "fp32") if p in have]
    return (f"precision {precision}: GPU {gpu.name} has no {precision} (its profile lists {', '.join(have)}); use "
            f"precision {usable[0] if usable else next(iter(have))}")


def intra_link_problem(gpu: GPUSpec, bandwidth_GBps: float, calibration: Calibration | None = None) -> str | None:
    """Why an intra-node link of ``bandwidth_GBps`` per GPU is one ``gpu``'s platform does not have (more than
    :data:`LINK_SLACK` times its datasheet node link), or None; a ``calibration`` with a comm scale set it from
    measured runs (calibrate's fit, not a hand-typed datasheet value): None."""
    link = gpu.node_link
    if calibration is not None and "comm" in calibration.scales:
        return None
    if link is None or bandwidth_GBps <= LINK_SLACK * link.bandwidth_GBps:
        return None
    return (f"intra_node bandwidth_GBps {bandwidth_GBps:g}: GPU {gpu.name} has {link.text()} inside a node; use at "
            f"most {LINK_SLACK * link.bandwidth_GBps:g} ({LINK_SLACK:g}x its {link.bandwidth_GBps:g}), or leave "
            "intra_node out to use it")


def table_rate_problem(gpu: GPUSpec, precision: str, backend: str, calibrated: bool = False) -> str | None:
    """Why a rate ``gpu``'s tables say it measured is one it cannot reach (above its peak at ``precision``, beyond
    :data:`RATE_SLACK`), or None. CPU ranks (gloo): their peak is itself a measured rate. ``calibrated``: the tables
    are a fit's (an earlier autopar's calibrate scaled them without that limit)."""
    if backend == "gloo" or precision not in gpu.peak_tflops:
        return None
    peak = gpu.peak(precision) / 1e12
    rates = [(f"gemm_table m={p.m} n={p.n} k={p.k}", p.tflops) for p in gpu.gemm_table]
    rates += [(f"attention_table seq={p.seq} heads={p.heads} head_dim={p.head_dim} {d}", getattr(p, f"{d}_tflops"))
              for p in gpu.attention_table for d in ("fwd", "bwd")]
    where, top = max(rates, key=lambda r: r[1], default=("", 0.0))
    if top <= RATE_SLACK * peak:
        return None
    fix = ("a calibration scaled it there (an earlier autopar's, which let a fit pass the peak): calibrate the "
           "profile it was fitted on again" if calibrated else
           "correct the table (`autopar profile` measures it) or peak_tflops")
    return (f"gpu {gpu.name}: {where}: {top:g} TFLOP/s is above its {precision} peak of {peak:g} TFLOP/s, which no "
            f"measurement reaches; {fix}")


class ClusterSpec(Strict):
    name: str
    gpu: GPUSpec
    gpus_per_node: int
    num_nodes: int = 1
    intra_node: Link
    inter_node: InterNode | None = None
    backend: Literal["nccl", "gloo"] = "nccl"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    # Let tensor-parallel groups span whole nodes (their collectives then cross the NICs); off by default,
    # as Megatron keeps them on NVLink. `--allow-cross-node-tp` sets it for one command.
    tp_across_nodes: bool = False
    # measured collectives: {collective: {"intra"|"inter": fit}}; collective in all_reduce, all_gather,
    # reduce_scatter, p2p, all_to_all
    collectives: dict[Collective, dict[Literal["intra", "inter"], CollectiveFit]] = Field(default_factory=dict)
    # Node groups (specs/topology.py): islands of nodes with their own GPUs and NICs. The fields above then
    # describe the whole cluster as if it were homogeneous at its slowest GPU and link (``homogeneous_view``).
    node_groups: tuple[NodeGroup, ...] = ()
    between_groups: tuple[GroupLink, ...] = ()
    default_between: DefaultLink | None = None
    # the fit this profile came from, when `autopar calibrate` / `tune` wrote it (widens plans' bands)
    calibration: Calibration | None = None
    # a full node's GPUs when ``resized`` cut this cluster to part of one (a plan for 2 of a node's 8 GPUs keeps a
    # node of 2): growing it again (`run --resume --replan --gpus N`) starts from the real node
    full_node_gpus: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _stale_full_node(cls, data: Any) -> Any:
        """``full_node_gpus`` only says something of one node cut below its size: a profile or plan file edited
        since (more nodes, a larger node) keeps what the edit says, and the stale size goes."""
        if isinstance(data, dict) and data.get("full_node_gpus") is not None:
            nodes, per_node, full = data.get("num_nodes", 1), data.get("gpus_per_node"), data["full_node_gpus"]
            if nodes != 1 or (isinstance(per_node, int) and isinstance(full, int) and full <= per_node):
                data = {k: v for k, v in data.items() if k != "full_node_gpus"}
        return data

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        if self.gpus_per_node <= 0 or self.num_nodes <= 0:
            raise ValueError("gpus_per_node and num_nodes must be positive")
        if self.num_nodes > 1 and self.inter_node is None:
            raise ValueError("a cluster of several nodes needs an inter_node section")
        problem = self.precision_problem() or self.link_problem() or self.rate_problem()
        if problem:
            raise ValueError(problem)
        inside = [op for op, levels in self.collectives.items() if "intra" in levels and levels["intra"].busbw_by_nodes]
        if inside:
            raise ValueError(f"collectives.{inside[0]}.intra.busbw_by_nodes: node counts describe collectives across "
                             "nodes; give them under inter")
        if self.num_gpus > MAX_GPUS:
            raise ValueError(f"gpus_per_node x num_nodes = {self.num_gpus:,} GPUs is beyond autopar's limit of "
                             f"{MAX_GPUS:,}; check the values")
        return self

    @property
    def num_gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    def peak_flops(self, pp: int, stage_gpus: int, placement: tuple[str, ...] | None = None) -> float:
        """Peak FLOP/s at the profile's precision of the GPUs a plan of ``pp`` pipeline ranks of ``stage_gpus``
        (tp x dp x cp) GPUs each runs on, what MFU divides by (the estimate's and the runtime's metrics alike): its
        GPUs', or under a node-group ``placement`` each pipeline rank's GPUs at their group's peak, split evenly over
        the groups of an entry that splits the replicas. CPU ranks sharing a node's cores share their peak too
        (:attr:`compute_slowdown`): MFU is of the cores that compute, not of a core per rank."""
        if not placement:
            return pp * stage_gpus * self.gpu.peak(self.precision) / self.compute_slowdown
        return sum(stage_gpus // len(entry_groups(e)) * (v := self.group_view(g)).gpu.peak(self.precision)
                   / v.compute_slowdown for e in placement for g in entry_groups(e))

    @property
    def groups(self) -> dict[str, int]:
        """GPUs per node group, in profile order (empty for a homogeneous cluster)."""
        return {g.name: g.num_gpus for g in self.node_groups}

    @property
    def node_gpus(self) -> dict[str, int]:
        """GPUs per node of each node group, in profile order (empty for a homogeneous cluster)."""
        return {g.name: g.gpus_per_node for g in self.node_groups}

    @property
    def memory_sizes_GiB(self) -> list[float]:
        """The GPU memories of the cluster's node groups, each once, smallest first (homogeneous: its GPU's)."""
        return sorted({self.group_view(g).gpu.memory_GiB for g in self.groups} or {self.gpu.memory_GiB})

    @cached_property
    def topology(self) -> Topology:
        """The node groups and the links between them as a graph (built once per profile)."""
        return Topology(self.node_groups, self.between_groups, self.default_between)

    def group_view(self, name: str) -> ClusterSpec:
        """Node group ``name`` as a homogeneous cluster of its own (its GPUs, its nodes, its NICs); built once per
        profile."""
        if name not in self._views:
            self._views[name] = self._group_view(name)
        return self._views[name]

    @cached_property
    def _views(self) -> dict[str, ClusterSpec]:
        return {}

    def _group_view(self, name: str) -> ClusterSpec:
        g = next((x for x in self.node_groups if x.name == name), None)
        if g is None:
            hint = did_you_mean(name, list(self.groups))
            raise AutoparError(f"cluster {self.name} has no node group '{name}'{hint}; its groups: "
                               f"{', '.join(self.groups) or 'none'}")
        return ClusterSpec(
            name=f"{self.name}:{g.name}", gpu=GPUSpec.model_validate(g.gpu), gpus_per_node=g.gpus_per_node,
            num_nodes=g.num_nodes, intra_node=Link.model_validate(g.intra_node), backend=self.backend,
            precision=self.precision, tp_across_nodes=self.tp_across_nodes, collectives=g.collectives,
            inter_node=InterNode(**g.inter_node.model_dump(exclude={"kind"})), calibration=g.calibration)

    def precision_problem(self) -> str | None:
        """Why this cluster's GPUs cannot compute in its ``precision`` (:func:`gpu_precision_problem`)."""
        return gpu_precision_problem(self.gpu, self.precision, self.backend)

    def rate_problem(self) -> str | None:
        """Why a rate this GPU's tables say it measured is one it cannot reach (:func:`table_rate_problem`)."""
        return table_rate_problem(self.gpu, self.precision, self.backend, self.calibration is not None)

    def link_problem(self) -> str | None:
        """Why this cluster's intra-node link is one its GPU's platform does not have (:func:`intra_link_problem`),
        or None."""
        if self.node_groups:  # the merged view's link is its narrowest group's, checked with that group's own fit
            return None
        return intra_link_problem(self.gpu, self.intra_node.bandwidth_GBps, self.calibration)

    @property
    def nic_bw_per_gpu(self) -> float:
        """Bytes/s of cross-node bandwidth each GPU gets when every GPU sends at once."""
        if self.inter_node is None:
            return self.intra_node.bandwidth_GBps * 1e9
        return self.inter_node.node_Gbps / 8 * 1e9 / self.gpus_per_node

    def resized(self, gpus: int | None = None, nodes: int | None = None, asked_as: str | None = None) -> ClusterSpec:
        """The same cluster with another size (``--gpus`` or ``--nodes``; ``asked_as``: how the errors name the
        size where another option gave it, e.g. ``--vary gpus=12``)."""
        if gpus is not None and nodes is not None:
            raise AutoparError("give --gpus or --nodes, not both")
        if self.node_groups and (gpus, nodes) not in ((None, None), (self.num_gpus, None), (None, self.num_nodes)):
            raise AutoparError(f"cluster {self.name} is made of node groups ({', '.join(self.groups)}): it is sized by "
                               "each group's num_nodes in its profile, not by --gpus or --nodes")
        asked = gpus if gpus is not None else None if nodes is None else nodes * self.gpus_per_node
        flag = asked_as or (f"--gpus {gpus}" if gpus is not None else f"--nodes {nodes}")
        if asked is not None and asked > MAX_GPUS:
            raise AutoparError(f"{flag} asks for {asked:,} GPUs, beyond autopar's limit of {MAX_GPUS:,}; "
                               "check the value")
        if nodes is not None:
            if nodes <= 0:
                raise AutoparError(f"--nodes must be positive, got {nodes}")
            if nodes > 1 and self.inter_node is None:
                raise AutoparError(f"cluster {self.name} has no inter_node section, so it cannot span {nodes} nodes")
            # several nodes of the cut size (whatif's --gpus N --vary nodes) make that size the node's
            return self.model_copy(update={"num_nodes": nodes, "full_node_gpus": self.full_node_gpus if nodes == 1
                                           else None})
        if gpus is None:
            return self
        if gpus <= 0:
            raise AutoparError(f"--gpus must be positive, got {gpus}")
        if gpus <= self.gpus_per_node:
            full = self.full_node_gpus or self.gpus_per_node
            return self.model_copy(update={"num_nodes": 1, "gpus_per_node": gpus, "gpu": self._rank_share(gpus),
                                           "full_node_gpus": full if gpus < full else None})
        if self.full_node_gpus and self.num_nodes == 1:  # part of a node, grown: the real node again
            return self.model_copy(update={"gpus_per_node": self.full_node_gpus, "full_node_gpus": None,
                                           "gpu": self._rank_share(self.full_node_gpus)}).resized(gpus, None, asked_as)
        if gpus % self.gpus_per_node:
            raise AutoparError(
                f"{flag} is not a whole number of {self.name} nodes ({self.gpus_per_node} GPUs each); "
                f"use a multiple of {self.gpus_per_node} or at most {self.gpus_per_node}"
            )
        if self.inter_node is None:
            fewer = f"--gpus {self.gpus_per_node} or fewer" if asked_as is None else \
                f"{self.gpus_per_node} GPUs or fewer there ({asked_as})"
            raise AutoparError(f"cluster {self.name} is one node of {self.gpus_per_node} GPUs (no inter_node "
                               f"section), so it cannot hold {gpus}: use {fewer}, or a multi-node profile")
        return self.model_copy(update={"num_nodes": gpus // self.gpus_per_node})

    def _rank_share(self, ranks: int) -> GPUSpec:
        """The GPU profile of one of ``ranks`` ranks on a node: a GPU's own, or, for CPU ranks (gloo), whose memory is
        the host's, shared by the ranks on it, the host's memory over ``ranks`` instead of ``gpus_per_node``."""
        if self.backend != "gloo" or ranks == self.gpus_per_node:
            return self.gpu
        return self.gpu.model_copy(update={"memory_GiB": self.gpu.memory_GiB * self.gpus_per_node / ranks})

    @property
    def compute_slowdown(self) -> float:
        """How many times slower each rank computes than its GPU profile's rates: CPU ranks beyond the node's
        measured cores take turns on them (1 on GPUs, and for CPU profiles that do not give their cores)."""
        cores = self.gpu.cores
        return max(1.0, self.gpus_per_node / cores) if cores else 1.0

    def summary(self) -> str:
        if self.node_groups:
            topo = self.topology
            parts = []
            for g in self.node_groups:
                gpu, net = GPUSpec.model_validate(g.gpu), g.inter_node
                parts.append(f"{g.name} ({g.num_nodes} x {g.gpus_per_node} {gpu.name}, {net.nics_per_node}x"
                             f"{net.nic_bandwidth_Gbps:.4g} Gb/s {net.kind})")
            names = list(self.groups)
            links = [f"{a}-{b} {topo.between(a, b)[0]:.4g} Gb/s per node" for i, a in enumerate(names)
                     for b in names[i + 1:]]
            between = f"; between groups {', '.join(links)}" if links else ""  # (one group: no link between)
            return f"{self.name}: {self.num_gpus} GPUs in node groups {', '.join(parts)}{between}"
        net = (f", {self.inter_node.nics_per_node}x{self.inter_node.nic_bandwidth_Gbps:.4g} Gb/s NICs per node"
               if self.inter_node else "")
        tp = ", tensor parallelism may span nodes" if self.tp_across_nodes and self.num_nodes > 1 else ""
        ranks = counted(self.num_gpus, "GPU") if self.backend == "nccl" else counted(self.num_gpus, "gloo rank")
        return (f"{self.name}: {self.num_nodes} x {self.gpus_per_node} {self.gpu.name} "
                f"({ranks}), intra-node {self.intra_node.bandwidth_GBps:.4g} GB/s{net}{tp}")
