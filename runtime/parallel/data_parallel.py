"""Data parallelism: contiguous gradient buckets reduced asynchronously as they fill during backward.

Each model chunk's parameters live in one flat parameter buffer and their gradients in one flat gradient
buffer (``param.data`` / ``param.grad`` are views), in reverse order of ``parameters()`` — roughly the order
backward produces them — cut into buckets of about ``bucket_numel`` elements. A post-accumulate-grad hook
counts the parameters of a bucket during the chunk's *final* backward of the step; when the last one lands
the bucket's reduction is launched asynchronously (``overlap=True``) — or all buckets are launched after
backward (``overlap=False``): the same collectives on the same data, so the results are identical.

* ZeRO-0: all-reduce each bucket over dp (SUM, then divide: gloo has no AVG).
* ZeRO-1: reduce-scatter each bucket (padded to a multiple of dp) so dp rank ``r`` owns slice ``r`` of it;
  the optimizer updates only that slice (fp32 master) and :meth:`start_param_gather` all-gathers the new
  parameters, waited by forward pre-hooks of the modules that use them (overlap with the next forward).

Before the DP reduction of the bucket holding a tied embedding (pp > 1), its gradient is summed with the
other end of the pipeline; after it, gradients of sequence-parallel parameters are summed over tp.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from runtime.models.common import Transformer
from runtime.parallel.mappings import all_gather_into, reduce_scatter_into
from runtime.parallel.mesh import ParallelGroups

Range = tuple[int, int]


@dataclass(eq=False)
class Bucket:
    chunk: int
    ranges: list[tuple[nn.Parameter, int, int]]  # each parameter's [start, end) in the bucket
    param_data: torch.Tensor  # views into the chunk's flat buffers
    grad_data: torch.Tensor
    lo: int  # the slice this rank owns (everything for ZeRO-0)
    hi: int
    grad_shard: torch.Tensor  # reduced gradients of the owned slice
    late: bool = False  # holds a tied embedding: reduced after the cross-stage sum, never early
    pending: set[int] = field(default_factory=set)
    work: dist.Work | None = None
    launched: bool = False
    gather_work: dist.Work | None = None

    def owned(self, keep: Callable[[nn.Parameter], bool]) -> list[Range]:
        """Merged ranges, in owned-slice coordinates, of the parameters ``keep`` accepts."""
        out: list[Range] = []
        for p, a, b in self.ranges:
            a, b = max(a, self.lo), min(b, self.hi)
            if a < b and keep(p):
                a, b = a - self.lo, b - self.lo
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
        return out


class DataParallel:
    """Owns the parameter/gradient buffers of this rank's chunks and their DP synchronisation."""

    def __init__(self, chunks: list[Transformer], groups: ParallelGroups, zero: int, overlap: bool,
                 device: torch.device, bucket_numel: int = 2**25) -> None:
        self.g, self.overlap, self.device = groups, overlap, device
        self.dp = groups.dp
        self.zero = zero if self.dp > 1 else 0  # one replica: nothing to shard
        self.armed = [False] * len(chunks)
        self.buckets: list[Bucket] = []
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for c, chunk in enumerate(chunks):
            self._build(c, chunk, bucket_numel)
        if self.zero:
            for c, chunk in enumerate(chunks):
                self._gather_hooks(c, chunk)
        self.zero_grad()

    # ---- layout -----------------------------------------------------------------------------
    def _build(self, c: int, chunk: nn.Module, bucket_numel: int) -> None:
        params = [p for p in reversed(list(chunk.parameters())) if p.requires_grad]
        parts: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            if getattr(p, "tied_embedding", False):
                continue
            if size >= bucket_numel:
                parts.append([])
                size = 0
            parts[-1].append(p)
            size += p.numel()
        parts = [grp for grp in parts if grp]
        late = [[p] for p in params if getattr(p, "tied_embedding", False)]
        spans, total = [], 0
        for grp in parts + late:
            n = sum(p.numel() for p in grp)
            n = -(-n // self.dp) * self.dp if self.zero else n
            spans.append((grp, total, n))
            total += n
        dtype = params[0].dtype if params else torch.float32  # a stage may hold no layers (layers=0/...)
        pbuf = torch.zeros(total, dtype=dtype, device=self.device)
        gbuf = torch.zeros(total, dtype=dtype, device=self.device)
        self.buffers.append((pbuf, gbuf))
        for i, (grp, start, n) in enumerate(spans):
            ranges, off = [], 0
            for p in grp:
                view = pbuf[start + off:start + off + p.numel()]
                view.copy_(p.data.reshape(-1))
                p.data = view.view(p.shape)
                p.grad = gbuf[start + off:start + off + p.numel()].view(p.shape)
                ranges.append((p, off, off + p.numel()))
                off += p.numel()
            gdata = gbuf[start:start + n]
            lo, hi = (self.g.dp_rank * n // self.dp, (self.g.dp_rank + 1) * n // self.dp) if self.zero else (0, n)
            shard = torch.zeros(hi - lo, dtype=gdata.dtype, device=gdata.device) if self.zero else gdata
            b = Bucket(c, ranges, pbuf[start:start + n], gdata, lo, hi, shard, late=i >= len(parts))
            self.buckets.append(b)
            hook = self._grad_hook(len(self.buckets) - 1)
            for p in grp:
                p.register_post_accumulate_grad_hook(hook)

    def _grad_hook(self, index: int) -> Callable[[nn.Parameter], None]:
        # Tensor hooks live in C++, out of the garbage collector's sight: a strong reference back to this
        # object would make an uncollectable cycle (parameter -> hook -> self -> parameter).
        me = weakref.ref(self)

        def hook(p: nn.Parameter) -> None:
            dp = me()
            if dp is not None:
                dp._on_grad(dp.buckets[index], p)

        return hook

    def _gather_hooks(self, c: int, chunk: nn.Module) -> None:
        where = {id(p): b for b in self.buckets if b.chunk == c for p, _, _ in b.ranges}
        for mod in chunk.modules():
            mine = {id(where[id(p)]): where[id(p)] for p in mod.parameters(recurse=False) if id(p) in where}
            if mine:
                mod.register_forward_pre_hook(functools.partial(self._wait_gather, list(mine.values())))

    # ---- gradients --------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for _, gbuf in self.buffers:
            gbuf.zero_()
        for b in self.buckets:
            b.pending = {id(p) for p, _, _ in b.ranges}
            b.work, b.launched = None, False
        self.armed = [False] * len(self.armed)

    def arm(self, chunk: int, final: bool) -> None:
        """Called before each backward of ``chunk``: only its final one of the step reduces gradients."""
        self.armed[chunk] = final

    def _on_grad(self, b: Bucket, p: nn.Parameter) -> None:
        if not self.armed[b.chunk]:
            return
        b.pending.discard(id(p))
        if self.overlap and not b.pending and not b.late:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        if b.launched:
            return
        b.launched = True
        if self.dp == 1:
            return
        if self.zero:
            b.work = reduce_scatter_into(b.grad_shard, b.grad_data, self.g.dp_group, async_op=True)
        else:
            b.work = dist.all_reduce(b.grad_data, group=self.g.dp_group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Complete every reduction of the step; afterwards ``grad_shard`` holds the averaged gradients."""
        for b in self.buckets:
            if b.late and self.g.embed_group is not None:
                dist.all_reduce(b.grad_data, group=self.g.embed_group)
            self._launch(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None
            if self.dp > 1:
                b.grad_shard.div_(self.dp)
        self._sum_sequence_parallel()
        self.armed = [False] * len(self.armed)

    def _sum_sequence_parallel(self) -> None:
        if self.g.tp == 1:
            return
        views = [b.grad_shard[a:e] for b in self.buckets
                 for a, e in b.owned(lambda p: getattr(p, "sequence_parallel", False))]
        if not views:
            return
        flat = torch.cat(views)
        dist.all_reduce(flat, group=self.g.tp_group)
        off = 0
        for v in views:
            v.copy_(flat[off:off + v.numel()])
            off += v.numel()

    def grad_norm_sq(self) -> torch.Tensor:
        """Sum of squares of this rank's share of the gradient (duplicates left out), fp32."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for b in self.buckets:
            for a, e in b.owned(lambda p: not getattr(p, "duplicate", False)):
                total += b.grad_shard[a:e].float().pow(2).sum()
        return total

    @property
    def norm_group(self) -> dist.ProcessGroup:
        """Where ``grad_norm_sq`` is summed: one replica's ranks, or everyone when the gradient is sharded."""
        return self.g.world if self.zero else self.g.mp_group

    # ---- parameters (ZeRO-1) ----------------------------------------------------------------
    def start_param_gather(self, sources: list[torch.Tensor]) -> None:
        """All-gather each bucket's new parameters from the owners' slices (``sources``, one per bucket)."""
        for b, src in reversed(list(zip(self.buckets, sources))):  # forward order
            b.gather_work = all_gather_into(b.param_data, src.to(b.param_data.dtype), self.g.dp_group,
                                            async_op=True)
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
