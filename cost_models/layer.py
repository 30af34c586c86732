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
A model with MoE layers is priced as its average layer: the MoE layers' share (``ModelSpec.moe_fraction``) of the
routed part (cost_models/moe.py) and of the shared experts, the rest of the dense MLP (docs/cost_model.md).
All quantities broadcast over numpy arrays of configurations.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ArrayLike, ComputeModel
from cost_models.moe import mlp_mix, moe_cost
from specs.model import ModelSpec
from specs.parallel import sp_in_effect, tp_overlap_in_effect
from specs.state import LOSS_BLOCK_V, fused_loss_rows

# Tensors of the squared ReLU's elements its backward reads or writes, as autograd runs torch.pow(relu(x), 2):
# x.pow(1) (a copy: 2), times 2 (2), times the gradient (3), then relu's threshold_backward (3).
SQUARED_RELU_BWD_PASSES = 10


def loss_traffic(eb: int, whole_logits: bool, fused: bool, t: ArrayLike,
                 vocab_shard: ArrayLike) -> tuple[np.ndarray, ...]:
    """The cross-entropy's elementwise work per logit of the vocabulary shard as each stack runs it, ``eb`` bytes per
    logit as the LM head writes them: (bytes forward, kernels forward, bytes backward, kernels backward), the
    kernels per chunk of logits for autopar's fused loss, per micro-batch otherwise (arrays over ``t``).

    - autopar's fused loss (runtime/kernels/cross_entropy_op.py): on one rank one kernel per chunk reads each row
      once when it fits one block (``specs.state.LOSS_BLOCK_V``), else twice (its max and sum of exponentials, then
      its gradient), and writes the gradient over it; vocab-parallel, a statistics kernel reads the row and a
      gradient kernel reads and overwrites it. The backward only scales what the forward made.
    - ``whole_logits``, one kernel per torch op (Megatron-LM's and Megatron-DeepSpeed's vocab-parallel
      cross-entropy; Megatron-Core's ``vocab_parallel_cross_entropy`` at v0.9): an fp32 copy of the logits
      (eb + 4), their max (4), the max subtracted in place (8), exponentiated in place (8), summed (4) and divided by
      the sum in place (8) -- the softmax kept for the backward; backward: the softmax scaled by the incoming
      gradient in place (8) and cast back to the logits' precision (4 + eb). autopar's reference loss on CPUs
      (torch's cross-entropy on the fp32 logits) is priced so too.
    - ``whole_logits`` and ``fused`` (Megatron-Core's ``cross_entropy_loss_fusion``, v0.9
      ``fusions/fused_cross_entropy.py``: the same steps as three compiled functions forward, one backward): the
      fp32 copy with its max (eb + 4), subtract, exponentiate and sum (8), divide (8); backward the scale and the
      cast in one kernel, its in-place result written too (4 + 4 + eb).
    """
    one = np.ones_like(np.asarray(t, dtype=float))
    if not whole_logits:
        single = np.asarray(t) == 1
        reads = np.where(single & (np.asarray(vocab_shard) <= LOSS_BLOCK_V), 1.0, 2.0)
        return (reads + 1.0) * eb * one, np.where(single, 1.0, 2.0) * one, 0.0 * one, 0.0 * one
    if fused:
        return (eb + 4.0 + 8.0 + 8.0) * one, 3.0 * one, (8.0 + eb) * one, one
    return (eb + 4.0 + 4.0 + 8.0 + 8.0 + 4.0 + 8.0) * one, 6.0 * one, (8.0 + 4.0 + eb) * one, 2.0 * one


@dataclass
class LayerCost:
    """Seconds per layer per micro-batch on one GPU (arrays broadcast over configurations)."""

    fwd: np.ndarray  # forward compute
    bwd: np.ndarray  # backward compute (no recompute)
    core_fwd: np.ndarray  # the attention core's forward (what selective recompute repeats)
    comm_fwd: np.ndarray  # exposed TP + CP communication in forward
    comm_bwd: np.ndarray  # exposed TP + CP communication in backward
    ep_comm: np.ndarray | float = 0.0  # of the two above, the MoE layers' all-to-all (and etp) communication


# The tensor-parallel collectives of one layer per micro-batch, in order: (pass, op with sequence parallelism, op
# without it (None: nothing), the GEMM it feeds or follows). Forward: all-gathers feed the column-parallel GEMMs,
# reduce-scatters (all-reduces without SP) follow the row-parallel ones; backward: the conjugates. Each moves
# one activation (:func:`tp_message_bytes`); ``tp_overlap`` runs each as t - 1 ring passes of 1/t of it.
TP_LAYER_OPS = (
    ("fwd", "all_gather", None, "qkv"), ("fwd", "reduce_scatter", "all_reduce", "proj"),
    ("fwd", "all_gather", None, "mlp_in"), ("fwd", "reduce_scatter", "all_reduce", "mlp_out"),
    ("bwd", "all_gather", None, "proj"), ("bwd", "reduce_scatter", "all_reduce", "qkv"),
    ("bwd", "all_gather", None, "mlp_out"), ("bwd", "reduce_scatter", "all_reduce", "mlp_in"),
)
# Under SP each column-parallel GEMM keeps only its input's shard for the backward, as Megatron-LM does (the
# memory model counts it sharded): the backward all-gathers it again, a plain collective beside the GEMM's input
# gradient, with or without tp_overlap: (pass, op, the GEMM whose input it is).
SP_REGATHER_OPS = (("bwd", "all_gather", "qkv"), ("bwd", "all_gather", "mlp_in"))
# Context parallelism, per layer and micro-batch (each of :func:`kv_bytes`): the all-gather of the sequence's K and
# V before the attention, again in the backward, and the reduce-scatter of their gradients.
CP_LAYER_OPS = (("fwd", "all_gather"), ("bwd", "all_gather"), ("bwd", "reduce_scatter"))
# The embedding (first stage) and the head (last stage), per micro-batch: (pass, op with SP, op without, message:
# "act" one activation, "ce" the vocab-parallel cross-entropy's fp32 statistics, a value per token)
END_OPS = {
    "embed": (("fwd", "reduce_scatter", "all_reduce", "act"), ("bwd", "all_gather", None, "act")),
    "head": (("fwd", "all_gather", None, "act"), ("fwd", "all_reduce", "all_reduce", "ce"),
             ("fwd", "all_reduce", "all_reduce", "ce"), ("fwd", "all_reduce", "all_reduce", "ce"),
             ("bwd", "reduce_scatter", "all_reduce", "act")),
}
CE_STAT_BYTES = 4  # fp32 per token


def tp_message_bytes(model: ModelSpec, eb: float, mbs: ArrayLike, cp: ArrayLike) -> np.ndarray:
    """One activation of a micro-batch on one GPU (``mbs`` x seq / ``cp`` tokens x hidden): what each
    tensor-parallel collective and each pipeline send carries."""
    return np.asarray(mbs, dtype=float) * model.seq_length / np.asarray(cp, dtype=float) * model.hidden_size * eb


def ce_stat_bytes(model: ModelSpec, mbs: ArrayLike, cp: ArrayLike) -> np.ndarray:
    """One fp32 value per token of a micro-batch on one GPU: what each of the cross-entropy's all-reduces carries."""
    return np.asarray(mbs, dtype=float) * model.seq_length / np.asarray(cp, dtype=float) * CE_STAT_BYTES


def kv_bytes(model: ModelSpec, eb: float, mbs: ArrayLike, t: ArrayLike) -> np.ndarray:
    """K and V of the whole sequence for this rank's heads: what each context-parallel collective carries."""
    return 2 * np.asarray(mbs, dtype=float) * model.seq_length * (model.kv_width / np.asarray(t, dtype=float)) * eb


def _collectives(comm: CommModel, nbytes, size, stride) -> dict[str, np.ndarray]:
    """The time of each collective the op tables name, for one message over a group."""
    return {"all_gather": comm.all_gather(nbytes, size, stride), "all_reduce": comm.all_reduce(nbytes, size, stride),
            "reduce_scatter": comm.reduce_scatter(nbytes, size, stride)}


def _overlap(comm: np.ndarray, gemm: np.ndarray, t: np.ndarray, on: np.ndarray) -> np.ndarray:
    """Exposed time of a collective split into t chunks behind a GEMM (when ``on``)."""
    hidden = np.maximum(comm / np.maximum(t, 1), comm - gemm)
    return np.where(on, hidden, comm)


# The projections' names in a stack's overlap settings (StateSpec.overlap_pieces, sm_margin: "<name>_fprop" / ...).
OVERLAP_NAMES = {"qkv": "qkv", "proj": "proj", "mlp_in": "fc1", "mlp_out": "fc2"}


def projection_shapes(model: ModelSpec, t: ArrayLike, ffn: ArrayLike | None = None) -> dict[str, tuple]:
    """(N, K) of each tensor-parallel projection's forward GEMM y[tokens, N] = x[tokens, K] W^T on one GPU at tensor
    parallel ``t`` (the weight gradient is N x K); ``ffn``: the MLP's width (default the model's; a shared expert's
    for MoE)."""
    f = model.ffn if ffn is None else ffn
    gated = 2 if model.arch == "llama" else 1
    qw, kw, h = model.q_width, model.kv_width, model.hidden_size
    return {"qkv": ((qw + 2 * kw) / t, h), "proj": (h, qw / t), "mlp_in": (gated * f / t, h), "mlp_out": (h, f / t)}


def layer_cost(model: ModelSpec, cm: ComputeModel, comm: CommModel, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike,
               sp: ArrayLike, tp_overlap: ArrayLike, ep: ArrayLike = 1, etp: ArrayLike = 1,
               pieces: Mapping[str, int] | None = None, sm_margin: Mapping[str, int] | None = None) -> LayerCost:
    """Per-layer cost for tensor parallel ``t``, context parallel ``cp``, micro-batch ``mbs``, expert parallel
    ``ep`` and ``etp`` (arrays). With tp overlap each projection's forward and input-gradient GEMM runs in tp
    pieces, or in as many as ``pieces`` names for it, and a forward GEMM ``sm_margin`` names on that many SMs
    fewer (a stack's own overlap settings: StateSpec.overlap_pieces, StateSpec.sm_margin)."""
    t, cp, mbs = (np.asarray(x, dtype=float) for x in (t, cp, mbs))
    sp = sp_in_effect(sp, t)
    ovl = tp_overlap_in_effect(tp_overlap, sp, t)
    T = mbs * model.seq_length / cp  # tokens per GPU per micro-batch
    gemm = _gemms(model, cm, T, t, ovl, pieces, sm_margin)
    core_f, core_b = _attention_core(model, cm, mbs, t, cp)
    ew_f, ew_b = _elementwise(model, cm, T, t, sp)
    tp_f, tp_b, cp_f, cp_b = _tp_cp_comm(model, comm, gemm, cm.eb, mbs, t, cp, sp, ovl)
    fwd = sum(g[0] for g in gemm.values()) + core_f + ew_f
    bwd = sum(g[1] + g[2] for g in gemm.values()) + core_b + ew_b
    ep_f = ep_b = seq = 0.0
    if model.moe is not None:  # the MoE layers' routed part
        mc, phi = moe_cost(model, cm, comm, t, cp, mbs, ep, etp), model.moe_fraction
        fwd, bwd = fwd + phi * mc.fwd, bwd + phi * mc.bwd
        ep_f, ep_b = phi * mc.comm_fwd, phi * mc.comm_bwd
        # of those, the aux loss's all-reduce runs on the tensor/context-parallel ranks' group, where the runtime's
        # phase clock times it (tp_cp_comm): ep_comm is the expert-parallel collectives alone
        seq = phi * mc.seq_fwd
    return LayerCost(fwd=fwd, bwd=bwd, core_fwd=core_f, comm_fwd=tp_f + cp_f + ep_f, comm_bwd=tp_b + cp_b + ep_b,
                     ep_comm=ep_f + ep_b - seq)


def _gemms(model: ModelSpec, cm: ComputeModel, T: np.ndarray, t: np.ndarray, ovl: np.ndarray,
           pieces: Mapping[str, int] | None, sm_margin: Mapping[str, int] | None) -> dict[str, tuple]:
    """(forward, input-gradient, weight-gradient) GEMM seconds of each projection of a layer, ``T`` tokens per GPU
    (:func:`layer_cost`)."""
    h, f = model.hidden_size, model.ffn
    dense_w, shared_w, fs = mlp_mix(model)
    if model.block is not None:  # traced custom block: one GEMM-equivalent of its matmul FLOPs
        width = model.block.fwd_flops_per_token / (2.0 * h)
        g_fwd, g_bwd = cm.gemm_fwd_bwd(T, width / t, h)
        gemm = {g: (g_fwd / 4, g_bwd / 8, g_bwd / 8) for g in OVERLAP_NAMES}
    else:
        stack = dict(pieces or {})

        def n(g: str, ps: str) -> np.ndarray:  # pieces of GEMM g's pass ps: t under tp_overlap unless the stack says
            name = f"{OVERLAP_NAMES[g]}_{ps}"
            return np.where(ovl, float(stack[name]) if name in stack else t, 1.0)

        margin = dict(sm_margin or {})

        def lin(g: str, ffn=None):
            N, K = projection_shapes(model, t, ffn)[g]
            kept = margin.get(f"{OVERLAP_NAMES[g]}_fprop", 0)
            sms = np.where(ovl, max(1, cm.gpu.sm_count - kept), cm.gpu.sm_count) if kept else None
            return cm.linear(T, N, K, pieces=n(g, "fprop"), dgrad_pieces=n(g, "dgrad"), fprop_sms=sms)

        def mlp(gemm_of):  # the average layer's tensor-parallel MLP GEMM: the dense MLP's and shared experts' share
            shared = gemm_of(fs) if shared_w else (0.0, 0.0, 0.0)
            return tuple(dense_w * a + shared_w * b for a, b in zip(gemm_of(f), shared))

        gemm = {"qkv": lin("qkv"), "proj": lin("proj"), "mlp_in": mlp(lambda w: lin("mlp_in", w)),
                "mlp_out": mlp(lambda w: lin("mlp_out", w))}
    return gemm


def _attention_core(model: ModelSpec, cm: ComputeModel, mbs: np.ndarray, t: np.ndarray, cp: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The attention core's (forward, backward) seconds of a layer (:func:`layer_cost`)."""
    s, hd, eb = model.seq_length, model.hd, cm.eb
    drop = model.dropout_p > 0
    heads = model.num_attention_heads / t
    sq, sk = s / cp, float(s)
    if model.block is not None and model.block.attn_flops_per_token == 0:
        core_f = core_b = np.zeros_like(mbs * sq)
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
    return core_f, core_b


def _elementwise(model: ModelSpec, cm: ComputeModel, T: np.ndarray, t: np.ndarray, sp: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The memory-bound ops' (forward, backward) seconds of a layer: norms, residuals, dropout, activation, RoPE
    (:func:`layer_cost`)."""
    h, f, qw, kw, eb = model.hidden_size, model.ffn, model.q_width, model.kv_width, cm.eb
    n_sp = T * h / np.where(sp, t, 1.0)  # elements of the norm/dropout (sequence-parallel) region
    drop = model.dropout_p > 0
    dense_w, shared_w, fs = mlp_mix(model)
    ffw = T * (dense_w * f + shared_w * fs) / t  # activation-function elements (the tensor-parallel MLPs)
    if model.arch == "gpt":
        ew_f = cm.memory(2 * n_sp * 2 * eb, 2)  # two LayerNorms
        ew_b = cm.memory(2 * n_sp * 3 * eb, 4)  # their backward (dx, then dgamma/dbeta reduce)
        ew_f += cm.memory(2 * n_sp * (3 * eb + (1 if drop else 0)), 2)  # (bias +) dropout + residual
        ew_b += cm.memory(2 * n_sp * (3 * eb + (1 if drop else 0)), 2)
        if model.act == "gelu":
            ew_f += cm.memory(ffw * 2 * eb)  # (bias +) GeLU: one kernel each way
            ew_b += cm.memory(ffw * 3 * eb)
        else:  # torch.pow(relu(x), 2) as torch runs it, unfused: relu, pow; the pow's and the relu's backward
            ew_f += cm.memory(ffw * 4 * eb, 2)
            ew_b += cm.memory(ffw * SQUARED_RELU_BWD_PASSES * eb, 4)
        if model.has_bias:
            ew_b += cm.reduce((T * (qw + 2 * kw) / t + ffw + 2 * n_sp) * eb, 4)  # bias gradients (sum over tokens)
        elif model.qkv_bias:
            ew_b += cm.reduce(T * (qw + 2 * kw) / t * eb)
    else:
        ew_f = cm.memory(2 * n_sp * 2 * eb, 2)  # two RMSNorms
        ew_b = cm.memory(2 * n_sp * 3 * eb, 4)
        ew_f += cm.memory(2 * n_sp * 3 * eb, 2)  # residual adds
        ew_b += cm.memory(2 * n_sp * 3 * eb, 2)  # residual-gradient adds
        ew_f += cm.memory(ffw * 3 * eb)  # SwiGLU
        ew_b += cm.memory(ffw * 5 * eb)
        if drop:
            ew_f += cm.memory(2 * n_sp * (2 * eb + 1), 2)
            ew_b += cm.memory(2 * n_sp * (2 * eb + 1), 2)
    if model.rope_dims:  # RoPE (Llama's, or a GPT's instead of learned positions): a pass over q and k each way,
        rope = cm.memory(T * (qw + kw) / t * 2 * eb)  # the dimensions it leaves alone copied alongside
        ew_f, ew_b = ew_f + rope, ew_b + rope
    if model.block is not None and model.block.elementwise_bytes_per_token:
        ew_f = cm.memory(T * model.block.elementwise_bytes_per_token / t, 6)
        ew_b = 1.5 * ew_f
    return ew_f, ew_b


def _tp_cp_comm(model: ModelSpec, comm: CommModel, gemm: dict[str, tuple], eb: float, mbs: np.ndarray, t: np.ndarray,
                cp: np.ndarray, sp: np.ndarray, ovl: np.ndarray) -> tuple[np.ndarray, ...]:
    """A layer's exposed tensor- and context-parallel communication: (tp forward, tp backward, cp forward, cp
    backward) seconds, the overlapped part hidden behind the ``gemm`` seconds beside it (:func:`layer_cost`)."""
    dense_w, shared_w, _ = mlp_mix(model)
    msg = tp_message_bytes(model, eb, mbs, cp)
    one = _collectives(comm, msg, t, 1)  # each op's time for one activation over tp
    tp = {"fwd": 0.0, "bwd": 0.0}
    mlp_w = dense_w + shared_w  # the MoE layers without shared experts have no tensor-parallel MLP collectives
    share = {"qkv": 1.0, "proj": 1.0, "mlp_in": mlp_w, "mlp_out": mlp_w}
    for ps, with_sp, without, g in TP_LAYER_OPS:  # tp_overlap: backward pieces pipeline with the input-gradient GEMM
        beside = (gemm[g][0] if ps == "fwd" else gemm[g][1]) / max(share[g], 1e-12)
        plain = one[without] if without else 0.0
        tp[ps] = tp[ps] + share[g] * np.where(sp, _overlap(one[with_sp], beside, t, ovl), plain)
    for ps, op, g in SP_REGATHER_OPS:  # beside the input-gradient GEMM, less what tp_overlap's ring already hides
        free = np.maximum(0.0, gemm[g][1] / max(share[g], 1e-12) - np.where(ovl, one["reduce_scatter"], 0.0))
        tp[ps] = tp[ps] + share[g] * np.where(sp, np.maximum(0.0, one[op] - free), 0.0)
    kv = _collectives(comm, kv_bytes(model, eb, mbs, t), cp, t)  # over the cp group (stride t)
    cpc = {"fwd": 0.0, "bwd": 0.0}
    for ps, op in CP_LAYER_OPS:
        cpc[ps] = cpc[ps] + np.where(cp > 1, kv[op], 0.0)
    return tp["fwd"], tp["bwd"], cpc["fwd"], cpc["bwd"]


@dataclass
class EndCost:
    """Embedding (first stage) and final norm + LM head + loss (last stage), per micro-batch."""

    embed_f: np.ndarray
    embed_b: np.ndarray
    head_f: np.ndarray
    head_b: np.ndarray


def end_cost(model: ModelSpec, cm: ComputeModel, comm: CommModel, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike,
             sp: ArrayLike, whole_logits: bool = False, loss_fusion: bool = False) -> EndCost:
    """The embedding's and the head's work per micro-batch, the loss as :func:`loss_traffic` says the stack runs it
    (``whole_logits``/``loss_fusion``: ``StateSpec.full_logits``/``loss_fusion``)."""
    t, cp, mbs = (np.asarray(x, dtype=float) for x in (t, cp, mbs))
    sp = sp_in_effect(sp, t)
    s, h, V = model.seq_length, model.hidden_size, model.vocab_size
    eb = cm.eb
    T = mbs * s / cp
    n_sp = T * h / np.where(sp, t, 1.0)
    drop = model.dropout_p > 0
    one = {"act": _collectives(comm, tp_message_bytes(model, eb, mbs, cp), t, 1),
           "ce": _collectives(comm, ce_stat_bytes(model, mbs, cp), t, 1)}
    comm_t = {(end, ps): 0.0 for end in END_OPS for ps in ("fwd", "bwd")}
    for end, ops in END_OPS.items():
        for ps, with_sp, without, what in ops:
            plain = one[what][without] if without else 0.0
            comm_t[end, ps] = comm_t[end, ps] + np.where(sp, one[what][with_sp], plain)
    # embedding: vocab-parallel lookup, then all-reduce (reduce-scatter with SP) of the partial sums
    pos = 3 * eb if model.learned_positions else 0
    embed_f = cm.memory(T * h * 2 * eb + n_sp * (pos + (2 * eb + 1 if drop else 0)), 3) + comm_t["embed", "fwd"]
    embed_b = cm.memory(T * h * 3 * eb + n_sp * (2 * eb + 1 if drop else 0), 2) + comm_t["embed", "bwd"]
    # head: final norm, (SP all-gather), LM head GEMM over the vocab shard, vocab-parallel cross-entropy
    norm_f, norm_b = cm.memory(n_sp * 2 * eb), cm.memory(n_sp * 3 * eb, 2)
    lm_f, lm_b = cm.gemm_fwd_bwd(T, V / t, h)
    logits = T * V / t
    shard = np.ceil(V / t)
    fb, fk, bb, bk = loss_traffic(eb, whole_logits, loss_fusion, t, shard)
    # autopar's fused loss runs chunk by chunk: each chunk's kernels, and from the second chunk on its weight-gradient
    # GEMM reads the sum so far and writes it back
    chunks = 1.0 if whole_logits else np.ceil(T / fused_loss_rows(T, shard))
    ce_f = cm.memory(logits * fb + (chunks - 1) * shard * h * 2 * eb, chunks * fk)
    ce_b = cm.memory(logits * bb, bk)
    # autopar's fused loss makes the head's input and weight gradients in its forward, chunk by chunk (the backward
    # only scales them): its gradient GEMMs are priced in the forward pass (the breakdown's forward_compute, the
    # last stage's forward in the schedule's replay), as the runtime runs them
    grads_f = 0.0 if whole_logits else lm_b
    head_f = norm_f + lm_f + grads_f + ce_f + comm_t["head", "fwd"]
    head_b = norm_b + lm_b - grads_f + ce_b + comm_t["head", "bwd"]
    return EndCost(embed_f=embed_f, embed_b=embed_b, head_f=head_f, head_b=head_b)
