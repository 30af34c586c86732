"""A plan placed on a cluster's node groups (``ParallelConfig.placement``: the group of each pipeline rank, or the
groups its data-parallel replicas are split over evenly, ``a+b``).

Each pipeline rank's tensor-, context- and data-parallel ranks sit inside its group, so everything but the
pipeline sends is priced on that group as a homogeneous cluster of its own (``ClusterSpec.group_view``: its GPU,
its NVLink, its NICs): the stage's compute, its TP/CP/EP communication, its data-parallel reduce and optimizer
(tail.py) and its memory against its GPU's memory. A send between two stages in different groups crosses the link
between them (``Topology.between``: per node, shared by the node's GPUs, which all send at once), at the lower
NIC efficiency of the two. The schedule is then replayed with these per-stage times as for any plan, so a slow
group's stages set the pace unless the layer split (``layers``) gives them fewer layers.

A pipeline rank split over groups (``a+b``) runs on each of them: its stage is priced on every one and the slowest
sets its pace; its data-parallel collectives cross between the groups hierarchically (``comm.SpanningComm``), and a
send between two stages crosses a link where a replica's groups differ.

The step's small reductions (a tied embedding's sum, the norm) are priced on the slowest group's network.

Several layer splits of one placed plan are priced at once (``splits``: the search's layer moves), one row each,
their schedules replayed together (``pipeline.table_replay``, the same times as one replay each).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from cost_models.comm import CommModel, SpanningComm
from cost_models.compute import ComputeModel
from cost_models.memo import IdentityMemo
from cost_models.memory import RankMemory, rank_memory
from cost_models.pipeline import REPLAY_FIELDS, Replay, replayed, simulate_steps, table_replay
from cost_models.stages import LayerTerms, StageCosts, layer_terms, stage_costs, stage_split
from cost_models.tail import RankTail, rank_tail
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, sp_in_effect
from specs.placement import entry_groups, replica_group
from specs.state import StateSpec


@dataclass
class Priced:
    """A plan priced (placed or not), one row per layer split: per-stage costs, the replay, each rank's tail and memory
    ([N, pp] like the vectorised model's), each rank's GPU memory (GiB) and the cluster's peak FLOP/s over the GPUs
    used."""

    costs: StageCosts
    replay: Replay
    tail: RankTail
    mem: RankMemory
    capacity_GiB: list[float]
    peak_flops: float

    def row(self, i: int) -> Priced:
        """Row ``i`` alone (a one-row :class:`Priced`)."""
        def one(x: object) -> object:
            return type(x)(**{f.name: getattr(x, f.name)[i:i + 1] for f in fields(x)})  # type: ignore[arg-type]

        return replace(self, costs=one(self.costs), replay=one(self.replay), tail=one(self.tail), mem=one(self.mem))


def _stitch(parts: dict[str, object], owner: list[str], cls: type) -> object:
    """One [N, n] (or [N]) array per field, column ``j`` from ``parts[owner[j]]`` (per-candidate fields: the max)."""
    out = {}
    for f in fields(cls):
        arrays = {g: np.asarray(getattr(p, f.name)) for g, p in parts.items()}
        first = next(iter(arrays.values()))
        if first.ndim == 2 and first.shape[1] == len(owner):
            out[f.name] = np.stack([arrays[g][:, j] for j, g in enumerate(owner)], axis=1)
        else:
            out[f.name] = np.max(np.stack(list(arrays.values())), axis=0)
    return cls(**out)


def cross_send(cluster: ClusterSpec, a: str, b: str, act_bytes: float, t: int, sp: bool, comm_b: CommModel) -> float:
    """One blocking send of a stage-boundary activation from a stage in group ``a`` to one in group ``b``: each
    tensor-parallel rank sends 1/t of it over the link between the groups (without SP the receivers then
    all-gather the slices, inside their node)."""
    per_gpu, latency = link(cluster, (a, b))
    gather = 0.0 if sp_in_effect(sp, t) else float(comm_b.all_gather(act_bytes, t, 1))
    return latency + act_bytes / t / per_gpu + gather


def link(cluster: ClusterSpec, names: tuple[str, ...]) -> tuple[float, float]:
    """(bytes/s per GPU, seconds) between the node groups ``names``: the narrowest per-GPU rate of any pair of them
    (``Topology.per_gpu_Gbps``) at the lowest NIC efficiency among them, and the longest pair latency."""
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    eff = min(g.inter_node.efficiency for g in cluster.node_groups if g.name in names)
    per_gpu = min(cluster.topology.per_gpu_Gbps(a, b) for a, b in pairs) / 8 * 1e9 * eff
    return per_gpu, max(cluster.topology.between(a, b)[1] for a, b in pairs) * 1e-6


def _worst(parts: list[object], cls: type) -> object:
    """Field by field, the largest of ``parts`` (the slowest of the groups a pipeline rank is split over)."""
    if len(parts) == 1:  # (a rank on one group: its own)
        return parts[0]
    return cls(**{f.name: np.max(np.stack([np.asarray(getattr(p, f.name)) for p in parts]), axis=0)
                  for f in fields(cls)})


def _comm(cluster: ClusterSpec, view: ClusterSpec, entry: str, c: Candidates) -> CommModel:
    """The collectives of a pipeline rank placed on ``entry``, priced on the view of one of its groups."""
    names = entry_groups(entry)
    if len(names) == 1:
        return CommModel(view)
    share = int(c.tp[0] * c.dp[0] * c.cp[0]) // len(names)
    return SpanningComm(view, len(names), share, *link(cluster, names))


TABLE_ROWS = 4  # splits priced together from which their schedules are replayed as one table (pipeline.table_replay)

_TERMS: IdentityMemo[LayerTerms] = IdentityMemo(512)


def _terms(model: ModelSpec, view: ClusterSpec, entry: str, cfg: ParallelConfig, state: StateSpec,
           cm: ComputeModel, comm: CommModel) -> LayerTerms:
    """``layer_terms`` of a plan on one group, remembered across the placements and layer splits of the same plan
    (they do not depend on either; the search prices a plan many ways)."""
    return _TERMS.get((model, view, state), (entry, replace(cfg, layers=None, placement=None, recompute_layers=None)),
                      lambda: layer_terms(model, cm, comm, Candidates.of(cfg), state))


def price_placed(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
                 state: StateSpec, splits: list[tuple[int, ...]] | None = None) -> Priced:
    """Price ``cfg`` (with a placement) on ``cluster``'s node groups (module docstring); ``splits``: with each of these
    layer splits instead of its own, one row each."""
    assert cfg.placement is not None
    parts = [stage_split(replace(cfg, layers=s) if s is not None else cfg, model.num_layers)
             for s in ([None] if splits is None else splits)]
    n = len(parts)
    layers, recomputed = np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    one, each = Candidates.of(cfg), np.zeros(n, dtype=int)  # the plan, and its row for each split
    c = one.take(each)
    pp, vpp, m = cfg.pp, cfg.vpp, cfg.microbatches(global_batch)
    nv = pp * vpp
    owner = [cfg.placement[j % pp] for j in range(nv)]  # virtual stage j runs on pipeline rank j % pp
    views = {g: cluster.group_view(g) for e in dict.fromkeys(cfg.placement) for g in entry_groups(e)}
    models, costs = {}, {}
    for e in dict.fromkeys(cfg.placement):  # each group of the entry once
        models[e] = {g: (ComputeModel.of(views[g]), _comm(cluster, views[g], e, one))
                     for g in entry_groups(e)}
        costs[e] = _worst([stage_costs(model, comm, state, c,
                                       _terms(model, views[g], e, cfg, state, cm, comm).take(each),
                                       layers, recomputed, cm.eb) for g, (cm, comm) in models[e].items()], StageCosts)
    stitched = _stitch(costs, owner, StageCosts)
    assert isinstance(stitched, StageCosts)
    eb = next(iter(models[owner[0]].values()))[0].eb
    act = cfg.mbs * model.seq_length / cfg.cp * model.hidden_size * eb
    for j in range(nv - 1):
        firsts = {k * cfg.dp // len(entry_groups(e)) for e in owner[j:j + 2] for k in range(len(entry_groups(e)))}
        pairs = {(replica_group(owner[j], r, cfg.dp), replica_group(owner[j + 1], r, cfg.dp)) for r in firsts}
        for a, b in pairs - {(a, a) for a, _ in pairs}:
            stitched.send_f[:, j] = np.maximum(stitched.send_f[:, j],
                                               cross_send(cluster, a, b, act, cfg.tp, cfg.sp, CommModel(views[b])))
            stitched.send_b[:, j + 1] = np.maximum(stitched.send_b[:, j + 1],
                                                   cross_send(cluster, b, a, act, cfg.tp, cfg.sp, CommModel(views[a])))
    ms = np.full(n, m)
    f, b = stitched.f, stitched.b
    if n >= TABLE_ROWS:
        replay = table_replay(f, b, pp, vpp, ms)
    else:  # a few rows: replayed one at a time (a table replay's waves cost more than they share)
        alone = [replayed(simulate_steps(pp, vpp, m, f[i].tolist(), b[i].tolist())) for i in range(n)]
        replay = Replay(**{k: np.concatenate([getattr(r, k) for r in alone]) for k in REPLAY_FIELDS})
    ranks = list(cfg.placement)
    tails = {e: _worst([rank_tail(model, cm, comm, state, c, stitched, replay, ms, cluster.num_gpus)
                        for cm, comm in pair.values()], RankTail) for e, pair in models.items()}
    tail = _stitch(tails, ranks, RankTail)
    assert isinstance(tail, RankTail)
    tail.step_time = tail.finish.max(axis=1) + tail.tied + tail.norm
    load = stitched.rank_load(pp, vpp, ms)
    mem = _stitch({e: rank_memory(c, state, cluster.backend, load) for e in models}, ranks, RankMemory)
    assert isinstance(mem, RankMemory)
    peak = cluster.peak_flops(cfg.pp, cfg.tp * cfg.dp * cfg.cp, cfg.placement)
    return Priced(costs=stitched, replay=replay, tail=tail, mem=mem,
                  capacity_GiB=[min(views[g].gpu.memory_GiB for g in entry_groups(e)) for e in ranks], peak_flops=peak)
