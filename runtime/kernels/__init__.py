"""Fused ops used by the runtime's models. Stable API; Triton kernels on CUDA, pure-torch references on CPU.

Every function here takes plain tensors; process groups are passed explicitly (no globals).
Shapes: ``x`` is ``[..., hidden]``; q is ``[batch, seq, heads, head_dim]``,
k ``[batch, seq, kv_heads, head_dim]``; cos/sin are ``[seq, head_dim // 2]``
(rotate-half convention, as Hugging Face Llama).

Backend (:func:`set_backend`): ``"auto"`` runs the Triton kernel when the input is a CUDA tensor and the
torch reference otherwise; ``"torch"`` always runs the reference; ``"triton"`` always runs the kernel, on
CPU tensors too when ``TRITON_INTERPRET=1`` (Triton's interpreter, used by the tests); ``"native"`` is
``"auto"`` with the plain norms on torch's own fused ``F.rms_norm`` / ``F.layer_norm``.
Each op lives in ``<op>_op.py``: Triton kernels, the autograd Function and the torch reference beside it.
"""

import torch
import torch.distributed as dist

from ._utils import get_backend, native_norms, set_backend, use_triton
from .cross_entropy_op import (
    linear_cross_entropy_reference,
    linear_cross_entropy_triton,
    vocab_parallel_linear_cross_entropy_reference,
    vocab_parallel_linear_cross_entropy_triton,
)
from .experts_op import experts_swiglu_grouped, experts_swiglu_reference, grouped_ok
from .layer_norm_op import layer_norm_reference, layer_norm_triton
from .rms_norm_op import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, rms_norm_triton
from .rope_op import rope_reference, rope_triton
from .swiglu_op import swiglu_packed_reference, swiglu_packed_triton, swiglu_reference, swiglu_triton

__all__ = [
    "add_rms_norm", "experts_swiglu", "get_backend", "layer_norm", "linear_cross_entropy", "rms_norm", "rope",
    "set_backend", "swiglu", "swiglu_packed", "vocab_parallel_linear_cross_entropy",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * weight`` (fp32 math, output in ``x.dtype``)."""
    if native_norms():
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual), in one pass on the kernel path."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim (fp32 math, output in ``x.dtype``); ``bias`` may be None."""
    if native_norms():
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight.to(x.dtype),
                                              None if bias is None else bias.to(x.dtype), eps)
    if use_triton(x):
        return layer_norm_triton(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    if use_triton(gate):
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate, up = gate_up.chunk(2, -1)`` (a fused gate/up projection's output).

    Same values as ``swiglu(*gate_up.chunk(2, -1))``, but the kernel's backward writes the gradient of
    ``gate_up`` in one buffer, saving the copy autograd's ``chunk`` backward (a ``cat``) would make.
    """
    if use_triton(gate_up):
        return swiglu_packed_triton(gate_up)
    return swiglu_packed_reference(gate_up)


def experts_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Routed experts' SwiGLU MLPs on rows grouped by expert: ``counts[e]`` consecutive rows of ``x`` [N, h] for
    expert ``e`` of ``gate_up`` [E, 2f, h] / ``down`` [E, h, f] -> [N, h] (experts_op.py). Grouped GEMMs where the
    kernel path runs (CUDA, or backend "triton") and torch has them; a loop over the experts otherwise."""
    if get_backend() != "torch" and (x.device.type == "cuda" or get_backend() == "triton") \
            and grouped_ok(x, gate_up, down):
        return experts_swiglu_grouped(x, gate_up, down, counts, swiglu_packed)
    return experts_swiglu_reference(x, gate_up, down, counts, swiglu_packed)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the positions' angles (rotate-half).

    ``inplace`` lets the kernel write the result into q and k: always without autograd (inference), and
    with autograd when q and k are not views (autograd cannot mark two dirty views from one Function);
    otherwise, and always on the reference path, new tensors are returned.
    """
    if use_triton(q):
        return rope_triton(q, k, cos, sin, inplace=inplace)
    return rope_reference(q, k, cos, sin)


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``target`` (softmax in fp32).

    x ``[..., hidden]``, weight ``[vocab, hidden]``, target ``[...]`` (x's leading shape). The kernel path
    never materialises the full logits and computes both gradients during the forward.
    """
    if use_triton(x):
        return linear_cross_entropy_triton(x, weight, target, ignore_index)
    return linear_cross_entropy_reference(x, weight, target, ignore_index)


def vocab_parallel_linear_cross_entropy(x: torch.Tensor, weight_shard: torch.Tensor, target: torch.Tensor,
                                        vocab_start: int, group: dist.ProcessGroup,
                                        ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy over the full vocab when each rank of ``group`` holds a vocab shard of the head.

    ``weight_shard`` holds vocab rows ``[vocab_start, vocab_start + weight_shard.shape[0])``; ``x`` and
    ``target`` (full-vocab ids) are the same on every rank. Returns the same global mean loss on every rank.

    Gradients: ``weight_shard`` gets its exact gradient. ``x`` gets only this rank's partial gradient
    (``grad_logits_shard @ weight_shard``); the caller must sum it over ``group``, e.g. by passing
    ``x`` through the usual TP "copy to tensor-parallel region" op (identity forward, all-reduce backward),
    or, with sequence parallelism, by producing ``x`` with the sequence all-gather (reduce-scatter backward).
    """
    if use_triton(x):
        return vocab_parallel_linear_cross_entropy_triton(x, weight_shard, target, vocab_start, group,
                                                          ignore_index)
    return vocab_parallel_linear_cross_entropy_reference(x, weight_shard, target, vocab_start, group,
                                                         ignore_index)
