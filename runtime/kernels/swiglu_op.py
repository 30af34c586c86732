"""SwiGLU ``silu(gate) * up``: Triton kernels, autograd Function, torch reference.

Elementwise in fp32, output in the inputs' dtype. Inputs may be row-strided views (e.g. the two halves
of a fused gate/up projection) and are read in place. Backward recomputes ``silu`` from the saved inputs.
``SwiGLUPackedFunction`` takes the fused ``[gate | up]`` tensor itself and returns its gradient packed the
same way, which saves the ``cat`` that autograd's ``chunk`` backward would do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._utils import LazyKernel, as_rows, cdiv

tl: Any = None  # triton.language, bound by LazyKernel.build on first launch (triton is imported lazily)

BLOCK = 2048  # elements per program (tunable)
NUM_WARPS: int | None = None  # None: 8 for blocks of 2048+, else 4


def _swiglu_fwd(G, U, Y, N, blocks_per_row, sg, su, sy, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // blocks_per_row).to(tl.int64)
    cols = (pid % blocks_per_row).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(Y + row * sy + cols, y.to(Y.dtype.element_ty), mask=mask)


def _swiglu_bwd(DY, G, U, DG, DU, N, blocks_per_row, sdy, sg, su, sdg, sdu, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = (pid // blocks_per_row).to(tl.int64)
    cols = (pid % blocks_per_row).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(DY + row * sdy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * su + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    silu = g * sig
    tl.store(DU + row * sdu + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    dg = dy * u * (sig + silu * (1.0 - sig))
    tl.store(DG + row * sdg + cols, dg.to(DG.dtype.element_ty), mask=mask)


swiglu_fwd_kernel = LazyKernel(_swiglu_fwd)
swiglu_bwd_kernel = LazyKernel(_swiglu_bwd)


def _layout(n: int, *ts: torch.Tensor) -> tuple[list[torch.Tensor], int, int]:
    """2-D row views of ``ts``; fully contiguous inputs become one long row (no tail waste per row)."""
    if all(t.is_contiguous() for t in ts):
        numel = ts[0].numel()
        return [t.view(1, numel) for t in ts], numel, 1
    rows = [as_rows(t, n) for t in ts]
    return rows, n, rows[0].shape[0]


def _launch_cfg(n: int) -> tuple[int, int]:
    block = min(BLOCK, max(128, 1 << max(0, n - 1).bit_length()))
    return block, NUM_WARPS or (8 if block >= 2048 else 4)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        n = gate.shape[-1]
        (g2, u2), width, rows = _layout(n, gate, up)
        y = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
        block, warps = _launch_cfg(width)
        bpr = cdiv(width, block)
        swiglu_fwd_kernel[(rows * bpr,)](g2, u2, y, width, bpr, g2.stride(0), u2.stride(0), width,
                                         BLOCK=block, num_warps=warps)
        ctx.save_for_backward(gate, up)
        return y.view(gate.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        n = gate.shape[-1]
        (dy2, g2, u2), width, rows = _layout(n, dy, gate, up)
        dg = torch.empty((rows, width), dtype=gate.dtype, device=gate.device)
        du = torch.empty((rows, width), dtype=up.dtype, device=up.device)
        block, warps = _launch_cfg(width)
        bpr = cdiv(width, block)
        swiglu_bwd_kernel[(rows * bpr,)](dy2, g2, u2, dg, du, width, bpr, dy2.stride(0), g2.stride(0),
                                         u2.stride(0), width, width, BLOCK=block, num_warps=warps)
        return dg.view(gate.shape), du.view(up.shape)


class SwiGLUPackedFunction(torch.autograd.Function):
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` on the last dim; the gradient comes back packed too,
    so no ``cat`` of the two halves' gradients follows (as it does after ``gate_up.chunk(2, -1)``)."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        two_f = gate_up.shape[-1]
        f = two_f // 2
        gu = as_rows(gate_up, two_f)
        rows = gu.shape[0]
        y = torch.empty((rows, f), dtype=gate_up.dtype, device=gate_up.device)
        block, warps = _launch_cfg(f)
        bpr = cdiv(f, block)
        swiglu_fwd_kernel[(rows * bpr,)](gu, gu[:, f:], y, f, bpr, gu.stride(0), gu.stride(0), f,
                                         BLOCK=block, num_warps=warps)
        ctx.save_for_backward(gu)
        ctx.shape = gate_up.shape
        return y.view(*gate_up.shape[:-1], f)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (gu,) = ctx.saved_tensors
        rows, two_f = gu.shape
        f = two_f // 2
        dy2 = as_rows(dy, f)
        dgu = torch.empty((rows, two_f), dtype=gu.dtype, device=gu.device)
        block, warps = _launch_cfg(f)
        bpr = cdiv(f, block)
        sgu = gu.stride(0)
        swiglu_bwd_kernel[(rows * bpr,)](dy2, gu, gu[:, f:], dgu, dgu[:, f:], f, bpr, dy2.stride(0), sgu, sgu,
                                         two_f, two_f, BLOCK=block, num_warps=warps)
        return dgu.view(ctx.shape)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``silu(gate) * up``."""
    return F.silu(gate) * up


def swiglu_packed_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-torch ``silu(gate) * up`` with ``gate, up = gate_up.chunk(2, -1)``."""
    return swiglu_reference(*gate_up.chunk(2, dim=-1))


def swiglu_packed_triton(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[-1] % 2 or gate_up.numel() == 0:
        return swiglu_packed_reference(gate_up)
    return SwiGLUPackedFunction.apply(gate_up)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.numel() == 0:
        return swiglu_reference(gate, up)
    return SwiGLUFunction.apply(gate, up)
