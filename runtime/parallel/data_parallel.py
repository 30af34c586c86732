"""Data parallelism: flat buffers per model chunk, gradient buckets by reduce group, reduced asynchronously as
they fill during the final backward.

Each model chunk's parameters live in one flat parameter buffer (the plan's ``state.params`` dtype;
``param.data`` is a view) and their gradients in one flat gradient buffer (``state.grads``). When the two
dtypes agree ``param.grad`` is a view into the gradient buffer and autograd accumulates into it; when they
differ (bf16 parameters, fp32 gradients) a post-accumulate-grad hook adds ``param.grad`` into its view of the
buffer (Megatron's "main grad") and frees it.

Layout: the chunk's parameters, in reverse order of ``parameters()`` (about the order backward produces them),
grouped by reduce group (:mod:`runtime.parallel.params`), each group contiguous, each group cut into
``ceil(n / state.bucket_params)`` equal buckets at element granularity — a parameter may span two buckets;
a bucket is ready when every parameter overlapping it has its gradient. These are the buckets the cost model
counts (``cost_models.params.gradient_buckets``). With ZeRO-1 every bucket is a multiple of the dp x cp group
size ``d`` (bucket edges on multiples of ``d``, the group padded at its end with fewer than ``d`` elements), so
each splits evenly and parameters stay contiguous.

During the chunk's *final* backward of the step a hook counts each bucket's parameters; when the last one
lands the bucket's reduction is launched asynchronously (``overlap=True``) — or all buckets are launched after
backward (``overlap=False``): the same collectives on the same data, so the results are identical.

* ZeRO-0: all-reduce each bucket over dp x cp (SUM, then divide: gloo has no AVG).
* ZeRO-1: reduce-scatter each bucket in place, so rank ``r`` of the group finds the sum of slice ``r`` in its
  own slice of the gradient buffer; the optimizer updates only that slice, and :meth:`start_param_gather`
  all-gathers each bucket's parameters in place from the owners' slices, waited by forward pre-hooks of the
  modules that use them (overlap with the next forward). In-place collectives are safe on NCCL (documented)
  and gloo (it reduces a copy of the input and gathers into a temporary before writing the output).

A tied embedding's bucket (``("dp", "embed")``) is first summed with the other end of the pipeline, then
reduced over dp, never early; a sequence-parallel bucket (``("dp", "tp")``) is summed over tp after its dp
reduce, one all-reduce per bucket.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from runtime.models.common import Transformer
from runtime.parallel.mappings import all_gather_into, reduce_scatter_into
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.params import ParamInfo, ParamTable, Reduce

Range = tuple[int, int]


class Span(NamedTuple):
    """The part ``[start, end)`` (bucket coordinates) of a bucket that holds (part of) a parameter."""

    param: nn.Parameter
    info: ParamInfo
    start: int
    end: int


@dataclass(eq=False)
class Bucket:
    chunk: int
    reduce: Reduce
    spans: list[Span]
    param_data: torch.Tensor  # views into the chunk's flat buffers (padding included)
    grad_data: torch.Tensor
    lo: int  # the slice this rank owns (everything for ZeRO-0)
    hi: int
    pending: set[int] = field(default_factory=set)
    work: dist.Work | None = None
    launched: bool = False
    gather_work: dist.Work | None = None

    @property
    def param_shard(self) -> torch.Tensor:
        return self.param_data[self.lo:self.hi]

    @property
    def grad_shard(self) -> torch.Tensor:
        """The owned slice of the gradients: after :meth:`DataParallel.finish_grad_sync`, their average."""
        return self.grad_data[self.lo:self.hi]

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


def bucket_bounds(n: int, bucket_params: int, unit: int = 1) -> list[Range]:
    """``[start, end)`` of each bucket of an ``n``-element reduce group: ``ceil(n / bucket_params)`` buckets of
    equal size (within ``unit``), each a multiple of ``unit`` elements (the last one padded)."""
    k = -(-n // bucket_params)
    units = -(-n // unit)
    return [(i * units // k * unit, (i + 1) * units // k * unit) for i in range(k)]


class DataParallel:
    """Owns the parameter/gradient buffers of this rank's chunks and their DP synchronisation."""

    def __init__(self, chunks: list[Transformer], table: ParamTable, groups: ParallelGroups, zero: int,
                 overlap: bool, device: torch.device, grad_dtype: torch.dtype, bucket_params: int) -> None:
        self.g, self.overlap, self.device, self.grad_dtype = groups, overlap, device, grad_dtype
        self.d = groups.dpcp
        self.zero = zero if self.d > 1 else 0  # one replica: nothing to shard
        self.armed = [False] * len(chunks)
        self.buckets: list[Bucket] = []
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._main_grad: dict[int, torch.Tensor] = {}  # id(param) -> its gradient buffer view, when dtypes differ
        for c, chunk in enumerate(chunks):
            self._build(c, chunk, table, bucket_params)
        if self.zero:
            for c, chunk in enumerate(chunks):
                self._gather_hooks(c, chunk)
        self.zero_grad()

    # ---- layout -----------------------------------------------------------------------------
    def _build(self, c: int, chunk: nn.Module, table: ParamTable, bucket_params: int) -> None:
        params = [(p, info) for p, info in reversed(list(table.named(chunk))) if p.requires_grad]
        groups: dict[Reduce, list[tuple[nn.Parameter, ParamInfo]]] = {}
        for p, info in params:
            groups.setdefault(info.reduce, []).append((p, info))
        unit = self.d if self.zero else 1
        layout, total = [], 0
        for reduce, members in groups.items():
            bounds = bucket_bounds(sum(p.numel() for p, _ in members), bucket_params, unit)
            layout.append((reduce, members, total, bounds))
            total += bounds[-1][1] if bounds else 0
        dtype = params[0][0].dtype if params else torch.float32  # a stage may hold no layers (layers=0/...)
        pbuf = torch.zeros(total, dtype=dtype, device=self.device)
        gbuf = torch.zeros(total, dtype=self.grad_dtype, device=self.device)
        self.buffers.append((pbuf, gbuf))
        for reduce, members, start, bounds in layout:
            self._place(c, reduce, members, start, bounds, pbuf, gbuf)

    def _place(self, c: int, reduce: Reduce, members: list[tuple[nn.Parameter, ParamInfo]], start: int,
               bounds: list[Range], pbuf: torch.Tensor, gbuf: torch.Tensor) -> None:
        """Move one reduce group's parameters into the buffers from ``start`` on and make its buckets."""
        where, off = [], start
        for p, info in members:
            n = p.numel()
            view = pbuf[off:off + n]
            view.copy_(p.data.reshape(-1))
            p.data = view.view(p.shape)
            grad = gbuf[off:off + n].view(p.shape)
            if gbuf.dtype == pbuf.dtype:
                p.grad = grad
            else:
                self._main_grad[id(p)] = grad
            where.append((p, info, off - start))
            off += n
        first = len(self.buckets)
        for a, e in bounds:
            spans = [Span(p, info, max(o, a) - a, min(o + p.numel(), e) - a) for p, info, o in where
                     if o < e and o + p.numel() > a]
            lo, hi = self._owned(e - a)
            self.buckets.append(Bucket(c, reduce, spans, pbuf[start + a:start + e], gbuf[start + a:start + e], lo, hi))
        for p, _, o in where:
            mine = [first + i for i, (a, e) in enumerate(bounds) if o < e and o + p.numel() > a]
            p.register_post_accumulate_grad_hook(self._grad_hook(c, mine))

    def _owned(self, size: int) -> Range:
        """The slice of a ``size``-element bucket this rank owns: its 1/d share under ZeRO-1, else all of it."""
        if not self.zero:
            return 0, size
        r = self.g.dpcp_rank
        return r * size // self.d, (r + 1) * size // self.d

    def _grad_hook(self, chunk: int, buckets: list[int]) -> Callable[[nn.Parameter], None]:
        # Tensor hooks live in C++, out of the garbage collector's sight: a strong reference back to this
        # object would make an uncollectable cycle (parameter -> hook -> self -> parameter).
        me = weakref.ref(self)

        def hook(p: nn.Parameter) -> None:
            dp = me()
            if dp is not None:
                dp._on_grad(p, chunk, buckets)

        return hook

    def _gather_hooks(self, c: int, chunk: nn.Module) -> None:
        where: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            if b.chunk == c:
                for s in b.spans:
                    where.setdefault(id(s.param), []).append(b)
        for mod in chunk.modules():
            mine = {id(b): b for p in mod.parameters(recurse=False) for b in where.get(id(p), [])}
            if mine:
                mod.register_forward_pre_hook(functools.partial(self._wait_gather, list(mine.values())))

    # ---- gradients --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for _, gbuf in self.buffers:
            gbuf.zero_()
        for b in self.buckets:
            b.pending = {id(s.param) for s in b.spans}
            b.work, b.launched = None, False
        self.armed = [False] * len(self.armed)

    def arm(self, chunk: int, final: bool) -> None:
        """Called before each backward of ``chunk``: only its final one of the step reduces gradients."""
        self.armed[chunk] = final

    def _on_grad(self, p: nn.Parameter, chunk: int, buckets: list[int]) -> None:
        main = self._main_grad.get(id(p))
        if main is not None:  # gradients kept in another dtype than the parameters
            main.add_(p.grad)
            p.grad = None
        if not self.armed[chunk]:
            return
        for i in buckets:
            b = self.buckets[i]
            b.pending.discard(id(p))
            if self.overlap and not b.pending and "embed" not in b.reduce:
                self._launch(b)

    def _launch(self, b: Bucket) -> None:
        if b.launched:
            return
        b.launched = True
        if self.d == 1 or b.grad_data.numel() == 0:
            return
        if self.zero:  # in place: the output is this rank's slice of the input
            b.work = reduce_scatter_into(b.grad_shard, b.grad_data, self.g.dpcp_group, async_op=True)
        else:
            b.work = dist.all_reduce(b.grad_data, group=self.g.dpcp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Complete every reduction of the step; afterwards each bucket's ``grad_shard`` holds the average."""
        for b in self.buckets:
            if "embed" in b.reduce and self.g.embed_group is not None:
                dist.all_reduce(b.grad_data, group=self.g.embed_group)
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if self.d > 1:
                b.grad_shard.div_(self.d)
        if self.g.tp > 1:
            for b in self.buckets:
                if "tp" in b.reduce:
                    dist.all_reduce(b.grad_shard, group=self.g.tp_group)
        self.armed = [False] * len(self.armed)

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's share of the gradient (copies counted elsewhere left out), fp32."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for b in self.buckets:
            for a, e in b.owned(lambda s: s.info.in_norm):
                total += b.grad_shard[a:e].float().pow(2).sum()
        return total

    @property
    def norm_group(self) -> dist.ProcessGroup:
        """Where ``grad_norm_sq`` is summed: one replica's ranks, or everyone when the gradient is sharded."""
        return self.g.world if self.zero else self.g.mp_group

    # ---- parameters (ZeRO-1) ----------------------------------------------------------------
    def start_param_gather(self) -> None:
        """All-gather each bucket's parameters in place from the owners' (updated) slices."""
        for b in reversed(self.buckets):  # forward order
            if b.param_data.numel():
                b.gather_work = all_gather_into(b.param_data, b.param_shard, self.g.dpcp_group, async_op=True)
        if not self.overlap:
            self.wait_param_gather()

    def wait_param_gather(self) -> None:
        self._wait_gather(self.buckets)

    @staticmethod
    def _wait_gather(buckets: list[Bucket], *_: object) -> None:
        for b in buckets:
            if b.gather_work is not None:
                b.gather_work.wait()
                b.gather_work = None
