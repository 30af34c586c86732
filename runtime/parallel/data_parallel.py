"""Data parallelism and ZeRO 0-3 over the dp x cp group (``d`` ranks): flat buffers per model chunk, gradient
buckets, their reduction, and (ZeRO-3) parameters gathered layer by layer while they are used.

Each model chunk's parameters live in one flat parameter buffer (the plan's ``state.params`` dtype;
``param.data`` is a view) and their gradients in one flat gradient buffer (``state.grads``); under ZeRO-2 the
gradient buffer, under ZeRO-3 both, hold only this rank's slices (1/d), as the cost model prices them
(``cost_models.memory.state_bytes``).

The buckets (:mod:`runtime.parallel.buckets`): under ZeRO-0/1 each reduce group cut by ``state.bucket_params``,
under ZeRO-2/3 one per transformer layer — what the cost model counts; each a multiple of ``ALIGN`` elements,
under ZeRO of ``d x ALIGN``, and rank ``r`` owns slice ``r``.

Gradients:

* ZeRO-0: all-reduce each bucket over d (SUM, then divide: gloo has no AVG) in the chunk's *final* backward
  of the step: a hook counts each bucket's parameters and launches the reduction when the last one lands
  (``overlap=True``), or all are launched after backward (``overlap=False``) — the same collectives on the same
  data, so the results are identical.
* ZeRO-1: the same, reduce-scattered in place, so rank ``r`` finds the sum of slice ``r`` in its own slice.
* ZeRO-2/3: no full gradient buffer. In *every* backward (every micro-batch), when a bucket's parameters all
  have their gradients, autograd's ``param.grad`` tensors are copied into one flat buffer and freed, the
  buffer is reduce-scattered over d and the owned part added into the rank's gradient slice. With ``overlap``
  the reduce-scatter runs asynchronously behind the next layer's backward (one in flight); without, in line.

Parameters:

* ZeRO-1/2: the optimizer updates the owned slice and :meth:`DataParallel.start_param_gather` all-gathers
  each bucket in place from the owners' slices, waited before the embedding, each layer and the head run
  forward (``overlap``: behind the next forward). In-place collectives are safe on NCCL (documented) and gloo
  (it reduces a copy of the input and gathers into a temporary before writing the output).
* ZeRO-3: only the owned slice is kept. Before the embedding, a layer or the head runs forward its buckets are
  all-gathered into a buffer per bucket and its parameters become views of it (``overlap``: the next module's
  buckets are prefetched); afterwards they are freed unless the next module uses them. A hook on the module's
  output gathers them again before its backward (prefetching the module before it); they are freed when their
  last gradient lands. Freed, a parameter is an empty tensor and its bucket's storage has size 0: views
  autograd saved share that storage and see the values again when it is re-gathered for backward. So at most
  two modules' buckets are gathered at once, one without ``overlap`` (the cost model's ``zero3_gather_bytes``;
  with ``overlap`` one reduce-scatter buffer is in flight too, ``zero_scatter_bytes``); the first and last bucket
  also hold the embedding and the head, and a tied embedding on a single
  stage keeps the first bucket gathered from the head's backward to the embedding's).

A tied embedding's bucket (``("dp", "embed")``) is summed with the other end of the pipeline: before its dp
reduce (ZeRO-0/1, never early) or, as its owned slice, after the step's reduce-scatters (ZeRO-2/3). A
sequence-parallel parameter (``("dp", "tp")``) is summed over tp after the dp reduce, one all-reduce per bucket.
A MoE model's routed experts (``("edp",)``, ZeRO-0/1 only) are reduced, sharded and gathered over the
expert-data-parallel group instead of dp x cp (each bucket knows its group), and averaged over dp x cp like the rest.

The gradient norm sums each bucket's squares where it is owned: under ZeRO (or with routed experts) over every
rank, each bucket counted by its owner (a bucket no group shares by the group's first rank); otherwise over one
replica (tp x pp), as before.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from runtime.models.common import Transformer
from runtime.parallel.buckets import (
    Bucket,
    Range,
    Segment,
    Span,
    bucket_bounds,
    group_segments,
    layer_segments,
    users,
)
from runtime.parallel.hierarchy import Hierarchy
from runtime.parallel.mappings import all_gather_into, member, reduce_scatter_into, sum_into
from runtime.parallel.mesh import ParallelGroups
from runtime.parallel.params import EDP, ParamTable, Reduce
from specs.parallel import zero_in_effect

__all__ = ["Bucket", "DataParallel", "Span", "bucket_bounds"]


def _summed_over_tp(s: Span) -> bool:
    return "tp" in s.info.reduce


class DataParallel:
    """Owns the parameter/gradient buffers of this rank's chunks and their DP synchronisation."""

    def __init__(self, chunks: list[Transformer], table: ParamTable, groups: ParallelGroups, zero: int,
                 overlap: bool, device: torch.device, grad_dtype: torch.dtype, bucket_params: int) -> None:
        self.g, self.overlap, self.device, self.grad_dtype = groups, overlap, device, grad_dtype
        self.d = groups.dpcp
        self.experts = groups.edp_group is not None
        self.zero = int(zero_in_effect(zero, self.d, groups.edp if self.experts else 1))
        self.armed = [False] * len(chunks)
        self.buckets: list[Bucket] = []
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._main_grad: dict[int, torch.Tensor] = {}  # id(param) -> its gradient buffer view, when dtypes differ
        self._inflight: list[Bucket] = []  # ZeRO-2/3: reduce-scatters not yet added into the gradient slices
        self._empty = torch.empty(0, device=device)  # ZeRO-3: what a parameter is between uses
        for c, chunk in enumerate(chunks):
            self._build(c, chunk, table, bucket_params)
        if self.zero:
            for c, chunk in enumerate(chunks):
                self._use_hooks(c, chunk)
        self.zero_grad()

    # ---- layout -----------------------------------------------------------------------------
    def _build(self, c: int, chunk: Transformer, table: ParamTable, bucket_params: int) -> None:
        params = [(p, info) for p, info in reversed(list(table.named(chunk))) if p.requires_grad]
        if self.zero >= 2:
            segments = layer_segments(chunk, params, self.d)
        else:
            segments = group_segments(params, bucket_params, self._unit)
        total = sum(s.bounds[-1][1] for s in segments if s.bounds)
        dtype = params[0][0].dtype if params else torch.float32  # a stage may hold no layers (layers=0/...)
        self._empty = torch.empty(0, dtype=dtype, device=self.device)
        pbuf = torch.zeros(total // self.d if self.zero >= 3 else total, dtype=dtype, device=self.device)
        gbuf = torch.zeros(total // self.d if self.zero >= 2 else total, dtype=self.grad_dtype, device=self.device)
        self.buffers.append((pbuf, gbuf))
        start = 0
        for seg in segments:
            self._place(c, seg, start, pbuf, gbuf)
            start += seg.bounds[-1][1] if seg.bounds else 0

    def _place(self, c: int, seg: Segment, start: int, pbuf: torch.Tensor, gbuf: torch.Tensor) -> None:
        """Lay one segment out from ``start`` (whole-bucket coordinates of the chunk) and make its buckets."""
        where, off = [], 0
        for p, info in seg.members:
            n = p.numel()
            if self.zero < 3:
                at = slice(start + off, start + off + n)
                self._adopt(p, pbuf[at], gbuf[at] if self.zero < 2 else None)
            where.append((p, info, p.shape, off, n))
            off += n
        first = len(self.buckets)
        for a, e in seg.bounds:
            spans = [Span(p, info, shape, max(o, a) - a, min(o + n, e) - a) for p, info, shape, o, n in where
                     if o < e and o + n > a]
            self.buckets.append(self._bucket(c, seg, spans, start + a, e - a, pbuf, gbuf))
        for p, _, _, o, n in where:
            mine = [first + i for i, (a, e) in enumerate(seg.bounds) if o < e and o + n > a]
            p.register_post_accumulate_grad_hook(self._grad_hook(c, mine))

    def _adopt(self, p: nn.Parameter, pview: torch.Tensor, gview: torch.Tensor | None) -> None:
        """Move ``p`` into its view of the parameter buffer, its gradient into ``gview`` (ZeRO-0/1)."""
        pview.copy_(p.data.reshape(-1))
        p.data = pview.view(p.shape)
        if gview is None:
            return
        if gview.dtype == pview.dtype:
            p.grad = gview.view(p.shape)
        else:
            self._main_grad[id(p)] = gview.view(p.shape)

    def _bucket(self, c: int, seg: Segment, spans: list[Span], at: int, size: int, pbuf: torch.Tensor,
                gbuf: torch.Tensor) -> Bucket:
        """The bucket of ``size`` elements at ``at`` (whole-bucket coordinates; under ZeRO-2/3 its owned slice sits
        at ``at / d`` of the buffers that hold slices only)."""
        group, d, rank = self._over(seg.reduce)
        lo, hi = self._owned(size, d, rank)
        own = slice(at // self.d, at // self.d + hi - lo)
        unit = seg.unit if seg.unit is not None else sum(b.chunk == c for b in self.buckets)
        grad = gbuf[at:at + size] if self.zero < 2 else None
        if self.zero < 3:
            param = pbuf[at:at + size]
            pshard = param[lo:hi]
        else:  # the whole bucket once, to cut the owned slice out of it; then freed
            param = torch.zeros(size, dtype=pbuf.dtype, device=self.device)
            for s in spans:
                param[s.start:s.end].copy_(s.param.data.reshape(-1))
            pshard = pbuf[own]
            pshard.copy_(param[lo:hi])
        b = Bucket(c, unit, seg.reduce, spans, size, lo, hi, param, pshard, grad,
                   grad[lo:hi] if grad is not None else gbuf[own], group=group, d=d)
        self._release(b)
        return b

    def _over(self, reduce: Reduce) -> tuple[dist.ProcessGroup, int, int]:
        """(group, size, this rank's index) a bucket of the reduce group ``reduce`` is reduced and sharded over."""
        if reduce == EDP:
            assert self.g.edp_group is not None and self.zero < 2, "routed experts run under ZeRO-0/1 only"
            return self.g.edp_group, self.g.edp, self.g.edp_rank
        return self.g.dp_reduce_group, self.d, self.g.dpcp_rank

    def _unit(self, reduce: Reduce) -> int:
        """ZeRO-0/1 buckets are multiples of this (times ``ALIGN``): ZeRO-1's ``d`` owners; ZeRO-0's 1, or (replicas
        split over node groups) the members per group, so the hierarchy's reduce-scatter needs no padded copy."""
        group, d, _ = self._over(reduce)
        if self.zero:
            return d
        return group.n if isinstance(group, Hierarchy) else 1

    def _owned(self, size: int, d: int, rank: int) -> Range:
        """The slice of a ``size``-element bucket this rank owns: its 1/d share under ZeRO, else all of it."""
        if not self.zero:
            return 0, size
        return rank * size // d, (rank + 1) * size // d

    def _grad_hook(self, chunk: int, buckets: list[int]) -> Callable[[nn.Parameter], None]:
        # Tensor hooks live in C++, out of the garbage collector's sight: a strong reference back to this
        # object would make an uncollectable cycle (parameter -> hook -> self -> parameter).
        me = weakref.ref(self)

        def hook(p: nn.Parameter) -> None:
            dp = me()
            if dp is not None:
                dp._on_grad(p, chunk, buckets)

        return hook

    def _use_hooks(self, c: int, chunk: Transformer) -> None:
        """Hooks on the embedding, each layer and the head (in forward order): their buckets' parameters are
        complete before they run forward (ZeRO-1/2: the gather after the optimizer step; ZeRO-3: gathered now)."""
        where: dict[int, list[Bucket]] = {}
        for b in self.buckets:
            if b.chunk == c:
                for s in b.spans:
                    where.setdefault(id(s.param), []).append(b)
        mods = users(chunk)
        uses = [list({id(b): b for p in m.parameters() for b in where.get(id(p), [])}.values()) for m in mods]
        for i, mod in enumerate(mods):
            mod.register_forward_pre_hook(functools.partial(self._before_forward, uses, i))
            if self.zero >= 3:
                mod.register_forward_hook(functools.partial(self._after_forward, uses, i))

    # ---- gradients --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for _, gbuf in self.buffers:
            gbuf.zero_()
        for b in self.buckets:
            b.pending = {id(s.param) for s in b.spans}
            b.work, b.launched = None, False
        self.armed = [False] * len(self.armed)

    def arm(self, chunk: int, final: bool) -> None:
        """Called before each backward of ``chunk``: only its final one of the step reduces gradients (ZeRO-0/1;
        ZeRO-2/3 reduce them in every backward)."""
        self.armed[chunk] = final

    def _on_grad(self, p: nn.Parameter, chunk: int, buckets: list[int]) -> None:
        if self.zero >= 2:  # a parameter lies in one bucket
            b = self.buckets[buckets[0]]
            b.pending.discard(id(p))
            if not b.pending:
                self._scatter(b)
            return
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
        """ZeRO-0/1: reduce the bucket over d (asynchronously)."""
        if b.launched:
            return
        b.launched = True
        if b.d == 1 or b.size == 0:
            return
        if self.zero:  # in place: the output is this rank's slice of the input
            b.work = reduce_scatter_into(b.grad_shard, b.grad_data, b.group, async_op=True)
        else:
            b.work = sum_into(b.grad_data, b.group, async_op=True)

    def _scatter(self, b: Bucket) -> None:
        """ZeRO-2/3: reduce-scatter this backward's gradients of ``b`` (autograd's, freed here) over d."""
        self._drain()  # one in flight at most
        flat = torch.zeros(b.size, dtype=self.grad_dtype, device=self.device)
        for s in b.spans:
            if s.param.grad is not None:
                flat[s.start:s.end].copy_(s.param.grad.reshape(-1))
                s.param.grad = None
        work = reduce_scatter_into(flat[b.lo:b.hi], flat, self.g.dp_reduce_group, async_op=self.overlap)
        b.scatter, b.launched, b.pending = (flat, work), True, {id(s.param) for s in b.spans}
        self._inflight.append(b)
        if self.zero >= 3:
            self._release(b)
        if not self.overlap:
            self._drain()

    def _drain(self) -> None:
        """ZeRO-2/3: add the reduce-scatters in flight into the owned gradient slices, in launch order."""
        for b in self._inflight:
            flat, work = b.scatter
            if work is not None:
                work.wait()
            b.grad_shard.add_(flat[b.lo:b.hi])
            b.scatter = None
        self._inflight.clear()

    def finish_grad_sync(self) -> None:
        """Complete every reduction of the step; afterwards each bucket's ``grad_shard`` holds the average."""
        if self.zero >= 2:
            self._finish_scatters()
        else:
            self._finish_reduces()
        for b in self.buckets:
            if self.d > 1:
                b.grad_shard.div_(self.d)
            if self.g.tp > 1:
                self._sum_over_tp(b)
        self.armed = [False] * len(self.armed)

    def _sum_over_tp(self, b: Bucket) -> None:
        """The gradients sequence parallelism left partial, in the slice this rank owns of bucket ``b``, summed
        over tp: one all-reduce per bucket (the ranges packed together when there are several)."""
        ranges = b.owned(_summed_over_tp)
        if len(ranges) == 1:
            lo, hi = ranges[0]
            dist.all_reduce(b.grad_shard[lo:hi], group=self.g.tp_group)
        elif ranges:
            packed = torch.cat([b.grad_shard[lo:hi] for lo, hi in ranges])
            dist.all_reduce(packed, group=self.g.tp_group)
            at = 0
            for lo, hi in ranges:
                b.grad_shard[lo:hi].copy_(packed[at:at + hi - lo])
                at += hi - lo

    def _finish_reduces(self) -> None:
        """ZeRO-0/1: a tied embedding's buckets summed with the other end of the pipeline first; every bucket
        reduced (those not launched during backward now), and waited."""
        for b in self.buckets:
            if "embed" in b.reduce and self.g.embed_group is not None:
                dist.all_reduce(b.grad_data, group=self.g.embed_group)
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None

    def _finish_scatters(self) -> None:
        """ZeRO-2/3: a bucket some parameter of which had no gradient in the last backward is reduced now; all
        are added in, nothing stays gathered, and a tied embedding's owned slice is summed with the other end."""
        for b in self.buckets:
            if len(b.pending) < len(b.spans):
                self._scatter(b)
        self._drain()
        for b in self.buckets:
            self._release(b)
            if "embed" in b.reduce and self.g.embed_group is not None:
                dist.all_reduce(b.grad_shard, group=self.g.embed_group)

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's share of the gradient (copies counted elsewhere left out): one multi-tensor
        norm over every counted slice (a kernel or two, not three per slice), fp32 on GPUs (a tree reduction) and
        fp64 on CPUs, whose norm adds a slice's squares one after another (in fp32 a 0.8M-element bucket's norm
        is 4e-5 off, and differs with how the plan slices the buckets); the sum returned in fp32."""
        everyone = self.norm_group is self.g.world
        pieces = []
        for b in self.buckets:
            if everyone and not (self.zero and b.d > 1) and member(b.group) > 0:
                continue  # a replica: counted by the group's first rank
            pieces += [b.grad_shard[a:e] for a, e in b.owned(lambda s: s.info.in_norm) if e > a]
        if not pieces:
            return torch.zeros((), dtype=torch.float32, device=self.device)
        acc = torch.float64 if self.device.type == "cpu" else torch.float32
        return torch.stack(torch._foreach_norm(pieces, 2, dtype=acc)).square().sum().float()  # reduced in fp32, as
        # priced (cost_models/ledger.py): the ranks' few partial sums lose nothing that matters there

    @property
    def norm_group(self) -> dist.ProcessGroup:
        """Where ``grad_norm_sq`` is summed: one replica's ranks, or everyone when the gradient is sharded or a MoE
        model's experts are split over ranks of other replicas."""
        return self.g.world if self.zero or self.experts else self.g.mp_group

    # ---- parameters (ZeRO-1/2: after the optimizer step; ZeRO-3: where they are used) --------
    def start_param_gather(self) -> None:
        """ZeRO-1/2: all-gather each bucket's parameters in place from the owners' (updated) slices. (ZeRO-3
        gathers them before each use instead.)"""
        if self.zero >= 3:
            return
        for b in reversed(self.buckets):  # forward order
            if b.size and b.d > 1:
                b.gather_work = all_gather_into(b.param_data, b.param_shard, b.group, async_op=True)
        if not self.overlap:
            self.wait_param_gather()

    def wait_param_gather(self) -> None:
        self._wait_gather(self.buckets)

    @staticmethod
    def _wait_gather(buckets: Iterable[Bucket], *_: object) -> None:
        for b in buckets:
            if b.gather_work is not None:
                b.gather_work.wait()
                b.gather_work = None

    def _before_forward(self, uses: list[list[Bucket]], i: int, *_: object) -> None:
        if self.zero < 3:
            self._wait_gather(uses[i])
            return
        self._gather(uses[i], wait=True)
        if self.overlap and i + 1 < len(uses):
            self._gather(uses[i + 1], wait=False)

    def _after_forward(self, uses: list[list[Bucket]], i: int, _mod: nn.Module, _args: object, out: object) -> None:
        """ZeRO-3: free what the next module does not use; gather it again before this module's backward."""
        later = uses[i + 1] if i + 1 < len(uses) else []
        for b in uses[i]:
            if b not in later:
                self._release(b)
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self._before_backward, uses, i))

    def _before_backward(self, uses: list[list[Bucket]], i: int, _grad: torch.Tensor) -> None:
        self._gather(uses[i], wait=True)
        if self.overlap and i > 0:
            self._gather(uses[i - 1], wait=False)

    def _gather(self, buckets: list[Bucket], wait: bool) -> None:
        """ZeRO-3: all-gather the buckets' parameters (asynchronously with ``overlap``) and make them views of it."""
        for b in buckets:
            if not b.gathered:
                b.param_data.untyped_storage().resize_(b.size * b.param_data.element_size())
                b.gather_work = all_gather_into(b.param_data, b.param_shard, self.g.dp_reduce_group,
                                                async_op=self.overlap)
                for s in b.spans:
                    s.param.data = b.param_data[s.start:s.end].view(s.shape)
                b.gathered = True
        if wait:
            self._wait_gather(buckets)

    def _release(self, b: Bucket) -> None:
        """ZeRO-3: free a bucket's gathered parameters (views saved by autograd keep the storage, at size 0)."""
        if self.zero < 3 or not b.gathered:
            return
        self._wait_gather([b])
        for s in b.spans:
            s.param.data = self._empty
        b.param_data.untyped_storage().resize_(0)
        b.gathered = False
