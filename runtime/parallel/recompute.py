"""Activation recomputation: full (whole transformer layers) or selective (the attention core only).

A recomputed module keeps its class, its name and its parameters: its class is swapped for a subclass whose
``forward`` runs under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved so dropout replays
identically). Only the forward's inputs are kept; the rest is recomputed during backward: the whole forward,
its last GEMM and tensor-parallel collective included (torch's early stop, which would skip what no saved
tensor needs, is turned off so that the runtime does what the cost model prices: a layer's forward again).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from runtime.models.common import Transformer
from specs.parallel import ParallelConfig


@functools.cache
def _recomputed_class(cls: type[nn.Module]) -> type[nn.Module]:
    class Recomputed(cls):  # type: ignore[valid-type, misc]
        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return super().forward(*args)
            with set_checkpoint_early_stop(False):  # recompute the whole forward, as priced (and as Megatron does)
                return checkpoint(super().forward, *args, use_reentrant=False)

    Recomputed.__name__ = Recomputed.__qualname__ = f"Recomputed{cls.__name__}"
    return Recomputed


def recompute_module(module: nn.Module) -> None:
    """Make ``module`` recompute its forward during backward instead of storing activations."""
    if not type(module).__name__.startswith("Recomputed"):
        module.__class__ = _recomputed_class(type(module))


def is_recomputed(module: nn.Module) -> bool:
    return type(module).__name__.startswith("Recomputed")


def apply_recompute(stage: Transformer, cfg: ParallelConfig, vstage: int) -> None:
    """``full``: the first ``recompute_layers`` layers of virtual stage ``vstage`` (all by default);
    ``selective``: every layer's attention core (softmax(QK^T)V and its s x s scores)."""
    layers = list(stage.layers.values())
    if cfg.recompute == "full":
        for layer in layers[: cfg.recomputed_layers(vstage, len(layers))]:
            recompute_module(layer)
    elif cfg.recompute == "selective":
        for layer in layers:
            recompute_module(layer.attn.core)
