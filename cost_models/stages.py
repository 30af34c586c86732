"""Every per-stage cost term, written once: what one micro-batch costs on each virtual pipeline stage.

``stage_costs`` works on arrays of candidates ([N] per key) and a layer split ([N, stages] or [stages]); the
exact model calls it with one candidate, the vectorised closed form with many, and the ILP derives its
coefficients from it. Per stage it gives, in seconds per micro-batch: forward and backward compute (with the
embedding on the first stage and the head on the last), recompute, exposed tensor/context-parallel
communication, the blocking pipeline sends, and ZeRO-2/3's per-micro-batch traffic; and per GPU the
parameters, the activation bytes stored per micro-batch in flight and the temporary bytes of a backward.

What overlaps with what here: TP collectives are exposed unless ``tp_overlap``; CP ring steps hide behind
attention (both in layer.py). A stage's send to the next one blocks (Megatron's schedules): each
tensor-parallel rank sends 1/t of the boundary activation (with SP it holds only that; without, the
receivers all-gather the slices over the node). ZeRO-2 reduce-scatters gradients every micro-batch (no
full gradient buffer to accumulate into), one bucket per layer; ZeRO-3 also gathers each stage's
parameters for its forward and its backward; with ``dp_overlap`` that traffic hides behind the stage's
compute except one bucket's worth.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from cost_models.arrays import distinct
from cost_models.comm import CommModel
from cost_models.compute import ArrayLike, ComputeModel
from cost_models.layer import end_cost, layer_cost
from cost_models.memory import (
    FULL,
    SELECTIVE,
    RankLoad,
    end_activation_bytes,
    layer_activation_bytes,
    rank_load,
    zero_scatter_bytes,
)
from cost_models.params import (
    end_stages,
    gradient_buckets,
    gradient_groups,
    head_params,
    per_rank,
    stage_params,
    zero3_regather,
)
from cost_models.zero_ops import per_microbatch, runs
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, sp_in_effect, zero_in_effect
from specs.state import StateSpec


@dataclass
class StageState:
    """[N, stages] arrays: what each virtual stage holds on one GPU (all the memory model needs)."""

    params: np.ndarray  # parameters on one GPU
    expert_params: np.ndarray  # of which the routed experts' (reduced over the expert-data-parallel group)
    buckets: np.ndarray  # data-parallel gradient buckets (ZeRO 0/1: by reduce group; ZeRO-2/3: per layer)
    tp_summed: np.ndarray  # parameters whose gradients are also summed over tp (sequence parallelism)
    largest_bucket: np.ndarray  # parameters of the largest per-layer bucket (what ZeRO-3 gathers at once)
    act_bytes: np.ndarray  # activations stored per micro-batch in flight
    work_bytes: np.ndarray  # temporary bytes while the stage runs a backward

    def take(self, idx: np.ndarray):
        return type(self)(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def rank_load(self, pp: int, vpp: int, m: np.ndarray) -> RankLoad:
        """What each pipeline rank holds ([N, pp]) with ``m`` micro-batches per step ([N]): :func:`memory.rank_load`
        of these stages."""
        return rank_load(pp, vpp, m, self.params, self.act_bytes, self.work_bytes, self.largest_bucket,
                         self.expert_params)


@dataclass
class StageCosts(StageState):
    """[N, stages] arrays: the state above and seconds per micro-batch, forward and backward kept apart."""

    fwd: np.ndarray  # forward compute
    bwd: np.ndarray  # backward compute
    recompute: np.ndarray  # forwards repeated in the backward (full layers, or the attention core)
    comm_f: np.ndarray  # exposed tensor/context-parallel communication in the forward
    comm_b: np.ndarray  # ... in the backward
    send_f: np.ndarray  # the blocking send of the activation to the next stage
    send_b: np.ndarray  # the blocking send of the input gradient to the previous stage
    zero_f: np.ndarray  # exposed ZeRO-3 parameter gather before the forward
    zero_b: np.ndarray  # exposed ZeRO-2/3 gradient reduce-scatter (+ ZeRO-3 gather) around the backward
    ep_comm: np.ndarray  # of comm_f + comm_b, the MoE layers' all-to-all (and etp) communication

    @property
    def f(self) -> np.ndarray:
        """Forward of one micro-batch, send included."""
        return self.fwd + self.comm_f + self.send_f + self.zero_f

    @property
    def b(self) -> np.ndarray:
        """Backward of one micro-batch, recompute and send included."""
        return self.bwd + self.recompute + self.comm_b + self.send_b + self.zero_b


def stage_split(cfg: ParallelConfig, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """([stages], [stages]): the layers of each virtual stage of ``cfg`` and how many of them full recompute
    recomputes (``ParallelConfig.stage_layers`` / ``recomputed_layers``), as the cost model takes them."""
    layers = np.array(cfg.stage_layers(num_layers), dtype=float)
    recomputed = np.array([cfg.recomputed_layers(j, int(n)) for j, n in enumerate(layers)], dtype=float)
    return layers, recomputed


def crosses_node(stride: ArrayLike, boundary: ArrayLike, pp: ArrayLike, gpus_per_node: int) -> np.ndarray:
    """Whether the send across virtual-stage boundary ``boundary`` -> ``boundary + 1`` leaves the node: pipeline
    rank r owns global ranks from r * ``stride`` on (rank order (pp, dp, cp, tp)), so the send goes from rank
    ``boundary % pp`` to rank ``(boundary + 1) % pp``."""
    a, b = np.mod(boundary, pp), np.mod(np.asarray(boundary) + 1, pp)
    return (a * stride) // gpus_per_node != (b * stride) // gpus_per_node


def send_time(comm: CommModel, act_bytes: ArrayLike, t: ArrayLike, sp: ArrayLike, crosses: ArrayLike) -> np.ndarray:
    """One blocking stage-boundary send of a ``act_bytes`` activation: every tensor-parallel rank sends 1/t of
    it (over the NIC when it leaves the node); without SP the receivers all-gather the slices."""
    gather = np.where(sp_in_effect(sp, t), 0.0, comm.all_gather(act_bytes, t, 1))
    return comm.p2p(np.asarray(act_bytes) / t, crosses) + gather


def zero_traffic(comm: CommModel, state: StateSpec, params: ArrayLike, nb: ArrayLike, fwd: ArrayLike, bwd: ArrayLike,
                 zero: ArrayLike, d: ArrayLike, t: ArrayLike, overlap: ArrayLike, regather: ArrayLike = 0.0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Exposed (forward, backward) ZeRO time per micro-batch of a stage holding ``params`` parameters in ``nb``
    buckets (one per layer): the collectives ``zero_ops.DP_OPS`` runs every micro-batch (ZeRO-2's gradient
    reduce-scatter, ZeRO-3's too and its parameter gathers before the forward and the backward), and under ZeRO-3
    ``regather`` parameters once more in the forward (``params.zero3_regather``). Overlapped, only what outlasts the
    compute beside it (and at least one bucket) is exposed."""
    stage = zero_in_effect(zero, d)
    nb = np.maximum(1.0, nb)
    nbytes = {"grads": params * state.grad_reduce_bytes, "params": params * state.param_bytes}
    f_comm = b_comm = again = 0.0
    for o in (*per_microbatch("grads"), *per_microbatch("params")):
        each = np.where(runs(o, stage), comm.bucketed(getattr(comm, o.op), nbytes[o.what], nb, d, t), 0.0)
        f_comm = f_comm + (each if o.in_forward else 0.0)
        b_comm = b_comm + each * (o.per_microbatch - o.in_forward)
        if o.in_forward:
            again = again + np.where(runs(o, stage) & (np.asarray(regather) > 0),
                                     comm.all_gather(np.asarray(regather) * state.param_bytes, d, t), 0.0)
    f = np.where(overlap, np.maximum(f_comm / nb, f_comm + again - fwd), f_comm + again)
    b = np.where(overlap, np.maximum(b_comm / nb, b_comm - bwd), b_comm)
    return f, b


def _col(x) -> np.ndarray:
    return np.asarray(x, dtype=float)[:, None]


@dataclass
class LayerTerms:
    """Per candidate ([N] arrays): one layer's and the ends' times and activation bytes per micro-batch."""

    fwd: np.ndarray
    bwd: np.ndarray
    core_fwd: np.ndarray  # the attention core's forward (what selective recompute repeats)
    comm_f: np.ndarray
    comm_b: np.ndarray
    ep_comm: np.ndarray  # of comm_f + comm_b, the MoE all-to-alls
    embed_f: np.ndarray
    embed_b: np.ndarray
    head_f: np.ndarray
    head_b: np.ndarray
    act_full: np.ndarray  # a layer's activations kept for backward
    act_ckpt: np.ndarray  # ... when it is fully recomputed (its input only)
    act_work: np.ndarray  # temporary bytes of a layer's backward
    act_embed: np.ndarray
    act_head: np.ndarray
    act_embed_work: np.ndarray  # temporary bytes of the embedding's backward
    byte_s: np.ndarray  # seconds per byte of an unfused memory-bound op (the gradient accumulation's adds)

    def take(self, idx: np.ndarray) -> LayerTerms:
        return LayerTerms(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})


def layer_terms(model: ModelSpec, cm: ComputeModel, comm: CommModel, c: Candidates, state: StateSpec) -> LayerTerms:
    """The layer-level terms of every candidate, evaluated once per distinct (tp, cp, mbs, sp, tp_overlap,
    recompute) and scattered back (the search prices hundreds of thousands of candidates)."""
    sp = sp_in_effect(c.sp, c.tp).astype(np.int64)
    keys = np.stack([c.tp, c.cp, c.mbs, sp, c.tp_overlap.astype(np.int64), c.recompute, c.ep, c.etp],
                    axis=1).astype(np.int64)
    first, inv = distinct(*keys.T)
    uniq = keys[first]
    t, cp, b, s, o, rc, ep, etp = (uniq[:, i] for i in range(8))
    t, cp, b, ep, etp = t.astype(float), cp.astype(float), b.astype(float), ep.astype(float), etp.astype(float)
    s, o = s.astype(bool), o.astype(bool)
    lc = layer_cost(model, cm, comm, t, cp, b, s, o, ep, etp, pieces=dict(state.overlap_pieces),
                    sm_margin=dict(state.sm_margin))
    # the runtime's loss on CPUs (gloo) is its reference, over the whole logits; the fused kernel runs on GPUs
    reference = comm.c.backend == "gloo" and not state.full_logits
    whole = state.full_logits or reference
    ec = end_cost(model, cm, comm, t, cp, b, s, whole, state.loss_fusion)
    full, ckpt, work = layer_activation_bytes(model, cm.eb, t, cp, b, s, rc, etp)
    emb, head, emb_work = end_activation_bytes(model, cm.eb, t, cp, b, s, state, whole, reference)
    parts = dict(fwd=lc.fwd, bwd=lc.bwd, core_fwd=lc.core_fwd, comm_f=lc.comm_fwd, comm_b=lc.comm_bwd,
                 ep_comm=lc.ep_comm,
                 embed_f=ec.embed_f, embed_b=ec.embed_b, head_f=ec.head_f, head_b=ec.head_b, act_full=full,
                 act_ckpt=ckpt, act_work=work, act_embed=emb, act_head=head, act_embed_work=emb_work,
                 byte_s=1.0 / cm.ew_bw)
    return LayerTerms(**{k: np.broadcast_to(np.asarray(v, dtype=float), (len(uniq),))[inv] for k, v in parts.items()})


def _split(c: Candidates, layers, recomputed) -> tuple[np.ndarray, np.ndarray]:
    layers = np.broadcast_to(np.asarray(layers, dtype=float), (len(c), np.shape(layers)[-1]))
    return layers, np.broadcast_to(np.asarray(recomputed, dtype=float), layers.shape)


def _compute(c: Candidates, lt: LayerTerms, layers: np.ndarray, recomputed: np.ndarray, first: np.ndarray,
             last: np.ndarray) -> tuple[np.ndarray, ...]:
    """(forward, backward, recompute, TP/CP communication forward and backward) of stages holding ``layers``
    (``recomputed`` of them fully recomputed; ``first``/``last``: holding the embedding/head). Linear in all four,
    so summed stages give their sum."""
    rc = _col(c.recompute)
    fwd = layers * _col(lt.fwd) + first * _col(lt.embed_f) + last * _col(lt.head_f)
    bwd = layers * _col(lt.bwd) + first * _col(lt.embed_b) + last * _col(lt.head_b)
    recompute = np.where(rc == FULL, recomputed * _col(lt.fwd + lt.comm_f),
                         np.where(rc == SELECTIVE, layers * _col(lt.core_fwd), 0.0))
    return fwd, bwd, recompute, layers * _col(lt.comm_f), layers * _col(lt.comm_b)


def _scatters(c: Candidates) -> np.ndarray:
    """[N, 1]: ZeRO-2/3 over more than one data-parallel rank (gradients reduce-scattered every micro-batch)."""
    return _col(zero_in_effect(c.zero, c.dp * c.cp)) >= 2


def accumulate_time(state: StateSpec, c: Candidates, lt: LayerTerms, params: ArrayLike) -> np.ndarray:
    """Seconds of one micro-batch's gradient accumulation over ``params`` ([N, stages]) in the runtime's own pass
    or in the GEMMs' epilogue (``StateSpec.accumulate_bytes``, at the profile's memory bandwidth: the epilogue's extra
    traffic is not hidden behind the GEMM's math); under ZeRO-2/3 the runtime packs the backward's gradients into
    a zeroed bucket for the reduce-scatter, as many bytes, and then adds its owned slice into the shard:
    3 x grad_bytes / d)."""
    d = _col(c.dp * c.cp)
    shard_add = np.where(_scatters(c) & (not state.fused_accumulation), 3.0 * state.grad_bytes / d, 0.0)
    return np.asarray(params, dtype=float) * (state.accumulate_bytes + shard_add) * _col(lt.byte_s)


def rank_work(model: ModelSpec, comm: CommModel, state: StateSpec, c: Candidates, lt: LayerTerms, layers: np.ndarray,
              recomputed: np.ndarray, pp: int) -> np.ndarray:
    """[N, pp]: a lower bound of each pipeline rank's forward + backward time per micro-batch over its chunks, for
    ``layers``/``recomputed`` per virtual stage as in :func:`stage_costs`: its compute, exposed TP/CP
    communication and ZeRO-2/3 traffic, sends left out. Compute, parameters and communication add up over
    chunks (collectives are affine in bytes, a latency per bucket), and exposed ZeRO traffic summed over chunks
    is at least that of the sum (what outlasts the chunks' compute, at least the mean bucket). Each rank's
    parameters are those of one stage holding all its layers: the embedding on rank 0, the head on the last
    (the rank's stages summed; a tied head owns its copy exactly when pp > 1, as interleaving needs pp > 1)."""
    nv = np.shape(layers)[-1]

    def by_rank(x) -> np.ndarray:  # summed over each rank's chunks
        return per_rank(x, pp, nv // pp).sum(axis=-1)

    first, last = end_stages(nv)
    fwd, bwd, recompute, comm_f, comm_b = _compute(c, lt, *_split(c, by_rank(layers), by_rank(recomputed)),
                                                   by_rank(first), by_rank(last))
    tied = (first + last) if model.tie_embeddings and nv > 1 else 0.0  # as stage_state's per-layer buckets
    buckets = by_rank(np.maximum(1.0, np.asarray(layers, dtype=float)) + tied)
    rank_params = by_rank(stage_params(model, c.tp, layers, c.ep, c.etp))
    bwd = bwd + accumulate_time(state, c, lt, rank_params)
    zero_f, zero_b = zero_traffic(comm, state, rank_params, buckets, fwd, bwd + recompute, _col(c.zero),
                                  _col(c.dp * c.cp), _col(c.tp), c.dp_overlap[:, None])
    return fwd + bwd + recompute + comm_f + comm_b + zero_f + zero_b


def stage_state(model: ModelSpec, state: StateSpec, c: Candidates, lt: LayerTerms, layers: np.ndarray,
                recomputed: np.ndarray) -> StageState:
    """What each virtual stage of the candidates ``c`` holds on one GPU, split into ``layers`` per virtual stage
    ([N, stages] or [stages]) with ``recomputed`` of them fully recomputed (same shape)."""
    layers, recomputed = _split(c, layers, recomputed)
    t = c.tp.astype(float)
    first, last = end_stages(layers.shape[1])
    rc = _col(c.recompute)
    plain, summed, tied, experts = gradient_groups(model, t, sp_in_effect(c.sp, c.tp), layers, c.ep, c.etp)
    params = plain + summed + tied + experts
    per_layer = _scatters(c)  # ZeRO-2/3: a bucket per layer (ends in the first
    # and last; a split tied embedding reduced on its own besides)
    buckets = np.where(per_layer, np.maximum(1.0, layers) + (tied > 0),
                       gradient_buckets((plain, summed, tied, experts), state.bucket_params))
    largest = params - np.maximum(layers - 1, 0.0) * model.layer_params_on(_col(t), _col(c.ep), _col(c.etp))
    act_bytes = (layers - recomputed) * _col(lt.act_full) + recomputed * _col(lt.act_ckpt) + first * _col(lt.act_embed)
    # a backward's temporaries; under full recompute they hold a rematerialised layer only where one is recomputed
    work = _col(lt.act_work) - np.where((rc == FULL) & (recomputed == 0), _col(lt.act_full), 0.0)
    # beside a layer's backward (not the head's, the first), ZeRO-2/3 with overlap keep one reduce-scatter in flight
    scatter = zero_scatter_bytes(largest, _col(zero_in_effect(c.zero, c.dp * c.cp)), state, _col(c.dp_overlap))
    # the head's: under ZeRO-2/3 its bucket's reduce-scatter buffer is filled while its weight gradient is alive
    head_scatter = np.where(_scatters(c), head_params(model, _col(t), layers.shape[1]) * state.grad_reduce_bytes, 0.0)
    work_bytes = np.maximum.reduce([np.where(layers > 0, work + scatter, 0.0),
                                    last * (_col(lt.act_head) + head_scatter), first * _col(lt.act_embed_work)])
    return StageState(params=params, expert_params=experts, buckets=buckets,
                      tp_summed=summed, largest_bucket=largest, act_bytes=act_bytes, work_bytes=work_bytes)


def stage_costs(model: ModelSpec, comm: CommModel, state: StateSpec, c: Candidates, lt: LayerTerms,
                layers: np.ndarray, recomputed: np.ndarray, act_elem_bytes: int,
                held: StageState | None = None) -> StageCosts:
    """Per-stage costs of the candidates ``c`` (with their layer terms ``lt``) split into ``layers`` per virtual
    stage ([N, stages] or [stages]), ``recomputed`` of them fully recomputed (same shape); pipeline sends
    carry activations of ``act_elem_bytes`` per element. ``held``: their :func:`stage_state`, when known."""
    held = held or stage_state(model, state, c, lt, layers, recomputed)
    layers, recomputed = _split(c, layers, recomputed)
    n, nv = layers.shape
    t = c.tp.astype(float)
    sp = sp_in_effect(c.sp, c.tp)
    fwd, bwd, recompute, comm_f, comm_b = _compute(c, lt, layers, recomputed, *end_stages(nv))
    bwd = bwd + accumulate_time(state, c, lt, held.params)

    act = _col(c.mbs * model.seq_length / c.cp * model.hidden_size * act_elem_bytes)
    stride = (c.tp * c.cp * c.dp)[:, None]
    boundary = np.arange(nv - 1)[None, :]
    hop = send_time(comm, act, _col(t), sp[:, None], crosses_node(stride, boundary, c.pp[:, None], comm.g))
    send_f = np.concatenate([hop, np.zeros((n, 1))], axis=1)
    send_b = np.concatenate([np.zeros((n, 1)), hop], axis=1)

    zero_f, zero_b = zero_traffic(comm, state, held.params, held.buckets, fwd, bwd + recompute, _col(c.zero),
                                  _col(c.dp * c.cp), _col(t), c.dp_overlap[:, None], _col(zero3_regather(model, t, nv)))
    return StageCosts(**{f.name: getattr(held, f.name) for f in fields(StageState)}, fwd=fwd, bwd=bwd,
                      recompute=recompute, comm_f=comm_f, comm_b=comm_b, send_f=send_f, send_b=send_b, zero_f=zero_f,
                      zero_b=zero_b, ep_comm=layers * _col(lt.ep_comm))
