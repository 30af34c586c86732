"""Time of one transformer layer (and of the embedding and LM head) for one micro-batch on one GPU.

Every op of the layer is listed with its shape under tensor (t), context (cp) and sequence parallelism:
GEMMs (QKV, attention output, MLP), the attention core (unfused: batched QK^T / softmax / dropout / AV;
flash: one fused kernel), and the memory-bound ops (norms, residual adds, dropout, activation functions,
RoPE). Communication inside the layer: tensor-parallel all-reduces (or SP all-gather + reduce-scatter)
and the context-parallel all-gather of K/V. What overlaps:
- TP collectives are exposed unless ``tp_overlap``; then each is split into t chunks that hide behind the
  GEMM it feeds (or that feeds it), leaving max(one chunk, collective - GEMM) exposed.
- CP (the runtime's runtime/parallel/context_parallel.py): the all-gather of the whole sequence's K and V is
  exposed in the forward; the backward gathers them again and reduce-scatters dK and dV, both exposed.
All quantities broadcast over numpy arrays of configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from specs.model import ModelSpec


@dataclass
class LayerCost:
    """Seconds per layer per micro-batch on one GPU (arrays broadcast over configurations)."""

    fwd: np.ndarray  # forward compute
    bwd: np.ndarray  # backward compute (no recompute)
    core_fwd: np.ndarray  # the attention core's forward (what selective recompute repeats)
    comm_fwd: np.ndarray  # exposed TP + CP communication in forward
    comm_bwd: np.ndarray  # exposed TP + CP communication in backward


def _overlap(comm: np.ndarray, gemm: np.ndarray, t: np.ndarray, on: np.ndarray) -> np.ndarray:
    """Exposed time of a collective split into t chunks behind a GEMM (when ``on``)."""
    hidden = np.maximum(comm / np.maximum(t, 1), comm - gemm)
    return np.where(on, hidden, comm)


def layer_cost(model: ModelSpec, cm: ComputeModel, comm: CommModel, t, cp, mbs, sp, tp_overlap) -> LayerCost:
    """Per-layer cost for tensor parallel ``t``, context parallel ``cp``, micro-batch ``mbs`` (arrays)."""
    t, cp, mbs = (np.asarray(x, dtype=float) for x in (t, cp, mbs))
    sp = np.asarray(sp, dtype=bool) & (t > 1)
    ovl = np.asarray(tp_overlap, dtype=bool) & sp
    s, h, f = model.seq_length, model.hidden_size, model.ffn
    qw, kw, hd = model.q_width, model.kv_width, model.hd
    eb = cm.eb
    T = mbs * s / cp  # tokens per GPU per micro-batch
    n_sp = T * h / np.where(sp, t, 1.0)  # elements of the norm/dropout (sequence-parallel) region
    drop = model.dropout_p > 0

    # ---- GEMMs ---------------------------------------------------------------------------------
    if model.block is not None:  # traced custom block: one GEMM-equivalent of its matmul FLOPs
        width = model.block.fwd_flops_per_token / (2.0 * h)
        g_fwd, g_bwd = cm.gemm_fwd_bwd(T, width / t, h)
        gemm = {"qkv": (g_fwd / 4, g_bwd / 4), "proj": (g_fwd / 4, g_bwd / 4),
                "mlp_in": (g_fwd / 4, g_bwd / 4), "mlp_out": (g_fwd / 4, g_bwd / 4)}
    else:
        mlp_in = 2 * f if model.arch == "llama" else f
        gemm = {
            "qkv": cm.gemm_fwd_bwd(T, (qw + 2 * kw) / t, h),
            "proj": cm.gemm_fwd_bwd(T, h, qw / t),
            "mlp_in": cm.gemm_fwd_bwd(T, mlp_in / t, h),
            "mlp_out": cm.gemm_fwd_bwd(T, h, f / t),
        }
    gemm_fwd = sum(g[0] for g in gemm.values())
    gemm_bwd = sum(g[1] for g in gemm.values())

    # ---- attention core --------------------------------------------------------------------------
    heads = model.num_attention_heads / t
    sq, sk = s / cp, float(s)
    if model.block is not None and model.block.attn_flops_per_token == 0:
        core_f = core_b = np.zeros_like(T)
    elif model.attn_impl == "flash":
        core_f, core_b = cm.flash_attention(mbs * heads, sq, sk, hd, 0.5)
    else:
        bh = mbs * heads
        E = bh * sq * sk  # attention-score elements
        qk_f, qk_b = cm.gemm_fwd_bwd(sq, sk, hd, bh)  # scores = Q K^T
        av_f, av_b = cm.gemm_fwd_bwd(sq, hd, sk, bh)  # out = P V
        soft_f = cm.memory(E * 2 * eb)  # fused scale + mask + softmax
        soft_b = cm.memory(E * 3 * eb)
        drop_f = cm.memory(E * (2 * eb + 1)) if drop else 0.0
        drop_b = cm.memory(E * (2 * eb + 1)) if drop else 0.0
        core_f = qk_f + av_f + soft_f + drop_f
        core_b = qk_b + av_b + soft_b + drop_b

    # ---- memory-bound ops -------------------------------------------------------------------------
    ffw = T * f / t  # activation-function elements
    if model.arch == "gpt":
        ew_f = cm.memory(2 * n_sp * 2 * eb, 2)  # two LayerNorms
        ew_b = cm.memory(2 * n_sp * 3 * eb, 4)  # their backward (dx, then dgamma/dbeta reduce)
        ew_f += cm.memory(2 * n_sp * (3 * eb + (1 if drop else 0)), 2)  # bias + dropout + residual
        ew_b += cm.memory(2 * n_sp * (3 * eb + (1 if drop else 0)), 2)
        ew_f += cm.memory(ffw * 2 * eb)  # bias + GeLU
        ew_b += cm.memory(ffw * 3 * eb)
        ew_b += cm.memory((T * (qw + 2 * kw) / t + ffw + 2 * n_sp) * eb, 4)  # bias gradients (sum over tokens)
    else:
        ew_f = cm.memory(2 * n_sp * 2 * eb, 2)  # two RMSNorms
        ew_b = cm.memory(2 * n_sp * 3 * eb, 4)
        ew_f += cm.memory(2 * n_sp * 3 * eb, 2)  # residual adds
        ew_b += cm.memory(2 * n_sp * 3 * eb, 2)  # residual-gradient adds
        rope = T * (qw + kw) / t
        ew_f += cm.memory(rope * 2 * eb)
        ew_b += cm.memory(rope * 2 * eb)
        ew_f += cm.memory(ffw * 3 * eb)  # SwiGLU
        ew_b += cm.memory(ffw * 5 * eb)
        if drop:
            ew_f += cm.memory(2 * n_sp * (2 * eb + 1), 2)
            ew_b += cm.memory(2 * n_sp * (2 * eb + 1), 2)
    if model.block is not None and model.block.elementwise_bytes_per_token:
        ew_f = cm.memory(T * model.block.elementwise_bytes_per_token / t, 6)
        ew_b = 1.5 * ew_f

    # ---- tensor-parallel communication ----------------------------------------------------------
    msg = T * h * eb  # one full activation of this micro-batch
    ag = comm.all_gather(msg, t, 1)
    rs = comm.reduce_scatter(msg, t, 1)
    ar = comm.all_reduce(msg, t, 1)
    # forward: (AG -> qkv, proj -> RS, AG -> mlp_in, mlp_out -> RS) with SP; two all-reduces without
    tp_f_sp = (_overlap(ag, gemm["qkv"][0], t, ovl) + _overlap(rs, gemm["proj"][0], t, ovl)
               + _overlap(ag, gemm["mlp_in"][0], t, ovl) + _overlap(rs, gemm["mlp_out"][0], t, ovl))
    # backward: the conjugates (grad AG before proj/mlp_out dgrad, grad RS after qkv/mlp_in dgrad)
    tp_b_sp = (_overlap(ag, gemm["proj"][1] / 2, t, ovl) + _overlap(rs, gemm["qkv"][1] / 2, t, ovl)
               + _overlap(ag, gemm["mlp_out"][1] / 2, t, ovl) + _overlap(rs, gemm["mlp_in"][1] / 2, t, ovl))
    tp_f = np.where(sp, tp_f_sp, 2 * ar)
    tp_b = np.where(sp, tp_b_sp, 2 * ar)

    # ---- context parallelism: all-gather of K and V over the cp group (stride t) -----------------
    kv_bytes = 2 * mbs * s * (kw / t) * eb  # K and V of the whole sequence (this rank's heads), gathered
    kv_ag = comm.all_gather(kv_bytes, cp, t)
    cp_f = np.where(cp > 1, kv_ag, 0.0)  # the attention waits for it
    cp_b = np.where(cp > 1, kv_ag + comm.reduce_scatter(kv_bytes, cp, t), 0.0)  # gathered again; dK, dV scattered

    fwd = gemm_fwd + core_f + ew_f
    bwd = gemm_bwd + core_b + ew_b
    return LayerCost(fwd=fwd, bwd=bwd, core_fwd=core_f, comm_fwd=tp_f + cp_f, comm_bwd=tp_b + cp_b)


@dataclass
class EndCost:
    """Embedding (first stage) and final norm + LM head + loss (last stage), per micro-batch."""

    embed_f: np.ndarray
    embed_b: np.ndarray
    head_f: np.ndarray
    head_b: np.ndarray


def end_cost(model: ModelSpec, cm: ComputeModel, comm: CommModel, t, cp, mbs, sp) -> EndCost:
    t, cp, mbs = (np.asarray(x, dtype=float) for x in (t, cp, mbs))
    sp = np.asarray(sp, dtype=bool) & (t > 1)
    s, h, V = model.seq_length, model.hidden_size, model.vocab_size
    eb = cm.eb
    T = mbs * s / cp
    n_sp = T * h / np.where(sp, t, 1.0)
    msg = T * h * eb
    drop = model.dropout_p > 0
    # embedding: vocab-parallel lookup, then all-reduce (reduce-scatter with SP) of the partial sums
    pos = 3 * eb if model.arch == "gpt" else 0
    embed_f = cm.memory(T * h * 2 * eb + n_sp * (pos + (2 * eb + 1 if drop else 0)), 3)
    embed_f = embed_f + np.where(sp, comm.reduce_scatter(msg, t), comm.all_reduce(msg, t))
    embed_b = cm.memory(T * h * 3 * eb + n_sp * (2 * eb + 1 if drop else 0), 2)
    embed_b = embed_b + np.where(sp, comm.all_gather(msg, t), 0.0)
    # head: final norm, (SP all-gather), LM head GEMM over the vocab shard, vocab-parallel cross-entropy
    norm_f, norm_b = cm.memory(n_sp * 2 * eb), cm.memory(n_sp * 3 * eb, 2)
    lm_f, lm_b = cm.gemm_fwd_bwd(T, V / t, h)
    logits = T * V / t
    ce_f = cm.memory(logits * (eb + 4 + 4), 3) + 3 * comm.all_reduce(T * 4, t)
    ce_b = cm.memory(logits * (4 + eb), 1)
    head_f = norm_f + lm_f + ce_f + np.where(sp, comm.all_gather(msg, t), 0.0)
    head_b = norm_b + lm_b + ce_b + np.where(sp, comm.reduce_scatter(msg, t), comm.all_reduce(msg, t))
    return EndCost(embed_f=embed_f, embed_b=embed_b, head_f=head_f, head_b=head_b)
