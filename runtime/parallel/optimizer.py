"""AdamW over the data-parallel buckets (ZeRO-1/2/3 when they are sharded), gradient clipping, warmup + cosine LR.

The update is torch.optim.AdamW's (its fused kernel, ``torch._fused_adamw_``) applied per bucket to the slice
this rank owns (the whole bucket for ZeRO-0), with fp32 ``exp_avg`` and ``exp_avg_sq``. The weights it updates
are an fp32 master copy of the slice when the plan's ``state.master_weights`` says so (16-bit parameters),
copied into the parameters afterwards; otherwise the parameter buffer's slice itself, in place. ZeRO-1/2 then
all-gather the parameters from the owners' slices; ZeRO-3 keeps only the slice (gathered where it is used).
Weight decay applies to matrices (parameters of two or more dimensions), not to norms and biases. The gradient
norm is the norm of the full (unsharded, deduplicated) gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.parallel.buckets import Span
from runtime.parallel.data_parallel import DataParallel
from specs.planfile import TrainConfig


def lr_at(step: int, train: TrainConfig, total_steps: int) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, total_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


def _is_matrix(s: Span) -> bool:
    return len(s.shape) >= 2  # a shard has the dimensions of its full tensor


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


Operands = list[list[torch.Tensor]]  # [weights, grads, exp_avg, exp_avg_sq] slices


class DistributedAdamW:
    def __init__(self, dp: DataParallel, train: TrainConfig, total_steps: int, master_weights: bool) -> None:
        self.dp, self.train, self.total_steps = dp, train, total_steps
        self.step_count = 0
        self.master: list[torch.Tensor | None] = []  # fp32 copies of the owned slices, when kept
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.decay: list[list[tuple[int, int]]] = []
        for b in dp.buckets:
            owned = b.param_shard
            self.master.append(owned.detach().float().clone() if master_weights else None)
            self.exp_avg.append(torch.zeros(owned.shape, dtype=torch.float32, device=owned.device))
            self.exp_avg_sq.append(torch.zeros(owned.shape, dtype=torch.float32, device=owned.device))
            self.decay.append(b.owned(_is_matrix))
        self._cached: tuple[Operands, Operands] | None = None
        self._step_t: torch.Tensor | None = None

    def clip_and_norm(self) -> torch.Tensor:
        """Global gradient norm (before clipping); scales the gradients so it is at most ``grad_clip``."""
        sq = self.dp.grad_norm_sq()
        dist.all_reduce(sq, group=self.dp.norm_group)
        norm = sq.sqrt()
        if self.train.grad_clip > 0:
            coef = torch.clamp(self.train.grad_clip / (norm + 1e-6), max=1.0)
            for b in self.dp.buckets:
                b.grad_shard.mul_(coef.to(b.grad_shard.dtype))
        return norm

    def _weights(self, i: int) -> torch.Tensor:
        """What the update of bucket ``i`` changes: its master copy, or the parameters' owned slice."""
        m = self.master[i]
        return m if m is not None else self.dp.buckets[i].param_shard

    def _operands(self) -> tuple[Operands, Operands, list[tuple[torch.Tensor, torch.Tensor]]]:
        """(decayed, not decayed) fp32 operands for the fused update, and the (tensor, fp32 temporary) pairs to
        copy back afterwards (16-bit weights updated without a master copy)."""
        dec: Operands = [[], [], [], []]
        rest: Operands = [[], [], [], []]
        back = []
        for i, b in enumerate(self.dp.buckets):
            w = self._weights(i)
            w32, g32 = _fp32(w), _fp32(b.grad_shard)
            if w32 is not w:
                back.append((w, w32))
            edges = [0]
            for lo, hi in self.decay[i]:
                edges += [lo, hi]
            edges.append(w.numel())
            for j in range(len(edges) - 1):
                lo, hi = edges[j], edges[j + 1]
                if lo < hi:
                    target = dec if j % 2 else rest
                    for lst, t in zip(target, (w32, g32, self.exp_avg[i], self.exp_avg_sq[i])):
                        lst.append(t[lo:hi])
        return dec, rest, back

    @torch.no_grad()
    def step(self) -> tuple[float, float]:
        """One update from the synchronised gradients; returns (grad norm, learning rate).

        One fused AdamW kernel (torch's own) per group: matrices with weight decay, the rest without."""
        self.dp.wait_param_gather()
        norm = self.clip_and_norm()
        lr = lr_at(self.step_count, self.train, self.total_steps)
        self.step_count += 1
        b1, b2 = self.train.betas
        if self._cached is not None:
            dec, rest, back = *self._cached, []
        else:
            dec, rest, back = self._operands()
            if not back and all(b.grad_shard.dtype == torch.float32 for b in self.dp.buckets):
                self._cached = (dec, rest)  # views of persistent fp32 buffers: built once
        for (w, g, ea, eas), wd in zip((dec, rest), (self.train.weight_decay, 0.0)):
            if not w:
                continue
            if self._step_t is None:
                self._step_t = torch.zeros((), dtype=torch.float32, device=w[0].device)
            self._step_t.fill_(float(self.step_count))  # one persistent tensor (no new allocation per step)
            steps = [self._step_t] * len(w)
            torch._fused_adamw_(w, g, ea, eas, [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                                eps=self.train.eps, amsgrad=False, maximize=False)
        for t, t32 in back:
            t.copy_(t32)
        self._publish()
        return float(norm), lr

    def _publish(self) -> None:
        """Make the updated weights the parameters: copy masters into the owned slices, then (ZeRO-1/2) gather."""
        for b, m in zip(self.dp.buckets, self.master):
            if m is not None:
                b.param_shard.copy_(m)
        if self.dp.zero:
            self.dp.start_param_gather()
