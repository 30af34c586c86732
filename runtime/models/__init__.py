"""GPT and Llama written plainly (no parallel code); ``build_model(spec)`` picks the family."""

from __future__ import annotations

import torch

from runtime.models.common import Transformer, init_parameters
from runtime.models.gpt import GPTBlock
from runtime.models.llama import LlamaBlock
from specs.model import ModelSpec

__all__ = ["Transformer", "build_model", "init_parameters"]


def build_model(spec: ModelSpec, device: torch.device | str = "cpu", seed: int | None = None) -> Transformer:
    """The whole model on ``device`` (``"meta"`` for a shape-only model to parallelize); initialised if seed given."""
    block = GPTBlock if spec.arch == "gpt" else LlamaBlock
    with torch.device(device):
        model = Transformer(spec, block)
    if seed is not None:
        init_parameters(model, spec, seed)
    return model
