"""The communication ledger of a step: every collective and send this rank issues, by (op, group, dtype).

Off by default: :func:`recording` wraps torch.distributed's collective and send functions for the duration of a
``with`` block (the runtime calls them through the ``dist`` module, so every call site is seen: tensor, sequence
and context parallelism, the pipeline, data parallelism and ZeRO, the optimizer's norm, the step's metrics).
Each call is booked under its op (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``send``, ``broadcast``),
the plan group it runs on (named from :class:`~runtime.parallel.mesh.ParallelGroups`), its dtype, with the
bytes as the cost model counts them (cost_models/comm.py: all-gather output, reduce-scatter input, all-reduce
buffer, bytes sent). Receives mirror sends and are not booked; calls on one-rank groups move nothing and are
not booked either. ``cost_models.ledger.priced_ledger`` is what the cost model priced for the same plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from runtime.parallel.mappings import ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE
from runtime.parallel.mesh import ParallelGroups

# group attribute of ParallelGroups -> ledger name; the first match names a group object used for several
_GROUP_NAMES = (("tp_group", "tp"), ("cp_group", "cp"), ("dpcp_group", "dp"), ("dp_group", "dp"),
                ("act_group", "pp"), ("grad_group", "pp"), ("pp_group", "pp"), ("embed_group", "embed"),
                ("mp_group", "mp"), ("world", "world"))


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
    names: dict[int, str] = {}
    for attr, name in _GROUP_NAMES:
        g = getattr(groups, attr)
        if g is not None:
            names.setdefault(id(g), name)
    ledger = Ledger()

    def group_of(kw: dict[str, Any], default: Any = None) -> tuple[str, int]:
        g = kw.get("group", default)
        g = groups.world if g is None else g
        return names.get(id(g), "other"), dist.get_world_size(g)

    def booked(fn: Any, op: str, which: int, out_bytes: Any = None) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            name, size = group_of(kw)
            if size > 1:
                t = a[which] if len(a) > which else kw.get("tensor")
                ledger.book(op, name, t, out_bytes(a) if out_bytes else _bytes(t))
            return fn(*a, **kw)
        return call

    def batch(ops: list[Any]) -> Any:
        for p in ops:
            if p.op in (dist.isend, real["isend"], dist.send, real["send"]):
                ledger.book("send", names.get(id(p.group), "other"), p.tensor, _bytes(p.tensor))
        return real["batch_isend_irecv"](ops)

    real = {n: getattr(dist, n) for n in ("all_reduce", "all_gather", ALL_GATHER_SINGLE, REDUCE_SCATTER_SINGLE,
                                          "isend", "send", "broadcast", "batch_isend_irecv")}
    wrapped = {
        "all_reduce": booked(real["all_reduce"], "all_reduce", 0),
        "all_gather": booked(real["all_gather"], "all_gather", 1, lambda a: _bytes(a[1]) * len(a[0])),
        ALL_GATHER_SINGLE: booked(real[ALL_GATHER_SINGLE], "all_gather", 0),
        REDUCE_SCATTER_SINGLE: booked(real[REDUCE_SCATTER_SINGLE], "reduce_scatter", 1),
        "isend": booked(real["isend"], "send", 0),
        "send": booked(real["send"], "send", 0),
        "broadcast": booked(real["broadcast"], "broadcast", 0),
        "batch_isend_irecv": batch,
    }
    for n, fn in wrapped.items():
        setattr(dist, n, fn)
    try:
        yield ledger
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
