"""Rotary position embedding on q and k in one launch: Triton kernel, autograd Function, torch reference.

Rotate-half convention (Hugging Face Llama): with ``x = [x1, x2]`` split on the last dim,
``rope(x) = [x1*cos - x2*sin, x2*cos + x1*sin]``. q is ``[batch, seq, heads, head_dim]``, k
``[batch, seq, kv_heads, head_dim]``, cos/sin ``[seq, head_dim // 2]``. One program per (batch, seq)
position rotates every q and k head there. Outputs may alias the inputs (in place); the backward is the
same kernel rotating by ``-theta``. Math in fp32, outputs in the inputs' dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from ._utils import LazyKernel, next_pow2, num_warps_for

tl: Any = None  # triton.language, bound by LazyKernel.build on first launch (triton is imported lazily)


def _rope(Q, K, QO, KO, COS, SIN, S, HALF, NQ, NK,
          sqb, sqs, sqh, skb, sks, skh, sqob, sqos, sqoh, skob, skos, skoh,
          BACKWARD: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    c = tl.load(COS + s * HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    sn = tl.load(SIN + s * HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:
        sn = -sn

    hq = tl.arange(0, BLOCK_HQ)
    mq = (hq < NQ)[:, None] & dmask[None, :]
    src = Q + b * sqb + s * sqs + hq[:, None] * sqh + d[None, :]
    q1 = tl.load(src, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(src + HALF, mask=mq, other=0.0).to(tl.float32)
    dst = QO + b * sqob + s * sqos + hq[:, None] * sqoh + d[None, :]
    tl.store(dst, (q1 * c - q2 * sn).to(QO.dtype.element_ty), mask=mq)
    tl.store(dst + HALF, (q2 * c + q1 * sn).to(QO.dtype.element_ty), mask=mq)

    hk = tl.arange(0, BLOCK_HK)
    mk = (hk < NK)[:, None] & dmask[None, :]
    src = K + b * skb + s * sks + hk[:, None] * skh + d[None, :]
    k1 = tl.load(src, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(src + HALF, mask=mk, other=0.0).to(tl.float32)
    dst = KO + b * skob + s * skos + hk[:, None] * skoh + d[None, :]
    tl.store(dst, (k1 * c - k2 * sn).to(KO.dtype.element_ty), mask=mk)
    tl.store(dst + HALF, (k2 * c + k1 * sn).to(KO.dtype.element_ty), mask=mk)


rope_kernel = LazyKernel(_rope)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False,
               inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel; returns (q_out, k_out), which are q and k themselves when ``inplace``."""
    bsz, seq, nq, dim = q.shape
    nk = k.shape[2]
    half = dim // 2
    q = _unit_last(q)
    k = _unit_last(k)
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    cos = cos.contiguous()
    sin = sin.contiguous()
    block_hq, block_hk, block_d = next_pow2(nq), next_pow2(nk), next_pow2(half)
    if bsz * seq > 0:
        rope_kernel[(bsz * seq,)](
            q, k, qo, ko, cos, sin, seq, half, nq, nk,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
            BACKWARD=backward, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d,
            num_warps=num_warps_for(2 * max(block_hq, block_hk) * block_d))
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
        inplace = inplace and q.stride(-1) == 1 and k.stride(-1) == 1
        qo, ko = rope_apply(q, k, cos, sin, inplace=inplace)
        if inplace:
            ctx.mark_dirty(q, k)
        ctx.save_for_backward(cos, sin)
        return qo, ko

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_apply(dq, dk, cos, sin, backward=True)
        return dq, dk, None, None, None


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch rotate-half RoPE (cos/sin cast to the inputs' dtype, as Hugging Face Llama)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inplace: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    ok = (q.dim() == 4 and k.dim() == 4 and q.shape[-1] % 2 == 0 and q.shape[-1] == k.shape[-1]
          and q.shape[:2] == k.shape[:2] and cos.shape == sin.shape == (q.shape[1], q.shape[-1] // 2)
          and q.numel() > 0 and k.numel() > 0)
    if not ok:
        return rope_reference(q, k, cos, sin)
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    if inplace and not needs_grad:
        return rope_apply(q, k, cos, sin, inplace=q.stride(-1) == 1 and k.stride(-1) == 1)
    if inplace and (q._base is not None or k._base is not None):
        inplace = False  # autograd cannot mark two in-place-modified views dirty in one Function
    return RoPEFunction.apply(q, k, cos, sin, inplace)
