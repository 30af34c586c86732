"""Llama: pre-norm RMSNorm blocks with rotary attention (GQA) and a SwiGLU MLP (or, in a model's MoE layers, a
mixture of SwiGLU experts: moe.py); no biases."""

from __future__ import annotations

import torch
from torch import nn

from runtime import kernels
from runtime.models.common import Attention, RMSNorm, SwiGLU
from runtime.models.moe import MoE
from specs.model import ModelSpec


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.norm_eps)
        moe = spec.moe is not None and spec.moe.is_moe_layer(layer)
        self.mlp = MoE(spec) if moe else SwiGLU(spec.hidden_size, spec.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.attn(self.attn_norm(x))
        h, x = kernels.add_rms_norm(a, x, self.mlp_norm.weight, self.mlp_norm.eps)
        return x + self.mlp(h)
