"""Fused linear + cross-entropy that never materialises the full ``[tokens, vocab]`` logits.

Tokens are processed in chunks: ``logits = x_chunk @ weight.T`` (cuBLAS, in the compute dtype), then a
Triton kernel computes each row's log-sum-exp and loss in fp32 and overwrites the logits, in place, with
``d loss / d logits = (softmax - onehot) / n_valid``. The same chunk then yields ``grad_x`` (``grad_logits @
weight``) and adds into ``grad_weight`` (``grad_logits.T @ x``), so the backward is a scale by the
incoming gradient. Peak extra memory is one logits chunk plus ``grad_x`` and ``grad_weight``.

Compute dtype: the autocast dtype when autocast is on for the device, else the promotion of x's and
weight's dtypes. With an fp32 master weight and bf16/fp16 compute, ``grad_weight`` is accumulated over
chunks in fp32: by cuBLAS directly where it can write fp32 outputs (``out_dtype``, checked once per device),
else as one 16-bit product per chunk added into an fp32 buffer. The backward's scale by the incoming
gradient is a Triton kernel that skips all memory traffic when that gradient is 1 (no host sync). In fp16
the ``1/n_valid`` is applied there too rather than to the fp16 logits gradient, where it would underflow.

Vocab-parallel (tensor-parallel) version: each rank holds rows ``[vocab_start, vocab_start + shard)`` of
the weight and the full (replicated) ``x``. Per chunk a stats kernel writes each row's local max, local
sum of exps and local target logit; one ``all_gather`` over the group combines them into the global
log-sum-exp; a second kernel writes the local slice of the logits gradient. The loss is the global mean,
identical on every rank. The weight-shard gradient is exact. The x gradient returned is this rank's
*partial* sum ``grad_logits_shard @ weight_shard``: the caller must sum it over the TP group, which the
usual Megatron mapping does: pass ``copy_to_tensor_parallel_region(x)`` (identity forward, all-reduce
backward), or, with sequence parallelism, the output of the sequence all-gather (whose backward is a
reduce-scatter, which sums too).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from specs.state import LOGITS_CHUNK_ELEMENTS, LOSS_BLOCK_V, fused_loss_rows  # chunk and row block, as priced

from ._utils import LazyKernel, cdiv, next_pow2

tl: Any = None  # triton.language, bound by LazyKernel.build on first launch (triton is imported lazily)

MAX_BLOCK_V = LOSS_BLOCK_V  # widest vocab block one program holds in registers


# ----------------------------------------------------------------------------------------------- kernels
def _row_max_sumexp(ptr, V, BLOCK_V: tl.constexpr):
    """One row of V logits, BLOCK_V at a time (online softmax): (max, sum of exp(x - max)) in fp32."""
    m = float("-inf")
    ssum = 0.0
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        ssum = ssum * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    return m, ssum


def _write_grad_row(ptr, V, t, lse, scale, BLOCK_V: tl.constexpr):
    """Overwrite one row of V logits (in place, BLOCK_V at a time) with (exp(x - lse) - onehot(t)) * scale."""
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse)
        g = tl.where(cols == t, g - 1.0, g) * scale
        tl.store(ptr + cols, g.to(ptr.dtype.element_ty), mask=mask)


def _zero_row(ptr, V, BLOCK_V: tl.constexpr):
    """Zero one row of V logits (the gradient of an ignored target)."""
    for off in range(0, V, BLOCK_V):
        cols = off + tl.arange(0, BLOCK_V)
        tl.store(ptr + cols, tl.zeros([BLOCK_V], dtype=ptr.dtype.element_ty), mask=cols < V)


def _ce_fused(LOGITS, stride, TARGET, LOSS, SCALE, V, ignore_index,
              COMPUTE_GRAD: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row: loss = lse - logit[target]; logits row <- (softmax - onehot) * scale when COMPUTE_GRAD."""
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    t = tl.load(TARGET + row)
    if t == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            _zero_row(ptr, V, BLOCK_V)
        return
    xt = tl.load(ptr + t, mask=(t >= 0) & (t < V), other=0.0).to(tl.float32)
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        e = tl.exp(x - m)
        ssum = tl.sum(e, axis=0)
        tl.store(LOSS + row, m + tl.log(ssum) - xt)
        if COMPUTE_GRAD:
            scale = tl.load(SCALE)
            g = e / ssum
            g = tl.where(cols == t, g - 1.0, g) * scale
            tl.store(ptr + cols, g.to(LOGITS.dtype.element_ty), mask=mask)
    else:
        m, ssum = _row_max_sumexp(ptr, V, BLOCK_V)
        lse = m + tl.log(ssum)
        tl.store(LOSS + row, lse - xt)
        if COMPUTE_GRAD:
            _write_grad_row(ptr, V, t, lse, tl.load(SCALE), BLOCK_V)


def _ce_stats(LOGITS, stride, TARGET, STATS, V, vocab_start, ignore_index,
              ONE_BLOCK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row of a vocab shard: STATS[row] = (local max, local sum exp(x - max), local target logit or 0)."""
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    t = tl.load(TARGET + row) - vocab_start
    here = (t >= 0) & (t < V) & (t + vocab_start != ignore_index)
    xt = tl.load(ptr + t, mask=here, other=0.0).to(tl.float32)
    if ONE_BLOCK:
        cols = tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        ssum = tl.sum(tl.exp(x - m), axis=0)
    else:
        m, ssum = _row_max_sumexp(ptr, V, BLOCK_V)
    tl.store(STATS + row * 3, m)
    tl.store(STATS + row * 3 + 1, ssum)
    tl.store(STATS + row * 3 + 2, xt)


def _ce_grad(LOGITS, stride, TARGET, LSE, SCALE, V, vocab_start, ignore_index, BLOCK_V: tl.constexpr):
    """Per row of a vocab shard: logits row <- (exp(x - lse) - onehot) * scale (zeros for ignored rows)."""
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    t = tl.load(TARGET + row)
    if t == ignore_index:
        _zero_row(ptr, V, BLOCK_V)
        return
    t = t - vocab_start
    lse = tl.load(LSE + row)
    _write_grad_row(ptr, V, t, lse, tl.load(SCALE), BLOCK_V)


def _grad_scale(X, Y, G, N, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """Y = X * G[0]. In place, programs skip all memory traffic when G[0] == 1 (the usual loss.backward())."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(G)
    if IN_PLACE:
        if g != 1.0:
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=mask)
    else:
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + offs, (x * g).to(Y.dtype.element_ty), mask=mask)


ce_fused_kernel = LazyKernel(_ce_fused, helpers=(_row_max_sumexp, _write_grad_row, _zero_row))
ce_stats_kernel = LazyKernel(_ce_stats, helpers=(_row_max_sumexp,))
ce_grad_kernel = LazyKernel(_ce_grad, helpers=(_write_grad_row, _zero_row))
grad_scale_kernel = LazyKernel(_grad_scale)


# ------------------------------------------------------------------------------------------ launchers
def _block_cfg(v: int) -> tuple[int, int, bool]:
    block = min(next_pow2(v), MAX_BLOCK_V)
    warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, warps, block >= v


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for the block, on a device type autocast knows (the meta device of a memory replay it does
    not)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):  # (no autocast on meta)
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, weight.dtype)


def _chunk_tokens(tokens: int, vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is None:  # this module's budget, which benchmarks/kernels.py --tune may change
        return int(fused_loss_rows(tokens, vocab, LOGITS_CHUNK_ELEMENTS))
    return max(1, min(tokens, chunk_tokens))


_FP32_ACC_OK: dict[int, bool] = {}


def fp32_gemm_accumulate_ok(device: torch.device) -> bool:
    """Whether cuBLAS bf16/fp16 GEMMs can write/accumulate fp32 outputs here (``out_dtype``, torch >= 2.8).

    Checked once per device, numerically, since early versions of ``addmm(..., out_dtype, out=)`` misbehaved.
    """
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _FP32_ACC_OK:
        try:
            with torch.autocast("cuda", enabled=False):
                _FP32_ACC_OK[idx] = _probe_fp32_accumulate(device)
        except (TypeError, RuntimeError, NotImplementedError):
            _FP32_ACC_OK[idx] = False
    return _FP32_ACC_OK[idx]


def _probe_fp32_accumulate(device: torch.device) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(96, 64, device=device, generator=g).to(torch.bfloat16)
    b = torch.randn(64, 80, device=device, generator=g).to(torch.bfloat16)
    acc = torch.mm(a, b, out_dtype=torch.float32)
    torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    ref = 2 * (a.float() @ b.float())
    return acc.dtype == torch.float32 and bool(torch.allclose(acc, ref, rtol=1e-3, atol=1e-3))


def _combine_stats(gathered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[world, rows, 3]`` (max, sum exp, target logit) per shard -> (global lse, target logit) per row."""
    m = gathered[..., 0].amax(0)
    ssum = (gathered[..., 1] * torch.exp(gathered[..., 0] - m)).sum(0)
    return m + torch.log(ssum), gathered[..., 2].sum(0)


def _all_gather_stats(stats: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    world = dist.get_world_size(group)
    out = torch.empty((world, *stats.shape), dtype=stats.dtype, device=stats.device)
    dist.all_gather(list(out.unbind(0)), stats, group=group)
    return out


def apply_grad_scale(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t * g`` as ``dtype``: in place (and free when ``g == 1``) if ``t`` already has that dtype."""
    g = g.detach().float().reshape(1).to(t.device)
    n = t.numel()
    block = 4096
    in_place = t.dtype == dtype
    out = t if in_place else torch.empty(t.shape, dtype=dtype, device=t.device)
    if n:
        grad_scale_kernel[(cdiv(n, block),)](t, out, g, n, IN_PLACE=in_place, BLOCK=block, num_warps=8)
    return out


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Mean CE of ``x @ weight.T``; with ``group`` the weight is a vocab shard starting at ``vocab_start``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                group: dist.ProcessGroup | None, vocab_start: int, chunk_tokens: int | None) -> torch.Tensor:
        h = x.shape[-1]
        x2 = x.reshape(-1, h)
        tgt = target.reshape(-1).contiguous()
        n_tok, vocab = x2.shape[0], weight.shape[0]
        if tgt.shape[0] != n_tok:
            raise ValueError(f"target has {tgt.shape[0]} tokens, x has {n_tok}")
        dt = _compute_dtype(x, weight)
        need_gx, need_gw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = need_gx or need_gw
        # fp32 master weight with bf16/fp16 compute: accumulate its gradient in fp32 inside cuBLAS if possible
        fp32_acc = (need_gw and weight.dtype == torch.float32 and dt in (torch.bfloat16, torch.float16)
                    and fp32_gemm_accumulate_ok(x.device))
        xc = x2.to(dt)
        wc = weight.to(dt)
        n_valid = (tgt != ignore_index).sum()
        inv_n = (1.0 / n_valid.float()).reshape(1)
        # fold 1/n_valid into the in-place logits gradient, except in fp16, where (softmax - onehot)/n_valid
        # underflows for large n_valid: there it scales grad_x / grad_weight in the backward instead
        fold = dt != torch.float16
        scale = inv_n if fold else torch.ones(1, device=x.device)
        loss_rows = torch.empty(n_tok, dtype=torch.float32, device=x.device)
        gx = torch.empty((n_tok, h), dtype=dt, device=x.device) if need_gx else None
        gw = None
        chunk = _chunk_tokens(n_tok, vocab, chunk_tokens)
        block, warps, one_block = _block_cfg(vocab)
        buf = torch.empty((min(chunk, n_tok), vocab), dtype=dt, device=x.device)
        with _no_autocast(x.device.type):
            for c0 in range(0, n_tok, chunk):
                c1 = min(n_tok, c0 + chunk)
                xs, ts = xc[c0:c1], tgt[c0:c1]
                logits = buf[: c1 - c0]
                torch.mm(xs, wc.t(), out=logits)
                if group is None:
                    ce_fused_kernel[(c1 - c0,)](
                        logits, logits.stride(0), ts, loss_rows[c0:c1], scale, vocab, ignore_index,
                        COMPUTE_GRAD=grad, ONE_BLOCK=one_block, BLOCK_V=block, num_warps=warps)
                else:
                    stats = torch.empty((c1 - c0, 3), dtype=torch.float32, device=x.device)
                    ce_stats_kernel[(c1 - c0,)](
                        logits, logits.stride(0), ts, stats, vocab, vocab_start, ignore_index,
                        ONE_BLOCK=one_block, BLOCK_V=block, num_warps=warps)
                    lse, xt = _combine_stats(_all_gather_stats(stats, group))
                    loss_rows[c0:c1] = torch.where(ts != ignore_index, lse - xt, 0.0)
                    if grad:
                        ce_grad_kernel[(c1 - c0,)](
                            logits, logits.stride(0), ts, lse, scale, vocab, vocab_start, ignore_index,
                            BLOCK_V=block, num_warps=warps)
                if need_gx:
                    torch.mm(logits, wc, out=gx[c0:c1])
                if need_gw:
                    if fp32_acc:
                        if gw is None:
                            gw = torch.mm(logits.t(), xs, out_dtype=torch.float32)
                        else:
                            torch.addmm(gw, logits.t(), xs, out_dtype=torch.float32, out=gw)
                    elif weight.dtype == torch.float32 and dt != torch.float32:
                        # no fp32-output GEMM here: a 16-bit product per chunk, summed in fp32 (one extra pass)
                        part = torch.mm(logits.t(), xs)
                        gw = part.float() if gw is None else gw.add_(part)
                    elif gw is None:
                        gw = torch.mm(logits.t(), xs)
                    else:
                        gw.addmm_(logits.t(), xs)
        if need_gw and gw is None:  # no tokens
            gw = torch.zeros(weight.shape, dtype=dt, device=x.device)
        ctx.gx, ctx.gw, ctx.pending, ctx.post_scale = gx, gw, grad, None if fold else inv_n
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return loss_rows.sum() / n_valid

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.pending:
            raise RuntimeError("the fused linear cross-entropy computes its gradients in the forward; "
                               "its backward can run only once per forward")
        gx, gw = ctx.gx, ctx.gw
        ctx.gx = ctx.gw = None
        ctx.pending = False
        if ctx.post_scale is not None:
            grad_out = grad_out.float() * ctx.post_scale
        if gx is not None:
            gx = apply_grad_scale(gx, grad_out, ctx.x_dtype).view(ctx.x_shape)
        if gw is not None:
            gw = apply_grad_scale(gw, grad_out, ctx.w_dtype)
        return gx, gw, None, None, None, None, None


# ------------------------------------------------------------------------------------------ references
def linear_cross_entropy_reference(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                   ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``target`` (full logits, fp32 softmax)."""
    logits = (x @ weight.t()).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: for values every rank then uses identically."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def vocab_parallel_linear_cross_entropy_reference(
        x: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor, vocab_start: int,
        group: dist.ProcessGroup, ignore_index: int = -100) -> torch.Tensor:
    """Pure-torch vocab-parallel CE (local logits materialised); same gradient contract as the kernel."""
    logits = (x @ weight_shard.t()).float().reshape(-1, weight_shard.shape[0])
    tgt = target.reshape(-1)
    m = logits.detach().amax(-1)
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = _SumOverGroup.apply(torch.exp(logits - m[:, None]).sum(-1), group)
    local = tgt - vocab_start
    here = (local >= 0) & (local < weight_shard.shape[0]) & (tgt != ignore_index)
    xt = torch.gather(logits, 1, torch.where(here, local, 0)[:, None])[:, 0] * here
    xt = _SumOverGroup.apply(xt, group)
    valid = tgt != ignore_index
    loss = torch.where(valid, m + torch.log(sum_exp) - xt, 0.0)
    return loss.sum() / valid.sum()


# ------------------------------------------------------------------------------------------ entry points
def linear_cross_entropy_triton(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                ignore_index: int = -100, chunk_tokens: int | None = None) -> torch.Tensor:
    return LinearCrossEntropyFunction.apply(x, weight, target, ignore_index, None, 0, chunk_tokens)


def vocab_parallel_linear_cross_entropy_triton(
        x: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor, vocab_start: int,
        group: dist.ProcessGroup, ignore_index: int = -100, chunk_tokens: int | None = None) -> torch.Tensor:
    return LinearCrossEntropyFunction.apply(x, weight_shard, target, ignore_index, group, vocab_start,
                                            chunk_tokens)
