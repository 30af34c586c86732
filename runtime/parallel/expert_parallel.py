"""Expert parallelism for the mixture-of-experts layers (runtime/models/moe.py), and their MoE layers under
tensor/sequence parallelism.

* **Experts over ep.** Rank ``j`` of an expert-parallel group (:mod:`runtime.parallel.mesh`) holds experts ``[j E/ep,
  (j+1) E/ep)``: dim-0 slices of the stacked ``experts.gate_up`` / ``experts.down``. Each rank routes its own tokens;
  :class:`ExpertShard` sorts the (token, choice) pairs by expert, sends each expert's rows to the rank holding it with
  one ``all_to_all_single`` (uneven splits; the per-expert counts first, in a small all-to-all), runs its experts on
  what it received (``kernels.experts_swiglu``: grouped GEMMs on GPU, a loop on CPU; empty experts included, so every
  rank's backward issues the same collectives), sends the results back the same way and sums each token's k outputs
  with its router weights. The backward runs both all-to-alls in reverse
  (:func:`~runtime.parallel.mappings.all_to_all`). The experts' gradients are summed over the expert-data-parallel
  group (``params.EDP``).
* **Under sequence parallelism** (tp > 1 with sp, which a MoE plan needs) a MoE layer sees the sequence shard of
  its tensor-parallel rank: the router and the shared experts' gate are whole on every tp rank and sum their
  gradients over tp (``params.DP_TP``); the shared experts are a column-/row-parallel MLP (tensor_parallel.py).
  **Under context parallelism** it sees its cp rank's tokens. Either way the aux loss's expert-choice counts are
  summed over the ranks holding shards of the same sequences (``ParallelGroups.seq_group``: an all-reduce per
  layer and micro-batch), so each sequence's loss is the whole sequence's; a cp rank weighs its share cp times, as
  its gradients are averaged over cp with the data-parallel ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from runtime import kernels
from runtime.models.common import Transformer
from runtime.models.moe import Experts, MoE, by_expert, combine
from runtime.parallel.mappings import all_to_all, all_to_all_rows
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.tensor_parallel import ShardedModule, ShardSpec


class ExpertShard(ShardedModule):
    """This rank's experts of a MoE layer and the token exchange with the rest of its expert-parallel group."""

    def __init__(self, num: int, hidden: int, ffn: int, g: ParallelGroups) -> None:
        super().__init__()
        assert g.ep_group is not None
        self.group, self.ep, self.num = g.ep_group, g.ep, num
        self.local = num // g.ep
        self.gate_up = nn.Parameter(torch.empty(self.local, 2 * ffn, hidden, device="meta"))
        self.down = nn.Parameter(torch.empty(self.local, hidden, ffn, device="meta"))
        spec = ShardSpec(0, (num,), g.ep_rank, g.ep)
        self.shards = {"gate_up": spec, "down": spec}

    def forward(self, x: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` [N, h] tokens, ``choice`` / ``weight`` [N, k] their experts and weights -> [N, h]."""
        order, token, sent = by_expert(choice, self.num)  # sent: [E] rows this rank sends each expert
        got = all_to_all_rows(sent, [self.local] * self.ep, [self.local] * self.ep, self.group).view(self.ep, -1)
        out_rows, in_rows = got.sum(1).tolist(), sent.view(self.ep, -1).sum(1).tolist()
        rows = all_to_all(x[token], out_rows, in_rows, self.group)  # from each source, by its local expert
        expert = torch.repeat_interleave(torch.arange(self.local, device=x.device).repeat(self.ep), got.reshape(-1))
        regroup = torch.sort(expert, stable=True).indices  # the received rows by local expert
        y = kernels.experts_swiglu(rows[regroup], self.gate_up, self.down, got.sum(0))
        y = torch.empty_like(y).index_copy(0, regroup, y)  # back in the order they came
        back = all_to_all(y, in_rows, out_rows, self.group)  # the pairs' outputs, in ``order``
        return combine(x, token, order, back, weight)


def routed_expert_params(module: nn.Module) -> set[int]:
    """The ids of the routed experts' parameters under ``module`` (whole or sliced over ep)."""
    return {id(p) for m in module.modules() if isinstance(m, (Experts, ExpertShard)) for p in m.parameters()}


def _sum_over(group: dist.ProcessGroup):  # noqa: ANN202
    def total(counts: torch.Tensor) -> torch.Tensor:
        counts = counts.contiguous()
        dist.all_reduce(counts, group=group)
        return counts
    return total


def apply_expert_parallel(stage: Transformer, g: ParallelGroups, sp: bool) -> None:
    """Give each MoE layer of a stage (on the meta device, before init) its experts' shard when ep > 1, and where
    sequence or context parallelism splits its sequences the sum of its aux-loss counts over their shards."""
    for layer in stage.layers.values():
        moe = layer.mlp
        if not isinstance(moe, MoE):
            continue
        if g.ep > 1:
            gate_up = moe.experts.gate_up
            moe.experts = ExpertShard(gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2, g)
        shards = (g.tp if sp else 1) * g.cp
        if shards > 1:
            assert g.seq_group is not None
            moe.sequence_sum, moe.sequence_shards, moe.shard_weight = _sum_over(g.seq_group), shards, g.cp
