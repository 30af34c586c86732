"""Context parallelism: the ``cp`` ranks of a group split every sequence; attention all-gathers K and V.

**Which tokens a rank holds.** The sequence is cut into ``2 cp`` equal chunks and cp rank ``i`` holds chunks
``i`` and ``2 cp - 1 - i``, in that order (the zig-zag split of Megatron and Llama 3), so every rank does the same
share of the causal attention work. :func:`local_positions` gives the global positions of a rank's tokens; the
data (``TokenData.batch(positions=...)``), the positions (RoPE tables, GPT's learned rows) and which keys a
query attends to all follow from it. Everything outside attention is per token and runs on the local ``s / cp`` tokens
unchanged (under sequence parallelism tp splits the local sequence further).

**Attention** (Llama 3's choice, "all-gather based"): K and V of the local tokens are all-gathered over the cp
group (one collective carrying both) into the full sequence in global order, and the local queries attend to
them causally by global position. Each local chunk ``g`` attends in two blocks: the chunks before it
(unmasked) and itself (causal, square), merged with their log-sum-exps — no mask is built and only the causal
half of the work is done. :class:`_AllGatherAttention` is the collective pair: the all-gather of K and V in the
forward, the reduce-scatter of their gradients (dK, dV of the full sequence, summed into each owner's chunks)
in the backward. It keeps only the local Q, K, V, output and log-sum-exp for backward and all-gathers K and V
again there (as Transformer Engine's all-gather CP does), so activation memory is the cost model's (every term
divided by cp) and the traffic is one all-gather in the forward and an all-gather plus a reduce-scatter in the
backward (``cost_models/layer.py``). A selectively recomputed core (``recompute=selective``) keeps only Q, K
and V and recomputes the blocks' forward after that second all-gather: the core's forward again, no extra
collective.

Blocks run on torch's fused flash-attention kernels, which return and take the log-sum-exp: the CPU's
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) on the CPU, CUDA's
(``aten._scaled_dot_product_flash_attention``; bf16/fp16, head dim <= 256) on GPUs and on the meta device of the
memory replay, and otherwise :class:`MathBlocks` (the same blocks in plain torch, scores materialised per block;
the reference the tests compare against).
Attention dropout is not supported under context parallelism (a one-line error).

:func:`apply_context_parallel` swaps a stage's modules: every layer's attention core for
:class:`ContextParallelAttention`, RoPE tables for :class:`ContextParallelRotary`, GPT's learned positions for
:class:`ContextParallelPositions`. The model code stays free of parallel code.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from runtime.models.common import CoreAttention, Rotary, Transformer
from runtime.parallel.mappings import all_gather_into, reduce_scatter_into
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.recompute import is_recomputed
from specs.errors import AutoparError
from specs.rules import cp_split_problem

# ---- which tokens a rank holds ------------------------------------------------------------------------------


def local_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the ``2 cp`` chunks cp rank ``rank`` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Global positions of cp rank ``rank``'s ``seq / cp`` tokens, in local order (int64)."""
    problem = cp_split_problem(seq, cp)
    if problem:
        raise AutoparError(problem)
    c = seq // (2 * cp)
    return torch.cat([torch.arange(g * c, (g + 1) * c, device=device) for g in local_chunks(cp, rank)])


# ---- the collectives: K and V gathered into global order, their gradients scattered back --------------------


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, cp: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local ``[b, s/cp, kv, d]`` K and V -> the full sequence's, ``[b, s, kv, d]`` each, in global order."""
    b, n, heads, d = k.shape
    c = n // 2
    out = k.new_empty((cp, 2, b, n, heads, d))
    all_gather_into(out.view(-1), torch.stack((k, v)).view(-1), group)
    out = out.view(cp, 2, b, 2, c, heads, d)
    # chunk g < cp is rank g's first half; chunk g >= cp is rank 2cp-1-g's second half
    chunks = torch.cat((out[:, :, :, 0], out[:, :, :, 1].flip(0)))  # [2cp, 2, b, c, kv, d] in global order
    full = chunks.permute(1, 2, 0, 3, 4, 5).reshape(2, b, 2 * cp * c, heads, d)
    return full[0], full[1]


def _scatter_kv_grads(dkv: torch.Tensor, group: dist.ProcessGroup, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of the full K and V, ``[2, b, s, kv, d]`` in global order -> the sum over the group of each rank's
    own chunks, ``[b, s/cp, kv, d]`` each (the reverse of :func:`_gather_kv`)."""
    _, b, s, heads, d = dkv.shape
    c = s // (2 * cp)
    chunks = dkv.view(2, b, 2 * cp, c, heads, d).permute(2, 0, 1, 3, 4, 5)  # [2cp, 2, b, c, kv, d]
    send = torch.stack((chunks[:cp], chunks[cp:].flip(0)), dim=3).contiguous()  # [cp, 2, b, 2, c, kv, d]
    out = dkv.new_empty((2, b, 2 * c, heads, d))
    reduce_scatter_into(out.view(-1), send.view(-1), group)
    return out[0], out[1]


# ---- attention blocks -----------------------------------------------------------------------------------------
# One block: queries [b, h, m, d] against keys/values [b, kv, n, d] (kv divides h), unmasked or causal (square).
# forward -> (output [b, h, m, d], fp32 log-sum-exp [b, h, m]); backward takes the *merged* output and log-sum-exp
# of all the query rows' blocks, which is what makes the blocks' gradients those of the whole softmax.


class FlashCPUBlocks:
    """torch's fused flash-attention kernel for the CPU (it returns and takes the log-sum-exp)."""

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, lse

    @staticmethod
    def backward(do, q, k, v, o, lse, causal: bool, scale: float):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, scale=scale)


class FlashCUDABlocks:
    """torch's fused flash-attention kernel for CUDA (bf16 or fp16, head dim at most 256), which also runs on the
    meta device (the memory replay). The kernel takes as many K/V heads as query heads: grouped K and V are
    repeated for it and their gradients summed back over each group."""

    @staticmethod
    def _heads(x: torch.Tensor, g: int) -> torch.Tensor:
        return x.repeat_interleave(g, dim=1) if g > 1 else x

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        g = q.shape[1] // k.shape[1]
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q, FlashCUDABlocks._heads(k, g), FlashCUDABlocks._heads(v, g), 0.0, causal, scale=scale)
        return out[0], out[1]

    @staticmethod
    def backward(do, q, k, v, o, lse, causal: bool, scale: float):
        b, h, m, d = q.shape
        kv, n = k.shape[1], k.shape[2]
        g = h // kv
        unused = torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64,
                                                                                  device=q.device)  # no dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, FlashCUDABlocks._heads(k, g), FlashCUDABlocks._heads(v, g), o, lse, None, None, m, n, 0.0, causal,
            *unused, scale=scale)
        if g > 1:
            dk, dv = dk.view(b, kv, g, n, d).sum(2), dv.view(b, kv, g, n, d).sum(2)
        return dq, dk, dv


def block_kernel(q: torch.Tensor) -> Any:
    """The blocks' kernel for ``q``: the CPU's flash kernel, CUDA's (half precision, head dim <= 256; the meta
    device too), or :class:`MathBlocks`."""
    if q.device.type == "cpu":
        return FlashCPUBlocks
    if q.device.type in ("cuda", "meta") and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return FlashCUDABlocks
    return MathBlocks


class MathBlocks:
    """The same blocks in plain torch (scores materialised, fp32 softmax): any device, and the tests' reference."""

    @staticmethod
    def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
        b, h, m, d = q.shape
        kv = k.shape[1]
        s = (q.float().reshape(b, kv, h // kv, m, d) @ k.float().unsqueeze(2).transpose(-2, -1)) * scale
        if causal:
            s = s.masked_fill(torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return s  # [b, kv, g, m, n]

    @staticmethod
    def forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, m, d = q.shape
        s = MathBlocks._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        o = torch.exp(s - lse.unsqueeze(-1)) @ v.float().unsqueeze(2)
        return o.reshape(b, h, m, d).to(q.dtype), lse.reshape(b, h, m)

    @staticmethod
    def backward(do, q, k, v, o, lse, causal: bool, scale: float):
        b, h, m, d = q.shape
        kv = k.shape[1]
        g = h // kv
        p = torch.exp(MathBlocks._scores(q, k, causal, scale) - lse.reshape(b, kv, g, m, 1))
        do5 = do.float().reshape(b, kv, g, m, d)
        dv = (p.transpose(-2, -1) @ do5).sum(2)
        dp = do5 @ v.float().unsqueeze(2).transpose(-2, -1)
        delta = (do5 * o.float().reshape(b, kv, g, m, d)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = (ds @ k.float().unsqueeze(2)).reshape(b, h, m, d)
        dk = (ds.transpose(-2, -1) @ q.float().reshape(b, kv, g, m, d)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _blocks(chunk: int, c: int) -> list[tuple[int, int, bool]]:
    """Key ranges ``[lo, hi)`` chunk ``chunk``'s queries attend to, and whether the range is causal."""
    return ([(0, chunk * c, False)] if chunk else []) + [(chunk * c, (chunk + 1) * c, True)]


def _merge(o1, l1, o2, l2) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.logaddexp(l1, l2)
    o = o1.float() * torch.exp(l1 - lse).unsqueeze(-1) + o2.float() * torch.exp(l2 - lse).unsqueeze(-1)
    return o.to(o1.dtype), lse


def blocks_forward(impl, q, k, v, chunks: tuple[int, ...], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Local queries ``[b, h, len(chunks) c, d]`` (chunk ``chunks[j]`` at rows ``j c ..``) against the full K, V
    ``[b, kv, s, d]``, causal by global position -> (output ``[b, h, m, d]``, a view of a ``[b, m, h, d]`` tensor;
    fp32 log-sum-exp ``[b, h, m]``)."""
    b, h, m, d = q.shape
    c = m // len(chunks)
    out = q.new_empty((b, m, h, d)).transpose(1, 2)  # laid out [b, m, h, d]: the model's view of it is free
    lses = []
    for j, g in enumerate(chunks):
        qj = q[:, :, j * c:(j + 1) * c]
        o = lse = None
        for lo, hi, causal in _blocks(g, c):
            ob, lb = impl.forward(qj, k[:, :, lo:hi], v[:, :, lo:hi], causal, scale)
            o, lse = (ob, lb) if o is None else _merge(o, lse, ob, lb)
        out[:, :, j * c:(j + 1) * c] = o
        lses.append(lse)
    return out, torch.cat(lses, dim=2)


def blocks_backward(impl, do, q, k, v, o, lse, chunks: tuple[int, ...], scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`blocks_forward`: dq ``[b, h, m, d]``, dk and dv of the full sequence ``[b, kv, s, d]``."""
    c = q.shape[2] // len(chunks)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))  # sums of blocks
    for j, g in enumerate(chunks):
        rows = slice(j * c, (j + 1) * c)
        doj, qj, oj, lj = do[:, :, rows].contiguous(), q[:, :, rows], o[:, :, rows].contiguous(), lse[:, :, rows]
        for lo, hi, causal in _blocks(g, c):
            dqb, dkb, dvb = impl.backward(doj, qj, k[:, :, lo:hi], v[:, :, lo:hi], oj, lj.contiguous(), causal, scale)
            dq[:, :, rows] += dqb
            dk[:, :, lo:hi] += dkb
            dv[:, :, lo:hi] += dvb
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _AllGatherAttention(torch.autograd.Function):
    """Causal attention of the local queries over the whole sequence: all-gather of K and V forward,
    reduce-scatter of dK and dV backward (K and V all-gathered again there). Layouts are the model's:
    q ``[b, s/cp, h, d]``, k/v ``[b, s/cp, kv, d]`` -> ``[b, s/cp, h, d]``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, cp: int,
                chunks: tuple[int, ...], recompute: bool, impl: Any) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        kf, vf = _gather_kv(k, v, group, cp)
        o, lse = blocks_forward(impl, q.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), chunks, scale)
        o = o.transpose(1, 2)  # [b, s/cp, h, d], contiguous: the output and (unless recomputed) kept for backward
        ctx.group, ctx.cp, ctx.chunks, ctx.recompute, ctx.impl, ctx.scale = group, cp, chunks, recompute, impl, scale
        if recompute:
            ctx.save_for_backward(q, k, v)
        else:
            ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, *kept = ctx.saved_tensors
        kf, vf = _gather_kv(k, v, ctx.group, ctx.cp)
        qh, kh, vh = q.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2)
        o, lse = (kept[0].transpose(1, 2), kept[1]) if kept else blocks_forward(ctx.impl, qh, kh, vh, ctx.chunks,
                                                                                  ctx.scale)
        dq, dk, dv = blocks_backward(ctx.impl, do.transpose(1, 2), qh, kh, vh, o, lse, ctx.chunks, ctx.scale)
        dk, dv = _scatter_kv_grads(torch.stack((dk.transpose(1, 2), dv.transpose(1, 2))), ctx.group, ctx.cp)
        return dq.transpose(1, 2), dk, dv, None, None, None, None, None


# ---- the modules parallelize swaps in ------------------------------------------------------------------------


class ContextParallelAttention(nn.Module):
    """The attention core of a cp rank: ``forward(q, k, v)`` as :class:`CoreAttention` (``[b, s/cp, h*d]`` out),
    attending over the whole sequence. ``recompute``: keep only Q, K, V for backward (selective recompute)."""

    def __init__(self, core: CoreAttention, g: ParallelGroups, recompute: bool) -> None:
        super().__init__()
        if core.dropout_p > 0:
            raise AutoparError(f"cp={g.cp}: context-parallel attention has no attention dropout, and the model "
                               f"sets dropout {core.dropout_p}; set dropout: 0 in the model spec or plan with cp=1")
        self.group, self.cp, self.recompute = g.cp_group, g.cp, recompute
        self.chunks = local_chunks(g.cp, g.cp_rank)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, h, d = q.shape
        impl = block_kernel(q)
        o = _AllGatherAttention.apply(q, k, v, self.group, self.cp, self.chunks, self.recompute, impl)
        return o.reshape(b, s, h * d)


class ContextParallelRotary(Rotary):
    """RoPE tables at the global positions of this cp rank's tokens."""

    def __init__(self, rope: Rotary, g: ParallelGroups) -> None:
        super().__init__(rope.head_dim, rope.theta)
        self.cp, self.rank = g.cp, g.cp_rank

    def positions(self, s: int, device: torch.device) -> torch.Tensor:
        return local_positions(s * self.cp, self.cp, self.rank, device)


class ContextParallelPositions(nn.Module):
    """GPT's learned positions: the rows of this cp rank's tokens (under sequence parallelism, of this tp rank's
    share of them). The weight stays whole; its gradient is reduced over dp x cp like any replicated one."""

    def __init__(self, pos: nn.Module, g: ParallelGroups, sp: bool) -> None:
        super().__init__()
        self.weight = pos.weight
        self.cp, self.rank = g.cp, g.cp_rank
        self.tp, self.tp_rank = (g.tp, g.tp_rank) if sp else (1, 0)
        self._rows: dict[tuple, torch.Tensor] = {}

    def forward(self, seq: int) -> torch.Tensor:
        key = (seq, self.weight.device)
        if key not in self._rows:
            rows = local_positions(seq * self.cp, self.cp, self.rank, self.weight.device)
            n = seq // self.tp
            self._rows[key] = rows[self.tp_rank * n:(self.tp_rank + 1) * n]
        return self.weight[self._rows[key]]


def apply_context_parallel(stage: Transformer, g: ParallelGroups, sp: bool) -> None:
    """Swap a stage's attention cores and positions for their context-parallel versions (after tensor parallelism
    and recompute: a selectively recomputed core becomes a context-parallel core that recomputes itself)."""
    if g.cp == 1:
        return
    if dist.get_rank(g.cp_group) != g.cp_rank:
        raise AutoparError("the context-parallel group's ranks are not in mesh order")
    for layer in stage.layers.values():
        attn = layer.attn
        attn.core = ContextParallelAttention(attn.core, g, recompute=is_recomputed(attn.core))
        if attn.rope is not None:
            attn.rope = ContextParallelRotary(attn.rope, g)
    if stage.embed is not None and stage.embed.pos is not None:
        stage.embed.pos = ContextParallelPositions(stage.embed.pos, g, sp)

