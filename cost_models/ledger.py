"""The communication the cost model prices for one plan, rank by rank: the ledger runtime/comm_ledger.py records.

Per pipeline rank (tensor-, context- and data-parallel ranks of one stage do the same) and per step, the calls and
bytes of each (op, group, dtype), read off the same declarations and per-stage terms the pricing uses:
``layer.TP_LAYER_OPS`` / ``CP_LAYER_OPS`` / ``END_OPS`` and their message sizes, the pipeline sends of
``stages.send_time``, the data-parallel collectives of each ZeRO stage as ``zero_ops.DP_OPS`` declares them (priced
per micro-batch by ``stages.zero_traffic``, per step by ``tail.rank_tail``; ``stage_state``'s buckets), the tp-sum of
sequence-parallel gradients (``tail.tp_sum``), a tied embedding's reduce and the step's three scalar reductions
(``tail.step_reductions``); a MoE model's ``moe.MOE_LAYER_OPS`` per MoE layer (at balanced load: the all-to-alls carry
each rank's own routed tokens, the combine's the rows it received, which sum to the same over the ep group) and its
experts' reduce over the expert-data-parallel group. Bytes follow cost_models/comm.py's convention: the all-gather's
output, the reduce-scatter's input, the all-reduce's buffer, the bytes sent. The runtime's padding of buckets to a
multiple of 64 elements (ZeRO: of 64 x the data-parallel size) is not priced (fewer than that per bucket).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np

from cost_models.comm import CommModel
from cost_models.compute import ComputeModel
from cost_models.layer import (
    CP_LAYER_OPS,
    END_OPS,
    SP_REGATHER_OPS,
    TP_LAYER_OPS,
    ce_stat_bytes,
    kv_bytes,
    tp_message_bytes,
)
from cost_models.moe import MOE_LAYER_OPS, moe_messages
from cost_models.params import zero3_regather
from cost_models.stages import layer_terms, stage_state
from cost_models.tail import expert_buckets, owned_share, step_reductions, tied_grad_bytes, tp_sum_buckets
from cost_models.zero_ops import DP_OPS
from specs.cluster import ClusterSpec
from specs.model import ModelSpec
from specs.parallel import Candidates, ParallelConfig, seq_group_name, zero_in_effect
from specs.state import DTYPE_BYTES, TORCH_NAMES, StateSpec

Key = tuple[str, str, str]  # (op, group, dtype)


class _Book:
    def __init__(self) -> None:
        self.calls: dict[Key, float] = defaultdict(float)
        self.nbytes: dict[Key, float] = defaultdict(float)

    def add(self, op: str, group: str, dtype: str, calls: float, each: float) -> None:
        if calls > 0 and each > 0:
            self.calls[op, group, dtype] += calls
            self.nbytes[op, group, dtype] += calls * each

    def as_dict(self) -> dict[Key, tuple[float, float]]:
        return {k: (self.calls[k], self.nbytes[k]) for k in sorted(self.calls)}


def priced_ledger(model: ModelSpec, cluster: ClusterSpec, cfg: ParallelConfig, global_batch: int,
                  state: StateSpec) -> list[dict[Key, tuple[float, float]]]:
    """For each pipeline rank: {(op, group, dtype): (calls, bytes)} of one training step, as priced.

    Groups: ``tp``, ``cp``, ``dp`` (data parallelism over dp x cp), ``pp`` (sends to a neighbouring stage),
    ``embed`` (the first and last stage, for a tied embedding), ``mp`` (tp x pp: one replica), ``world``, and for
    MoE models ``ep`` (expert parallel), ``etp``, ``edp`` (expert data parallel) and ``cptp`` (cp x tp)."""
    act = TORCH_NAMES[cluster.precision]
    eb = DTYPE_BYTES[cluster.precision]
    t, cp, pp = cfg.tp, cfg.cp, cfg.pp
    d, nv, m = cfg.dp * cfg.cp, cfg.num_chunks, cfg.microbatches(global_batch)
    sp, full = cfg.sequence_parallel, cfg.recompute == "full"
    zero = int(zero_in_effect(cfg.zero, d, cfg.edp if model.moe else 1))  # what the runtime runs
    msg = float(tp_message_bytes(model, eb, cfg.mbs, cp))
    kv = float(kv_bytes(model, eb, cfg.mbs, t))
    ce = float(ce_stat_bytes(model, cfg.mbs, cp))
    layers = cfg.stage_layers(model.num_layers)
    redone = [cfg.recomputed_layers(j, n) for j, n in enumerate(layers)]
    c = Candidates.of(replace(cfg, layers=None, recompute_layers=None))  # the split is given below
    lt = layer_terms(model, ComputeModel.of(cluster), CommModel(cluster), c, state)
    held = stage_state(model, state, c, lt, np.array(layers, dtype=float), np.array(redone, dtype=float)).take(0)
    owned = float(owned_share(zero, d, 1))  # ZeRO: the slice of the gradients a rank reduces and updates
    summed_nb = tp_sum_buckets(held.buckets, held.tp_summed, zero, state)
    grads, params = TORCH_NAMES[state.grad_reduce], TORCH_NAMES[state.params]
    out = []
    for r in range(pp):
        book = _Book()

        def tp_op(op: str | None, calls: float, layer: bool = False, *, book: _Book = book) -> None:
            if op is not None and t > 1:  # tp_overlap runs a layer's collectives as t - 1 ring passes of 1/t
                if layer and cfg.tensor_overlap:
                    book.add("send", "tp", act, calls * (t - 1), msg / t)
                else:
                    book.add(op, "tp", act, calls, msg)

        for j in range(r, nv, pp):
            n, k = layers[j], redone[j]
            for ps, with_sp, without, _ in TP_LAYER_OPS:
                tp_op(with_sp if sp else without, (n + (k if full and ps == "fwd" else 0)) * m, layer=True)
            if sp:
                for _, op, _ in SP_REGATHER_OPS:
                    book.add(op, "tp", act, n * m, msg)
            if cp > 1:
                for ps, op in CP_LAYER_OPS:
                    book.add(op, "cp", act, (n + (k if full and ps == "fwd" else 0)) * m, kv)
            ends = (["embed"] if j == 0 else []) + (["head"] if j == nv - 1 else [])
            for end in ends:
                for _, with_sp, without, what in END_OPS[end]:
                    op = with_sp if sp else without
                    if what == "ce" and t > 1:
                        book.add(op, "tp", "float32", m, ce)
                    elif what == "act":
                        tp_op(op, m)
            for sends in (j < nv - 1, j > 0):  # the activation forward, its gradient backward
                if sends:
                    book.add("send", "pp", act, m, msg / t)
                    if t > 1 and not sp:  # the receiver gathers the tensor-parallel slices
                        tp_op("all_gather", m)
            if model.moe is not None:
                _moe_ops(book, model, cfg, eb, act, range(sum(layers[:j]), sum(layers[:j]) + n), k, m)
            nb, p = float(held.buckets[j]), float(held.params[j])
            pe = float(held.expert_params[j])
            if pe > 0:  # the routed experts: a reduce group of their own, over the expert-data-parallel ranks
                nbe = float(expert_buckets(pe, state))
                nb, p = nb - nbe, p - pe
                if cfg.edp > 1:
                    _dp_ops(book, "edp", zero, nbe, pe, state, m)
            if d > 1:
                _dp_ops(book, "dp", zero, nb, p, state, m)
                if zero == 3:
                    book.add("all_gather", "dp", params, m, float(zero3_regather(model, t, nv)) * state.param_bytes)
            if sp and held.tp_summed[j] > 0:
                snb = float(summed_nb[j])
                book.add("all_reduce", "tp", grads, snb, held.tp_summed[j] * state.grad_reduce_bytes / owned / snb)
        if model.tie_embeddings and nv > 1 and r in (0, pp - 1):
            book.add("all_reduce", "embed", grads, 1, float(tied_grad_bytes(model, state, t, zero, d)))
        for group, size, nbytes in step_reductions(t, pp, zero, cfg.world, model.moe is not None):
            if int(size) > 1:
                book.add("all_reduce", str(group), "float32", 1, nbytes)
        out.append(book.as_dict())
    return out


def _dp_ops(book: _Book, group: str, zero: int, nb: float, p: float, state: StateSpec, m: int) -> None:
    """What ZeRO stage ``zero`` communicates over ``group`` for ``nb`` buckets holding ``p`` parameters in a step of
    ``m`` micro-batches (``zero_ops.DP_OPS``)."""
    for o in DP_OPS:
        if zero in o.stages:
            grads = o.what == "grads"
            dtype = TORCH_NAMES[state.grad_reduce if grads else state.params]
            each = p * (state.grad_reduce_bytes if grads else state.param_bytes) / nb
            book.add(o.op, group, dtype, nb * (o.per_microbatch * m or 1), each)


def _moe_ops(book: _Book, model: ModelSpec, cfg: ParallelConfig, eb: float, act: str, layer_ids: range,
             recomputed: int, m: int) -> None:
    """The MoE layers' collectives of one virtual stage holding ``layer_ids``, the first ``recomputed`` of them
    run forward again under full recompute, over ``m`` micro-batches."""
    moe = model.moe
    assert moe is not None
    msgs = moe_messages(model, eb, cfg.tp, cfg.cp, cfg.mbs, cfg.etp)
    sizes = {"ep": cfg.ep, "etp": cfg.etp, "seq": cfg.tp * cfg.cp}
    names = {"seq": seq_group_name(cfg.tp, cfg.cp)}  # the runtime's group for it
    ids = [i for i in layer_ids if moe.is_moe_layer(i)]
    again = sum(1 for i in ids if i - layer_ids.start < recomputed) if cfg.recompute == "full" else 0
    for ps, op, group, what in MOE_LAYER_OPS:
        nbytes, dtype = msgs[group, what]
        if sizes[group] > 1:
            book.add(op, names.get(group, group), act if dtype == "act" else dtype,
                     (len(ids) + (again if ps == "fwd" else 0)) * m, float(nbytes))
