"""Vectorised cost model: step time and memory of many configurations at once (numpy).

The same layer, communication and memory functions as ``step.estimate``; the pipeline uses the closed form
(pipeline.analytic_makespan) over the default layer split, paced by the busiest rank's mean chunk, instead
of replaying the schedule. The planner ranks every candidate with this, then re-prices its best ones with
the exact ``step.estimate``. Memory is the largest of the first, a middle and the last rank, with the
schedule's in-flight micro-batches of each and the rank's mean chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from cost_models.pipeline import analytic_makespan, inflight_count
from cost_models.step import BUCKET_PARAMS, GRAD_REDUCE_BYTES, OPT_BYTES_PER_PARAM
from planner.cluster_spec import ClusterSpec
from planner.model_spec import ModelSpec


@dataclass
class Candidates:
    """Parallel arrays, one entry per configuration (recompute: 0 none, 1 selective, 2 full)."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    cp: np.ndarray
    mbs: np.ndarray
    vpp: np.ndarray
    sp: np.ndarray
    recompute: np.ndarray
    zero: np.ndarray
    dp_overlap: np.ndarray
    tp_overlap: np.ndarray

    def __len__(self) -> int:
        return len(self.tp)

    def take(self, idx: np.ndarray) -> Candidates:
        return Candidates(**{k: getattr(self, k)[idx] for k in self.__dataclass_fields__})


@dataclass
class BatchResult:
    step_time: np.ndarray
    memory_GiB: np.ndarray
    bubble: np.ndarray


def _unique_eval(keys: np.ndarray, fn) -> tuple[np.ndarray, ...]:
    """Evaluate ``fn`` on the unique rows of the small non-negative integer matrix ``keys`` and scatter the
    results back (rows are packed into one int64 so that numpy's 1-D unique does the work)."""
    k = keys.astype(np.int64)
    packed = np.zeros(len(k), dtype=np.int64)
    for col in k.T:
        packed = packed * (int(col.max()) + 1) + col
    _, first, inv = np.unique(packed, return_index=True, return_inverse=True)
    outs = fn(*k[first].T.astype(float))
    return tuple(np.asarray(o, dtype=float)[inv.reshape(-1)] for o in outs)


def estimate_batch(model: ModelSpec, cluster: ClusterSpec, c: Candidates, global_batch: int) -> BatchResult:
    prec = cluster.precision
    cm, comm = ComputeModel(cluster.gpu, prec), CommModel(cluster)
    eb = cm.eb
    wb = 4 if prec == "fp32" else 2
    L = model.num_layers
    t, pp, dp, cp, b, v = (x.astype(float) for x in (c.tp, c.pp, c.dp, c.cp, c.mbs, c.vpp))
    sp = c.sp & (c.tp > 1)
    rc = c.recompute
    m = global_batch / (dp * b)
    d = dp * cp

    def per_layer(tt, cc, bb, ss, oo):
        lc = layer_cost(model, cm, comm, tt, cc, bb, ss.astype(bool), oo.astype(bool))
        ec = end_cost(model, cm, comm, tt, cc, bb, ss.astype(bool))
        return (lc.fwd, lc.bwd, lc.core_fwd, lc.comm_fwd, lc.comm_bwd, ec.embed_f + ec.embed_b, ec.head_f + ec.head_b)

    keys = np.stack([t, cp, b, sp.astype(float), c.tp_overlap.astype(float)], axis=1)
    lf, lb, lcore, lcf, lcb, emb, head = _unique_eval(keys, per_layer)

    def acts(tt, cc, bb, ss, rr):
        full, ckpt, work = layer_activation_bytes(model, eb, tt, cc, bb, ss.astype(bool), rr)
        e, h = end_activation_bytes(model, eb, tt, cc, bb, ss.astype(bool))
        return full, ckpt, work, e, h

    akeys = np.stack([t, cp, b, sp.astype(float), rc.astype(float)], axis=1)
    full_b, ckpt_b, work_b, emb_act, head_act = _unique_eval(akeys, acts)

    # per-layer forward+backward (with recompute) and p2p per chunk boundary (priced as crossing nodes when
    # any boundary of the pipeline does: the slowest send paces the pipeline)
    u_layer = lf + lcf + lb + lcb + np.where(rc == 2, lf + lcf, np.where(rc == 1, lcore, 0.0))
    act_tok = b * model.seq_length / cp * model.hidden_size * eb
    stride = t * cp * dp
    nv = pp * v
    cross = (pp > 1) & ((stride >= cluster.gpus_per_node) | (pp * stride > cluster.gpus_per_node))
    p2p = np.where(nv > 1, comm.p2p(act_tok / t, cross) + np.where(sp, 0.0, comm.all_gather(act_tok, t, 1)), 0.0)

    # layers per rank under the default split (the remainder goes to middle stages; the end stages hold
    # floor(L / (pp * vpp)) per chunk): the first and last ranks carry embedding / LM head on top
    one = pp == 1
    lay_mid = np.ceil(L / pp)
    lay_end = np.minimum(lay_mid, np.floor(L / nv) + (v - 1) * np.ceil(L / nv))
    lay_first = np.where(one, L, lay_end)
    lay_last = np.where(one, L, lay_end)
    u_first = lay_first * u_layer + emb + np.where(one, head, 0.0)
    u_last = lay_last * u_layer + head
    u_rank = np.where(one, u_first, np.maximum(lay_mid * u_layer, np.maximum(u_first, u_last))) + 2 * p2p * v
    u_fill = (L * u_layer + emb + head) / v + 2 * p2p * pp
    makespan = analytic_makespan(u_rank / v, u_fill, m, v)

    # parameters per rank
    lp = model.layer_params / t
    pos_p = model.seq_length * model.hidden_size if model.arch == "gpt" else 0
    emb_p = model.vocab_size * model.hidden_size / t + pos_p
    head_p = model.vocab_size * model.hidden_size / t
    p_first = lay_first * lp + emb_p + np.where(one, head_p, 0.0)
    p_last = lay_last * lp + head_p
    p_mid = lay_mid * lp
    rank_p = np.where(one, p_first, np.maximum(p_mid, np.maximum(p_first, p_last)))
    lay_busy = np.where(one, L, np.maximum(lay_mid, lay_end))

    # data-parallel reduction, ZeRO-2/3 per-micro-batch traffic, optimizer, parameter gather
    nb = np.maximum(1.0, np.ceil(rank_p / BUCKET_PARAMS))
    gb = GRAD_REDUCE_BYTES[prec]
    grad_comm = np.where(c.zero == 0, comm.bucketed(comm.all_reduce, rank_p * gb, nb, d, t),
                         comm.bucketed(comm.reduce_scatter, rank_p * gb, nb, d, t))
    nl = np.maximum(lay_busy, 1)  # ZeRO-2/3: a bucket per layer
    rs = comm.bucketed(comm.reduce_scatter, rank_p * gb, nl, d, t)
    window = lay_busy * (lb + lcb)  # the last backward of every chunk on the rank
    dp_exp = np.where(c.dp_overlap, np.maximum(grad_comm / nb, grad_comm - window), grad_comm)
    dp_exp = np.where((d > 1) & (c.zero < 2), dp_exp, 0.0)
    ag = comm.bucketed(comm.all_gather, rank_p * wb, nb, d, t)
    first_fwd = (lf + lcf) * lay_first / v * np.minimum(m, pp)
    gather = np.where(c.dp_overlap, np.maximum(ag / nb, ag - first_fwd), ag)
    gather = np.where((d > 1) & ((c.zero == 1) | (c.zero == 2)), gather, 0.0)
    ag3 = np.where(c.zero == 3, comm.bucketed(comm.all_gather, rank_p * wb, nl, d, t), 0.0)
    f_rank = lay_busy * (lf + lcf)
    b_rank = lay_busy * (u_layer - lf - lcf)
    per_mb = np.where(c.dp_overlap,
                      np.maximum(ag3 / nl, ag3 - f_rank) + np.maximum((ag3 + rs) / nl, ag3 + rs - b_rank),
                      2 * ag3 + rs)
    z23 = np.where((d > 1) & (c.zero >= 2), m * per_mb, 0.0)
    shard = rank_p / np.where(c.zero >= 1, d, 1.0)
    opt = cm.stream(shard * OPT_BYTES_PER_PARAM[prec] + rank_p * 8, 12)
    step = makespan + dp_exp + gather + z23 + opt

    # memory of the first, a middle and the last rank (the schedule's in-flight chunks on each)
    layer_act = np.where(rc == 2, ckpt_b, full_b)
    frag = 1 + FRAGMENTATION
    z3_temp = np.where(c.zero == 3, 2 * lp * wb, 0.0)

    def rank_mem(params, layers, rank, extra_act, temp):
        st = state_bytes(params, c.zero, d, prec)
        inflight = inflight_count(pp, v, m, rank)
        acts = inflight * (layers / v * layer_act + extra_act)
        return st.weights + st.grads + st.optimizer + (acts + temp + z3_temp) * frag

    m_first = rank_mem(p_first, lay_first, 0, emb_act, np.maximum(work_b, np.where(one, head_act, 0.0)))
    m_last = rank_mem(p_last, lay_last, pp - 1, 0.0, np.maximum(work_b, head_act))
    m_mid = rank_mem(p_mid, lay_mid, np.minimum(1, pp - 1), 0.0, work_b)
    mem = np.where(one, m_first, np.maximum(m_first, np.maximum(m_last, np.where(pp > 2, m_mid, 0.0))))
    mem = mem + RESERVED_GIB.get(cluster.backend, 1.0) * GiB
    bubble = (pp - 1) / (m * v + pp - 1)
    return BatchResult(step_time=step, memory_GiB=mem / GiB, bubble=bubble)
