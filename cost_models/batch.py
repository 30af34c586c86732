"""Vectorised cost model: step time and memory of many configurations at once (numpy).

The same layer, communication and memory functions as ``step.estimate``; the pipeline uses the closed form
(pipeline.analytic_makespan) over even layer splits instead of replaying the schedule. The planner ranks
every candidate with this, then re-prices its best ones with the exact ``step.estimate``. Memory here is
conservative (in-flight chunks of every model chunk peak together), so a plan it rejects would not fit.
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

    # per-layer forward+backward (with recompute) and p2p per chunk boundary
    u_layer = lf + lcf + lb + lcb + np.where(rc == 2, lf + lcf, np.where(rc == 1, lcore, 0.0))
    act_tok = b * model.seq_length / cp * model.hidden_size * eb
    stride = t * cp * dp
    nv = pp * v
    p2p = np.where(nv > 1, comm.p2p(act_tok / t, comm.crosses_node(stride))
                   + np.where(sp, 0.0, comm.all_gather(act_tok, t, 1)), 0.0)
    n_max = np.ceil(L / nv)
    n_end = np.floor(L / nv)
    u_max = np.maximum(n_max * u_layer, n_end * u_layer + np.maximum(emb, head) * np.where(nv > 1, 1.0, 0.0))
    u_max = np.where(nv > 1, u_max, L * u_layer + emb + head) + 2 * p2p
    u_fill = (L * u_layer + emb + head) / v + 2 * p2p * pp
    makespan = analytic_makespan(u_max, u_fill, m, v)

    # parameters on the fullest rank (first rank: its chunks plus the embedding)
    lp = model.layer_params / t
    pos_p = model.seq_length * model.hidden_size if model.arch == "gpt" else 0
    emb_p = model.vocab_size * model.hidden_size / t + pos_p
    head_p = model.vocab_size * model.hidden_size / t
    rank_p = np.maximum(n_max * v * lp, n_end * v * lp + np.maximum(emb_p, head_p) * np.where(pp > 1, 1.0, 0.0))
    rank_p = np.where(pp > 1, rank_p, L * lp + emb_p + head_p)

    # data-parallel reduction, ZeRO-2/3 per-micro-batch traffic, optimizer, parameter gather
    nb = np.maximum(1.0, np.ceil(rank_p / BUCKET_PARAMS))
    gb = GRAD_REDUCE_BYTES[prec]
    grad_comm = np.where(c.zero == 0, comm.bucketed(comm.all_reduce, rank_p * gb, nb, d, t),
                         comm.bucketed(comm.reduce_scatter, rank_p * gb, nb, d, t))
    layers_here = np.maximum(n_max * v, 1)
    rs = comm.bucketed(comm.reduce_scatter, rank_p * gb, layers_here, d, t)  # ZeRO-2/3: a bucket per layer
    window = v * (np.maximum(n_max, 1) * (lb + lcb))  # the last backward of each chunk on the rank
    dp_exp = np.where(c.dp_overlap, np.maximum(grad_comm / nb, grad_comm - window), grad_comm)
    dp_exp = np.where((d > 1) & (c.zero < 2), dp_exp, 0.0)
    ag = comm.bucketed(comm.all_gather, rank_p * wb, nb, d, t)
    first_fwd = (lf + lcf) * n_max * np.minimum(m, pp)
    gather = np.where(c.dp_overlap, np.maximum(ag / nb, ag - first_fwd), ag)
    gather = np.where((d > 1) & ((c.zero == 1) | (c.zero == 2)), gather, 0.0)
    ag3 = np.where(c.zero == 3, comm.bucketed(comm.all_gather, rank_p * wb, layers_here, d, t), 0.0)
    per_mb = np.where(c.dp_overlap,
                      np.maximum((3 * ag3 + rs) / np.maximum(n_max * v, 1), 3 * ag3 + rs - (lf + lb) * n_max * v),
                      2 * ag3 + rs)
    z23 = np.where((d > 1) & (c.zero >= 2), m * per_mb, 0.0)
    shard = rank_p / np.where(c.zero >= 1, d, 1.0)
    opt = cm.stream(shard * OPT_BYTES_PER_PARAM[prec] + rank_p * 8, 12)
    step = makespan + dp_exp + gather + z23 + opt

    # memory on the first rank (most micro-batches in flight), conservative
    st = state_bytes(rank_p, c.zero, d, prec)
    layer_act = np.where(rc == 2, ckpt_b, full_b)
    inflight = inflight_count(pp, v, m, 0)
    chunk_act = n_max * layer_act
    acts_b = inflight * chunk_act + inflight * emb_act
    temp = np.maximum(work_b, np.where(pp > 1, 0.0, head_act))
    temp = temp + np.where(c.zero == 3, 2 * lp * wb, 0.0)
    last = st.weights + st.grads + st.optimizer + (head_act + work_b) * (1 + FRAGMENTATION)
    mem = st.weights + st.grads + st.optimizer + (acts_b + temp) * (1 + FRAGMENTATION)
    mem = np.maximum(mem, np.where(pp > 1, last, 0.0))
    mem = mem + RESERVED_GIB.get(cluster.backend, 1.0) * GiB
    bubble = (pp - 1) / (m * v + pp - 1)
    return BatchResult(step_time=step, memory_GiB=mem / GiB, bubble=bubble)
