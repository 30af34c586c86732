"""What each pipeline rank does after its last backward: the data-parallel gradient reduce, the optimizer step and
ZeRO-1/2's parameter all-gather; and the step-wide reductions (a tied embedding's gradient, the norm).

Written once for the exact model (rank and chunk timings from the schedule replay) and the vectorised one (from
the closed form). All arrays are [N, pp] per rank ([N, pp, vpp] per model chunk).

- Without ``dp_overlap`` the gradient reduce (all-reduce; reduce-scatter for ZeRO-1) runs after the rank's last
  backward. With it, each chunk's gradients are reduced in buckets (``StateSpec.bucket_params`` each) as the
  chunk's last backward produces them, serialised on one communication stream; only what outlasts the
  backward is exposed. ZeRO-2/3 reduce every micro-batch instead (stages.py).
- With sequence parallelism the gradients of parameters every tensor-parallel rank holds whole (norms, row-parallel
  biases) are partial: they are summed over tp after the data-parallel reduce, exposed.
- The step ends with three small all-reduces (:func:`step_reductions`): the gradient norm, the loss, the peak
  memory.
- The optimizer (fused AdamW, memory bound) updates the rank's shard after the reduce, its ``StateSpec.adamw_bytes``
  at the profile's measured optimizer bandwidth (the copy bandwidth where none was measured); the master copy's
  write-back, the gradient's averaging over d, its norm and its clipping pass over the shard, and the gradient
  buffer is zeroed for the next step: plain streaming passes at the copy bandwidth (``StateSpec.master_copy_bytes``
  plus grad_bytes x (3, + 2 when d > 1) per parameter).
- ZeRO-1/2 all-gather the updated parameters after it; with ``dp_overlap`` that hides behind the next step's
  first forwards, all but one bucket (not for a stack that gathers right after its step,
  ``StateSpec.param_gather_after_step``).
- A MoE model's routed experts are replicated over the expert-data-parallel group (``specs.parallel.edp``), not the
  data-parallel one: their gradients are reduced, their optimizer state sharded and their parameters gathered
  there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ArrayLike, ComputeModel
from cost_models.params import per_rank
from cost_models.pipeline import Replay
from cost_models.stages import StageCosts
from cost_models.zero_ops import per_step, runs
from specs.model import ModelSpec
from specs.parallel import Candidates, edp, zero_in_effect
from specs.state import StateSpec, bucket_count


@dataclass
class RankTail:
    dp_exposed: np.ndarray  # [N, pp] exposed gradient reduce
    optimizer: np.ndarray  # [N, pp]
    gather: np.ndarray  # [N, pp] exposed ZeRO-1/2 parameter gather
    finish: np.ndarray  # [N, pp] when each rank is done
    tied: np.ndarray  # [N] the sum of a tied embedding's gradient over the first and last stage
    norm: np.ndarray  # [N] the grad-norm, loss and peak-memory reductions (latency)
    step_time: np.ndarray  # [N] the slowest rank's finish, then the two above


def owned_share(zero: ArrayLike, d: ArrayLike, from_stage: int) -> np.ndarray:
    """How many ranks share a gradient slice a rank reduces: ``d`` from ZeRO stage ``from_stage`` on (over d > 1
    ranks), else 1 (the whole of it)."""
    return np.where((np.asarray(zero) >= from_stage) & (np.asarray(d) > 1), d, 1)


def tied_grad_bytes(model: ModelSpec, state: StateSpec, t: ArrayLike, zero: ArrayLike, d: ArrayLike) -> np.ndarray:
    """Bytes of a split tied embedding's gradient a rank sums with the other end of the pipeline: its vocab
    shard (ZeRO-2/3: the slice it owns)."""
    vocab_shard = np.ceil(model.vocab_size / np.asarray(t, dtype=float)) * model.hidden_size
    return vocab_shard * state.grad_reduce_bytes / owned_share(zero, d, 2)


def tp_sum_buckets(buckets: ArrayLike, summed: ArrayLike, zero: ArrayLike, state: StateSpec) -> np.ndarray:
    """The all-reduces of :func:`tp_sum` per stage: one per bucket (ZeRO-2/3's per-layer buckets all hold
    some), else the summed parameters in buckets of their own."""
    return np.where(np.asarray(zero) >= 2, buckets, bucket_count(np.asarray(summed), state.bucket_params))


def step_reductions(tp: ArrayLike, pp: ArrayLike, zero: ArrayLike, gpus: int,
                    experts: bool = False) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """The step's small fp32 all-reduces as (group, ranks, bytes): the gradient norm's sum of squares (over one
    replica's tp x pp ranks; over every rank when ZeRO shards the gradients or a MoE model's ``experts`` are split
    over ranks of other replicas), the loss, and the peak memory (allocated and reserved)."""
    sharded = (np.asarray(zero) >= 1) | experts
    return [(np.where(sharded, "world", "mp"), np.where(sharded, gpus, np.asarray(tp) * np.asarray(pp)), 4),
            (np.asarray("world"), np.asarray(gpus), 4), (np.asarray("world"), np.asarray(gpus), 8)]


def tp_sum(comm: CommModel, state: StateSpec, costs: StageCosts, pp: int, vpp: int, t: np.ndarray, d: np.ndarray,
           zero: np.ndarray) -> np.ndarray:
    """[N, pp]: after the data-parallel reduce, the all-reduce over tp of the gradients sequence parallelism
    left partial (norms, row-parallel biases, GPT's positions), one per bucket holding them, on the slice a
    rank owns (all of it without ZeRO)."""
    summed = per_rank(costs.tp_summed, pp, vpp)
    owned = owned_share(zero, d, 1)[..., None]
    nb = tp_sum_buckets(per_rank(costs.buckets, pp, vpp), summed, zero[..., None], state)
    time = comm.bucketed(comm.all_reduce, summed * state.grad_reduce_bytes / owned, nb, t[..., None], 1)
    return np.where(summed > 0, time, 0.0).sum(axis=2)


def expert_buckets(experts: ArrayLike, state: StateSpec) -> np.ndarray:
    """Of a chunk's ZeRO-0/1 gradient buckets, the routed experts' (a reduce group of their own; 0 without)."""
    return bucket_count(np.asarray(experts, dtype=float), state.bucket_params)


def _col(x) -> np.ndarray:
    return np.asarray(x, dtype=float)[:, None]


def rank_tail(model: ModelSpec, cm: ComputeModel, comm: CommModel, state: StateSpec, c: Candidates,
              costs: StageCosts, replay: Replay, m: np.ndarray, gpus: int) -> RankTail:
    """The tail of every rank of candidates ``c`` after a pipeline step timed by ``replay``."""
    pp, vpp = int(c.pp[0]), int(c.vpp[0])
    t, d = _col(c.tp), _col(c.dp * c.cp)
    e, e_stride = _col(edp(c.dp, c.cp, c.tp, c.ep, c.etp)), _col(c.ep * c.etp)  # the experts' replicas
    zero, overlap = _col(zero_in_effect(c.zero, c.dp * c.cp, e[:, 0] if model.moe else 1)), c.dp_overlap[:, None]
    chunk_params = per_rank(costs.params, pp, vpp)  # [N, pp, vpp]
    chunk_experts = per_rank(costs.expert_params, pp, vpp)
    rank_params, rank_experts = chunk_params.sum(axis=2), chunk_experts.sum(axis=2)
    rank_dense = rank_params - rank_experts

    # the gradient reduce once per step (ZeRO 0/1, zero_ops.DP_OPS): one bucketed collective per chunk, started by
    # its last backward; the routed experts' gradients over their own replicas after the rest
    nb = np.maximum(1.0, per_rank(costs.buckets, pp, vpp))
    nb_e = expert_buckets(chunk_experts, state)
    t3, d3, e3, es3 = t[..., None], d[..., None], e[..., None], e_stride[..., None]
    reduces = per_step("grads")

    def reduce(grads, buckets, size, stride):
        return sum(np.where(runs(o, zero[..., None]), comm.bucketed(getattr(comm, o.op), grads, buckets, size, stride),
                            0.0) for o in reduces)

    dur = reduce((chunk_params - chunk_experts) * state.grad_reduce_bytes, np.maximum(1.0, nb - nb_e), d3, t3)
    dur = dur + np.where(chunk_experts > 0,
                         reduce(chunk_experts * state.grad_reduce_bytes, np.maximum(1.0, nb_e), e3, es3), 0.0)
    start, end, dur_o, nb_o = replay.last_b_start, replay.last_b_end, dur, nb
    if vpp > 1:  # in the order the chunks' last backwards start
        order = np.argsort(start, axis=2, kind="stable")
        start, end, dur_o, nb_o = (np.take_along_axis(a, order, axis=2) for a in (start, end, dur, nb))
    engine = np.zeros(rank_params.shape)
    for k in range(vpp):
        begin = np.maximum(engine, start[..., k] + (end[..., k] - start[..., k]) / nb_o[..., k])
        engine = np.maximum(begin + dur_o[..., k], end[..., k] + dur_o[..., k] / nb_o[..., k])
    exposed = np.where(overlap, np.maximum(0.0, engine - replay.rank_end), dur.sum(axis=2))
    reduced = np.logical_or.reduce([runs(o, zero) for o in reduces])
    exposed = np.where(((d > 1) | (e > 1)) & reduced, exposed, 0.0)
    exposed = exposed + tp_sum(comm, state, costs, pp, vpp, t, d, zero)

    shard = rank_dense / np.where(zero >= 1, d, 1.0) + rank_experts / np.where(zero >= 1, e, 1.0)
    # the update; over the shard the gradient's averaging over d (read and written, when d > 1), the norm (a read)
    # and the clipping (read and written: the runtime's default grad_clip); the zeroing of the gradient buffer (all
    # of it, or under ZeRO-2/3 the shard)
    zeroed = np.where(zero >= 2, shard, rank_params)
    passes = state.master_copy_bytes + state.grad_bytes * (3 + 2 * (d > 1))
    opt = cm.adamw(shard * state.adamw_bytes, 2) + cm.stream(shard * passes + zeroed * state.grad_bytes, 10)

    # the parameters gathered once per step after the update (ZeRO 1/2, zero_ops.DP_OPS)
    nb_rank = np.maximum(1.0, nb.sum(axis=2))

    def gathered(params, size, stride):
        return sum(np.where(runs(o, zero), comm.bucketed(getattr(comm, o.op), params * state.param_bytes, nb_rank,
                                                         size, stride), 0.0) for o in per_step("params"))

    ag = gathered(rank_dense, d, t) + np.where(rank_experts > 0, gathered(rank_experts, e, e_stride), 0.0)
    first_f = (costs.f[:, :pp]) * np.minimum(_col(m), pp - np.arange(pp)[None, :])  # next step's first forwards
    hidden = overlap & (not state.param_gather_after_step)
    gather = np.where(hidden, np.maximum(ag / nb_rank, ag - first_f), ag)
    gather = np.where((d > 1) | (e > 1), gather, 0.0)

    finish = replay.rank_end + exposed + opt + gather
    tied = np.zeros(len(c))
    if model.tie_embeddings and pp * vpp > 1:
        stride = c.tp * c.cp * c.dp
        tied = comm.all_reduce(tied_grad_bytes(model, state, c.tp, zero[:, 0], c.dp * c.cp), 2, stride * (pp - 1))
    norm = sum(comm.all_reduce(nbytes, size, 1) for _, size, nbytes in step_reductions(c.tp, c.pp, zero[:, 0], gpus,
                                                                                     model.moe is not None))
    norm = np.broadcast_to(norm, (len(c),))
    return RankTail(dp_exposed=exposed, optimizer=opt, gather=gather, finish=finish, tied=tied, norm=norm,
                    step_time=finish.max(axis=1) + tied + norm)
