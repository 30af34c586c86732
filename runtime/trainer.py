"""One rank's training state for a plan: model chunks, DP buffers, optimizer, pipeline runner, data.

``Trainer(plan, groups, device, data, steps)`` builds everything (the model on the meta device, cut and
sharded by :func:`runtime.parallel.parallelize.parallelize`, then allocated and initialised as if
unsharded); ``train_step()`` runs one step of the plan and returns its metrics.

The model state is the plan's ``state`` (specs/state.py), as the cost model prices it: parameters in
``state.params`` (compute runs in that dtype; no autocast), gradient buffers in ``state.grads``, buckets of
``state.bucket_params``, an fp32 master copy only with ``state.master_weights``. A CUDA (nccl) plan run on a
machine without CUDA runs on the CPU in fp32 instead (:func:`executed_state`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.data import TokenData
from runtime.dtypes import TORCH_DTYPES
from runtime.models import build_model
from runtime.models.common import param_seed
from runtime.parallel.context_parallel import local_positions
from runtime.parallel.data_parallel import DataParallel
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.optimizer import DistributedAdamW
from runtime.parallel.parallelize import materialize, parallelize
from runtime.parallel.pipeline import PipelineRunner
from runtime.phase_clock import PhaseClock
from specs.capabilities import execution_problem
from specs.errors import AutoparError
from specs.planfile import PlanFile
from specs.state import StateSpec


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    peak_memory_GiB: float  # the fullest rank's: CUDA max_memory_allocated; CPU: the process's peak RSS
    peak_reserved_GiB: float  # ... CUDA max_memory_reserved (what the caching allocator held); CPU: the same RSS


def check_supported(plan: PlanFile, source: str | None = None) -> None:
    """A one-line error for a plan this runtime does not execute (``specs/capabilities.py`` says what it does),
    naming the plan file ``source`` it was read from."""
    problem = execution_problem(plan.model, plan.state)
    if problem:
        raise AutoparError(f"plan file {source}: {problem}" if source else problem)


def executed_state(plan: PlanFile, device: torch.device) -> StateSpec:
    """The model state this rank keeps: the plan's, or fp32 for a CUDA (nccl) plan run on CPUs (the meta device
    of a memory replay keeps the plan's)."""
    if plan.cluster.backend == "nccl" and device.type == "cpu":
        return StateSpec.default("fp32").model_copy(update={"bucket_params": plan.state.bucket_params})
    return plan.state


def peak_memory_GiB(device: torch.device) -> tuple[float, float]:
    """This rank's peak (allocated, reserved) GiB: the CUDA caching allocator's, or the process's peak RSS twice."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.max_memory_reserved(device) / 2**30
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
    return rss, rss


class Trainer:
    def __init__(self, plan: PlanFile, groups: ParallelGroups, device: torch.device, data: TokenData,
                 steps: int, clock: PhaseClock | None = None) -> None:
        check_supported(plan)
        self.clock = clock or PhaseClock()  # where each step's time goes (runtime/phase_clock.py)
        self.plan, self.g, self.device, self.data, self.steps = plan, groups, device, data, steps
        cfg, spec = plan.config, plan.model
        self.cfg, self.m = cfg, cfg.microbatches(plan.global_batch)
        self.state = executed_state(plan, device)
        dtype = TORCH_DTYPES[self.state.params]
        self.chunks, self.params = parallelize(build_model(spec, "meta"), cfg, groups)
        materialize(self.chunks, self.params, spec, plan.train.seed, device, dtype)
        for c in self.chunks:
            c.train()
        self.dp = DataParallel(self.chunks, self.params, groups, cfg.zero, cfg.dp_overlap, device,
                               TORCH_DTYPES[self.state.grads], self.state.bucket_params)
        # the learning-rate schedule is the plan's (train.steps), whatever this run's length: a resumed or
        # extended run continues it exactly
        self.opt = DistributedAdamW(self.dp, plan.train, plan.train.steps, self.state.master_weights)
        # a stage boundary carries this rank's tokens: seq / cp of each sequence (under SP, 1/tp of those)
        seq = plan.seq // cfg.cp // (cfg.tp if cfg.sequence_parallel else 1)
        self.positions = local_positions(plan.seq, cfg.cp, groups.cp_rank) if cfg.cp > 1 else None
        self.runner = PipelineRunner(self.chunks, groups, cfg, self.m, (cfg.mbs, seq, spec.hidden_size),
                                     dtype, dtype, device, on_backward=self.dp.arm, clock=self.clock)
        # Same stream on every tp rank (replicated dropout stays replicated), distinct per pp, dp and cp rank.
        cp_key = f"/cp{groups.cp_rank}" if cfg.cp > 1 else ""
        torch.manual_seed(param_seed(plan.train.seed, f"rng/pp{groups.pp_rank}/dp{groups.dp_rank}{cp_key}"))
        self.step = 0  # completed steps

    @property
    def is_loss_rank(self) -> bool:
        """Holds the loss: the last pipeline rank, tp rank 0 (one per dp x cp rank: the mean over its tokens)."""
        return self.g.pp_rank == self.cfg.pp - 1 and self.g.tp_rank == 0

    def forward_backward(self) -> torch.Tensor:
        """Forward and backward of the current step with synchronised gradients; returns this rank's loss sum."""
        with self.clock.phase("data"):
            inp, tgt = self.data.batch(self.step, self.plan.global_batch, self.g.dp_rank, self.cfg.dp,
                                       self.positions)
            inp, tgt = inp.to(self.device), tgt.to(self.device)
        mbs = self.cfg.mbs
        with self.clock.phase("optimizer"):  # zeroing the gradient buffer: priced with the optimizer (tail.py)
            self.dp.zero_grad()
        loss_sum = self.runner.step(inp.split(mbs), tgt.split(mbs))
        with self.clock.phase("dp_comm"):
            self.dp.finish_grad_sync()
        return loss_sum

    def train_step(self) -> StepStats:
        return self.finish_step(self.forward_backward())

    def finish_step(self, loss_sum: torch.Tensor) -> StepStats:
        """Optimizer update after :meth:`forward_backward`; the step's mean loss and its other metrics."""
        with self.clock.phase("optimizer"):
            grad_norm, lr = self.opt.step()
        self.step += 1
        loss = loss_sum if self.is_loss_rank else torch.zeros_like(loss_sum)
        dist.all_reduce(loss, group=self.g.world)
        mem = torch.tensor(peak_memory_GiB(self.device), device=self.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=self.g.world)
        return StepStats(float(loss) / (self.cfg.dp * self.cfg.cp * self.m), grad_norm, lr, float(mem[0]),
                         float(mem[1]))
