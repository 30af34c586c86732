"""GPT: pre-norm LayerNorm blocks, learned positions, a GeLU (or squared-ReLU) MLP, biases (unless the spec drops
them) and dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.models.common import Attention, LayerNorm
from specs.model import ModelSpec


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 as Megatron-LM and NeMo compute it unfused (what cost_models/layer.py prices)."""
    return torch.pow(F.relu(x), 2)


class MLP(nn.Module):
    """fc -> activation (``spec.act``: tanh-GeLU or squared ReLU) -> proj."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.fc = nn.Linear(spec.hidden_size, spec.ffn, bias=spec.has_bias)
        self.proj = nn.Linear(spec.ffn, spec.hidden_size, bias=spec.has_bias)
        self.squared_relu = spec.act == "squared_relu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return self.proj(squared_relu(h) if self.squared_relu else F.gelu(h, approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int = 0) -> None:
        super().__init__()
        self.dropout_p = spec.dropout_p
        self.attn_norm = LayerNorm(spec.hidden_size, spec.norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = LayerNorm(spec.hidden_size, spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.attn_norm(x)), self.dropout_p, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout_p, self.training)
