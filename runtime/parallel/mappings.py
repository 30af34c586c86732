"""Tensor- and sequence-parallel collectives, one autograd Function per forward/backward pair.

==========================  =========================  ===========================
function                    forward                    backward
==========================  =========================  ===========================
``copy_to_tp``              identity                   all-reduce
``reduce_from_tp``          all-reduce                 identity
``gather_from_sp``          all-gather along seq       reduce-scatter along seq
``reduce_scatter_to_sp``    reduce-scatter along seq   all-gather along seq
``sp_column_linear``        all-gather along seq,      all-gather again (beside
                            linear                     dgrad), reduce-scatter
``all_to_all``              all-to-all (uneven rows)   all-to-all back
==========================  =========================  ===========================

Activations are ``[batch, seq, hidden]``; sequence parallelism shards dim 1. The reductions work in place
on tensors the caller hands over (a matmul output, a fresh gradient), as Megatron does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ_DIM = 1

# torch 2.12 renamed the tensor collectives; keep working on older releases. Looked up at each call, so that
# runtime/comm_ledger.py sees them.
ALL_GATHER_SINGLE = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_SINGLE = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False):
    """``out`` = every member's ``inp`` in order; ``group`` a process group or a data-parallel
    :class:`~runtime.parallel.hierarchy.Hierarchy` (in its slice order)."""
    if not isinstance(group, dist.ProcessGroup):
        return _waited(group.all_gather_into(out, inp), async_op)
    return getattr(dist, ALL_GATHER_SINGLE)(out, inp, group=group, async_op=async_op)


def all_to_all_rows(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup
                    ) -> torch.Tensor:
    """Send ``in_rows[j]`` consecutive rows of ``x`` to rank ``j`` of ``group`` and receive ``out_rows[j]`` from
    it (no autograd)."""
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=group)
    return out


def _waited(work: Any, async_op: bool) -> Any:
    """``work`` (a hierarchy's chain), waited for unless the caller asked for it asynchronously."""
    if not async_op:
        work.wait()
        return None
    return work


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool = False):
    """``out`` = this member's slice of ``inp`` summed over ``group`` (a process group or a
    :class:`~runtime.parallel.hierarchy.Hierarchy`)."""
    if not isinstance(group, dist.ProcessGroup):
        return _waited(group.reduce_scatter_into(out, inp), async_op)
    return getattr(dist, REDUCE_SCATTER_SINGLE)(out, inp, group=group, async_op=async_op)


def sum_into(t: torch.Tensor, group: Any, async_op: bool = False):
    """``t`` summed over ``group`` in place (a process group or a :class:`~runtime.parallel.hierarchy.Hierarchy`)."""
    if not isinstance(group, dist.ProcessGroup):
        return _waited(group.all_reduce(t), async_op)
    return dist.all_reduce(t, group=group, async_op=async_op)


def member(group: Any) -> int:
    """This rank's index in ``group`` (a :class:`~runtime.parallel.hierarchy.Hierarchy`: the slice it owns)."""
    return dist.get_rank(group) if isinstance(group, dist.ProcessGroup) else group.rank


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` summed over ``group`` (in place on a contiguous ``x``; as it is on a one-rank group), no autograd."""
    if dist.get_world_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    full, done = start_gather_seq(x, group)
    done()
    return full


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return x
    full = x.movedim(SEQ_DIM, 0).contiguous()
    if full.shape[0] % n:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the tensor-parallel size {n}")
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    reduce_scatter_into(out, full, group)
    return out.movedim(0, SEQ_DIM)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce_sum(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_seq(g, ctx.group), None


class _SPColumnLinear(torch.autograd.Function):
    """A column-parallel linear on a sequence-sharded input that keeps only the shard for its backward (as
    Megatron-LM does): the backward all-gathers it again, beside the input-gradient GEMM, for the weight gradient
    (cost_models/layer.py ``SP_REGATHER_OPS``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_gather_seq(x, group), weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        full, done = start_gather_seq(x, ctx.group)
        dx = _reduce_scatter_seq(g.matmul(weight), ctx.group)  # beside the gather
        done()
        db = g.flatten(0, -2).sum(0) if ctx.has_bias else None
        return dx, weight_grad(g, full), db, None


def weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of a linear's weight from its output gradient ``g`` and its input ``x`` (``[..., n]``,
    ``[..., k]``)."""
    return g.flatten(0, -2).t().matmul(x.flatten(0, -2))


def start_gather_seq(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, Callable[[], None]]:
    """Start all-gathering the sequence shards ``x``: (the full tensor, to read once the returned function has
    waited for the gather)."""
    n = dist.get_world_size(group)
    if n == 1:
        return x, lambda: None
    local = x.movedim(SEQ_DIM, 0).contiguous()
    out = local.new_empty((n * local.shape[0], *local.shape[1:]))
    work = all_gather_into(out, local, group, async_op=True)
    return out.movedim(0, SEQ_DIM), work.wait


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _gather_seq(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.rows, ctx.group = (out_rows, in_rows), group
        return all_to_all_rows(x, out_rows, in_rows, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        out_rows, in_rows = ctx.rows
        return all_to_all_rows(g, in_rows, out_rows, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """:func:`all_to_all_rows` with autograd: the gradient goes back the way the rows came."""
    return _AllToAll.apply(x, out_rows, in_rows, group)


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input: gradients are summed over the group."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Leave a tensor-parallel region: sum the partial results of the group."""
    return _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sequence-sharded ``[b, s/tp, h]`` -> full ``[b, s, h]`` (entering a tensor-parallel region under SP)."""
    return _GatherFromSP.apply(x, group)


def sp_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     group: dist.ProcessGroup) -> torch.Tensor:
    """``F.linear(gather_from_sp(x), weight, bias)`` keeping only the shard ``x`` for the backward."""
    return _SPColumnLinear.apply(x, weight, bias, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Partial sums ``[b, s, h]`` -> summed sequence shard ``[b, s/tp, h]`` (leaving a TP region under SP)."""
    return _ReduceScatterToSP.apply(x, group)
