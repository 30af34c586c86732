"""The data-parallel collectives of a pipeline rank whose replicas are split over node groups (placement ``a+b``):
reduce-scatter inside each group, the collective across the groups on that shard, all-gather inside, so only
1/(members per group) of the data crosses the slow link between groups (``cost_models.comm.SpanningComm`` prices
exactly this).

The dp x cp group of ``parts * n`` members (dp major, cp minor) holds ``n`` consecutive members per node group.
Member ``q`` is member ``i = q % n`` of its group's *inner* group and member ``g = q // n`` of the *outer* group of
the members with the same ``i`` (one per node group). Under ZeRO it owns slice ``i * parts + g`` of each bucket
(:attr:`Hierarchy.rank`): then the inner reduce-scatter leaves member ``i`` the block of slices ``i * parts`` ..
``i * parts + parts - 1``, contiguous, and the outer one its own slice of it; gathers run the other way round. The
collectives run one after the other; the returned handle is already complete.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.parallel.mappings import all_gather_into, reduce_scatter_into


class Done:
    """The handle of collectives that already ran (what ``async_op=True`` returns elsewhere)."""

    def wait(self) -> bool:
        return True


class Hierarchy:
    """This rank's inner (same node group) and outer (same place in every node group) data-parallel groups."""

    def __init__(self, inner: dist.ProcessGroup, outer: dist.ProcessGroup, parts: int, n: int, member: int) -> None:
        self.inner, self.outer, self.parts, self.n = inner, outer, parts, n
        self.rank = member % n * parts + member // n  # the ZeRO slice this member owns

    @property
    def size(self) -> int:
        return self.parts * self.n

    def all_reduce(self, t: torch.Tensor) -> Done:
        """Sum ``t`` (contiguous) over every member, in place."""
        flat = t.view(-1)
        pad = -flat.numel() % self.n
        buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
        block = buf.new_empty(buf.numel() // self.n)
        reduce_scatter_into(block, buf, self.inner)
        dist.all_reduce(block, group=self.outer)
        all_gather_into(buf, block, self.inner)
        if pad:
            flat.copy_(buf[:flat.numel()])
        return Done()

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor) -> Done:
        """``out`` = this member's slice (:attr:`rank`) of ``inp`` summed over every member (``inp``'s size a multiple
        of :attr:`size`)."""
        block = inp.new_empty(inp.numel() // self.n)
        reduce_scatter_into(block, inp, self.inner)
        reduce_scatter_into(out, block, self.outer)
        return Done()

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> Done:
        """``out`` = every member's slice, in slice order."""
        block = out.new_empty(out.numel() // self.n)
        all_gather_into(block, inp.contiguous(), self.outer)
        all_gather_into(out, block, self.inner)
        return Done()


def hierarchies(layout: torch.Tensor, parts: list[int], me: int) -> Hierarchy | None:
    """Create the inner and outer groups of every pipeline rank split over ``parts[p]`` > 1 node groups (every rank
    calls, in the same order); this rank's :class:`Hierarchy`, or None. ``layout``: the global ranks as
    ``[pp, dp, cp, tp]``."""
    mine = None
    pp, tp = layout.shape[0], layout.shape[3]
    for p in range(pp):
        if parts[p] == 1:
            continue
        for t in range(tp):
            members = layout[p, :, :, t].reshape(-1).tolist()
            n = len(members) // parts[p]
            inner = [dist.new_group(members[g * n:(g + 1) * n]) for g in range(parts[p])]
            outer = [dist.new_group(members[i::n]) for i in range(n)]
            if me in members:
                q = members.index(me)
                mine = Hierarchy(inner[q // n], outer[q % n], parts[p], n, q)
    return mine
