"""GPT: pre-norm LayerNorm blocks, learned positions, a GeLU MLP, biases everywhere and dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.common import Attention, LayerNorm
from specs.model import ModelSpec


class GeluMLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.hidden_size, spec.ffn)
        self.proj = nn.Linear(spec.ffn, spec.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        self.dropout_p = spec.dropout_p
        self.attn_norm = LayerNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = LayerNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = GeluMLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.attn_norm(x)), self.dropout_p, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout_p, self.training)
