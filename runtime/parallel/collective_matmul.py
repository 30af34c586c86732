"""Tensor-parallel communication overlapped with the GEMMs it feeds (``tp_overlap``; needs sequence parallelism).

Under SP a column-parallel linear all-gathers its sequence-sharded input before the GEMM, and a row-parallel one
reduce-scatters its partial output after. Here each collective is decomposed into tp steps around a ring of the
tensor-parallel ranks, one sequence chunk per step, and every step's GEMM piece runs while the next chunk is
in flight (the "collective matmul" of Wang et al., ASPLOS 2023):

* :func:`gather_matmul` (all-gather, then GEMM): at step i a rank multiplies the chunk it holds (its own first,
  then its neighbours') while passing it on to the next rank.
* :func:`matmul_reduce_scatter` (GEMM, then reduce-scatter): at step i a rank computes its partial product for
  one chunk and adds it to the running sum received from the previous rank, which it passes on; after tp steps
  each rank holds the full sum of its own chunk.

The backward uses the conjugate pair (the gradient of a gathered input is reduce-scattered, the gradient of a
scattered output is gathered), so forward and backward both overlap, as the cost model prices it
(cost_models/layer.py). A column-parallel linear keeps only its input's shard: its backward all-gathers it
again (one collective, beside the input-gradient pieces) for the weight gradient, as Megatron-LM does. The
sends are asynchronous point-to-point operations: on NCCL they run on NCCL's own stream beside the GEMM; on
gloo the same decomposition runs, the GEMM beside the transfer thread. Results equal the non-overlapped
path's (the same GEMM per output row; only the order of the tp-way sum can differ).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime.parallel.mappings import SEQ_DIM, start_gather_seq, weight_grad

# the functions themselves (P2POp accepts only these), even while runtime/comm_ledger.py wraps ``dist.isend``
_ISEND, _IRECV = dist.distributed_c10d.isend, dist.distributed_c10d.irecv


def _ring(group: dist.ProcessGroup) -> tuple[int, int, int, int]:
    """(size, rank, global rank of the next rank, of the previous one) in ``group``'s ring."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def _pass_on(send: torch.Tensor, nxt: int, prv: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to the next rank and receiving a tensor like it from the previous one."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(_ISEND, send, nxt, group), dist.P2POp(_IRECV, recv, prv, group)]
    return recv, dist.batch_isend_irecv(ops)


def gather_matmul(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(all_gather_seq(x), weight)`` and the gathered ``x``, the gather overlapped with the GEMM pieces
    (``x``: ``[b, s/tp, k]``; returns ``[b, s, n]`` and ``[b, s, k]``)."""
    n, r, nxt, prv = _ring(group)
    chunk = x.movedim(SEQ_DIM, 0).contiguous()
    inputs: list[torch.Tensor | None] = [None] * n
    outputs: list[torch.Tensor | None] = [None] * n
    for i in range(n):
        owner = (r - i) % n  # whose chunk this rank holds at step i
        pending = _pass_on(chunk, nxt, prv, group) if i < n - 1 else None
        inputs[owner] = chunk
        outputs[owner] = F.linear(chunk, weight)
        if pending is not None:
            recv, reqs = pending
            for q in reqs:
                q.wait()
            chunk = recv
    full_in = torch.cat(inputs, 0).movedim(0, SEQ_DIM)
    return torch.cat(outputs, 0).movedim(0, SEQ_DIM), full_in


def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``reduce_scatter_seq(F.linear(x, weight))`` with the reduction overlapped with the GEMM pieces (``x``:
    ``[b, s, k]``; returns ``[b, s/tp, n]``)."""
    n, r, nxt, prv = _ring(group)
    full = x.movedim(SEQ_DIM, 0)
    if full.shape[0] % n:
        raise ValueError(f"sequence length {full.shape[0]} is not divisible by the tensor-parallel size {n}")
    size = full.shape[0] // n

    def partial(c: int) -> torch.Tensor:
        return F.linear(full[c * size:(c + 1) * size], weight)

    acc = partial((r - 1) % n)  # step i works on chunk r - i - 1: its sum ends on its own rank, the last step here
    for i in range(1, n):
        recv, reqs = _pass_on(acc.contiguous(), nxt, prv, group)
        mine = partial((r - i - 1) % n)  # overlaps the transfer
        for q in reqs:
            q.wait()
        acc = recv + mine
    return acc.movedim(0, SEQ_DIM)


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                group: dist.ProcessGroup) -> torch.Tensor:
        y, _full = gather_matmul(x, weight, group)
        ctx.save_for_backward(x, weight)  # the shard only: gathered again in the backward, as Megatron-LM does
        ctx.group, ctx.has_bias = group, bias is not None
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        full, done = start_gather_seq(x, ctx.group)
        dx = matmul_reduce_scatter(g, weight.t(), ctx.group)  # beside the gather
        done()
        db = g.flatten(0, -2).sum(0) if ctx.has_bias else None
        return dx, weight_grad(g, full), db, None


class _LinearScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return matmul_reduce_scatter(x, weight, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        dx, g_full = gather_matmul(g, weight.t(), ctx.group)
        return dx, weight_grad(g_full, x), None


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  group: dist.ProcessGroup) -> torch.Tensor:
    """A column-parallel linear on a sequence-sharded input, its all-gather overlapped with the GEMM."""
    return _GatherLinear.apply(x, weight, bias, group)


def linear_scatter(x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A row-parallel linear whose partial output is reduce-scattered to sequence shards, overlapped."""
    return _LinearScatter.apply(x, weight, group)
