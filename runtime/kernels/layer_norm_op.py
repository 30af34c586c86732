"""LayerNorm (GPT): Triton kernels, autograd Function, torch reference.

``y = (x - mean) * rstd * weight + bias`` over the last dim, fp32 math, output in ``x.dtype``; ``bias``
may be None. Forward saves ``mean`` and ``rstd`` per row; backward writes ``dx`` per row and accumulates
``dweight``/``dbias`` partial sums in registers per program, summed afterwards in torch (no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

from ._utils import MAX_ROW, LazyKernel, RowKernelConfig, as_rows, cdiv

tl: Any = None  # triton.language, bound by LazyKernel.build on first launch (triton is imported lazily)

CONFIG = RowKernelConfig()


def _ln_fwd(X, Y, W, B, MEAN, RSTD, M, N, sx, sy, eps,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + r64 * sy + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=rmask)
    tl.store(RSTD + rows, rstd, mask=rmask)


def _ln_bwd(DY, X, W, MEAN, RSTD, DX, DW, DB, M, N, sdy, sx, sdx, blocks_per_prog,
            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, blocks_per_prog):
        rows = (pid * blocks_per_prog + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + r64 * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = dy * w[None, :]
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DX + r64 * sdx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=cmask)
    if HAS_BIAS:
        tl.store(DB + pid.to(tl.int64) * N + cols, db, mask=cmask)


ln_fwd_kernel = LazyKernel(_ln_fwd)
ln_bwd_kernel = LazyKernel(_ln_bwd)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
                ) -> torch.Tensor:
        n = x.shape[-1]
        x2 = as_rows(x, n)
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_m, block_n, warps = CONFIG.block(n)
        weight = weight.contiguous()
        ln_fwd_kernel[(cdiv(m, block_m),)](
            x2, y, weight, bias.contiguous() if bias is not None else weight, mean, rstd, m, n,
            x2.stride(0), n, eps, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=warps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = as_rows(dy, n)
        dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        block_m, block_n, warps = CONFIG.block(n, backward=True)
        progs, blocks_per_prog = CONFIG.bwd_grid(m, block_m, x2.device)
        dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)
        db_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device) if ctx.has_bias else dw_part
        ln_bwd_kernel[(progs,)](
            dy2, x2, weight, mean, rstd, dx, dw_part, db_part, m, n, dy2.stride(0), x2.stride(0), n,
            blocks_per_prog, HAS_BIAS=ctx.has_bias, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
        db = db_part.sum(0).to(ctx.bias_dtype) if ctx.has_bias else None
        return dx.view(ctx.x_shape), dw_part.sum(0).to(weight.dtype), db, None


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
                         ) -> torch.Tensor:
    """Pure-torch LayerNorm: fp32 math, output in ``x.dtype``."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    xc = xf - mean
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
                      ) -> torch.Tensor:
    if x.shape[-1] > MAX_ROW or x.numel() == 0:
        return layer_norm_reference(x, weight, bias, eps)
    return LayerNormFunction.apply(x, weight, bias, eps)
