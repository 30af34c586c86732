"""Tensor parallelism (Megatron-style) and sequence parallelism for the plain models.

* :class:`ColumnParallelLinear` splits the output features: each fused part (q | k | v, gate | up) is split
  separately, so heads stay whole on a rank. Input: replicated (``copy_to_tp``) or, under SP, gathered
  from sequence shards.
* :class:`RowParallelLinear` splits the input features and sums the partial outputs: all-reduce, or under
  SP a reduce-scatter back to sequence shards. Its bias is added after the reduction.
* :class:`VocabParallelEmbedding` and :class:`VocabParallelOutput` split the vocabulary (padded to a
  multiple of tp with zero rows); the loss is ``kernels.vocab_parallel_linear_cross_entropy``, so full
  logits never exist on one rank.

Each parallel module lists its sharded parameters in ``shards`` (parameter name -> :class:`ShardSpec`, the
recipe that slices it out of the full tensor); :func:`param_shards` collects them for ``parallelize``, which
records them in each parameter's :class:`~runtime.parallel.params.ParamInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from runtime import kernels
from runtime.models.common import LearnedPositions, OutputLayer, TokenEmbedding, Transformer
from runtime.models.moe import MoE
from runtime.parallel.collective_matmul import gather_linear, linear_scatter
from runtime.parallel.mappings import (
    copy_to_tp,
    gather_from_sp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    sp_column_linear,
)
from runtime.parallel.mesh import ParallelGroups
from specs.errors import AutoparError


@dataclass(frozen=True)
class ShardSpec:
    """Rank ``rank`` of ``size`` holds chunk ``rank`` of every segment along ``dim`` (segments padded to a
    multiple of ``size`` with zeros), concatenated."""

    dim: int
    segments: tuple[int, ...]
    rank: int
    size: int

    def _chunk(self, seg: int) -> int:
        return -(-seg // self.size)

    def full_shape(self, local: torch.Size) -> torch.Size:
        shape = list(local)
        shape[self.dim] = sum(self.segments)
        return torch.Size(shape)

    def local_len(self) -> int:
        return sum(self._chunk(s) for s in self.segments)

    def held(self) -> list[tuple[int, int, int]]:
        """Per segment, the part of it this rank holds: (offset in the shard, offset in the full tensor, length);
        in the shard each takes a whole chunk, the rest zero padding (a length of 0 when the rank holds none)."""
        out, local, full = [], 0, 0
        for seg in self.segments:
            c = self._chunk(seg)
            lo, hi = min(self.rank * c, seg), min((self.rank + 1) * c, seg)
            out.append((local, full + lo, hi - lo))
            local, full = local + c, full + seg
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the full tensor."""
        parts = []
        for (_, at, n), seg in zip(self.held(), self.segments):
            part = full.narrow(self.dim, at, n)
            c = self._chunk(seg)
            if n < c:  # zero padding at the end of the last rank's chunk
                pad = list(part.shape)
                pad[self.dim] = c - n
                part = torch.cat((part, part.new_zeros(pad)), self.dim)
            parts.append(part)
        return torch.cat(parts, self.dim) if len(parts) > 1 else parts[0].clone()

    def blocks(self, local: torch.Size) -> list[Block]:
        """The rectangular blocks of the full tensor a shard of shape ``local`` holds, one per segment part it
        holds (:meth:`held`; padding and empty parts left out)."""
        out = []
        for off, at, n in self.held():
            if n:
                where, start, size = [0] * len(local), [0] * len(local), list(local)
                where[self.dim], start[self.dim], size[self.dim] = off, at, n
                out.append(Block(tuple(where), tuple(start), tuple(size)))
        return out

    def assemble(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard (in rank order)."""
        out, off = [], 0
        for seg in self.segments:
            c = self._chunk(seg)
            out.append(torch.cat([s.narrow(self.dim, off, c) for s in shards], self.dim).narrow(self.dim, 0, seg))
            off += c
        return torch.cat(out, self.dim)


class Block(NamedTuple):
    """A rectangle of a shard: its offsets in the shard, its offsets in the full tensor, its sizes."""

    local: tuple[int, ...]
    full: tuple[int, ...]
    size: tuple[int, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This block of the shard ``t`` (a view)."""
        return t[tuple(slice(o, o + n) for o, n in zip(self.local, self.size))]


@dataclass(frozen=True)
class Nested:
    """A slice of a slice: ``outer`` (over one group) cut from the full tensor, then ``inner`` (over another, along
    another dimension) cut from that; e.g. a routed expert's weights over ep (experts) and etp (their width)."""

    outer: ShardSpec
    inner: ShardSpec

    def full_shape(self, local: torch.Size) -> torch.Size:
        return self.outer.full_shape(self.inner.full_shape(local))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return self.inner.take(self.outer.take(full))

    def blocks(self, local: torch.Size) -> list[Block]:
        out = []
        for a in self.outer.blocks(self.inner.full_shape(local)):
            for b in self.inner.blocks(local):
                d = self.outer.dim
                out.append(Block(tuple(a.local[i] if i == d else b.local[i] for i in range(len(local))),
                                 tuple(a.full[i] if i == d else b.full[i] for i in range(len(local))),
                                 tuple(a.size[i] if i == d else b.size[i] for i in range(len(local)))))
        return out


Sharding = ShardSpec | Nested


def _sharded(shape: tuple[int, ...], spec: ShardSpec, like: torch.Tensor) -> nn.Parameter:
    local = list(shape)
    local[spec.dim] = spec.local_len()
    return nn.Parameter(torch.empty(local, dtype=like.dtype, device=like.device))


class ShardedModule(nn.Module):
    """A tensor-parallel module: ``shards`` names its sharded parameters and their slices."""

    shards: dict[str, Sharding]


def param_shards(module: nn.Module) -> dict[int, ShardSpec]:
    """The shard spec of every sharded parameter under ``module``, by ``id`` of the parameter."""
    out = {}
    for mod in module.modules():
        if isinstance(mod, ShardedModule):
            for name, spec in mod.shards.items():
                out[id(mod._parameters[name])] = spec
    return out


def _overlap(overlap: bool, sp: bool) -> bool:
    """``overlap`` where the plan has it in effect (``ParallelConfig.tensor_overlap``): it splits the sequence-parallel
    collectives, so without ``sp`` it is a caller's mistake."""
    if overlap and not sp:
        raise ValueError("tensor-parallel overlap needs sequence parallelism (ParallelConfig.tensor_overlap)")
    return overlap


class ColumnParallelLinear(ShardedModule):
    def __init__(self, lin: nn.Linear, segments: tuple[int, ...], g: ParallelGroups, sp: bool,
                 overlap: bool = False) -> None:
        super().__init__()
        self.group, self.sp, self.overlap = g.tp_group, sp, _overlap(overlap, sp)
        spec = ShardSpec(0, segments, g.tp_rank, g.tp)
        self.weight = _sharded(tuple(lin.weight.shape), spec, lin.weight)
        self.bias = _sharded(tuple(lin.bias.shape), spec, lin.bias) if lin.bias is not None else None
        self.shards = {"weight": spec} | ({"bias": spec} if self.bias is not None else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap:
            return gather_linear(x, self.weight, self.bias, self.group)
        if self.sp:
            return sp_column_linear(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(ShardedModule):
    def __init__(self, lin: nn.Linear, g: ParallelGroups, sp: bool, overlap: bool = False) -> None:
        super().__init__()
        self.group, self.sp, self.overlap = g.tp_group, sp, _overlap(overlap, sp)
        spec = ShardSpec(1, (lin.in_features,), g.tp_rank, g.tp)
        self.weight = _sharded(tuple(lin.weight.shape), spec, lin.weight)
        self.bias = lin.bias  # replicated, added once after the reduction
        self.shards = {"weight": spec}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap:
            y = linear_scatter(x, self.weight, self.group)
        else:
            y = F.linear(x, self.weight)
            y = reduce_scatter_to_sp(y, self.group) if self.sp else reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(ShardedModule):
    def __init__(self, tok: TokenEmbedding, g: ParallelGroups, sp: bool) -> None:
        super().__init__()
        self.group, self.sp = g.tp_group, sp
        vocab = tok.weight.shape[0]
        spec = ShardSpec(0, (vocab,), g.tp_rank, g.tp)
        self.weight = _sharded(tuple(tok.weight.shape), spec, tok.weight)
        self.shards = {"weight": spec}
        self.start, self.per = g.tp_rank * spec.local_len(), spec.local_len()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.start + self.per)
        x = F.embedding((tokens - self.start).masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sp(x, self.group) if self.sp else reduce_from_tp(x, self.group)


class SequenceParallelPositions(nn.Module):
    """Learned positions for this rank's sequence shard only (the weight stays replicated)."""

    def __init__(self, pos: LearnedPositions, g: ParallelGroups) -> None:
        super().__init__()
        self.weight = pos.weight
        self.rank, self.size = g.tp_rank, g.tp

    def forward(self, seq: int) -> torch.Tensor:
        n = seq // self.size
        return self.weight[self.rank * n:(self.rank + 1) * n]


class VocabParallelOutput(ShardedModule):
    """The LM head over a vocabulary shard; ``loss`` matches :meth:`OutputLayer.loss` (the mean)."""

    def __init__(self, out: OutputLayer, g: ParallelGroups, sp: bool, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.group, self.sp = g.tp_group, sp
        self.vocab = out.weight.shape[0]
        spec = ShardSpec(0, (self.vocab,), g.tp_rank, g.tp)
        self.weight = weight if weight is not None else _sharded(tuple(out.weight.shape), spec, out.weight)
        self.shards = {"weight": spec}
        self.start = g.tp_rank * spec.local_len()
        self.rows = min(spec.local_len(), self.vocab - self.start)  # the rest is padding
        if self.rows <= 0:
            raise AutoparError(f"vocabulary {self.vocab} is too small to give each of tp={g.tp} ranks a shard")

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.group) if self.sp else copy_to_tp(x, self.group)
        return kernels.vocab_parallel_linear_cross_entropy(
            x.flatten(0, -2), self.weight[: self.rows], target.reshape(-1), self.start, self.group)


def apply_tensor_parallel(stage: Transformer, g: ParallelGroups, sp: bool, overlap: bool = False) -> None:
    """Swap a stage's modules for their tensor-parallel versions (on the meta device, before init); with
    ``overlap`` (in effect only with ``sp``: ``ParallelConfig.tensor_overlap``) the layers' all-gathers and
    reduce-scatters overlap their GEMMs (collective_matmul.py)."""
    if g.tp == 1:
        return
    spec = stage.spec
    for layer in stage.layers.values():
        attn = layer.attn
        attn.qkv = ColumnParallelLinear(attn.qkv, (spec.q_width, spec.kv_width, spec.kv_width), g, sp, overlap)
        attn.proj = RowParallelLinear(attn.proj, g, sp, overlap)
        attn.n_heads //= g.tp
        attn.n_kv_heads //= g.tp
        mlp = layer.mlp
        if isinstance(mlp, MoE):  # the shared experts split like a dense MLP; the rest: expert_parallel.py
            mlp = mlp.shared
        if mlp is None:
            continue
        if hasattr(mlp, "gate_up"):
            width = mlp.down.in_features
            mlp.gate_up = ColumnParallelLinear(mlp.gate_up, (width, width), g, sp, overlap)
            mlp.down = RowParallelLinear(mlp.down, g, sp, overlap)
        else:
            mlp.fc = ColumnParallelLinear(mlp.fc, (spec.ffn,), g, sp, overlap)
            mlp.proj = RowParallelLinear(mlp.proj, g, sp, overlap)
    tied = None
    if stage.embed is not None:
        old = stage.embed.tok.weight
        stage.embed.tok = VocabParallelEmbedding(stage.embed.tok, g, sp)
        if stage.head is not None and stage.head.out.weight is old:
            tied = stage.embed.tok.weight
        if sp and stage.embed.pos is not None:
            stage.embed.pos = SequenceParallelPositions(stage.embed.pos, g)
    if stage.head is not None:
        stage.head.out = VocabParallelOutput(stage.head.out, g, sp, weight=tied)
