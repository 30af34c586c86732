"""The data-parallel collectives of a pipeline rank whose replicas are split over node groups (placement ``a+b``):
reduce-scatter inside each group, the collective across the groups on that shard, all-gather inside, so only
1/(members per group) of the data crosses the slow link between groups (``cost_models.comm.SpanningComm`` prices
exactly this).

The dp x cp group of ``parts * n`` members (dp major, cp minor) holds ``n`` consecutive members per node group.
Member ``q`` is member ``i = q % n`` of its group's *inner* groups and member ``g = q // n`` of the *outer* groups of
the members with the same ``i`` (one per node group). Under ZeRO it owns slice ``i * parts + g`` of each bucket
(:attr:`Hierarchy.rank`): then the inner reduce-scatter leaves member ``i`` the block of slices ``i * parts`` ..
``i * parts + parts - 1``, contiguous, and the outer one its own slice of it; gathers run the other way round.

Asynchronous, as the flat collectives are (the gradient reduce overlaps the backward). On GPUs (NCCL) every step
of a call is issued at once, in program order: each waits for the one before on a side stream, so neither the host
nor the compute stream waits (:class:`Issued`), and every communicator sees its collectives in the same order on
every rank. On CPUs (gloo, whose wait blocks the host) each call is a :class:`Chain` of steps, each started when the
one before it has finished; chains of one direction (reductions; gathers) form a queue in which a chain starts a step
only after every earlier chain with steps left has started that step, so every process group sees its collectives
in the same order on every rank, whatever each rank's timing; every call advances the queue, and waiting for a
chain first finishes the chains before it. Each kind of step has its own process group (reduce-scatter, the
reduction across, the all-gather back; the gathers' two), so no group's order depends on when a rank advanced.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from runtime.parallel.mappings import all_gather_into, reduce_scatter_into

Step = Callable[[], Any]  # starts one collective asynchronously, returns its work handle


class Chain:
    """Collectives that run one after another (a work handle: :meth:`wait`, :meth:`is_completed`)."""

    def __init__(self, queue: Queue, steps: list[Step], after: Callable[[], None] | None = None) -> None:
        self.queue, self.steps, self.after = queue, deque(steps), after
        self.work: Any = None
        self.started = 0

    @property
    def done(self) -> bool:
        return self.work is None and not self.steps

    def ready(self) -> bool:
        """Whether the step in flight (if any) has finished."""
        return self.work is None or self.work.is_completed()

    def start_next(self) -> None:
        if self.work is not None:
            self.work.wait()
        self.work = self.steps.popleft()() if self.steps else None
        self.started += self.work is not None
        if self.done and self.after is not None:
            self.after()
            self.after = None

    def finish(self) -> None:
        while not self.done:
            self.start_next()

    def is_completed(self) -> bool:
        self.queue.pump()
        return self.done

    def wait(self) -> bool:
        self.queue.finish_through(self)
        return True


class Queue:
    """The chains of one direction, oldest first (module docstring)."""

    def __init__(self) -> None:
        self.chains: deque[Chain] = deque()

    def add(self, steps: list[Step], after: Callable[[], None] | None = None) -> Chain:
        self.pump()
        chain = Chain(self, steps, after)
        chain.start_next()  # the chains before it started their first step when they were added
        self.chains.append(chain)
        return chain

    def pump(self) -> None:
        """Start each chain's next step where its step in flight has finished and every earlier chain with steps left
        has started that step already (chains may differ in length); drop finished chains."""
        floor = None  # the fewest steps started by an earlier chain that has steps left
        for chain in self.chains:
            if not chain.done and chain.ready() and (not chain.steps or floor is None or floor > chain.started):
                chain.start_next()  # its next step, or (none left) it completes
            if chain.steps:
                floor = chain.started if floor is None else min(floor, chain.started)
        while self.chains and self.chains[0].done:
            self.chains.popleft()

    def finish_through(self, chain: Chain) -> None:
        """Finish every chain up to and including ``chain``, oldest first."""
        if chain.done:
            return
        while self.chains:
            first = self.chains.popleft()
            first.finish()
            if first is chain:
                return
        chain.finish()


class Issued:
    """A call's steps issued at once, each after the one before on ``stream`` (NCCL: the wait is the stream's, not the
    host's); a work handle for the last."""

    def __init__(self, steps: list[Step], after: Callable[[], None] | None, stream: Callable[[], Any]) -> None:
        work = steps[0]()
        for step in steps[1:]:
            with stream():
                work.wait()
                work = step()
        self.work, self.after = work, after

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self) -> bool:
        self.work.wait()
        if self.after is not None:
            self.after()
            self.after = None
        return True


class Hierarchy:
    """This rank's inner (same node group) and outer (same place in every node group) data-parallel groups, one of
    each per kind of step (module docstring). ``eager``: issue every step at once (GPUs; module docstring)."""

    def __init__(self, inner: dict[str, dist.ProcessGroup], outer: dict[str, dist.ProcessGroup], parts: int, n: int,
                 member: int, eager: bool = False) -> None:
        self.inner, self.outer, self.parts, self.n = inner, outer, parts, n
        self.rank = member % n * parts + member // n  # the ZeRO slice this member owns
        self.reductions, self.gathers = Queue(), Queue()
        self.eager = eager
        self._side: Any = None

    def _stream(self) -> Any:
        """The side stream the steps after a call's first wait on (CUDA), or no stream (CPUs: the test of that path)."""
        if not torch.cuda.is_available():
            return contextlib.nullcontext()
        if self._side is None:
            self._side = torch.cuda.Stream()
        return torch.cuda.stream(self._side)

    def _run(self, queue: Queue, steps: list[Step], after: Callable[[], None] | None = None) -> Chain | Issued:
        return Issued(steps, after, self._stream) if self.eager else queue.add(steps, after)

    @property
    def size(self) -> int:
        return self.parts * self.n

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        return [*self.inner.values(), *self.outer.values()]

    def all_reduce(self, t: torch.Tensor) -> Chain | Issued:
        """Sum ``t`` (contiguous) over every member, in place."""
        flat = t.view(-1)
        pad = -flat.numel() % self.n
        buf = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
        block = buf.new_empty(buf.numel() // self.n)
        steps = [lambda: reduce_scatter_into(block, buf, self.inner["scatter"], async_op=True),
                 lambda: dist.all_reduce(block, group=self.outer["reduce"], async_op=True),
                 lambda: all_gather_into(buf, block, self.inner["back"], async_op=True)]
        return self._run(self.reductions, steps, (lambda: flat.copy_(buf[:flat.numel()])) if pad else None)

    def reduce_scatter_into(self, out: torch.Tensor, inp: torch.Tensor) -> Chain | Issued:
        """``out`` = this member's slice (:attr:`rank`) of ``inp`` summed over every member (``inp``'s size a multiple
        of :attr:`size`)."""
        block = inp.new_empty(inp.numel() // self.n)
        return self._run(self.reductions, [
            lambda: reduce_scatter_into(block, inp, self.inner["scatter"], async_op=True),
            lambda: reduce_scatter_into(out, block, self.outer["reduce"], async_op=True)])

    def all_gather_into(self, out: torch.Tensor, inp: torch.Tensor) -> Chain | Issued:
        """``out`` = every member's slice, in slice order."""
        block = out.new_empty(out.numel() // self.n)
        shard = inp.contiguous()
        return self._run(self.gathers, [lambda: all_gather_into(block, shard, self.outer["gather"], async_op=True),
                                        lambda: all_gather_into(out, block, self.inner["gather"], async_op=True)])


INNER, OUTER = ("scatter", "back", "gather"), ("reduce", "gather")


def hierarchies(layout: torch.Tensor, parts: list[int], me: int, eager: bool = False) -> Hierarchy | None:
    """Create the inner and outer groups of every pipeline rank split over ``parts[p]`` > 1 node groups (every rank
    calls, in the same order); this rank's :class:`Hierarchy`, or None. ``layout``: the global ranks as
    ``[pp, dp, cp, tp]``; ``eager``: see :class:`Hierarchy`."""
    mine = None
    pp, tp = layout.shape[0], layout.shape[3]
    for p in range(pp):
        if parts[p] == 1:
            continue
        for t in range(tp):
            members = layout[p, :, :, t].reshape(-1).tolist()
            n = len(members) // parts[p]
            inner = {k: [dist.new_group(members[g * n:(g + 1) * n]) for g in range(parts[p])] for k in INNER}
            outer = {k: [dist.new_group(members[i::n]) for i in range(n)] for k in OUTER}
            if me in members:
                q = members.index(me)
                mine = Hierarchy({k: v[q // n] for k, v in inner.items()}, {k: v[q % n] for k, v in outer.items()},
                                 parts[p], n, q, eager)
    return mine
