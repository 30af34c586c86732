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
* **Experts' width over etp.** With etp > 1 each rank holds 1/etp of every local expert's width (gate|up split by
  columns, down by rows, as a column-/row-parallel MLP); after the dispatch the rows of the etp group are gathered
  (every rank computes its width of all of them) and the partial outputs are reduced back onto the rank each row
  came from, both as all-to-alls of uneven rows (the per-expert counts all-gathered first).
* **Under sequence parallelism** (tp > 1 with sp, which a MoE plan needs) a MoE layer sees the sequence shard of
  its tensor-parallel rank: the router and the shared experts' gate are whole on every tp rank and sum their
  gradients over tp (``params.DP_TP``); the shared experts are a column-/row-parallel MLP (tensor_parallel.py).
  **Under context parallelism** it sees its cp rank's tokens. Either way the aux loss's expert-choice counts are
  summed over the ranks holding shards of the same sequences (``ParallelGroups.seq_group``: an all-reduce per
  layer and micro-batch), so each sequence's loss is the whole sequence's; a cp rank weighs its share cp times, as
  its gradients are averaged over cp with the data-parallel ones.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from runtime import kernels
from runtime.models.common import Transformer
from runtime.models.moe import Experts, MoE, by_expert, combine
from runtime.parallel.mappings import all_gather_into, all_reduce_sum, all_to_all, all_to_all_rows
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.tensor_parallel import Nested, ShardedModule, ShardSpec


class ExpertShard(ShardedModule):
    """This rank's experts of a MoE layer (E/ep of them, each 1/etp of its width) and the token exchange with the
    rest of its expert-parallel and expert-tensor-parallel groups."""

    def __init__(self, num: int, hidden: int, ffn: int, g: ParallelGroups) -> None:
        super().__init__()
        self.ep, self.etp, self.num = g.ep, g.etp, num
        self.ep_group, self.etp_group = g.ep_group, g.etp_group
        self.local = num // g.ep
        experts = ShardSpec(0, (num,), g.ep_rank, g.ep)
        width = {"gate_up": ShardSpec(1, (ffn, ffn), g.etp_rank, self.etp), "down": ShardSpec(2, (ffn,), g.etp_rank,
                                                                                              self.etp)}
        part = width["down"].local_len()
        self.gate_up = nn.Parameter(torch.empty(self.local, 2 * part, hidden, device="meta"))
        self.down = nn.Parameter(torch.empty(self.local, hidden, part, device="meta"))
        self.shards = {name: (Nested(experts, w) if self.ep > 1 and self.etp > 1 else experts if self.ep > 1 else w)
                       for name, w in width.items()}
        self.over = "ep+etp" if self.ep > 1 and self.etp > 1 else "ep" if self.ep > 1 else "etp"

    def forward(self, x: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` [N, h] tokens, ``choice`` / ``weight`` [N, k] their experts and weights -> [N, h]."""
        order, token, sent = by_expert(choice, self.num)  # sent: [E] rows this rank sends each expert
        rows, got = x[token], sent.view(1, -1)
        if self.ep > 1:
            got = all_to_all_rows(sent, [self.local] * self.ep, [self.local] * self.ep, self.ep_group)
            got = got.view(self.ep, -1)  # [source, local expert]
            out_rows, in_rows = got.sum(1).tolist(), sent.view(self.ep, -1).sum(1).tolist()
            rows = all_to_all(rows, out_rows, in_rows, self.ep_group)  # from each source, by its local expert
        y = self._experts(rows, got) if self.etp == 1 else self._experts_split(rows, got)
        if self.ep > 1:
            y = all_to_all(y, in_rows, out_rows, self.ep_group)  # the pairs' outputs, in ``order``
        return combine(x, token, order, y, weight)

    def _experts(self, rows: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
        """The local experts on ``rows`` (``got[s, e]`` consecutive rows per source s and local expert e), back in
        that order."""
        expert = torch.repeat_interleave(torch.arange(self.local, device=rows.device).repeat(got.shape[0]),
                                         got.reshape(-1))
        regroup = torch.sort(expert, stable=True).indices  # the rows by local expert
        y = kernels.experts_swiglu(rows[regroup], self.gate_up, self.down, got.sum(0))
        return torch.empty_like(y).index_copy(0, regroup, y)

    def _experts_split(self, rows: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
        """The local experts' 1/etp widths on the rows of every etp rank (gathered), their partial outputs summed
        back on the rank each row came from: both exchanges are all-to-alls with uneven rows."""
        mine = rows.shape[0]
        every = got.new_empty(self.etp * got.numel())
        all_gather_into(every, got.reshape(-1), self.etp_group)
        every = every.view(self.etp, *got.shape)
        theirs = every.sum((1, 2)).tolist()
        gathered = all_to_all(rows.repeat(self.etp, 1), theirs, [mine] * self.etp, self.etp_group)
        partial = self._experts(gathered, every.reshape(-1, got.shape[1]))
        back = all_to_all(partial, [mine] * self.etp, theirs, self.etp_group)
        return back.view(self.etp, mine, -1).sum(0)


def routed_expert_params(module: nn.Module) -> dict[int, str]:
    """The routed experts' parameters under ``module``, by id: the group(s) whose ranks hold their other slices
    (``ParamInfo.shard_over``; "ep" for whole experts, which have none)."""
    return {id(p): m.over if isinstance(m, ExpertShard) else "ep"
            for m in module.modules() if isinstance(m, (Experts, ExpertShard)) for p in m.parameters()}


def apply_expert_parallel(stage: Transformer, g: ParallelGroups, sp: bool) -> None:
    """Give each MoE layer of a stage (on the meta device, before init) its experts' shard when ep > 1, and where
    sequence or context parallelism splits its sequences the sum of its aux-loss counts over their shards."""
    for layer in stage.layers.values():
        moe = layer.mlp
        if not isinstance(moe, MoE):
            continue
        if g.ep > 1 or g.etp > 1:
            gate_up = moe.experts.gate_up
            moe.experts = ExpertShard(gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2, g)
        shards = (g.tp if sp else 1) * g.cp
        if shards > 1:
            assert g.seq_group is not None
            moe.sequence_sum = functools.partial(all_reduce_sum, group=g.seq_group)
            moe.sequence_shards, moe.shard_weight = shards, g.cp
