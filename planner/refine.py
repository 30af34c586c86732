"""Exact re-pricing of the search's finalists: the even layer split, and the ILP's split / per-stage recompute.

``stage_problem`` builds the ILP's inputs (planner/ilp.py) from the cost model's own per-stage terms;
``refine`` prices a configuration exactly (schedule simulation) as it is and, where an uneven split or
partial recompute can help, with the ILP's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.memory import (
    FRAGMENTATION,
    RESERVED_GIB,
    GiB,
    state_bytes,
    zero3_gather_bytes,
)
from cost_models.pipeline import inflight_profiles
from cost_models.stages import LayerTerms, layer_terms, stage_costs
from cost_models.step import Estimate, estimate
from planner.ilp import solve_stages
from planner.stage_problem import StageProblem
from specs.cluster import ClusterSpec
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, zero_in_effect
from specs.rules import PlanContext, check_plan
from specs.state import StateSpec


@dataclass
class PlanResult:
    config: ParallelConfig
    estimate: Estimate

    def row(self) -> dict[str, Any]:
        e = self.estimate
        return {"plan": self.config.short(), "parallel": self.config.to_dict(), "step_time_s": e.step_time_s,
                "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "memory_GiB": e.memory_GiB,
                "bubble_fraction": e.bubble_fraction, "exposed_comm_fraction": e.exposed_comm_fraction}


def stage_problem(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
                  headroom_GiB: float, state: StateSpec, terms: LayerTerms | None = None) -> StageProblem:
    """The ILP's inputs for one configuration, read off the cost model's own per-stage terms: each stage's
    costs with no layers (the embedding, head and sends), with one layer, and with one recomputed layer."""
    cm, comm = ComputeModel(cluster.gpu, cluster.precision), CommModel(cluster)
    c = Candidates.of(replace(cfg, layers=None, recompute_layers=None))
    lt = terms or layer_terms(model, cm, comm, c, state)
    nv, m = cfg.num_chunks, cfg.microbatches(global_batch)
    none, one = np.zeros(nv), np.ones(nv)
    base, plain, redone = (stage_costs(model, comm, state, c, lt, layers, rec, cm.eb)
                           for layers, rec in ((none, none), (one, none), (one, one)))
    u = lambda s: (s.f + s.b)[0]  # noqa: E731 - a stage's time per micro-batch
    d = cfg.dp * cfg.cp
    per_param, per_expert = (float(sum(np.asarray(x).item() for x in vars(state_bytes(1.0, cfg.zero, n, state))
                                       .values())) for n in (d, cfg.edp))
    frag = 1 + FRAGMENTATION
    # a stage's temporaries as stage_state counts them (a layer's backward with ZeRO's scatter buffer, a fully
    # recomputed layer's rebuilt activations, or the head's)
    temporary = float(np.maximum(plain.work_bytes[0], redone.work_bytes[0]).max()) + float(
        zero3_gather_bytes(plain.largest_bucket.max(), zero_in_effect(cfg.zero, d), state, cfg.dp_overlap))
    profiles = inflight_profiles(cfg.pp, cfg.vpp, m)
    inflight = [int(profiles[j % cfg.pp][:, j // cfg.pp].max()) for j in range(nv)]
    return StageProblem(
        num_layers=model.num_layers, pp=cfg.pp, vpp=cfg.vpp, microbatches=m,
        layer_time=float((u(plain) - u(base)).max()), recompute_time=float((u(redone) - u(plain)).max()),
        extra_time=u(base).tolist(),
        state_per_layer=float(((plain.params - plain.expert_params - base.params) * per_param
                               + plain.expert_params * per_expert)[0].max()),
        extra_state=(base.params[0] * per_param).tolist(),
        act_full=float((plain.act_bytes - base.act_bytes)[0].max()) * frag,
        act_ckpt=float((redone.act_bytes - base.act_bytes)[0].max()) * frag,
        extra_act=(base.act_bytes[0] * frag).tolist(), inflight=inflight,
        fixed_bytes=RESERVED_GIB.get(cluster.backend, 1.0) * GiB + temporary * frag,
        capacity=(cluster.gpu.memory_GiB - headroom_GiB) * GiB, allow_recompute=cfg.recompute == "full",
        fixed_layers=cfg.layers,
    )


def _ilp_may_help(model: ModelSpec, cfg: ParallelConfig, est: Estimate) -> bool:
    """Whether an uneven split or partial recompute can beat the even split: full recompute (recompute
    fewer layers where memory allows), layers that do not divide evenly, or an embedding / LM head worth a
    sizeable share of a stage (then the first / last stages should hold fewer layers)."""
    if cfg.recompute == "full":
        return True
    if cfg.pp == 1:
        return False
    if model.num_layers % cfg.num_chunks:
        return True
    t = est.stage_time_s
    middle = sorted(t)[len(t) // 2]
    return max(t[0], t[-1]) > 1.1 * middle


def refine(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
           headroom_GiB: float, fixed: dict[str, Any], state: StateSpec,
           ilp: bool = True, terms: LayerTerms | None = None) -> tuple[list[PlanResult], bool]:
    """Exact estimates of ``cfg`` with an even split and, with ``ilp`` and where it may help, with the stage ILP's
    split / per-stage recompute; and whether the ILP was solved. ``terms``: ``cfg``'s layer terms, when known."""
    out = []
    est = estimate(model, cluster, cfg, global_batch, headroom_GiB, validate=False, state=state, terms=terms)
    out.append(PlanResult(cfg, est))
    if ilp and _ilp_may_help(model, cfg, est):
        if "layers" in fixed and ("recompute_layers" in fixed or cfg.recompute != "full"):
            return out, False
        sol = solve_stages(stage_problem(model, cluster, cfg, global_batch, headroom_GiB, state, terms))
        if sol is not None:
            layers = cfg.stage_layers(model.num_layers) if "layers" in fixed else sol.layers
            rl: Any = fixed.get("recompute_layers", sol.recompute_layers)
            new = cfg
            if cfg.recompute == "full" and "recompute_layers" not in fixed and "recompute" not in fixed:
                if all(r == 0 for r in rl):
                    new = replace(new, recompute="none", recompute_layers=None)
                elif all(r == n for r, n in zip(rl, layers)):
                    new = replace(new, recompute_layers=None)
                else:
                    new = replace(new, recompute_layers=tuple(rl))
            if cfg.pp > 1 and tuple(layers) != cfg.stage_layers(model.num_layers):
                new = replace(new, layers=tuple(layers))
            if new != cfg:
                try:
                    check_plan(new, PlanContext.on(model, cluster, global_batch))
                    same = new.recompute == cfg.recompute  # the layer terms depend on the recompute kind
                    est2 = estimate(model, cluster, new, global_batch, headroom_GiB, validate=False, state=state,
                                    terms=terms if same else None)
                    out.append(PlanResult(new, est2))
                except AutoparError:
                    pass
        return out, True
    return out, False


