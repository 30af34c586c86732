"""A mixture-of-experts layer's routed part, per micro-batch on one GPU: router, token dispatch, experts, combine.

The layer's input is the rank's sequence-parallel share of the tokens, ``T' = mbs x seq / (cp x t)`` (with tensor
parallelism the MoE layer needs sequence parallelism, as in Megatron-Core). Each token goes to
``experts_per_token`` (k) experts. The experts are split over an ``ep`` x ``etp`` block of a stage's dp*cp*tp ranks
(``specs.parallel.edp``; etp innermost, so an ep group's members are etp ranks apart):

- router: a [T', h] x [h, E] GEMM, then softmax/sigmoid and top-k over the E scores (fp32, memory bound);
- dispatch: the tokens permuted by expert, then an all-to-all over the ep group (each rank sends k T' tokens of h
  values); with etp > 1 the received tokens are gathered over etp (an all-to-all of uneven rows); the combine is the
  reverse (the partial outputs reduced back over etp, an all-to-all back over ep, then the weighted sum of each
  token's k outputs); the backward runs both again (:data:`MOE_LAYER_OPS`);
- experts: each rank holds E / ep experts; balanced, each sees ``k T' etp ep / E`` tokens, as a grouped GEMM
  (``ComputeModel.gemm`` with the experts as its batch: tile quantisation makes it slower per FLOP as the tokens
  per expert fall) for the SwiGLU's gate|up and down projections, split etp ways;
- load imbalance: the busiest rank receives ``MoESpec.token_time_factor()`` times the mean (the documented load
  imbalance, or the capacity every buffer is padded to with a capacity factor); the step waits for it, so the
  experts' GEMMs, their elementwise ops and the all-to-alls are priced at that rank's load.

No communication is overlapped with compute (Megatron-Core's default all-to-all dispatcher).
The shared experts are a dense tensor-parallel MLP, priced with the dense MLP's terms in layer.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ArrayLike, ComputeModel
from specs.model import ModelSpec

# The routed part's collectives per MoE layer and micro-batch, in order: (pass, op, group, what) (message sizes:
# :func:`moe_messages`). "counts": how many rows each rank sends each expert (int64, over ep, before the tokens; with
# etp > 1 also all-gathered over etp); "dispatch"/"combine": the k T' routed tokens over the ep group, and with
# etp > 1 the received tokens over the etp group (gathered before the experts, their partial outputs reduced back
# after: both as all-to-alls of uneven rows, which gloo and NCCL run alike; the backward the conjugates); "aux": the
# aux loss's expert-choice counts of each sequence summed over the "seq" ranks that hold its shards (tp with SP,
# x cp; fp32).
MOE_LAYER_OPS = (
    ("fwd", "all_reduce", "seq", "aux"), ("fwd", "all_to_all", "ep", "counts"),
    ("fwd", "all_to_all", "ep", "dispatch"), ("fwd", "all_gather", "etp", "counts"),
    ("fwd", "all_to_all", "etp", "dispatch"), ("fwd", "all_to_all", "etp", "combine"),
    ("fwd", "all_to_all", "ep", "combine"),
    ("bwd", "all_to_all", "ep", "combine"), ("bwd", "all_to_all", "etp", "combine"),
    ("bwd", "all_to_all", "etp", "dispatch"), ("bwd", "all_to_all", "ep", "dispatch"),
)
ROUTER_STAT_BYTES = 4  # the router's scores and probabilities are fp32
COUNT_BYTES = 8  # the per-expert row counts (int64)


def mlp_mix(model: ModelSpec) -> tuple[float, float, int]:
    """How the average layer's tensor-parallel MLP is made up: (weight of the dense MLP, weight of the shared
    experts' MLP, the shared experts' width); (1, 0, 0) for a dense model."""
    if model.moe is None:
        return 1.0, 0.0, 0
    phi, fs = model.moe_fraction, model.moe.shared_ffn
    return 1.0 - phi, (phi if fs else 0.0), fs


def routed_load(model: ModelSpec, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike,
                etp: ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per MoE layer and micro-batch: (T', the rank's sequence-parallel tokens; the k T' token-expert pairs it sends;
    the pairs the busiest rank computes, ``token_time_factor`` x the mean, after the etp all-gather)."""
    assert model.moe is not None
    t, cp, mbs, etp = (np.asarray(x, dtype=float) for x in (t, cp, mbs, etp))
    tokens = mbs * model.seq_length / (cp * t)
    pairs = tokens * model.moe.experts_per_token
    return tokens, pairs, model.moe.token_time_factor() * pairs * etp


def a2a_bytes(model: ModelSpec, eb: float, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike) -> np.ndarray:
    """What each all-to-all of a MoE layer carries from one rank (balanced load): its routed tokens' activations."""
    return routed_load(model, t, cp, mbs, 1)[1] * model.hidden_size * eb


def moe_messages(model: ModelSpec, eb: float, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike, etp: ArrayLike,
                 r: ArrayLike = 1.0) -> dict[tuple[str, str], tuple[object, str]]:
    """Each of :data:`MOE_LAYER_OPS`'s messages from one rank, by (group, what): (bytes in cost_models/comm.py's
    convention, "act" for the activations' dtype or the dtype). ``r`` scales the routed tokens (1: balanced; the
    busiest rank's ``token_time_factor``); a "what" not sent (no aux loss, or whole sequences) has 0 bytes."""
    moe = model.moe
    assert moe is not None
    sent = r * a2a_bytes(model, eb, t, cp, mbs)
    aux = np.where((np.asarray(t) * np.asarray(cp) > 1) & (moe.aux_loss_coef > 0),
                   np.asarray(mbs, dtype=float) * moe.num_experts * ROUTER_STAT_BYTES, 0.0)
    return {("ep", "counts"): (moe.num_experts * COUNT_BYTES, "int64"),
            ("etp", "counts"): (moe.num_experts * COUNT_BYTES * np.asarray(etp, dtype=float), "int64"),
            ("ep", "dispatch"): (sent, "act"), ("ep", "combine"): (sent, "act"),
            ("etp", "dispatch"): (sent * np.asarray(etp, dtype=float), "act"),
            ("etp", "combine"): (sent * np.asarray(etp, dtype=float), "act"),
            ("seq", "aux"): (aux, "float32")}


def moe_bytes(model: ModelSpec, eb: float, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike, etp: ArrayLike
              ) -> tuple[np.ndarray, np.ndarray]:
    """One MoE layer's routed part per micro-batch on the busiest rank: (bytes kept for the backward: the router's
    fp32 probabilities and its choices, the experts' input (gathered over etp), their gate, up and SwiGLU output,
    and their output before the weighted combine; the backward's gradient buffers)."""
    moe = model.moe
    assert moe is not None
    h, E, r = model.hidden_size, moe.num_experts, moe.token_time_factor()
    tokens, pairs, got = routed_load(model, t, cp, mbs, etp)
    width = np.ceil(moe.moe_ffn_hidden_size / np.asarray(etp, dtype=float))
    act = tokens * E * ROUTER_STAT_BYTES + pairs * 8 + got * h * eb + got * width * 3 * eb + r * pairs * h * eb
    return act, 2 * got * (h + width) * eb


@dataclass
class MoECost:
    """One MoE layer's routed part per micro-batch on one GPU (arrays broadcast over configurations)."""

    fwd: np.ndarray  # compute, forward
    bwd: np.ndarray  # compute, backward
    comm_fwd: np.ndarray  # exposed all-to-all (and etp) communication, forward, and the aux loss's all-reduce
    comm_bwd: np.ndarray
    seq_fwd: np.ndarray | float = 0.0  # of comm_fwd, the aux loss's all-reduce over the sequence's tp x cp ranks


def moe_cost(model: ModelSpec, cm: ComputeModel, comm: CommModel, t: ArrayLike, cp: ArrayLike, mbs: ArrayLike,
             ep: ArrayLike, etp: ArrayLike) -> MoECost:
    """The routed part of a MoE layer for tensor parallel ``t`` (with SP), context parallel ``cp``, micro-batch
    ``mbs``, expert parallel ``ep`` and expert-tensor parallel ``etp`` (arrays)."""
    moe = model.moe
    assert moe is not None
    t, cp, mbs, ep, etp = (np.asarray(x, dtype=float) for x in (t, cp, mbs, ep, etp))
    h, E, fe, eb = model.hidden_size, moe.num_experts, moe.moe_ffn_hidden_size, cm.eb
    r = moe.token_time_factor()
    tokens, pairs, got = routed_load(model, t, cp, mbs, etp)
    local = E / ep  # experts per rank
    per_expert = got / local

    router_f, router_b = cm.gemm_fwd_bwd(tokens, E, h)
    scores = tokens * E * ROUTER_STAT_BYTES
    router_f = router_f + cm.memory(scores * 3 + tokens * E * eb, 2)  # softmax/sigmoid, top-k
    router_b = router_b + cm.memory(scores * 3, 2)
    up_f, up_b = cm.gemm_fwd_bwd(per_expert, 2 * np.ceil(fe / etp), h, local)
    down_f, down_b = cm.gemm_fwd_bwd(per_expert, h, np.ceil(fe / etp), local)
    act = got * np.ceil(fe / etp)  # SwiGLU elements
    perm = r * pairs * h * eb  # permute in, unpermute + weighted sum out
    fwd = router_f + up_f + down_f + cm.memory(act * 3 * eb) + cm.memory(2 * perm * 2 + tokens * h * eb, 2)
    bwd = router_b + up_b + down_b + cm.memory(act * 5 * eb) + cm.memory(2 * perm * 2 + tokens * h * eb, 2)

    msgs = moe_messages(model, eb, t, cp, mbs, etp, r)  # from the busiest rank
    by_op = {("all_to_all", "ep"): lambda n: comm.all_to_all(n, ep, etp),
             ("all_gather", "etp"): lambda n: comm.all_gather(n, etp, 1),
             ("all_to_all", "etp"): lambda n: comm.all_to_all(n, etp, 1),
             ("all_reduce", "seq"): lambda n: np.where(n > 0, comm.all_reduce(n, t * cp, 1), 0.0)}
    comm_t = {"fwd": 0.0, "bwd": 0.0}
    seq = 0.0
    for ps, op, group, what in MOE_LAYER_OPS:
        took = by_op[op, group](msgs[group, what][0])
        comm_t[ps] = comm_t[ps] + took
        seq = seq + (took if group == "seq" else 0.0)
    return MoECost(fwd=fwd, bwd=bwd, comm_fwd=comm_t["fwd"], comm_bwd=comm_t["bwd"], seq_fwd=seq)
