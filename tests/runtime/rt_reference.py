"""The single-process reference the parallel runs are compared with.

The plain model (no parallel code) on the whole global batch at once, trained with ``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_`` and a warmup + cosine schedule written out here — none of the runtime's
data-parallel, optimizer or pipeline code.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from runtime.data import TokenData
from runtime.models import build_model
from specs.planfile import PlanFile


def schedule_lr(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * min(t, 1.0))) / 2


def reference_run(plan: PlanFile, data_path: str) -> dict[str, Any]:
    """Gradients of step 1 (before clipping), the loss of every step, and the final parameters."""
    tc = plan.train
    model = build_model(plan.model, "cpu", seed=tc.seed)
    data = TokenData(data_path, plan.seq, plan.model.vocab_size, tc.seed)
    named = dict(model.named_parameters())
    decay = [p for p in named.values() if p.dim() >= 2]
    rest = [p for p in named.values() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=tc.lr, betas=tc.betas, eps=tc.eps, foreach=False)
    grads, losses, norms = None, [], []
    for step in range(tc.steps):
        inp, tgt = data.batch(step, plan.global_batch)
        loss = model(inp, tgt)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.detach().numpy().copy() for n, p in named.items()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)))
        for group in opt.param_groups:
            group["lr"] = schedule_lr(step, tc.lr, tc.min_lr, tc.warmup_steps, tc.steps)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.detach().numpy().copy() for n, p in named.items()}
    return {"grads": grads, "losses": losses, "params": params, "grad_norm": norms[0]}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """``|a - b| / |b|`` in the 2-norm (absolute when b is zero)."""
    denom = float(np.linalg.norm(b))
    diff = float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64)))
    return diff / denom if denom > 0 else diff


def merge(results: list[dict[str, Any] | None], key: str) -> dict[str, np.ndarray]:
    """Union of the per-rank dicts under ``key`` (each pipeline stage reports its own parameters)."""
    out: dict[str, np.ndarray] = {}
    for r in results:
        if r is not None and r.get(key):
            for name, value in r[key].items():
                out.setdefault(name, value)
    return out
