"""Exact re-pricing of the search's finalists: the even layer split, and the ILP's split / per-stage recompute.

``refine`` prices a configuration exactly (schedule simulation) as it is and, where an uneven split or
partial recompute can help, with the ILP's choice (its inputs: planner/stage_problem.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from cost_models.stages import LayerTerms
from cost_models.step import Estimate, estimate
from planner.ilp import solve_stages
from planner.stage_problem import stage_problem
from specs.cluster import ClusterSpec
from specs.errors import AutoparError
from specs.json_numbers import rounded
from specs.model import ModelSpec
from specs.parallel import ParallelConfig
from specs.rules import PlanContext, check_plan
from specs.state import StateSpec


@dataclass
class PlanResult:
    config: ParallelConfig
    estimate: Estimate

    def rank_key(self) -> tuple[bool, float, float, float]:
        """How plans are ranked everywhere: those that fit first, then the faster, then (a tie) the one recomputing
        less (recompute that only fills a wait on the network costs real time where the network is faster than
        priced), then the one using less memory."""
        e = self.estimate
        return not e.fits, e.step_time_s, e.breakdown.get("recompute", 0.0), e.memory_GiB

    def row(self) -> dict[str, Any]:
        """The plan and its predicted numbers (6 significant digits, as every command writes them)."""
        e = self.estimate
        return {"plan": self.config.short(), "parallel": self.config.to_dict(), **rounded({
            "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "memory_GiB": e.memory_GiB,
            "bubble_fraction": e.bubble_fraction, "exposed_comm_fraction": e.exposed_comm_fraction})}


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
           headroom_GiB: float | None, fixed: dict[str, Any], state: StateSpec,
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
            if cfg.recompute == "full" and "recompute_layers" not in fixed:  # (a fixed recompute=full: some layers)
                if all(r == 0 for r in rl):
                    if "recompute" not in fixed:
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


