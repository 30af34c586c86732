"""Helpers shared by the kernel tests."""

import pytest
import torch

from runtime.kernels._utils import HAS_TRITON

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-10}

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not importable")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, factor: float = 1.0,
                 what: str = "") -> None:
    """Max abs error within ``TOL[dtype] * factor`` of the expected tensor's largest magnitude."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    err = (a - e).abs().max().item() if a.numel() else 0.0
    scale = max(e.abs().max().item() if e.numel() else 0.0, 1e-6)
    assert err <= TOL[dtype] * factor * scale, f"{what}: max error {err:.3g} vs scale {scale:.3g} ({dtype})"


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def grads(out, inputs, grad_outputs):
    """Gradients of ``sum(out_i * g_i)`` w.r.t. ``inputs`` (None where unused)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    gos = grad_outputs if isinstance(grad_outputs, (tuple, list)) else (grad_outputs,)
    return torch.autograd.grad(outs, inputs, gos, allow_unused=True)
