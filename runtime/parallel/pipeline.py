"""Pipeline parallelism: run this rank's row of the schedule table, with p2p over torch.distributed.

The table comes from :func:`specs.schedules.build_schedule` — the very table the cost model simulates —
and is executed action by action: ``F(mb, chunk)`` receives the activation of virtual stage ``v - 1`` (or
embeds the tokens), runs the chunk and sends its output on (or computes the loss on the last stage);
``B(mb, chunk)`` receives the output gradient (or starts from the loss), runs backward and sends the input
gradient back. Sends are asynchronous (a completed one is let go at the next send, the rest waited at the end of
the step); receives block. A sent output's values are freed at once (:func:`release`): its backward needs only
its place in the autograd graph. Activations and
gradients travel on separate process groups so each stays a FIFO in table order (NCCL matches p2p in
order, not by tag).

Without sequence parallelism a stage boundary's activation (and its gradient) is the same on every
tensor-parallel rank, so each rank sends only its 1/tp slice and the receivers all-gather the slices over
the tensor-parallel group (Megatron's scatter/gather; NVLink instead of the network carries the rest), as
the cost model prices it. With sequence parallelism each rank's tensor already is its own slice. A boundary
tensor holds this rank's tokens: ``(mbs, seq / cp, hidden)``, ``(mbs, seq / cp / tp, hidden)`` under SP (the
trainer passes the shape).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from runtime.models.common import Transformer
from runtime.models.moe import set_aux_scale
from runtime.parallel.mappings import all_gather_into
from runtime.parallel.mesh import ParallelGroups
from runtime.phase_clock import PhaseClock
from specs.parallel import ParallelConfig
from specs.schedules import Action, build_schedule, virtual_stage


class P2P:
    """Point-to-point transfers of one step: sends kept pending until :meth:`finish`.

    With ``split`` (a tensor-parallel group whose ranks all hold the same boundary tensor) a rank sends only
    slice ``tp_rank`` of ``tp`` and a receive all-gathers the slices over ``tp_group``."""

    def __init__(self, tp_group: dist.ProcessGroup | None, tp: int, tp_rank: int, split: bool) -> None:
        self._sends: list[dist.Work] = []
        self.tp_group, self.tp, self.tp_rank, self.split = tp_group, tp, tp_rank, split and tp > 1

    def _sliced(self, numel: int) -> bool:
        return self.split and numel % self.tp == 0

    def send(self, t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
        t = t.contiguous()
        if self._sliced(t.numel()):
            t = t.view(self.tp, -1)[self.tp_rank].contiguous()
        # a completed send's Work lets go of its tensor: keep only those still in flight
        self._sends = [w for w in self._sends if not w.is_completed()]
        self._sends.append(dist.isend(t, dst=dst, group=group))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, src: int,
             group: dist.ProcessGroup) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        if not self._sliced(buf.numel()):
            dist.irecv(buf, src=src, group=group).wait()
            return buf
        part = torch.empty(buf.numel() // self.tp, dtype=dtype, device=device)
        dist.irecv(part, src=src, group=group).wait()
        all_gather_into(buf.view(-1), part, self.tp_group)
        return buf

    def finish(self) -> None:
        for w in self._sends:
            w.wait()
        self._sends.clear()


def release(y: torch.Tensor) -> None:
    """Free a sent stage output's values, keeping its place in the autograd graph (what its backward starts from):
    nothing needs them (a stage ends in a residual add, which saves no output), and the send holds its own
    reference until it completes. Megatron does the same (``deallocate_output_tensor``)."""
    y.data = torch.empty((1,), dtype=y.dtype, device=y.device)


def backward_from(y: torch.Tensor, dy: torch.Tensor) -> None:
    """``y.backward(dy)`` for a released ``y`` (its shape is no longer ``dy``'s, which ``Tensor.backward`` checks):
    the autograd engine run directly, as Megatron's ``custom_backward``."""
    torch.autograd.Variable._execution_engine.run_backward(  # type: ignore[attr-defined]
        tensors=(y,), grad_tensors=(dy,), keep_graph=False, create_graph=False, inputs=(), allow_unreachable=True,
        accumulate_grad=True)


def last_backward(schedule: Sequence[Action]) -> dict[int, int]:
    """Index in the table of each chunk's final backward (where its gradients become complete)."""
    return {a.chunk: i for i, a in enumerate(schedule) if a.kind == "B"}


class PipelineRunner:
    """Executes one training step's forward and backward passes for this pipeline rank."""

    def __init__(self, chunks: list[Transformer], groups: ParallelGroups, cfg: ParallelConfig, microbatches: int,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype, param_dtype: torch.dtype, device: torch.device,
                 on_backward: Callable[[int, bool], None] | None = None, clock: PhaseClock | None = None) -> None:
        self.chunks, self.g, self.cfg, self.m = chunks, groups, cfg, microbatches
        self.schedule = build_schedule(cfg.pp, cfg.vpp, microbatches)[groups.pp_rank]
        self.final_b = last_backward(self.schedule)
        self.nv = cfg.pp * cfg.vpp
        self.act_shape, self.act_dtype, self.param_dtype, self.device = act_shape, act_dtype, param_dtype, device
        self.on_backward = on_backward  # (chunk, is_final) before each backward: DP hooks arm on the final one
        self.p2p = P2P(groups.tp_group, cfg.tp, groups.tp_rank, split=not cfg.sequence_parallel)
        self.clock = clock or PhaseClock()  # where the step's time goes (runtime/phase_clock.py)
        for chunk in chunks:  # the step's loss is the mean over micro-batches: so is each MoE layer's aux loss
            set_aux_scale(chunk, 1.0 / microbatches)

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Run the table; returns the sum of the micro-batch losses on the last stage (0 elsewhere)."""
        g, pp, r = self.g, self.cfg.pp, self.g.pp_rank
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Size]] = {}
        loss_sum = torch.zeros((), device=self.device)
        phase = self.clock.phase
        for i, a in enumerate(self.schedule):
            v = virtual_stage(r, a.chunk, pp)
            first, last = v == 0, v == self.nv - 1
            if a.kind == "F":
                if first:
                    x = inputs[a.microbatch]
                else:
                    with phase("p2p_wait"):
                        buf = self.p2p.recv(self.act_shape, self.act_dtype, self.device, g.pp_peer(r - 1),
                                            g.act_group)
                    x = buf.to(self.param_dtype).requires_grad_()
                with phase("forward"):
                    y = self.chunks[a.chunk](x, targets[a.microbatch] if last else None)
                shape = y.shape
                if last:
                    loss_sum += y.detach().float()
                    y = y / self.m  # the step's loss is the mean over micro-batches
                else:
                    with phase("p2p_send"):
                        self.p2p.send(y.detach().to(self.act_dtype), g.pp_peer(r + 1), g.act_group)
                    release(y)
                saved[(a.microbatch, a.chunk)] = (x, y, shape)
            else:
                x, y, shape = saved.pop((a.microbatch, a.chunk))
                if self.on_backward is not None:
                    self.on_backward(a.chunk, i == self.final_b[a.chunk])
                if last:
                    with phase("backward"):
                        y.backward()
                else:
                    with phase("p2p_wait"):
                        dy = self.p2p.recv(shape, self.act_dtype, self.device, g.pp_peer(r + 1), g.grad_group)
                    with phase("backward"):
                        backward_from(y, dy.to(self.param_dtype))
                if not first:
                    with phase("p2p_send"):
                        self.p2p.send(x.grad.to(self.act_dtype), g.pp_peer(r - 1), g.grad_group)
        with phase("p2p_wait"):  # the last sends complete when their receivers get to them
            self.p2p.finish()
        return loss_sum
