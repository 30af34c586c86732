"""Pool cases of the Hugging Face tests: a case's plan with RoPE scaling, trained from an imported checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rt_cases import case_plan

from runtime.checkpoint import load_checkpoint
from runtime.data import TokenData
from runtime.parallel.mesh import build_groups
from runtime.trainer import Trainer
from specs.model import RopeScaling
from specs.planfile import PlanFile


def scaled_plan(case: dict[str, Any], scaling: dict[str, Any]) -> PlanFile:
    """``rt_cases.case_plan(case)`` with the model's RoPE scaled as ``scaling`` says."""
    plan = case_plan(case)
    return plan.model_copy(update={"model": plan.model.model_copy(update={"rope_scaling": RopeScaling(**scaling)})})


def first_loss(rank: int, case: dict[str, Any], scaling: dict[str, Any], data_path: str, ckpt_dir: str
               ) -> float | None:
    """The loss of the first step after resuming from ``ckpt_dir`` (None on ranks outside the plan)."""
    plan = scaled_plan(case, scaling)
    groups = build_groups(plan.config, "cpu", ranks=list(range(plan.world_size)),
                          tied_embeddings=plan.model.tie_embeddings, experts=False)
    if groups is None:
        return None
    try:
        tr = Trainer(plan, groups, torch.device("cpu"), TokenData(data_path, plan.seq, plan.model.vocab_size,
                                                                  plan.train.seed), steps=plan.train.steps)
        load_checkpoint(tr, Path(ckpt_dir))
        return tr.train_step().loss
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()
