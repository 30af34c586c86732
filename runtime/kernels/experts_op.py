"""A mixture-of-experts layer's routed experts, each a SwiGLU MLP, on rows grouped by expert.

``x`` [N, h] holds ``counts[e]`` consecutive rows for expert ``e`` (in expert order); ``gate_up`` [E, 2f, h] and
``down`` [E, h, f] are the experts' stacked weights. Two paths give the same result:

* :func:`experts_swiglu_grouped`: two grouped GEMMs (torch's ``grouped_mm``: one kernel per projection over all
  experts, on CUDA the grouped GEMM of CUTLASS), when torch has it and the operands' rows are 16-byte aligned;
* :func:`experts_swiglu_reference`: a loop over the experts, two GEMMs each.

Both run every expert, the ones that received no rows too, so the weights are always part of the graph (an
expert-parallel backward issues the same collectives on every rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED = getattr(F, "grouped_mm", None)


def grouped_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the grouped path runs these operands: torch has it, and every row of every operand is a multiple
    of 16 bytes (what its kernels need)."""
    if _GROUPED is None:
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 and t.shape[-2] * t.element_size() % 16 == 0
               for t in (gate_up, down)) and x.dtype == gate_up.dtype


def experts_swiglu_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor,
                           swiglu_packed) -> torch.Tensor:  # noqa: ANN001
    offs = counts.cumsum(0).to(torch.int32)
    h = _GROUPED(x, gate_up.transpose(-2, -1), offs=offs)
    return _GROUPED(swiglu_packed(h), down.transpose(-2, -1), offs=offs)


def experts_swiglu_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor,
                             swiglu_packed) -> torch.Tensor:  # noqa: ANN001
    parts = x.split(counts.tolist())
    return torch.cat([F.linear(swiglu_packed(F.linear(p, gate_up[e])), down[e]) for e, p in enumerate(parts)])
