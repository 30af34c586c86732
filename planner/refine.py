"""Exact re-pricing of the search's finalists: the even layer split, and the ILP's split / per-stage recompute.

``stage_problem`` builds the ILP's inputs (planner/ilp.py) from the same cost functions the estimate uses;
``refine`` prices a configuration exactly (schedule simulation) as it is and, where an uneven split or
partial recompute can help, with the ILP's choice.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.layer import end_cost, layer_cost
from cost_models.memory import (
    FRAGMENTATION,
    RESERVED_GIB,
    GiB,
    end_activation_bytes,
    layer_activation_bytes,
    state_bytes,
)
from cost_models.pipeline import steady_m
from cost_models.step import RC_CODE, Estimate, estimate, stage_params
from planner.cluster_spec import ClusterSpec
from planner.errors import AutoparError
from planner.ilp import StageProblem, solve_stages
from planner.model_spec import ModelSpec
from planner.parallel import ParallelConfig
from planner.schedules import build_schedule, virtual_stage


@dataclass
class PlanResult:
    config: ParallelConfig
    estimate: Estimate

    def row(self) -> dict[str, Any]:
        e = self.estimate
        return {"plan": self.config.short(), "parallel": self.config.to_dict(), "step_time_s": e.step_time_s,
                "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "memory_GiB": e.memory_GiB,
                "bubble_fraction": e.bubble_fraction, "exposed_comm_fraction": e.exposed_comm_fraction}


@lru_cache(maxsize=64)
def _chunk_inflight(pp: int, vpp: int, m: int) -> list[int]:
    """Per virtual stage: the most micro-batches of that chunk in flight at once (from the schedule; the same
    for ``m`` and ``steady_m(pp, m)``)."""
    sched = build_schedule(pp, vpp, steady_m(pp, m))
    out = [0] * (pp * vpp)
    for r, acts in enumerate(sched):
        cur = [0] * vpp
        for kind, _mb, ch in acts:
            cur[ch] += 1 if kind == "F" else -1
            j = virtual_stage(r, ch, pp)
            out[j] = max(out[j], cur[ch])
    return out


def stage_problem(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
                  headroom_GiB: float) -> StageProblem:
    """The ILP's inputs for one configuration, from the same cost functions as the estimate."""
    prec = cluster.precision
    cm, comm = ComputeModel(cluster.gpu, prec), CommModel(cluster)
    t, cp, b, sp = cfg.tp, cfg.cp, cfg.mbs, cfg.sp
    lc = layer_cost(model, cm, comm, t, cp, b, sp, cfg.tp_overlap)
    ec = end_cost(model, cm, comm, t, cp, b, sp)
    rc = RC_CODE[cfg.recompute]
    full, ckpt, work = (float(x) for x in layer_activation_bytes(model, cm.eb, t, cp, b, sp, rc))
    emb_act, head_act = (float(x) for x in end_activation_bytes(model, cm.eb, t, cp, b, sp))
    m = cfg.microbatches(global_batch)
    nv = cfg.num_chunks
    f, bw = float(lc.fwd + lc.comm_fwd), float(lc.bwd + lc.comm_bwd)
    layer_time = f + bw + (float(lc.core_fwd) if rc == 1 else 0.0)
    act = cm.eb * b * model.seq_length / cp * model.hidden_size
    stride = t * cp * cfg.dp
    p2p = 0.0
    if nv > 1:  # the slowest boundary (sends that leave the node), plus Megatron's all-gather without SP
        cross = any(comm.boundary_crosses_node(r, stride, cfg.pp) for r in range(cfg.pp - 1))
        p2p = float(comm.p2p(act / t, cross)) + (0.0 if sp and t > 1 else float(comm.all_gather(act, t, 1)))
    extra_time = [2 * p2p for _ in range(nv)]
    extra_time[0] += float(ec.embed_f + ec.embed_b) - p2p
    extra_time[-1] += float(ec.head_f + ec.head_b) - (p2p if nv > 1 else 0.0)
    d = cfg.dp * cfg.cp
    st = state_bytes(1.0, cfg.zero, d, prec)
    per_param = float(st.weights + st.grads + st.optimizer)
    ends = stage_params(model, replace(cfg, layers=None), tuple([0] * nv))
    frag = 1 + FRAGMENTATION
    extra_act = [0.0] * nv
    extra_act[0] += emb_act * frag
    fixed_bytes = RESERVED_GIB.get(cluster.backend, 1.0) * GiB + max(work, head_act) * frag
    if cfg.zero == 3:  # two layers' gathered parameters (prefetch)
        fixed_bytes += 2 * model.layer_params / t * (4 if prec == "fp32" else 2) * frag
    return StageProblem(
        num_layers=model.num_layers, pp=cfg.pp, vpp=cfg.vpp, microbatches=m, layer_time=layer_time,
        recompute_time=f, extra_time=extra_time, state_per_layer=model.layer_params / t * per_param,
        extra_state=[e * per_param for e in ends], act_full=full * frag, act_ckpt=ckpt * frag, extra_act=extra_act,
        inflight=_chunk_inflight(cfg.pp, cfg.vpp, m), fixed_bytes=fixed_bytes,
        capacity=(cluster.gpu.memory_GiB - headroom_GiB) * GiB, allow_recompute=rc == 2,
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
           headroom_GiB: float, fixed: dict[str, Any]) -> list[PlanResult]:
    """Exact estimates of ``cfg`` with an even split and with the ILP's split / per-stage recompute."""
    out = []
    est = estimate(model, cluster, cfg, global_batch, headroom_GiB, validate=False)
    out.append(PlanResult(cfg, est))
    if _ilp_may_help(model, cfg, est):
        if "layers" in fixed and ("recompute_layers" in fixed or cfg.recompute != "full"):
            return out
        sol = solve_stages(stage_problem(model, cluster, cfg, global_batch, headroom_GiB))
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
                    new.validate(model, cluster.num_gpus, global_batch, cluster.gpus_per_node, cluster.tp_across_nodes)
                    est2 = estimate(model, cluster, new, global_batch, headroom_GiB, validate=False)
                    out.append(PlanResult(new, est2))
                except AutoparError:
                    pass
    return out


