"""Llama: pre-norm RMSNorm blocks with rotary attention (GQA) and a SwiGLU MLP; no biases."""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.models.common import Attention, RMSNorm
from specs.model import ModelSpec


class SwiGLU(nn.Module):
    """``down(silu(gate) * up)`` with a fused ``gate_up`` projection laid out ``[gate | up]``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_up = nn.Linear(spec.hidden_size, 2 * spec.ffn, bias=False)
        self.down = nn.Linear(spec.ffn, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one op over the fused projection: its backward writes d(gate_up) in one buffer (no cat)
        return self.down(kernels.swiglu_packed(self.gate_up(x)))


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = SwiGLU(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.attn_norm(x))
        h, x = kernels.add_rms_norm(a, x, self.mlp_norm.weight, self.mlp_norm.eps)
        return x + self.mlp(h)
