"""AdamW over the data-parallel buckets (ZeRO-1 when they are sharded), gradient clipping, warmup + cosine LR.

The update is torch.optim.AdamW's (its fused kernel, ``torch._fused_adamw_``), applied to flat fp32
tensors: per bucket one master copy of the slice this rank owns (the parameter buffer itself for ZeRO-0
with fp32 parameters), ``exp_avg`` and ``exp_avg_sq``. Weight decay applies to matrices (parameters of two
or more dimensions), not to norms and biases. The gradient norm is the norm of the full (unsharded,
deduplicated) gradient.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.parallel.data_parallel import DataParallel
from specs.planfile import TrainConfig


def lr_at(step: int, train: TrainConfig, total_steps: int) -> float:
    """Learning rate of update ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, total_steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


def _is_matrix(p: torch.nn.Parameter) -> bool:
    shard = getattr(p, "shard", None)
    return len(shard.full_shape(p.shape) if shard is not None else p.shape) >= 2


class DistributedAdamW:
    def __init__(self, dp: DataParallel, train: TrainConfig, total_steps: int) -> None:
        self.dp, self.train, self.total_steps = dp, train, total_steps
        self.step_count = 0
        self.master: list[torch.Tensor] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.decay: list[list[tuple[int, int]]] = []
        for b in dp.buckets:
            owned = b.param_data[b.lo:b.hi]
            in_place = not dp.zero and owned.dtype == torch.float32
            m = owned if in_place else owned.detach().float().clone()
            self.master.append(m)
            self.exp_avg.append(torch.zeros_like(m))
            self.exp_avg_sq.append(torch.zeros_like(m))
            self.decay.append(b.owned(_is_matrix))
        self._cached: tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]] | None = None
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

    def _groups(self) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
        """(decayed, not decayed) lists of [master, grad, exp_avg, exp_avg_sq] slices, for the fused update."""
        dec: list[list[torch.Tensor]] = [[], [], [], []]
        rest: list[list[torch.Tensor]] = [[], [], [], []]
        for b, m, ea, eas, decay in zip(self.dp.buckets, self.master, self.exp_avg, self.exp_avg_sq, self.decay):
            g = b.grad_shard if b.grad_shard.dtype == m.dtype else b.grad_shard.to(m.dtype)
            edges = [0]
            for lo, hi in decay:
                edges += [lo, hi]
            edges.append(m.numel())
            for i in range(len(edges) - 1):
                lo, hi = edges[i], edges[i + 1]
                if lo < hi:
                    target = dec if i % 2 else rest
                    for lst, t in zip(target, (m, g, ea, eas)):
                        lst.append(t[lo:hi])
        return dec, rest

    @torch.no_grad()
    def step(self) -> tuple[float, float]:
        """One update from the synchronised gradients; returns (grad norm, learning rate).

        One fused AdamW kernel (torch's own) per group: matrices with weight decay, the rest without."""
        self.dp.wait_param_gather()
        norm = self.clip_and_norm()
        lr = lr_at(self.step_count, self.train, self.total_steps)
        self.step_count += 1
        b1, b2 = self.train.betas
        if self._cached is None or any(b.grad_shard.dtype != torch.float32 for b in self.dp.buckets):
            self._cached = self._groups()  # views of persistent buffers: built once (fp32 gradients)
        for (m, g, ea, eas), wd in zip(self._cached, (self.train.weight_decay, 0.0)):
            if not m:
                continue
            if self._step_t is None:
                self._step_t = torch.zeros((), dtype=torch.float32, device=m[0].device)
            self._step_t.fill_(float(self.step_count))  # one persistent tensor (no new allocation per step)
            steps = [self._step_t] * len(m)
            torch._fused_adamw_(m, g, ea, eas, [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                                eps=self.train.eps, amsgrad=False, maximize=False)
        if self.dp.zero:
            self.dp.start_param_gather(self.master)
        else:
            for b, m in zip(self.dp.buckets, self.master):
                if m.data_ptr() != b.param_data.data_ptr():
                    b.param_data.copy_(m)
        return float(norm), lr

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors to checkpoint (keys unique to this rank's slice; the master only where it is a copy)."""
        out = {}
        for i, (b, m) in enumerate(zip(self.dp.buckets, self.master)):
            out[f"{prefix}.b{i}.exp_avg"] = self.exp_avg[i]
            out[f"{prefix}.b{i}.exp_avg_sq"] = self.exp_avg_sq[i]
            if m.data_ptr() != b.param_data.data_ptr():
                out[f"{prefix}.b{i}.master"] = m
        return out
