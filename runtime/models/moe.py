"""A mixture-of-experts MLP (``moe:`` in the model spec, specs/moe.py), written plainly: no parallel code.

The router scores every token against the ``num_experts`` experts in fp32 (softmax, or sigmoid), keeps the top
``experts_per_token`` (ties broken by the lower expert index, so routing is deterministic), optionally renormalises
their weights, and sums the chosen experts' SwiGLU outputs with those weights; shared experts (one SwiGLU MLP of
their total width, optionally gated by a sigmoid) see every token. The experts' weights are two stacked tensors,
``experts.gate_up`` [E, 2f, h] and ``experts.down`` [E, h, f], so expert parallelism can split them on dim 0.

The auxiliary load-balancing loss is computed per sequence (E x sum_e f_e P_e, f_e the share of the sequence's
token choices routed to expert e, P_e its mean routing probability, probabilities normalised per token) and
averaged over the sequences of the batch, so it is the same whether a batch is run at once or in micro-batches.
It is not added to the returned loss: :class:`AuxLoss` passes the MoE output through unchanged and adds the aux
loss's gradient in the backward (as Megatron-Core's MoEAuxLossAutoScaler does), scaled by ``aux_scale``: 1 for a
whole batch, 1 / micro-batches when the pipeline averages micro-batch losses (:func:`set_aux_scale`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from runtime import kernels
from runtime.models.common import SwiGLU
from specs.model import ModelSpec


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class AuxLoss(torch.autograd.Function):
    """Identity on ``out``; its backward also gives ``aux`` the gradient ``scale`` (so d(scale x aux) reaches the
    router) whatever the loss downstream is."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=grad.device), None


def by_expert(choice: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs of ``choice`` [N, k] sorted by expert, then token: (their flat indices, their
    tokens, the pairs per expert [num])."""
    flat = choice.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    return order, order // choice.shape[1], torch.bincount(flat, minlength=num)


def combine(x: torch.Tensor, token: torch.Tensor, order: torch.Tensor, y: torch.Tensor,
            weight: torch.Tensor) -> torch.Tensor:
    """Each token's expert outputs ``y`` (rows in :func:`by_expert`'s order) summed with its router ``weight``."""
    return torch.zeros_like(x).index_add(0, token, y * weight.reshape(-1)[order].unsqueeze(1))


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs as stacked weights; ``forward`` runs each on the tokens routed to it."""

    def __init__(self, num: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num, 2 * ffn, hidden))
        self.down = nn.Parameter(torch.empty(num, hidden, ffn))

    def forward(self, x: torch.Tensor, choice: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x`` [N, h] tokens, ``choice`` / ``weight`` [N, k] their experts and weights -> [N, h]."""
        order, token, counts = by_expert(choice, self.gate_up.shape[0])
        y = kernels.experts_swiglu(x[token], self.gate_up, self.down, counts)
        return combine(x, token, order, y, weight)


class MoE(nn.Module):
    """Router, routed experts and shared experts of one MoE layer (the MLP of a :class:`LlamaBlock`)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        moe = spec.moe
        assert moe is not None
        self.moe = moe
        self.router = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, spec.hidden_size, moe.moe_ffn_hidden_size)
        self.shared = SwiGLU(spec.hidden_size, moe.shared_ffn) if moe.shared_ffn else None
        self.shared_gate = nn.Linear(spec.hidden_size, 1, bias=False) if moe.shared_expert_gate else None
        self.aux_scale = 1.0  # gradient scale of the aux loss (set_aux_scale)
        # how the expert-choice counts of a sequence split over ranks are summed, and into how many shards; the
        # weight of this shard's aux gradient (its number of shards whose gradients are averaged, not summed)
        self.sequence_sum: Callable[[torch.Tensor], torch.Tensor] = _same
        self.sequence_shards = 1
        self.shard_weight = 1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities [b, s, E] in fp32, chosen experts [b, s, k], their weights [b, s, k]) of tokens ``x``."""
        logits = F.linear(x.float(), self.router.weight.float())
        probs = torch.softmax(logits, -1) if self.moe.router == "softmax" else torch.sigmoid(logits)
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices  # ties: the lower index first
        choice = order[..., : self.moe.experts_per_token]
        weight = probs.gather(-1, choice)
        if self.moe.norm_topk_prob:
            weight = weight / weight.sum(-1, keepdim=True)
        return probs, choice, weight

    def aux_loss(self, probs: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss, per sequence and averaged over the batch (see the module docstring).

        The counts of each sequence's expert choices go through :attr:`sequence_sum` (identity here: the layer sees
        whole sequences), so a layer that sees one of :attr:`sequence_shards` shards of each sequence can sum them
        over the shards; the probabilities' part is then this shard's share of the sum, so the shards' gradients add
        up to the whole sequence's (times :attr:`shard_weight` where they are averaged instead)."""
        E = probs.shape[-1]
        counts, tokens = self.sequence_sum(F.one_hot(choice, E).sum(-2).float().sum(-2)), probs.shape[-2]  # [b, E]
        tokens = tokens * self.sequence_shards
        share = counts / (tokens * choice.shape[-1])  # f_e (no gradient)
        p = probs / probs.sum(-1, keepdim=True)
        return self.shard_weight * E * (share * p.sum(-2) / tokens).sum(-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, choice, weight = self.route(x)
        flat = x.reshape(-1, x.shape[-1])
        out = self.experts(flat, choice.reshape(flat.shape[0], -1), weight.reshape(flat.shape[0], -1).to(x.dtype))
        out = out.view_as(x)
        if self.shared is not None:
            s = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * s if self.shared_gate is not None else s)
        if self.training and self.moe.aux_loss_coef > 0 and torch.is_grad_enabled():
            out = AuxLoss.apply(out, self.moe.aux_loss_coef * self.aux_loss(probs, choice), self.aux_scale)
        return out


def set_aux_scale(module: nn.Module, scale: float) -> None:
    """Scale the aux losses' gradient of every MoE layer in ``module`` (1 / micro-batches under a pipeline that
    averages its micro-batches' losses)."""
    for m in module.modules():
        if isinstance(m, MoE):
            m.aux_scale = scale
