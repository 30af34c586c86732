"""The communication ledger of a step: every collective and send this rank issues, by (op, group, dtype).

Off by default: :func:`recording` wraps torch.distributed's collective and send functions for the duration of a
``with`` block (the runtime calls them through the ``dist`` module, so every call site is seen: tensor, sequence and
context parallelism, the pipeline, data parallelism and ZeRO, the optimizer's norm, the step's metrics). Each call is
booked, once it has returned, under its op (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``,
``send``, ``broadcast``), the plan group it runs on (named from :class:`~runtime.parallel.mesh.ParallelGroups`), its
dtype, with the bytes as the cost model counts them (cost_models/comm.py: all-gather output, reduce-scatter input,
all-reduce buffer, bytes sent; an all-to-all's input). Receives mirror sends and are not booked; calls on one-rank
groups move nothing and are not booked either. ``cost_models.ledger.priced_ledger`` is what the cost model priced for
the same plan.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.parallel.mappings import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from runtime.parallel.mesh import ParallelGroups


@dataclass
class Ledger:
    """Calls and bytes per (op, group, dtype) of what ran inside :func:`recording`."""

    calls: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)

    def book(self, op: str, group: str, t: torch.Tensor, nbytes: int) -> None:
        key = (op, group, str(t.dtype).removeprefix("torch."))
        self.calls[key] += 1
        self.nbytes[key] += nbytes

    def as_dict(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        return {k: (self.calls[k], self.nbytes[k]) for k in sorted(self.calls)}


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextmanager
def recording(groups: ParallelGroups) -> Iterator[Ledger]:
    """Book every collective and send issued inside the block (this process only)."""
    names = groups.group_names()
    ledger = Ledger()

    def group_of(g: Any) -> tuple[str, int]:
        g = groups.world if g is None else g
        return names.get(id(g), "other"), dist.get_world_size(g)

    def booked(fn: Any, op: str, tensor: str, nbytes: Any = None) -> Any:
        """``fn`` booking ``op`` on its group after it returns: the argument named ``tensor`` (bytes: ``nbytes``
        of the bound arguments, default that tensor's)."""
        sig = inspect.signature(fn)

        def call(*a: Any, **kw: Any) -> Any:
            args = sig.bind(*a, **kw).arguments
            out = fn(*a, **kw)
            name, size = group_of(args.get("group"))
            if size > 1:
                t = args[tensor]
                ledger.book(op, name, t, nbytes(args) if nbytes else _bytes(t))
            return out
        return call

    def batch(ops: list[Any]) -> Any:
        out = real["batch_isend_irecv"](ops)
        for p in ops:
            name, size = group_of(p.group)
            if size > 1 and p.op in (dist.isend, real["isend"], dist.send, real["send"]):
                ledger.book("send", name, p.tensor, _bytes(p.tensor))
        return out

    real = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE,
                                          "all_to_all_single", "isend", "send", "broadcast", "batch_isend_irecv")}
    in_name = "input_tensor" if "input_tensor" in inspect.signature(real[REDUCE_SCATTER_SINGLE]).parameters else "input"
    out_name = "output_tensor" if "output_tensor" in inspect.signature(real[ALL_GATHER_SINGLE]).parameters else "output"
    wrapped = {
        "all_reduce": booked(real["all_reduce"], "all_reduce", "tensor"),
        "all_gather": booked(real["all_gather"], "all_gather", "tensor",
                             lambda a: _bytes(a["tensor"]) * len(a["tensor_list"])),
        ALL_GATHER_SINGLE: booked(real[ALL_GATHER_SINGLE], "all_gather", out_name),
        REDUCE_SCATTER_SINGLE: booked(real[REDUCE_SCATTER_SINGLE], "reduce_scatter", in_name),
        "all_to_all_single": booked(real["all_to_all_single"], "all_to_all", "input"),
        "isend": booked(real["isend"], "send", "tensor"),
        "send": booked(real["send"], "send", "tensor"),
        "broadcast": booked(real["broadcast"], "broadcast", "tensor"),
        "batch_isend_irecv": batch,
    }
    for n, fn in wrapped.items():
        setattr(dist, n, fn)
    try:
        yield ledger
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
