"""Step time and peak memory of one plan: composes layer, communication, pipeline and memory models.

What overlaps with what (stated once, here):
- Inside a layer: TP collectives are exposed (or hidden behind GEMMs with tp_overlap); CP ring steps hide
  behind attention blocks (layer.py).
- Pipeline: the schedule table is replayed with per-virtual-stage forward/backward times that include the
  blocking p2p send of the activation or gradient (pipeline.py). Idle time on the critical rank is the bubble.
- Data parallel: without dp_overlap the gradient reduce (all-reduce; reduce-scatter for ZeRO-1) runs after
  the rank's last backward. With dp_overlap, gradients are reduced in buckets (BUCKET_PARAMS each) as soon
  as a model chunk's last backward starts producing them, serialised on one communication stream; only what
  outlasts the backward is exposed. ZeRO-1/2 parameter all-gather follows the optimizer step; with dp_overlap
  it hides behind the next step's first forwards (all but its first bucket). ZeRO-2 reduce-scatters
  gradients every micro-batch (it keeps no full gradient buffer to accumulate into); ZeRO-3 also gathers
  each chunk's parameters for every forward and backward; with dp_overlap that traffic is prefetched
  behind compute.
- The optimizer step (memory-bound AdamW over the local shard) runs after the gradient reduce.
The step time is the slowest rank's finish. Memory is the peak over ranks: model state (memory.py) +
activations of the micro-batches in flight (from the schedule table) + the largest temporary + allowances.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
from cost_models.pipeline import peak_inflight_bytes, simulate_steps
from planner.cluster_spec import ClusterSpec
from planner.model_spec import ModelSpec
from planner.parallel import ParallelConfig

BUCKET_PARAMS = 40e6  # gradient bucket size (parameters) for overlapped data-parallel reduction
OPT_BYTES_PER_PARAM = {"fp32": 28.0, "bf16": 30.0, "fp16": 30.0}  # AdamW: read g, w, m, v; write w, m, v (+bf16 w)
# Bytes per gradient element in the data-parallel reduce: Megatron accumulates and reduces bf16 runs' gradients
# in fp32, fp16 runs' in fp16 (its defaults).
GRAD_REDUCE_BYTES = {"fp32": 4.0, "bf16": 4.0, "fp16": 2.0}
RC_CODE = {"none": 0, "selective": 1, "full": 2}


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
    critical_rank: int = 0

    def to_json(self) -> dict[str, Any]:
        r = lambda x: float(f"{x:.6g}")  # noqa: E731
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


@dataclass
class Parts:
    """Per-micro-batch costs of one virtual stage, split by kind (seconds), and its memory terms."""

    fwd: float = 0.0  # forward compute
    bwd: float = 0.0  # backward compute
    recompute: float = 0.0
    tp_cp_comm: float = 0.0  # exposed TP/CP communication, forward + backward
    tp_cp_comm_f: float = 0.0  # ... of which in the forward
    p2p: float = 0.0  # blocking sends, forward + backward
    p2p_f: float = 0.0
    zero3_comm: float = 0.0  # exposed per-micro-batch ZeRO-2/3 gradient reduce-scatters (+ ZeRO-3 gathers)
    zero3_f: float = 0.0
    params: float = 0.0
    act_bytes: float = 0.0  # activations stored per in-flight micro-batch
    work_bytes: float = 0.0  # temporary bytes while this stage runs a backward

    @property
    def f(self) -> float:
        return self.fwd + self.tp_cp_comm_f + self.p2p_f + self.zero3_f

    @property
    def b(self) -> float:
        return (self.bwd + self.recompute + self.tp_cp_comm - self.tp_cp_comm_f + self.p2p - self.p2p_f
                + self.zero3_comm - self.zero3_f)


def _f(x: Any) -> float:
    return float(np.asarray(x))


def stage_params(model: ModelSpec, cfg: ParallelConfig, layers: tuple[int, ...]) -> list[float]:
    """Parameters held per virtual stage on one GPU (tensor-parallel shard)."""
    t, nv = cfg.tp, len(layers)
    out = []
    for j, n in enumerate(layers):
        p = n * model.layer_params / t
        if j == 0:
            p += model.vocab_size * model.hidden_size / t
            if model.arch == "gpt":
                p += model.seq_length * model.hidden_size
        if j == nv - 1:
            p += model.head_params - (0 if model.tie_embeddings else model.vocab_size * model.hidden_size)
            if not model.tie_embeddings or nv > 1:
                p += model.vocab_size * model.hidden_size / t
        out.append(p)
    return out


def estimate(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
             headroom_GiB: float = 0.0, validate: bool = True) -> Estimate:
    """Predict step time, throughput, MFU and peak memory of ``cfg`` (exact: simulates the schedule)."""
    if validate:
        cfg.validate(model, cluster.num_gpus, global_batch, cluster.gpus_per_node, cluster.tp_across_nodes)
    prec = cluster.precision
    cm, comm = ComputeModel(cluster.gpu, prec), CommModel(cluster)
    eb = cm.eb
    t, pp, dp, cp, v = cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.vpp
    m = cfg.microbatches(global_batch)
    d = dp * cp
    rc = RC_CODE[cfg.recompute]
    lc = layer_cost(model, cm, comm, t, cp, cfg.mbs, cfg.sp, cfg.tp_overlap)
    ec = end_cost(model, cm, comm, t, cp, cfg.mbs, cfg.sp)
    full_b, ckpt_b, work_b = (_f(x) for x in layer_activation_bytes(model, eb, t, cp, cfg.mbs, cfg.sp, rc))
    emb_act, head_act = (_f(x) for x in end_activation_bytes(model, eb, t, cp, cfg.mbs, cfg.sp))
    layers = cfg.stage_layers(model.num_layers)
    nv = len(layers)
    params = stage_params(model, cfg, layers)

    # p2p between virtual stages: each tensor-parallel rank sends 1/t of the micro-batch's activation
    # (with SP it holds only that; without, Megatron's scatter/gather sends a slice and all-gathers it
    # over NVLink on arrival)
    sp_on = cfg.sp and t > 1
    act = cfg.mbs * model.seq_length / cp * model.hidden_size * eb
    pp_stride = t * cp * dp

    def p2p_time(j: int) -> float:
        """The blocking send across virtual-stage boundary j -> j+1 (NIC when it leaves the node)."""
        t_ = _f(comm.p2p(act / t, comm.boundary_crosses_node(j % pp, pp_stride, pp)))
        return t_ + (0.0 if sp_on else _f(comm.all_gather(act, t, 1)))

    p2p_j = [p2p_time(j) for j in range(nv - 1)]

    lf, lb, lcore = _f(lc.fwd), _f(lc.bwd), _f(lc.core_fwd)
    lcf, lcb = _f(lc.comm_fwd), _f(lc.comm_bwd)
    wb = 4 if prec == "fp32" else 2
    gb = GRAD_REDUCE_BYTES[prec]
    parts: list[Parts] = []
    for j, n in enumerate(layers):
        nr = cfg.recomputed_layers(j, n)
        pt = Parts(params=params[j])
        pt.fwd = n * lf
        pt.bwd = n * lb
        pt.tp_cp_comm_f = n * lcf
        pt.tp_cp_comm = n * (lcf + lcb)
        pt.recompute = nr * (lf + lcf) if rc == 2 else (n * lcore if rc == 1 else 0.0)
        pt.act_bytes = (n - nr) * full_b + nr * ckpt_b
        pt.work_bytes = work_b if n else 0.0
        if j == 0:
            pt.fwd += _f(ec.embed_f)
            pt.bwd += _f(ec.embed_b)
            pt.act_bytes += emb_act
        if j == nv - 1:
            pt.fwd += _f(ec.head_f)
            pt.bwd += _f(ec.head_b)
            pt.work_bytes = max(pt.work_bytes, head_act)
        pt.p2p_f = p2p_j[j] if j < nv - 1 else 0.0
        pt.p2p = pt.p2p_f + (p2p_j[j - 1] if j > 0 else 0.0)
        if cfg.zero >= 2 and d > 1:
            # ZeRO-2 reduce-scatters gradients every micro-batch; ZeRO-3 also gathers parameters per pass
            nb = max(1, n)  # one bucket per layer
            rs = _f(comm.bucketed(comm.reduce_scatter, params[j] * gb, nb, d, t))
            ag = _f(comm.bucketed(comm.all_gather, params[j] * wb, nb, d, t)) if cfg.zero == 3 else 0.0
            if cfg.dp_overlap:
                pt.zero3_f = max(ag / nb, ag - pt.fwd)
                pt.zero3_comm = pt.zero3_f + max((ag + rs) / nb, ag + rs - pt.bwd - pt.recompute)
            else:
                pt.zero3_f, pt.zero3_comm = ag, 2 * ag + rs
        parts.append(pt)

    sim = simulate_steps(pp, v, m, [p.f for p in parts], [p.b for p in parts])

    # ---- data-parallel gradient reduction, optimizer, ZeRO parameter gather, per rank ----------------
    rank_params = [sum(params[c * pp + r] for c in range(v)) for r in range(pp)]
    finish, dp_exposed, opt_time, gather_exposed = [], [], [], []
    for r in range(pp):
        end = sim.rank_end[r]
        exposed = 0.0
        if d > 1 and cfg.zero < 2:
            chunk_comm = []
            for c in range(v):
                pc = params[c * pp + r]
                nb = max(1, math.ceil(pc / BUCKET_PARAMS))
                coll = comm.all_reduce if cfg.zero == 0 else comm.reduce_scatter
                chunk_comm.append((sim.last_b[r][c], _f(comm.bucketed(coll, pc * gb, nb, d, t)), nb))
            if cfg.dp_overlap:
                engine = 0.0
                for (b_start, b_end), dur, nb in sorted(chunk_comm):
                    start = max(engine, b_start + (b_end - b_start) / nb)
                    engine = max(start + dur, b_end + dur / nb)
                exposed = max(0.0, engine - end)
            else:
                exposed = sum(dur for _, dur, _ in chunk_comm)
        shard = rank_params[r] / (d if cfg.zero >= 1 else 1)
        opt = _f(cm.stream(shard * OPT_BYTES_PER_PARAM[prec] + rank_params[r] * 8, 12))
        gather = 0.0
        if d > 1 and cfg.zero in (1, 2):
            nb = max(1, math.ceil(rank_params[r] / BUCKET_PARAMS))
            ag = _f(comm.bucketed(comm.all_gather, rank_params[r] * wb, nb, d, t))
            first_fwd = parts[r].f * min(m, pp - r)
            gather = max(ag / nb, ag - first_fwd) if cfg.dp_overlap else ag
        dp_exposed.append(exposed)
        opt_time.append(opt)
        gather_exposed.append(gather)
        finish.append(end + exposed + opt + gather)
    tied = 0.0
    if model.tie_embeddings and nv > 1:
        tied = _f(comm.all_reduce(model.vocab_size * model.hidden_size / t * gb, 2, pp_stride * (pp - 1) or 1))
    norm = _f(comm.all_reduce(8, cluster.num_gpus, 1))  # grad-norm and loss reductions (latency)
    crit = int(np.argmax(finish))
    step = finish[crit] + tied + norm

    # ---- breakdown along the critical rank ------------------------------------------------------------
    mine = [parts[c * pp + crit] for c in range(v)]
    comp_f = m * sum(p.fwd for p in mine)
    comp_b = m * sum(p.bwd for p in mine)
    recomp = m * sum(p.recompute for p in mine)
    tpcp = m * sum(p.tp_cp_comm for p in mine)
    p2p = m * sum(p.p2p for p in mine)
    z3 = m * sum(p.zero3_comm for p in mine)
    bubble = sim.rank_end[crit] - sim.rank_busy[crit]
    breakdown = {
        "forward_compute": comp_f,
        "backward_compute": comp_b,
        "recompute": recomp,
        "tp_cp_comm": tpcp,
        "pp_p2p": p2p,
        "pipeline_bubble": bubble,
        "dp_comm_exposed": dp_exposed[crit] + gather_exposed[crit] + z3 + tied,
        "optimizer": opt_time[crit] + norm,
    }

    # ---- memory per rank ------------------------------------------------------------------------------
    peaks = peak_inflight_bytes(pp, v, m, [p.act_bytes for p in parts])
    reserved = RESERVED_GIB.get(cluster.backend, 1.0) * GiB
    stage_mem, mem_parts = [], []
    for r in range(pp):
        st = state_bytes(rank_params[r], cfg.zero, d, prec)
        mine_r = [parts[c * pp + r] for c in range(v)]
        temp = max(p.work_bytes for p in mine_r)
        if cfg.zero == 3:
            temp += 2 * max(p.params for p in mine_r) / max(1, max(layers)) * wb
        dyn = peaks[r] + temp
        total = _f(st.weights + st.grads + st.optimizer) + dyn * (1 + FRAGMENTATION) + reserved
        stage_mem.append(total / GiB)
        mem_parts.append({
            "weights": _f(st.weights) / GiB, "gradients": _f(st.grads) / GiB, "optimizer": _f(st.optimizer) / GiB,
            "activations": peaks[r] / GiB, "temporary": temp / GiB,
            "allocator_and_reserved": (dyn * FRAGMENTATION + reserved) / GiB,
        })
    worst = int(np.argmax(stage_mem))
    mem = stage_mem[worst]
    cap = cluster.gpu.memory_GiB - headroom_GiB

    tokens = global_batch * model.seq_length
    mflops = model.model_flops_per_token(model.seq_length) * tokens
    peak = cluster.gpu.peak(prec)
    exposed_comm = breakdown["tp_cp_comm"] + breakdown["pp_p2p"] + breakdown["dp_comm_exposed"]
    return Estimate(
        step_time_s=step,
        tokens_per_s=tokens / step,
        model_flops_per_step=mflops,
        mfu=mflops / (step * cluster.num_gpus * peak),
        memory_GiB=mem,
        fits=mem <= cap,
        breakdown=breakdown,
        memory_breakdown=mem_parts[worst],
        bubble_fraction=bubble / step,
        exposed_comm_fraction=exposed_comm / step,
        stage_memory_GiB=stage_mem,
        stage_memory_breakdown=mem_parts,
        stage_time_s=[p.f + p.b for p in parts],
        critical_rank=crit,
    )
