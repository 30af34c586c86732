"""Plan search: enumerate every parallel configuration, price them all, refine the best exactly.

1. ``enumerate_space`` lists every valid combination of tp, cp, pp, dp, micro-batch, vpp, sp, recompute,
   ZeRO stage, dp_overlap and tp_overlap as numpy arrays (keys in ``fixed`` are held).
2. ``cost_models.batch`` prices all of them at once (closed-form pipeline, conservative memory).
3. The fastest that fit are re-priced with the exact model (schedule simulation) after the ILP
   (planner/ilp.py) has chosen their layer split and per-stage recompute; the result is sorted.
``exhaustive=True`` drops the pruning of the space (every micro-batch size and interleave degree) and prices
every candidate with the exact model instead of the closed form.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np

from cost_models.batch import Candidates, estimate_batch
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
from cost_models.step import RC_CODE, Estimate, estimate, stage_params
from planner.cluster_spec import ClusterSpec
from planner.errors import AutoparError
from planner.ilp import StageProblem, solve_stages
from planner.model_spec import ModelSpec
from planner.parallel import RECOMPUTE, ParallelConfig
from planner.schedules import build_schedule, virtual_stage

RC_NAMES = {v: k for k, v in RC_CODE.items()}
PRUNED_MAX_MBS = 32
PRUNED_MAX_VPP = 8


@dataclass
class PlanResult:
    config: ParallelConfig
    estimate: Estimate

    def row(self) -> dict[str, Any]:
        e = self.estimate
        return {"plan": self.config.short(), "parallel": self.config.to_dict(), "step_time_s": e.step_time_s,
                "tokens_per_s": e.tokens_per_s, "mfu": e.mfu, "memory_GiB": e.memory_GiB,
                "bubble_fraction": e.bubble_fraction, "exposed_comm_fraction": e.exposed_comm_fraction}


@dataclass
class SearchResult:
    plans: list[PlanResult]  # best first; empty when nothing fits
    candidates: int  # configurations priced
    seconds: float
    closest: PlanResult | None = None  # when nothing fits: the plan needing the least memory
    exhaustive: bool = False
    ranked: list[PlanResult] = field(default_factory=list)  # every exactly-priced plan that fits, best first


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _values(key: str, fixed: dict[str, Any], default: list[Any]) -> list[Any]:
    """The values to try for ``key``: the fixed one, the allowed ones when a list is given, else all."""
    if key not in fixed:
        return default
    v = fixed[key]
    return [x for x in default if x in v] if isinstance(v, (list, tuple, set)) else [v]


# What autopar's own runtime executes (`autopar plan --runnable`, and `autopar run`'s default plan).
RUNNABLE = {"cp": 1, "zero": [0, 1], "tp_overlap": False}


def _as_list(v: Any) -> list[Any]:
    return [] if v is None else list(v) if isinstance(v, (list, tuple, set)) else [v]


def check_fixed(model: ModelSpec, cluster: ClusterSpec, fixed: dict[str, Any]) -> None:
    """One-line errors for fixed keys that no plan can satisfy (the search then honours every other rule)."""
    for k in ("tp", "pp", "dp", "cp", "mbs", "vpp"):
        for v in _as_list(fixed.get(k)):
            if v < 1:
                raise AutoparError(f"--fix {k}={v}: must be at least 1")
    for v in _as_list(fixed.get("zero")):
        if v not in (0, 1, 2, 3):
            raise AutoparError(f"--fix zero={v}: ZeRO stage must be 0, 1, 2 or 3")
    g = cluster.gpus_per_node
    for t in _as_list(fixed.get("tp")):
        from planner.parallel import check_tp_heads

        check_tp_heads(model, t)
        if t > g or (cluster.num_nodes > 1 and g % t):
            raise AutoparError(f"--fix tp={t}: tensor-parallel groups must fit inside a node ({g} GPUs); "
                               f"use a tp that divides {g}")
    for c in _as_list(fixed.get("cp")):
        if c > 1 and model.attn_impl != "flash":
            raise AutoparError(f"--fix cp={c} needs attention: flash in the model spec")
        if c > 1 and model.seq_length % (2 * c):
            raise AutoparError(f"--fix cp={c}: seq {model.seq_length} must be divisible by 2*cp = {2 * c}")
    for p in _as_list(fixed.get("pp")):
        if p > model.num_layers:
            raise AutoparError(f"--fix pp={p}: the model has only {model.num_layers} layers")
    layers = fixed.get("layers")
    if layers is not None:
        if sum(layers) != model.num_layers or min(layers) < 0:
            raise AutoparError(f"--fix layers={'/'.join(map(str, layers))}: must be non-negative and sum to "
                               f"{model.num_layers}")
        if isinstance(fixed.get("pp"), int) and isinstance(fixed.get("vpp", 1), int) \
                and len(layers) != fixed["pp"] * fixed.get("vpp", 1):
            raise AutoparError(f"--fix layers has {len(layers)} entries but pp*vpp = "
                               f"{fixed['pp'] * fixed.get('vpp', 1)} stages need one each")
    rl = fixed.get("recompute_layers")
    if rl is not None:
        if fixed.get("recompute", "full") != "full":
            raise AutoparError("--fix recompute_layers needs recompute=full")
        if min(_as_list(rl)) < 0:
            raise AutoparError("--fix recompute_layers: counts must be non-negative")


def enumerate_space(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
                    exhaustive: bool = False) -> Candidates:
    """Every valid configuration (as arrays), honouring ``fixed`` keys."""
    G, L, g = cluster.num_gpus, model.num_layers, cluster.gpus_per_node
    heads, kv = model.num_attention_heads, model.kv_heads

    def tp_ok(t: int) -> bool:  # divides the heads, stays inside a node without straddling two
        return heads % t == 0 and kv % t == 0 and t <= g and (cluster.num_nodes == 1 or g % t == 0)

    def cp_ok(c: int) -> bool:
        return c == 1 or (model.attn_impl == "flash" and model.seq_length % (2 * c) == 0)

    tps = [t for t in _divisors(math.gcd(heads, kv)) if G % t == 0 and tp_ok(t)]
    cps = [1]
    if model.attn_impl == "flash":
        cps = [c for c in _divisors(G) if cp_ok(c) and (exhaustive or c <= 16)]
    n_layers_fixed = len(fixed["layers"]) if fixed.get("layers") is not None else None
    rl = fixed.get("recompute_layers")
    n_rl_fixed = len(rl) if isinstance(rl, tuple) else None
    outer = []
    for t in _values("tp", fixed, tps):
        if not tp_ok(t):
            continue
        for c in _values("cp", fixed, cps):
            if G % (t * c) or not cp_ok(c):
                continue
            pps = [p for p in _divisors(G // (t * c)) if p <= L]
            for p in _values("pp", fixed, pps):
                if G % (t * c * p) or p > L:
                    continue
                dp = G // (t * c * p)
                if dp not in _values("dp", fixed, [dp]):
                    continue
                if global_batch % dp:
                    continue
                per_dp = global_batch // dp
                mbs_all = _divisors(per_dp)
                if not exhaustive:
                    mbs_all = [b for b in mbs_all if b <= PRUNED_MAX_MBS]
                for b in _values("mbs", fixed, mbs_all):
                    if per_dp % b:
                        continue
                    m = per_dp // b
                    vmax = L // p if p > 1 else 1
                    if not exhaustive:
                        vmax = min(vmax, PRUNED_MAX_VPP)
                    for v in _values("vpp", fixed, list(range(1, vmax + 1))):
                        if v > 1 and (p == 1 or m % p or p * v > L):
                            continue
                        if p * v > L or n_layers_fixed not in (None, p * v) or n_rl_fixed not in (None, p * v):
                            continue
                        outer.append((t, p, dp, c, b, v))
    if not outer:
        return Candidates(*(np.zeros(0, dtype=int) for _ in range(11)))
    inner = list(itertools.product(
        _values("sp", fixed, [False, True]),
        [RC_CODE[r] for r in _values("recompute", fixed, list(RECOMPUTE))],
        _values("zero", fixed, [0, 1, 2, 3]),
        _values("dp_overlap", fixed, [False, True]),
        _values("tp_overlap", fixed, [False, True]),
    ))
    O = np.array(outer, dtype=int)
    I = np.array(inner, dtype=int)
    no, ni = len(O), len(I)
    O = np.repeat(O, ni, axis=0)
    I = np.tile(I, (no, 1))
    t, p, dp, c, b, v = O.T
    sp, rc, zero, dpo, tpo = I.T
    d = dp * c
    ok = ~((sp == 1) & (t == 1)) & ~((tpo == 1) & (sp == 0)) & ~((zero > 0) & (d == 1)) & ~((dpo == 1) & (d == 1))
    idx = np.nonzero(ok)[0]
    return Candidates(tp=t[idx], pp=p[idx], dp=dp[idx], cp=c[idx], mbs=b[idx], vpp=v[idx], sp=sp[idx].astype(bool),
                      recompute=rc[idx], zero=zero[idx], dp_overlap=dpo[idx].astype(bool),
                      tp_overlap=tpo[idx].astype(bool))


def _config(c: Candidates, i: int, fixed: dict[str, Any]) -> ParallelConfig:
    cfg = ParallelConfig(tp=int(c.tp[i]), pp=int(c.pp[i]), dp=int(c.dp[i]), cp=int(c.cp[i]), mbs=int(c.mbs[i]),
                         vpp=int(c.vpp[i]), sp=bool(c.sp[i]), recompute=RC_NAMES[int(c.recompute[i])],
                         zero=int(c.zero[i]), dp_overlap=bool(c.dp_overlap[i]), tp_overlap=bool(c.tp_overlap[i]))
    extra = {k: fixed[k] for k in ("layers", "recompute_layers") if k in fixed}
    return replace(cfg, **extra) if extra else cfg


@lru_cache(maxsize=64)
def _chunk_inflight(pp: int, vpp: int, m: int) -> list[int]:
    """Per virtual stage: the most micro-batches of that chunk in flight at once (from the schedule)."""
    sched = build_schedule(pp, vpp, m)
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
                    new.validate(model, cluster.num_gpus, global_batch, cluster.gpus_per_node)
                    est2 = estimate(model, cluster, new, global_batch, headroom_GiB, validate=False)
                    out.append(PlanResult(new, est2))
                except AutoparError:
                    pass
    return out


def search(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any] | None = None,
           top: int = 5, exhaustive: bool = False, headroom_GiB: float = 0.0, refine_count: int | None = None,
           progress: Any = None) -> SearchResult:
    """Find the fastest plans that fit; ``fixed`` holds plan keys constant."""
    fixed = dict(fixed or {})
    t0 = time.perf_counter()
    if global_batch <= 0:
        raise AutoparError(f"--global-batch must be positive, got {global_batch}")
    check_fixed(model, cluster, fixed)
    if fixed.get("recompute_layers") is not None:
        fixed.setdefault("recompute", "full")
    cands = enumerate_space(model, cluster, global_batch, fixed, exhaustive)
    if len(cands) == 0:
        raise AutoparError(
            f"no parallel configuration of {cluster.num_gpus} GPUs divides global batch {global_batch} and the model "
            f"({model.num_layers} layers, {model.num_attention_heads} heads) with the fixed keys "
            f"{fixed or '(none)'}; change --global-batch, --gpus or --fix"
        )
    cap = cluster.gpu.memory_GiB - headroom_GiB
    n_ref = refine_count or max(2 * top, 16)
    if exhaustive:
        scored = []
        for i in range(len(cands)):
            cfg = _config(cands, i, fixed)
            scored.append(PlanResult(cfg, estimate(model, cluster, cfg, global_batch, headroom_GiB, validate=False)))
            if progress and i % 500 == 0:
                progress(i, len(cands))
        fitting = sorted((r for r in scored if r.estimate.fits),
                         key=lambda r: (r.estimate.step_time_s, r.estimate.memory_GiB))
        pool = [r.config for r in fitting[:n_ref]]
        by_mem = sorted(scored, key=lambda r: r.estimate.memory_GiB)[:8] if not fitting else []
    else:
        res = estimate_batch(model, cluster, cands, global_batch)
        fits = res.memory_GiB <= cap
        order = np.argsort(np.where(fits, res.step_time, np.inf), kind="stable")
        n_fit = int(fits.sum())
        pool = [_config(cands, int(i), fixed) for i in order[:min(n_ref, n_fit)]]
        by_mem = [_config(cands, int(i), fixed) for i in np.argsort(res.memory_GiB)[:8]] if n_fit < top else []
        pool += by_mem
    results: dict[ParallelConfig, PlanResult] = {}
    for cfg in pool:
        for r in refine(model, cluster, cfg, global_batch, headroom_GiB, fixed):
            results[r.config] = r
    if exhaustive and by_mem:
        for r in by_mem:
            results[r.config] = r
    def valid(cfg: ParallelConfig) -> bool:
        try:
            cfg.validate(model, cluster.num_gpus, global_batch, cluster.gpus_per_node)
            return True
        except AutoparError:
            return False

    results = {c: r for c, r in results.items() if valid(c)}
    plans = sorted((r for r in results.values() if r.estimate.fits),
                   key=lambda r: (r.estimate.step_time_s, r.estimate.memory_GiB))
    closest = None
    if not plans:
        allr = sorted(results.values(), key=lambda r: r.estimate.memory_GiB)
        closest = allr[0] if allr else None
    return SearchResult(plans=plans[:top], candidates=len(cands), seconds=time.perf_counter() - t0,
                        closest=closest, exhaustive=exhaustive, ranked=plans)


def min_gpus_to_fit(model: ModelSpec, cluster: ClusterSpec, global_batch: int, fixed: dict[str, Any],
                    headroom_GiB: float = 0.0, limit: int = 1 << 16) -> int | None:
    """The smallest power-of-two multiple of the cluster on which some plan fits (None past ``limit``)."""
    g = cluster.num_gpus * 2
    while g <= limit:
        try:
            bigger = cluster.resized(gpus=g)
        except AutoparError:
            return None
        try:
            res = search(model, bigger, global_batch, fixed=fixed, top=1, headroom_GiB=headroom_GiB, refine_count=4)
        except AutoparError:
            res = None
        if res is not None and res.plans:
            return g
        g *= 2
    return None
