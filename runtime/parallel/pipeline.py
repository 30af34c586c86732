"""Pipeline parallelism: run this rank's row of the schedule table, with p2p over torch.distributed.

The table comes from :func:`planner.schedules.build_schedule` — the very table the cost model simulates —
and is executed action by action: ``F(mb, chunk)`` receives the activation of virtual stage ``v - 1`` (or
embeds the tokens), runs the chunk and sends its output on (or computes the loss on the last stage);
``B(mb, chunk)`` receives the output gradient (or starts from the loss), runs backward and sends the input
gradient back. Sends are asynchronous and waited at the end of the step; receives block. Activations and
gradients travel on separate process groups so each stays a FIFO in table order (NCCL matches p2p in
order, not by tag).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from planner.parallel import ParallelConfig
from planner.schedules import Action, build_schedule
from runtime.models.common import Transformer
from runtime.parallel.mesh import ParallelGroups


class P2P:
    """Point-to-point transfers of one step: sends kept pending until :meth:`finish`."""

    def __init__(self) -> None:
        self._sends: list[dist.Work] = []

    def send(self, t: torch.Tensor, dst: int, group: dist.ProcessGroup) -> None:
        self._sends.append(dist.isend(t.contiguous(), dst=dst, group=group))

    def recv(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, src: int,
             group: dist.ProcessGroup) -> torch.Tensor:
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.irecv(buf, src=src, group=group).wait()
        return buf

    def finish(self) -> None:
        for w in self._sends:
            w.wait()
        self._sends.clear()


def last_backward(schedule: Sequence[Action]) -> dict[int, int]:
    """Index in the table of each chunk's final backward (where its gradients become complete)."""
    return {a.chunk: i for i, a in enumerate(schedule) if a.kind == "B"}


class PipelineRunner:
    """Executes one training step's forward and backward passes for this pipeline rank."""

    def __init__(self, chunks: list[Transformer], groups: ParallelGroups, cfg: ParallelConfig, microbatches: int,
                 act_shape: tuple[int, ...], act_dtype: torch.dtype, param_dtype: torch.dtype, device: torch.device,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 on_backward: Callable[[int, bool], None] | None = None) -> None:
        self.chunks, self.g, self.cfg, self.m = chunks, groups, cfg, microbatches
        self.schedule = build_schedule(cfg.pp, cfg.vpp, microbatches)[groups.pp_rank]
        self.final_b = last_backward(self.schedule)
        self.nv = cfg.pp * cfg.vpp
        self.act_shape, self.act_dtype, self.param_dtype, self.device = act_shape, act_dtype, param_dtype, device
        self.autocast = autocast
        self.on_backward = on_backward  # (chunk, is_final) before each backward: DP hooks arm on the final one
        self.p2p = P2P()

    def step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> torch.Tensor:
        """Run the table; returns the sum of the micro-batch losses on the last stage (0 elsewhere)."""
        g, pp, r = self.g, self.cfg.pp, self.g.pp_rank
        saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        loss_sum = torch.zeros((), device=self.device)
        for i, a in enumerate(self.schedule):
            v = a.chunk * pp + r
            first, last = v == 0, v == self.nv - 1
            if a.kind == "F":
                if first:
                    x = inputs[a.microbatch]
                else:
                    buf = self.p2p.recv(self.act_shape, self.act_dtype, self.device, g.pp_peer(r - 1), g.act_group)
                    x = buf.to(self.param_dtype).requires_grad_()
                with self.autocast():
                    y = self.chunks[a.chunk](x, targets[a.microbatch] if last else None)
                if last:
                    loss_sum += y.detach().float()
                    y = y / self.m  # the step's loss is the mean over micro-batches
                else:
                    self.p2p.send(y.detach().to(self.act_dtype), g.pp_peer(r + 1), g.act_group)
                saved[(a.microbatch, a.chunk)] = (x, y)
            else:
                x, y = saved.pop((a.microbatch, a.chunk))
                if self.on_backward is not None:
                    self.on_backward(a.chunk, i == self.final_b[a.chunk])
                if last:
                    y.backward()
                else:
                    dy = self.p2p.recv(y.shape, self.act_dtype, self.device, g.pp_peer(r + 1), g.grad_group)
                    y.backward(dy.to(y.dtype))
                if not first:
                    self.p2p.send(x.grad.to(self.act_dtype), g.pp_peer(r - 1), g.grad_group)
        self.p2p.finish()
        return loss_sum
