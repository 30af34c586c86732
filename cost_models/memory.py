"""Memory per GPU: weights, gradients and optimizer state by precision and ZeRO stage; activations.

Activations follow Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
Models", term by term, so for GPT with unfused attention and dropout the per-layer bytes are exactly the
paper's: sbh(34 + 5as/h) unsharded; sbh(10 + 24/t + 5as/(ht)) with TP; (sbh/t)(34 + 5as/h) with TP+SP;
the 5as/h term drops with selective recompute; 2sbh per layer (2sbh/t with SP) with full recompute.
The same terms generalise to Llama: RMSNorm inputs, GQA-sized K/V, SwiGLU's gate, up and product, flash
attention's output and log-sum-exp instead of the s x s scores. Context parallelism divides the tokens.

Allowances (documented, not fitted per plan): ``RESERVED_GIB`` per GPU for the CUDA context, NCCL and
cuBLAS workspaces (allocations PyTorch's allocator does not see), and ``FRAGMENTATION`` of the dynamic
(activation and temporary) memory for the caching allocator's fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.arrays import by_value
from cost_models.compute import ArrayLike
from cost_models.moe import mlp_mix, moe_bytes
from cost_models.params import per_rank
from cost_models.pipeline import peak_inflight_bytes
from specs.model import ModelSpec
from specs.parallel import RECOMPUTE_CODE, Candidates, edp, sp_in_effect, zero_in_effect
from specs.schedules import repeating_from
from specs.state import StateSpec, fused_loss_rows

GiB = float(2**30)
SELECTIVE, FULL = RECOMPUTE_CODE["selective"], RECOMPUTE_CODE["full"]
RESERVED_GIB = {"nccl": 1.0, "gloo": 0.1}
FRAGMENTATION = 0.05


def layer_activation_bytes(model: ModelSpec, eb: int, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike, sp: ArrayLike,
                           recompute: ArrayLike, etp: ArrayLike = 1
                           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, per micro-batch: (bytes stored without full recompute, bytes stored with full
    recompute, bytes materialised while the layer's backward runs). ``recompute`` 1 = selective, 2 = full.
    A model with MoE layers: the average layer, the MoE layers' share of their routed part (cost_models/moe.py)."""
    t, cp, mbs = (np.asarray(x, dtype=float) for x in (t, cp, mbs))
    sp = sp_in_effect(sp, t)
    rc = np.asarray(recompute)
    s, h, f = model.seq_length, model.hidden_size, model.ffn
    qw, kw = model.q_width, model.kv_width
    heads = model.num_attention_heads
    T = mbs * s / cp
    shard = np.where(sp, t, 1.0)
    mask = 1.0 if model.dropout_p > 0 else 0.0
    dense_w, shared_w, fs = mlp_mix(model)
    mlp_width = dense_w * f + shared_w * fs  # the tensor-parallel MLPs of the average layer
    if model.block is not None:
        full = T * model.block.act_bytes_per_token * (eb / 2.0) / t
        core = np.zeros_like(full)
    else:
        # norm / residual region: two norm inputs, the two GEMM inputs they feed, two dropout masks
        region = (4 * eb + 2 * mask) * h / shard
        if model.attn_impl == "flash":
            attn = eb * (qw + 2 * kw + qw) / t  # Q, K, V and the output O
            core = 4.0 * heads / t  # fp32 log-sum-exp per head
        else:
            attn = eb * (qw + kw + kw + qw) / t  # Q and K (for QK^T), V, context (input of the projection)
            core = (heads / t) * s * (eb + (1 + eb) * mask)  # softmax output, dropout mask and output
        mlp = (2 if model.arch == "gpt" else 3) * eb * mlp_width / t  # GeLU in/out, or gate, up, SwiGLU out
        full = T * (region + attn + mlp + np.where(rc == SELECTIVE, 0.0, core))
        core = T * core
    ckpt = T * eb * h / shard  # layer input only
    # gradient buffers alive during one layer's backward; the squared ReLU's (torch.pow(relu(x), 2)) backward holds two
    # more of the MLP's width at once (relu(x) to the first power, then times 2, before the incoming gradient)
    act_work = 4 if model.act == "squared_relu" else 2
    work = T * eb * (2 * h / shard + act_work * mlp_width / t)
    if model.moe is not None:
        routed_act, routed_work = moe_bytes(model, eb, t, cp, mbs, etp)
        full, work = full + model.moe_fraction * routed_act, work + model.moe_fraction * routed_work
    # context parallelism's attention backward: K and V all-gathered again (the whole sequence), their gradients
    # summed over the blocks in fp32 (the whole sequence) and the local queries' in fp32 (runtime/parallel/
    # context_parallel.py)
    work = work + np.where(cp > 1, (mbs * s * kw * (2 * eb + 2 * 4.0) + T * qw * 4.0) / t, 0.0)
    # while a layer runs backward: its gradient buffers, plus whatever recompute materialises again
    # (the whole layer under full recompute, the attention core under selective)
    return full, ckpt, work + np.where(rc == FULL, full, np.where(rc == SELECTIVE, core, 0.0))


def end_activation_bytes(model: ModelSpec, eb: int, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike, sp: ArrayLike,
                         state: StateSpec, whole_logits: bool, reference: bool = False
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(embedding bytes stored per in-flight micro-batch on the first stage, LM-head + loss bytes on the last stage,
    the embedding's backward temporaries on the first stage).

    The embedding's backward: the gradient of its output over all the tokens (under TP also its masked copy, and under
    SP the received shard it is gathered from) and its weight's dense gradient over the vocabulary shard, in the
    parameters' precision, before it is added to the gradient buffer (a first stage of no layers peaked there 11-48%
    above the model without it, `autopar estimate --verify`).
    The head's: the final norm's input and its backward's fp32 working copy (over the local tokens), its input and
    input gradient [tokens, h] (the whole sequence: under SP gathered), and the logits over the vocabulary shard.
    With ``whole_logits`` (Megatron-LM's loss) all of them, 16-bit and an fp32 copy; autopar's ``reference`` loss
    (on CPUs) three fp32 copies at its backward's peak (the log-softmax's saved output, its gradient, the logits');
    else autopar's fused loss: one chunk of 16-bit logits (``specs.state.fused_loss_rows``), an fp32 loss per token,
    and the weight shard's gradient, which it computes in the forward and keeps until the backward."""
    t, cp, mbs = (np.asarray(x, dtype=float) for x in (t, cp, mbs))
    sp = sp_in_effect(sp, t)
    T = mbs * model.seq_length / cp
    shard = np.where(sp, t, 1.0)
    vocab = np.ceil(model.vocab_size / t)
    embed = T * model.hidden_size * (1.0 if model.dropout_p > 0 else 0.0) / shard
    # the head's input and input gradient over all the tokens (under SP the all-gathered input, beside the final
    # norm's local output it was gathered from)
    x_bytes = T * eb * model.hidden_size * (2.0 + np.where(sp, 1.0 / t, 0.0))
    x_bytes = x_bytes + T * model.hidden_size * (eb + 4.0) / shard  # the final norm's
    embed_work = (T * eb * model.hidden_size * (1.0 + (t > 1) + np.where(sp, 1.0 / t, 0.0))
                  + vocab * model.hidden_size * state.param_bytes)
    if reference:
        return embed, x_bytes + T * 3 * 4.0 * vocab, embed_work
    if whole_logits:
        return embed, x_bytes + T * (eb + 4.0) * vocab, embed_work
    return embed, x_bytes + fused_loss_rows(T, vocab) * vocab * eb + T * 4.0 + vocab * model.hidden_size * \
        state.param_bytes, embed_work


def reserved_bytes(backend: str) -> float:
    """Bytes per GPU the caching allocator does not see (CUDA context, NCCL and cuBLAS workspaces): ``RESERVED_GIB``
    of the communication ``backend``, 1 GiB for one not listed."""
    return RESERVED_GIB.get(backend, 1.0) * GiB


def fragmentation_bytes(dynamic: np.ndarray | float) -> np.ndarray | float:
    """The caching allocator's fragmentation of ``dynamic`` bytes (activations and temporaries): a fixed share of
    them, so linear in them."""
    return dynamic * FRAGMENTATION


@dataclass
class StateBytes:
    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray

    @property
    def total(self) -> np.ndarray:
        """Weights, gradients and optimizer state together."""
        return self.weights + self.grads + self.optimizer


def state_bytes(params: ArrayLike, zero: ArrayLike, d: ArrayLike, state: StateSpec) -> StateBytes:
    """Bytes of parameters, gradients and optimizer state (``state``'s precisions: specs/state.py) for ``params``
    local parameters. ZeRO-1 shards the optimizer state over the ``d`` = dp x cp ranks of the data-parallel
    group, ZeRO-2 also the gradients, ZeRO-3 also the parameters."""
    params = np.asarray(params, dtype=float)
    zero = np.asarray(zero)
    d = np.maximum(np.asarray(d, dtype=float), 1.0)
    weights = params * np.where(zero >= 3, state.param_bytes / d, state.param_bytes)
    grads = params * np.where(zero >= 2, state.grad_bytes / d, state.grad_bytes)
    opt = params * np.where(zero >= 1, state.optimizer_bytes / d, state.optimizer_bytes)
    return StateBytes(weights=weights, grads=grads, optimizer=opt)


def state_shards(c: Candidates) -> tuple[np.ndarray, np.ndarray]:
    """([N], [N]): the data-parallel ranks ZeRO shards a dense parameter's state over (dp x cp) and a routed
    expert's (its expert-data-parallel group, :func:`specs.parallel.edp`)."""
    return c.dp * c.cp, edp(c.dp, c.cp, c.tp, c.ep, c.etp)


def state_per_param(c: Candidates, state: StateSpec) -> tuple[np.ndarray, np.ndarray]:
    """([N], [N]): bytes of weights, gradients and optimizer state per dense parameter and per routed expert's
    parameter on one GPU (:func:`rank_memory`'s state is linear in both counts)."""
    dense_d, expert_d = state_shards(c)
    return state_bytes(1.0, c.zero, dense_d, state).total, state_bytes(1.0, c.zero, expert_d, state).total


def zero3_gather_bytes(largest_bucket: ArrayLike, zero: ArrayLike, state: StateSpec,
                       overlap: ArrayLike = True) -> np.ndarray:
    """ZeRO-3's gathered parameters alive at once on one GPU: with ``overlap`` (dp_overlap) two of its largest
    per-layer buckets (the running one, the next one prefetched), without it one (runtime/parallel/data_parallel.py
    gathers a module's buckets when it runs and frees them after)."""
    return np.where(np.asarray(zero) == 3, np.where(overlap, 2, 1) * np.asarray(largest_bucket) * state.param_bytes,
                    0.0)


def zero_scatter_bytes(largest_bucket: ArrayLike, zero: ArrayLike, state: StateSpec, overlap: ArrayLike) -> np.ndarray:
    """ZeRO-2/3's gradient buffer in flight: with ``overlap`` a layer's reduce-scatter (its gradients copied into one
    flat buffer of the reduce dtype) runs behind the next layer's backward, so one such buffer is alive at that
    backward's peak (runtime/parallel/data_parallel.py ``_scatter``); without it the reduce-scatter finishes
    before the next backward starts."""
    return np.where((np.asarray(zero) >= 2) & np.asarray(overlap, dtype=bool),
                    np.asarray(largest_bucket) * state.grad_reduce_bytes, 0.0)


@dataclass
class RankMemory:
    """Peak memory of each pipeline rank, by kind ([N, pp] arrays, bytes)."""

    weights: np.ndarray
    grads: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray  # the most micro-batches' activations held at once (from the schedule)
    temporary: np.ndarray  # the largest temporary: a backward's buffers, ZeRO-3's gathered layers
    allocator_and_reserved: np.ndarray  # fragmentation of the dynamic memory, CUDA context and workspaces

    @property
    def total(self) -> np.ndarray:
        return (self.weights + self.grads + self.optimizer + self.activations + self.temporary
                + self.allocator_and_reserved)


@dataclass
class RankLoad:
    """What each pipeline rank holds whatever the ZeRO stage ([N, pp] arrays): its parameters, the most
    activation bytes it holds at once, its largest backward temporaries and its largest per-layer bucket."""

    params: np.ndarray
    activations: np.ndarray
    work: np.ndarray
    largest_bucket: np.ndarray
    expert_params: np.ndarray  # of ``params``, the routed experts'

    def take(self, idx: np.ndarray) -> RankLoad:
        return RankLoad(self.params[idx], self.activations[idx], self.work[idx], self.largest_bucket[idx],
                        self.expert_params[idx])


def rank_load(pp: int, vpp: int, m: np.ndarray, params: np.ndarray, act_bytes: np.ndarray, work_bytes: np.ndarray,
              largest_bucket: np.ndarray, expert_params: np.ndarray) -> RankLoad:
    """Each rank's load of candidates with one pp and vpp and ``m`` micro-batches each ([N]) from, per virtual
    stage ([N, pp * vpp]), the parameters, activation bytes per micro-batch in flight, the temporary bytes of a
    backward, the largest per-layer bucket and the routed experts' parameters."""
    n = len(params)
    m = np.minimum(np.asarray(m), repeating_from(pp))  # more only repeat the peak
    peak = np.zeros((n, pp))
    for mi, rows in by_value(m):
        peak[rows] = peak_inflight_bytes(pp, vpp, int(mi), act_bytes[rows])
    return RankLoad(params=per_rank(params, pp, vpp).sum(axis=2), activations=peak,
                    work=per_rank(work_bytes, pp, vpp).max(axis=2),
                    largest_bucket=per_rank(largest_bucket, pp, vpp).max(axis=2),
                    expert_params=per_rank(expert_params, pp, vpp).sum(axis=2))


def temporary_bytes(c: Candidates, state: StateSpec, work: np.ndarray, largest_bucket: np.ndarray) -> np.ndarray:
    """A rank's largest temporary ([N, ...]): a backward's ``work`` bytes plus, under ZeRO-3, the gathered
    parameters of its ``largest_bucket``."""
    zero = zero_in_effect(c.zero, c.dp * c.cp)[:, None]
    return work + zero3_gather_bytes(largest_bucket, zero, state, c.dp_overlap[:, None])


def rank_memory(c: Candidates, state: StateSpec, backend: str, load: RankLoad) -> RankMemory:
    """Every rank's peak memory for candidates ``c`` (one pp and vpp) holding ``load``."""
    dense_d, expert_d = state_shards(c)
    dense = state_bytes(load.params - load.expert_params, c.zero[:, None], dense_d[:, None], state)
    experts = state_bytes(load.expert_params, c.zero[:, None], expert_d[:, None], state)
    st = StateBytes(*(a + b for a, b in zip(vars(dense).values(), vars(experts).values())))
    temp = temporary_bytes(c, state, load.work, load.largest_bucket)
    dynamic = load.activations + temp
    return RankMemory(weights=st.weights, grads=st.grads, optimizer=st.optimizer, activations=load.activations,
                      temporary=temp, allocator_and_reserved=fragmentation_bytes(dynamic) + reserved_bytes(backend))
