"""Multi-rank cases run inside the worker pool (``pool.run("rt_cases:<name>", ...)``), and the plans they use.

Every case function takes the worker's rank first and returns something picklable (numpy arrays), or None
on ranks outside the plan.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runtime.data import TokenData
from runtime.parallel.mappings import all_gather_into
from runtime.parallel.mesh import build_groups
from runtime.parallel.tensor_parallel import gather_full
from runtime.trainer import Trainer
from specs.cluster import load_cluster
from specs.errors import AutoparError
from specs.model import ModelSpec
from specs.parallel import ParallelConfig
from specs.planfile import PlanFile, TrainConfig, make_plan
from specs.rules import PlanContext, check_plan
from specs.state import StateSpec

TRAIN = TrainConfig(steps=3, lr=3e-3, min_lr=3e-4, warmup_steps=1, weight_decay=0.1, grad_clip=1.0, seed=7)


def case_spec(case: dict[str, Any]) -> ModelSpec:
    """A tiny model for a case: Llama (GQA where tp allows) or GPT, 4 layers, hidden 32, vocab 64, seq 16."""
    tp = case.get("tp", 1)
    llama = case.get("arch", "llama") == "llama"
    return ModelSpec(
        name=f"tiny-{case.get('arch', 'llama')}", arch=case.get("arch", "llama"), num_layers=case.get("num_layers", 4),
        hidden_size=32, num_attention_heads=4, num_kv_heads=(2 if tp <= 2 else 4) if llama else None,
        ffn_hidden_size=64 if llama else 96, vocab_size=case.get("vocab", 64), seq_length=16,
        tie_embeddings=case.get("tied", False), dropout=case.get("dropout", 0.0), attention=case.get("attention"),
    )


def case_plan(case: dict[str, Any]) -> PlanFile:
    keys = {k: case[k] for k in ("tp", "pp", "dp", "mbs", "sp", "recompute", "recompute_layers", "zero",
                                  "dp_overlap", "layers") if k in case}
    if case.get("sched") == "interleaved":
        keys["vpp"] = 2
    keys.setdefault("mbs", 2 if case.get("tp", 1) == 4 else 1)  # tp=4 collectives are the slow part on 2 cores
    cfg = ParallelConfig(**keys)
    spec = case_spec(case)
    check_plan(cfg, PlanContext(spec, cfg.world, case.get("global_batch", 8)))
    train = TRAIN.model_copy(update={"steps": case.get("steps", 3)})
    # small gradient buckets (several per chunk); ``state`` picks the precisions (default: the cluster's, fp32)
    state = StateSpec.default(case.get("state", "fp32")).model_copy(
        update={"bucket_params": case.get("bucket_params", 3000)})
    return make_plan(spec, load_cluster("cpu-gloo"), case.get("global_batch", 8), cfg, train=train, state=state)


def full_grads(tr: Trainer) -> dict[str, np.ndarray] | None:
    """Every parameter's synchronised gradient, unsharded (tp shards and ZeRO slices gathered).

    Returned by the rank with tp_rank == dp_rank == 0 of each pipeline stage; None elsewhere.
    """
    g, dp = tr.g, tr.dp
    flat: dict[str, list[torch.Tensor]] = {}
    for b in dp.buckets:
        full = b.grad_data
        if dp.zero:
            full = torch.empty_like(b.grad_data)
            all_gather_into(full, b.grad_shard.contiguous(), g.dpcp_group)
        for s in b.spans:  # a parameter may span two buckets: its pieces in order
            flat.setdefault(s.info.name, []).append(full[s.start:s.end])
    out = {}
    for c in tr.chunks:
        for p, info in tr.params.named(c):
            whole = torch.cat(flat[info.name]).view(p.shape)
            out[info.name] = gather_full(whole, info.shard, g.tp_group).float().numpy().copy()
    return out if g.tp_rank == 0 and g.dp_rank == 0 else None


def _trainer(rank: int, case: dict[str, Any], data_path: str) -> tuple[Trainer | None, Any]:
    plan = case_plan(case)
    groups = build_groups(plan.config, "cpu", ranks=list(range(plan.world_size)),
                          tied_embeddings=plan.model.tie_embeddings)
    if groups is None:
        return None, None
    data = TokenData(data_path, plan.seq, plan.model.vocab_size, plan.train.seed)
    tr = Trainer(plan, groups, torch.device("cpu"), data, steps=plan.train.steps)
    return tr, groups


def equivalence(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Gradients after step 1's backward, and the losses of ``steps`` steps."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        loss_sum = tr.forward_backward()
        grads = full_grads(tr)
        losses = [tr.finish_step(loss_sum).loss]
        while tr.step < tr.steps:
            losses.append(tr.train_step().loss)
        params = {n: p.detach().float().numpy().copy() for c in tr.chunks for n, p in c.named_parameters()}
        return {"grads": grads, "losses": losses, "params": params if groups.tp == 1 and groups.dp_rank == 0 else None}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def train_with_checkpoints(rank: int, case: dict[str, Any], data_path: str, ckpt_dir: str, save_at: list[int],
                           resume: bool, stop_after: int | None = None) -> list[float] | str | None:
    """Losses of the steps this call runs: resume from ``ckpt_dir`` if asked, save after the steps in
    ``save_at``, stop after ``stop_after`` steps. An AutoparError comes back as its message."""
    from runtime.checkpoint import load_checkpoint, save_checkpoint

    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        if resume:
            load_checkpoint(tr, Path(ckpt_dir))
        losses = []
        while tr.step < (stop_after or tr.steps):
            losses.append(tr.train_step().loss)
            if tr.step in save_at:
                save_checkpoint(tr, Path(ckpt_dir))
        return losses
    except AutoparError as err:
        return f"AutoparError: {err}"
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def overlap_run(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Losses and this rank's final local parameters, plus how many buckets were reduced during backward."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        early, losses = [], []
        while tr.step < tr.steps:
            inp, tgt = tr.data.batch(tr.step, tr.plan.global_batch, groups.dp_rank, tr.cfg.dp)
            tr.dp.zero_grad()
            loss_sum = tr.runner.step(inp.split(tr.cfg.mbs), tgt.split(tr.cfg.mbs))
            early.append(sum(b.launched for b in tr.dp.buckets))  # launched before finish_grad_sync
            tr.dp.finish_grad_sync()
            losses.append(tr.finish_step(loss_sum).loss)
        tr.dp.wait_param_gather()
        params = {n: p.detach().float().numpy().copy() for c in tr.chunks for n, p in c.named_parameters()}
        return {"losses": losses, "params": params, "early": early, "buckets": len(tr.dp.buckets)}
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()


def mesh_layout(rank: int, cfg: dict[str, int]) -> dict[str, Any] | None:
    """This rank's coordinates and the members of its groups."""
    c = ParallelConfig(**cfg)
    g = build_groups(c, "cpu", ranks=list(range(c.world)))
    if g is None:
        return None
    try:
        members = {name: dist.get_process_group_ranks(getattr(g, f"{name}_group"))
                   for name in ("tp", "dp", "cp", "dpcp", "pp", "mp")}
        return {"coord": (g.pp_rank, g.dp_rank, g.cp_rank, g.tp_rank), "dpcp_rank": g.dpcp_rank, **members}
    finally:
        dist.barrier(group=g.world)
        g.destroy()


def p2p_volume(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """Elements of every pipeline send of one step, next to one micro-batch's boundary activation, and the
    losses of two steps (the second depends on the gradients the backward sends carried)."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    sent: list[int] = []
    real = dist.isend

    def spy(t, *a, **k):
        sent.append(t.numel())
        return real(t, *a, **k)

    dist.isend = spy
    try:
        loss_sum = tr.forward_backward()
        dist.isend = real
        losses = [tr.finish_step(loss_sum).loss, tr.train_step().loss]
        return {"sent": sent, "act": math.prod(tr.runner.act_shape), "tp": groups.tp, "losses": losses}
    finally:
        dist.isend = real
        dist.barrier(group=groups.world)
        groups.destroy()


def _nbytes(tensors: list[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def state_report(rank: int, case: dict[str, Any], data_path: str) -> dict[str, Any] | None:
    """After one step: this rank's data-parallel gradient buckets per model chunk and its model state's bytes by
    kind, measured from the tensors it keeps (parameter buffers, gradient buffers, master copies and Adam
    moments), the padding elements of its buffers, and the parameter tensors living outside the buffers."""
    tr, groups = _trainer(rank, case, data_path)
    if tr is None:
        return None
    try:
        loss = tr.train_step().loss
        dp, opt = tr.dp, tr.opt
        pbufs, gbufs = [p for p, _ in dp.buffers], [g for _, g in dp.buffers]
        params = [p for c in tr.chunks for p in c.parameters()]
        inside = {b.untyped_storage().data_ptr() for b in pbufs + gbufs}
        stray = [t for p in params for t in (p.data, p.grad)
                 if t is not None and t.untyped_storage().data_ptr() not in inside]
        return {
            "pp_rank": groups.pp_rank, "vstages": [c * groups.pp + groups.pp_rank for c in range(len(tr.chunks))],
            "buckets": [sum(b.chunk == c for b in dp.buckets) for c in range(len(tr.chunks))],
            "bytes": {"weights": _nbytes(pbufs), "gradients": _nbytes(gbufs),
                      "optimizer": _nbytes(opt.master + opt.exp_avg + opt.exp_avg_sq)},
            "padding": sum(b.numel() for b in pbufs) - sum(p.numel() for p in params),
            "dtypes": [str(pbufs[0].dtype), str(gbufs[0].dtype)], "d": dp.d, "zero": dp.zero,
            "stray": len(stray), "loss": loss,
        }
    finally:
        dist.barrier(group=groups.world)
        groups.destroy()
