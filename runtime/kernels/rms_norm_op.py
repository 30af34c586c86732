"""RMSNorm and fused residual-add + RMSNorm: Triton kernels, autograd Functions, torch references.

``y = x * rsqrt(mean(x^2) + eps) * weight`` over the last dim, fp32 math, output in the input dtype.
Forward saves only ``rstd`` per row. Backward writes ``dx`` row by row and accumulates ``dweight`` in
registers per program (a fixed number of programs, ~SM count), then sums the partials in torch (no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

from ._utils import MAX_ROW, LazyKernel, RowKernelConfig, as_rows, cdiv

tl: Any = None  # triton.language, bound by LazyKernel.build on first launch (triton is imported lazily)

CONFIG = RowKernelConfig()


# ----------------------------------------------------------------------------------------------- kernels
def _rms_fwd(X, R, S, Y, W, RSTD, M, N, sx, sr, ss, sy, eps,
             HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols < N)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * sx + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        res = tl.load(R + r64 * sr + cols[None, :], mask=mask, other=0.0)
        s = (x.to(tl.float32) + res.to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + r64 * ss + cols[None, :], s, mask=mask)
        xf = s.to(tl.float32)  # normalise the rounded sum, as the reference does
    else:
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / N + eps)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = xf * rstd[:, None] * w[None, :]
    tl.store(Y + r64 * sy + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rmask)


def _rms_bwd(DY, X, W, RSTD, DRES, DX, DW, M, N, sdy, sx, sdr, sdx, blocks_per_prog,
             HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, blocks_per_prog):
        rows = (pid * blocks_per_prog + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + r64 * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(xhat * wdy, axis=1) / N
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += tl.load(DRES + r64 * sdr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + r64 * sdx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(DW + pid.to(tl.int64) * N + cols, dw, mask=cmask)


rms_fwd_kernel = LazyKernel(_rms_fwd)
rms_bwd_kernel = LazyKernel(_rms_bwd)


# ------------------------------------------------------------------------------------------ launchers
def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Returns (y, s, rstd, x2) as 2-D row tensors; ``s = x + residual`` (None without a residual), ``x2``
    the row view (or copy) of x the kernel read."""
    n = x.shape[-1]
    x2 = as_rows(x, n)
    m = x2.shape[0]
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2 = as_rows(residual, n)
        s = torch.empty((m, n), dtype=out_dtype, device=x.device)
    else:
        r2, s = x2, None
    block_m, block_n, warps = CONFIG.block(n)
    if m > 0:
        rms_fwd_kernel[(cdiv(m, block_m),)](
            x2, r2, s if s is not None else y, y, weight.contiguous(), rstd, m, n,
            x2.stride(0), r2.stride(0), n, n, eps,
            HAS_RES=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    return y, s, rstd, x2


def rms_norm_bwd(dy: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 dres: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx [rows, n] in x's dtype (+ dres), dweight in weight's dtype)."""
    m, n = x2.shape
    dy2 = as_rows(dy, n)
    dres2 = as_rows(dres, n) if dres is not None else dy2
    dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    block_m, block_n, warps = CONFIG.block(n, backward=True)
    progs, blocks_per_prog = CONFIG.bwd_grid(m, block_m, x2.device)
    dw_part = torch.empty((progs, n), dtype=torch.float32, device=x2.device)
    if m > 0:
        rms_bwd_kernel[(progs,)](
            dy2, x2, weight.contiguous(), rstd, dres2, dx, dw_part, m, n,
            dy2.stride(0), x2.stride(0), dres2.stride(0), n, blocks_per_prog,
            HAS_DRES=dres is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)
    else:
        dw_part.zero_()
    return dx, dw_part.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------------- autograd Functions
class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, _, rstd, x2 = rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd(dy, x2, weight, rstd)
        return dx.view(ctx.x_shape), dw, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        y, s, rstd, _ = rms_norm_fwd(x, weight, eps, residual=residual)
        ctx.save_for_backward(s, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        shape = torch.broadcast_shapes(x.shape, residual.shape)
        ctx.shape = shape
        return y.view(shape), s.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor, ds: torch.Tensor):
        s, weight, rstd = ctx.saved_tensors
        dsum, dw = rms_norm_bwd(dy, s, weight, rstd, dres=ds)
        dsum = dsum.view(ctx.shape)
        return dsum.to(ctx.dtypes[0]), dsum.to(ctx.dtypes[1]), dw, None


# ------------------------------------------------------------------------------------------ references
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-torch RMSNorm: fp32 math, output in ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch ``(rms_norm(x + residual), x + residual)``."""
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] > MAX_ROW or x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != residual.shape or x.shape[-1] > MAX_ROW or x.numel() == 0:
        return add_rms_norm_reference(x, residual, weight, eps)
    return AddRMSNormFunction.apply(x, residual, weight, eps)
