"""Gradient buckets: how a model chunk's parameters are laid out in its flat buffers and cut into the buckets the
data-parallel group ``d`` (dp x cp) reduces — the buckets the cost model counts.

Every bucket is a multiple of ``ALIGN`` elements, and under ZeRO of ``d x ALIGN`` (padded at its end), so it splits
evenly, rank ``r`` owns slice ``r``, and every bucket and slice starts ``ALIGN``-aligned: the fused optimizer and the
norm's multi-tensor kernels take their vectorised path only on 16-byte-aligned tensors (an H100 ran a 1.4B model's
AdamW 31% and its gradient norm 2x slower on buckets cut at arbitrary elements; benchmarks/optimizer_step.py).

* ZeRO-0/1 (:func:`group_segments`): the chunk's parameters, in reverse order of ``parameters()`` (about the
  order backward produces them), grouped by reduce group (:mod:`runtime.parallel.params`), each group contiguous
  and cut into ``ceil(n / state.bucket_params)`` equal buckets of ``ALIGN``-element granularity — a parameter may
  span two; the count ``cost_models.params.gradient_buckets`` prices. A MoE model's routed experts are a reduce group
  of their own, over the expert-data-parallel ranks: their buckets are multiples of that group's size x ``ALIGN``.
* ZeRO-2/3 (:func:`layer_segments`): one bucket per transformer layer, the embedding in the first layer's, the
  final norm and the LM head in the last's (a chunk without layers: one) — the ``layers`` buckets of the cost
  model's ZeRO-2/3 traffic (``cost_models.stages.zero_traffic``). Within one, the parameters also summed over tp
  (SP) sit together, so their owned part is one range. A tied embedding split over the two ends of the pipeline
  is padded and reduced as a bucket of its own inside its layer's (``Bucket.unit`` says which), so that both ends
  own the same rows of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from runtime.models.common import Transformer
from runtime.parallel.params import DP_EMBED, ParamInfo, Reduce
from specs.state import bucket_count

Range = tuple[int, int]
ALIGN = 64  # elements: where buckets (and their ZeRO slices) may start: 128 bytes of bf16, 256 of fp32
Members = list[tuple[nn.Parameter, ParamInfo]]


class Span(NamedTuple):
    """The part ``[start, end)`` (bucket coordinates) of a bucket that holds (part of) a parameter."""

    param: nn.Parameter
    info: ParamInfo
    shape: torch.Size  # the parameter's (a ZeRO-3 parameter is an empty tensor between uses)
    start: int
    end: int


class Segment(NamedTuple):
    """Parameters laid out contiguously and cut into buckets at ``bounds`` (segment coordinates)."""

    reduce: Reduce
    members: Members
    bounds: list[Range]
    unit: int | None  # ZeRO-2/3: the layer bucket its bucket belongs to; None: each bucket is one


@dataclass(eq=False)
class Bucket:
    chunk: int
    unit: int  # which of its chunk's buckets the cost model counts this is (part of)
    reduce: Reduce  # the groups (some of) its gradients are summed over
    spans: list[Span]
    size: int  # elements, padding included
    lo: int  # the slice this rank owns (everything for ZeRO-0)
    hi: int
    param_data: torch.Tensor  # the bucket's parameters: a view of the chunk's buffer (ZeRO-3: gathered, or size 0)
    param_shard: torch.Tensor  # the owned slice of them, which the optimizer updates
    grad_data: torch.Tensor | None  # the bucket's gradients (ZeRO-0/1; ZeRO-2/3 keep none)
    grad_shard: torch.Tensor  # the owned slice: after DataParallel.finish_grad_sync, the average
    pending: set[int] = field(default_factory=set)  # ids of the parameters whose gradient has not landed yet
    work: dist.Work | None = None  # ZeRO-0/1: its reduce in flight
    launched: bool = False  # reduced (or launched) during this step's backward
    scatter: tuple[torch.Tensor, dist.Work | None] | None = None  # ZeRO-2/3: a reduce-scatter not yet added in
    gather_work: dist.Work | None = None
    gathered: bool = True  # ZeRO-3: its parameters are present
    group: dist.ProcessGroup | None = None  # the ranks it is reduced (and under ZeRO sharded) over
    d: int = 1  # their number

    def owned(self, keep: Callable[[Span], bool]) -> list[Range]:
        """Merged ranges, in owned-slice coordinates, of the spans ``keep`` accepts."""
        out: list[Range] = []
        for s in self.spans:
            a, b = max(s.start, self.lo), min(s.end, self.hi)
            if a < b and keep(s):
                a, b = a - self.lo, b - self.lo
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out


def bucket_bounds(n: int, bucket_params: int, unit: int = 1, align: int = 1) -> list[Range]:
    """``[start, end)`` of each bucket of an ``n``-element reduce group: ``ceil(n / bucket_params)`` buckets of
    equal size (within ``unit``), each a multiple of ``unit x align`` elements (the last one padded), or of ``unit``
    alone where buckets that coarse would leave some empty (a ``bucket_params`` below ``unit x align``)."""
    k = bucket_count(n, bucket_params)
    if -(-n // (unit * align)) >= k:
        unit *= align
    units = -(-n // unit)
    return [(i * units // k * unit, (i + 1) * units // k * unit) for i in range(k)]


def users(chunk: Transformer) -> list[nn.Module]:
    """The modules a chunk runs, in forward order: embedding, layers, head (every parameter is in one of them)."""
    return [m for m in (chunk.embed, *chunk.layers.values(), chunk.head) if m is not None]


def numel(members: Members) -> int:
    return sum(p.numel() for p, _ in members)


def group_segments(params: Members, bucket_params: int, unit: Callable[[Reduce], int]) -> list[Segment]:
    """ZeRO-0/1: a segment per reduce group, cut into ``ceil(n / bucket_params)`` buckets, multiples of
    ``unit(reduce group) x ALIGN`` (:func:`bucket_bounds`)."""
    groups: dict[Reduce, Members] = {}
    for p, info in params:
        groups.setdefault(info.reduce, []).append((p, info))
    return [Segment(r, m, bucket_bounds(numel(m), bucket_params, unit(r), ALIGN), None) for r, m in groups.items()]


def layer_of(chunk: Transformer) -> dict[int, int]:
    """ZeRO-2/3's bucket of each parameter (by id): its layer's index in the chunk, the embedding's the first,
    the head's the last."""
    last = max(len(chunk.layers) - 1, 0)
    out: dict[int, int] = {}
    for i, mod in enumerate(users(chunk)):
        for p in mod.parameters():
            out.setdefault(id(p), min(max(i - int(chunk.first), 0), last))
    return out


def layer_segments(chunk: Transformer, params: Members, d: int) -> list[Segment]:
    """ZeRO-2/3: a bucket per layer, padded to a multiple of ``d x ALIGN`` (a split tied embedding one of its own)."""
    layer = layer_of(chunk)
    parts: dict[tuple[int, bool], Members] = {}
    for p, info in params:
        parts.setdefault((layer[id(p)], info.reduce == DP_EMBED), []).append((p, info))
    out = []
    for (unit, _), members in parts.items():
        members.sort(key=lambda m: m[1].reduce)  # stable: the ones summed over tp too form one range
        reduce = tuple(dict.fromkeys(g for _, info in members for g in info.reduce))
        out.append(Segment(reduce, members, bucket_bounds(numel(members), numel(members), d, ALIGN), unit))
    return out
