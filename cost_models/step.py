"""The exact cost model of one plan: per-stage costs (stages.py), the schedule replayed (pipeline.py), each
rank's tail (tail.py) and memory (memory.py), composed into step time, throughput, MFU and peak memory.

The vectorised model the search ranks candidates with (batch.py) composes the same functions and differs only
in the pipeline: a closed form instead of the replay (``pipeline.closed_form``). The step time is the
slowest rank's finish; its breakdown follows the busiest rank (its waiting the pipeline bubble). Memory is the peak
over ranks. The symbols and what
overlaps with what are in docs/cost_model.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.headroom import check_headroom, fullest, usable_GiB
from cost_models.memo import IdentityMemo
from cost_models.memory import GiB, rank_memory
from cost_models.params import per_rank
from cost_models.pipeline import replayed, simulate_steps
from cost_models.placement import Priced, price_placed
from cost_models.stages import LayerTerms, layer_terms, stage_costs, stage_split
from cost_models.tail import rank_tail
from specs.cluster import ClusterSpec
from specs.json_numbers import sig6
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig
from specs.rules import PlanContext, check_plan
from specs.state import StateSpec


@dataclass
class Estimate:
    """The cost model's prediction for one plan (the estimate command's JSON, plus details)."""

    step_time_s: float
    tokens_per_s: float
    model_flops_per_step: float
    mfu: float
    memory_GiB: float
    fits: bool
    breakdown: dict[str, float]
    memory_breakdown: dict[str, float]
    bubble_fraction: float
    exposed_comm_fraction: float
    stage_memory_GiB: list[float] = field(default_factory=list)
    stage_memory_breakdown: list[dict[str, float]] = field(default_factory=list)
    stage_time_s: list[float] = field(default_factory=list)
    critical_rank: int = 0  # the pipeline rank the breakdown follows: the busiest (least idle)
    stage_capacity_GiB: list[float] = field(default_factory=list)  # each stage's GPU memory (node groups: its own)
    rank_finish_s: list[float] = field(default_factory=list)  # when each pipeline rank is done (its reduce, optimizer)

    @property
    def fullest_stage(self) -> tuple[int, float, float]:
        """(pipeline stage, its GiB, its GPU's GiB) of the stage that fills its GPU the most (:func:`fullest`)."""
        return fullest(self.stage_memory_GiB, self.stage_capacity_GiB)

    def to_json(self) -> dict[str, Any]:
        r = sig6
        return {
            "step_time_s": r(self.step_time_s),
            "tokens_per_s": r(self.tokens_per_s),
            "model_flops_per_step": r(self.model_flops_per_step),
            "mfu": r(self.mfu),
            "memory_GiB": r(self.memory_GiB),
            "fits": self.fits,
            "breakdown": {k: r(v) for k, v in self.breakdown.items()},
            "memory_breakdown_GiB": {k: r(v) for k, v in self.memory_breakdown.items()},
            "bubble_fraction": r(self.bubble_fraction),
            "exposed_comm_fraction": r(self.exposed_comm_fraction),
            "stage_memory_GiB": [r(x) for x in self.stage_memory_GiB],
        }


def estimate(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
             headroom_GiB: float | None = 0.0, validate: bool = True, state: StateSpec | None = None,
             terms: LayerTerms | None = None) -> Estimate:
    """Predict step time, throughput, MFU and peak memory of ``cfg`` (exact: replays the schedule). ``state``:
    the model state's precisions and buckets (default: ``StateSpec.default`` of the cluster's precision);
    ``terms``: ``cfg``'s layer terms when the caller has them (the search computes its finalists' at once).
    ``headroom_GiB``: kept free on every GPU for the plan to fit (None: the default share of each stage's GPUs).
    Remembered for the same model, cluster and state objects (:data:`_ESTIMATES`): do not modify the result."""
    return _ESTIMATES.get((model, cluster, state), (cfg, global_batch, headroom_GiB, validate),
                          lambda: _exact(model, cluster, cfg, global_batch, headroom_GiB, validate, state, terms))


# a search prices many plans again (placed by the whole search, then by the search of their own placement; refined
# on one view by several rankings): a tenth of a search of node groups' time
_ESTIMATES: IdentityMemo[Estimate] = IdentityMemo(4096)


def _exact(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int, headroom_GiB: float | None,
           validate: bool, state: StateSpec | None, terms: LayerTerms | None) -> Estimate:
    if validate:
        check_plan(cfg, PlanContext.on(model, cluster, global_batch))
        check_headroom(headroom_GiB, cluster)
    state = state or StateSpec.default(cluster.precision)
    if cfg.placement is not None:  # on the cluster's node groups
        return _estimate(model, cfg, global_batch, headroom_GiB, price_placed(model, cluster, cfg, global_batch, state))
    pp, vpp, m = cfg.pp, cfg.vpp, cfg.microbatches(global_batch)
    cm, comm = ComputeModel.of(cluster), CommModel(cluster)
    c = Candidates.of(cfg)
    layers, recomputed = stage_split(cfg, model.num_layers)
    costs = stage_costs(model, comm, state, c, terms or layer_terms(model, cm, comm, c, state), layers, recomputed,
                        cm.eb)
    replay = replayed(simulate_steps(pp, vpp, m, costs.f[0].tolist(), costs.b[0].tolist()))
    ms = np.array([m])
    tail = rank_tail(model, cm, comm, state, c, costs, replay, ms, cluster.num_gpus)
    mem = rank_memory(c, state, cluster.backend, costs.rank_load(pp, vpp, ms))
    priced = Priced(costs=costs, replay=replay, tail=tail, mem=mem, capacity_GiB=[cluster.gpu.memory_GiB] * pp,
                    peak_flops=cluster.peak_flops(pp, cfg.tp * cfg.dp * cfg.cp))
    return _estimate(model, cfg, global_batch, headroom_GiB, priced)


def split_estimates(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, splits: list[tuple[int, ...]],
                    global_batch: int, headroom_GiB: float | None, state: StateSpec) -> list[Estimate]:
    """:func:`estimate` of a placed ``cfg`` with each of these layer ``splits`` (not validated: each a split of the
    model's layers that ``cfg``'s rules allow), priced together (the same numbers as one at a time)."""
    if not splits:
        return []
    priced = price_placed(model, cluster, cfg, global_batch, state, splits)
    return [_estimate(model, cfg, global_batch, headroom_GiB, priced.row(i)) for i in range(len(splits))]


def _estimate(model: ModelSpec, cfg: ParallelConfig, global_batch: int, headroom_GiB: float | None,
              priced: Priced) -> Estimate:
    """``priced`` (one row) composed into step time, throughput, MFU, peak memory and the breakdown."""
    assert len(priced.tail.step_time) == 1, "one row: Priced.row"
    pp, vpp, m = cfg.pp, cfg.vpp, cfg.microbatches(global_batch)
    costs, tail, mem, capacity = priced.costs, priced.tail, priced.mem, priced.capacity_GiB
    step = float(tail.step_time[0])

    def mine(x: np.ndarray) -> np.ndarray:  # [pp]: each rank's share of a step of per-stage costs ``x``
        return m * np.array([chunks.sum() for chunks in per_rank(x, pp, vpp)[0]])  # (each rank summed alone)

    row = {  # what each pipeline rank does in a step, all but its waiting
        "forward_compute": mine(costs.fwd),
        "backward_compute": mine(costs.bwd),
        "recompute": mine(costs.recompute),
        "tp_cp_comm": mine(costs.comm_f + costs.comm_b - costs.ep_comm),
        "ep_comm": mine(costs.ep_comm),
        "pp_p2p": mine(costs.send_f + costs.send_b),
        "pipeline_bubble": np.zeros(pp),  # (its waiting: set for the rank the breakdown follows, below)
        "dp_comm_exposed": tail.dp_exposed[0] + tail.gather[0] + tail.tied[0] + mine(costs.zero_f + costs.zero_b),
        "optimizer": tail.optimizer[0] + tail.norm[0],
    }
    works = [{k: float(v[r]) for k, v in row.items()} for r in range(pp)]

    # The breakdown follows the busiest rank (the one with the least waiting; of equals, the one that finishes last):
    # the rank that finishes last may be a light one (an embedding-only first stage) that mostly waits on the others,
    # whose compute would read as the plan's and whose waiting as its pipeline bubble.
    crit = max(range(pp), key=lambda r: (round(sum(works[r].values()), 12), tail.finish[0, r]))
    waited = step - sum(works[crit].values())  # (a sum's rounding where nothing waits: 1e-15 of the step)
    breakdown = {**works[crit], "pipeline_bubble": waited if waited > 1e-9 * step else 0.0}
    parts = {"weights": mem.weights, "gradients": mem.grads, "optimizer": mem.optimizer,
             "activations": mem.activations, "temporary": mem.temporary,
             "allocator_and_reserved": mem.allocator_and_reserved}
    stage_mem = (mem.total[0] / GiB).tolist()
    stage_parts = [{k: float(v[0, r]) / GiB for k, v in parts.items()} for r in range(pp)]
    worst = int(np.argmax(stage_mem))
    tokens = global_batch * model.seq_length
    mflops = model.model_flops_per_token(model.seq_length) * tokens
    exposed_comm = (breakdown["tp_cp_comm"] + breakdown["ep_comm"] + breakdown["pp_p2p"]
                    + breakdown["dp_comm_exposed"])
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        model_flops_per_step=mflops,
        mfu=mflops / (step * priced.peak_flops),
        memory_GiB=stage_mem[worst],
        fits=all(x <= usable_GiB(headroom_GiB, cap) for x, cap in zip(stage_mem, capacity)),
        breakdown=breakdown,
        memory_breakdown=stage_parts[worst],
        bubble_fraction=breakdown["pipeline_bubble"] / step,
        exposed_comm_fraction=exposed_comm / step,
        stage_memory_GiB=stage_mem,
        stage_memory_breakdown=stage_parts,
        stage_time_s=(costs.f[0] + costs.b[0]).tolist(),
        stage_capacity_GiB=list(capacity),
        critical_rank=crit,
        rank_finish_s=tail.finish[0].tolist(),
    )
