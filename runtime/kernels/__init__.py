"""Fused ops used by the runtime's models. Stable API; Triton kernels on CUDA, pure-torch references on CPU.

Every function here takes plain tensors; process groups are passed explicitly (no globals).
Shapes: ``x`` is ``[..., hidden]``; q is ``[batch, seq, heads, head_dim]``, k ``[batch, seq, kv_heads, head_dim]``;
cos/sin are ``[seq, head_dim // 2]`` (rotate-half convention, as Hugging Face Llama).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_BACKEND = "auto"  # auto: Triton on CUDA tensors, torch references otherwise


def set_backend(name: str) -> None:
    """Force 'triton' or 'torch' kernels, or 'auto' (Triton on CUDA, torch on CPU)."""
    global _BACKEND
    if name not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel backend must be auto, triton or torch, got {name!r}")
    _BACKEND = name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``target`` (logits in fp32)."""
    logits = (x @ weight.t()).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index)
